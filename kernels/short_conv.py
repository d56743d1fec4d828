"""Causal depthwise short convolution over time followed by SiLU (the KDA layer's q/k/v conv), fused in
Triton on the [B, T, C] layout, beside its plain-PyTorch reference.

    y[b, t, c] = silu(p[b, t, c]),   p[b, t, c] = sum_{j < W} w[c, j] x[b, t - (W-1) + j, c],   x[b, t < 0, c] = 0

x [B, T, C] (bf16, fp16 or fp32), w [C, W] (an nn.Conv1d(C, C, W, groups=C) weight [C, 1, W] without its
middle dim; any dtype) -> y [B, T, C] in x's dtype. The kernels read w as fp32 and sum in fp32, so a bf16 x
under autocast meets its fp32 weight unrounded (nn.Conv1d under autocast rounds the weight to bf16).

- forward ``_conv_fwd``: one [BT, BC] tile of y per program, from W time-shifted loads of x (the W-1 rows
  of halo come from the cache); nothing is kept but x and w.
- backward, two kernels: ``_conv_bwd_g`` recomputes the pre-activation p from x and writes
  g = dy * silu'(p) [B, T, C] in x's dtype (dy's precision; half of fp32's bytes in bf16) and partial sums
  of dw[c, j] = sum_{b, t} g[b, t, c] x[b, t - (W-1) + j, c] (from g before its rounding);
  ``_conv_bwd_dx`` reads g back W times shifted, dx[t] = sum_j w[c, j] g[t + (W-1) - j], like the forward.
  A single fused kernel has to recompute g at the W-1 rows past its tile too (W^2 loads and W sigmoids per
  element): on the H200 (B, T, C = 8, 4096, 1024, bf16) it took 0.39 ms at best against 0.29 ms for the pair
  (with g in fp32).
  Each ``_conv_bwd_g`` program walks a fixed set of time tiles of one (channel block, batch), sums the dw
  products elementwise over them and over time once at the end, and writes its partial dw sums; torch adds
  them (``.sum(0)``), so the result does not depend on scheduling (no atomics). dx comes back in x's dtype,
  dw in w's.

Entry point :func:`short_conv` (backend as ``kernels.kda.kda``). The Triton path is two ``torch.library``
custom ops, ``k3lab::short_conv_fwd`` and ``k3lab::short_conv_bwd``, the second the first's autograd formula,
so that torch.compile keeps each call as one node of its graph (no graph break), like ``k3lab::kda_fwd``.
"""
from __future__ import annotations  # the kernels' tl.constexpr annotations stay strings (read by triton.jit)

import torch
import torch.nn.functional as F
from torch import Tensor

from .device import sm_count
from .kda import BACKENDS

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is a Linux-only dependency (pyproject): elsewhere only the torch path exists
    triton = None
jit = triton.jit if triton is not None else (lambda fn: fn)

# Per kernel: time rows x channels of a tile, warps per program. ``_conv_bwd_g`` keeps W accumulator tiles,
# hence its smaller tiles. On the H200 at B, T, C = 8, 4096, 1024 and 1, 16384, 2048 in bf16, tiles of
# 32 x 128 with 4 warps ran the forward at about 2.4 TB/s, within 3% of the best of 18 shapes tried. For
# ``_conv_bwd_g`` with g stored in bf16, 8 x 64 with 2 warps and 8 programs per SM was the best of 108
# configurations at 8, 4096, 1024 (the backward 0.224 ms against 0.274 ms for 16 x 64, 2 warps, 16 per SM,
# the best while g was fp32; benchmarks/RESULTS.md).
LAUNCH = {"fwd": dict(BT=32, BC=128, num_warps=4), "bwd_g": dict(BT=8, BC=64, num_warps=2),
          "bwd_dx": dict(BT=32, BC=128, num_warps=4)}
# programs per SM of ``_conv_bwd_g``: each walks a strided set of time tiles, so that the partial dw sums stay few
BWD_PROGRAMS_PER_SM = 8
MAX_W = 4  # kernel sizes 1..MAX_W (``_conv_bwd_g`` has one accumulator per tap)

__all__ = ["BACKENDS", "conv_bwd", "conv_fwd", "short_conv", "short_conv_reference", "triton_available"]


