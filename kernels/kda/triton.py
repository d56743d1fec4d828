"""Triton chunkwise KDA (Kimi Linear arXiv:2510.26692) as torch.library custom ops with autograd.

Entry points:
- ``kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, safe_gate=False)``: same
  contract as ``kernels.kda.kda`` (g is the per-channel log-decay, <= 0). ``safe_gate=True`` promises
  g >= -5 (the K3 sigmoid map with g_min = -5): each 16-row sub-block is then one tensor-core product
  with its diagonal block; with ``safe_gate=False`` any g <= 0 is handled without overflow, the diagonal
  blocks by two masked products each (``triton_fwd`` module docstring: within e^-16 = 1.1e-7 of the
  exact pairwise decays).
- ``kda_gated(q, k, v, z, beta_logits, A_log, dt_bias, decay="sigmoid", g_min=-5.0, ...)``: the
  fused-gate entry. It computes, on the way in, the decay map (sigmoid: g = g_min sigmoid(exp(A_h) (z + dt_bias));
  softplus: g = -exp(A_h) softplus(z + dt_bias)) inside the first kernel and its backward inside the
  last one, and the L2 norm of q and k (``use_qk_l2norm=True``) with beta = sigmoid(beta_logits) in one
  small prep kernel (its backward inside two of the backward's kernels, ``triton_bwd``).
  ``kda_gated_reference`` is the same computation in plain PyTorch (any backend), used by the tests.

Supported: any B, H and T >= 1 (ragged last chunk); K <= 128 (tested 16, 32, 64, 128; other values
are masked to the next power of two); any V (tested 16 to 128, tiled by 64). fp32 inputs run exact
fp32 matmuls on fp32 intermediates. bf16/fp16 inputs keep the normalised q/k, Qg, W, U, Kd, delta and the
chunk states in their own dtype (``triton_fwd.storage_dtype``; G, At, P and Tinv stay fp32, and only
the copies of At and P that ``keep_intra`` keeps for the backward take the storage dtype), run the
two sequential state passes on half-precision operands and the other matmuls in tf32, always with
fp32 accumulation; the running state is fp32. The backward reads the chunk states kept by the forward.

Both entries run through two ``torch.library`` custom ops, ``k3lab::kda_fwd`` and ``k3lab::kda_bwd``, the
second registered as the first's autograd formula, so that ``torch.compile`` keeps each call as one node
of its graph (no graph break) in the forward and in the backward. They are ``custom_op``s rather than
``triton_op``s: a ``triton_op`` lets Inductor trace into the launches, which buys nothing here (Inductor
cannot fuse into these kernels, and a call launches a dozen of them on tensors of up to [B, H, NT, K, V]),
while it would require every launch, its grid and its constexprs to be traceable by ``wrap_triton``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton_bwd import kda_bwd
from .triton_fwd import (BT, check_head_dim, chunk_intermediates, dot_precision, gate_cumsum, kda_fwd, prep_fwd,
                         storage_dtype)

GATES = {"none": 0, "sigmoid": 1, "softplus": 2}


def saved_names(fuse_prep: bool, recompute_states: bool, recompute_chunks: bool = False,
                keep_intra: bool = False) -> list[str]:
    """Names of the tensors ``k3lab::kda_fwd`` returns for the backward, in order: the forward's
    intermediates (``triton_fwd.kda_fwd``; with ``recompute_chunks`` only Tinv, and with ``keep_intra`` At
    and P too, in the storage dtype, and the backward reruns the rest of ``triton_fwd.chunk_intermediates``),
    then with ``fuse_prep`` the normalised q, k (qn, kn), beta = sigmoid(logits) and the inverse norms rq, rk
    (``triton_fwd.prep_fwd``)."""
    names = ["G", "At", "P", "Tinv", "W", "Kd", "Qg"] + (["U"] if recompute_states else ["Hs", "Dl"])
    if recompute_chunks:
        names = ["Tinv", "At_kept", "P_kept"] if keep_intra else ["Tinv"]
    return names + (["qn", "kn", "beta", "rq", "rk"] if fuse_prep else [])


def _forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None,
             dt_bias: Tensor | None, initial_state: Tensor | None, scale: float, safe_gate: bool, gate: int,
             g_min: float, fuse_prep: bool, recompute_states: bool, recompute_chunks: bool,
             keep_intra: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    """o [B, T, H, V] (dtype of v), the final state [B, H, K, V] float32 (always: one store per (b, h) at
    the end of the state pass; the entries drop it unless asked) and the tensors kept for the backward
    (``saved_names``). gate: a value of GATES; with a gate ``g`` holds the raw input z. With ``fuse_prep``
    q and k are raw (L2-normalised in a kernel) and ``beta`` holds the logits. Matmul precision follows v:
    exact fp32 for fp32 values, tf32 tensor cores for bf16/fp16 (``dot_precision``). recompute_chunks: keep
    only the inputs and Tinv, as fla keeps its inverse (implies recompute_states); keep_intra: with it, keep
    At and P too, so that the backward's rerun skips the intra-chunk kernel."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    prep = []
    if fuse_prep:
        q, k, beta, rq, rk = prep_fwd(q, k, beta)
        prep = [q, k, beta, rq, rk]
    o, ht, saved = kda_fwd(q, k, v, g, beta, scale, initial_state, True, safe_gate, gate=gate, A_log=A_log,
                           dt_bias=dt_bias, g_min=g_min, prec=dot_precision(v.dtype),
                           recompute_states=recompute_states or recompute_chunks,
                           keep_intra=keep_intra and recompute_chunks)
    return o, ht, [saved[n] for n in saved_names(False, recompute_states, recompute_chunks, keep_intra)] + prep


