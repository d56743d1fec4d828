"""Triton chunkwise KDA (Kimi Linear arXiv:2510.26692) as an autograd Function.

Entry points:
- ``kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, safe_gate=False)``: same
  contract as ``kernels.kda.kda`` (g is the per-channel log-decay, <= 0). ``safe_gate=True`` promises
  g >= -5 (the K3 sigmoid map with g_min = -5) and unlocks tensor-core matmuls on the 16x16 diagonal
  sub-blocks; with ``safe_gate=False`` any g <= 0 is handled without overflow.
- ``kda_gated(q, k, v, z, beta_logits, A_log, dt_bias, decay="sigmoid", g_min=-5.0, ...)``: the
  fused-gate entry. It computes, on the way in, the decay map (sigmoid: g = g_min sigmoid(exp(A_h) (z + dt_bias));
  softplus: g = -exp(A_h) softplus(z + dt_bias)) inside the first kernel and its backward inside the
  last one, and the L2 norm of q and k (``use_qk_l2norm=True``) with beta = sigmoid(beta_logits) in one
  small prep kernel (float32 out; its backward in one kernel too). ``kda_gated_reference`` is the same
  computation in plain PyTorch (any backend), used by the tests.

Supported: any B, H and T >= 1 (ragged last chunk); K <= 128 (tested 16, 32, 64, 128; other values
are masked to the next power of two); any V (tested 16 to 128, tiled by 64). fp32 inputs run exact
fp32 matmuls on fp32 intermediates. bf16/fp16 inputs keep the normalised q/k, Qg, W, U, Kd, delta and the
chunk states in their own dtype (``triton_fwd.storage_dtype``; G, At, P and Tinv stay fp32), run the
two sequential state passes on half-precision operands and the other matmuls in tf32, always with
fp32 accumulation; the running state is fp32. The backward reads the chunk states kept by the forward.
"""
from __future__ import annotations

import torch

from .triton_bwd import kda_bwd, prep_bwd
from .triton_fwd import dot_precision, kda_fwd, prep_fwd

GATES = {"none": 0, "sigmoid": 1, "softplus": 2}


class KDATritonFunction(torch.autograd.Function):
    """o, S_T = KDA(q, k, v, g, beta; S_0). With gate = "sigmoid"/"softplus", ``g`` holds the raw gate
    input z (the map runs in the first kernel, its backward in the last) and A_log and dt_bias get
    gradients. With ``fuse_prep``, q and k are raw (L2-normalised in a Triton kernel) and
    ``beta`` holds the logits (sigmoid in the same kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                safe_gate, gate, g_min, fuse_prep, recompute_states):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        ctx.dtypes = (q.dtype, k.dtype, beta.dtype)
        rq = rk = None
        if fuse_prep:
            q, k, beta, rq, rk = prep_fwd(q, k, beta)
        # matmul precision follows v: exact fp32 for fp32 values, tf32 tensor cores for bf16/fp16
        ctx.prec = dot_precision(v.dtype)
        o, ht, saved = kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, safe_gate,
                               gate=GATES[gate], A_log=A_log, dt_bias=dt_bias, g_min=g_min, prec=ctx.prec,
                               recompute_states=recompute_states)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, rq, rk, *saved.values())
        ctx.saved_names = list(saved)
        ctx.scale, ctx.safe_gate, ctx.gate, ctx.g_min, ctx.fuse_prep = scale, safe_gate, gate, g_min, fuse_prep
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, rq, rk, *rest = ctx.saved_tensors
        saved = dict(zip(ctx.saved_names, rest))
        dq, dk, dv, dg, dbeta, dh0, dA_log, ddt = kda_bwd(
            q, k, v, beta, ctx.scale, h0, saved, do, dht, ctx.safe_gate, ctx.prec,
            gate=GATES[ctx.gate], z=g, A_log=A_log, dt_bias=dt_bias, g_min=ctx.g_min,
            dqk_dtype=torch.float32 if ctx.fuse_prep else None)
        if ctx.fuse_prep:
            dq, dk, dbeta = prep_bwd(q, k, beta, rq, rk, dq, dk, dbeta, *ctx.dtypes)
        if dA_log is not None:
            dA_log = dA_log.to(A_log.dtype)
        if ddt is not None:
            ddt = ddt.reshape(dt_bias.shape).to(dt_bias.dtype)
        return (dq, dk, dv, dg.to(g.dtype), dbeta, dA_log, ddt, dh0, None, None, None, None, None, None, None)


def kda_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, safe_gate=False,
               recompute_states=False):
    """Chunkwise KDA on CUDA (or under TRITON_INTERPRET=1 on CPU). Shapes as ``kernels.kda.kda``:
    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] float32.
    Returns o [B, T, H, V] (dtype of v) and the float32 final state (or None). recompute_states: the
    backward recomputes the chunk states instead of keeping them (less memory, one more sequential pass;
    ``triton_fwd.kda_fwd``)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if initial_state is not None:
        initial_state = initial_state.float()
    return KDATritonFunction.apply(q, k, v, g, beta, None, None, initial_state, float(scale),
                                   bool(output_final_state), bool(safe_gate), "none", 0.0, False,
                                   bool(recompute_states))


def kda_gated(q, k, v, z, beta_logits, A_log, dt_bias, decay="sigmoid", g_min=-5.0, scale=None,
              initial_state=None, output_final_state=False, use_qk_l2norm=True, recompute_states=False):
    """KDA with the gate fused: q, k [B, T, H, K] raw (L2-normalised here when ``use_qk_l2norm``),
    v [B, T, H, V], z [B, T, H, K] the gate pre-activation, beta_logits [B, T, H], A_log [H],
    dt_bias [H * K]. Log-decay (K3 eq. 5 / Kimi Linear): sigmoid g = g_min sigmoid(exp(A_h) (z + dt_bias)),
    softplus g = -exp(A_h) softplus(z + dt_bias). decay="sigmoid" with g_min >= -5 runs the bounded
    (tensor-core) path."""
    if decay not in ("sigmoid", "softplus"):
        raise ValueError(f"decay must be 'sigmoid' or 'softplus', got {decay!r}")
    if dt_bias is None:
        raise ValueError("kda_gated needs dt_bias [H * K] (zeros for a gate without bias)")
    beta = beta_logits
    if not use_qk_l2norm:  # otherwise the prep kernel normalises q, k and applies the sigmoid (fp32)
        beta = torch.sigmoid(beta_logits.float())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if initial_state is not None:
        initial_state = initial_state.float()
    safe = decay == "sigmoid" and g_min >= -5.0
    return KDATritonFunction.apply(q, k, v, z, beta, A_log, dt_bias,
                                   initial_state, float(scale), bool(output_final_state), safe, decay,
                                   float(g_min), bool(use_qk_l2norm), bool(recompute_states))


def kda_gated_reference(q, k, v, z, beta_logits, A_log, dt_bias, decay="sigmoid", g_min=-5.0, scale=None,
                        initial_state=None, output_final_state=False, use_qk_l2norm=True, backend="torch"):
    """Plain-PyTorch twin of :func:`kda_gated`: the gate map, norms and sigmoid as torch ops
    (``kernels.kda.gated_inputs``), then ``kernels.kda.kda`` with the given backend."""
    from . import gated_inputs, kda

    q, k, g, beta = gated_inputs(q, k, z, beta_logits, A_log, dt_bias, decay, g_min, use_qk_l2norm)
    return kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
               backend=backend)
