"""Fused Triton kernels for two-phase Block AttnRes (Attention Residuals, arXiv:2603.15031 section 3.2).

The ops of one block see the same completed sources v_1..v_S and differ in their queries q_j and partial
sums. Phase 1 mixes the sources for all Q queries of the block in one pass:

    l_ji = (q_j . v_i) r_i,   lse_j = logsumexp_i l_ji,   alpha_ji = exp(l_ji - lse_j),   o_j = sum_i alpha_ji v_i

phase 2 merges op j's partial sum p into o_j as one more softmax term:

    r = 1 / sqrt(mean(p^2) + eps),   d = q_j . p,   z = d r - lse_j,   w = sigmoid(z),   h = o_j + w (p - o_j)

which is the one-phase mix (kernels/attnres.py) over [v_1..v_S, p] rewritten. Same math as
``k3lab.model.attnres._BlockSoftmaxMix`` and ``_MergePartial`` (with r = ``inv_rms(p)``), whose docstrings list
the gradients; the sources v_i [B, T, D] are bf16, fp16 or fp32 (possibly mixed), r_i [B, T, 1] fp32, the
queries [Q, D] are the pseudo-queries times their RMSNorm weights. Every sum runs in fp32; one program owns one
token row.
- phase 1 forward ``_block_mix_fwd``: the sources reach it as a tuple of S pointers and the outputs o_j as a
  tuple of Q pointers (S and Q compile-time, nothing stacked: a [QP, BD] tile of pointers picks o_j's row for
  tile row j); the program holds the queries as a [QP, BD] tile (Q and D padded to powers of two), reads each
  source row once and runs an online softmax per query (running max and sum, o rescaled as in flash
  attention). It writes o_j [B, T, D] each, lse [Q, B, T] fp32 and the raw logits [Q, S, B, T] fp32.
- phase 1 backward, two kernels as in kernels/attnres.py, with lse rebuilt from the logits by the forward's
  online recurrence, alpha from both, and g_l_ji = alpha_ji (g_alpha_ji - c_j + g_lse_j),
  c_j = sum_i alpha_ji g_alpha_ji (g_lse is zero unless a merge used lse): ``_block_mix_bwd_scores`` (a
  grid-stride loop over rows) reads each g_o_j and each source once, writes g_alpha_ji = <g_o_j, v_i> and c_j
  (the centred difference in fp64, see ``kernels.attnres._mix_bwd_scores``) and sums
  g_q_j = sum_i g_l_ji r_i v_i per program; ``_block_mix_bwd_values`` writes
  g_v_i = sum_j (alpha_ji g_o_j + g_l_ji r_i q_j) without reading v_i and g_r_i = sum_j g_l_ji d_ji with
  d_ji = l_ji / r_i.
- merge forward ``_merge_fwd``: one read of o and p, computes r itself (fp32, ``inv_rms``'s formula) and
  writes h (promoted dtype), w, delta = p - o [B, T, D] (p's dtype) and z, r [B, T] fp32. Backward ``_merge_bwd`` (a
  grid-stride loop over rows, for g_q's sum over rows), with p = h + (1 - w) delta and d = q . p rebuilt:
  g_z = w (1 - w) <g_h, delta>, g_o = (1 - w) g_h, g_lse = -g_z, g_q = sum_rows g_z r p and
  g_p = w g_h + g_z r q - g_r r^3 p / D with g_r = g_z d (the last term through r).
  1 - w is sigmoid(-z), not 1 - sigmoid(z), which loses its digits when w is near 1.
Saved for backward: phase 1 keeps its inputs (the sources, their 1/rms and the queries) and the logits, not o
and not lse; the merge keeps h (its output), delta, the per-row z and r and its query, not o and not p. Inside
AttnResidual this is what the one-phase mixes of the block's ops keep, tensor for tensor: op j's input h_j (o_0
for the first op, which keeps no other o_j alive as the o_j are separate tensors; the merge's h for the others)
is kept by the next sublayer's RMSNorm anyway; each merged op keeps one [B, T, D] in p's dtype (delta where the
one-phase mix keeps the partial sum p: under bf16 autocast the sources are fp32 and p bf16, and delta in the
promoted dtype would keep twice p's bytes) and two [B, T] fp32 (z and r where it keeps p's logit and 1/rms(p));
the block keeps its queries [Q, D] (AttnResidual passes the merges rows of phase 1's queries) and logits
[Q, S, B, T]. Cost: delta is rounded to p's dtype and h to the promoted one, so with bf16 p the gradients through
g_z and the rebuilt p (g_lse, g_q and g_p's terms in q and p) carry bf16 rounding (about 3e-3 relative).
Launch shapes as kernels/attnres.py's (`default_launch` over the [QP, BD] tile). On the H200 (D = 1024,
16384 rows, bf16, S = 3, Q = 2, on top of commit e2c1fde; measured with the merge taking r as an input, phase 1
writing o as one [Q, B, T, D] tensor and keeping lse): phase 1 forward 77 us, backward 196 us; merge forward
84 us, backward 89 us (a copy of one [16384, 1024] bf16 tensor: 21 us).
Eager calls go through autograd.Functions; under torch.compile the phases and their backwards are the custom ops
``k3lab::attnres_block_mix``, ``k3lab::attnres_merge`` and their ``_backward`` ops, kept whole in the graph (no
graph break).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .attnres import DTYPES, MAX_D, MAX_SOURCES, PROGRAMS_PER_SM, SCORES_ELEMENTS_PER_THREAD, default_launch
from .device import sm_count

# The queries padded to a power of two times D padded: the forward's accumulator tile per row, held in
# registers (16 elements per thread at 32 warps). Larger blocks of ops go to torch.
MAX_QUERY_TILE = 16384


@triton.jit
def _query_tile(queries, D, Q: tl.constexpr, QP: tl.constexpr, BD: tl.constexpr):
    """The queries [Q, D] fp32 as a [QP, BD] tile, zero-padded."""
    qs = tl.arange(0, QP)
    cols = tl.arange(0, BD)
    mask = (qs < Q)[:, None] & (cols < D)[None, :]
    return tl.load(queries + qs[:, None] * D + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _query_row_ptrs(tensors, row, D, Q: tl.constexpr, QP: tl.constexpr, BD: tl.constexpr):
    """Row `row` of each of Q row-major [N, D] tensors (`tensors`: a tuple of Q pointers), as one [QP, BD] tile:
    (pointers, mask); tile row j points into tensors[j], the padding rows into tensors[0] (masked). The base
    pointers are picked per query ([QP] selects), then offset."""
    qs = tl.arange(0, QP)
    cols = tl.arange(0, BD)
    bases = tensors[0] + tl.zeros([QP], tl.int64)
    for j in tl.static_range(1, Q):
        bases = tl.where(qs == j, tensors[j], bases)
    return bases[:, None] + (tl.cast(row, tl.int64) * D + cols)[None, :], (qs < Q)[:, None] & (cols < D)[None, :]


@triton.jit
def _row_lse(logits, row, N, Q: tl.constexpr, S: tl.constexpr, QP: tl.constexpr):
    """lse_j = logsumexp_i l_ji [QP] fp32 of token row `row` from the raw logits [Q, S, N] fp32, by the forward's
    online recurrence (log S for the padding queries)."""
    qs = tl.arange(0, QP)
    m = tl.full([QP], float("-inf"), tl.float32)
    l = tl.zeros([QP], tl.float32)
    for i in tl.static_range(S):
        logit = tl.load(logits + (qs * S + i) * N + row, mask=qs < Q, other=0.0)
        m_new = tl.maximum(m, logit)
        l = l * tl.exp(m - m_new) + tl.exp(logit - m_new)
        m = m_new
    return m + tl.log(l)


@triton.jit
def _block_mix_fwd(vs, rs, queries, outs, lse, logits, N, D, Q: tl.constexpr, S: tl.constexpr, QP: tl.constexpr,
                   BD: tl.constexpr):
    """vs, rs: S pointers to v_i [N, D] and r_i [N]; queries [Q, D] fp32 -> outs: Q pointers to o_j [N, D],
    lse [Q, N] fp32 and the raw logits [Q, S, N] fp32. One token row per program, all Q queries at once."""
    row = tl.program_id(0)
    cols = tl.arange(0, BD)
    qs = tl.arange(0, QP)
    qmask = qs < Q
    qv = _query_tile(queries, D, Q, QP, BD)
    m = tl.full([QP], float("-inf"), tl.float32)
    l = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, BD], tl.float32)
    for i in tl.static_range(S):
        v = tl.load(vs[i] + tl.cast(row, tl.int64) * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        logit = tl.sum(qv * v[None, :], axis=1) * tl.load(rs[i] + row)
        tl.store(logits + (qs * S + i) * N + row, logit, mask=qmask)
        m_new = tl.maximum(m, logit)
        c = tl.exp(m - m_new)
        p = tl.exp(logit - m_new)
        acc = acc * c[:, None] + p[:, None] * v[None, :]
        l = l * c + p
        m = m_new
    o_ptrs, o_mask = _query_row_ptrs(outs, row, D, Q, QP, BD)
    tl.store(o_ptrs, (acc / l[:, None]).to(outs[0].dtype.element_ty), mask=o_mask)
    tl.store(lse + qs * N + row, m + tl.log(l), mask=qmask)


@triton.jit
def _block_mix_bwd_scores(vs, rs, logits, g_os, g_lse, g_alpha, c_out, g_q, N, D, Q: tl.constexpr,
                          S: tl.constexpr, QP: tl.constexpr, BD: tl.constexpr):
    """First backward pass, a grid-stride loop over token rows, g_os: Q pointers to g_o_j [N, D]:
    g_alpha_ji = <g_o_j, v_i> [Q, S, N] fp32, c_j = sum_i alpha_ji g_alpha_ji / sum_i alpha_ji [Q, N] fp64 (why
    fp64: ``kernels.attnres._mix_bwd_scores``) and this program's partial sum [n_programs, Q, D] of
    g_q_j = sum_i g_l_ji r_i v_i = sum_i alpha_ji r_i g_alpha_ji v_i + (g_lse_j - c_j) sum_i alpha_ji r_i v_i."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    qs = tl.arange(0, QP)
    qmask = qs < Q
    gq = tl.zeros([QP, BD], tl.float32)
    for row in range(pid, N, tl.num_programs(0)):
        go_ptrs, go_mask = _query_row_ptrs(g_os, row, D, Q, QP, BD)
        go = tl.load(go_ptrs, mask=go_mask, other=0.0).to(tl.float32)
        lse_j = _row_lse(logits, row, N, Q, S, QP)
        c = tl.zeros([QP], tl.float64)
        a_sum = tl.zeros([QP], tl.float64)
        av = tl.zeros([QP, BD], tl.float32)   # sum_i alpha_ji r_i v_i
        agv = tl.zeros([QP, BD], tl.float32)  # sum_i alpha_ji r_i g_alpha_ji v_i
        for i in tl.static_range(S):
            v = tl.load(vs[i] + tl.cast(row, tl.int64) * D + cols, mask=cols < D, other=0.0).to(tl.float32)
            logit = tl.load(logits + (qs * S + i) * N + row, mask=qmask, other=0.0)
            a = tl.where(qmask, tl.exp(logit - lse_j), 0.0)
            g_a = tl.sum(go * v[None, :], axis=1)
            tl.store(g_alpha + (qs * S + i) * N + row, g_a, mask=qmask)
            c += a.to(tl.float64) * g_a.to(tl.float64)
            a_sum += a.to(tl.float64)
            arv = (a * tl.load(rs[i] + row))[:, None] * v[None, :]
            av += arv
            agv += g_a[:, None] * arv
        c = c / tl.where(qmask, a_sum, 1.0)
        tl.store(c_out + qs * N + row, c, mask=qmask)
        if S > 1:  # g_alpha - c = 0 exactly for one source (a rounding residue here would move q under Adam)
            gq += agv - c.to(tl.float32)[:, None] * av
        gq += tl.load(g_lse + qs * N + row, mask=qmask, other=0.0)[:, None] * av
    tl.store(g_q + pid * Q * D + qs[:, None] * D + cols[None, :], gq, mask=qmask[:, None] & (cols < D)[None, :])


