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

Two-phase Block AttnRes (paper §3.2; `kernels.attnres_two_phase`). The ops of one block see the same
completed sources and differ only in the partial sum. Phase 1 (`block_softmax_mix`) mixes the completed
sources for all of the block's queries in one pass, o_j = sum_i alpha_ji v_i with the log-sum-exp lse_j
of op j's logits; phase 2 (`merge_partial`) adds op j's partial sum p as one more softmax term,

    h_j = (1 - w_j) o_j + w_j p,    w_j = sigmoid(q_j . p / rms(p) - lse_j),

which is the one-phase mix over [completed sources, p] rewritten. Both phases are plain-PyTorch autograd
functions here (the reference, and the CPU path) and fused Triton kernels on CUDA (kernels/attnres_block.py);
an op whose block has no partial sum yet takes o_j as it is. Phase 1 returns the o_j as separate tensors and
the merge computes 1/rms(p) itself, so on the fused kernels the two phases keep for backward what the one-phase
mix keeps: each op's input (kept by its sublayer's norm anyway) and per merged op one [B, T, D], p - o in
place of p.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from k3lab.config import ResidualConfig
from k3lab.model.norm import RMSNorm
from k3lab.model.residual import DepthRecorder, sublayer_label
from k3lab.model.tags import AdamWGroup, tag


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
    if _wants_triton(impl, values[0]):
        from kernels import attnres as fused

        if fused.supported(values, inv_rms_, query):
            return fused.attnres_mix_triton(values, inv_rms_, query)
        if impl == "triton":
            raise ValueError(f"the Triton AttnRes mix needs 1-{fused.MAX_SOURCES} sources of one shape "
                             f"[B, T, D <= {fused.MAX_D}] on one device, bf16/fp16/fp32 values, fp32 inv_rms")
    return _DepthSoftmaxMix.apply(query, len(values), *values, *inv_rms_)


