"""Chunkwise Kimi Delta Attention in plain PyTorch (Kimi Linear, arXiv:2510.26692, section 3).

Inside a chunk of C = 64 tokens, with G_t = sum_{s <= t} g_s (cumulative log-decay from the chunk
start, per channel) and S the state entering the chunk, unrolling the recurrence gives

    S_t = Diag(e^{G_t}) S + sum_{i <= t} Diag(e^{G_t - G_i}) k_i delta_i^T
    delta_i = beta_i (v_i - (Diag(a_i) S_{i-1})^T k_i)              (the delta-rule residual)

and delta solves a unit lower-triangular system (the UT / WY transform):

    (I + A) delta = Diag(beta) V - Diag(beta) (K * e^G) S,   A_ij = beta_i k_i^T Diag(e^{G_i - G_j}) k_j  (j < i)
    => delta = U - W S,   U = (I + A)^{-1} Diag(beta) V,   W = (I + A)^{-1} Diag(beta) (K * e^G)

Outputs and the state passed to the next chunk:

    o_t   = scale * ( (q_t * e^{G_t})^T S + sum_{i <= t} (q_t^T Diag(e^{G_t - G_i}) k_i) delta_i )
    S_new = Diag(e^{G_C}) S + sum_i Diag(e^{G_C - G_i}) k_i delta_i^T

Everything but the short loop over chunks runs batched over all chunks. Numerical safety: the
pairwise factors e^{G_t - G_i} (t >= i) are never formed as e^{G_t} * e^{-G_i}, which overflows
when the decay is strong (g can reach -300 per token with a saturated softplus gate). The chunk
is cut into 16-token sub-blocks: across sub-blocks the factor is split at the first token of the
query's sub-block and the last token of the key's sub-block, all exponents <= 0; inside a sub-block it is
split at its middle token when the decay across the sub-block allows it (|exponent| <= 60 in
float32, always the case for the sigmoid map) and computed pair by pair otherwise. When the decay
across the whole chunk is mild (|G_t - G_mid| <= 40 in float32) a single split at the chunk's middle
token makes each product one matmul. No number that
could overflow is ever exponentiated.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
SUB = 16
# Largest |exponent| allowed when a decay factor is split in two (e^60 ~ 1e26 < float32 max 3e38).
# The same limits apply in float64, so the float64 tests run the paths that float32 training runs.
_FACTOR_LIMIT = 60.0
# Same for the split at the middle of the whole chunk, whose products above the diagonal (computed,
# then masked) reach twice the exponent: e^80 ~ 6e34 stays finite in float32.
_CHUNK_LIMIT = 40.0


class DecayFactors:
    """Overflow-safe pieces of the pairwise decays e^{G_t - G_i} (t >= i) of a chunk.

    G: [..., C, K] within-chunk cumulative log-decay (non-increasing along C, C a multiple of 16).
    Across sub-blocks (query t in sub-block n, key i in an earlier sub-block m) the factor is

        e^{G_t - G_i} = e^{G_t - G_{r_n}} * e^{G_{r_n} - G_{e_m}} * e^{G_{e_m} - G_i}

    with r_n the first token of sub-block n and e_m the last token of sub-block m: three exponents
    <= 0. Inside a sub-block the factor is split at its middle token when that is safe, else formed
    pair by pair (see the module docstring). When the decay across the whole chunk is mild
    (|G - G_mid| <= _CHUNK_LIMIT, e.g. the softplus map at its initialisation) the factor is split
    once at the chunk's middle token and each product is one matmul (``whole_row``/``whole_col``).
    """

    def __init__(self, G: torch.Tensor):
        *batch, C, K = G.shape
        mid_c = G[..., C // 2 : C // 2 + 1, :]
        self.whole_row = None
        if (G - mid_c).abs().amax() <= _CHUNK_LIMIT:
            self.whole_row = torch.exp(G - mid_c)                           # [..., C, K]
            self.whole_col = self.whole_row.reciprocal()
            return
        nb = C // SUB
        Gb = G.reshape(*batch, nb, SUB, K)
        first, last = Gb[..., :1, :], Gb[..., -1:, :]
        self.nb = nb
        self.row = torch.exp(Gb - first)                                    # [..., nb, SUB, K]
        self.col = torch.exp(last - Gb)                                     # [..., nb, SUB, K]
        # cross[n, m] = e^{G_{r_n} - G_{e_m}} for m < n (clamped entries are masked later).
        cross = first.squeeze(-2).unsqueeze(-2) - last.squeeze(-2).unsqueeze(-3)
        self.cross = torch.exp(cross.clamp(max=0))                          # [..., nb(n), nb(m), K]
        mid = Gb[..., SUB // 2 : SUB // 2 + 1, :]
        if (Gb - mid).abs().amax() <= _FACTOR_LIMIT:
            self.mid_row = torch.exp(Gb - mid)
            self.mid_col = self.mid_row.reciprocal()
            self.pair = None
        else:
            self.pair = torch.exp((Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).clamp(max=0))  # [..., nb, SUB, SUB, K]


def decayed_products(a: torch.Tensor, b: torch.Tensor, f: DecayFactors, strict: bool) -> torch.Tensor:
    """M[..., t, i] = sum_k a[..., t, k] b[..., i, k] exp(G[..., t, k] - G[..., i, k]) for i <= t
    (i < t when ``strict``), 0 above. a, b: [..., C, K]; f: the DecayFactors of G. Returns [..., C, C].
    """
    *batch, C, K = a.shape
    if f.whole_row is not None:
        M = (a * f.whole_row) @ (b * f.whole_col).transpose(-1, -2)
        return M * torch.ones(C, C, device=a.device, dtype=a.dtype).tril(-1 if strict else 0)
    nb = f.nb
    ab = a.reshape(*batch, nb, SUB, K)
    bb = b.reshape(*batch, nb, SUB, K)
    # Earlier sub-blocks: off[n, m] (query block n, key block m < n), only the nb(nb-1)/2 pairs needed.
    n_idx, m_idx = torch.tril_indices(nb, nb, -1, device=a.device)
    a_row = (ab * f.row)[..., n_idx, :, :] * f.cross[..., n_idx, m_idx, :].unsqueeze(-2)  # [..., P, SUB, K]
    b_col = (bb * f.col)[..., m_idx, :, :]
    pairs = a_row @ b_col.transpose(-1, -2)  # in autocast's dtype when autocast is on, hence new_zeros on it
    off = pairs.new_zeros(*batch, nb, nb, SUB, SUB)
    off[..., n_idx, m_idx, :, :] = pairs
    # Same sub-block.
    if f.pair is None:
        diag = (ab * f.mid_row) @ (bb * f.mid_col).transpose(-1, -2)         # [..., nb, SUB, SUB]
    else:
        diag = (ab.unsqueeze(-2) * bb.unsqueeze(-3) * f.pair).sum(-1)
    diag = diag * torch.ones(SUB, SUB, device=a.device, dtype=a.dtype).tril(-1 if strict else 0)
    eye = torch.eye(nb, device=a.device, dtype=a.dtype)
    M = off + diag.unsqueeze(-3) * eye[:, :, None, None]                     # [..., nb, nb, SUB, SUB]
    return M.transpose(-3, -2).reshape(*batch, C, C)


def kda_chunk_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA, differentiable through plain torch ops.

    Shapes: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V].
    Any T: the sequence is padded to a multiple of ``chunk_size`` with k = v = g = beta = 0, which
    leaves the state untouched. Returns o [B, T, H, V] (dtype of v) and the final state
    [B, H, K, V] (float32; float64 for float64 inputs) or None. Computes in float64 for float64
    inputs and in float32 otherwise.
    """
    if chunk_size % SUB:
        raise ValueError(f"chunk_size must be a multiple of {SUB}, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = K**-0.5 if scale is None else scale
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B, H, N, C, D]
        x = F.pad(x.to(dt), (0, 0, 0, 0, 0, pad))
        return x.transpose(1, 2).reshape(B, H, N, C, x.shape[-1])

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = chunks(beta.unsqueeze(-1))                                  # [B, H, N, C, 1]
    G = g.cumsum(-2)                                                   # within-chunk cumulative decay

    f = DecayFactors(G)
    A = beta * decayed_products(k, k, f, strict=True)                  # [B, H, N, C, C]
    eye = torch.eye(C, device=q.device, dtype=dt)
    eG = G.exp()                                                       # decay from the chunk start
    rhs = torch.cat([beta * v, beta * k * eG], dim=-1)                 # [B, H, N, C, V + K]
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :V], UW[..., V:]

    P = scale * decayed_products(q, k, f, strict=False)                # [B, H, N, C, C]
    qG = scale * q * eG                                                # [B, H, N, C, K]
    kG = k * (G[..., -1:, :] - G).exp()                                # decay to the chunk end
    aC = G[..., -1, :].exp().unsqueeze(-1)                             # [B, H, N, K, 1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for n in range(N):
        delta = U[:, :, n] - W[:, :, n] @ S                            # [B, H, C, V]
        outs.append(qG[:, :, n] @ S + P[:, :, n] @ delta)
        S = aC[:, :, n] * S + kG[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    final = None
    if output_final_state:
        final = S if dt == torch.float64 else S.float()
    return o.to(out_dtype), final