@triton.jit
def _block_mix_bwd_values(rs, g_vs, queries, logits, g_os, g_lse, g_alpha, c_in, g_r, N, D, Q: tl.constexpr,
                          S: tl.constexpr, QP: tl.constexpr, BD: tl.constexpr):
    """Second backward pass, one token row per program: g_l_ji = alpha_ji (g_alpha_ji - c_j + g_lse_j) (the
    difference in fp64), g_r_i = sum_j g_l_ji d_ji with d_ji = l_ji / r_i [S, N] fp32 and
    g_v_i = sum_j (alpha_ji g_o_j + g_l_ji r_i q_j) [N, D], without reading v_i."""
    row = tl.program_id(0)
    cols = tl.arange(0, BD)
    qs = tl.arange(0, QP)
    qmask = qs < Q
    qv = _query_tile(queries, D, Q, QP, BD)
    go_ptrs, go_mask = _query_row_ptrs(g_os, row, D, Q, QP, BD)
    go = tl.load(go_ptrs, mask=go_mask, other=0.0).to(tl.float32)
    lse_j = _row_lse(logits, row, N, Q, S, QP)
    g_lse_j = tl.load(g_lse + qs * N + row, mask=qmask, other=0.0)
    c = tl.load(c_in + qs * N + row, mask=qmask, other=0.0)
    for i in tl.static_range(S):
        logit = tl.load(logits + (qs * S + i) * N + row, mask=qmask, other=0.0)
        a = tl.where(qmask, tl.exp(logit - lse_j), 0.0)
        g_a = tl.load(g_alpha + (qs * S + i) * N + row, mask=qmask, other=0.0)
        r_i = tl.load(rs[i] + row)
        g_l = a * ((g_a.to(tl.float64) - c).to(tl.float32) + g_lse_j)
        tl.store(g_r + i * N + row, tl.sum(g_l * (logit / r_i), axis=0))
        g_v = tl.sum(a[:, None] * go + (g_l * r_i)[:, None] * qv, axis=0)
        tl.store(g_vs[i] + tl.cast(row, tl.int64) * D + cols, g_v.to(g_vs[i].dtype.element_ty), mask=cols < D)


