"""Stable LatentMoE (K3 eq. 11, arXiv:2607.24653; LatentMoE arXiv:2601.18089).

    latent_norm:  y = shared(x) + W_up RMSNorm( sum_{i in E(x)} p_i E_i(W_down x) )
    latent:       y = shared(x) + W_up          sum_{i in E(x)} p_i E_i(W_down x)
    standard:     y = shared(x) +               sum_{i in E(x)} p_i E_i(x)
    dense_matched (no MoE): one GLU whose hidden width gives the active parameters of latent_norm with the
                  same moe settings (matched_dense_hidden), so that MoE and dense compare at equal active
                  parameters and FLOPs per token; `dense` is the plain GLU FFN of width model.ffn_hidden.

x [B, T, D]. The router (k3lab.model.router) scores the full-width x. Routed experts are GLUs (the
`glu` switch) of width w = D / alpha (latent) or D (standard) and hidden width h; the shared experts
are full-width GLUs. LatentMoE's "acc" variant (scale_with_latent) multiplies n_experts and top_k by
alpha, which keeps total and active routed parameters equal to the standard MoE's (w*h per expert
matrix, alpha times as many, alpha times as many active).

Expert weights are stacked [n_experts, out, in] (dim 0 indexes experts; Muon treats each 3-D stack's
slices [out, in] as matrices of their own). Dispatch sorts the k*m (token, expert)
pairs by expert and runs each of the three GLU matmuls as one grouped matmul (`torch._grouped_mm`, CUDA
bf16), or, elsewhere, as a loop over the experts' contiguous segments; checkpointed experts on CUDA run
as fused Triton kernels instead (`kernels.grouped_glu`: grouped GEMMs with the GLU in their epilogues).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3lab.config import BalanceConfig, GLUConfig, ModelConfig, MoEConfig
from k3lab.distributed import all_reduce_sum, broadcast_from_rank0
from k3lab.model.ffn import GLU, glu_combine
from k3lab.model.norm import RMSNorm
from k3lab.model.router import (Router, Routing, build_balancer, expert_load, max_violation_tensor,
                               score_entropy)
from k3lab.switches import check_option
from k3lab.model.tags import tag
from kernels.grouped_glu import grouped_glu, triton_available

DISPATCHES = ("auto", "fused", "grouped", "loop")
STATS = ("maxvio", "dead_frac", "router_entropy", "bias_norm")  # MoE.stats_tensor, in order


def default_expert_hidden(d_model: int, top_k: int, ffn_hidden: int | None = None) -> int:
    """The dense FFN's hidden width (given, or by the ModelConfig.ffn_hidden rule with its default
    ffn_mult) split over the top_k experts a token uses before latent scaling, rounded to a multiple
    of 8 (grouped-matmul alignment). Tiny model: 352 / 2 = 176."""
    if not ffn_hidden:
        ffn_hidden = int(round(ModelConfig.ffn_mult * d_model / 32)) * 32
    return max(8, int(round(ffn_hidden / top_k / 8)) * 8)


def latent_norm_active_params(d_model: int, moe: MoEConfig, ffn_hidden: int | None = None) -> int:
    """Active parameters of one latent_norm MoE layer with moe's sizes, as MoE.n_params_active counts them:
        router d*E + routed experts k*3*w*h + shared experts 3*d*(n_shared*h) + W_down and W_up 2*d*w + norm w,
    with s = latent_ratio if scale_with_latent else 1, E = n_experts*s, k = top_k*s, w = d / latent_ratio,
    h = expert_hidden or default_expert_hidden(d, top_k, ffn_hidden). Tiny model (d 128, 8 experts top-2,
    ratio 4): 4,096 + 135,168 + 67,584 + 8,192 + 32 = 215,072."""
    scale = moe.latent_ratio if moe.scale_with_latent else 1
    n_experts, top_k, width = moe.n_experts * scale, moe.top_k * scale, d_model // moe.latent_ratio
    hidden = moe.expert_hidden or default_expert_hidden(d_model, moe.top_k, ffn_hidden)
    return (d_model * n_experts + top_k * 3 * width * hidden + 3 * d_model * hidden * moe.n_shared
            + 2 * d_model * width + width)


def matched_dense_hidden(d_model: int, moe: MoEConfig, ffn_hidden: int | None = None) -> int:
    """Hidden width h of the dense GLU (3*d*h weights) with the active parameters of a latent_norm MoE layer:
    h = latent_norm_active_params / (3 d), rounded to a multiple of 8 (so within 12*d parameters of it).
    Tiny model: 215,072 / 384 = 560.1 -> 560, against the plain dense FFN's 352."""
    return max(8, int(round(latent_norm_active_params(d_model, moe, ffn_hidden) / (3 * d_model) / 8)) * 8)


