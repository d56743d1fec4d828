"""Attention Residuals (AttnRes, arXiv:2603.15031 §3; Kimi K3 arXiv:2607.24653 §2.2).

The PreNorm residual feeds sublayer l the plain sum of everything before it. AttnRes feeds it a
softmax over depth instead (paper eq. 2-3):

    h_l = sum_i alpha_{i->l} v_i,    alpha_{i->l} = softmax_i( w_l^T RMSNorm_l(v_i) )

with v_0 = the token embedding, one zero-initialised pseudo-query w_l [D] and one learnable RMSNorm per
AttnRes op; the values v_i stay unnormalised and each sublayer keeps its own PreNorm. There is one op
before every sublayer (attention/mixer and FFN count one each) plus a final aggregation before the
output norm, so 2L + 1 ops for L layers. Zero queries make every mix uniform at initialisation.

Block AttnRes (paper §3.2) groups `block_size` consecutive sublayers into a block and sums their
outputs inside it, b_n = sum_{j in block n} f_j(h_j). Sublayer l attends over

    [ v_0 = embedding,  b_1, ..., b_{n-1} (completed blocks),  b_n^partial (if non-empty) ]

where b_n^partial is the sum of the outputs already produced in l's own block. `full_attnres` is the
same code with block_size = 1: every output is its own completed block, the partial sum is always empty.

Efficiency. w^T RMSNorm(v) = (w * g)^T v / rms(v), with g the norm's weight, so the only per-source
work that does not depend on the op is 1/rms(v) [B, T, 1]: it is computed once when a source is
finished and reused by every later op (the tensor normalised RMSNorm(v) is never built). Sources stay
a Python list, and the op is one autograd.Function with a written-out backward that keeps only
references to the sources (alive anyway), alpha and the raw scores [S, B, T], never a stacked
[S, B, T, D] copy per op. The softmax over depth runs in fp32; the mix accumulates in fp32 and returns
the sources' promoted dtype. On CUDA the same op runs as fused Triton kernels (kernels/attnres.py: one
read of each source forward, one backward). Measurements: docs/attnres.md, `python -m benchmarks.attnres_bench`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from k3lab.config import ResidualConfig
from k3lab.model.norm import RMSNorm
from k3lab.model.residual import DepthRecorder, sublayer_label


class _InvRMS(torch.autograd.Function):
    """r = 1 / sqrt(mean(v^2) + eps) over the last dim, with the one-pass backward
    g_v = v * (-g_r r^3 / D), written straight in v's dtype (autograd's backward of the same ops makes
    three full-size passes through fp32 temporaries: 4.5 of the 27 ms of the H200 residual benchmark)."""

    @staticmethod
    def forward(ctx, v, eps):
        acc = torch.promote_types(v.dtype, torch.float32)
        sq = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=acc).square()  # reads v in its dtype
        r = torch.rsqrt(sq / v.shape[-1] + eps)
        ctx.save_for_backward(v, r)
        return r

    @staticmethod
    def backward(ctx, g_r):
        v, r = ctx.saved_tensors
        return torch.mul(v, g_r * r.pow(3) / -v.shape[-1], out=torch.empty_like(v)), None


def inv_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(v^2) + eps) over the last dim, in fp32 (fp64 for fp64 v): v [..., D] -> [..., 1].
    Nothing but v (alive anyway as an AttnRes source) and the result is kept for backward."""
    return _InvRMS.apply(v, eps)


def _dtypes(values: list[torch.Tensor]) -> tuple[torch.dtype, torch.dtype]:
    """(output dtype = promotion over the values, accumulation dtype = at least fp32)."""
    out = values[0].dtype
    for v in values[1:]:
        out = torch.promote_types(out, v.dtype)
    return out, torch.promote_types(out, torch.float32)


