"""The model's KDA layer (k3lab/model/kda.py) on the Triton backend, on the CPU under TRITON_INTERPRET=1.

The layer makes one call, ``kernels.kda.kda_gated``: on the triton backend the fused entry whose kernels
apply the q/k L2 norm, the decay map and beta's sigmoid; on the torch backend the same math in PyTorch.
The checks run in one fresh subprocess (this file run as a script; Triton reads TRITON_INTERPRET when first
imported) and the tests assert on what it reports.
"""
import json

import pytest

from interpreted import run_interpreted

LIMIT = 1e-4
# (B, T, d_model, head_dim): 4 heads of 16, T = 70 spans a full and a ragged chunk
SHAPE = (2, 70, 64, 16)
VARIANTS = {"plain": dict(), "checkpoint_recompute": dict(checkpoint_kda=True, recompute_states=True)}


def layer_results(decay: str, backend: str, **kernels) -> dict:
    """Output, input gradient and every parameter gradient of one KDA layer (fp32, fixed weights and
    input, a fixed random cotangent). The decay parameters are set off their init so that every gradient
    is exercised: sigmoid A_h ~ N(0, 0.5^2), dt_bias ~ U(-3, 1); softplus A_h = log of 1..16 over the
    heads, dt_bias ~ U(-5, -1) (fast decays, chunks past the tensor-core range)."""
    import torch

    from k3lab.config import DecayConfig, KernelsConfig, ModelConfig
    from k3lab.model.kda import KDA

    B, T, D, K = SHAPE
    cfg = ModelConfig(n_layers=4, d_model=D, head_dim=K, decay=DecayConfig(name=decay),
                      kernels=KernelsConfig(backend=backend, **kernels))
    torch.manual_seed(0)
    layer = KDA(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        H = layer.n_heads
        if decay == "sigmoid":
            layer.A_log.copy_(0.5 * torch.randn(H, generator=gen))
            layer.dt_bias.copy_(4 * torch.rand(H * K, generator=gen) - 3)
        else:
            layer.A_log.copy_(torch.log(torch.linspace(1, 16, H)))
            layer.dt_bias.copy_(4 * torch.rand(H * K, generator=gen) - 5)
    x = torch.randn(B, T, D, generator=gen).requires_grad_()
    y = layer(x)
    (y * torch.randn(y.shape, generator=gen)).sum().backward()
    return dict(y=y.detach(), x=x.grad, **{n: p.grad for n, p in layer.named_parameters()})


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run_checks() -> dict:
    out = {}
    for decay in ("sigmoid", "softplus"):
        ref = layer_results(decay, "torch")
        for variant, kernels in VARIANTS.items():
            got = layer_results(decay, "triton", **kernels)
            out[f"layer_{decay}_{variant}"] = {n: rel(got[n], ref[n]) for n in ref}
    return out


@pytest.fixture(scope="module")
def results():
    return run_interpreted(__file__)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("decay", ["sigmoid", "softplus"])
def test_layer_triton_matches_torch(results, decay, variant):
    """backend=triton against backend=torch, fp32: the output, the input's gradient and the gradient of
    every parameter (q/k/v projections and convs, f_down, f_up, b_proj, g_proj, o_norm, o_proj, A_log,
    dt_bias) within 1e-4 relative; also with kernels.checkpoint_kda and kernels.recompute_states on."""
    errs = results[f"layer_{decay}_{variant}"]
    assert {"y", "x", "A_log", "dt_bias", "f_up.weight", "b_proj.weight"} <= set(errs)
    bad = {n: e for n, e in errs.items() if not e < LIMIT}
    assert not bad, bad


if __name__ == "__main__":
    print(json.dumps(_run_checks()))
