"""Fused Triton kernels for one AttnRes op (Attention Residuals, arXiv:2603.15031 eq. 2-3).

    d_i = q . v_i,   logit_i = d_i r_i,   alpha = softmax_i(logit),   h = sum_i alpha_i v_i

with S sources v_i [B, T, D] (bf16, fp16 or fp32, possibly mixed), r_i = 1/rms(v_i) [B, T, 1] fp32 and
q [D] = pseudo-query * RMSNorm weight. Same math as ``k3lab.model.attnres._DepthSoftmaxMix``; its
docstring lists the gradients.

The sources stay separate tensors: they reach the kernels as a tuple of pointers (S is a compile-time
constant, the source loop is unrolled), so nothing is stacked. One program owns BT token rows and the
whole of D (D <= MAX_D, padded to a power of two), every sum runs in fp32.
- forward ``_mix_fwd``: one read of each source, with an online softmax (running max m, running sum l,
  h rescaled as in flash attention), one write of h and of the raw logits [S, B, T] fp32, whose softmax
  over the sources (a small torch op) is alpha.
- backward, two kernels: ``_mix_bwd_scores`` reads g_h and each source once (giving g_alpha_i =
  <g_h, v_i> into an [S, N] buffer, c = sum_i alpha_i g_alpha_i / sum_i alpha_i per row in fp64, and g_q);
  ``_mix_bwd_values`` reads g_h again and writes g_v_i = alpha_i g_h + g_logit_i r_i q without reading
  v_i, and g_r_i = g_logit_i d_i with d_i = logit_i / r_i from the forward's logits. The per-row scalars
  cross between the passes through global memory at a kernel boundary
  (not a [BT, S] register tile, whose per-source selects make some launch shapes many times slower, nor
  memory inside one kernel, where the hand-off races with the loop pipelining).
  g_q = sum_i v_i^T (g_logit_i r_i) is accumulated in the first pass's single read as
  sum_i a_i r_i (g_alpha_i v_i) - c sum_i a_i r_i v_i, per program over a grid-stride loop of row
  blocks, and the per-program partial sums [n_programs, D] are added in torch.
Nothing is saved for backward but the inputs and the logits. Eager calls go through an autograd.Function; under
torch.compile the op and its backward are the custom ops ``k3lab::attnres_mix`` and
``k3lab::attnres_mix_backward``, which stay whole in the graph (no graph break).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .device import sm_count

MAX_SOURCES = 16  # one compiled kernel per (S, dtypes); full_attnres' 2L+1 sources go to torch above this
MAX_D = 8192
# Launch shapes: one token row per program; 16 elements of it per thread in the forward and in
# `_mix_bwd_values`, 32 in `_mix_bwd_scores`, whose grid-stride loop runs 16 programs per SM. On the H200
# (D = 1024, 32768 rows, `python -m benchmarks.attnres_bench --tune`, commit 49c557a) 32 elements per
# thread in the scores kernel took the whole backward from 0.438 to 0.396 ms at 7 sources (0.146 -> 0.131
# at 2, 0.230 -> 0.231 at 4), within 1.3% of the best launch tried for either backward kernel at 2, 4 and 7
# sources; the forward is within 12% of its best (1 warp at 2 and 7 sources, the default at 4).
ELEMENTS_PER_THREAD = 16
SCORES_ELEMENTS_PER_THREAD = 32
PROGRAMS_PER_SM = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _row_block(blk, N, D, BT: tl.constexpr, BD: tl.constexpr):
    """Rows blk*BT .. blk*BT+BT of a row-major [N, D] tensor: rows [BT], their mask, the [BT, BD] tile's
    mask and element offsets (int64)."""
    rows = blk * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    rmask = rows < N
    return rows, rmask, rmask[:, None] & (cols[None, :] < D), rows.to(tl.int64)[:, None] * D + cols[None, :]


@triton.jit
def _mix_fwd(vs, rs, q, h, logits, N, D, S: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """vs, rs: S pointers to v_i [N, D] and r_i [N]; q [D] fp32 -> h [N, D] and the raw logits [S, N]
    fp32 (alpha is their softmax over the sources, taken by the caller)."""
    rows, rmask, mask, offs = _row_block(tl.program_id(0), N, D, BT, BD)
    cols = tl.arange(0, BD)
    qv = tl.load(q + cols, mask=cols < D, other=0.0)
    m = tl.full([BT], float("-inf"), tl.float32)
    l = tl.zeros([BT], tl.float32)
    acc = tl.zeros([BT, BD], tl.float32)
    for i in tl.static_range(S):
        v = tl.load(vs[i] + offs, mask=mask, other=0.0).to(tl.float32)
        logit = tl.sum(v * qv[None, :], axis=1) * tl.load(rs[i] + rows, mask=rmask, other=0.0)
        tl.store(logits + i * N + rows, logit, mask=rmask)
        m_new = tl.maximum(m, logit)
        c = tl.exp(m - m_new)
        p = tl.exp(logit - m_new)
        acc = acc * c[:, None] + p[:, None] * v
        l = l * c + p
        m = m_new
    tl.store(h + offs, (acc / l[:, None]).to(h.dtype.element_ty), mask=mask)


@triton.jit
def _mix_bwd_scores(vs, rs, alpha, g_h, g_alpha, c_out, g_q, N, D, S: tl.constexpr,
                    BT: tl.constexpr, BD: tl.constexpr):
    """First backward pass, a grid-stride loop over row blocks: g_alpha_i = <g_h, v_i> [S, N] fp32,
    c = sum_j alpha_j g_alpha_j / sum_j alpha_j [N] fp64 (the sums in fp64, below), and this program's
    partial sum [n_programs, D] of g_q = sum_i v_i^T (g_logit_i r_i) = sum_i alpha_i r_i (g_alpha_i - c) v_i.
    Why fp64: for a source holding nearly all the weight, g_alpha_i and c agree in most of their digits, and
    an fp32 c loses them in g_alpha_i - c (4% error in that source's g_r_i). The fp64 products of fp32
    factors are exact; dividing by sum_j alpha_j (1 up to the softmax's rounding) makes g_alpha_i - c equal
    sum_j alpha_j (g_alpha_i - g_alpha_j) / sum_j alpha_j, whose terms each are small."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    cmask = cols < D
    gq = tl.zeros([BD], tl.float32)
    for blk in range(pid, tl.cdiv(N, BT), tl.num_programs(0)):
        rows, rmask, mask, offs = _row_block(blk, N, D, BT, BD)
        gh = tl.load(g_h + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.zeros([BT], tl.float64)
        a_sum = tl.zeros([BT], tl.float64)
        av = tl.zeros([BT, BD], tl.float32)   # sum_i alpha_i r_i v_i
        agv = tl.zeros([BT, BD], tl.float32)  # sum_i alpha_i r_i g_alpha_i v_i
        for i in tl.static_range(S):
            v = tl.load(vs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            a_i = tl.load(alpha + i * N + rows, mask=rmask, other=0.0)
            r_i = tl.load(rs[i] + rows, mask=rmask, other=0.0)
            g_a = tl.sum(gh * v, axis=1)
            tl.store(g_alpha + i * N + rows, g_a, mask=rmask)
            c += a_i.to(tl.float64) * g_a.to(tl.float64)
            a_sum += a_i.to(tl.float64)
            arv = (a_i * r_i)[:, None] * v
            av += arv
            agv += g_a[:, None] * arv
        c = c / tl.where(rmask, a_sum, 1.0)
        tl.store(c_out + rows, c, mask=rmask)
        if S > 1:  # g_q = 0 exactly for one source (a rounding residue here would move q under Adam)
            gq += tl.sum(agv - c.to(tl.float32)[:, None] * av, axis=0)
    tl.store(g_q + pid * D + cols, gq, mask=cmask)


@triton.jit
def _mix_bwd_values(rs, g_vs, q, alpha, logits, g_h, g_alpha, c_in, g_r, N, D, S: tl.constexpr,
                    BT: tl.constexpr, BD: tl.constexpr):
    """Second backward pass, BT rows per program: g_logit_i = alpha_i (g_alpha_i - c) (the difference in
    fp64, see ``_mix_bwd_scores``), g_r_i = g_logit_i d_i with d_i = q . v_i = logit_i / r_i [S, N] fp32,
    and g_v_i = alpha_i g_h + g_logit_i r_i q [N, D], without reading v_i."""
    rows, rmask, mask, offs = _row_block(tl.program_id(0), N, D, BT, BD)
    cols = tl.arange(0, BD)
    qv = tl.load(q + cols, mask=cols < D, other=0.0)
    gh = tl.load(g_h + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_in + rows, mask=rmask, other=0.0)
    for i in tl.static_range(S):
        a_i = tl.load(alpha + i * N + rows, mask=rmask, other=0.0)
        g_a = tl.load(g_alpha + i * N + rows, mask=rmask, other=0.0)
        r_i = tl.load(rs[i] + rows, mask=rmask, other=1.0)
        g_logit = a_i * (g_a.to(tl.float64) - c).to(tl.float32)
        logit = tl.load(logits + i * N + rows, mask=rmask, other=0.0)
        tl.store(g_r + i * N + rows, g_logit * (logit / r_i), mask=rmask)
        g_v = a_i[:, None] * gh + (g_logit * r_i)[:, None] * qv[None, :]
        tl.store(g_vs[i] + offs, g_v.to(g_vs[i].dtype.element_ty), mask=mask)


def default_launch(D: int, per_thread: int = ELEMENTS_PER_THREAD) -> tuple[int, int]:
    """(rows per program BT, num_warps) for width D: one row, `per_thread` elements of its padded width per
    thread (at least one warp, at most 32)."""
    return 1, max(1, min(32, triton.next_power_of_2(D) // (32 * per_thread)))


def supported(values, inv_rms, query) -> bool:
    """Whether the kernels take this op: 1..MAX_SOURCES sources of one shape [B, T, D], D <= MAX_D, on one
    device, in bf16/fp16/fp32, inv_rms fp32."""
    v0 = values[0]
    return (0 < len(values) <= MAX_SOURCES and v0.dim() == 3 and v0.shape[-1] <= MAX_D
            and all(v.shape == v0.shape and v.dtype in DTYPES and v.device == v0.device for v in values)
            and all(r.dtype == torch.float32 and r.numel() == v0.numel() // v0.shape[-1] for r in inv_rms)
            and query.shape == v0.shape[-1:])


def mix_forward(values: list[torch.Tensor], inv_rms: list[torch.Tensor], query: torch.Tensor, *,
                launch: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch `_mix_fwd`: values S x [B, T, D], inv_rms S x [B, T, 1] fp32, query [D] -> h [B, T, D]
    (dtype promoted over the values), the raw logits [S, B, T] fp32 (alpha is their softmax over dim 0).
    launch: (rows per program, num_warps), default `default_launch(D)`; the results do not depend on it."""
    h, logits = _empty_forward(values, inv_rms, query)
    values = [v.contiguous() for v in values]
    B, T, D = values[0].shape
    N, S = B * T, len(values)
    BT, warps = launch or default_launch(D)
    _mix_fwd[(triton.cdiv(N, BT),)](tuple(values), tuple(r.contiguous() for r in inv_rms), query.float().contiguous(),
                                     h, logits, N, D, S=S, BT=BT, BD=triton.next_power_of_2(D), num_warps=warps)
    return h, logits


def _empty_forward(values, inv_rms, query):
    B, T, D = values[0].shape
    h = values[0].new_empty(B, T, D, dtype=functools.reduce(torch.promote_types, [v.dtype for v in values]))
    return h, values[0].new_empty(len(values), B, T, dtype=torch.float32)


def mix_backward(
    values: list[torch.Tensor], inv_rms: list[torch.Tensor], query: torch.Tensor, logits: torch.Tensor,
    g_h: torch.Tensor, *, launch: tuple[int, int] | None = None, scores_launch: tuple[int, int] | None = None,
    programs: int | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Launch `_mix_bwd_scores` then `_mix_bwd_values` on the forward's raw logits [S, B, T]: -> g_values
    S x [B, T, D] (the values' dtypes), g_r [S, B, T] fp32, g_q [D] fp32.
    launch, scores_launch: (rows per program, num_warps) of the values and the scores kernel, default
    `default_launch(D)` and `default_launch(D, SCORES_ELEMENTS_PER_THREAD)`; programs: size of the scores
    kernel's grid-stride grid, default PROGRAMS_PER_SM per SM. g_q's summation order depends on
    scores_launch and programs, nothing else does."""
    values = [v.contiguous() for v in values]
    B, T, D = values[0].shape
    N, S = B * T, len(values)
    BT, warps = launch or default_launch(D)
    BT_s, warps_s = scores_launch or default_launch(D, SCORES_ELEMENTS_PER_THREAD)
    BD = triton.next_power_of_2(D)
    n_prog = min(triton.cdiv(N, BT_s), programs or PROGRAMS_PER_SM * sm_count(values[0].device))
    g_values = [torch.empty_like(v) for v in values]
    logits = logits.contiguous()
    alpha = torch.softmax(logits, dim=0)
    g_r, g_alpha = torch.empty_like(alpha), torch.empty_like(alpha)
    c = alpha.new_empty(N, dtype=torch.float64)
    g_q = alpha.new_empty(n_prog, D)
    rs, q, g_h = tuple(r.contiguous() for r in inv_rms), query.float().contiguous(), g_h.contiguous()
    _mix_bwd_scores[(n_prog,)](tuple(values), rs, alpha, g_h, g_alpha, c, g_q, N, D, S=S, BT=BT_s, BD=BD,
                               num_warps=warps_s)
    _mix_bwd_values[(triton.cdiv(N, BT),)](rs, tuple(g_values), q, alpha, logits, g_h, g_alpha, c, g_r, N, D,
                                           S=S, BT=BT, BD=BD, num_warps=warps)
    return g_values, g_r, g_q.sum(0)


def _save(ctx, values, inv_rms, query, logits):
    ctx.n = len(values)
    ctx.save_for_backward(query, logits, *values, *inv_rms)
    ctx.mark_non_differentiable(logits)


def _grads(ctx, g_h, backward):
    """(g_values, g_inv_rms, g_query) from the tensors `_save` kept, via `backward` (a `mix_backward`)."""
    query, logits, *tensors = ctx.saved_tensors
    values, scales = tensors[:ctx.n], tensors[ctx.n:]
    g_values, g_r, g_q = backward(values, scales, query, logits, g_h)
    return g_values, [g.view(r.shape) for g, r in zip(g_r, scales)], g_q.to(query.dtype)


class _EagerMix(torch.autograd.Function):
    """The op in eager mode: about half the per-call CPU cost of going through the custom ops."""

    @staticmethod
    def forward(ctx, query, n, *tensors):
        values, scales = list(tensors[:n]), list(tensors[n:])
        h, logits = mix_forward(values, scales, query)
        _save(ctx, values, scales, query, logits)
        return h, logits

    @staticmethod
    def backward(ctx, g_h, _g_logits):
        g_values, g_scales, g_q = _grads(ctx, g_h, mix_backward)
        return g_q, None, *g_values, *g_scales


# Under torch.compile the op and its backward are custom ops, kept whole in the graph (no graph break).
# Their schemas leave out the launch keywords (benchmark knobs that do not change the results).
mix_op = torch.library.custom_op("k3lab::attnres_mix", mix_forward, mutates_args=(),
                                 schema="(Tensor[] values, Tensor[] inv_rms, Tensor query) -> (Tensor, Tensor)")
mix_op.register_fake(_empty_forward)
mix_backward_op = torch.library.custom_op(
    "k3lab::attnres_mix_backward", mix_backward, mutates_args=(),
    schema="(Tensor[] values, Tensor[] inv_rms, Tensor query, Tensor logits, Tensor g_h) -> (Tensor[], Tensor, Tensor)")
mix_backward_op.register_fake(lambda values, inv_rms, query, logits, g_h: (
    [torch.empty_like(v) for v in values], torch.empty_like(logits), logits.new_empty(query.shape[0])))
mix_op.register_autograd(lambda ctx, g_h, _g_logits: _grads(ctx, g_h, mix_backward_op),
                         setup_context=lambda ctx, inputs, output: _save(ctx, *inputs, output[1]))


def attnres_mix_triton(values: list[torch.Tensor], inv_rms: list[torch.Tensor], query: torch.Tensor):
    """values S x [B, T, D], inv_rms S x [B, T, 1] fp32, query [D] -> h [B, T, D] (dtype promoted over the
    values), alpha [S, B, T] fp32 (not differentiable). Check `supported` first."""
    if torch.compiler.is_compiling():
        h, logits = mix_op(values, inv_rms, query)
    else:
        h, logits = _EagerMix.apply(query, len(values), *values, *inv_rms)
    return h, torch.softmax(logits, dim=0)
