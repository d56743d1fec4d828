"""Plain-PyTorch KDA: the chunkwise form (kernels/kda/chunk_torch.py) against the token-by-token
reference (kernels/kda/recurrent.py), Kimi Linear arXiv:2510.26692 eq. (1)."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from kernels.kda import BACKENDS, kda, kda_chunk_torch, kda_recurrent
from kernels.kda.chunk_torch import CHUNK, DecayFactors


def make_gate(kind: str, B: int, T: int, H: int, K: int, gen: torch.Generator, dtype=torch.float64):
    """Per-channel log-decay g [B, T, H, K] from one of the model's decay maps.

    mild: the softplus map near its initialisation, g ~ -0.2 (the whole-chunk matmul path).
    moderate: the sigmoid map g = -5 * sigmoid(exp(A_h) z) with z ~ N(0, 1), A_h = 0.
    sigmoid_sat: the sigmoid map with saturated z = +-20 (g = -5 or ~ -1e-8).
    softplus_sat: g = -exp(A_h) softplus(z + dt_bias), z = +-20, A_h = log U(1, 16): g down to ~ -320
    and up to ~ -1e-8.
    """
    if kind == "mild":
        return -0.2 * torch.rand(B, T, H, K, generator=gen, dtype=dtype)
    if kind == "moderate":
        z = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
        return -5.0 * torch.sigmoid(z)
    sign = torch.randint(0, 2, (B, T, H, K), generator=gen).to(dtype) * 2 - 1
    z = 20.0 * sign
    if kind == "sigmoid_sat":
        return -5.0 * torch.sigmoid(z)
    if kind == "softplus_sat":
        A = torch.log(1 + 15 * torch.rand(H, 1, generator=gen, dtype=dtype))
        dt_bias = torch.empty(H, K, dtype=dtype).uniform_(-6.9, -2.3, generator=gen)
        return -A.exp() * F.softplus(z + dt_bias)
    raise ValueError(kind)


def make_inputs(B, T, H, K, V, gate="moderate", seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = make_gate(gate, B, T, H, K, gen, dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, h0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def outputs_and_grads(fn, inputs, seed=1):
    """Run fn, backprop fixed random cotangents of o and the final state, return all results."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = leaves
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.dtype)
    ((o * do).sum() + (ht * dht).sum()).backward()
    return [o.detach(), ht.detach()] + [x.grad for x in leaves]


NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


@pytest.mark.parametrize(
    "T,K,V,gate",
    [
        (1, 32, 32, "moderate"),
        (100, 32, 16, "moderate"),
        (100, 32, 16, "mild"),
        (130, 64, 64, "moderate"),
        (70, 64, 32, "softplus_sat"),
        (70, 32, 32, "sigmoid_sat"),
        (130, 32, 32, "softplus_sat"),
    ],
)
def test_chunk_matches_recurrent_float64(T, K, V, gate):
    """Outputs, final state and gradients of q, k, v, g, beta and the initial state agree to 1e-6."""
    inputs = make_inputs(1, T, 1, K, V, gate)
    ref = outputs_and_grads(kda_recurrent, inputs)
    got = outputs_and_grads(kda_chunk_torch, inputs)
    for name, a, b in zip(NAMES, got, ref):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < 1e-6, (name, rel(a, b))


def test_all_three_decay_paths_are_exercised():
    """Mild gates take the whole-chunk matmul, moderate gates the split-at-the-sub-block-middle path,
    saturated softplus gates the pairwise one; the float64 test above therefore checks all three."""
    for gate, path in [("mild", "whole"), ("moderate", "mid"), ("softplus_sat", "pair")]:
        g = make_inputs(1, CHUNK, 1, 32, 32, gate)[3]
        f = DecayFactors(g.transpose(1, 2).reshape(1, 1, 1, CHUNK, 32).cumsum(-2))
        taken = "whole" if f.whole_row is not None else ("pair" if f.pair is not None else "mid")
        assert taken == path, gate


def test_float32_saturated_gates_stay_finite_and_accurate():
    """In float32 a softplus gate at -320 per token must neither overflow nor lose accuracy."""
    inputs = make_inputs(1, 100, 2, 64, 32, "softplus_sat", seed=3)
    ref = outputs_and_grads(kda_recurrent, inputs)
    got = outputs_and_grads(kda_chunk_torch, [x.float() for x in inputs])
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel(a.double(), b) < 1e-4, (name, rel(a.double(), b))


@pytest.mark.parametrize("gate", ["mild", "moderate", "softplus_sat"])
def test_runs_under_bf16_autocast(gate):
    """Float32 inputs under bf16 autocast (the model's mixed-precision training) on every decay path:
    matmuls return bf16 there, and the path must combine them with its float32 pieces (it once failed
    with a dtype mismatch on the sub-block path) and stay within bf16 error of the reference."""
    inputs = make_inputs(1, 130, 2, 32, 32, gate, seed=14)
    ref, _ = kda_recurrent(*inputs[:5], initial_state=inputs[5])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = kda_chunk_torch(*[x.float() for x in inputs[:5]], initial_state=inputs[5].float())
    assert torch.isfinite(o).all()
    assert rel(o.double(), ref) < 3e-2


