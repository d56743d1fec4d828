"""Triton backward kernels for chunkwise KDA (notation of ``triton_fwd.py``; arXiv:2510.26692).

By default the forward stores the chunk-entry states S_n and delta for the backward; with
``recompute_states`` it keeps U instead and the backward reruns the sequential ``_state`` pass (less
memory for one more pass: benchmarks/RESULTS.md). Per chunk, with dS' the gradient of the state
leaving the chunk and Kd = K * e^{G_last - G}:

    d delta = P^T dO + Kd dS'           (``_bwd_state_prep`` per chunk, then ``_bwd_state``, reverse pass)
    dS      = scale (q e^G)^T dO + Diag(e^{G_last}) dS' - W^T d delta
    dP      = dO delta^T,   dW = -d delta S^T,   dKd = delta dS'^T,   dU = d delta
    dTinv   = dU (beta V)^T + dW (beta K e^G)^T,  dA = -Tinv^T dTinv Tinv^T (strictly lower)
    dv      = beta * Tinv^T dU,  d(beta K e^G) = Tinv^T dW
                                      (``_bwd_local_v`` over V, ``_bwd_local_kv`` per key slice, ``_bwd_dA``)

and the gradients through the decayed products M_ij = sum_k a_ik b_jk e^{G_ik - G_jk} (A: a = b = k;
P: a = q, b = k) with weights dM: da_i = sum_j dM_ij b_j e^{G_i - G_j}, db_j = sum_i dM_ij a_i e^{G_i - G_j},
dG += a * da - b * db (``_bwd_local_k``, and ``_bwd_diag`` for the diagonal sub-blocks of an unbounded
gate; the same splits as the forward). Finally
dg = reverse cumulative sum of dG within the chunk, through a fused gate map when there is one
(``_dg_bwd``). Behind the fused prep of ``kda_gated`` (q, k L2-normalised, beta = sigmoid(logits)) the
last kernels also take the gradients through it: ``_bwd_local_k`` those of the raw q and k,
dx = (dxn - xn <xn, dxn>) / |x| on the rows it finishes, and ``_bwd_dA`` that of the logits,
dbeta * beta (1 - beta).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..device import sm_count
from .triton_fwd import (BC, BT, _chunk, _diag_factors, _load_rows, _load_tile, _pow2, _softplus, _within_half,
                         dot_precision, launch, one_wave_block, state_pass, storage_dtype)


@triton.jit
def _bwd_state_prep(
    P, do, dDl, T, H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BTC: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk, the part of d delta that does not depend on dS', P^T dO (into dDl [B, T, H, V]), so that
    ``_bwd_state``'s sequential steps only load and multiply."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    stride_v = H * V
    r = tl.arange(0, BTC)
    pt = tl.trans(tl.load(P + (i_bh * NT * BTC + t0) * BTC + r[:, None] * BTC + r[None, :]).to(tl.float32))
    for iv in range(tl.cdiv(V, BV)):
        base_v = (i_b * T * H + i_h) * V + t0 * stride_v + iv * BV
        cv = iv * BV + tl.arange(0, BV)
        dO = _load_tile(do + base_v, 0, T_local, stride_v, V - iv * BV, BTC, BV)
        tl.store(dDl + base_v + r[:, None] * stride_v + tl.arange(0, BV)[None, :],
                 tl.dot(pt, dO, input_precision=PREC), mask=(r[:, None] < T_local) & (cv[None, :] < V))


@triton.jit
def _bwd_state(
    Qg, Kd, W, G, do, dht, dHs, dDl, dh0, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BTC: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
):
    """Reverse pass over chunks for one (b, h, V-block): stores dS' of every chunk (dHs [B, H, NT, K, V])
    and completes d delta in dDl (P^T dO there, from ``_bwd_state_prep``, plus Kd dS'); then the
    initial-state gradient. dS' accumulates in float32; the products take the operands' dtype (that of
    dO: bf16 for bf16 inputs, as fla's reverse pass), and the [BT, K] operands (the forward's Qg, Kd and
    W) load straight into shared memory, so that with 2-3 stages the next chunk's loads overlap this
    chunk's products."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BTC)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    hmask = (ck[:, None] < K) & (cv[None, :] < V)
    hoff = ck[:, None] * V + cv[None, :]
    if USE_DHT:
        dh = tl.load(dht + i_bh * K * V + hoff, mask=hmask, other=0.0).to(tl.float32)
    else:
        dh = tl.zeros([BK, BV], dtype=tl.float32)
    stride_v = H * V
    r = tl.arange(0, BTC)
    for i in range(NT):
        n = NT - 1 - i
        t0 = n * BTC
        T_local = T - t0
        tl.store(dHs + (i_bh * NT + n) * K * V + hoff, dh, mask=hmask)
        base_v = (i_b * T * H + i_h) * V + t0 * stride_v + i_v * BV
        pbase = (i_bh * NT * BTC + t0) * K
        kd = _load_rows(Kd + pbase, 0, BTC, K, K, BTC, BK)
        qg = _load_rows(Qg + pbase, 0, BTC, K, K, BTC, BK)
        w = _load_rows(W + pbase, 0, BTC, K, K, BTC, BK)
        g_last = tl.load(G + (i_bh * NT * BTC + t0 + BTC - 1) * K + ck, mask=ck < K, other=0.0)
        dO = _load_rows(do + base_v, 0, T_local, stride_v, V - i_v * BV, BTC, BV)
        dmask = (r[:, None] < T_local) & (cv[None, :] < V)
        dd_ptr = dDl + base_v + r[:, None] * stride_v + tl.arange(0, BV)[None, :]
        dd = tl.load(dd_ptr, mask=dmask, other=0.0) + tl.dot(kd, dh.to(kd.dtype), input_precision=PREC)
        tl.store(dd_ptr, dd, mask=dmask)
        dh = (tl.dot(tl.trans(qg), dO, input_precision=PREC) + dh * tl.exp(g_last)[:, None]
              - tl.dot(tl.trans(w), dd.to(w.dtype), input_precision=PREC))
    if STORE_DH0:
        tl.store(dh0 + i_bh * K * V + hoff, dh, mask=hmask)


@triton.jit
def _v_block(do, Dl, dDl, chunk_v, iv, T_local, V: tl.constexpr, stride_v, BTC: tl.constexpr, BV: tl.constexpr):
    """V-block iv of one chunk (chunk_v: offset of its first element in [B, T, H, V]): the block's offset
    and columns, and dO, delta (both [BT, BV] in their stored dtype) and d delta (float32) there."""
    base_v = chunk_v + iv * BV
    nv = V - iv * BV
    dO = _load_rows(do + base_v, 0, T_local, stride_v, nv, BTC, BV)
    dl = _load_rows(Dl + base_v, 0, T_local, stride_v, nv, BTC, BV)
    ddl = _load_tile(dDl + base_v, 0, T_local, stride_v, nv, BTC, BV)
    return base_v, iv * BV + tl.arange(0, BV), dO, dl, ddl


@triton.jit
def _bwd_local_v(
    v, beta, Tinv, Dl, dDl, do, dv, dPs, dT_parts, db_parts, scale: tl.constexpr,
    T, H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BTC: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk, the gradients that contract over V and need no [BT, K] tile: dv = beta Tinv^T d delta,
    dP = dO delta^T (stored scaled and masked in dPs), and the V parts of dTinv (dT_parts[0]) and of
    dbeta (db_parts[0]); ``_bwd_local_kv`` adds the K parts, ``_bwd_dA`` sums them."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    stride_v = H * V
    r = tl.arange(0, BTC)
    cm_off = (i_bh * NT * BTC + t0) * BTC + r[:, None] * BTC + r[None, :]
    Ti = tl.load(Tinv + cm_off)
    bt = tl.load(beta + i_b * T * H + i_h + (t0 + r) * H, mask=r < T_local, other=0.0).to(tl.float32)
    dP = tl.zeros([BTC, BTC], dtype=tl.float32)
    dT = tl.zeros([BTC, BTC], dtype=tl.float32)
    db = tl.zeros([BTC], dtype=tl.float32)
    for iv in range(tl.cdiv(V, BV)):
        base_v, cv, dO, dl, ddl = _v_block(do, Dl, dDl, (i_b * T * H + i_h) * V + t0 * stride_v, iv, T_local, V,
                                           stride_v, BTC, BV)
        vv = _load_tile(v + base_v, 0, T_local, stride_v, V - iv * BV, BTC, BV)
        dP += tl.dot(dO.to(tl.float32), tl.trans(dl.to(tl.float32)), input_precision=PREC)
        dT += tl.dot(ddl, tl.trans(vv * bt[:, None]), input_precision=PREC)
        dXv = tl.dot(tl.trans(Ti), ddl, input_precision=PREC)
        tl.store(dv + base_v + r[:, None] * stride_v + tl.arange(0, BV)[None, :],
                 (dXv * bt[:, None]).to(dv.dtype.element_ty), mask=(r[:, None] < T_local) & (cv[None, :] < V))
        db += tl.sum(dXv * vv, axis=1)
    tl.store(dPs + cm_off, tl.where(r[:, None] >= r[None, :], dP * scale, 0.0))
    tl.store(dT_parts + cm_off, dT)
    tl.store(db_parts + i_bh * NT * BTC + t0 + r, db)


@triton.jit
def _bwd_local_kv(
    q, k, beta, G, Tinv, Hs, dHs, Dl, dDl, do, dq_p, dk_p, dG_p, dgl, dT_parts, db_parts, scale: tl.constexpr,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BTC: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk and slice of BKS key columns (program axis 2), the gradients that contract over V into
    a [BT, K] result: dq = scale e^G dO S^T, the W and Kd paths (dW = -d delta S^T, dKd = delta dS'^T)
    into dk and dG, and d G_last; plus this slice's parts of dTinv and dbeta (dT_parts[1 + slice],
    db_parts[1 + slice]). Slicing K keeps three [BT, BKS] accumulators per program instead of [BT, K].
    dO S^T and delta dS'^T take their operands as stored (bf16 for bf16 inputs); d delta S^T is float32."""
    i_n, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    stride_k = H * K
    stride_v = H * V
    r = tl.arange(0, BTC)
    ck = i_k * BKS + tl.arange(0, BKS)
    cm_off = (i_bh * NT * BTC + t0) * BTC + r[:, None] * BTC + r[None, :]
    dQ1 = tl.zeros([BTC, BKS], dtype=tl.float32)
    dW = tl.zeros([BTC, BKS], dtype=tl.float32)
    dKd = tl.zeros([BTC, BKS], dtype=tl.float32)
    dglast = tl.zeros([BKS], dtype=tl.float32)
    for iv in range(tl.cdiv(V, BV)):
        _, cv, dO, dl, ddl = _v_block(do, Dl, dDl, (i_b * T * H + i_h) * V + t0 * stride_v, iv, T_local, V,
                                      stride_v, BTC, BV)
        hmask = (ck[:, None] < K) & (cv[None, :] < V)
        hoff = (i_bh * NT + i_n) * K * V + ck[:, None] * V + cv[None, :]
        h = tl.load(Hs + hoff, mask=hmask, other=0.0)
        dh = tl.load(dHs + hoff, mask=hmask, other=0.0)
        dQ1 += tl.dot(dO, tl.trans(h.to(dO.dtype)), input_precision=PREC)
        dKd += tl.dot(dl, tl.trans(dh.to(dl.dtype)), input_precision=PREC)
        h = h.to(tl.float32)
        dW -= tl.dot(ddl, tl.trans(h), input_precision=PREC)
        dglast += tl.sum(h * dh.to(tl.float32), axis=1)
    # the [BT, BKS] inputs are loaded only now, so they hold no registers during the V loop
    base_k = (i_b * T * H + i_h) * K + t0 * stride_k + i_k * BKS
    nk = K - i_k * BKS
    kk = _load_tile(k + base_k, 0, T_local, stride_k, nk, BTC, BKS)
    qq = _load_tile(q + base_k, 0, T_local, stride_k, nk, BTC, BKS)
    G_ptr = G + (i_bh * NT * BTC + t0) * K + i_k * BKS
    Gc = _load_tile(G_ptr, 0, BTC, K, nk, BTC, BKS)
    g_last = tl.load(G_ptr + (BTC - 1) * K + tl.arange(0, BKS), mask=ck < K, other=0.0)
    Ti = tl.load(Tinv + cm_off)
    bt = tl.load(beta + i_b * T * H + i_h + (t0 + r) * H, mask=r < T_local, other=0.0).to(tl.float32)
    eG = tl.exp(Gc)
    ke = kk * eG
    part = (1 + i_k) * (tl.num_programs(1) * NT * BTC)           # offset of this slice's part
    tl.store(dT_parts + part * BTC + cm_off, tl.dot(dW, tl.trans(ke * bt[:, None]), input_precision=PREC))
    dXk = tl.dot(tl.trans(Ti), dW, input_precision=PREC)
    tl.store(db_parts + part + i_bh * NT * BTC + t0 + r, tl.sum(dXk * ke, axis=1))
    dk = dXk * eG * bt[:, None]
    dG = dXk * ke * bt[:, None]
    dq = dQ1 * eG * scale
    dG += qq * dq
    decay = tl.exp(g_last[None, :] - Gc)
    kd = kk * decay
    dk += dKd * decay
    dG -= kd * dKd
    dglast = dglast * tl.exp(g_last) + tl.sum(kd * dKd, axis=0)
    poff = (i_bh * NT * BTC + t0 + r[:, None]) * K + ck[None, :]
    pmask = (r[:, None] < BTC) & (ck[None, :] < K)
    tl.store(dq_p + poff, dq, mask=pmask)
    tl.store(dk_p + poff, dk, mask=pmask)
    tl.store(dG_p + poff, dG, mask=pmask)
    tl.store(dgl + (i_bh * NT + i_n) * K + ck, dglast, mask=ck < K)


@triton.jit
def _bwd_dA(
    beta, At, Tinv, dT_parts, db_parts, dAs, dbeta, T, H: tl.constexpr, NPARTS: tl.constexpr, BTC: tl.constexpr,
    PREC: tl.constexpr, LOGITS: tl.constexpr,
):
    """Per chunk: dTinv and dbeta summed over their NPARTS parts (V, then each key slice), then
    dA = -Tinv^T dTinv Tinv^T (strictly lower; stored times beta in dAs) and dbeta += rowsum(dA * At).
    LOGITS: beta = sigmoid(logits), and dbeta is stored as the logits' gradient, dbeta * beta (1 - beta)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    r = tl.arange(0, BTC)
    cm_off = (i_bh * NT * BTC + t0) * BTC + r[:, None] * BTC + r[None, :]
    stride = tl.num_programs(1) * NT * BTC
    dT = tl.zeros([BTC, BTC], dtype=tl.float32)
    db = tl.zeros([BTC], dtype=tl.float32)
    for i in tl.static_range(NPARTS):
        dT += tl.load(dT_parts + i * stride * BTC + cm_off)
        db += tl.load(db_parts + i * stride + i_bh * NT * BTC + t0 + r)
    Ti = tl.load(Tinv + cm_off)
    dA = -tl.dot(tl.trans(Ti), tl.dot(dT, tl.trans(Ti), input_precision=PREC), input_precision=PREC)
    dA = tl.where(r[:, None] > r[None, :], dA, 0.0)
    db += tl.sum(dA * tl.load(At + cm_off).to(tl.float32), axis=1)
    bt = tl.load(beta + i_b * T * H + i_h + (t0 + r) * H, mask=r < T_local, other=0.0).to(tl.float32)
    tl.store(dAs + cm_off, dA * bt[:, None])
    if LOGITS:
        db = db * bt * (1.0 - bt)
    tl.store(dbeta + i_b * T * H + i_h + (t0 + r) * H, db, mask=r < T_local)


@triton.jit
def _rows_da(
    M1, M2, b, Gall, G_n, n, G_ptr, K, SAFE: tl.constexpr,
    BTC: tl.constexpr, BCC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """da_i = sum_j M_ij b_j e^{G_i - G_j} for the 16 rows i of sub-block n, for two lower-triangular
    weight matrices sharing b. M1, M2: [BC, BT] those rows; b, Gall: [BT, BK]. Returns two [BC, BK].
    SAFE as in ``_decayed_rows``; when false the diagonal sub-block (j in block n) is left to ``_bwd_diag``."""
    cols = tl.arange(0, BTC)
    ck = tl.arange(0, BK)
    if SAFE:
        g_mid = tl.load(G_ptr + (n * BCC + BCC // 2) * K + ck, mask=ck < K, other=0.0)
        e_col = tl.where(cols[:, None] < (n + 1) * BCC, g_mid[None, :] - Gall, 0.0)
        bf = b.to(tl.float32) * tl.exp(e_col)
        rf = tl.exp(G_n - g_mid[None, :])
        out1 = rf * tl.dot(M1, bf, input_precision=PREC)
        out2 = rf * tl.dot(M2, bf, input_precision=PREC)
    else:
        g_first = tl.load(G_ptr + (n * BCC) * K + ck, mask=ck < K, other=0.0)
        e_col = tl.where(cols[:, None] < n * BCC, g_first[None, :] - Gall, 0.0)
        earlier = cols[None, :] < n * BCC
        bf = b.to(tl.float32) * tl.exp(tl.minimum(e_col, 0.0))
        rf = tl.exp(G_n - g_first[None, :])
        out1 = rf * tl.dot(tl.where(earlier, M1, 0.0), bf, input_precision=PREC)
        out2 = rf * tl.dot(tl.where(earlier, M2, 0.0), bf, input_precision=PREC)
    return out1, out2


@triton.jit
def _cols_db(
    M1t, a1, M2t, a2, Gall, G_m, m, G_ptr, K, SAFE: tl.constexpr,
    BTC: tl.constexpr, BCC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """db_j = sum_i M_ij a_i e^{G_i - G_j} for the 16 columns j of sub-block m, for two pairs (M1, a1),
    (M2, a2). Mt: [BC, BT] with Mt[j, i] = M[i, m*BC + j] (M lower-triangular); a, Gall: [BT, BK].
    Returns two [BC, BK]. When SAFE is false the diagonal sub-block (i in block m) is left to ``_bwd_diag``."""
    cols = tl.arange(0, BTC)
    ck = tl.arange(0, BK)
    if SAFE:
        g_mid = tl.load(G_ptr + (m * BCC + BCC // 2) * K + ck, mask=ck < K, other=0.0)
        e_row = tl.exp(tl.where(cols[:, None] >= m * BCC, Gall - g_mid[None, :], 0.0))
        cf = tl.exp(g_mid[None, :] - G_m)
        out1 = cf * tl.dot(M1t, a1.to(tl.float32) * e_row, input_precision=PREC)
        out2 = cf * tl.dot(M2t, a2.to(tl.float32) * e_row, input_precision=PREC)
    else:
        g_end = tl.load(G_ptr + (m * BCC + BCC - 1) * K + ck, mask=ck < K, other=0.0)
        later = cols >= (m + 1) * BCC
        e_row = tl.exp(tl.minimum(tl.where(later[:, None], Gall - g_end[None, :], 0.0), 0.0))
        cf = tl.exp(g_end[None, :] - G_m)
        out1 = cf * tl.dot(tl.where(later[None, :], M1t, 0.0), a1.to(tl.float32) * e_row, input_precision=PREC)
        out2 = cf * tl.dot(tl.where(later[None, :], M2t, 0.0), a2.to(tl.float32) * e_row, input_precision=PREC)
    return out1, out2


@triton.jit
def _bwd_diag(
    q, k, G, Gh, dPs, dAs, dq_p, dk_p, dG_p, T, H: tl.constexpr, K: tl.constexpr, BKS: tl.constexpr,
    BTC: tl.constexpr, BCC: tl.constexpr, PREC: tl.constexpr,
):
    """The diagonal 16x16 sub-blocks of the decayed-product gradients for an unbounded gate (softplus),
    added into the partial sums dq_p, dk_p, dG_p before ``_bwd_local_k`` (which covers the earlier
    sub-blocks). One program per (chunk x sub-block, b*h, BKS key columns: the products are column-wise,
    so the slices are independent). With the pairwise decays E_ij = e^{G_i - G_j} (j <= i) the four
    products are
        x1_i = sum_j dP_ij k_j E_ij,  x3_i = sum_j dA_ij k_j E_ij   (row side, a = q and a = k)
        x2_j = sum_i dP_ij q_i E_ij,  x4_j = sum_i dA_ij k_i E_ij   (column side)
    each two masked tensor-core products, as the forward splits them (``triton_fwd._diag_factors``: the
    pairs across the middle row, then those within a half) and P's diagonal (E_ii = 1); then dq += x1,
    dk += x2 + x3 + x4, dG += q x1 - k x2 + k (x3 - x4)."""
    i_n, n = tl.program_id(0) // (BTC // BCC), tl.program_id(0) % (BTC // BCC)
    i_bh, c0 = tl.program_id(1), tl.program_id(2) * BKS
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    stride_k = H * K
    base_k = (i_b * T * H + i_h) * K + t0 * stride_k + c0
    G_ptr = G + (i_bh * NT * BTC + t0) * K
    r16 = tl.arange(0, BCC)
    cd = c0 + tl.arange(0, BKS)
    rows = n * BCC + r16
    qd = _load_tile(q + base_k, n * BCC, T_local, stride_k, K - c0, BCC, BKS)
    kd = _load_tile(k + base_k, n * BCC, T_local, stride_k, K - c0, BCC, BKS)
    Gd = _load_tile(G_ptr + c0, n * BCC, BTC, K, K - c0, BCC, BKS)
    moff = (i_bh * NT * BTC + t0 + rows[:, None]) * BTC + rows[None, :]
    dP = tl.load(dPs + moff)    # lower triangle with its diagonal (as stored)
    dA = tl.load(dAs + moff)    # strictly lower
    up, lo, u, l = _diag_factors(Gd, G_ptr, Gh + (i_bh * NT * BTC + t0) * K, n, c0, K, BCC, BKS)
    within = _within_half(BCC)
    hP = tl.where(within, dP, 0.0)
    hA = tl.where(within, dA, 0.0)
    dP_ii = tl.sum(tl.where(r16[:, None] == r16[None, :], dP, 0.0), axis=1)[:, None]   # E_ii = 1
    kl, kh = kd * lo, kd * l
    x1 = dP_ii * kd + up * tl.dot(dP, kl, input_precision=PREC) + u * tl.dot(hP, kh, input_precision=PREC)
    x3 = up * tl.dot(dA, kl, input_precision=PREC) + u * tl.dot(hA, kh, input_precision=PREC)
    x2 = (dP_ii * qd + lo * tl.dot(tl.trans(dP), qd * up, input_precision=PREC)
          + l * tl.dot(tl.trans(hP), qd * u, input_precision=PREC))
    x4 = (lo * tl.dot(tl.trans(dA), kd * up, input_precision=PREC)
          + l * tl.dot(tl.trans(hA), kd * u, input_precision=PREC))
    poff = (i_bh * NT * BTC + t0 + rows[:, None]) * K + cd[None, :]
    pmask = cd[None, :] < K
    tl.store(dq_p + poff, tl.load(dq_p + poff, mask=pmask) + x1, mask=pmask)
    tl.store(dk_p + poff, tl.load(dk_p + poff, mask=pmask) + x2 + x3 + x4, mask=pmask)
    tl.store(dG_p + poff, tl.load(dG_p + poff, mask=pmask) + qd * x1 - kd * x2 + kd * (x3 - x4), mask=pmask)


@triton.jit
def _bwd_local_k(
    q, k, G, dPs, dAs, dq_p, dk_p, dG_p, dq, dk, rq, rk,
    T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BTC: tl.constexpr, BCC: tl.constexpr,
    RB: tl.constexpr, SAFE: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr,
):
    """Gradients through the decayed products A (a = b = k) and P (a = q, b = k) for RB rows of a chunk
    (program axis 0 runs over chunks x row blocks); SAFE: a bounded gate, whose diagonal sub-blocks are
    in these products too (else ``_bwd_diag`` has added them into the partial sums). dq and dk are
    final; dG is completed in place in dG_p [B, H, Tp, K] for ``_dg_bwd``. NORM: q and k
    are L2-normalised rows with inverse norms rq, rk [B, T, H], and dq, dk are stored as the gradients
    of the raw rows, (dxn - xn <xn, dxn>) / |x|."""
    NRB: tl.constexpr = BTC // RB
    i_n, i_r, i_bh = tl.program_id(0) // NRB, tl.program_id(0) % NRB, tl.program_id(1)
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    stride_k = H * K
    base_k = (i_b * T * H + i_h) * K + t0 * stride_k
    q_ptr = q + base_k
    k_ptr = k + base_k
    G_ptr = G + (i_bh * NT * BTC + t0) * K
    # the chunk's keys and queries stay in their storage dtype (bf16 in training), converted where used:
    # two [BT, K] fp32 tiles held across the program spilled registers
    kk = _load_rows(k_ptr, 0, T_local, stride_k, K, BTC, BK)
    qq = _load_rows(q_ptr, 0, T_local, stride_k, K, BTC, BK)
    Gall = _load_tile(G_ptr, 0, BTC, K, K, BTC, BK)
    ck = tl.arange(0, BK)
    cols = tl.arange(0, BTC)
    r16 = tl.arange(0, BCC)
    mbase = (i_bh * NT * BTC + t0) * BTC
    pbase = (i_bh * NT * BTC + t0) * K
    for s in tl.static_range(RB // BCC):
        n = i_r * (RB // BCC) + s
        rows = n * BCC + r16
        G_n = _load_tile(G_ptr, n * BCC, BTC, K, K, BCC, BK)
        k_n = _load_tile(k_ptr, n * BCC, T_local, stride_k, K, BCC, BK)
        q_n = _load_tile(q_ptr, n * BCC, T_local, stride_k, K, BCC, BK)
        row_off = mbase + rows[:, None] * BTC + cols[None, :]
        col_off = mbase + cols[None, :] * BTC + rows[:, None]          # [j, i] -> M[i, j]
        dP_r = tl.load(dPs + row_off)
        dA_r = tl.load(dAs + row_off)
        dP_c = tl.load(dPs + col_off)
        dA_c = tl.load(dAs + col_off)
        x1, x3 = _rows_da(dP_r, dA_r, kk, Gall, G_n, n, G_ptr, K, SAFE, BTC, BCC, BK, PREC)
        x2, x4 = _cols_db(dP_c, qq, dA_c, kk, Gall, G_n, n, G_ptr, K, SAFE, BTC, BCC, BK, PREC)
        poff = pbase + rows[:, None] * K + ck[None, :]
        pmask = ck[None, :] < K
        dq_n = tl.load(dq_p + poff, mask=pmask, other=0.0) + x1
        dk_n = tl.load(dk_p + poff, mask=pmask, other=0.0) + x2 + x3 + x4
        dG_n = tl.load(dG_p + poff, mask=pmask, other=0.0) + q_n * x1 - k_n * x2 + k_n * (x3 - x4)
        tl.store(dG_p + poff, dG_n, mask=pmask)
        if NORM:
            inv = (i_b * T + t0 + rows) * H + i_h
            rq_n = tl.load(rq + inv, mask=rows < T_local, other=0.0)
            rk_n = tl.load(rk + inv, mask=rows < T_local, other=0.0)
            dq_n = (dq_n - q_n * tl.sum(q_n * dq_n, axis=1)[:, None]) * rq_n[:, None]
            dk_n = (dk_n - k_n * tl.sum(k_n * dk_n, axis=1)[:, None]) * rk_n[:, None]
        out_off = base_k + rows[:, None] * stride_k + ck[None, :]
        omask = (rows[:, None] < T_local) & (ck[None, :] < K)
        tl.store(dq + out_off, dq_n.to(dq.dtype.element_ty), mask=omask)
        tl.store(dk + out_off, dk_n.to(dk.dtype.element_ty), mask=omask)


@triton.jit
def _dg_bwd(
    dG_p, dgl, z, A_log, dt_bias, dg, dA_part, ddt_part, T, H: tl.constexpr, K: tl.constexpr, BKS: tl.constexpr,
    BTC: tl.constexpr, GATE: tl.constexpr, G_MIN: tl.constexpr,
):
    """Per chunk and slice of BKS key columns (program axis 2), dg = d G_last + the reverse cumulative
    sum of dG within the chunk (G is the within-chunk cumsum of g), then through a fused gate (GATE 1 =
    sigmoid map g = G_MIN sigmoid(a (z + dt_bias)), 2 = softplus map g = -a softplus(z + dt_bias), a = exp(A_log[h])).
    Writes dg [B, T, H, K] (the gradient of z with a fused gate, in dg's dtype) and partial sums of
    dA_log per chunk and slice (dA_part [B, H, NT, NKS]) and of dt_bias per chunk
    (ddt_part [B, H, NT, K])."""
    i_n, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, NT, t0, T_local = _chunk(i_n, i_bh, T, H, BTC)
    stride_k = H * K
    r = tl.arange(0, BTC)
    ck = i_k * BKS + tl.arange(0, BKS)
    m = (r[:, None] < T_local) & (ck[None, :] < K)
    dG = tl.load(dG_p + (i_bh * NT * BTC + t0 + r[:, None]) * K + ck[None, :], mask=ck[None, :] < K, other=0.0)
    carry = tl.load(dgl + (i_bh * NT + i_n) * K + ck, mask=ck < K, other=0.0)
    d = carry[None, :] + tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG
    off = (i_b * T * H + i_h) * K + t0 * stride_k + r[:, None] * stride_k + ck[None, :]
    if GATE > 0:
        zz = tl.load(z + off, mask=m, other=0.0).to(tl.float32)
        zb = zz + tl.load(dt_bias + i_h * K + ck, mask=ck < K, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        part = (i_bh * NT + i_n) * tl.num_programs(2) + i_k      # this chunk and slice's dA_log part
        if GATE == 1:
            sg = tl.sigmoid(a * zb)
            dpre = tl.where(m, d * G_MIN * sg * (1.0 - sg), 0.0)
            tl.store(dA_part + part, tl.sum(tl.sum(dpre * a * zb, axis=1), axis=0))
            d = dpre * a
        else:
            d = tl.where(m, d, 0.0)
            tl.store(dA_part + part, tl.sum(tl.sum(-d * a * _softplus(zb), axis=1), axis=0))
            d = -d * a * tl.sigmoid(zb)
        tl.store(ddt_part + (i_bh * NT + i_n) * K + ck, tl.sum(d, axis=0), mask=ck < K)
    tl.store(dg + off, d.to(dg.dtype.element_ty), mask=m)


def kda_bwd(q, k, v, beta, scale, initial_state, saved, do, dht, safe_gate, prec=None,
            gate=0, z=None, A_log=None, dt_bias=None, g_min=-5.0, prep_norms=None):
    """Launch the backward kernels. Returns dq, dk, dv, dg, dbeta, the initial-state gradient (None
    without an initial state), dA_log and ddt_bias. Without a fused gate (gate = 0) dg is the gradient
    of the log-decay g and the last two are None; with gate 1 (sigmoid) or 2 (softplus) it is the
    gradient of the raw input z, and dA_log [H] and ddt_bias [H * K] come along. prep_norms: the inverse
    norms (rq, rk) [B, T, H] of the fused prep (``triton_fwd.prep_fwd``), whose outputs q, k and beta
    then are: dq, dk and dbeta come back as the gradients of its inputs (raw q, k and the beta logits),
    dq and dk in q's and k's dtype, dbeta in fp32. saved: the forward's tensors by name
    (``triton_fwd.chunk_intermediates``; Gh only for an unbounded gate)."""
    import torch

    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    Tp = NT * BT
    BK = _pow2(K)
    prec = prec or dot_precision(q.dtype)
    dev = q.device
    f32 = torch.float32
    G, At, P, Tinv, W, Kd, Qg = (saved[n] for n in ("G", "At", "P", "Tinv", "W", "Kd", "Qg"))
    do = do.contiguous()
    dDl = torch.empty(B, T, H, V, device=dev, dtype=f32)
    _bwd_state_prep[(NT, B * H)](P, do, dDl, T, H, V, min(64, _pow2(V)), BT, prec, num_warps=8)
    if "Hs" in saved:
        Hs, Dl = saved["Hs"], saved["Dl"]
    else:  # the forward kept U instead (recompute_states): one more sequential pass
        h0 = None if initial_state is None else initial_state.contiguous()
        Hs, Dl, _ = state_pass(Kd, W, saved["U"], G, h0, prec, False)
    dHs = torch.empty(B, H, NT, K, V, device=dev, dtype=storage_dtype(do.dtype))
    dh0 = torch.empty(B, H, K, V, device=dev, dtype=f32) if initial_state is not None else None
    dummy = G
    BVS, opts = launch("bwd_state", V)
    BVS = one_wave_block(BVS, V, B * H, sm_count(dev))
    _bwd_state[(triton.cdiv(V, BVS), B * H)](
        Qg, Kd, W, G, do, dummy if dht is None else dht.contiguous(), dHs, dDl, dummy if dh0 is None else dh0,
        T, H, K, V, BK, BVS, BT, dht is not None, dh0 is not None, prec, **opts)
    dq_p = torch.empty(B, H, Tp, K, device=dev, dtype=f32)
    dk_p = torch.empty_like(dq_p)
    dv = torch.empty_like(v)
    dPs = torch.empty(B, H, Tp, BT, device=dev, dtype=f32)
    dAs = torch.empty(B, H, Tp, BT, device=dev, dtype=f32)
    dG_p = torch.empty_like(dq_p)
    dgl = torch.empty(B, H, NT, K, device=dev, dtype=f32)
    dbeta = torch.empty(B, T, H, device=dev, dtype=f32)
    BVK, kv_opts = launch("bwd_local_kv", V)
    BKS = min(kv_opts.pop("BKS"), BK)
    NK = triton.cdiv(K, BKS)
    dT_parts = torch.empty(1 + NK, B, H, Tp, BT, device=dev, dtype=f32)
    db_parts = torch.empty(1 + NK, B, H, Tp, device=dev, dtype=f32)
    BVL, opts = launch("bwd_local_v", V)
    _bwd_local_v[(NT, B * H)](v, beta, Tinv, Dl, dDl, do, dv, dPs, dT_parts, db_parts, float(scale),
                              T, H, V, BVL, BT, prec, **opts)
    _bwd_local_kv[(NT, B * H, NK)](q, k, beta, G, Tinv, Hs, dHs, Dl, dDl, do, dq_p, dk_p, dG_p, dgl, dT_parts,
                                   db_parts, float(scale), T, H, K, V, BKS, BVK, BT, prec, **kv_opts)
    norm = prep_norms is not None
    _bwd_dA[(NT, B * H)](beta, At, Tinv, dT_parts, db_parts, dAs, dbeta, T, H, 1 + NK, BT, prec, norm, num_warps=4)
    dq = torch.empty(q.shape, device=dev, dtype=q.dtype)
    dk = torch.empty(k.shape, device=dev, dtype=k.dtype)
    rq, rk = prep_norms if norm else (dummy, dummy)
    if not safe_gate:
        _, diag_opts = launch("bwd_diag")
        BKS_D = min(diag_opts.pop("BKS"), BK)
        _bwd_diag[(NT * (BT // BC), B * H, triton.cdiv(K, BKS_D))](q, k, G, saved["Gh"], dPs, dAs, dq_p, dk_p, dG_p,
                                                                  T, H, K, BKS_D, BT, BC, prec, **diag_opts)
    _, k_opts = launch("bwd_local_k")
    RB = k_opts.pop("RB")
    _bwd_local_k[(NT * (BT // RB), B * H)](q, k, G, dPs, dAs, dq_p, dk_p, dG_p, dq, dk, rq, rk,
                                           T, H, K, BK, BT, BC, RB, bool(safe_gate), prec, norm, **k_opts)
    # dg: the gradient of the log-decay g, or of the raw gate input z when the gate map is fused
    dg = torch.empty(B, T, H, K, device=dev, dtype=f32) if not gate else torch.empty_like(z)
    _, g_opts = launch("dg_bwd")
    BKG = min(g_opts.pop("BKS"), BK)
    NKG = triton.cdiv(K, BKG)
    dA_part = torch.empty(B, H, NT, NKG, device=dev, dtype=f32) if gate else None
    ddt_part = torch.empty(B, H, NT, K, device=dev, dtype=f32) if gate else None
    _dg_bwd[(NT, B * H, NKG)](dG_p, dgl, dummy if z is None else z, dummy if A_log is None else A_log,
                              dummy if dt_bias is None else dt_bias, dg, dummy if dA_part is None else dA_part,
                              dummy if ddt_part is None else ddt_part, T, H, K, BKG, BT, gate, float(g_min),
                              **g_opts)
    dA_log = dA_part.sum((0, 2, 3)) if gate else None
    ddt = ddt_part.sum((0, 2)).reshape(H * K) if gate else None
    return dq, dk, dv, dg, dbeta.to(beta.dtype), dh0, dA_log, ddt
