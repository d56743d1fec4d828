"""Token-by-token reference for Kimi Delta Attention (KDA), Kimi Linear arXiv:2510.26692, eq. (1):

    S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t v_t^T,   a_t = exp(g_t)
    o_t = scale * S_t^T q_t

Written for clarity, not speed: the tests compare every faster implementation with it (in float64).
"""
from __future__ import annotations

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA.

    Shapes: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V].
    Returns o [B, T, H, V] (dtype of v) and the final state [B, H, K, V] (float32, or float64 for
    float64 inputs) when ``output_final_state``, else None. Computes in float64 for float64 inputs
    and in float32 otherwise.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = _compute_dtype(q)
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.to(dt)
    outs = []
    for t in range(T):
        qt, kt, vt, bt = q[:, t], k[:, t], v[:, t], beta[:, t, :, None]
        S = S * g[:, t].exp().unsqueeze(-1)                       # Diag(a_t) S_{t-1}
        kS = torch.einsum("bhk,bhkv->bhv", kt, S)                 # k_t^T Diag(a_t) S_{t-1}
        S = S + torch.einsum("bhk,bhv->bhkv", kt, bt * (vt - kS))  # delta-rule update
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", qt, S))
    o = torch.stack(outs, dim=1).to(v.dtype)
    final = None
    if output_final_state:
        final = S if dt == torch.float64 else S.float()
    return o, final