def _forward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, safe_gate, gate, g_min, fuse_prep,
                  recompute_states, recompute_chunks, keep_intra):
    """Shapes, dtypes and (contiguous) strides of ``_forward``'s results, without launching anything."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    check_head_dim(K)
    NT = (T + BT - 1) // BT
    Tp = NT * BT
    f32, sd, sq = torch.float32, storage_dtype(v.dtype), storage_dtype(q.dtype)
    like = dict(G=((B, H, Tp, K), f32), At=((B, H, Tp, BT), f32), P=((B, H, Tp, BT), f32),
                At_kept=((B, H, Tp, BT), sd), P_kept=((B, H, Tp, BT), sd), Tinv=((B, H, Tp, BT), f32),
                W=((B, H, Tp, K), sd), Kd=((B, H, Tp, K), sd),
                Qg=((B, H, Tp, K), sd), U=((B, T, H, V), sd), Hs=((B, H, NT, K, V), sd), Dl=((B, T, H, V), sd),
                qn=((B, T, H, K), sq), kn=((B, T, H, K), sq), beta=((B, T, H), f32), rq=((B, T, H), f32),
                rk=((B, T, H), f32))
    saved = [q.new_empty(like[n][0], dtype=like[n][1])
             for n in saved_names(fuse_prep, recompute_states, recompute_chunks, keep_intra)]
    return v.new_empty(v.shape), v.new_empty((B, H, K, V), dtype=f32), saved


def _backward(q: Tensor | None, k: Tensor | None, v: Tensor, g: Tensor, beta: Tensor | None, A_log: Tensor | None,
              dt_bias: Tensor | None, initial_state: Tensor | None, saved: list[Tensor], do: Tensor,
              dht: Tensor | None, scale: float, safe_gate: bool, gate: int, g_min: float, fuse_prep: bool,
              recompute_states: bool, recompute_chunks: bool, keep_intra: bool, q_dtype: torch.dtype,
              k_dtype: torch.dtype, beta_dtype: torch.dtype) -> list[Tensor]:
    """Gradients of ``_forward``'s inputs from those of o [B, T, H, V] and of the final state (dht, or None):
    [dq, dk, dv, dg, dbeta], then dA_log [H] and ddt_bias [H * K] when A_log and dt_bias are given, then
    the initial state's gradient [B, H, K, V] when there is one; each in its input's dtype (q_dtype,
    k_dtype, beta_dtype name those of q, k and beta). saved: ``_forward``'s third result. q, k and beta
    are the forward's raw inputs, or None with ``fuse_prep`` (the normalised ones are in ``saved``)."""
    kept = dict(zip(saved_names(fuse_prep, recompute_states, recompute_chunks, keep_intra), saved))
    if fuse_prep:
        q, k, beta = kept.pop("qn"), kept.pop("kn"), kept.pop("beta")
        rq, rk = kept.pop("rq"), kept.pop("rk")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if recompute_chunks:  # the forward kept its inputs and Tinv (and At, P): rerun its chunk kernels on them
        kept = chunk_intermediates(q, k, v, g, beta, scale, safe_gate, gate, A_log, dt_bias, g_min,
                                   dot_precision(v.dtype), Tinv=kept["Tinv"], At=kept.get("At_kept"),
                                   P=kept.get("P_kept"))
    elif not safe_gate:  # Gh, the unbounded gate's diagonal-block decay, is cheaper to rerun than to keep
        kept["Gh"] = gate_cumsum(g, safe_gate, gate, A_log, dt_bias, g_min, store_G=False)[1]
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt = kda_bwd(
        q, k, v, beta, scale, initial_state, kept, do, dht, safe_gate, dot_precision(v.dtype), gate=gate, z=g,
        A_log=A_log, dt_bias=dt_bias, g_min=g_min, prep_norms=(rq, rk) if fuse_prep else None)
    grads = [dq.to(q_dtype), dk.to(k_dtype), dv, dg.to(g.dtype), dbeta.to(beta_dtype)]
    if A_log is not None:
        grads.append(dA_log.to(A_log.dtype))
    if dt_bias is not None:
        grads.append(ddt.reshape(dt_bias.shape).to(dt_bias.dtype))
    if initial_state is not None:
        grads.append(dh0)
    return grads


