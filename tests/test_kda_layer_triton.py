"""The model's KDA layer (k3lab/model/kda.py) on the Triton backend, on the CPU under TRITON_INTERPRET=1.

The layer makes one call, ``kernels.kda.kda_gated``: on the triton backend the fused entry whose kernels
apply the q/k L2 norm, the decay map and beta's sigmoid; on the torch backend the same math in PyTorch.
The Triton entry is a pair of torch.library custom ops (``k3lab::kda_fwd``, ``k3lab::kda_bwd``): checked
with ``torch.library.opcheck``, and the layer under ``torch.compile(fullgraph=True)``.
The checks run in one fresh subprocess (this file run as a script; Triton reads TRITON_INTERPRET when first
imported) and the tests assert on what it reports.
"""
import json

import pytest

from interpreted import run_interpreted

LIMIT = 1e-4
# (B, T, d_model, head_dim): 4 heads of 16, T = 70 spans a full and a ragged chunk
SHAPE = (1, 70, 64, 16)
VARIANTS = {"plain": dict(), "checkpoint_recompute": dict(checkpoint_kda=True, recompute_states=True),
            "recompute_chunks": dict(recompute_chunks=True),
            "recompute_chunks_keep_intra": dict(recompute_chunks=True, keep_intra=True)}


def layer_results(decay: str, backend: str, **kernels) -> dict:
    """Output, input gradient and every parameter gradient of one KDA layer (fp32, fixed weights and
    input, a fixed random cotangent). The decay parameters are set off their init so that every gradient
    is exercised: sigmoid A_h ~ N(0, 0.5^2), dt_bias ~ U(-3, 1); softplus A_h = log of 1..16 over the
    heads, dt_bias ~ U(-5, -1) (fast decays, sub-blocks past the sigmoid map's bound)."""
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


def op_inputs(gate: str, dtype, fuse_prep: bool, initial_state: bool, seed: int = 0) -> list:
    """Small inputs of ``k3lab::kda_fwd`` (B=1, T=20, H=2, K=V=16) for a gate ("none": g is a log-decay
    <= 0 and q, k are normalised; "sigmoid"/"softplus": g is the raw z, A_log and dt_bias are given)."""
    import torch
    import torch.nn.functional as F

    from kernels.kda.triton import GATES

    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = 1, 20, 2, 16, 16
    q, k, z = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    v, bl = torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, generator=gen)
    if gate == "none":
        q, k, z, bl = F.normalize(q, dim=-1), F.normalize(k, dim=-1), -torch.rand(B, T, H, K, generator=gen), bl.sigmoid()
    A_log, dt_bias = (torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)) if gate != "none" else (None, None)
    h0 = torch.randn(B, H, K, V, generator=gen) if initial_state else None
    tensors = [x if x is None else x.to(dtype if i < 5 else torch.float32).requires_grad_()
               for i, x in enumerate((q, k, v, z, bl, A_log, dt_bias, h0))]
    return tensors + [K ** -0.5, gate == "sigmoid", GATES[gate], -5.0, fuse_prep, False, False, False]


# name: (gate, dtype, fuse_prep, initial state, (recompute_states, recompute_chunks, keep_intra)); fp16 keeps
# half-precision intermediates
OPCHECK = {"sigmoid_prep_h0": ("sigmoid", "float32", True, True, (False, False, False)),
           "softplus_prep_fp16_recompute": ("softplus", "float16", True, False, (True, False, False)),
           "none_h0_recompute_chunks": ("none", "float32", False, True, (True, True, False)),
           "softplus_prep_keep_intra": ("softplus", "float32", True, False, (False, True, True)),
           "sigmoid_prep_fp16_keep_intra": ("sigmoid", "float16", True, False, (False, True, True)),
           "none_h0": ("none", "float32", False, True, (False, False, False))}


