"""Stable LatentMoE layer: dispatch against a dense per-token reference, the moe options, parameter
counts, statistics and the interface the model stack uses."""
import math

import pytest
import torch
import torch.nn.functional as F

from k3lab.config import BalanceConfig, GLUConfig, MoEConfig
from k3lab.model.ffn import glu_combine
from k3lab.model.moe import MoE
from k3lab.model.router import expert_load, max_violation
from k3lab.model.tags import named_tags


def build(name="latent_norm", d=32, n=4, k=2, hidden=16, alpha=2, glu="situ", balance="qb", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = MoEConfig(name=name, n_experts=n, top_k=k, expert_hidden=hidden, latent_ratio=alpha, **kw)
    return MoE(d, cfg, GLUConfig(name=glu), BalanceConfig(name=balance))


def grouped_mm_on_cpu() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, mixed by the dense gate matrix G [m, n] (p_ij on the chosen k, else 0)."""
    B, T, D = x.shape
    xf = x.reshape(-1, D)
    routing = moe.router(xf)
    G = torch.zeros(xf.shape[0], moe.n_experts, dtype=routing.weight.dtype).scatter(1, routing.idx, routing.weight)
    h = moe.down(xf) if moe.latent else xf
    e = moe.experts
    gate = torch.einsum("mw,nhw->nmh", h, e.w1)
    up = torch.einsum("mw,nhw->nmh", h, e.w2)
    out = torch.einsum("nmh,nwh->nmw", glu_combine(gate, up, e.glu), e.w3)   # [n, m, w]
    r = torch.einsum("mn,nmw->mw", G.to(out.dtype), out)
    if moe.norm is not None:
        r = moe.norm(r)
    y = moe.up(r) if moe.latent else r
    if moe.shared is not None:
        y = y + moe.shared(xf)
    return y.reshape(B, T, D)


def grads(moe, x, out):
    moe.zero_grad()
    x.grad = None
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape).to(out.dtype)).sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]


@pytest.mark.parametrize("name", ["latent_norm", "latent", "standard"])
@pytest.mark.parametrize("glu", ["situ", "swiglu"])
def test_loop_dispatch_equals_dense_reference(name, glu):
    moe = build(name, glu=glu).double()
    moe.dispatch = "loop"
    x = torch.randn(3, 11, 32, dtype=torch.float64, requires_grad=True)
    y, ref = moe(x), dense_reference(moe, x)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads(moe, x, y), grads(moe, x, dense_reference(moe, x))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not grouped_mm_on_cpu(), reason="torch._grouped_mm has no CPU path in this torch")
@pytest.mark.parametrize("name,n,k", [("latent_norm", 16, 4), ("standard", 8, 2), ("latent", 256, 8)])
def test_grouped_dispatch_equals_dense_reference(name, n, k):
    """The grouped-matmul path (the GPU path, here through torch's CPU fallback in fp32), including
    experts that get no token (256 experts, 40 tokens)."""
    moe = build(name, d=64, n=n, k=k, alpha=4, scale_with_latent=False)
    moe.dispatch = "grouped"
    x = torch.randn(2, 20, 64, requires_grad=True)
    y, ref = moe(x), dense_reference(moe, x)
    if n == 256:
        assert (expert_load(moe.router(x.reshape(-1, 64)).idx, n) == 0).any()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads(moe, x, y), grads(moe, x, dense_reference(moe, x))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,n,k,tokens", [("latent_norm", 64, 8, 16), ("standard", 8, 2, 256)])
def test_cuda_grouped_dispatch_in_bf16_matches_the_per_expert_loop(name, n, k, tokens, monkeypatch):
    """The GPU path: bf16 experts through torch._grouped_mm (its calls counted, so a fallback cannot
    pass), with 64 experts top-8 on 16 tokens some experts get none; against the per-expert loop on the
    same bf16 model and routing, outputs and every gradient within bf16 rounding. (The loop equals the
    float64 dense reference: test_loop_dispatch_equals_dense_reference.)"""
    from k3lab.model import moe as moe_module

    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    moe = build(name, d=256, n=n, k=k, hidden=64, alpha=4, scale_with_latent=False).cuda().bfloat16()
    x = torch.randn(1, tokens, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    x = x.bfloat16().requires_grad_()
    assert moe_module.grouped_mm_usable(x, moe.experts.width, moe.experts.hidden)
    if n == 64:
        assert (expert_load(moe.router(x.detach().reshape(-1, 256)).idx, n) == 0).any()
    results = {}
    for dispatch in ("grouped", "loop"):
        moe.dispatch = dispatch
        calls.clear()
        out = moe(x)
        results[dispatch] = [out.detach()] + grads(moe, x, out)
        assert len(calls) == (3 if dispatch == "grouped" else 0)
    for a, b in zip(results["grouped"], results["loop"]):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2 * b.abs().max().item() + 1e-6)


@pytest.mark.parametrize("name", ["latent_norm", "standard"])
def test_checkpoint_experts_reruns_them_in_the_backward_with_the_same_results(name, monkeypatch):
    """kernels.checkpoint_experts: the routed experts run twice per step (forward, then in the backward),
    the autograd graph keeps fewer bytes, and the output and every gradient are bitwise the same."""
    from k3lab.model import moe as moe_module

    calls = []
    real = moe_module.GroupedExperts.forward
    monkeypatch.setattr(moe_module.GroupedExperts, "forward", lambda self, *a: calls.append(1) or real(self, *a))

    def step(checkpoint_experts):
        moe = build(name, d=64, n=8, k=4, hidden=96)
        moe.checkpoint_experts = checkpoint_experts
        x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        kept = {}  # storage -> bytes of what the graph keeps, parameters left out

        def pack(t):
            if not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in moe.parameters()):
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        calls.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = moe(x)
        forward_calls = len(calls)
        return [out.detach()] + grads(moe, x, out), sum(kept.values()), forward_calls, len(calls)

    plain, plain_bytes, plain_fwd, plain_all = step(False)
    ckpt, ckpt_bytes, ckpt_fwd, ckpt_all = step(True)
    assert (plain_fwd, plain_all, ckpt_fwd, ckpt_all) == (1, 1, 1, 2)
    assert ckpt_bytes < 0.75 * plain_bytes, (ckpt_bytes, plain_bytes)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_checkpoint_experts_reaches_every_moe_layer_from_the_config():
    from k3lab.config import KernelsConfig, ModelConfig
    from k3lab.model import K3Model

    for on in (False, True):
        model = K3Model(ModelConfig(n_layers=2, vocab_size=64, kernels=KernelsConfig(checkpoint_experts=on)))
        flags = [m.checkpoint_experts for m in model.modules() if isinstance(m, MoE)]
        assert flags and all(f is on for f in flags)


@pytest.mark.parametrize("keep,first_dense,want", [(0, 0, [True] * 5), (2, 0, [True] * 3 + [False] * 2),
                                                   (2, 1, [True] * 2 + [False] * 2), (5, 0, [False] * 5)])
def test_keep_experts_leaves_the_last_moe_layers_unchecked(keep, first_dense, want):
    """kernels.keep_experts=N: with checkpoint_experts, the MoE layers among the last N keep their experts'
    activations (not checkpointed); the others still checkpoint. first_dense layers have no MoE."""
    from k3lab.config import KernelsConfig, ModelConfig, MoEConfig
    from k3lab.model import K3Model

    cfg = ModelConfig(n_layers=5, vocab_size=64, moe=MoEConfig(first_dense=first_dense),
                      kernels=KernelsConfig(checkpoint_experts=True, keep_experts=keep))
    model = K3Model(cfg)
    assert [m.checkpoint_experts for m in model.modules() if isinstance(m, MoE)] == want


@pytest.mark.parametrize("kernels,message", [
    (dict(checkpoint_experts=True, keep_experts=-1), "kernels.keep_experts=-1 must be >= 0"),
    (dict(keep_experts=2), "kernels.keep_experts acts with kernels.checkpoint_experts=true only")])
def test_keep_experts_refuses_what_it_cannot_do(kernels, message):
    from k3lab.config import KernelsConfig, RunConfig
    from k3lab.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        RunConfig(kernels=KernelsConfig(**kernels)).check()


def test_256_experts_loop_dispatch():
    moe = build("latent_norm", d=64, n=64, k=2, alpha=4)     # scaled: 256 experts, top-8
    assert (moe.n_experts, moe.top_k, moe.width) == (256, 8, 16)
    moe.dispatch = "loop"
    x = torch.randn(1, 48, 64)
    torch.testing.assert_close(moe(x), dense_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_autocast_bf16_runs_experts_in_bf16():
    moe = build("latent_norm", d=64, n=8, k=2, hidden=32)
    x = torch.randn(2, 16, 64)
    y32 = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = moe(x)
    assert (y16.float() - y32).abs().max() < 0.05 * y32.abs().max()


def test_latent_norm_differs_from_latent_only_by_the_norm():
    a, b = build("latent_norm"), build("latent")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert set(pa) - set(pb) == {"norm.weight"} and set(pb) <= set(pa)
    for name in pb:
        assert torch.equal(pa[name], pb[name]), name
    x = torch.randn(2, 9, 32)
    assert not torch.allclose(a(x), b(x), atol=1e-4)
    a.norm = torch.nn.Identity()          # remove the norm's effect: identical layers
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    # and latent_norm's routed branch is W_up RMSNorm(latent's aggregated expert output)
    c = build("latent_norm")
    with torch.no_grad():
        c.norm.weight.uniform_(0.5, 1.5)
    xf = x.reshape(-1, 32)
    routing = c.router(xf)
    captured = {}
    b.up.register_forward_hook(lambda mod, inp, out: captured.setdefault("r", inp[0]))
    b.routed(xf, routing)
    r = F.rms_norm(captured["r"], (c.width,), c.norm.weight, c.norm.eps)
    torch.testing.assert_close(c.routed(xf, routing), c.up(r))


def test_latent_scaling_and_parameter_counts():
    D, h, n, k, alpha = 64, 24, 4, 2, 4
    std = build("standard", d=D, n=n, k=k, hidden=h, n_shared=1)
    lat = build("latent_norm", d=D, n=n, k=k, hidden=h, alpha=alpha, n_shared=1)
    noscale = build("latent", d=D, n=n, k=k, hidden=h, alpha=alpha, n_shared=0, scale_with_latent=False)
    assert (std.n_experts, std.top_k, std.width) == (4, 2, 64)
    assert (lat.n_experts, lat.top_k, lat.width) == (16, 8, 16)
    assert (noscale.n_experts, noscale.top_k, noscale.width) == (4, 2, 16)
    shared, routed_std = 3 * D * h, n * 3 * D * h
    assert std.n_params_total() == routed_std + n * D + shared
    assert std.n_params_active() == k * 3 * D * h + n * D + shared
    w = D // alpha
    routed_lat = alpha * n * 3 * w * h
    assert routed_lat == routed_std                     # LatentMoE "acc": same routed parameters
    assert lat.n_params_total() == routed_lat + alpha * n * D + shared + 2 * D * w + w
    assert lat.n_params_active() == alpha * k * 3 * w * h + alpha * n * D + shared + 2 * D * w + w
    assert noscale.n_params_active() == k * 3 * w * h + n * D + 2 * D * w


def test_weight_layout_and_attributes():
    moe = build("latent_norm", n=4, k=2, hidden=16, alpha=2)
    n, w, h = moe.n_experts, moe.width, moe.hidden
    e = moe.experts
    assert e.w1.shape == e.w2.shape == (n, h, w) and e.w3.shape == (n, w, h)
    tags = named_tags(moe)
    assert {n for n, t in tags.items() if t.get("output_proj")} == {"experts.w3", "up.weight", "shared.w3.weight"}
    assert moe.router.weight.shape == (n, 32)
    names = {name for name, _ in moe.named_parameters()}
    assert "router.bias" not in names and "router.bias" in moe.state_dict()
    assert not any(k.startswith("_") for k in moe.state_dict())   # statistics are not checkpointed
    e.reset_parameters(0.02, out_scale=0.5)
    assert abs(float(e.w3.detach().std()) - 0.01) < 0.003 and abs(float(e.w1.detach().std()) - 0.02) < 0.005


def test_dense_option_and_bad_name_raise():
    with pytest.raises(ValueError, match="dense"):
        MoE(32, MoEConfig(name="dense"), GLUConfig(), BalanceConfig())
    with pytest.raises(ValueError, match="valid options"):
        MoE(32, MoEConfig(name="latentnorm"), GLUConfig(), BalanceConfig())


def test_stats_and_eval_mode():
    moe = build("latent_norm", d=32, n=8, k=2, alpha=2)      # 16 experts, top-4
    x = torch.randn(2, 30, 32)
    moe(x[:1]); moe(x[1:])
    idx = moe.router(x.reshape(-1, 32)).idx
    load = expert_load(idx, moe.n_experts)
    st = moe.stats()
    assert set(st) == {"maxvio", "dead_frac", "router_entropy", "bias_norm"}
    assert math.isclose(st["maxvio"], max_violation(load), rel_tol=1e-9)
    assert math.isclose(st["dead_frac"], float((load == 0).float().mean()), rel_tol=1e-9)
    assert 0 < st["router_entropy"] <= math.log(moe.n_experts) and st["bias_norm"] == 0.0
    moe.update_bias()
    after = moe.stats()                                    # the step just closed, with the new bias norm
    assert math.isclose(after["maxvio"], st["maxvio"]) and after["bias_norm"] > 0
    bias = moe.router.bias.clone()
    moe.eval()
    moe(x)                                                 # eval forwards gather nothing
    moe.update_bias()
    assert torch.equal(moe.router.bias, bias)
    moe.train()
    y = moe(x)
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_default_expert_hidden_splits_the_dense_ffn():
    moe = MoE(128, MoEConfig(name="latent_norm", n_experts=8, top_k=2), GLUConfig(), BalanceConfig())
    assert moe.hidden == 176                               # ffn_hidden 352 (2.75 * 128) / top_k 2
    assert MoE(128, MoEConfig(name="standard", top_k=2), GLUConfig(), BalanceConfig(), ffn_hidden=256).hidden == 128
