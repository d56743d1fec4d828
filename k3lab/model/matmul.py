"""Matrix products of 16-bit operands with fp32 results, and the fp32 router's logits built from them.

A product of two bf16 (or fp16) numbers is exact in fp32, so an fp32 GEMM of operands that hold 16-bit values
and a tensor-core GEMM of the 16-bit operands that accumulates and returns fp32 compute the same sums, up to
the order of their fp32 additions. On CUDA the second is one cuBLAS call (torch.mm / torch.addmm with
`out_dtype`); elsewhere the operands are upcast, which is the first.

Each function is a ``torch.library`` custom op, one opaque node of a torch.compile graph that runs the eager
code as written: written as plain ops inside an autograd.Function, the compiled router's gradients and the
compiled cross-entropy missed their GPU tests' tolerances (tests/test_matmul.py, tests/test_linear_ce.py;
Inductor may keep a value in fp32 across a rounding to bf16 inside one fused kernel, which would drop the
split's low part).
"""
from __future__ import annotations

import torch
from torch import Tensor

HALF_DTYPES = (torch.bfloat16, torch.float16)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a [m, k] @ b [k, n] -> [m, n] fp32, for a and b of one 16-bit dtype (module docstring)."""
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float()


@torch.library.custom_op("k3lab::addmm_fp32", mutates_args=())
def addmm_fp32(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """acc [m, n] fp32 + a [m, k] @ b [k, n], a new fp32 tensor, for a and b of one 16-bit dtype: on CUDA
    the sum is taken in the GEMM's epilogue, the product never rounded to 16 bits nor stored."""
    if a.is_cuda:
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    return acc + a.float() @ b.float()


@addmm_fp32.register_fake
def _(acc, a, b):
    return torch.empty_like(acc)


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """The router's logits x W^T [m, n] in fp32 for x [m, D] and weight [n, D] (K3's fp32 router: the same
    values whatever the model's dtype). When both are in one 16-bit dtype (bf16-true) the products run on
    the tensor cores (`half_logits`); otherwise both are upcast to fp32."""
    if x.dtype == weight.dtype and x.dtype in HALF_DTYPES:
        return half_logits(x, weight)
    return torch.nn.functional.linear(x.float(), weight.float())


@torch.library.custom_op("k3lab::half_logits", mutates_args=())
def half_logits(x: Tensor, weight: Tensor) -> Tensor:
    """x [m, D] W [n, D]^T in fp32 from 16-bit operands, and (registered below) its gradients as the fp32
    product would give them (`half_logits_backward`). Saves x and W themselves for the backward, where the
    fp32 path keeps an fp32 copy of x [m, D]."""
    return _mm(x, weight.T)


@half_logits.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("k3lab::half_logits_backward", mutates_args=())
def half_logits_backward(grad: Tensor, x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """dx [m, D] and dW [n, D] of `half_logits` for the fp32 gradient grad [m, n]. grad is split into two
    16-bit parts, grad = hi + lo + r with hi = 16-bit(grad), lo = 16-bit(grad - hi) and |r| <= 2^-18 |grad| in
    bf16, so that dx = [hi lo] [W; W] and dW = [hi lo]^T x are 16-bit GEMMs (K = 2n for dx, two row blocks
    summed for dW) accumulating in fp32; dx is rounded once to x's dtype and dW to W's, as the fp32 path
    rounds its results."""
    hi = grad.to(x.dtype)
    parts = torch.cat([hi, (grad - hi.float()).to(x.dtype)], dim=1)        # [m, 2n]
    grad_w = _mm(parts.T, x)                                               # [2n, D]
    n = weight.shape[0]
    return parts @ torch.cat([weight, weight], dim=0), (grad_w[:n] + grad_w[n:]).to(weight.dtype)


@half_logits_backward.register_fake
def _(grad, x, weight):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return half_logits_backward(grad, *ctx.saved_tensors)


half_logits.register_autograd(_backward, setup_context=_setup_context)