def _run_checks() -> dict:
    import torch

    from kernels.kda.triton import kda_bwd_op, kda_fwd_op

    out = {}
    for decay in ("sigmoid", "softplus"):
        ref = layer_results(decay, "torch")
        for variant, kernels in VARIANTS.items():
            got = layer_results(decay, "triton", **kernels)
            out[f"layer_{decay}_{variant}"] = {n: rel(got[n], ref[n]) for n in ref}

    # custom ops: schema, fake tensors (shapes, dtypes, strides), autograd registration, AOT dispatch
    for name, (gate, dtype, fuse_prep, h0, recompute) in OPCHECK.items():
        args = op_inputs(gate, getattr(torch, dtype), fuse_prep, h0)
        args[-3:] = recompute
        out[f"opcheck_fwd_{name}"] = torch.library.opcheck(kda_fwd_op, args)
        detached = [x.detach() if isinstance(x, torch.Tensor) else x for x in args]
        q, k, v, g, beta, A_log, dt_bias, h, scale, safe, gate_id, g_min, _, _, _, _ = detached
        o, ht, saved = kda_fwd_op(*detached)
        gen = torch.Generator().manual_seed(2)
        do, dht = torch.randn(o.shape, generator=gen).to(o.dtype), torch.randn(ht.shape, generator=gen)
        raw = (None, None, None) if fuse_prep else (q, k, beta)
        out[f"opcheck_bwd_{name}"] = torch.library.opcheck(
            kda_bwd_op, (raw[0], raw[1], v, g, raw[2], A_log, dt_bias, h, saved, do, dht, scale, safe, gate_id, g_min,
                         fuse_prep, *recompute, q.dtype, k.dtype, beta.dtype))

    # torch.compile of the layer: one graph holding the custom ops, eager results forward and backward
    from torch._dynamo.testing import CompileCounterWithBackend

    from k3lab.config import DecayConfig, KernelsConfig, ModelConfig
    from k3lab.model.kda import KDA

    for decay in ("sigmoid", "softplus"):
        cfg = ModelConfig(n_layers=4, d_model=32, head_dim=16, decay=DecayConfig(name=decay),
                          kernels=KernelsConfig(backend="triton"))
        torch.manual_seed(0)
        layer = KDA(cfg)
        x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(3))

        def run(fn):
            layer.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_()
            y = fn(xx)
            y.square().mean().backward()
            return [y.detach(), xx.grad] + [p.grad for p in layer.parameters()]

        eager = run(layer)
        counter = CompileCounterWithBackend("aot_eager")
        compiled = run(torch.compile(layer, backend=counter, fullgraph=True))
        out[f"compile_{decay}"] = {
            "max_rel_error": max(rel(a, b) for a, b in zip(compiled, eager)),
            "frames": counter.frame_count,
            "custom_op_in_graph": all("k3lab.kda_fwd" in g.code for g in counter.graphs),
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_interpreted(__file__)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("decay", ["sigmoid", "softplus"])
def test_layer_triton_matches_torch(results, decay, variant):
    """backend=triton against backend=torch, fp32: the output, the input's gradient and the gradient of
    every parameter (q/k/v projections and convs, f_down, f_up, b_proj, g_proj, o_norm, o_proj, A_log,
    dt_bias) within 1e-4 relative; also with kernels.checkpoint_kda and kernels.recompute_states on, and with
    kernels.recompute_chunks, alone and with kernels.keep_intra."""
    errs = results[f"layer_{decay}_{variant}"]
    assert {"y", "x", "A_log", "dt_bias", "f_up.weight", "b_proj.weight"} <= set(errs)
    bad = {n: e for n, e in errs.items() if not e < LIMIT}
    assert not bad, bad


if __name__ == "__main__":
    print(json.dumps(_run_checks()))


@pytest.mark.parametrize("case", list(OPCHECK))
def test_custom_ops_pass_opcheck(results, case):
    """torch.library.opcheck of k3lab::kda_fwd (with requires_grad inputs) and of k3lab::kda_bwd: schema,
    fake tensors against the real results (shapes, dtypes and strides of every output, the kept
    intermediates included), the autograd registration and AOT dispatch with dynamic shapes."""
    for op in ("fwd", "bwd"):
        checks = results[f"opcheck_{op}_{case}"]
        assert set(checks) >= {"test_schema", "test_faketensor", "test_aot_dispatch_dynamic"}, checks
        assert set(checks.values()) == {"SUCCESS"}, (op, checks)


@pytest.mark.parametrize("decay", ["sigmoid", "softplus"])
def test_layer_compiles_fullgraph(results, decay):
    """torch.compile(layer, backend="aot_eager", fullgraph=True) with backend=triton: one frame, the custom
    op in its graph, output, input gradient and parameter gradients those of eager (within 1e-6)."""
    c = results[f"compile_{decay}"]
    assert c["frames"] == 1 and c["custom_op_in_graph"], c
    assert c["max_rel_error"] < 1e-6, c
