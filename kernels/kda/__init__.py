"""Kimi Delta Attention (KDA) kernels, Kimi Linear arXiv:2510.26692.

Per head: S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,  o_t = scale * S_t^T q_t.

Entry points: :func:`kda` (q, k normalised, log-decay g and beta given) and :func:`kda_gated` (raw q, k,
gate input z and beta logits: the model layer's call). Implementations:
- ``recurrent.kda_recurrent``: token-by-token reference (the tests' ground truth, float64).
- ``chunk_torch.kda_chunk_torch``: chunkwise plain PyTorch (chunk 64, UT/WY transform), CPU default.
- ``triton`` (module ``kernels.kda.triton``): chunkwise Triton forward and backward, CUDA default.
- ``fla``: ``fla.ops.kda.chunk_kda`` from the optional ``fla-core`` package, for comparison.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .chunk_torch import kda_chunk_torch
from .recurrent import kda_recurrent

BACKENDS = ("auto", "torch", "triton", "fla")
DECAYS = ("sigmoid", "softplus")

__all__ = ["BACKENDS", "DECAYS", "gated_inputs", "kda", "kda_chunk_torch", "kda_gated", "kda_recurrent", "log_decay",
           "triton_available"]


# The Triton entries are imported once, here, not on each call: a forward that imported them per call would
# make torch.compile break its graph at every KDA layer on CUDA (dynamo does not trace importlib).
try:
    from .triton import kda_gated as _kda_gated_triton, kda_triton as _kda_triton
    _TRITON_ERROR: ImportError | None = None
except ImportError as e:
    _kda_gated_triton = _kda_triton = None
    _TRITON_ERROR = e


def triton_available() -> bool:
    """True when the Triton KDA kernels could be imported (triton installed, kernels present)."""
    return _TRITON_ERROR is None


def _kda_fla(q, k, v, g, beta, scale, initial_state, output_final_state, safe_gate):
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as e:
        raise ImportError(
            "kda backend 'fla' needs the optional package fla-core (pip install 'fla-core==0.6.0'): "
            f"{e}"
        ) from e
    return chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, safe_gate=safe_gate,
    )


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    safe_gate: bool = False,
    recompute_states: bool = False,
    recompute_chunks: bool = False,
    keep_intra: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA.

    q, k: [B, T, H, K] (already L2-normalised), v: [B, T, H, V], g: [B, T, H, K] log-decay (<= 0),
    beta: [B, T, H] in (0, 1), initial_state: [B, H, K, V] or None; scale defaults to K**-0.5.
    Returns o [B, T, H, V] (dtype of v) and the final state [B, H, K, V] in float32 (None unless
    ``output_final_state``). backend: "auto" (Triton on CUDA tensors when available, else torch),
    "torch", "triton" or "fla". ``safe_gate=True`` promises g >= -5 (the sigmoid map with g_min = -5):
    the triton and fla kernels then run their diagonal sub-blocks as tensor-core matmuls.
    ``recompute_states=True`` makes the triton backward recompute the chunk states instead of keeping
    them from the forward (less activation memory, one more sequential pass); ``recompute_chunks=True``
    keeps only the inputs and Tinv (as fla keeps its inverse), and the backward reruns the other
    chunk-local forward kernels too; ``keep_intra=True`` (with it) keeps the intra-chunk products At and P
    as well, so that rerun skips the intra-chunk kernel. The torch and fla backends keep their own saving
    policy and ignore all three.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kda backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if backend == "auto":
        backend = "triton" if q.is_cuda and triton_available() else "torch"
    if backend == "torch":
        return kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state)
    if backend == "fla":
        return _kda_fla(q, k, v, g, beta, scale, initial_state, output_final_state, safe_gate)
    if not triton_available():
        raise ImportError(f"kda backend 'triton' is unavailable: {_TRITON_ERROR}") from _TRITON_ERROR
    return _kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, safe_gate=safe_gate,
                       recompute_states=recompute_states, recompute_chunks=recompute_chunks, keep_intra=keep_intra)


def log_decay(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, decay: str = "sigmoid",
              g_min: float = -5.0) -> torch.Tensor:
    """Per-channel log-decay g [B, T, H, K] (<= 0) from the gate input z [B, T, H, K], A_log [H] and
    dt_bias [H * K], in float32 (float64 for float64 z):
        sigmoid  (Kimi K3 eq. 5):  g = g_min * sigmoid(exp(A_h) * (z + dt_bias))
        softplus (Kimi Linear):    g = -exp(A_h) * softplus(z + dt_bias)
    """
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {', '.join(DECAYS)}, got {decay!r}")
    H, K = z.shape[-2:]
    acc = torch.promote_types(z.dtype, torch.float32)
    z = z.to(acc) + dt_bias.to(acc).view(H, K)
    a = A_log.to(acc).exp()[:, None]  # [H, 1]
    if decay == "sigmoid":
        return g_min * torch.sigmoid(a * z)
    return -a * F.softplus(z)


def gated_inputs(q, k, z, beta_logits, A_log, dt_bias, decay="sigmoid", g_min=-5.0, use_qk_l2norm=True):
    """The inputs of :func:`kda` from those of :func:`kda_gated`, as torch ops: q, k L2-normalised over the
    last dim (when ``use_qk_l2norm``), g = ``log_decay(z, ...)``, beta = sigmoid(beta_logits) in float32
    (float64 for float64 logits). Returns (q, k, g, beta)."""
    if use_qk_l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = log_decay(z, A_log, dt_bias, decay, g_min)
    beta = torch.sigmoid(beta_logits.to(torch.promote_types(beta_logits.dtype, torch.float32)))
    return q, k, g, beta


def kda_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    decay: str = "sigmoid",
    g_min: float = -5.0,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    backend: str = "auto",
    recompute_states: bool = False,
    recompute_chunks: bool = False,
    keep_intra: bool = False,
    core: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA from the layer's raw tensors: q, k [B, T, H, K] (L2-normalised here when ``use_qk_l2norm``),
    v [B, T, H, V], the gate input z [B, T, H, K], beta_logits [B, T, H] (beta = sigmoid of them),
    A_log [H], dt_bias [H * K], the decay map ("sigmoid" or "softplus", ``log_decay``); initial_state
    [B, H, K, V] or None. Returns o [B, T, H, V] (dtype of v) and the float32 final state (None unless
    ``output_final_state``).

    backend "triton" (or "auto" on CUDA tensors with Triton available) runs
    ``kernels.kda.triton.kda_gated``: the gate map, the norms and the sigmoid inside its kernels (the
    entry the kernel benchmark times). "torch" and "fla" (and "auto" elsewhere) compute the same in
    PyTorch (``gated_inputs``) and call ``core`` (default :func:`kda`) as
    ``core(q, k, v, g, beta, scale=, initial_state=, output_final_state=, backend=, safe_gate=,
    recompute_states=, recompute_chunks=, keep_intra=)``; a caller that wraps or inspects that call passes its own.
    safe_gate is set for the sigmoid map with g_min >= -5, whose g is bounded below by -5.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kda backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if q.is_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ImportError(f"kda backend 'triton' is unavailable: {_TRITON_ERROR}") from _TRITON_ERROR
        return _kda_gated_triton(q, k, v, z, beta_logits, A_log, dt_bias, decay=decay, g_min=g_min, scale=scale,
                                 initial_state=initial_state, output_final_state=output_final_state,
                                 use_qk_l2norm=use_qk_l2norm, recompute_states=recompute_states,
                                 recompute_chunks=recompute_chunks, keep_intra=keep_intra)
    q, k, g, beta = gated_inputs(q, k, z, beta_logits, A_log, dt_bias, decay, g_min, use_qk_l2norm)
    safe = decay == "sigmoid" and g_min >= -5
    return (core or kda)(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, backend=backend, safe_gate=safe,
                         recompute_states=recompute_states, recompute_chunks=recompute_chunks,
                         keep_intra=keep_intra)