def grouped_mm_usable(x: torch.Tensor, *dims: int, dtype: torch.dtype | None = None) -> bool:
    """torch._grouped_mm's fast kernel for x (in `dtype`, default its own): CUDA, bf16, rows 16-byte aligned
    (every dim a multiple of 8)."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and (dtype or x.dtype) == torch.bfloat16
            and all(d % 8 == 0 for d in dims))


class GroupedExperts(nn.Module):
    """n GLU experts, x [M, w] -> [M, w] for M (token, expert) pairs already sorted by expert.

    w1, w2 [n, h, w] (gate, up), w3 [n, w, h] (out; tagged `output_proj`); Muon orthogonalises each
    expert's slice of these 3-D stacks on its own.
    E_e(x) = w3[e] glu_combine(w1[e] x, w2[e] x).

    Dispatch (`resolve`): fused (kernels.grouped_glu, checkpointed by construction), grouped (three
    torch._grouped_mm and the GLU in PyTorch) or loop (per expert). auto picks fused only for checkpointed
    experts: where grouped_mm_usable holds and `backend` (kernels.backend) is auto, or always under backend
    triton (CPU tensors only under TRITON_INTERPRET=1); else grouped where usable, else loop.
    """

    def __init__(self, n: int, width: int, hidden: int, glu: GLUConfig, init_std: float = 0.02,
                 backend: str = "auto"):
        super().__init__()
        self.n, self.width, self.hidden, self.glu, self.backend = n, width, hidden, glu, backend
        self.w1 = nn.Parameter(torch.empty(n, hidden, width))
        self.w2 = nn.Parameter(torch.empty(n, hidden, width))
        self.w3 = nn.Parameter(torch.empty(n, width, hidden))
        tag(self, "w3", output_proj=True)
        self.reset_parameters(init_std)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_scale: float = 1.0) -> None:
        """N(0, std) like every Linear of the model; the output stack w3 scaled by out_scale."""
        self.w1.normal_(0.0, std)
        self.w2.normal_(0.0, std)
        self.w3.normal_(0.0, std * out_scale)

    def resolve(self, xs: torch.Tensor, dispatch: str, recompute: bool) -> str:
        """The dispatch that runs xs [M, w] for the requested one; recompute: the experts are checkpointed."""
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch={dispatch!r}; valid: {', '.join(DISPATCHES)}")
        if dispatch != "auto":
            return dispatch
        if recompute and self.backend == "triton":
            return "fused"
        usable = grouped_mm_usable(xs, self.width, self.hidden, dtype=self.run_dtype(xs))
        if recompute and usable and self.backend == "auto" and triton_available():
            return "fused"
        return "grouped" if usable else "loop"

    @staticmethod
    def run_dtype(xs: torch.Tensor) -> torch.dtype:
        """The dtype the experts run xs in: the autocast dtype under bf16-mixed, else xs's own."""
        if torch.is_autocast_enabled(xs.device.type):
            return torch.get_autocast_dtype(xs.device.type)
        return xs.dtype

    def forward(self, xs: torch.Tensor, counts: torch.Tensor, dispatch: str = "auto") -> torch.Tensor:
        """xs [M, w] sorted by expert, counts [n] (int64, sum M) -> [M, w]; dispatch by `resolve` for
        experts that are not checkpointed (auto: grouped or loop)."""
        dispatch = self.resolve(xs, dispatch, recompute=False)
        if dispatch == "fused":
            return self.fused(xs, counts)
        xs = xs.to(self.run_dtype(xs))
        return self._grouped(xs, counts) if dispatch == "grouped" else self._loop(xs, counts)

    def fused(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts through kernels.grouped_glu: the autograd graph keeps xs alone (see its docstring)."""
        xs = xs.to(self.run_dtype(xs))
        w1, w2, w3 = (w.to(xs.dtype) for w in (self.w1, self.w2, self.w3))
        return grouped_glu(xs, counts, w1, w2, w3, self.glu.name == "situ", self.glu.b1, self.glu.b2)

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        dt = xs.dtype
        w1, w2, w3 = (w.to(dt).transpose(-2, -1) for w in (self.w1, self.w2, self.w3))  # [n, in, out]
        gate = torch._grouped_mm(xs, w1, offs=offs)
        up = torch._grouped_mm(xs, w2, offs=offs)
        return torch._grouped_mm(glu_combine(gate, up, self.glu), w3, offs=offs)

    def _loop(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # unbind once: its backward stacks the n slice gradients (indexing w[e] per expert would
        # allocate a full [n, out, in] gradient per expert)
        w1, w2, w3 = (w.to(xs.dtype).unbind(0) for w in (self.w1, self.w2, self.w3))
        out = []
        for e, seg in enumerate(torch.split(xs, counts.tolist())):
            if seg.shape[0]:
                out.append(glu_combine(seg @ w1[e].T, seg @ w2[e].T, self.glu) @ w3[e].T)
        return torch.cat(out) if out else xs.new_zeros(0, self.width)


def dispatch_combine(experts: GroupedExperts, h: torch.Tensor, routing: Routing, dispatch: str = "auto",
                     checkpoint_experts: bool = False) -> torch.Tensor:
    """sum_{i in E(x)} p_i E_i(h): h [m, w] -> [m, w].

    The m*k (token, expert) pairs are sorted by expert (stable), run through the experts as grouped
    matmuls over contiguous segments, put back in (token, slot) order and summed with the weights.
    checkpoint_experts: the backward reruns the experts' gate and up matmuls from the gathered input
    instead of keeping gate, up and the GLU output ([m*k, hidden] each: top_k times a dense FFN's
    activations): inside the fused kernels where GroupedExperts.resolve picks them, else with the experts
    under torch.utils.checkpoint.
    """
    m, k = routing.idx.shape
    flat = routing.idx.reshape(-1)                       # [m*k] expert of each pair
    order = torch.argsort(flat, stable=True)            # pairs sorted by expert
    counts = expert_load(routing.idx, experts.n)         # [n] pairs per expert, fixed size: one graph
    xs = h[order // k]                                   # [m*k, w] in sorted order
    recompute = checkpoint_experts and torch.is_grad_enabled()
    dispatch = experts.resolve(xs, dispatch, recompute)
    if dispatch == "fused":
        ys = experts.fused(xs, counts)
    elif recompute:  # nothing random inside: no RNG state to keep
        ys = checkpoint(experts, xs, counts, dispatch, use_reentrant=False, preserve_rng_state=False)
    else:
        ys = experts(xs, counts, dispatch)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return combine(ys, inverse, routing.weight, h.dtype)


def combine(ys: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pairs' expert outputs ys [m*k, w] (sorted by expert) put back in (token, slot) order by inverse
    [m*k] and mixed with the gating weights [m, k]: sum_j p_ij y_ij [m, w] in dtype, the sum in fp32 (or fp64)
    whatever the expert dtype. Written as k - 1 adds of slot slices, which Inductor makes one pointwise kernel
    gathering k rows per output row: 9% faster forward + backward on the H200 than the same sum as a reduction
    over the slots (`python -m benchmarks.moe_bench --combine`)."""
    m, k = weight.shape
    y = ys[inverse].reshape(m, k, -1)
    acc = torch.promote_types(y.dtype, torch.float32)
    out = y[:, 0].to(acc) * weight[:, :1].to(acc)
    for j in range(1, k):
        out = out + y[:, j].to(acc) * weight[:, j:j + 1].to(acc)
    return out.to(dtype)


class MoE(nn.Module):
    """Stable LatentMoE FFN: x [B, T, D] -> y [B, T, D]. See the module docstring for the options.

    Expert hidden width: moe.expert_hidden, or (0) the dense FFN width `ffn_hidden` / moe.top_k.
    recompute_glu (kernels.recompute_glu) goes to the shared experts' GLU; checkpoint_experts covers the routed ones;
    backend (kernels.backend) picks their dispatch (GroupedExperts).

    After forward: `aux_loss` (0-dim; non-zero only for balance=aux, training mode). Once per optimizer
    step, after it: `update_bias()`. Logging: `stats()`.
    """

    def __init__(self, d_model: int, moe: MoEConfig, glu: GLUConfig, balance: BalanceConfig,
                 eps: float = 1e-6, ffn_hidden: int | None = None, checkpoint_experts: bool = False,
                 recompute_glu: bool = False, backend: str = "auto"):
        super().__init__()
        if moe.name in ("dense", "dense_matched"):
            raise ValueError(f"moe={moe.name} is a dense GLU FFN (k3lab.model.k3.build_ffn); build GLU, not MoE")
        check_option("moe", moe.name)
        self.kind = moe.name
        self.latent = moe.name in ("latent", "latent_norm")
        alpha = moe.latent_ratio if self.latent else 1
        if d_model % alpha:
            raise ValueError(f"d_model {d_model} is not divisible by moe.latent_ratio {alpha}")
        scale = alpha if (self.latent and moe.scale_with_latent) else 1
        self.n_experts, self.top_k = moe.n_experts * scale, moe.top_k * scale
        self.width = d_model // alpha
        self.hidden = moe.expert_hidden or default_expert_hidden(d_model, moe.top_k, ffn_hidden)
        self.dispatch = "auto"  # DISPATCHES (GroupedExperts); an attribute, set it to compare
        self.checkpoint_experts = checkpoint_experts  # kernels.checkpoint_experts (dispatch_combine)

        self.router = Router(d_model, self.n_experts, self.top_k, moe.router_init_std)
        self.experts = GroupedExperts(self.n_experts, self.width, self.hidden, glu, backend=backend)
        self.shared = (GLU(d_model, self.hidden * moe.n_shared, glu, recompute_glu=recompute_glu)
                       if moe.n_shared > 0 else None)
        if self.latent:
            self.down = nn.Linear(d_model, self.width, bias=False)   # W_down [w, D]
            self.up = nn.Linear(self.width, d_model, bias=False)     # W_up [D, w]
            tag(self.up, "weight", output_proj=True)
        self.norm = RMSNorm(self.width, eps) if moe.name == "latent_norm" else None

        self.balancer = build_balancer(balance, self.n_experts, self.top_k)
        self.aux_loss = torch.zeros(())
        # routing statistics since the last update_bias (not saved in checkpoints)
        self.register_buffer("_load", torch.zeros(self.n_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("_entropy_sum", torch.zeros((), dtype=torch.float64), persistent=False)
        self._tokens = 0
        self._closed: tuple[torch.Tensor, torch.Tensor] | None = None  # (load, [entropy sum, tokens]) of the last step

    # --- forward --------------------------------------------------------------------------------
    def routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [m, D] -> the routed branch [m, D] (latent: W_up [norm] sum p_i E_i(W_down x))."""
        h = self.down(x) if self.latent else x
        r = dispatch_combine(self.experts, h, routing, self.dispatch, self.checkpoint_experts)
        if self.norm is not None:
            r = self.norm(r.to(torch.promote_types(r.dtype, torch.float32))).to(r.dtype)  # fp32 stats under bf16
        return self.up(r) if self.latent else r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        xf = x.reshape(B * T, D)
        routing = self.router(xf)
        y = self.routed(xf, routing)
        if self.shared is not None:
            y = y + self.shared(xf)
        if self.training:
            self._observe(routing)
            loss = self.balancer.loss(routing)
            self.aux_loss = loss if loss is not None else x.new_zeros((), dtype=torch.float32)
        else:
            self.aux_loss = x.new_zeros((), dtype=torch.float32)
        return y.reshape(B, T, D)

    # --- balancing ------------------------------------------------------------------------------
    @torch.no_grad()
    def _observe(self, routing: Routing) -> None:
        self.balancer.observe(routing, self.router.bias)
        self._load += expert_load(routing.idx, self.n_experts)
        self._entropy_sum += score_entropy(routing.scores.detach()).sum().double()
        self._tokens += routing.idx.shape[0]

    @torch.no_grad()
    def update_bias(self) -> None:
        """Apply the balancing rule to the forwards since the last call (pooled over micro-batches and,
        under torch.distributed, over ranks: a collective, so every rank must call it). The new bias
        is used from the next forward on; every rank holds the same bias. The closed step's routing
        statistics stay on the device until `stats()` reads them: no host synchronisation per step."""
        new = self.balancer.update(self.router.bias)
        if new is not None:
            self.router.bias.copy_(broadcast_from_rank0(new.to(self.router.bias)))
        self.balancer.reset()
        self._closed = (all_reduce_sum(self._load).clone(), all_reduce_sum(self._entropy_tokens()))
        self._load.zero_()
        self._entropy_sum.zero_()
        self._tokens = 0

    def _entropy_tokens(self) -> torch.Tensor:
        """[entropy sum, tokens] (fp64, on the device) of the forwards since the last update_bias. The token
        count, a host int, enters by a fill kernel: a tensor built from it (new_tensor) would be a blocking
        host-to-device copy, which waits for the device's whole queue."""
        return torch.stack([self._entropy_sum, torch.full_like(self._entropy_sum, self._tokens)])

    def stats_tensor(self) -> torch.Tensor:
        """STATS as one fp64 tensor [4], left on the device: maxvio, dead_frac (experts with zero load),
        router_entropy (mean per-token entropy of the normalised scores, nats) and bias_norm, over this rank's
        training forwards since the last update_bias(), or, if none, over the step that update_bias() closed
        (pooled over ranks); the first three NaN where no token was routed. A caller reading several layers
        stacks them and reads once (k3lab.lit.K3LitModule.router_metrics)."""
        if self._tokens or self._closed is None:
            load, entropy_tokens = self._load, self._entropy_tokens()
        else:
            load, entropy_tokens = self._closed
        entropy, tokens = entropy_tokens.unbind()
        routed = tokens > 0
        nan = torch.full_like(entropy, float("nan"))
        return torch.stack([torch.where(routed, max_violation_tensor(load), nan),
                            torch.where(routed, (load == 0).double().mean(), nan),
                            torch.where(routed, entropy / tokens.clamp_min(1.0), nan),
                            self.router.bias.norm().double()])

    def stats(self) -> dict[str, float]:
        """`stats_tensor` read to the host, by name."""
        return dict(zip(STATS, self.stats_tensor().tolist()))

    # --- parameter counts -----------------------------------------------------------------------
    def n_params_total(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def n_params_active(self) -> int:
        """Routed experts by their top_k / n_experts share; router, shared experts, W_down/W_up, norm fully."""
        routed = sum(p.numel() for p in self.experts.parameters())
        return self.n_params_total() - routed + routed * self.top_k // self.n_experts