def _wants_triton(impl: str, x: torch.Tensor) -> bool:
    """Whether `impl` asks for the fused kernels on input x: "triton", or "auto" with x on CUDA."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    return impl == "triton" or (impl == "auto" and x.is_cuda)


class _BlockSoftmaxMix(torch.autograd.Function):
    """Phase 1 of two-phase Block AttnRes: Q ops over the same S sources in one pass.

    queries [Q, D] (each w_j * g_j), values S x [B, T, D], scales S x [B, T, 1] (1/rms) -> (*o, lse, alpha):
    o_j [B, T, D] for each query (the values' promoted dtype; views of one [Q, B, T, D] buffer here), lse
    [Q, B, T] and alpha [Q, S, B, T] (accumulation dtype; alpha not differentiable).
    With d_ji = q_j . v_i, l_ji = d_ji r_i, alpha = softmax_i(l), lse_j = logsumexp_i(l_ji):
      g_alpha_ji = <g_o_j, v_i>,  g_l_ji = alpha_ji (g_alpha_ji - sum_k alpha_jk g_alpha_jk + g_lse_j),
      g_v_i = sum_j (alpha_ji g_o_j + g_l_ji r_i q_j),  g_r_i = sum_j g_l_ji d_ji,  g_q_j = sum_i g_l_ji r_i v_i.
    """

    @staticmethod
    def forward(ctx, queries, n, *tensors):
        values, scales = tensors[:n], tensors[n:]
        out_dtype, acc = _dtypes(values)
        dots = torch.stack([(v @ queries.to(v.dtype).T).to(acc).movedim(-1, 0) for v in values], dim=1)
        logits = dots * torch.stack(scales).squeeze(-1).to(acc)                    # [Q, S, B, T]
        lse = torch.logsumexp(logits, dim=1)                                       # [Q, B, T]
        alpha = torch.exp(logits - lse.unsqueeze(1))
        o = alpha[:, 0].unsqueeze(-1) * values[0].to(acc)                           # [Q, B, T, D]
        for i, v in enumerate(values[1:], 1):
            o.addcmul_(alpha[:, i].unsqueeze(-1), v.to(acc))
        ctx.n = n
        ctx.save_for_backward(queries, alpha, dots, *tensors)
        ctx.mark_non_differentiable(alpha)
        return *o.to(out_dtype).unbind(0), lse, alpha

    @staticmethod
    def backward(ctx, *grads):
        *g_o, g_lse, _g_alpha = grads
        queries, alpha, dots, *tensors = ctx.saved_tensors
        values, scales = tensors[:ctx.n], tensors[ctx.n:]
        acc = alpha.dtype
        g_o = torch.stack(g_o).to(acc)                                              # [Q, B, T, D]
        g_alpha = torch.stack([torch.linalg.vecdot(g_o, v.to(acc)) for v in values], dim=1)     # [Q, S, B, T]
        # centred pairwise, as in _DepthSoftmaxMix
        centred = (alpha.unsqueeze(1) * (g_alpha.unsqueeze(2) - g_alpha.unsqueeze(1))).sum(2)
        g_logit = alpha * (centred + g_lse.unsqueeze(1))
        g_dot = g_logit * torch.stack(scales).squeeze(-1).to(acc)
        q = queries.to(acc)
        g_q = torch.zeros_like(q)
        g_values = []
        for i, v in enumerate(values):
            g_v = torch.einsum("qbt,qbtd->btd", alpha[:, i], g_o) + torch.einsum("qbt,qd->btd", g_dot[:, i], q)
            g_values.append(g_v.to(v.dtype))
            g_q += g_dot[:, i].reshape(len(q), -1) @ v.reshape(-1, v.shape[-1]).to(acc)
        g_scales = [(g_logit[:, i] * dots[:, i]).sum(0).unsqueeze(-1).to(r.dtype) for i, r in enumerate(scales)]
        return (g_q.to(queries.dtype), None, *g_values, *g_scales)


def block_softmax_mix(values: list[torch.Tensor], inv_rms_: list[torch.Tensor], queries: torch.Tensor,
                      impl: str = "auto") -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Phase 1: values S x [B, T, D], inv_rms_ S x [B, T, 1], queries [Q, D] -> o (a list of Q [B, T, D]),
    lse [Q, B, T], alpha [Q, S, B, T] (not differentiable); o[j] is `depth_softmax_mix` with queries[j].
    impl: "torch" = `_BlockSoftmaxMix`; "triton" = the fused kernels of kernels/attnres_block.py (on CPU only
    under TRITON_INTERPRET=1; o_j separate tensors, so holding one keeps no other alive, and neither o nor lse
    kept for backward); "auto" = triton for CUDA inputs the kernels support (`kernels.attnres_block.supported`),
    torch otherwise.
    """
    if _wants_triton(impl, values[0]):
        from kernels import attnres_block as fused

        if fused.supported(values, inv_rms_, queries):
            return fused.block_mix_triton(values, inv_rms_, queries)
        if impl == "triton":
            raise ValueError(f"the Triton block AttnRes mix needs 1-{fused.MAX_SOURCES} sources of one shape "
                             f"[B, T, D <= {fused.MAX_D}] on one device, bf16/fp16/fp32 values, fp32 inv_rms, and "
                             f"queries [Q, D] with Q and D rounded up to powers of two multiplying to at most "
                             f"{fused.MAX_QUERY_TILE}")
    *o, lse, alpha = _BlockSoftmaxMix.apply(queries, len(values), *values, *inv_rms_)
    return o, lse, alpha


class _MergePartial(torch.autograd.Function):
    """Phase 2 of two-phase Block AttnRes: one op's partial sum p joins its phase-1 mix as one more softmax term.

    o [B, T, D] (phase 1's mix for this op), lse [B, T], p [B, T, D], r [B, T, 1] (1/rms(p)), query [D] ->
    h [B, T, D] (o and p promoted), w [B, T] (not differentiable): with d = q . p, z = d r - lse,
    w = sigmoid(z), h = o + w (p - o). Backward: g_o = (1 - w) g_h, g_z = w (1 - w) <g_h, p - o>,
    g_p = w g_h + g_z r q, g_r = g_z d, g_lse = -g_z, g_q = g_z r p.
    """

    @staticmethod
    def forward(ctx, o, lse, p, r, query):
        out_dtype = torch.promote_types(o.dtype, p.dtype)
        acc = torch.promote_types(out_dtype, torch.float32)
        dot = (p @ query.to(p.dtype)).to(acc)                                      # [B, T]
        w = torch.sigmoid(dot * r.squeeze(-1).to(acc) - lse)
        h = torch.lerp(o.to(acc), p.to(acc), w.unsqueeze(-1))
        ctx.save_for_backward(o, p, r, query, w, dot)
        ctx.mark_non_differentiable(w)
        return h.to(out_dtype), w

    @staticmethod
    def backward(ctx, g_h, _g_w):
        o, p, r, query, w, dot = ctx.saved_tensors
        acc = w.dtype
        g_h = g_h.to(acc)
        g_z = w * (1 - w) * torch.linalg.vecdot(g_h, p.to(acc) - o.to(acc))        # [B, T]
        g_dot = g_z * r.squeeze(-1).to(acc)
        g_o = (1 - w).unsqueeze(-1) * g_h
        g_p = w.unsqueeze(-1) * g_h + g_dot.unsqueeze(-1) * query.to(acc)
        g_q = g_dot.reshape(-1) @ p.reshape(-1, p.shape[-1]).to(acc)
        return (g_o.to(o.dtype), -g_z, g_p.to(p.dtype), (g_z * dot).unsqueeze(-1).to(r.dtype),
                g_q.to(query.dtype))


def merge_partial(o: torch.Tensor, lse: torch.Tensor, p: torch.Tensor, query: torch.Tensor, eps: float,
                  impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2: o [B, T, D], lse [B, T], p [B, T, D], query [D] -> h [B, T, D], w [B, T] (the weight on p, not
    differentiable; op j's one-phase alphas are [alpha_j (1 - w), w]), with r = 1/rms(p) = `inv_rms(p, eps)`.
    impl: "torch" = `_MergePartial` on `inv_rms(p, eps)`; "triton" = the fused kernels of
    kernels/attnres_block.py, which compute r themselves and keep h, p - o and per-row scalars for backward,
    not o and p; "auto" = triton for CUDA inputs the kernels support (`kernels.attnres_block.merge_supported`),
    torch otherwise.
    """
    if _wants_triton(impl, o):
        from kernels import attnres_block as fused

        if fused.merge_supported(o, lse, p, query):
            return fused.merge_triton(o, lse, p, query, eps)
        if impl == "triton":
            raise ValueError(f"the Triton AttnRes merge needs o and p of one shape [B, T, D <= {fused.MAX_D}] on "
                             f"one device, bf16/fp16/fp32, fp32 lse")
    return _MergePartial.apply(o, lse, p, inv_rms(p, eps), query)


@dataclass
class DepthState:
    """What the stack carries between sublayers under AttnRes.

    sources: finished sources [embedding, b_1, b_2, ...], each [B, T, D]; inv_rms: their 1/rms [B, T, 1];
    partial: sum of the outputs of the current, unfinished block (None when the block is empty);
    phase1: two-phase only, phase 1 of the current block's Q ops over `sources`: (o, a list of Q [B, T, D];
    lse [Q, B, T]; the ops' queries [Q, D])."""
    sources: list[torch.Tensor] = field(default_factory=list)
    inv_rms: list[torch.Tensor] = field(default_factory=list)
    partial: torch.Tensor | None = None
    phase1: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor] | None = None


class AttnResidual(DepthRecorder, nn.Module):
    """full_attnres / block_attnres behind the residual seam (see k3lab.model.residual).

    n_sublayers AttnRes ops (op i forms the input of sublayer i) plus op n_sublayers, the final
    aggregation that `end` returns. Parameters: queries[i] [D] (zeros) and norms[i].weight [D] (ones),
    tagged `adamw_group` "attnres" (k3lab/model/tags.py): AdamW under every `optim`, at the AdamW rate times
    residual.query_lr_scale, with weight decay residual.query_weight_decay. two_phase (kernels.attnres_two_phase):
    each block's ops mix their completed sources together when the block opens (`block_softmax_mix`,
    in `begin` and in the `write` that completes a block) and merge their partial sums one by one
    (`merge_partial`, with the rows of phase 1's stacked queries); the depth recording (`record`) takes the
    one-phase mix. On the fused kernels this keeps for backward what the one-phase mix keeps (see
    kernels/attnres_block.py): each op's input, kept by its sublayer's norm anyway, and per merged op one
    [B, T, D], p - o in place of the partial sum p.
    """

    def __init__(self, cfg: ResidualConfig, n_sublayers: int, d_model: int, eps: float, two_phase: bool = False):
        super().__init__()
        if cfg.name not in ("full_attnres", "block_attnres"):
            raise ValueError(f"AttnResidual does not implement residual.name={cfg.name!r}")
        block_size = cfg.sublayers_per_block(n_sublayers)
        if block_size < 1:
            raise ValueError(f"residual.block_size must be >= 1 (sublayers per block), got {block_size}")
        self.name = cfg.name
        self.two_phase = two_phase
        self.block_size = block_size
        self.n_sublayers = n_sublayers
        self.eps = eps
        n_ops = n_sublayers + 1
        self.queries = nn.ParameterList([nn.Parameter(torch.zeros(d_model)) for _ in range(n_ops)])
        self.norms = nn.ModuleList([RMSNorm(d_model, eps) for _ in range(n_ops)])
        group = AdamWGroup("attnres", cfg.query_lr_scale, cfg.query_weight_decay)
        for op in range(n_ops):
            tag(self.queries, str(op), adamw_group=group)
            tag(self.norms[op], "weight", adamw_group=group)
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
        return self._opened(DepthState(sources=[embedding], inv_rms=[inv_rms(embedding, self.eps)]), 0)

    def query(self, op: int) -> torch.Tensor:
        """Op `op`'s query against unnormalised sources: its pseudo-query times its RMSNorm weight, [D]."""
        return self.queries[op] * self.norms[op].weight

    def _opened(self, state: DepthState, first_op: int) -> DepthState:
        """`state` at the start of the block whose first op is `first_op`; two-phase, with phase 1 of the ops
        that see its sources: first_op up to the block's end or the final aggregation (op n_sublayers)."""
        if not self.two_phase or self.record:
            return state
        ops = range(first_op, min(first_op + self.block_size, self.n_sublayers + 1))
        queries = torch.stack([self.query(op) for op in ops])
        o, lse, _ = block_softmax_mix(state.sources, state.inv_rms, queries)
        state.phase1 = (o, lse, queries)
        return state

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
        if state.phase1 is not None:
            o, lse, query = (t[op % self.block_size] for t in state.phase1)
            if state.partial is None:
                return o
            return merge_partial(o, lse, state.partial, query, self.eps)[0]
        values, scales = self.op_inputs(state)
        h, alpha = self.mix(values, scales, self.query(op))
        if self.record:
            self.record_weights(op, self.source_columns(op), alpha, torch.cat(scales, -1).movedim(-1, 0))
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
            done = DepthState(state.sources + [partial], state.inv_rms + [inv_rms(partial, self.eps)], None)
            return self._opened(done, sublayer + 1)
        return DepthState(state.sources, state.inv_rms, partial, state.phase1)

    def end(self, state: DepthState) -> torch.Tensor:
        h = self._mix(state, self.n_sublayers)
        if self.record:
            self.record_rms("final_rms", 0, h)
        return h

    def op_label(self, op: int) -> str:
        return "final" if op == self.n_sublayers else sublayer_label(op)

    @torch.no_grad()
    def query_norms(self) -> list[float]:
        """||w_op||_2 of each op's pseudo-query (the key-norm gain left out), op order. Under FSDP2 the
        queries are shards, gathered here (a collective: every rank calls this, as at validation's end)."""
        full = [q.detach().full_tensor() if isinstance(q, DTensor) else q.detach() for q in self.queries]
        return torch.stack([q.float().norm() for q in full]).tolist()

    def extra_repr(self) -> str:
        phases = ", two-phase" if self.two_phase else ""
        return f"{self.name}, block_size={self.block_size} sublayers, n_blocks={self.n_blocks}{phases}"