def _backward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, saved, do, dht, scale, safe_gate, gate, g_min,
                   fuse_prep, recompute_states, recompute_chunks, keep_intra, q_dtype, k_dtype, beta_dtype):
    """Shapes and dtypes of ``_backward``'s results (q and k have g's shape, beta v's first three dims)."""
    grads = [g.new_empty(g.shape, dtype=q_dtype), g.new_empty(g.shape, dtype=k_dtype), v.new_empty(v.shape),
             g.new_empty(g.shape), v.new_empty(v.shape[:3], dtype=beta_dtype)]
    grads += [x.new_empty(x.shape) for x in (A_log, dt_bias, initial_state) if x is not None]
    return grads


kda_fwd_op = torch.library.custom_op(
    "k3lab::kda_fwd", _forward, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
           "Tensor? initial_state, float scale, bool safe_gate, int gate, float g_min, bool fuse_prep, "
           "bool recompute_states, bool recompute_chunks, bool keep_intra) -> (Tensor, Tensor, Tensor[])")
kda_fwd_op.register_fake(_forward_fake)
kda_bwd_op = torch.library.custom_op(
    "k3lab::kda_bwd", _backward, mutates_args=(),
    schema="(Tensor? q, Tensor? k, Tensor v, Tensor g, Tensor? beta, Tensor? A_log, Tensor? dt_bias, "
           "Tensor? initial_state, Tensor[] saved, Tensor do, Tensor? dht, float scale, bool safe_gate, int gate, "
           "float g_min, bool fuse_prep, bool recompute_states, bool recompute_chunks, bool keep_intra, "
           "ScalarType q_dtype, ScalarType k_dtype, ScalarType beta_dtype) -> Tensor[]")
kda_bwd_op.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, h0, scale, safe_gate, gate, g_min, fuse_prep, states, chunks, intra = inputs
    saved = output[2]
    # the kept intermediates get no gradient; nor are zero gradients built for them, or for an unused output
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.options = (scale, safe_gate, gate, g_min, fuse_prep, states, chunks, intra, q.dtype, k.dtype, beta.dtype)
    raw = (None, None, None) if fuse_prep else (q, k, beta)   # with fuse_prep the kernels' q, k, beta are in saved
    ctx.save_for_backward(*raw, v, g, A_log, dt_bias, h0, *saved)


def _autograd_backward(ctx, do, dht, _dsaved):
    q, k, beta, v, g, A_log, dt_bias, h0, *saved = ctx.saved_tensors
    if do is None:  # only the final state was used
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, *rest = kda_bwd_op(q, k, v, g, beta, A_log, dt_bias, h0, saved, do, dht, *ctx.options)
    dA_log = rest.pop(0) if A_log is not None else None
    ddt = rest.pop(0) if dt_bias is not None else None
    dh0 = rest.pop(0) if h0 is not None else None
    return dq, dk, dv, dg, dbeta, dA_log, ddt, dh0, None, None, None, None, None, None, None, None


