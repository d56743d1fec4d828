"""The routed experts of an MoE layer as grouped GEMMs with the GLU fused into their epilogues (Triton).

    y[m] = W3[e] ( f(W1[e] x[m]) * c(W2[e] x[m]) )      for the rows m of expert e's segment

x [M, W] are the (token, expert) pairs' inputs sorted by expert, counts [n] the segment sizes (int), w1, w2
[n, H, W] and w3 [n, W, H] the stacked expert weights. The GLU is `k3lab.model.ffn.glu_combine`:
SiTU, f(g) = b1 tanh(g / b1) sigmoid(g) and c(u) = b2 tanh(u / b2) (Kimi K3, arXiv:2607.24653), or
SwiGLU, f(g) = g sigmoid(g) and c(u) = u.

This is the experts under activation checkpointing (``kernels.checkpoint_experts``), with the GLU fused:
the autograd graph keeps the inputs alone and the backward recomputes gate and up inside its kernel.

- forward ``_glu_fwd``: per [BM, BN] tile of the hidden layer, gate g and up u in two fp32 accumulators
  from one pass over x's row block, then h = f(g) c(u) written once in x's dtype (g and u never reach
  memory); torch._grouped_mm runs h through W3.
- backward ``_glu_bwd``: per tile, dh = dy W3[e] and g, u again, all three in one pass over the row blocks
  of dy and x (or dh from one torch._grouped_mm before it: the launch table's `dh`); the epilogue writes
  h (for dW3) and dg = dh c(u) f'(g), du = dh f(g) c'(u) side by side in one [M, 2H] tensor, so that
  dx = [dg du] [W1; W2] is one grouped GEMM (torch._grouped_mm), dW1 = dg^T x and dW2 = du^T x one each
  from its column blocks (no copies), and dW3 = dy^T h another.

Checkpointed and unfused, the forward writes gate and up, reads them for the GLU and writes h, twice (once
more in the backward), and the backward's GLU gradient reads gate, up and dh and writes dg and du: at the
K3 default's expert shapes (M = 262,144 pairs, W = 256, H = 1,408) each such pass moves 0.74 GB. On the
H200 one layer's forward + backward there took 6.54 ms against 6.76 ms for the torch.compile'd
checkpointed grouped path and 5.59 ms for the compiled path that keeps gate and up (1.5 GB more per
layer), so MoE.forward fuses only where the experts are checkpointed (benchmarks/RESULTS.md). Rows are
tiled per expert segment (a tile never spans two experts): the tile schedule (`tile_schedule`) is built
on the device from counts, so no step waits on the host.

Entry point :func:`grouped_glu`; the two ``torch.library`` custom ops ``k3lab::grouped_glu_fwd`` and
``k3lab::grouped_glu_bwd``, the second the first's autograd formula, keep each call one node of a
torch.compile graph, like ``k3lab::kda_fwd``. torch._grouped_mm needs every dimension a multiple of 8.
"""
from __future__ import annotations  # the kernels' tl.constexpr annotations stay strings (read by triton.jit)

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is a Linux-only dependency (pyproject): elsewhere the torch dispatch runs
    triton = None
jit = triton.jit if triton is not None else (lambda fn: fn)

# Tile of the hidden layer per program (rows BM of one expert's segment x hidden units BN), the K step BK
# over the width W, warps and pipeline stages; for the backward, where dh comes from (`glu_bwd`). Each is
# the fastest of `python -m benchmarks.moe_bench --tune` (32 forward, 64 backward configurations) on the
# H200 at the K3 default's shapes: 1.53 ms forward; 3.80 ms backward with dh from torch._grouped_mm, where
# the best with dh in the kernel takes 4.15 ms (a third operand tile per K step: 120 against 72 KiB of shared
# memory a program at this tile, `python -m benchmarks.kernel_resources`). The [M, H] dh costs the K3 default
# 0.68 GiB of peak memory for 0.6 ms a step. Programs that kept x's row block (and dy's) for up to 22 tiles
# of hidden units, which halves the L2 traffic, were timed and not kept: the best of them tied the best
# backward (4.006 against 3.996 ms), and no forward of them came near; nor did gate and up from one product
# of twice the width over w1 and w2's rows interleaved (1.540 against 1.520 ms forward, not among the
# backward's six fastest; benchmarks/RESULTS.md).
LAUNCH = {"fwd": dict(BM=128, BN=64, BK=64, num_warps=8, num_stages=3),
          "bwd": dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=3, dh="grouped_mm")}
