"""16-bit products with fp32 results (k3lab/model/matmul.py): the router's logits and their gradients against
float64, the fp32 path they replace, and the gradient without the low part of the split.

CPU: the products run upcast (the same sums); CUDA (``pytest -m gpu``): tensor-core GEMMs with fp32 output,
eager and compiled whole.
"""
import pytest
import torch
import torch.nn.functional as F

from k3lab.model.matmul import addmm_fp32, router_logits

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs CUDA")])]


def inputs(device, m=4096, n=64, d=256, seed=0):
    """x [m, d] bf16, a router weight [n, d] bf16 (N(0, 0.02)) and an upstream gradient [m, n] fp32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen).bfloat16()
    w = (0.02 * torch.randn(n, d, generator=gen)).bfloat16()
    g = 1e-3 * torch.randn(m, n, generator=gen)
    return x.to(device), w.to(device), g.to(device)


def forward_backward(fn, x, w, g):
    """(fn(x, w), dL/dx, dL/dW) for the upstream gradient g."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w)
    out.backward(g)
    return out.detach(), x.grad, w.grad


def fp32_path(x, w):
    return F.linear(x.float(), w.float())


def matches(got, exact, scale):
    """The share of elements equal to exact rounded to got's dtype, and whether every one lies within one ulp
    of it or, where the sum cancels, within 2^-16 of its terms' magnitude `scale` (sum |a_i b_i|)."""
    rounded = exact.to(got.dtype)
    bound = torch.maximum(rounded.double().abs() * 2.0 ** -7, scale * 2.0 ** -16)
    return (got == rounded).double().mean().item(), bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("device", DEVICES)
def test_router_logits_give_the_fp32_paths_values_and_gradients(device):
    """Forward: the fp32 GEMM's values (on the GPU up to the order of the fp32 sums). Backward: dx and dW within
    one bf16 ulp of float64 everywhere and equal to it rounded in >= 99% of elements, as the fp32 path; the
    16-bit gradient alone (no low part) rounds to the same value in about 58%."""
    x, w, g = inputs(device)
    out, dx, dw = forward_backward(router_logits, x, w, g)
    ref_out, ref_dx, ref_dw = forward_backward(fp32_path, x, w, g)
    assert out.dtype == torch.float32 and dx.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    g64, w64, x64 = g.double(), w.double(), x.double()
    exact_dx, exact_dw = g64 @ w64, g64.T @ x64
    scale_dx, scale_dw = g64.abs() @ w64.abs(), g64.abs().T @ x64.abs()
    for got, ref, exact, scale in [(dx, ref_dx, exact_dx, scale_dx), (dw, ref_dw, exact_dw, scale_dw)]:
        share, within = matches(got, exact, scale)
        assert within and share >= 0.99, share
        assert matches(ref, exact, scale) == (pytest.approx(1.0, abs=0.01), True)
    hi_only = (g.bfloat16().double() @ w64).bfloat16()
    assert matches(hi_only, exact_dx, scale_dx)[0] < 0.9


def test_router_logits_upcast_other_dtypes():
    """fp32 operands, or a bf16 x with fp32 weights (autocast's master weights), take the fp32 path as is."""
    x, w, g = inputs("cpu", m=64)
    for xs, ws in [(x.float(), w.float()), (x, w.float())]:
        out, dx, dw = forward_backward(router_logits, xs, ws, g)
        ref_out, ref_dx, ref_dw = forward_backward(fp32_path, xs, ws, g)
        assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx) and torch.equal(dw, ref_dw)


@pytest.mark.parametrize("device", DEVICES)
def test_addmm_fp32_sums_the_product_in_fp32(device):
    """acc + a b with bf16 a, b: within fp32 rounding of float64, where rounding the product to bf16 first
    (what an accumulator fed by a bf16 GEMM gets) is 100x further off."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*s, generator=gen).bfloat16().to(device) for s in [(96, 512), (512, 80)])
    acc = torch.randn(96, 80, generator=gen).to(device)
    got = addmm_fp32(acc, a, b)
    exact = acc.double() + a.double() @ b.double()
    assert got.dtype == torch.float32
    error = (got.double() - exact).abs().max().item()
    assert error < 1e-4 * exact.abs().max().item()
    assert error * 100 < ((acc + (a @ b).float()).double() - exact).abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_router_logits_compile_whole():
    """Under torch.compile(fullgraph=True) the logits and both gradients equal the eager ones to fp32 rounding."""
    x, w, g = inputs("cuda")
    eager = forward_backward(router_logits, x, w, g)
    compiled = forward_backward(torch.compile(router_logits, fullgraph=True), x, w, g)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(compiled[1:], eager[1:]):
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=0)


def test_custom_ops_pass_opcheck():
    """Fake tensors, schemas and the registered autograd agree with what the ops compute (torch's opcheck)."""
    from k3lab.model.matmul import half_logits, half_logits_backward

    x, w, g = inputs("cpu", m=32)
    torch.library.opcheck(addmm_fp32, (g, x, w.T))
    torch.library.opcheck(half_logits, (x.requires_grad_(), w.requires_grad_()))
    torch.library.opcheck(half_logits_backward, (g, x.detach(), w.detach()))