def triton_available() -> bool:
    """True when Triton can be imported (it can run these kernels on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return triton is not None


def short_conv_reference(x: Tensor, w: Tensor) -> Tensor:
    """x [B, T, C], w [C, W] -> silu(causal depthwise conv) [B, T, C]: nn.Conv1d's math on the transposed
    input (padding W-1 on both sides, the last W-1 outputs dropped), in PyTorch ops."""
    T, C, W = x.shape[1], *w.shape
    return F.silu(F.conv1d(x.transpose(1, 2), w.unsqueeze(1), padding=W - 1, groups=C)[..., :T].transpose(1, 2))


@jit
def _rows(ptr, t, c, cmask, T, C):
    """ptr[t, c] of one [T, C] row-major sequence for rows t [BT] and channels c [BC], as fp32; zero for
    rows outside [0, T) and channels past C."""
    mask = ((t >= 0) & (t < T))[:, None] & cmask[None, :]
    return tl.load(ptr + t.to(tl.int64)[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)


@jit
def _pre(x, w, t, c, cmask, T, C, W: tl.constexpr):
    """Pre-activation p [BT, BC] (fp32) at rows t: sum_j w[c, j] x[t - (W-1) + j, c]."""
    p = tl.load(w + c * W, mask=cmask, other=0.0)[None, :] * _rows(x, t - (W - 1), c, cmask, T, C)
    for j in tl.static_range(1, W):
        wj = tl.load(w + c * W + j, mask=cmask, other=0.0)
        p += wj[None, :] * _rows(x, t - (W - 1) + j, c, cmask, T, C)
    return p


@jit
def _conv_fwd(x, w, y, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """y = silu(p) for the tile (time block, channel block, batch) = program ids 0, 1, 2. x, y [B, T, C];
    w [C, W] fp32."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = c < C
    seq = tl.program_id(2).to(tl.int64) * T * C
    p = _pre(x + seq, w, t, c, cmask, T, C, W)
    offs = seq + t.to(tl.int64)[:, None] * C + c[None, :]
    tl.store(y + offs, (p * tl.sigmoid(p)).to(y.dtype.element_ty), mask=(t < T)[:, None] & cmask[None, :])