DH_SOURCES = ("kernel", "grouped_mm")  # LAUNCH["bwd"]["dh"]: see `glu_bwd`

__all__ = ["DH_SOURCES", "LAUNCH", "glu_bwd", "glu_fwd", "grouped_glu", "tile_schedule", "triton_available"]


def triton_available() -> bool:
    """True when Triton can be imported (it can run these kernels on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return triton is not None


def tile_schedule(counts: Tensor, block_m: int, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Row tiles of the segments of counts [n] (rows in all): (expert, first row, end row) per tile, int32
    [cdiv(rows, block_m) + n], a fixed length whatever the counts (one launch grid, no host sync). Tile t
    of expert e covers rows [s_e + t' block_m, min(s_e + (t' + 1) block_m, s_e + counts[e])); tiles past the
    last hold first row >= end row, and their programs return at once."""
    counts = counts.to(torch.int64)
    n = counts.numel()
    tiles = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(rows, block_m) + n, device=counts.device)
    expert = torch.searchsorted(tiles_end, t, right=True).clamp_(max=n - 1)
    seg_end = torch.cumsum(counts, 0)
    start = (seg_end - counts)[expert] + (t - (tiles_end - tiles)[expert]) * block_m
    return expert.to(torch.int32), start.to(torch.int32), seg_end[expert].to(torch.int32)


@jit
def _dot(a, b, acc, GPU: tl.constexpr):
    """acc + a b: the operands as loaded on the GPU, where fp32 ones multiply in full fp32 (not TF32); in fp32
    under the interpreter, whose bf16 tl.dot is wrong."""
    if not GPU:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@jit
def _tanh(z, GPU: tl.constexpr):
    """tanh(z) for fp32 z: one MUFU instruction on the GPU (tanh.approx.f32, relative error about 2^-11,
    below bf16's 2^-8), 2 sigmoid(2z) - 1 under the interpreter (which runs no inline assembly)."""
    if GPU:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [z], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return 2 * tl.sigmoid(2 * z) - 1


@jit
def _glu_parts(g, u, b1, b2, SITU: tl.constexpr, GPU: tl.constexpr):
    """f(g), f'(g), c(u), c'(u) in fp32 for the GLU (SiTU, or SwiGLU) of fp32 tiles g and u; the sigmoid as
    (1 + tanh(g / 2)) / 2, so that a SiTU element costs three tanh and no division on the GPU."""
    sg = 0.5 + 0.5 * _tanh(0.5 * g, GPU)
    if SITU:
        t1 = _tanh(g / b1, GPU)
        t2 = _tanh(u / b2, GPU)
        fg = b1 * t1 * sg
        dfg = (1 - t1 * t1) * sg + fg * (1 - sg)
        cu = b2 * t2
        dcu = 1 - t2 * t2
    else:
        fg = g * sg
        dfg = sg + fg * (1 - sg)
        cu = u
        dcu = tl.full(u.shape, 1.0, tl.float32)
    return fg, dfg, cu, dcu


@jit
def _tile(tile_expert, tile_start, tile_end, H, BM: tl.constexpr, BN: tl.constexpr):
    """This program's expert, rows [BM] with their mask, hidden units [BN] with theirs, and whether it has
    no rows (a tile past the last)."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(tile_start + pid_m), tl.load(tile_end + pid_m)
    rows = start + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    return tl.load(tile_expert + pid_m).to(tl.int64), rows, rows < end, cols, cols < H, start >= end


@jit
def _gate_up_step(x_at, w1, w2, w_at, k, kmask, rmask, cmask, g, u, GPU: tl.constexpr):
    """g, u += x's [BM, BK] block at k times the [BK, BN] tiles of w1[e]^T and w2[e]^T there."""
    a = tl.load(x_at + k, mask=rmask[:, None] & kmask[None, :], other=0.0)
    wmask = kmask[:, None] & cmask[None, :]
    g = _dot(a, tl.load(w1 + w_at + k, mask=wmask, other=0.0), g, GPU)
    u = _dot(a, tl.load(w2 + w_at + k, mask=wmask, other=0.0), u, GPU)
    return g, u


