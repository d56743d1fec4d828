"""Muon's elementwise start of a step, fused in Triton beside its plain-PyTorch form: the momentum update and
the direction Newton-Schulz orthogonalises, one read of the gradient and momentum and one write of each result.

    m <- s g + beta m                            (in place, rounded once to m's dtype)
    u <- s g + beta m  (Nesterov)  or  m         (rounded to m's dtype, then written in u's dtype)

g, m: one parameter's gradient and momentum buffer (any shape, the same numel, contiguous for the kernel);
u: where the direction goes, typically that parameter's slice of a Newton-Schulz batch in bf16; s: an
optional 0-dim fp32 tensor on the device (gradient clipping's factor), read by the kernel, so that clipping
needs no pass of its own over the gradients.
The torch form takes three passes over the elements for the momentum (read m and g, write m) and three for
the direction; the kernel takes four (read g and m, write m and u). At the K3 default's 888 million Muon
parameters (benchmarks/muon_bench.py) each pass is 1.8 GB of bf16.

Entry point :func:`momentum_direction` (backend as ``kernels.kda.kda``: "auto" is the kernel on CUDA
tensors when Triton is available). The optimizer has no autograd and no torch.compile graph, so this is a
plain launch, not a ``torch.library`` op.
"""
from __future__ import annotations  # the kernel's tl.constexpr annotations stay strings (read by triton.jit)

import torch
from torch import Tensor

from .kda import BACKENDS

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is a Linux-only dependency (pyproject): elsewhere only the torch path exists
    triton = None
jit = triton.jit if triton is not None else (lambda fn: fn)

# Elements per program and warps: 8 bf16 elements (16 bytes) per thread and load at 8 warps.
LAUNCH = dict(BLOCK=2048, num_warps=8)

__all__ = ["momentum_direction"]


@jit
def _momentum_direction(g, m, u, scale, n, beta, NESTEROV: tl.constexpr, SCALED: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One block of BLOCK elements: m <- s g + beta m (m's dtype); u <- s g + beta m or m (m's dtype, then
    u's); s = scale[0] when SCALED, else 1."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    grad = tl.load(g + offs, mask=mask).to(tl.float32)
    if SCALED:
        grad = grad * tl.load(scale)
    mom = (grad + beta * tl.load(m + offs, mask=mask).to(tl.float32)).to(m.dtype.element_ty)
    tl.store(m + offs, mom, mask=mask)
    if NESTEROV:
        direction = (grad + beta * mom.to(tl.float32)).to(m.dtype.element_ty)
    else:
        direction = mom
    tl.store(u + offs, direction.to(u.dtype.element_ty), mask=mask)


def momentum_direction(g: Tensor, m: Tensor, u: Tensor, beta: float, nesterov: bool, backend: str = "auto",
                       scale: Tensor | None = None) -> None:
    """m <- s g + beta m in place; u <- s g + beta m (Nesterov) or m, written into u (module docstring).

    g, m, u: the same numel; m and u are written; scale: s, a 0-dim fp32 tensor on g's device, or None (1).
    backend "auto": the Triton kernel on contiguous CUDA tensors when Triton is available, else torch;
    "triton" always the kernel (CPU tensors only under TRITON_INTERPRET=1); "torch" (and "fla", which has no
    such kernel) the torch form, where s g is rounded to g's dtype first (the kernel keeps it in fp32)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown momentum backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if not (g.numel() == m.numel() == u.numel()):
        raise ValueError(f"momentum_direction needs g, m and u of one size, got {g.numel()}, {m.numel()}, "
                         f"{u.numel()} elements")
    contiguous = g.is_contiguous() and m.is_contiguous() and u.is_contiguous()
    if backend == "auto":
        backend = "triton" if m.is_cuda and triton is not None and contiguous else "torch"
    if backend != "triton":
        if scale is not None:
            g = g * scale  # g's dtype, rounded once: what clipping's in-place multiply leaves in g
        torch.add(g, m, alpha=beta, out=m)
        if nesterov:
            torch.add(g, m, alpha=beta, out=u.view_as(m))  # computed in m's dtype, then cast to u's
        else:
            u.view_as(m).copy_(m)
        return
    if triton is None:
        raise ImportError("momentum backend 'triton' is unavailable: triton is not installed")
    if not contiguous:
        raise ValueError("the momentum kernel reads and writes contiguous g, m and u")
    n = m.numel()
    if n:
        _momentum_direction[(triton.cdiv(n, LAUNCH["BLOCK"]),)](
            g, m, u, g if scale is None else scale, n, beta, NESTEROV=nesterov, SCALED=scale is not None, **LAUNCH)
