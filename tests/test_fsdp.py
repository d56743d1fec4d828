"""FSDP2 on 2 CPU processes (gloo): k3lab.parallel.shard_model keeps the parameter tags, reduces the
same gradients as one process over the pooled batch, pools the QB quantile over both ranks, and Muon on
the DTensor shards makes the one-device update bit for bit (Newton-Schulz on whole matrices, head blocks
and experts, batched over same-shaped parameters), which Newton-Schulz on the local shards would not."""
import copy
import socket
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from k3lab.config import OptimConfig, run_config
from k3lab.lit import clip_grad_norm
from k3lab.model import K3Model
from k3lab.model.tags import named_tags
from k3lab.optim import Muon, orthogonal_update, param_groups
from k3lab.optim import muon as muon_module

from test_train import ROOT

WORLD, B, T, V = 2, 4, 16, 97


def tiny_model() -> tuple[K3Model, OptimConfig]:
    """The K3 default at 4 layers (KDA and MLA with per-head tags, LatentMoE with QB), seeded. 3 heads of 16
    rows in a [48, 48] projection: each rank's 24 rows cut a head in two, so per-head Newton-Schulz must
    gather."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model.n_layers=4", "model.d_model=48", "model.head_dim=16"])
    torch.manual_seed(0)
    model = K3Model(run_config(cfg).model_config(V))
    with torch.no_grad():  # a skewed router, so the QB bias has work to do
        for moe in model.moe_layers():
            moe.router.weight.mul_(20)
    return model, run_config(cfg).optim


def draw(p: torch.Tensor, name: str, step: int) -> torch.Tensor:
    """A gradient for parameter `name` at `step`, the same on every rank."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{step}".encode()))
    return torch.randn(p.shape, generator=gen)


def shard_like(full: torch.Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(full, like.device_mesh, [Replicate()], run_check=False).redistribute(
        like.device_mesh, like.placements)


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from k3lab.parallel import shard_model

        model, optim_cfg = tiny_model()
        ref = copy.deepcopy(model)
        tags = {name: dict(t) for name, t in named_tags(model).items()}  # the init tags' functions are kept
        shard_model(model, init_device_mesh("cpu", (WORLD,)), bf16=False)

        # 1. every parameter is a dim-0 shard; tags and optimizer groups are those of the plain model
        for name, p in model.named_parameters():
            rows = torch.arange(p.shape[0]).chunk(WORLD)
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
            assert p.to_local().shape == (len(rows[rank]) if rank < len(rows) else 0, *p.shape[1:]), name
        assert named_tags(model) == tags and tags["sublayers.0.fn.q_proj.weight"]["head_blocks"] == 3
        sharded_groups, ref_groups = param_groups(model, optim_cfg), param_groups(ref, optim_cfg)
        names = {id(p): n for n, p in model.named_parameters()}
        ref_names = {id(p): n for n, p in ref.named_parameters()}
        for g, r in zip(sharded_groups, ref_groups, strict=True):
            assert [names[id(p)] for p in g["params"]] == [ref_names[id(p)] for p in r["params"]], g["name"]
            assert g.get("head_blocks") == r.get("head_blocks")

        # 2. forward/backward on this rank's half of the batch == one process on the whole batch
        tokens = torch.randint(V, (B * WORLD, T + 1), generator=torch.Generator().manual_seed(1))
        x, y = tokens[:, :-1], tokens[:, 1:]

        def loss(m, xs, ys):
            return F.cross_entropy(m(xs).flatten(0, 1), ys.flatten())

        loss(model, x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]).backward()
        loss(ref, x, y).backward()
        grad_diff = max((p.grad.full_tensor() - q.grad).abs().max().item()
                        for p, q in zip(model.parameters(), ref.parameters(), strict=True))
        assert grad_diff < 1e-6, grad_diff
        norm, ref_norm = clip_grad_norm(model.parameters(), 1.0), clip_grad_norm(ref.parameters(), 1.0)
        assert abs(norm - ref_norm) < 1e-5 * ref_norm, (norm, ref_norm)
        model.update_router_biases()
        ref.update_router_biases()
        bias_diff = max((a.router.bias - b.router.bias).abs().max().item()
                        for a, b in zip(model.moe_layers(), ref.moe_layers(), strict=True))
        assert bias_diff < 1e-5 and all(b.router.bias.abs().sum() > 0 for b in ref.moe_layers()), bias_diff

        # 3. Muon (per-head, bf16 Newton-Schulz) + AdamW on shards, given the same gradients: bit for bit
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                p.copy_(shard_like(q.detach().clone(), p))
        opt, ref_opt = Muon(sharded_groups), Muon(ref_groups)
        calls = []
        factors = muon_module.newton_schulz_factors
        muon_module.newton_schulz_factors = lambda x, *args, **kw: calls.append(len(x)) or factors(x, *args, **kw)
        for step in range(2):  # the second step reads the momentum and Adam moments kept on the shards
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                q.grad = draw(q, name, step)
                p.grad = shard_like(q.grad.clone(), p)
            calls.clear()
            opt.step()
            sharded_calls = list(calls)
            calls.clear()
            ref_opt.step()
        muon_module.newton_schulz_factors = factors
        # the shards' Newton-Schulz is batched: one call per shape of whole parameter, not one per
        # parameter, over the same matrices as one device's buckets
        muon_params = [(p, h) for g in sharded_groups if g["use_muon"] for p, h in zip(g["params"], g["head_blocks"])]
        shapes = {(tuple(p.shape), h) for p, h in muon_params}
        assert len(sharded_calls) == len(shapes) < len(muon_params), (sharded_calls, len(muon_params))
        assert sum(sharded_calls) == sum(calls), (sharded_calls, calls)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q.detach()), name

        # the control: Newton-Schulz of this rank's rows alone is another update (what the test rules out)
        w1 = dict(model.named_parameters())["sublayers.1.fn.w1.weight"]
        u = shard_like(draw(w1, "u", 0), w1)
        whole = shard_like(orthogonal_update(u.full_tensor(), None, 5), w1).to_local()
        assert (whole - orthogonal_update(u.to_local(), None, 5)).norm() > 0.1 * whole.norm()
        if rank == 0:
            print(f"max |grad - one process| {grad_diff:.2e}, |grad norm diff| {abs(norm - ref_norm):.2e}, "
                  f"max |QB bias diff| {bias_diff:.2e}")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_model_tags_gradients_qb_and_muon_match_one_device():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