def depth_softmax_mix_autograd(
    values: list[torch.Tensor], inv_rms_: list[torch.Tensor], query: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One AttnRes op (paper eq. 2-3) in plain autograd ops; `depth_softmax_mix` computes the same.

    values:  S tensors [B, T, D] (unnormalised v_i); inv_rms_: S tensors [B, T, 1] fp32, 1/rms(v_i);
    query:   [D], the pseudo-query times the op's RMSNorm weight (w * g).
    Returns h [B, T, D] (dtype promoted over the values) and alpha [S, B, T] (fp32, fp64 for fp64 values).
    """
    out_dtype, acc = _dtypes(values)
    logits = torch.stack([(v @ query.to(v.dtype)).to(acc) * r.squeeze(-1) for v, r in zip(values, inv_rms_)])
    alpha = torch.softmax(logits, dim=0)
    h = alpha[0].unsqueeze(-1) * values[0]
    for a, v in zip(alpha[1:], values[1:]):
        h = h + a.unsqueeze(-1) * v
    return h.to(out_dtype), alpha


class _DepthSoftmaxMix(torch.autograd.Function):
    """The AttnRes op with a hand-written backward: fewer passes over the [B, T, D] sources than
    autograd's (per source: forward mv + addcmul, backward vecdot + mul + addcmul + mv), and nothing
    saved but the inputs, alpha [S, B, T] and the raw scores [S, B, T].

    With d_i = q . v_i, logit_i = d_i r_i, alpha = softmax(logit), h = sum_i alpha_i v_i:
      g_alpha_i = <g_h, v_i>,  g_logit = alpha * (g_alpha - sum_j alpha_j g_alpha_j),  (summed pairwise)
      g_v_i = alpha_i g_h + g_logit_i r_i q,  g_r_i = g_logit_i d_i,  g_q = sum_i v_i^T (g_logit_i r_i).
    """

    @staticmethod
    def forward(ctx, query, n, *tensors):
        values, scales = tensors[:n], tensors[n:]
        out_dtype, acc = _dtypes(values)
        dots = torch.stack([(v @ query.to(v.dtype)).to(acc) for v in values])          # [S, B, T]
        logits = dots * torch.stack(scales).squeeze(-1).to(acc)
        alpha = torch.softmax(logits, dim=0)
        h = alpha[0].unsqueeze(-1) * values[0]                                       # acc dtype
        for a, v in zip(alpha[1:], values[1:]):
            h.addcmul_(a.unsqueeze(-1), v)
        ctx.n = n
        ctx.save_for_backward(query, alpha, dots, *tensors)
        ctx.mark_non_differentiable(alpha)
        return h.to(out_dtype), alpha

    @staticmethod
    def backward(ctx, g_h, _g_alpha):
        query, alpha, dots, *tensors = ctx.saved_tensors
        n = ctx.n
        values, scales = tensors[:n], tensors[n:]
        acc = alpha.dtype
        g_alpha = torch.stack([torch.linalg.vecdot(g_h, v.to(g_h.dtype)).to(acc) for v in values])  # [S, B, T]
        # g_alpha_i - sum_j alpha_j g_alpha_j, summed pairwise: for a source with nearly all the weight the
        # plain difference cancels most digits (kernels/attnres.py takes it in fp64 instead)
        centred = (alpha.unsqueeze(0) * (g_alpha.unsqueeze(1) - g_alpha.unsqueeze(0))).sum(1)       # [S, B, T]
        g_logit = alpha * centred
        scale = torch.stack(scales).squeeze(-1).to(acc)
        g_dot = g_logit * scale                                                        # [S, B, T]
        g_q = torch.zeros_like(query, dtype=acc)
        g_values = []
        for i, v in enumerate(values):
            g_v = alpha[i].unsqueeze(-1) * g_h                                         # acc or g_h dtype
            g_v = g_v.addcmul_(g_dot[i].unsqueeze(-1), query.to(g_v.dtype))
            g_values.append(g_v.to(v.dtype))
            g_q += (g_dot[i].reshape(-1).to(v.dtype) @ v.reshape(-1, v.shape[-1])).to(acc)
        g_scales = [(g_logit[i] * dots[i]).unsqueeze(-1).to(r.dtype) for i, r in enumerate(scales)]
        return (g_q.to(query.dtype), None, *g_values, *g_scales)


def depth_softmax_mix(
    values: list[torch.Tensor], inv_rms_: list[torch.Tensor], query: torch.Tensor, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One AttnRes op (paper eq. 2-3): h = sum_i softmax_i((w*g) . v_i / rms(v_i)) v_i.

    Same arguments and results as `depth_softmax_mix_autograd` (values S x [B, T, D], inv_rms_ S x [B, T, 1],
    query [D] -> h [B, T, D], alpha [S, B, T]). impl: "torch" = `_DepthSoftmaxMix`; "triton" = the fused
    kernels of kernels/attnres.py (on CPU only under TRITON_INTERPRET=1); "auto" = triton for CUDA
    values the kernels support (`kernels.attnres.supported`: few enough sources, D small enough,
    bf16/fp16/fp32), torch otherwise.
    """
    if impl == "triton" or (impl == "auto" and values[0].is_cuda):
        from kernels import attnres as fused

        if fused.supported(values, inv_rms_, query):
            return fused.attnres_mix_triton(values, inv_rms_, query)
        if impl == "triton":
            raise ValueError(f"the Triton AttnRes mix needs 1-{fused.MAX_SOURCES} sources of one shape "
                             f"[B, T, D <= {fused.MAX_D}] on one device, bf16/fp16/fp32 values, fp32 inv_rms")
    elif impl not in ("auto", "torch"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    return _DepthSoftmaxMix.apply(query, len(values), *values, *inv_rms_)


@dataclass
class DepthState:
    """What the stack carries between sublayers under AttnRes.

    sources: finished sources [embedding, b_1, b_2, ...], each [B, T, D]; inv_rms: their 1/rms [B, T, 1];
    partial: sum of the outputs of the current, unfinished block (None when the block is empty)."""
    sources: list[torch.Tensor] = field(default_factory=list)
    inv_rms: list[torch.Tensor] = field(default_factory=list)
    partial: torch.Tensor | None = None


class AttnResidual(DepthRecorder, nn.Module):
    """full_attnres / block_attnres behind the residual seam (see k3lab.model.residual).

    n_sublayers AttnRes ops (op i forms the input of sublayer i) plus op n_sublayers, the final
    aggregation that `end` returns. Parameters: queries[i] [D] (zeros) and norms[i].weight [D] (ones),
    all 1-D, so the optimizer's grouping rule sends them to AdamW.
    """

    def __init__(self, cfg: ResidualConfig, n_sublayers: int, d_model: int, eps: float):
        super().__init__()
        if cfg.name not in ("full_attnres", "block_attnres"):
            raise ValueError(f"AttnResidual does not implement residual.name={cfg.name!r}")
        block_size = cfg.sublayers_per_block(n_sublayers)
        if block_size < 1:
            raise ValueError(f"residual.block_size must be >= 1 (sublayers per block), got {block_size}")
        self.name = cfg.name
        self.block_size = block_size
        self.n_sublayers = n_sublayers
        self.eps = eps
        n_ops = n_sublayers + 1
        self.queries = nn.ParameterList([nn.Parameter(torch.zeros(d_model)) for _ in range(n_ops)])
        self.norms = nn.ModuleList([RMSNorm(d_model, eps) for _ in range(n_ops)])
        self.n_blocks = math.ceil(n_sublayers / block_size)
        self.init_recorder()

    # --- which sources each op sees -------------------------------------------------------------
    def source_columns(self, op: int) -> list[int]:
        """Depth-source ids op `op` attends over: 0 = embedding, n = block n (its completed sum, or its
        partial sum when op lies inside block n). Op n_sublayers is the final aggregation."""
        done = op // self.block_size          # blocks completed before op
        cols = list(range(done + 1))          # embedding + completed blocks
        if op % self.block_size:              # op sits inside block done+1, after some of its sublayers
            cols.append(done + 1)
        return cols

    def column_labels(self) -> list[str]:
        if self.block_size == 1:
            return ["emb"] + [sublayer_label(j) for j in range(self.n_sublayers)]
        return ["emb"] + [f"block{n}" for n in range(1, self.n_blocks + 1)]

    # --- the seam ---------------------------------------------------------------------------------
    def begin(self, embedding: torch.Tensor) -> DepthState:
        return DepthState(sources=[embedding], inv_rms=[inv_rms(embedding, self.eps)])

    # the mix function (values, inv_rms, query) -> (h, alpha); benchmarks swap in alternatives
    mix = staticmethod(depth_softmax_mix)

    def op_inputs(self, state: DepthState) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The values an op attends over (finished sources, then the partial sum) and their 1/rms."""
        values, scales = list(state.sources), list(state.inv_rms)
        if state.partial is not None:
            values.append(state.partial)
            scales.append(inv_rms(state.partial, self.eps))
        return values, scales

    def _mix(self, state: DepthState, op: int) -> torch.Tensor:
        values, scales = self.op_inputs(state)
        h, alpha = self.mix(values, scales, self.queries[op] * self.norms[op].weight)
        if self.record:
            self.record_weights(op, self.source_columns(op), alpha)
        return h

    def read(self, state: DepthState, sublayer: int) -> torch.Tensor:
        h = self._mix(state, sublayer)
        if self.record:
            self.record_rms("input_rms", sublayer, h)
        return h

    def write(self, state: DepthState, sublayer: int, out: torch.Tensor) -> DepthState:
        if self.record:
            self.record_rms("output_rms", sublayer, out)
        partial = out if state.partial is None else state.partial + out
        if (sublayer + 1) % self.block_size == 0:   # block complete: its sum becomes a source
            return DepthState(state.sources + [partial], state.inv_rms + [inv_rms(partial, self.eps)], None)
        return DepthState(state.sources, state.inv_rms, partial)

    def end(self, state: DepthState) -> torch.Tensor:
        h = self._mix(state, self.n_sublayers)
        if self.record:
            self.record_rms("final_rms", 0, h)
        return h

    def op_label(self, op: int) -> str:
        return "final" if op == self.n_sublayers else sublayer_label(op)

    def extra_repr(self) -> str:
        return f"{self.name}, block_size={self.block_size} sublayers, n_blocks={self.n_blocks}"