@triton.jit
def _merge_fwd(o, lse, p, q, h, w, delta, z, r, N, D, eps, BD: tl.constexpr):
    """o, p [N, D], lse [N] fp32, q [D] fp32 -> h = o + w (p - o) [N, D] (promoted dtype), delta = p - o (p's dtype),
    w = sigmoid(z), z = (q . p) r - lse and r = 1 / sqrt(mean(p^2) + eps) [N] fp32. One token row per program."""
    row = tl.program_id(0)
    cols = tl.arange(0, BD)
    cmask = cols < D
    offs = tl.cast(row, tl.int64) * D + cols
    ov = tl.load(o + offs, mask=cmask, other=0.0).to(tl.float32)
    pv = tl.load(p + offs, mask=cmask, other=0.0).to(tl.float32)
    rr = tl.rsqrt(tl.sum(pv * pv, axis=0) / D + eps)
    zr = tl.sum(tl.load(q + cols, mask=cmask, other=0.0) * pv, axis=0) * rr - tl.load(lse + row)
    wr = tl.sigmoid(zr)
    dv = pv - ov
    hv = tl.where(wr < 0.5, ov + wr * dv, pv - tl.sigmoid(-zr) * dv)  # the nearer end, as torch.lerp
    tl.store(h + offs, hv.to(h.dtype.element_ty), mask=cmask)
    tl.store(delta + offs, dv.to(delta.dtype.element_ty), mask=cmask)
    tl.store(w + row, wr)
    tl.store(z + row, zr)
    tl.store(r + row, rr)


