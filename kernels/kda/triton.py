"""Triton chunkwise KDA (Kimi Linear arXiv:2510.26692) as an autograd Function.

Entry points:
- ``kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, safe_gate=False)``: same
  contract as ``kernels.kda.kda`` (g is the per-channel log-decay, <= 0). ``safe_gate=True`` promises
  g >= -5 (the K3 sigmoid map with g_min = -5) and unlocks tensor-core matmuls on the 16x16 diagonal
  sub-blocks; with ``safe_gate=False`` any g <= 0 is handled without overflow.
- ``kda_gated(q, k, v, z, beta_logits, A_log, dt_bias=None, decay="sigmoid", g_min=-5.0, ...)``: the
  fused-gate entry. It computes, on the way in, the decay map (sigmoid: g = g_min sigmoid(exp(A_h) z);
  softplus: g = -exp(A_h) softplus(z + dt_bias)) inside the first kernel (its backward is elementwise
  torch), and, in float32 torch ops before the kernels, the L2 norm of q and k (``use_qk_l2norm=True``)
  and beta = sigmoid(beta_logits). ``kda_gated_reference`` is the same
  computation in plain PyTorch (any backend), used by the tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton_bwd import kda_bwd
from .triton_fwd import dot_precision, kda_fwd

GATES = {"none": 0, "sigmoid": 1, "softplus": 2}


class KDATritonFunction(torch.autograd.Function):
    """o, S_T = KDA(q, k, v, g, beta; S_0). With gate = "sigmoid"/"softplus", ``g`` holds the raw gate
    input z and the function also differentiates A_log (and dt_bias for softplus)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                safe_gate, gate, g_min):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        # matmul precision follows v: exact fp32 for fp32 values, tf32 tensor cores for bf16/fp16
        ctx.prec = dot_precision(v.dtype)
        o, ht, saved = kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, safe_gate,
                               gate=GATES[gate], A_log=A_log, dt_bias=dt_bias, g_min=g_min, prec=ctx.prec)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, *saved.values())
        ctx.saved_names = list(saved)
        ctx.scale, ctx.safe_gate, ctx.gate, ctx.g_min = scale, safe_gate, gate, g_min
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, *rest = ctx.saved_tensors
        saved = dict(zip(ctx.saved_names, rest))
        dq, dk, dv, dg, dbeta, dh0 = kda_bwd(q, k, v, beta, ctx.scale, h0, saved, do, dht, ctx.safe_gate, ctx.prec)
        dA_log = ddt = None
        if ctx.gate != "none":
            # chain rule through the decay map (elementwise; g held the raw input z)
            z = g.float()
            a = A_log.float().exp().view(1, 1, -1, 1)
            if ctx.gate == "sigmoid":
                s = torch.sigmoid(a * z)
                dpre = dg * ctx.g_min * s * (1 - s)          # d g / d(a z)
                dz = dpre * a
                dA_log = (dpre * a * z).sum((0, 1, 3))
            else:
                K = z.shape[-1]
                zb = z + dt_bias.float().view(1, 1, -1, K)
                sp = F.softplus(zb)
                dz = -dg * a * torch.sigmoid(zb)
                dA_log = (-dg * a * sp).sum((0, 1, 3))
                ddt = dz.sum((0, 1)).reshape(dt_bias.shape).to(dt_bias.dtype)
            dg = dz
            dA_log = dA_log.to(A_log.dtype)
        return (dq, dk, dv, dg.to(g.dtype), dbeta, dA_log, ddt, dh0, None, None, None, None, None)


def kda_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, safe_gate=False):
    """Chunkwise KDA on CUDA (or under TRITON_INTERPRET=1 on CPU). Shapes as ``kernels.kda.kda``:
    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] float32.
    Returns o [B, T, H, V] (dtype of v) and the float32 final state (or None)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if initial_state is not None:
        initial_state = initial_state.float()
    return KDATritonFunction.apply(q, k, v, g, beta, None, None, initial_state, float(scale),
                                   bool(output_final_state), bool(safe_gate), "none", 0.0)


def kda_gated(q, k, v, z, beta_logits, A_log, dt_bias=None, decay="sigmoid", g_min=-5.0, scale=None,
              initial_state=None, output_final_state=False, use_qk_l2norm=True):
    """KDA with the gate fused: q, k [B, T, H, K] raw (L2-normalised here when ``use_qk_l2norm``),
    v [B, T, H, V], z [B, T, H, K] the gate pre-activation, beta_logits [B, T, H], A_log [H],
    dt_bias [H * K] (softplus only). decay="sigmoid" runs the bounded (tensor-core) path."""
    if decay not in ("sigmoid", "softplus"):
        raise ValueError(f"decay must be 'sigmoid' or 'softplus', got {decay!r}")
    if decay == "softplus" and dt_bias is None:
        raise ValueError("decay='softplus' needs dt_bias [H * K]")
    # norms and sigmoid in float32 (the kernels read fp32 q, k, beta; v keeps its dtype)
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = torch.sigmoid(beta_logits.float())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if initial_state is not None:
        initial_state = initial_state.float()
    safe = decay == "sigmoid" and g_min >= -5.0
    return KDATritonFunction.apply(q, k, v, z, beta, A_log, dt_bias if decay == "softplus" else None,
                                   initial_state, float(scale), bool(output_final_state), safe, decay,
                                   float(g_min))


def kda_gated_reference(q, k, v, z, beta_logits, A_log, dt_bias=None, decay="sigmoid", g_min=-5.0,
                        scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=True,
                        backend="torch"):
    """Plain-PyTorch twin of :func:`kda_gated` (the gate map, norms and sigmoid as torch ops), then
    ``kernels.kda.kda`` with the given backend."""
    from . import kda

    H, K = z.shape[-2], z.shape[-1]
    a = A_log.exp().view(1, 1, H, 1)
    if decay == "sigmoid":
        g = g_min * torch.sigmoid(a * z)
    else:
        g = -a * F.softplus(z + dt_bias.view(1, 1, H, K))
    if use_qk_l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return kda(q, k, v, g, torch.sigmoid(beta_logits), scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, backend=backend)