@jit
def _conv_bwd_g(x, w, dy, g, dw_part, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """g = dy * silu'(p) [B, T, C] (g's dtype) on time tiles k, k + n, k + 2n, ... (k, n: program id and count
    along grid axis 0) of one channel block (axis 1) and sequence (axis 2), and this program's partial dw
    sums dw_part[b * n + k] [C, W] (fp32). The products g x[t - (W-1) + j] are summed elementwise over the
    tiles, one [BT, BC] accumulator per tap (W <= MAX_W), and over time once at the end."""
    k, n = tl.program_id(0), tl.num_programs(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = c < C
    b = tl.program_id(2)
    seq = b.to(tl.int64) * T * C
    x, dy, g = x + seq, dy + seq, g + seq
    acc0 = tl.zeros([BT, BC], tl.float32)
    acc1 = tl.zeros([BT, BC], tl.float32)
    acc2 = tl.zeros([BT, BC], tl.float32)
    acc3 = tl.zeros([BT, BC], tl.float32)
    for blk in range(k, tl.cdiv(T, BT), n):
        t = blk * BT + tl.arange(0, BT)
        p = _pre(x, w, t, c, cmask, T, C, W)
        sig = tl.sigmoid(p)
        gt = _rows(dy, t, c, cmask, T, C) * sig * (1 + p * (1 - sig))  # zero past T (dy is masked)
        tl.store(g + t.to(tl.int64)[:, None] * C + c[None, :], gt.to(g.dtype.element_ty),
                 mask=(t < T)[:, None] & cmask[None, :])
        acc0 += gt * _rows(x, t - (W - 1), c, cmask, T, C)
        if W > 1:
            acc1 += gt * _rows(x, t - (W - 2), c, cmask, T, C)
        if W > 2:
            acc2 += gt * _rows(x, t - (W - 3), c, cmask, T, C)
        if W > 3:
            acc3 += gt * _rows(x, t - (W - 4), c, cmask, T, C)
    part = dw_part + (b * n + k).to(tl.int64) * C * W + c * W
    tl.store(part, tl.sum(acc0, axis=0), mask=cmask)
    if W > 1:
        tl.store(part + 1, tl.sum(acc1, axis=0), mask=cmask)
    if W > 2:
        tl.store(part + 2, tl.sum(acc2, axis=0), mask=cmask)
    if W > 3:
        tl.store(part + 3, tl.sum(acc3, axis=0), mask=cmask)


@jit
def _conv_bwd_dx(g, w, dx, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dx[t] = sum_j w[c, j] g[t + (W-1) - j] (g zero past T) for one tile, program ids as ``_conv_fwd``."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = c < C
    seq = tl.program_id(2).to(tl.int64) * T * C
    acc = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w + c * W + j, mask=cmask, other=0.0)
        acc += wj[None, :] * _rows(g + seq, t + (W - 1) - j, c, cmask, T, C)
    offs = seq + t.to(tl.int64)[:, None] * C + c[None, :]
    tl.store(dx + offs, acc.to(dx.dtype.element_ty), mask=(t < T)[:, None] & cmask[None, :])


def _launch(name: str, x: Tensor, w: Tensor, block: dict | None) -> tuple[dict, int, int]:
    """The launch config of kernel ``name`` (``LAUNCH[name]``, or ``block`` for every kernel) and the numbers
    of time and channel tiles of x [B, T, C]; refuses kernel sizes w [C, W] past MAX_W."""
    if not 1 <= w.shape[1] <= MAX_W:
        raise ValueError(f"the Triton short conv takes kernel sizes 1..{MAX_W}, got {w.shape[1]}")
    cfg = LAUNCH[name] if block is None else block
    return cfg, triton.cdiv(x.shape[1], cfg["BT"]), triton.cdiv(x.shape[2], cfg["BC"])


def conv_fwd(x: Tensor, w: Tensor, block: dict | None = None) -> Tensor:
    """Launch ``_conv_fwd``: x [B, T, C], w [C, W] -> y [B, T, C] (x's dtype). block: BT, BC and num_warps
    in place of ``LAUNCH["fwd"]``."""
    cfg, nt, nc = _launch("fwd", x, w, block)
    x, w = x.contiguous(), w.float().contiguous()
    B, T, C = x.shape
    y = torch.empty_like(x)
    _conv_fwd[(nt, nc, B)](x, w, y, T, C, W=w.shape[1], BT=cfg["BT"], BC=cfg["BC"], num_warps=cfg["num_warps"])
    return y


def conv_bwd(x: Tensor, w: Tensor, dy: Tensor, block: dict | None = None,
             time_programs: int | None = None, block_g: dict | None = None) -> tuple[Tensor, Tensor]:
    """Launch ``_conv_bwd_g`` and ``_conv_bwd_dx``: x [B, T, C], w [C, W], dy [B, T, C] -> dx [B, T, C]
    (x's dtype) and dw [C, W] (w's dtype). block: BT, BC and num_warps for both kernels in place of
    ``LAUNCH``; block_g: for ``_conv_bwd_g`` alone (the launch sweep of ``benchmarks.conv_bench``).
    time_programs: ``_conv_bwd_g`` programs per (channel block, sequence), each taking every
    time_programs-th time tile; by default enough for ``BWD_PROGRAMS_PER_SM`` programs per SM."""
    (cfg_g, nt_g, nc_g), (cfg_dx, nt, nc) = _launch("bwd_g", x, w, block_g or block), _launch("bwd_dx", x, w, block)
    w_dtype = w.dtype
    x, w, dy = x.contiguous(), w.float().contiguous(), dy.contiguous()
    B, T, C = x.shape
    W = w.shape[1]
    if time_programs is None:
        time_programs = triton.cdiv(BWD_PROGRAMS_PER_SM * sm_count(x.device), nc_g * B)
    n = max(1, min(nt_g, time_programs))
    g = torch.empty_like(x)
    dw_part = x.new_empty((B * n, C, W), dtype=torch.float32)
    _conv_bwd_g[(n, nc_g, B)](x, w, dy, g, dw_part, T, C, W=W, BT=cfg_g["BT"], BC=cfg_g["BC"],
                              num_warps=cfg_g["num_warps"])
    dx = torch.empty_like(x)
    _conv_bwd_dx[(nt, nc, B)](g, w, dx, T, C, W=W, BT=cfg_dx["BT"], BC=cfg_dx["BC"], num_warps=cfg_dx["num_warps"])
    return dx, dw_part.sum(0).to(w_dtype)


# the ops launch with the default configs (LAUNCH)
short_conv_fwd_op = torch.library.custom_op("k3lab::short_conv_fwd", conv_fwd, mutates_args=(),
                                            schema="(Tensor x, Tensor w) -> Tensor")
short_conv_fwd_op.register_fake(lambda x, w: x.new_empty(x.shape))
short_conv_bwd_op = torch.library.custom_op("k3lab::short_conv_bwd", conv_bwd, mutates_args=(),
                                            schema="(Tensor x, Tensor w, Tensor dy) -> (Tensor, Tensor)")
short_conv_bwd_op.register_fake(lambda x, w, dy: (x.new_empty(x.shape), w.new_empty(w.shape)))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x and w only: the backward recomputes the pre-activation


def _autograd_backward(ctx, dy):
    return short_conv_bwd_op(*ctx.saved_tensors, dy)


short_conv_fwd_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def short_conv(x: Tensor, w: Tensor, backend: str = "auto") -> Tensor:
    """silu(causal depthwise conv over time): x [B, T, C], w [C, W] -> y [B, T, C] (x's dtype).

    backend (``kernels.backend``, the rule of ``kernels.kda.kda``): "auto" runs the Triton kernels on CUDA
    tensors when Triton is available and W <= MAX_W, else the torch reference; "triton" always runs the
    kernels (CPU tensors only under TRITON_INTERPRET=1); "torch" and "fla" run :func:`short_conv_reference`
    (fla's KDA kernel leaves the conv to the model).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown short conv backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_available() and w.shape[1] <= MAX_W else "torch"
    if backend != "triton":
        return short_conv_reference(x, w)
    if not triton_available():
        raise ImportError("short conv backend 'triton' is unavailable: triton is not installed")
    return short_conv_fwd_op(x, w)