@triton.jit
def _merge_bwd(g_h, h, delta, z, r, q, g_o, g_lse, g_p, g_q, N, D, BD: tl.constexpr):
    """A grid-stride loop over token rows, with w = sigmoid(z), 1 - w = sigmoid(-z), p = h + (1 - w) delta rebuilt
    and d = q . p: g_z = w (1 - w) <g_h, delta>, g_o = (1 - w) g_h, g_p = w g_h + g_z r q - g_z d r^3 p / D
    [N, D], g_lse = -g_z [N] fp32, and this program's partial sum [n_programs, D] of g_q = sum_rows g_z r p."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    cmask = cols < D
    qv = tl.load(q + cols, mask=cmask, other=0.0)
    gq = tl.zeros([BD], tl.float32)
    for row in range(pid, N, tl.num_programs(0)):
        offs = tl.cast(row, tl.int64) * D + cols
        gh = tl.load(g_h + offs, mask=cmask, other=0.0).to(tl.float32)
        dv = tl.load(delta + offs, mask=cmask, other=0.0).to(tl.float32)
        zr = tl.load(z + row)
        rr = tl.load(r + row)
        wr = tl.sigmoid(zr)
        wc = tl.sigmoid(-zr)
        pv = tl.load(h + offs, mask=cmask, other=0.0).to(tl.float32) + wc * dv
        g_z = wr * wc * tl.sum(gh * dv, axis=0)
        g_dot = g_z * rr
        g_rms = g_z * tl.sum(qv * pv, axis=0) * rr * rr * rr / D  # g_r r^3 / D, g_r = g_z d
        tl.store(g_o + offs, (wc * gh).to(g_o.dtype.element_ty), mask=cmask)
        tl.store(g_p + offs, (wr * gh + g_dot * qv - g_rms * pv).to(g_p.dtype.element_ty), mask=cmask)
        tl.store(g_lse + row, -g_z)
        gq += g_dot * pv
    tl.store(g_q + pid * D + cols, gq, mask=cmask)


def _tile(Q: int, D: int) -> tuple[int, int]:
    """(QP, BD): the query count and the width padded to powers of two."""
    return triton.next_power_of_2(Q), triton.next_power_of_2(D)


def supported(values, inv_rms, queries) -> bool:
    """Whether the phase-1 kernels take this block: 1..MAX_SOURCES sources of one shape [B, T, D], D <= MAX_D,
    on one device, in bf16/fp16/fp32, inv_rms fp32, queries [Q, D] with Q and D padded to powers of two
    multiplying to at most MAX_QUERY_TILE."""
    v0 = values[0]
    return (0 < len(values) <= MAX_SOURCES and v0.dim() == 3 and v0.shape[-1] <= MAX_D
            and all(v.shape == v0.shape and v.dtype in DTYPES and v.device == v0.device for v in values)
            and all(r.dtype == torch.float32 and r.numel() == v0.numel() // v0.shape[-1] for r in inv_rms)
            and queries.dim() == 2 and queries.shape[0] > 0 and queries.shape[1] == v0.shape[-1]
            and queries.device == v0.device and math.prod(_tile(*queries.shape)) <= MAX_QUERY_TILE)


def merge_supported(o, lse, p, query) -> bool:
    """Whether the merge kernels take this op: o and p of one shape [B, T, D], D <= MAX_D, in bf16/fp16/fp32,
    lse fp32 with one entry per row, query [D], all on one device."""
    return (o.dim() == 3 and p.shape == o.shape and o.shape[-1] <= MAX_D and o.dtype in DTYPES
            and p.dtype in DTYPES and lse.dtype == torch.float32 and lse.numel() == o.numel() // o.shape[-1]
            and query.shape == o.shape[-1:] and all(t.device == o.device for t in (lse, p, query)))


def _empty_block_mix(values, inv_rms, queries):
    B, T, D = values[0].shape
    Q = queries.shape[0]
    dtype = functools.reduce(torch.promote_types, [v.dtype for v in values])
    return ([values[0].new_empty(B, T, D, dtype=dtype) for _ in range(Q)],
            values[0].new_empty(Q, B, T, dtype=torch.float32),
            values[0].new_empty(Q, len(values), B, T, dtype=torch.float32))


def block_mix_forward(values: list[torch.Tensor], inv_rms: list[torch.Tensor], queries: torch.Tensor
                      ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Launch `_block_mix_fwd`: values S x [B, T, D], inv_rms S x [B, T, 1] fp32, queries [Q, D] -> o Q x [B, T, D]
    (separate tensors, dtype promoted over the values), lse [Q, B, T] fp32, the raw logits [Q, S, B, T] fp32."""
    o, lse, logits = _empty_block_mix(values, inv_rms, queries)
    values = [v.contiguous() for v in values]
    B, T, D = values[0].shape
    Q = queries.shape[0]
    QP, BD = _tile(Q, D)
    _block_mix_fwd[(B * T,)](tuple(values), tuple(r.contiguous() for r in inv_rms), queries.float().contiguous(),
                             tuple(o), lse, logits, B * T, D, Q=Q, S=len(values), QP=QP, BD=BD,
                             num_warps=default_launch(QP * BD)[1])
    return o, lse, logits