@jit
def _glu_fwd(x, w1, w2, h, tile_expert, tile_start, tile_end, H, W, b1, b2,
             SITU: tl.constexpr, GPU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, rows, rmask, cols, cmask, idle = _tile(tile_expert, tile_start, tile_end, H, BM, BN)
    if idle:
        return
    ks = tl.arange(0, BK)
    x_at = x + rows.to(tl.int64)[:, None] * W + ks[None, :]                # [BM, BK]
    w_at = e * H * W + cols.to(tl.int64)[None, :] * W + ks[:, None]        # [BK, BN] of w1[e]^T, w2[e]^T
    g = tl.zeros((BM, BN), tl.float32)
    u = tl.zeros((BM, BN), tl.float32)
    for k in range(0, W, BK):
        g, u = _gate_up_step(x_at, w1, w2, w_at, k, (k + ks) < W, rmask, cmask, g, u, GPU)
    fg, _, cu, _ = _glu_parts(g, u, b1, b2, SITU, GPU)
    tl.store(h + rows.to(tl.int64)[:, None] * H + cols[None, :], (fg * cu).to(h.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@jit
def _glu_bwd(x, dy, w1, w2, w3, dh_in, h, dgu, tile_expert, tile_start, tile_end, H, W, b1, b2,
             SITU: tl.constexpr, DH_IN: tl.constexpr, GPU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr):
    e, rows, rmask, cols, cmask, idle = _tile(tile_expert, tile_start, tile_end, H, BM, BN)
    if idle:
        return
    ks = tl.arange(0, BK)
    row_at = rows.to(tl.int64)[:, None] * W + ks[None, :]                 # [BM, BK] of x and dy
    w_at = e * H * W + cols.to(tl.int64)[None, :] * W + ks[:, None]       # [BK, BN] of w1[e]^T, w2[e]^T
    w3_at = e * W * H + ks.to(tl.int64)[:, None] * H + cols[None, :]      # [BK, BN] of w3[e]
    dh = tl.zeros((BM, BN), tl.float32)
    g = tl.zeros((BM, BN), tl.float32)
    u = tl.zeros((BM, BN), tl.float32)
    out = rows.to(tl.int64)[:, None] * H + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    for k in range(0, W, BK):
        kmask = (k + ks) < W
        if not DH_IN:
            dh = _dot(tl.load(dy + row_at + k, mask=rmask[:, None] & kmask[None, :], other=0.0),
                      tl.load(w3 + w3_at + k * H, mask=kmask[:, None] & cmask[None, :], other=0.0), dh, GPU)
        g, u = _gate_up_step(x + row_at, w1, w2, w_at, k, kmask, rmask, cmask, g, u, GPU)
    if DH_IN:
        dh = tl.load(dh_in + out, mask=omask, other=0.0).to(tl.float32)
    fg, dfg, cu, dcu = _glu_parts(g, u, b1, b2, SITU, GPU)
    tl.store(h + out, (fg * cu).to(h.dtype.element_ty), mask=omask)
    both = rows.to(tl.int64)[:, None] * (2 * H) + cols[None, :]
    tl.store(dgu + both, (dh * cu * dfg).to(dgu.dtype.element_ty), mask=omask)
    tl.store(dgu + both + H, (dh * fg * dcu).to(dgu.dtype.element_ty), mask=omask)


def _offsets(counts: Tensor) -> Tensor:
    """torch._grouped_mm's group ends: the cumulative counts, int32."""
    return torch.cumsum(counts, 0).to(torch.int32)


def glu_fwd(xs: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, b1: float, b2: float, situ: bool,
            block: dict | None = None) -> Tensor:
    """xs [M, W] sorted by expert, counts [n], w1 and w2 [n, H, W], w3 [n, W, H] (all in xs's dtype) ->
    y [M, W]. block: BM, BN, BK, num_warps and num_stages in place of ``LAUNCH["fwd"]``."""
    cfg = LAUNCH["fwd"] if block is None else block
    xs, w1, w2 = xs.contiguous(), w1.contiguous(), w2.contiguous()
    (M, W), H = xs.shape, w1.shape[1]
    h = xs.new_empty(M, H)
    expert, start, end = tile_schedule(counts, cfg["BM"], M)
    _glu_fwd[(triton.cdiv(H, cfg["BN"]), expert.numel())](
        xs, w1, w2, h, expert, start, end, H, W, b1, b2, SITU=situ, GPU=xs.is_cuda, BM=cfg["BM"], BN=cfg["BN"],
        BK=cfg["BK"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return torch._grouped_mm(h, w3.transpose(-2, -1), offs=_offsets(counts))


def glu_bwd(xs: Tensor, dy: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, b1: float, b2: float,
            situ: bool, block: dict | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients (dxs [M, W], dw1, dw2 [n, H, W], dw3 [n, W, H]) of `glu_fwd`'s y for its cotangent dy
    [M, W]. block: as ``LAUNCH["bwd"]``, whose `dh` says where dh = dy W3[e] comes from: "kernel" (inside
    ``_glu_bwd``, three products per tile) or "grouped_mm" (torch._grouped_mm first, [M, H] in xs's dtype,
    which ``_glu_bwd`` reads in its epilogue beside its two products)."""
    cfg = LAUNCH["bwd"] if block is None else block
    xs, dy, w1, w2, w3 = (t.contiguous() for t in (xs, dy, w1, w2, w3))
    (M, W), H = xs.shape, w1.shape[1]
    if cfg["dh"] not in DH_SOURCES:
        raise ValueError(f"launch dh={cfg['dh']!r}; valid: {', '.join(DH_SOURCES)}")
    h, dgu = xs.new_empty(M, H), xs.new_empty(M, 2 * H)
    offs = _offsets(counts)
    dh = torch._grouped_mm(dy, w3, offs=offs) if cfg["dh"] == "grouped_mm" else xs.new_empty(0)
    expert, start, end = tile_schedule(counts, cfg["BM"], M)
    _glu_bwd[(triton.cdiv(H, cfg["BN"]), expert.numel())](
        xs, dy, w1, w2, w3, dh, h, dgu, expert, start, end, H, W, b1, b2, SITU=situ, DH_IN=dh.numel() > 0,
        GPU=xs.is_cuda, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    dxs = torch._grouped_mm(dgu, torch.cat([w1, w2], 1), offs=offs)     # [dg du] [W1; W2]
    # dW1 and dW2 from column blocks of dgu (strided views, no copy), each written contiguous: one
    # [n, 2H, W] product would need two copies to split
    dw1, dw2 = (torch._grouped_mm(dgu[:, part].t(), xs, offs=offs) for part in (slice(0, H), slice(H, None)))
    dw3 = torch._grouped_mm(dy.t(), h, offs=offs)                       # [n, W, H]
    return dxs, dw1, dw2, dw3


grouped_glu_fwd_op = torch.library.custom_op(
    "k3lab::grouped_glu_fwd", glu_fwd, mutates_args=(),
    schema="(Tensor xs, Tensor counts, Tensor w1, Tensor w2, Tensor w3, float b1, float b2, bool situ) -> Tensor")
grouped_glu_fwd_op.register_fake(lambda xs, counts, w1, w2, w3, b1, b2, situ: xs.new_empty(xs.shape))
grouped_glu_bwd_op = torch.library.custom_op(
    "k3lab::grouped_glu_bwd", glu_bwd, mutates_args=(),
    schema="(Tensor xs, Tensor dy, Tensor counts, Tensor w1, Tensor w2, Tensor w3, float b1, float b2, bool situ)"
           " -> (Tensor, Tensor, Tensor, Tensor)")
grouped_glu_bwd_op.register_fake(lambda xs, dy, counts, w1, w2, w3, b1, b2, situ: (
    xs.new_empty(xs.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape), w3.new_empty(w3.shape)))


def _setup_context(ctx, inputs, output):
    xs, counts, w1, w2, w3, ctx.b1, ctx.b2, ctx.situ = inputs
    ctx.save_for_backward(xs, counts, w1, w2, w3)  # the inputs only: the backward recomputes gate and up


def _backward(ctx, dy):
    xs, counts, w1, w2, w3 = ctx.saved_tensors
    dxs, dw1, dw2, dw3 = grouped_glu_bwd_op(xs, dy, counts, w1, w2, w3, ctx.b1, ctx.b2, ctx.situ)
    return dxs, None, dw1, dw2, dw3, None, None, None


grouped_glu_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_glu(xs: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, situ: bool, b1: float = 4.0,
                b2: float = 25.0) -> Tensor:
    """The experts' outputs y [M, W] for inputs xs [M, W] sorted by expert, counts [n] per expert, and
    weights w1, w2 [n, H, W], w3 [n, W, H] in xs's dtype (module docstring). situ: SiTU with caps b1, b2,
    else SwiGLU. The autograd graph keeps xs, counts and the weights; the backward reruns the gate and up
    products. Runs the Triton kernels: CUDA tensors, or CPU ones under TRITON_INTERPRET=1."""
    if not triton_available():
        raise ImportError("the fused grouped GLU needs triton, which is not installed")
    return grouped_glu_fwd_op(xs, counts, w1, w2, w3, float(b1), float(b2), situ)
