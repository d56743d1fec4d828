"""The training step on CUDA reads nothing back to the host (k3lab/lit.py's contract): a sync stalls the
host until the device drains its queue, and the device then idles while the host launches the next work."""
import pytest
import torch

from k3lab.config import ModelConfig, OptimConfig
from k3lab.lit import clip_grad_norm
from k3lab.model import K3Model
from k3lab.optim import build_optimizer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("balance", ["qb", "sign"])
def test_k3_default_training_step_never_syncs_the_host(balance):
    """The K3 default (Triton KDA, grouped MoE dispatch, exact Quantile Balancing or the sign update, block
    AttnRes, per-head Muon with the fused AdamW) in bf16, one step as K3LitModule takes it: forward with the
    loss, backward, gradient clipping, optimizer and scheduler step, router-bias update. After a first step
    (Triton compiles and tunes its kernels), the second runs under CUDA's sync debug mode set to error, which
    raises at any operation that waits for the device."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=4, d_model=256, head_dim=64, vocab_size=512)
    cfg.balance.name = balance
    model = K3Model(cfg).cuda().to(torch.bfloat16)
    opt, sched = build_optimizer(model, OptimConfig(), total_steps=10)
    gen = torch.Generator("cuda").manual_seed(1)
    tokens, targets = (torch.randint(0, 512, (2, 256), device="cuda", generator=gen) for _ in range(2))

    def step():
        (model(tokens, targets).mean + model.aux_loss()).backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_biases()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p).all() for p in model.parameters())