def block_mix_backward(
    values: list[torch.Tensor], inv_rms: list[torch.Tensor], queries: torch.Tensor, logits: torch.Tensor,
    g_o: list[torch.Tensor], g_lse: torch.Tensor, *, programs: int | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Launch `_block_mix_bwd_scores` then `_block_mix_bwd_values` on the forward's logits [Q, S, B, T] (lse is
    rebuilt from them), with the cotangents g_o Q x [B, T, D] (one dtype) and g_lse [Q, B, T]: -> g_values
    S x [B, T, D] (the values' dtypes), g_r [S, B, T] fp32, g_q [Q, D] fp32. programs: size of the scores
    kernel's grid-stride grid, default PROGRAMS_PER_SM per SM; g_q's summation order depends on it, nothing
    else does."""
    values = [v.contiguous() for v in values]
    B, T, D = values[0].shape
    N, S, Q = B * T, len(values), queries.shape[0]
    QP, BD = _tile(Q, D)
    n_prog = min(N, programs or PROGRAMS_PER_SM * sm_count(values[0].device))
    g_values = [torch.empty_like(v) for v in values]
    g_r = logits.new_empty(S, B, T)
    g_alpha = torch.empty_like(logits)
    c = logits.new_empty(Q, N, dtype=torch.float64)
    g_q = logits.new_empty(n_prog, Q, D)
    rs, logits, queries = tuple(r.contiguous() for r in inv_rms), logits.contiguous(), queries.float().contiguous()
    g_o, g_lse = tuple(g.contiguous() for g in g_o), g_lse.float().contiguous()
    _block_mix_bwd_scores[(n_prog,)](tuple(values), rs, logits, g_o, g_lse, g_alpha, c, g_q, N, D, Q=Q, S=S, QP=QP,
                                     BD=BD, num_warps=default_launch(QP * BD, SCORES_ELEMENTS_PER_THREAD)[1])
    _block_mix_bwd_values[(N,)](rs, tuple(g_values), queries, logits, g_o, g_lse, g_alpha, c, g_r, N, D, Q=Q, S=S,
                                QP=QP, BD=BD, num_warps=default_launch(QP * BD)[1])
    return g_values, g_r, g_q.sum(0)


def _empty_merge(o, lse, p, query, eps):
    h = o.new_empty(o.shape, dtype=torch.promote_types(o.dtype, p.dtype))
    w, z, r = (o.new_empty(o.shape[:-1], dtype=torch.float32) for _ in range(3))
    return h, w, torch.empty_like(p, memory_format=torch.contiguous_format), z, r


def merge_forward(o: torch.Tensor, lse: torch.Tensor, p: torch.Tensor, query: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch `_merge_fwd`: o, p [B, T, D], lse [B, T] fp32, query [D] -> h [B, T, D] (dtype promoted over o and
    p), delta = p - o [B, T, D] (p's dtype), w, z, r = 1/rms(p) [B, T] fp32."""
    h, w, delta, z, r = _empty_merge(o, lse, p, query, eps)
    B, T, D = o.shape
    _merge_fwd[(B * T,)](o.contiguous(), lse.contiguous(), p.contiguous(), query.float().contiguous(), h, w, delta,
                         z, r, B * T, D, eps, BD=triton.next_power_of_2(D), num_warps=default_launch(D)[1])
    return h, w, delta, z, r


def merge_backward(
    h: torch.Tensor, delta: torch.Tensor, z: torch.Tensor, r: torch.Tensor, query: torch.Tensor, g_h: torch.Tensor,
    o_dtype: torch.dtype, p_dtype: torch.dtype, *, programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch `_merge_bwd` on the forward's h, delta [B, T, D], z, r [B, T]: -> g_o [B, T, D] (o_dtype), g_lse
    [B, T] fp32, g_p [B, T, D] (p_dtype, through 1/rms(p) too), g_q [D] fp32. programs: size of the grid-stride
    grid, default PROGRAMS_PER_SM per SM; g_q's summation order depends on it, nothing else does."""
    B, T, D = h.shape
    N = B * T
    n_prog = min(N, programs or PROGRAMS_PER_SM * sm_count(h.device))
    g_o, g_p = h.new_empty(h.shape, dtype=o_dtype), h.new_empty(h.shape, dtype=p_dtype)
    g_lse = torch.empty_like(z)
    g_q = z.new_empty(n_prog, D)
    _merge_bwd[(n_prog,)](g_h.contiguous(), h, delta, z, r, query.float().contiguous(), g_o, g_lse, g_p, g_q, N, D,
                          BD=triton.next_power_of_2(D), num_warps=default_launch(D)[1])
    return g_o, g_lse, g_p, g_q.sum(0)


def _save_block_mix(ctx, values, inv_rms, queries, logits):
    ctx.n = len(values)
    ctx.save_for_backward(queries, logits, *values, *inv_rms)
    ctx.mark_non_differentiable(logits)


def _block_mix_grads(ctx, g_o, g_lse, backward):
    """(g_values, g_inv_rms, g_queries) from the tensors `_save_block_mix` kept, via `backward` (a
    `block_mix_backward`)."""
    queries, logits, *tensors = ctx.saved_tensors
    values, scales = tensors[:ctx.n], tensors[ctx.n:]
    g_values, g_r, g_q = backward(values, scales, queries, logits, list(g_o), g_lse)
    return g_values, [g.view(r.shape) for g, r in zip(g_r, scales)], g_q.to(queries.dtype)


def _save_merge(ctx, o, p, query, h, w, delta, z, r):
    ctx.o_dtype, ctx.p_dtype = o.dtype, p.dtype
    ctx.save_for_backward(h, delta, z, r, query)
    ctx.mark_non_differentiable(w, delta, z, r)


def _merge_grads(ctx, g_h, backward):
    """(g_o, g_lse, g_p, g_query, None for eps) from the tensors `_save_merge` kept, via `backward` (a
    `merge_backward`)."""
    h, delta, z, r, query = ctx.saved_tensors
    g_o, g_lse, g_p, g_q = backward(h, delta, z, r, query, g_h, ctx.o_dtype, ctx.p_dtype)
    return g_o, g_lse, g_p, g_q.to(query.dtype), None


class _EagerBlockMix(torch.autograd.Function):
    """Phase 1 in eager mode (cheaper per call than going through the custom ops): -> (*o, lse, logits)."""

    @staticmethod
    def forward(ctx, queries, n, *tensors):
        values, scales = list(tensors[:n]), list(tensors[n:])
        o, lse, logits = block_mix_forward(values, scales, queries)
        _save_block_mix(ctx, values, scales, queries, logits)
        return *o, lse, logits

    @staticmethod
    def backward(ctx, *grads):
        *g_o, g_lse, _g_logits = grads
        g_values, g_scales, g_q = _block_mix_grads(ctx, g_o, g_lse, block_mix_backward)
        return g_q, None, *g_values, *g_scales


class _EagerMerge(torch.autograd.Function):
    """Phase 2 in eager mode (cheaper per call than going through the custom ops)."""

    @staticmethod
    def forward(ctx, o, lse, p, query, eps):
        h, w, delta, z, r = merge_forward(o, lse, p, query, eps)
        _save_merge(ctx, o, p, query, h, w, delta, z, r)
        return h, w, delta, z, r

    @staticmethod
    def backward(ctx, g_h, _g_w, _g_delta, _g_z, _g_r):
        return _merge_grads(ctx, g_h, merge_backward)


# Under torch.compile the phases and their backwards are custom ops, kept whole in the graph (no graph break).
# Their schemas leave out the `programs` keyword (a launch knob that does not change the results).
block_mix_op = torch.library.custom_op(
    "k3lab::attnres_block_mix", block_mix_forward, mutates_args=(),
    schema="(Tensor[] values, Tensor[] inv_rms, Tensor queries) -> (Tensor[], Tensor, Tensor)")
block_mix_op.register_fake(_empty_block_mix)
block_mix_backward_op = torch.library.custom_op(
    "k3lab::attnres_block_mix_backward", block_mix_backward, mutates_args=(),
    schema="(Tensor[] values, Tensor[] inv_rms, Tensor queries, Tensor logits, Tensor[] g_o, Tensor g_lse) "
           "-> (Tensor[], Tensor, Tensor)")
block_mix_backward_op.register_fake(lambda values, inv_rms, queries, logits, g_o, g_lse: (
    [torch.empty_like(v) for v in values], logits.new_empty(logits.shape[1:]),
    logits.new_empty(queries.shape)))
block_mix_op.register_autograd(
    lambda ctx, g_o, g_lse, _g_logits: _block_mix_grads(ctx, g_o, g_lse, block_mix_backward_op),
    setup_context=lambda ctx, inputs, output: _save_block_mix(ctx, *inputs, output[2]))

merge_op = torch.library.custom_op(
    "k3lab::attnres_merge", merge_forward, mutates_args=(),
    schema="(Tensor o, Tensor lse, Tensor p, Tensor query, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
merge_op.register_fake(_empty_merge)
merge_backward_op = torch.library.custom_op(
    "k3lab::attnres_merge_backward", merge_backward, mutates_args=(),
    schema="(Tensor h, Tensor delta, Tensor z, Tensor r, Tensor query, Tensor g_h, ScalarType o_dtype, "
           "ScalarType p_dtype) -> (Tensor, Tensor, Tensor, Tensor)")
merge_backward_op.register_fake(lambda h, delta, z, r, query, g_h, o_dtype, p_dtype: (
    h.new_empty(h.shape, dtype=o_dtype), torch.empty_like(z), h.new_empty(h.shape, dtype=p_dtype),
    z.new_empty(query.shape)))
merge_op.register_autograd(
    lambda ctx, g_h, _g_w, _g_delta, _g_z, _g_r: _merge_grads(ctx, g_h, merge_backward_op),
    setup_context=lambda ctx, inputs, output: _save_merge(ctx, inputs[0], inputs[2], inputs[3], *output))


def block_mix_triton(values: list[torch.Tensor], inv_rms: list[torch.Tensor], queries: torch.Tensor
                     ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Phase 1: values S x [B, T, D], inv_rms S x [B, T, 1] fp32, queries [Q, D] -> o Q x [B, T, D] (separate
    tensors, dtype promoted over the values), lse [Q, B, T] fp32, alpha [Q, S, B, T] fp32 (not differentiable).
    Check `supported` first."""
    if torch.compiler.is_compiling():
        o, lse, logits = block_mix_op(values, inv_rms, queries)
    else:
        *o, lse, logits = _EagerBlockMix.apply(queries, len(values), *values, *inv_rms)
    return list(o), lse, torch.exp(logits - lse.detach().unsqueeze(1))


def merge_triton(o: torch.Tensor, lse: torch.Tensor, p: torch.Tensor, query: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2: o, p [B, T, D], lse [B, T] fp32, query [D], eps (of 1/rms(p)) -> h [B, T, D] (dtype promoted over
    o and p), w [B, T] fp32 (the weight on p, not differentiable). Check `merge_supported` first."""
    if torch.compiler.is_compiling():
        h, w, *_ = merge_op(o, lse, p, query, eps)
    else:
        h, w, *_ = _EagerMerge.apply(o, lse, p, query, eps)
    return h, w