kda_fwd_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check_keep_intra(recompute_chunks: bool, keep_intra: bool) -> None:
    if keep_intra and not recompute_chunks:
        raise ValueError("keep_intra=True needs recompute_chunks=True (without it the forward keeps At and P "
                         "anyway)")


def kda_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, safe_gate=False,
               recompute_states=False, recompute_chunks=False, keep_intra=False):
    """Chunkwise KDA on CUDA (or under TRITON_INTERPRET=1 on CPU). Shapes as ``kernels.kda.kda``:
    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] float32.
    Returns o [B, T, H, V] (dtype of v) and the float32 final state (or None). recompute_states: the
    backward recomputes the chunk states instead of keeping them (less memory, one more sequential pass;
    ``triton_fwd.kda_fwd``). recompute_chunks: the forward keeps only its inputs and Tinv, and the backward
    reruns the other chunk-local kernels too (``triton_fwd.chunk_intermediates``; implies recompute_states).
    keep_intra (with recompute_chunks): keep the intra-chunk products At and P as well (2 x [B, H, T, 64]
    in the storage dtype: fp32 for fp32 values, else half precision, which only the backward reads), so
    that the rerun skips the intra-chunk kernel."""
    _check_keep_intra(recompute_chunks, keep_intra)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if initial_state is not None:
        initial_state = initial_state.float()
    o, ht, _ = kda_fwd_op(q, k, v, g, beta, None, None, initial_state, float(scale), bool(safe_gate), GATES["none"],
                          0.0, False, bool(recompute_states), bool(recompute_chunks), bool(keep_intra))
    return o, (ht if output_final_state else None)


def kda_gated(q, k, v, z, beta_logits, A_log, dt_bias, decay="sigmoid", g_min=-5.0, scale=None,
              initial_state=None, output_final_state=False, use_qk_l2norm=True, recompute_states=False,
              recompute_chunks=False, keep_intra=False):
    """KDA with the gate fused: q, k [B, T, H, K] raw (L2-normalised here when ``use_qk_l2norm``),
    v [B, T, H, V], z [B, T, H, K] the gate pre-activation, beta_logits [B, T, H], A_log [H],
    dt_bias [H * K]. Log-decay (K3 eq. 5 / Kimi Linear): sigmoid g = g_min sigmoid(exp(A_h) (z + dt_bias)),
    softplus g = -exp(A_h) softplus(z + dt_bias). decay="sigmoid" with g_min >= -5 runs the bounded
    (tensor-core) path. Returns o [B, T, H, V] (dtype of v) and the float32 final state (or None).
    recompute_states, recompute_chunks, keep_intra: what the backward recomputes instead of reading
    (``kda_triton``)."""
    if decay not in ("sigmoid", "softplus"):
        raise ValueError(f"decay must be 'sigmoid' or 'softplus', got {decay!r}")
    if dt_bias is None:
        raise ValueError("kda_gated needs dt_bias [H * K] (zeros for a gate without bias)")
    _check_keep_intra(recompute_chunks, keep_intra)
    beta = beta_logits
    if not use_qk_l2norm:  # otherwise the prep kernel normalises q, k and applies the sigmoid (fp32)
        beta = torch.sigmoid(beta_logits.float())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if initial_state is not None:
        initial_state = initial_state.float()
    safe = decay == "sigmoid" and g_min >= -5.0
    o, ht, _ = kda_fwd_op(q, k, v, z, beta, A_log, dt_bias, initial_state, float(scale), safe, GATES[decay],
                          float(g_min), bool(use_qk_l2norm), bool(recompute_states), bool(recompute_chunks),
                          bool(keep_intra))
    return o, (ht if output_final_state else None)


def kda_gated_reference(q, k, v, z, beta_logits, A_log, dt_bias, decay="sigmoid", g_min=-5.0, scale=None,
                        initial_state=None, output_final_state=False, use_qk_l2norm=True, backend="torch"):
    """Plain-PyTorch twin of :func:`kda_gated`: the gate map, norms and sigmoid as torch ops
    (``kernels.kda.gated_inputs``), then ``kernels.kda.kda`` with the given backend."""
    from . import gated_inputs, kda

    q, k, g, beta = gated_inputs(q, k, z, beta_logits, A_log, dt_bias, decay, g_min, use_qk_l2norm)
    return kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
               backend=backend)
