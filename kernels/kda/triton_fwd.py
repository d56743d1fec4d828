"""Triton forward kernels for chunkwise Kimi Delta Attention (Kimi Linear, arXiv:2510.26692, sec. 3).

Notation (per batch b, head h, chunk n of BT = 64 tokens; see ``chunk_torch.py`` for the derivation):
    G      within-chunk cumulative log-decay, G_t = sum_{s <= t} g_s                      [BT, K]
    At_ij  sum_k k_ik k_jk e^{G_ik - G_jk} for j < i (no beta)                            [BT, BT]
    P_ij   scale * sum_k q_ik k_jk e^{G_ik - G_jk} for j <= i                              [BT, BT]
    Tinv   (I + Diag(beta) At)^{-1}  (the UT / WY transform)                              [BT, BT]
    U, W   Tinv Diag(beta) V,  Tinv Diag(beta) (K * e^G)                                  [BT, V], [BT, K]
    D      delta = U - W S_n   (S_n the state entering the chunk)                         [BT, V]
    o      scale (q * e^G) S_n + P D
    S_n+1  Diag(e^{G_last}) S_n + (K * e^{G_last - G})^T D

Kernels, in launch order: ``_gate_cumsum`` (optionally the decay map, then G, and Gh for an unbounded
gate, below), ``_intra`` (At and P, 16 rows at a time), ``_wy`` (Tinv by 16x16 blocks, U, W, and
Kd = K * e^{G_last - G}), ``_state`` (the sequential pass over chunks, one program per (b, h, V-block),
whose products take W and Kd as they are stored), ``_output``.

Decay safety. A pairwise factor e^{G_i - G_j} (i >= j) is evaluated as a product of exponentials
inside ``tl.dot``. With safe_gate (gate bounded below, g >= -5 as in K3's sigmoid map) every 16-row
sub-block is split at its middle row, so every exponent stays within 16 * 5 / 2 = 40 and the diagonal
sub-blocks are part of the same tensor-core product (K3 sec. 2.1.1). With any other gate (softplus) the
pairs of earlier sub-blocks are split at the first row of the query's sub-block (every exponent <= 0),
and a diagonal sub-block takes two masked 16x16 products (``_diag_factors``): the pairs across its middle
row split there (exact, exponents <= 0), the pairs within one half at that half's middle value of the
decay with every token's step clamped to at most DIAG_CLAMP = 16 nats; P's diagonal (factor 1) is
q_i . k_i. The clamp only touches a pair whose true factor is below e^-16 (a token between them decays
by more than that), so it moves that factor by less than e^-16 = 1.1e-7, the fp32 rounding of a factor
near 1, and keeps every exponential within e^(7 * 16 / 2) = e^56; a product of two overflows only in
the upper triangle, which is masked before it is summed. A model trained with softplus has most
sub-blocks far outside the sigmoid bound (``benchmarks.kda_decay``: by step 15 of the GPU benchmark over
90% of them decay by more than 75, 85% by more than 160), so this is its common path.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..device import sm_count

BT = 64  # chunk size
BC = 16  # sub-block size
# The most a token's log-decay step counts for inside one half of a diagonal sub-block (module docstring).
DIAG_CLAMP: tl.constexpr = tl.constexpr(16.0)

# Launch configuration per kernel (V-block width BV where the kernel tiles V, key-slice width BKS where
# it slices K, rows per program RB where it splits a chunk's rows, warps, pipeline stages).
# Every choice computes the same result up to float summation order (key slices add their parts in
# another order); only speed differs. Found by `python -m benchmarks.kda_tune` on one H200 at B=4,
# T=4096, H=16, K=V=128, and intra, bwd_diag by `--decay softplus-fast` at B=8, T=4096, H=8 (figures in
# benchmarks/RESULTS.md).
LAUNCH = {
    "intra": dict(BKS=32, num_warps=2),
    "wy": dict(BKS=32, num_warps=2, num_stages=3),
    "state": dict(BV=64, num_warps=4, num_stages=3),
    "output": dict(BV=64, num_warps=4),
    "bwd_state": dict(BV=64, num_warps=8, num_stages=3),
    "bwd_local_v": dict(BV=32, num_warps=8, num_stages=2),
    "bwd_local_kv": dict(BKS=64, BV=32, num_warps=8, num_stages=2),
    "bwd_local_k": dict(RB=16, num_warps=4),
    "gate_cumsum": dict(BKS=32, num_warps=4),
    "dg_bwd": dict(BKS=32, num_warps=4),
    "bwd_diag": dict(BKS=64, num_warps=4),
}


def launch(name: str, V: int | None = None) -> tuple[int | None, dict]:
    """(BV clipped to V's padded width, or None; the remaining Triton launch options) of kernel `name`."""
    opts = dict(LAUNCH[name])
    bv = opts.pop("BV", None)
    return (None if bv is None else min(bv, _pow2(V))), opts


@triton.jit
def _chunk(i_n, i_bh, T, H: tl.constexpr, BTC: tl.constexpr):
    """Coordinates of chunk i_n of the flattened (batch, head) i_bh: batch, head, number of chunks NT,
    first token t0 and the tokens left from t0 (T_local; the last chunk may be ragged)."""
    t0 = i_n * BTC
    return i_bh // H, i_bh % H, tl.cdiv(T, BTC), t0, T - t0


@triton.jit
def _load_rows(ptr, r0, nrows, stride, ncols, NR: tl.constexpr, NC: tl.constexpr):
    """Rows r0 .. r0+NR of a row-major matrix (row stride ``stride``), zero where row >= nrows or
    col >= ncols, [NR, NC] in the matrix's dtype."""
    r = r0 + tl.arange(0, NR)
    c = tl.arange(0, NC)
    m = (r[:, None] < nrows) & (c[None, :] < ncols)
    return tl.load(ptr + r[:, None] * stride + c[None, :], mask=m, other=0.0)


@triton.jit
def _load_tile(ptr, r0, nrows, stride, ncols, NR: tl.constexpr, NC: tl.constexpr):
    """``_load_rows`` as float32."""
    return _load_rows(ptr, r0, nrows, stride, ncols, NR, NC).to(tl.float32)


@triton.jit
def _softplus(x):
    """log(1 + e^x), linear above 20 (where the two agree in fp32)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _decayed_queries(q, G, scale):
    """Qg = scale q e^G, float32 (the one formula for it: ``_decayed_rows`` and ``_gate_cumsum`` both
    store it, and a backward that reads one in place of the other relies on their bits being the same)."""
    return q * tl.exp(G) * scale


@triton.jit
def _gate_cumsum(
    g, A_log, dt_bias, G, Gh, q, Qg, scale: tl.constexpr, T, H: tl.constexpr, K: tl.constexpr,
    BKS: tl.constexpr, GATE: tl.constexpr, G_MIN: tl.constexpr, BTC: tl.constexpr, BCC: tl.constexpr,
    HALVES: tl.constexpr, QG: tl.constexpr, STORE_G: tl.constexpr,
):
    """G[b, h, n*BT + t] = cumsum within the chunk of the log-decay, per chunk and slice of BKS key
    columns (program axis 2; the columns are independent). GATE: 0 = g given, 1 = sigmoid map
    g = G_MIN * sigmoid(exp(A_log[h]) * (z + dt_bias[h, :])), 2 = softplus map
    g = -exp(A_log[h]) softplus(z + dt_bias[h, :]).
    g: [B, T, H, K] (raw z when GATE > 0); G: [B, H, Tp, K] float32, Tp = NT * BT (padded rows hold g = 0).
    HALVES (an unbounded gate): also Gh [B, H, Tp, K] float32, the exponent of the diagonal sub-blocks'
    split within a half (``_diag_factors``): the cumulative decay from the half's first row with each
    step clamped at -DIAG_CLAMP, minus its middle value over the half (half its last value).
    QG: also Qg = scale q e^G [B, H, Tp, K] from q [B, T, H, K] (``_decayed_queries``, as ``_decayed_rows``
    stores it), for a backward that kept At and P and so does not rerun ``_intra``.
    STORE_G false: G is not written (a backward that kept G and reruns this for Gh alone)."""
    i_n, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BTC)
    x = _load_tile(g + (i_b * T * H + i_h) * K + i_k * BKS, i_n * BTC, T, H * K, K - i_k * BKS, BTC, BKS)
    c = i_k * BKS + tl.arange(0, BKS)
    r = i_n * BTC + tl.arange(0, BTC)
    valid = (r[:, None] < T) & (c[None, :] < K)
    if GATE > 0:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        z = x + tl.load(dt_bias + i_h * K + c, mask=c < K, other=0.0).to(tl.float32)[None, :]
        if GATE == 1:
            x = G_MIN * tl.sigmoid(a * z)
        else:
            x = -a * _softplus(z)
    x = tl.where(valid, x, 0.0)
    Gc = tl.cumsum(x, axis=0)
    base = (i_bh * NT * BTC) * K + r[:, None] * K + c[None, :]
    if STORE_G:
        tl.store(G + base, Gc, mask=c[None, :] < K)
    if QG:
        qq = _load_tile(q + (i_b * T * H + i_h) * K + i_k * BKS, i_n * BTC, T, H * K, K - i_k * BKS, BTC, BKS)
        tl.store(Qg + base, _decayed_queries(qq, Gc, scale).to(Qg.dtype.element_ty), mask=c[None, :] < K)
    if HALVES:
        HALF: tl.constexpr = BCC // 2
        first = (tl.arange(0, BTC) % HALF == 0)[:, None]
        steps = tl.reshape(tl.where(first, 0.0, tl.maximum(x, -DIAG_CLAMP)), [BTC // HALF, HALF, BKS])
        within = tl.cumsum(steps, axis=1)                        # [halves, rows, BKS], 0 on each first row
        centred = within - 0.5 * tl.min(within, axis=1)[:, None, :]  # non-increasing: the min is the last
        tl.store(Gh + base, tl.reshape(centred, [BTC, BKS]), mask=c[None, :] < K)


@triton.jit
def _diag_factors(Gd, G_ptr, Gh_ptr, n, c0, K, BCC: tl.constexpr, BKS: tl.constexpr):
    """The two splits of diagonal sub-block n for an unbounded gate over key columns c0 .. c0+BKS: Gd
    [BC, BKS] its rows of G there; G_ptr, Gh_ptr the chunk's row 0 of G and of Gh (``_gate_cumsum``).
    With r its middle row:
      pairs i >= r > j:  e^{G_i - G_j} = up_i lo_j,  up = e^{G - G_r} on rows >= r, lo = e^{G_r - G} on rows < r
                         (zero elsewhere, so the product holds exactly these pairs; both exponents <= 0);
      pairs in one half: e^{G~_i - G~_j} = u_i l_j,  u = e^{Gh}, l = e^{-Gh} (|Gh| <= 7 * DIAG_CLAMP / 2),
                         G~ the decay with each step clamped; the caller keeps only the pairs i > j of
                         ``_within_half`` (the diagonal i = j has factor 1).
    Returns up, lo, u, l, each [BC, BKS] float32."""
    cols = c0 + tl.arange(0, BKS)
    g_mid = tl.load(G_ptr + (n * BCC + BCC // 2) * K + cols, mask=cols < K, other=0.0)
    Hd = _load_tile(Gh_ptr + c0, n * BCC, n * BCC + BCC, K, K - c0, BCC, BKS)
    upper = (tl.arange(0, BCC) >= BCC // 2)[:, None]
    e = tl.exp(-tl.abs(Gd - g_mid[None, :]))
    return tl.where(upper, e, 0.0), tl.where(upper, 0.0, e), tl.exp(Hd), tl.exp(-Hd)


@triton.jit
def _within_half(BCC: tl.constexpr):
    """[BC, BC] mask of the pairs i > j of a sub-block in the same half (the upper triangle, where the
    within-half factors' products may overflow, is left out)."""
    r = tl.arange(0, BCC)
    return ((r[:, None] < BCC // 2) == (r[None, :] < BCC // 2)) & (r[:, None] > r[None, :])


@triton.jit
def _decayed_rows(
    q_ptr, k_ptr, G_ptr, Gh_ptr, qg_ptr, scale, n, T_local, stride, K, SAFE: tl.constexpr,
    NW: tl.constexpr, BCC: tl.constexpr, BKS: tl.constexpr, PREC: tl.constexpr,
):
    """Rows n*BC .. n*BC+BC of At (a = k, j < i) and of P / scale (a = q, j <= i) over the first NW
    columns j (NW >= (n+1)*BC: the later ones are zero), where M_ij = sum_k a_ik k_jk e^{G_ik - G_jk},
    accumulated over slices of BKS key columns so that no [BT, K] tile is held. q_ptr, k_ptr, G_ptr (and
    Gh_ptr, read when SAFE is false) point at row 0 of the chunk. SAFE (a bounded gate): one product per
    slice split at the sub-block's middle row; else the earlier sub-blocks split at its first row and the
    diagonal sub-block by ``_diag_factors`` (module docstring). Returns At's and P's rows, float32
    [BC, NW], and, with SAFE false, their diagonal sub-blocks [BC, BC] apart (the rows' columns
    n*BC .. n*BC+BC are zero then; with SAFE true those are in the rows and the two blocks are zero).
    On the way it stores these rows of Qg = scale q e^G (row 0 at qg_ptr, row stride K), the operand of
    the inter-chunk output term and of the reverse state pass."""
    rows = n * BCC + tl.arange(0, BCC)
    cols = tl.arange(0, NW)
    r16 = tl.arange(0, BCC)
    A = tl.zeros([BCC, NW], dtype=tl.float32)
    P = tl.zeros([BCC, NW], dtype=tl.float32)
    A_d = tl.zeros([BCC, BCC], dtype=tl.float32)
    P_d = tl.zeros([BCC, BCC], dtype=tl.float32)
    split = n * BCC + BCC // 2 if SAFE else n * BCC
    for c0 in range(0, K, BKS):
        ck = c0 + tl.arange(0, BKS)
        nk = K - c0
        G_n = _load_tile(G_ptr + c0, n * BCC, n * BCC + BCC, K, nk, BCC, BKS)
        k_n = _load_tile(k_ptr + c0, n * BCC, T_local, stride, nk, BCC, BKS)
        q_n = _load_tile(q_ptr + c0, n * BCC, T_local, stride, nk, BCC, BKS)
        _store_rows(qg_ptr + c0, n, n * BCC + BCC, K, nk, _decayed_queries(q_n, G_n, scale), BCC, BKS)
        kk = _load_tile(k_ptr + c0, 0, T_local, stride, nk, NW, BKS)
        Gk = _load_tile(G_ptr + c0, 0, NW, K, nk, NW, BKS)
        g_s = tl.load(G_ptr + split * K + ck, mask=ck < K, other=0.0)
        rf = tl.exp(G_n - g_s[None, :])
        if SAFE:
            kf = tl.trans(kk * tl.exp(tl.where(cols[:, None] < (n + 1) * BCC, g_s[None, :] - Gk, 0.0)))
        else:
            kf = tl.trans(kk * tl.exp(tl.minimum(tl.where(cols[:, None] < n * BCC, g_s[None, :] - Gk, 0.0), 0.0)))
            up, lo, u, l = _diag_factors(G_n, G_ptr, Gh_ptr, n, c0, K, BCC, BKS)
            kl = tl.trans(k_n * lo)
            kh = tl.trans(k_n * l)
            within = _within_half(BCC)
            A_d += tl.dot(k_n * up, kl, input_precision=PREC)
            A_d += tl.where(within, tl.dot(k_n * u, kh, input_precision=PREC), 0.0)
            P_d += tl.dot(q_n * up, kl, input_precision=PREC)
            P_d += tl.where(within, tl.dot(q_n * u, kh, input_precision=PREC), 0.0)
            P_d += tl.where(r16[:, None] == r16[None, :], tl.sum(q_n * k_n, axis=1)[:, None], 0.0)  # e^0 exactly
        A += tl.dot(k_n * rf, kf, input_precision=PREC)
        P += tl.dot(q_n * rf, kf, input_precision=PREC)
    if not SAFE:
        earlier = cols[None, :] < n * BCC
        A = tl.where(earlier, A, 0.0)
        P = tl.where(earlier, P, 0.0)
    A = tl.where(rows[:, None] > cols[None, :], A, 0.0)
    P = tl.where(rows[:, None] >= cols[None, :], P, 0.0)
    return A, P, A_d, P_d


@triton.jit
def _store_products(At_ptr, P_ptr, Ak_ptr, Pk_ptr, offs, a, p, mask, COPY: tl.constexpr):
    """Store entries a of At and p of P at offs (where mask), and with COPY the same into the copies that
    ``keep_intra`` keeps for the backward, rounded to their dtype."""
    tl.store(At_ptr + offs, a, mask=mask)
    tl.store(P_ptr + offs, p, mask=mask)
    if COPY:
        tl.store(Ak_ptr + offs, a.to(Ak_ptr.dtype.element_ty), mask=mask)
        tl.store(Pk_ptr + offs, p.to(Pk_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _intra_rows(
    q_ptr, k_ptr, G_ptr, Gh_ptr, qg_ptr, At_ptr, P_ptr, Ak_ptr, Pk_ptr, scale, n, T_local, stride, K,
    SAFE: tl.constexpr, COPY: tl.constexpr, NW: tl.constexpr, BTC: tl.constexpr, BCC: tl.constexpr,
    BKS: tl.constexpr, PREC: tl.constexpr,
):
    """Row block n of one chunk's At and P (row 0 at At_ptr, P_ptr; row stride BT; with COPY also at
    Ak_ptr, Pk_ptr in their dtype): the first NW columns from ``_decayed_rows`` (its diagonal block stored
    apart when SAFE is false), zeros after them."""
    rows = n * BCC + tl.arange(0, BCC)
    cols = tl.arange(0, NW)
    a, p, a_d, p_d = _decayed_rows(q_ptr, k_ptr, G_ptr, Gh_ptr, qg_ptr, scale, n, T_local, stride, K, SAFE, NW,
                                   BCC, BKS, PREC)
    offs = rows[:, None] * BTC + cols[None, :]
    if SAFE:
        _store_products(At_ptr, P_ptr, Ak_ptr, Pk_ptr, offs, a, p * scale, None, COPY)
    else:  # two disjoint stores: the diagonal block's columns come from a_d, p_d
        off_diag = (cols[None, :] < n * BCC) | (cols[None, :] >= n * BCC + BCC)
        _store_products(At_ptr, P_ptr, Ak_ptr, Pk_ptr, offs, a, p * scale, off_diag, COPY)
        doffs = rows[:, None] * BTC + rows[None, :]
        _store_products(At_ptr, P_ptr, Ak_ptr, Pk_ptr, doffs, a_d, p_d * scale, None, COPY)
    for m in tl.static_range(NW // BCC, BTC // BCC):
        zoffs = rows[:, None] * BTC + m * BCC + tl.arange(0, BCC)[None, :]
        zero = tl.zeros([BCC, BCC], dtype=tl.float32)
        _store_products(At_ptr, P_ptr, Ak_ptr, Pk_ptr, zoffs, zero, zero, None, COPY)


@triton.jit
def _intra(
    q, k, G, Gh, Qg, At, P, Ak, Pk, scale: tl.constexpr, T, H: tl.constexpr, K: tl.constexpr, BKS: tl.constexpr,
    BTC: tl.constexpr, BCC: tl.constexpr, SAFE: tl.constexpr, COPY: tl.constexpr, PREC: tl.constexpr,
):
    """At and P (see module docstring) into [B, H, Tp, BT], one 16-row block of one chunk per program
    (program axis 0: chunk * BT / BC + block); SAFE: the gate is bounded (else Gh is read: ``_decayed_rows``).
    Row block n computes only the first next_pow2((n + 1) * BC) columns (16, 32, 64, 64 for BT = 4 BC); the
    rest are zero. Also stores the block's rows of Qg = scale q e^G [B, H, Tp, K] (``_decayed_rows``), and
    with COPY those of At and P into Ak and Pk, in their (half-precision) dtype, for ``keep_intra``."""
    i_n, i_r, i_bh = tl.program_id(0) // (BTC // BCC), tl.program_id(0) % (BTC // BCC), tl.program_id(1)
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    stride = H * K
    q_ptr = q + (i_b * T * H + i_h) * K + t0 * stride
    k_ptr = k + (i_b * T * H + i_h) * K + t0 * stride
    G_ptr = G + (i_bh * NT * BTC + t0) * K
    Gh_ptr = Gh + (i_bh * NT * BTC + t0) * K
    out = (i_bh * NT * BTC + t0) * BTC
    out_k = (i_bh * NT * BTC + t0) * K
    if i_r == 0:
        _intra_rows(q_ptr, k_ptr, G_ptr, Gh_ptr, Qg + out_k, At + out, P + out, Ak + out, Pk + out, scale, 0,
                    T_local, stride, K, SAFE, COPY, BCC, BTC, BCC, BKS, PREC)
    elif i_r == 1:
        _intra_rows(q_ptr, k_ptr, G_ptr, Gh_ptr, Qg + out_k, At + out, P + out, Ak + out, Pk + out, scale, 1,
                    T_local, stride, K, SAFE, COPY, 2 * BCC, BTC, BCC, BKS, PREC)
    else:
        _intra_rows(q_ptr, k_ptr, G_ptr, Gh_ptr, Qg + out_k, At + out, P + out, Ak + out, Pk + out, scale, i_r,
                    T_local, stride, K, SAFE, COPY, BTC, BTC, BCC, BKS, PREC)


@triton.jit
def _blk(ptr, n, m, BTC: tl.constexpr, BCC: tl.constexpr):
    """The (n, m) 16x16 block of a [BT, BT] row-major matrix."""
    r = n * BCC + tl.arange(0, BCC)
    c = m * BCC + tl.arange(0, BCC)
    return tl.load(ptr + r[:, None] * BTC + c[None, :])


@triton.jit
def _store_blk(ptr, n, m, X, BTC: tl.constexpr, BCC: tl.constexpr):
    r = n * BCC + tl.arange(0, BCC)
    c = m * BCC + tl.arange(0, BCC)
    tl.store(ptr + r[:, None] * BTC + c[None, :], X)


@triton.jit
def _store_rows(ptr, n, nrows, stride, ncols, X, BCC: tl.constexpr, NC: tl.constexpr):
    """Store X [BC, NC] as rows n*BC .. of a row-major matrix, rows < nrows and cols < ncols only."""
    r = n * BCC + tl.arange(0, BCC)
    c = tl.arange(0, NC)
    tl.store(ptr + r[:, None] * stride + c[None, :], X, mask=(r[:, None] < nrows) & (c[None, :] < ncols))


@triton.jit
def _inv_unit_lower(A, BCC: tl.constexpr):
    """(I + A)^{-1} for a strictly lower-triangular [BC, BC] A, by forward substitution over rows."""
    r = tl.arange(0, BCC)
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BCC):
        a_i = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)        # row i of A
        x_i = tl.sum(a_i[:, None] * X, axis=0)                          # sum_j A_ij X_j
        X = tl.where(r[:, None] == i, X - x_i[None, :], X)
    return X


@triton.jit
def _decayed_keys(k_ptr, G_ptr, kd_ptr, g_last, n, T_local, stride_k, K, nk,
                  BTC: tl.constexpr, BCC: tl.constexpr, BKS: tl.constexpr):
    """Rows n*BC .. n*BC+BC of one chunk and BKS key columns (nk of them valid): stores Kd = k e^{G_last - G}
    there (row-major, row stride K) and returns k e^G, float32 [BC, BKS]."""
    kn = _load_tile(k_ptr, n * BCC, T_local, stride_k, nk, BCC, BKS)
    Gn = _load_tile(G_ptr, n * BCC, BTC, K, nk, BCC, BKS)
    _store_rows(kd_ptr, n, BTC, K, nk, kn * tl.exp(g_last[None, :] - Gn), BCC, BKS)
    return kn * tl.exp(Gn)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _wy_inverse(A_ptr, Ti_ptr, bt0, bt1, bt2, bt3, BTC: tl.constexpr, BCC: tl.constexpr, PREC: tl.constexpr):
    """The 16x16 blocks n >= m of one chunk's Tinv = (I + Diag(beta) At)^{-1} (block forward substitution),
    stored at Ti_ptr and returned; At's blocks at A_ptr, bt0..bt3 the chunk's beta by 16-row block."""
    # A = Diag(beta) At, block rows
    A10 = _blk(A_ptr, 1, 0, BTC, BCC) * bt1[:, None]
    A20 = _blk(A_ptr, 2, 0, BTC, BCC) * bt2[:, None]
    A21 = _blk(A_ptr, 2, 1, BTC, BCC) * bt2[:, None]
    A30 = _blk(A_ptr, 3, 0, BTC, BCC) * bt3[:, None]
    A31 = _blk(A_ptr, 3, 1, BTC, BCC) * bt3[:, None]
    A32 = _blk(A_ptr, 3, 2, BTC, BCC) * bt3[:, None]
    T00 = _inv_unit_lower(_blk(A_ptr, 0, 0, BTC, BCC) * bt0[:, None], BCC)
    T11 = _inv_unit_lower(_blk(A_ptr, 1, 1, BTC, BCC) * bt1[:, None], BCC)
    T22 = _inv_unit_lower(_blk(A_ptr, 2, 2, BTC, BCC) * bt2[:, None], BCC)
    T33 = _inv_unit_lower(_blk(A_ptr, 3, 3, BTC, BCC) * bt3[:, None], BCC)
    T10 = -_dot(T11, _dot(A10, T00, PREC), PREC)
    T21 = -_dot(T22, _dot(A21, T11, PREC), PREC)
    T20 = -_dot(T22, _dot(A20, T00, PREC) + _dot(A21, T10, PREC), PREC)
    T32 = -_dot(T33, _dot(A32, T22, PREC), PREC)
    T31 = -_dot(T33, _dot(A31, T11, PREC) + _dot(A32, T21, PREC), PREC)
    T30 = -_dot(T33, _dot(A30, T00, PREC) + _dot(A31, T10, PREC) + _dot(A32, T20, PREC), PREC)
    _store_blk(Ti_ptr, 0, 0, T00, BTC, BCC)
    _store_blk(Ti_ptr, 1, 0, T10, BTC, BCC)
    _store_blk(Ti_ptr, 1, 1, T11, BTC, BCC)
    _store_blk(Ti_ptr, 2, 0, T20, BTC, BCC)
    _store_blk(Ti_ptr, 2, 1, T21, BTC, BCC)
    _store_blk(Ti_ptr, 2, 2, T22, BTC, BCC)
    _store_blk(Ti_ptr, 3, 0, T30, BTC, BCC)
    _store_blk(Ti_ptr, 3, 1, T31, BTC, BCC)
    _store_blk(Ti_ptr, 3, 2, T32, BTC, BCC)
    _store_blk(Ti_ptr, 3, 3, T33, BTC, BCC)
    return T00, T10, T11, T20, T21, T22, T30, T31, T32, T33


@triton.jit
def _wy(
    k, v, beta, G, At, Tinv, U, W, Kd, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKS: tl.constexpr, BV: tl.constexpr, BTC: tl.constexpr, BCC: tl.constexpr, PREC: tl.constexpr,
    LOAD_T: tl.constexpr,
):
    """Tinv = (I + Diag(beta) At)^{-1} by 16x16 blocks (block forward substitution
    T_nm = -T_nn sum_{m <= j < n} A_nj T_jm), then U = Tinv Diag(beta) V [B, T, H, V], and the state
    pass's operands W = Tinv Diag(beta) (K e^G) and Kd = K e^{G_last - G}, [B, H, Tp, K] (zero in padded
    rows), each in its tensor's dtype. LOAD_T: read Tinv as an earlier call stored it instead (At unused)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    A_ptr = At + (i_bh * NT * BTC + t0) * BTC
    r16 = tl.arange(0, BCC)
    b_ptr = beta + i_b * T * H + i_h + t0 * H
    bt0 = tl.load(b_ptr + (0 * BCC + r16) * H, mask=0 * BCC + r16 < T_local, other=0.0).to(tl.float32)
    bt1 = tl.load(b_ptr + (1 * BCC + r16) * H, mask=1 * BCC + r16 < T_local, other=0.0).to(tl.float32)
    bt2 = tl.load(b_ptr + (2 * BCC + r16) * H, mask=2 * BCC + r16 < T_local, other=0.0).to(tl.float32)
    bt3 = tl.load(b_ptr + (3 * BCC + r16) * H, mask=3 * BCC + r16 < T_local, other=0.0).to(tl.float32)
    Ti_ptr = Tinv + (i_bh * NT * BTC + t0) * BTC          # zero-initialised: only blocks n >= m are written
    if LOAD_T:
        T00, T10, T11 = _blk(Ti_ptr, 0, 0, BTC, BCC), _blk(Ti_ptr, 1, 0, BTC, BCC), _blk(Ti_ptr, 1, 1, BTC, BCC)
        T20, T21, T22 = _blk(Ti_ptr, 2, 0, BTC, BCC), _blk(Ti_ptr, 2, 1, BTC, BCC), _blk(Ti_ptr, 2, 2, BTC, BCC)
        T30, T31 = _blk(Ti_ptr, 3, 0, BTC, BCC), _blk(Ti_ptr, 3, 1, BTC, BCC)
        T32, T33 = _blk(Ti_ptr, 3, 2, BTC, BCC), _blk(Ti_ptr, 3, 3, BTC, BCC)
    else:
        T00, T10, T11, T20, T21, T22, T30, T31, T32, T33 = _wy_inverse(A_ptr, Ti_ptr, bt0, bt1, bt2, bt3, BTC, BCC,
                                                                       PREC)
    # U, W by row blocks: X_n = sum_{m <= n} T_nm (beta X)_m
    stride_k = H * K
    stride_v = H * V
    k_ptr = k + (i_b * T * H + i_h) * K + t0 * stride_k
    v_ptr = v + (i_b * T * H + i_h) * V + t0 * stride_v
    G_ptr = G + (i_bh * NT * BTC + t0) * K
    for c0 in range(0, K, BKS):  # W and Kd over key slices, as U over V-blocks below
        nk = K - c0
        ck = c0 + tl.arange(0, BKS)
        g_last = tl.load(G_ptr + (BTC - 1) * K + ck, mask=ck < K, other=0.0)
        kp, Gp = k_ptr + c0, G_ptr + c0
        w_ptr = W + (i_bh * NT * BTC + t0) * K + c0
        kd_ptr = Kd + (i_bh * NT * BTC + t0) * K + c0
        bk0 = _decayed_keys(kp, Gp, kd_ptr, g_last, 0, T_local, stride_k, K, nk, BTC, BCC, BKS) * bt0[:, None]
        bk1 = _decayed_keys(kp, Gp, kd_ptr, g_last, 1, T_local, stride_k, K, nk, BTC, BCC, BKS) * bt1[:, None]
        bk2 = _decayed_keys(kp, Gp, kd_ptr, g_last, 2, T_local, stride_k, K, nk, BTC, BCC, BKS) * bt2[:, None]
        bk3 = _decayed_keys(kp, Gp, kd_ptr, g_last, 3, T_local, stride_k, K, nk, BTC, BCC, BKS) * bt3[:, None]
        w0 = _dot(T00, bk0, PREC)
        w1 = _dot(T10, bk0, PREC) + _dot(T11, bk1, PREC)
        w2 = _dot(T20, bk0, PREC) + _dot(T21, bk1, PREC) + _dot(T22, bk2, PREC)
        w3 = _dot(T30, bk0, PREC) + _dot(T31, bk1, PREC) + _dot(T32, bk2, PREC) + _dot(T33, bk3, PREC)
        _store_rows(w_ptr, 0, BTC, K, nk, w0, BCC, BKS)
        _store_rows(w_ptr, 1, BTC, K, nk, w1, BCC, BKS)
        _store_rows(w_ptr, 2, BTC, K, nk, w2, BCC, BKS)
        _store_rows(w_ptr, 3, BTC, K, nk, w3, BCC, BKS)
    u_ptr = U + (i_b * T * H + i_h) * V + t0 * stride_v
    for iv in range(tl.cdiv(V, BV)):
        vp = v_ptr + iv * BV
        nv = V - iv * BV
        bv0 = _load_tile(vp, 0 * BCC, T_local, stride_v, nv, BCC, BV) * bt0[:, None]
        bv1 = _load_tile(vp, 1 * BCC, T_local, stride_v, nv, BCC, BV) * bt1[:, None]
        bv2 = _load_tile(vp, 2 * BCC, T_local, stride_v, nv, BCC, BV) * bt2[:, None]
        bv3 = _load_tile(vp, 3 * BCC, T_local, stride_v, nv, BCC, BV) * bt3[:, None]
        u0 = _dot(T00, bv0, PREC)
        u1 = _dot(T10, bv0, PREC) + _dot(T11, bv1, PREC)
        u2 = _dot(T20, bv0, PREC) + _dot(T21, bv1, PREC) + _dot(T22, bv2, PREC)
        u3 = _dot(T30, bv0, PREC) + _dot(T31, bv1, PREC) + _dot(T32, bv2, PREC) + _dot(T33, bv3, PREC)
        _store_rows(u_ptr + iv * BV, 0, T_local, stride_v, nv, u0, BCC, BV)
        _store_rows(u_ptr + iv * BV, 1, T_local, stride_v, nv, u1, BCC, BV)
        _store_rows(u_ptr + iv * BV, 2, T_local, stride_v, nv, u2, BCC, BV)
        _store_rows(u_ptr + iv * BV, 3, T_local, stride_v, nv, u3, BCC, BV)


@triton.jit
def _state(
    Kd, W, U, G, h0, Hs, Dl, ht, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BTC: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr,
):
    """Sequential pass over chunks for one (b, h, V-block): stores the state entering each chunk
    (Hs [B, H, NT, K, V]) and delta = U - W S (Dl [B, T, H, V]). The state stays float32; the two
    products take the dtype of W and Kd ([B, H, Tp, K], from ``_wy``) as operands, which load straight
    into shared memory, so that with 2-3 stages the next chunk's loads overlap this chunk's products
    (the recipe of fla's forward state kernel)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BTC)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    hmask = (ck[:, None] < K) & (cv[None, :] < V)
    hoff = ck[:, None] * V + cv[None, :]
    if USE_H0:
        h = tl.load(h0 + i_bh * K * V + hoff, mask=hmask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    stride_v = H * V
    r = tl.arange(0, BTC)
    for n in range(NT):
        t0 = n * BTC
        T_local = T - t0
        tl.store(Hs + (i_bh * NT + n) * K * V + hoff, h, mask=hmask)
        pbase = (i_bh * NT * BTC + t0) * K
        w = _load_rows(W + pbase, 0, BTC, K, K, BTC, BK)
        kd = _load_rows(Kd + pbase, 0, BTC, K, K, BTC, BK)
        g_last = tl.load(G + pbase + (BTC - 1) * K + ck, mask=ck < K, other=0.0)
        base_v = (i_b * T * H + i_h) * V + t0 * stride_v + i_v * BV
        d = (_load_tile(U + base_v, 0, T_local, stride_v, V - i_v * BV, BTC, BV)
             - tl.dot(w, h.to(w.dtype), input_precision=PREC))
        tl.store(Dl + base_v + r[:, None] * stride_v + tl.arange(0, BV)[None, :], d,
                 mask=(r[:, None] < T_local) & (cv[None, :] < V))
        h = h * tl.exp(g_last)[:, None] + tl.dot(tl.trans(kd), d.to(kd.dtype), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_bh * K * V + hoff, h, mask=hmask)


@triton.jit
def _output(
    Qg, P, Hs, Dl, o, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BTC: tl.constexpr, PREC: tl.constexpr,
):
    """o = Qg S_n + P delta for one chunk and V-block, with Qg = scale q e^G from ``_intra``: the first
    product on the stored operands as they are (bf16 for bf16 inputs), the second in float32."""
    i_n, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    stride_v = H * V
    qg = _load_rows(Qg + (i_bh * NT * BTC + t0) * K, 0, BTC, K, K, BTC, BK)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    h = tl.load(Hs + (i_bh * NT + i_n) * K * V + ck[:, None] * V + cv[None, :],
                mask=(ck[:, None] < K) & (cv[None, :] < V), other=0.0)
    r = tl.arange(0, BTC)
    p = tl.load(P + (i_bh * NT * BTC + t0) * BTC + r[:, None] * BTC + r[None, :])
    base_v = (i_b * T * H + i_h) * V + t0 * stride_v + i_v * BV
    d = _load_tile(Dl + base_v, 0, T_local, stride_v, V - i_v * BV, BTC, BV)
    out = tl.dot(qg, h.to(qg.dtype), input_precision=PREC) + tl.dot(p, d, input_precision=PREC)
    tl.store(o + base_v + r[:, None] * stride_v + tl.arange(0, BV)[None, :], out.to(o.dtype.element_ty),
             mask=(r[:, None] < T_local) & (cv[None, :] < V))


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def dot_precision(dtype) -> str:
    """fp32 inputs get exact fp32 matmuls; bf16/fp16 inputs tf32 tensor-core matmuls."""
    import torch

    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def storage_dtype(dtype):
    """Dtype of the intermediates kept between kernels (normalised q/k, Qg, W, U, Kd, delta, chunk states)
    for inputs of `dtype`: bf16/fp16 for half-precision inputs, halving their memory traffic as fla
    does (G, At, P and Tinv stay float32), float32 otherwise."""
    import torch

    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def one_wave_block(widest: int, V: int, rows: int, sms: int) -> int:
    """V-block width of a sequential pass over chunks with one program per (row, V-block): the narrowest
    of widest, widest / 2, ... 16 whose grid still fits one program per SM, else widest. Each step of the
    pass is latency-bound, so a narrower block shortens every step as long as no program waits for an SM.
    Used by the forward ``_state`` and the reverse ``_bwd_state``. On the H200 (132 SMs, K = V = 128)
    this keeps 64 at B x H = 64 and picks 16 at B x H = 16, the faster choice at each (measured:
    benchmarks/RESULTS.md, KDA)."""
    bv = widest
    while bv > 16 and triton.cdiv(V, bv // 2) * rows <= sms:
        bv //= 2
    return bv


def state_pass(Kd, W, U, G, h0, prec, output_final_state):
    """The sequential ``_state`` pass: chunk-entry states Hs [B, H, NT, K, V] and delta Dl [B, T, H, V]
    in W's dtype, and the final state [B, H, K, V] (float32) or None. Used by the forward, and by the
    backward when the forward did not keep Hs and Dl (``recompute_states``)."""
    import torch

    B, T, H, V = U.shape
    K = Kd.shape[-1]
    NT = triton.cdiv(T, BT)
    Hs = torch.empty(B, H, NT, K, V, device=U.device, dtype=W.dtype)
    Dl = torch.empty(B, T, H, V, device=U.device, dtype=W.dtype)
    ht = torch.empty(B, H, K, V, device=U.device, dtype=torch.float32) if output_final_state else None
    BVS, opts = launch("state", V)
    BVS = one_wave_block(BVS, V, B * H, sm_count(U.device))
    _state[(triton.cdiv(V, BVS), B * H)](Kd, W, U, G, G if h0 is None else h0, Hs, Dl, G if ht is None else ht,
                                         T, H, K, V, _pow2(K), BVS, BT, h0 is not None, ht is not None, prec,
                                         **opts)
    return Hs, Dl, ht


def check_head_dim(K: int) -> None:
    """Raise ValueError for a head dimension the kernels do not support (K > 128)."""
    if K > 128:
        raise ValueError(f"the Triton KDA kernels hold a [64, K] tile per program and support K <= 128, got K={K}")


def gate_cumsum(g, safe_gate, gate=0, A_log=None, dt_bias=None, g_min=-5.0, q=None, scale=1.0, qg_dtype=None,
                store_G=True):
    """The ``_gate_cumsum`` launch: G [B, H, Tp, K] float32 (empty when not store_G), Gh, the diagonal
    blocks' half-centred clamped decay for an unbounded gate (same shape; empty for a bounded one), and,
    when q is given, Qg = scale q e^G [B, H, Tp, K] in qg_dtype (else empty). g: [B, T, H, K], the raw z with
    a fused gate (``kda_fwd``'s arguments). The backward reruns it for Gh alone when the forward kept G but
    not Gh: one cheap pass over g instead of Gh's bytes kept per layer."""
    import torch

    B, T, H, K = g.shape
    NT = triton.cdiv(T, BT)
    shape = (B, H, NT * BT, K)
    G = torch.empty(shape if store_G else 0, device=g.device, dtype=torch.float32)
    Gh = G.new_empty(0 if safe_gate else shape)
    Qg = G.new_empty(shape if q is not None else 0, dtype=qg_dtype or torch.float32)
    if not (store_G or Gh.numel()):
        raise ValueError("gate_cumsum with store_G=False has nothing to write for a bounded gate (no Gh)")
    dummy = G if store_G else Gh  # stands in for the tensors a launch does not touch
    _, opts = launch("gate_cumsum")
    BKS = min(opts.pop("BKS"), _pow2(K))
    _gate_cumsum[(NT, B * H, triton.cdiv(K, BKS))](g, dummy if A_log is None else A_log,
                                                    dummy if dt_bias is None else dt_bias, G if store_G else dummy,
                                                    dummy if safe_gate else Gh, dummy if q is None else q,
                                                    Qg if q is not None else dummy,
                                                    float(scale) if q is not None else 0.0, T, H, K, BKS, gate,
                                                    float(g_min), BT, BC, not safe_gate, q is not None, store_G,
                                                    **opts)
    return G, Gh, Qg


def chunk_intermediates(q, k, v, g, beta, scale, safe_gate, gate=0, A_log=None, dt_bias=None, g_min=-5.0,
                        prec=None, Tinv=None, At=None, P=None, keep_intra=False):
    """The chunk-local forward kernels (gate cumsum, intra-chunk products, WY transform), which need no state:
    G, Gh (``gate_cumsum``), At, P, Qg, Tinv, W, Kd and U by name. Shapes and arguments as ``kda_fwd``. The
    backward reruns this on the kept inputs when the forward kept only those and Tinv (``recompute_chunks``):
    the same kernels on the same inputs, so bitwise the same tensors. Tinv: an earlier call's, which ``_wy``
    then reads instead of inverting again (the sequential part of the WY kernel). At and P (with Tinv): an
    earlier call's too, in the storage dtype, and ``_intra`` is skipped (``_gate_cumsum`` stores Qg instead).
    keep_intra: also At_kept and P_kept, what the backward keeps of At and P: the fp32 tensors themselves for
    fp32 values, else copies in the storage dtype that ``_intra`` writes beside them (half the bytes; only
    the backward reads them)."""
    import torch

    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    Tp = NT * BT
    BK, BV = _pow2(K), min(64, _pow2(V))
    prec = prec or dot_precision(q.dtype)
    dev = q.device
    f32 = torch.float32
    sd = storage_dtype(v.dtype)
    given_intra = At is not None
    if given_intra and (P is None or Tinv is None):
        raise ValueError("chunk_intermediates: a kept At needs the same call's P and Tinv")
    G, Gh, Qg = gate_cumsum(g, safe_gate, gate, A_log, dt_bias, g_min, q if given_intra else None, scale, sd)
    kept = {}
    if not given_intra:
        At = torch.empty(B, H, Tp, BT, device=dev, dtype=f32)
        P = torch.empty(B, H, Tp, BT, device=dev, dtype=f32)
        Qg = torch.empty(B, H, Tp, K, device=dev, dtype=sd)
        copy = keep_intra and sd != f32   # fp32 values keep the products themselves
        At_kept, P_kept = (torch.empty_like(At, dtype=sd), torch.empty_like(P, dtype=sd)) if copy else (At, P)
        _, intra_opts = launch("intra")
        BKS_I = min(intra_opts.pop("BKS"), BK)
        _intra[(NT * (BT // BC), B * H)](q, k, G, G if safe_gate else Gh, Qg, At, P, At_kept, P_kept, float(scale),
                                         T, H, K, BKS_I, BT, BC, bool(safe_gate), copy, prec, **intra_opts)
        kept = dict(At_kept=At_kept, P_kept=P_kept) if keep_intra else {}
    load_t = Tinv is not None
    if not load_t:
        Tinv = torch.zeros(B, H, Tp, BT, device=dev, dtype=f32)
    U = torch.empty(B, T, H, V, device=dev, dtype=sd)
    W = torch.empty(B, H, Tp, K, device=dev, dtype=sd)
    Kd = torch.empty(B, H, Tp, K, device=dev, dtype=sd)
    _, wy_opts = launch("wy")
    _wy[(NT, B * H)](k, v, beta, G, At, Tinv, U, W, Kd, T, H, K, V, min(wy_opts.pop("BKS"), BK), BV, BT, BC, prec,
                     load_t, **wy_opts)
    return dict(G=G, Gh=Gh, At=At, P=P, Tinv=Tinv, W=W, Kd=Kd, Qg=Qg, U=U, **kept)


def kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, safe_gate,
            gate=0, A_log=None, dt_bias=None, g_min=-5.0, prec=None, recompute_states=False, keep_intra=False):
    """Launch the forward kernels. q, k, g: [B, T, H, K] contiguous; v: [B, T, H, V]; beta: [B, T, H].
    gate: 0 = g is the log-decay, 1 = sigmoid map, 2 = softplus map (g holds the raw z).
    prec: tl.dot input precision ("ieee" or "tf32"; default from the dtype of q).
    recompute_states: keep U [B, T, H, V] for the backward instead of the chunk states Hs
    [B, H, NT, K, V] and delta [B, T, H, V], which the backward then recomputes with one more ``_state``
    pass (saves K / 64 times delta's size: 134 MB per call at B=4, T=4096, H=16, K=V=128 in bf16).
    keep_intra: also At_kept and P_kept (``chunk_intermediates``).
    Returns o [B, T, H, V], the final state or None, and the tensors the backward needs."""
    import torch

    check_head_dim(q.shape[-1])
    prec = prec or dot_precision(q.dtype)
    saved = chunk_intermediates(q, k, v, g, beta, scale, safe_gate, gate, A_log, dt_bias, g_min, prec,
                                keep_intra=keep_intra)
    B, T, H, K = q.shape
    V = v.shape[-1]
    h0 = initial_state.contiguous() if initial_state is not None else None
    Hs, Dl, ht = state_pass(saved["Kd"], saved["W"], saved["U"], saved["G"], h0, prec, output_final_state)
    o = torch.empty_like(v)
    BVO, opts = launch("output", V)
    _output[(triton.cdiv(T, BT), B * H, triton.cdiv(V, BVO))](saved["Qg"], saved["P"], Hs, Dl, o, T, H, K, V,
                                                              _pow2(K), BVO, BT, prec, **opts)
    if not recompute_states:
        del saved["U"]
        saved.update(Hs=Hs, Dl=Dl)
    return o, ht, saved


@triton.jit
def _l2norm_rows(x_ptr, xn_ptr, inv_ptr, r, off, m, N):
    """xn = x / max(|x|, 1e-12) over the rows r of x (float32 out), and the inverse norms."""
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)
    tl.store(xn_ptr + off, x * inv[:, None], mask=m)
    tl.store(inv_ptr + r, inv, mask=r < N)


@triton.jit
def _prep(q, k, bl, qn, kn, beta, rq, rk, N, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """Fused input prep for ``kda_gated``: over N = B*T*H rows, qn = q / max(|q|, 1e-12) (likewise k),
    stored in float32 with the inverse norms rq, rk [N], and beta = sigmoid(bl)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, BK)
    m = (r[:, None] < N) & (c[None, :] < K)
    off = r[:, None] * K + c[None, :]
    _l2norm_rows(q, qn, rq, r, off, m, N)
    _l2norm_rows(k, kn, rk, r, off, m, N)
    b = tl.load(bl + r, mask=r < N, other=0.0).to(tl.float32)
    tl.store(beta + r, tl.sigmoid(b), mask=r < N)


def prep_fwd(q, k, beta_logits):
    """q, k [B, T, H, K] (any float dtype), beta_logits [B, T, H] -> float32 normalised q, k, beta and
    the inverse norms [B, T, H]."""
    import torch

    K = q.shape[-1]
    N = q.numel() // K
    qn = torch.empty(q.shape, device=q.device, dtype=storage_dtype(q.dtype))
    kn = torch.empty_like(qn)
    beta = torch.empty(beta_logits.shape, device=q.device, dtype=torch.float32)
    rq = torch.empty(beta.shape, device=q.device, dtype=torch.float32)
    rk = torch.empty_like(rq)
    BR = 16
    _prep[(triton.cdiv(N, BR),)](q, k, beta_logits, qn, kn, beta, rq, rk, N, K, _pow2(K), BR, num_warps=4)
    return qn, kn, beta, rq, rk