@pytest.mark.parametrize("P", [37, 64, 100])
def test_causality(P):
    """Changing every input at positions t >= P leaves the outputs before P unchanged."""
    q, k, v, g, beta, h0 = make_inputs(1, 130, 2, 32, 32, "moderate", seed=4)
    o1, _ = kda_chunk_torch(q, k, v, g, beta, initial_state=h0)
    q2, k2, v2, g2, beta2, _ = make_inputs(1, 130, 2, 32, 32, "moderate", seed=5)
    mixed = [torch.cat([a[:, :P], b[:, P:]], dim=1) for a, b in zip((q, k, v, g, beta), (q2, k2, v2, g2, beta2))]
    o2, _ = kda_chunk_torch(*mixed, initial_state=h0)
    assert torch.allclose(o1[:, :P], o2[:, :P], rtol=0, atol=1e-12)
    assert (o1[:, P:] - o2[:, P:]).abs().max() > 1e-3


def test_entry_point_dispatch_and_dtypes():
    """kda() on CPU tensors runs the torch path; bf16 in gives bf16 out and a float32 state."""
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 32, 32, "moderate", seed=6)
    o_auto, s_auto = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_torch, s_torch = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert torch.equal(o_auto, o_torch) and torch.equal(s_auto, s_torch)
    o_ref, _ = kda_recurrent(q, k, v, g, beta, scale=0.3, initial_state=h0)
    o_s, none = kda(q, k, v, g, beta, scale=0.3, initial_state=h0)
    assert none is None and rel(o_s, o_ref) < 1e-10
    bf = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    o_bf, s_bf = kda(*bf, output_final_state=True)
    assert o_bf.dtype == torch.bfloat16 and s_bf.dtype == torch.float32
    o_ref, _ = kda_recurrent(*[x.double() for x in bf])
    assert rel(o_bf.double(), o_ref) < 2e-2


def test_unknown_backend_lists_valid_names():
    x = make_inputs(1, 4, 1, 16, 16)
    with pytest.raises(ValueError) as err:
        kda(*x[:5], backend="cuda")
    for name in BACKENDS:
        assert name in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla-core is installed")
def test_fla_backend_names_the_missing_package():
    x = make_inputs(1, 4, 1, 16, 16)
    with pytest.raises(ImportError, match="fla-core"):
        kda(*x[:5], backend="fla")


def test_model_layer_passes_kernel_options(monkeypatch):
    """kernels.backend, kernels.recompute_states and kernels.recompute_chunks reach kernels.kda.kda from the
    model's KDA layer."""
    from k3lab.config import KernelsConfig, ModelConfig
    from k3lab.model import kda as kda_layer

    seen = {}
    real = kda_layer.kda

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(kda_layer, "kda", spy)
    cfg = ModelConfig(n_layers=4, d_model=128, head_dim=64,
                      kernels=KernelsConfig(backend="torch", recompute_states=True, recompute_chunks=True))
    kda_layer.KDA(cfg)(torch.randn(1, 10, 128))
    assert (seen["backend"], seen["recompute_states"], seen["recompute_chunks"]) == ("torch", True, True)


def test_checkpoint_kda_reruns_the_call_in_the_backward_with_the_same_results(monkeypatch):
    """kernels.checkpoint_kda: the KDA call runs again in the backward (twice per step, not once), the
    autograd graph keeps fewer bytes, and the output and every parameter gradient are bitwise the same."""
    from k3lab.config import KernelsConfig, ModelConfig
    from k3lab.model import kda as kda_layer

    calls = []
    real = kda_layer.kda
    monkeypatch.setattr(kda_layer, "kda", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def step(checkpoint_kda):
        cfg = ModelConfig(n_layers=4, d_model=128, head_dim=64,
                          kernels=KernelsConfig(backend="torch", checkpoint_kda=checkpoint_kda))
        torch.manual_seed(0)
        layer = kda_layer.KDA(cfg)
        x = torch.randn(2, 100, 128, generator=torch.Generator().manual_seed(1))
        kept = {}  # storage -> bytes, of every tensor the graph keeps for the backward

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x)
        calls.clear()
        y.square().mean().backward()
        return [y] + [p.grad for p in layer.parameters()], sum(kept.values()), len(calls)

    plain, plain_bytes, plain_calls = step(False)
    ckpt, ckpt_bytes, ckpt_calls = step(True)
    assert (plain_calls, ckpt_calls) == (0, 1)
    assert ckpt_bytes < plain_bytes / 2, (ckpt_bytes, plain_bytes)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)
