"""Balancing under data parallelism: 2 CPU processes (gloo) must end with the same router bias on both
ranks, equal to one process's bias over the pooled batch (K3: the quantile is of the global batch)."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3lab.config import BalanceConfig, GLUConfig, MoEConfig
from k3lab.model.moe import MoE

from test_fsdp import free_port

BALANCES = [("qb", dict(hist_bins=0)), ("qb", dict(hist_bins=512)), ("sign", dict(gamma=0.01))]
SPLIT = (3, 2)   # sequences per rank: unequal on purpose (the exact quantile pads the gather)


def build(name: str, **kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(32, MoEConfig(name="latent_norm", n_experts=8, top_k=2, expert_hidden=16, latent_ratio=2),
              GLUConfig(), BalanceConfig(name=name, **kw))
    with torch.no_grad():   # a skewed router, so the bias has work to do
        moe.router.weight.mul_(20)
    return moe


def batch() -> torch.Tensor:
    return torch.randn(sum(SPLIT), 24, 32, generator=torch.Generator().manual_seed(1))


def pooled_biases(x: torch.Tensor) -> list[torch.Tensor]:
    """Two steps: forward on x (two micro-batches), update_bias; again with the new bias."""
    out = []
    for name, kw in BALANCES:
        moe = build(name, **kw)
        for _ in range(2):
            for micro in torch.split(x, 2):
                moe(micro)
            moe.update_bias()
        out.append(moe.router.bias.clone())
    return out


def _worker(rank: int, world: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.split(batch(), list(SPLIT))[rank]
        torch.save(pooled_biases(x), f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_bias_equals_pooled_single_process(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    single = pooled_biases(batch())
    for (name, kw), b0, b1, ref in zip(BALANCES, rank0, rank1, single):
        assert torch.equal(b0, b1), (name, kw)                       # every rank holds the same bias
        assert ref.abs().sum() > 0
        torch.testing.assert_close(b0, ref, rtol=0, atol=1e-5, msg=f"{name} {kw}")
