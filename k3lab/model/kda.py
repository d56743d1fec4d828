"""Kimi Delta Attention (KDA) layer: gated delta rule with per-channel decay.

Per head h, with state S_t [K, V] (Kimi Linear, arXiv:2510.26692, eq. 1):
    S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(K)
    a_t = exp(g_t), g_t [K] the log-decay from one of two maps (the `decay` switch):
      sigmoid  (Kimi K3, arXiv:2607.24653, eq. 5):  g = g_min * sigmoid(exp(A_h) * (z + dt_bias)),  A_h init 0,
                                                     g_min = -5 (fla's `safe_gate` lower-bound gate)
      softplus (Kimi Linear):                        g = -exp(A_h) * softplus(z + dt_bias),  A_h init log U(1, 16)
    z = W_f2 W_f1 x (low rank, rank K); dt_bias [H*K] = softplus^-1(logU[1e-3, 1e-1]) in both maps, so both
    start with slow decay (sigmoid: g in [-0.47, -0.005]); beta_t = sigmoid(W_b x) per head.
q, k, v pass a causal depthwise conv (size 4) and SiLU; q and k are L2-normalised per head.
The conv is `kernels.short_conv`: fused Triton on [B, T, C] (triton; auto on CUDA), else nn.Conv1d's torch ops.
Output: W_o[ sigmoid(W_g x) * RMSNorm(o) ] with a full-rank gate (K3).
The q/k L2 norm, the decay map, beta's sigmoid and the sequence mixing are one call,
`kernels.kda.kda_gated`: on the Triton backend the fused entry whose kernels do all of it (the one the
kernel benchmark times), on the torch and fla backends the same math in PyTorch followed by
`kernels.kda.kda`. With kernels.checkpoint_kda the short convs and that call (`KDA.mix`) run under
torch.utils.checkpoint: the backward reruns them from their inputs (the projections of q, k, v, z and beta,
A_log, dt_bias) instead of keeping the conv outputs and the call's intermediates.

Inference (`forward(x, cache)`, k3lab.generate): a `KDACache` holds each short conv's last conv_size - 1
inputs and the recurrent state S [B, H, K, V], constant memory per token. A single new token runs the
recurrence itself (`kernels.kda.kda_recurrent`); a longer input (a prompt) runs the chunkwise form from the
cached state. Both continue exactly the sequence `forward(x)` would have seen, up to rounding.
"""
import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3lab.config import ModelConfig
from k3lab.model.norm import RMSNorm
from k3lab.model.tags import tag
from kernels.kda import gated_inputs, kda, kda_gated, kda_recurrent, log_decay
from kernels.short_conv import short_conv


def _uniform_log(p: torch.Tensor, gen: torch.Generator, low: float, high: float) -> torch.Tensor:
    """A_h = log U(low, high)."""
    return (low + (high - low) * torch.rand(p.shape, generator=gen)).log()


def _inverse_softplus_log_uniform(p: torch.Tensor, gen: torch.Generator, low: float, high: float) -> torch.Tensor:
    """dt_bias with softplus(dt_bias) = dt ~ log-uniform[low, high]."""
    dt = torch.exp(math.log(low) + (math.log(high) - math.log(low)) * torch.rand(p.shape, generator=gen))
    return dt + torch.log(-torch.expm1(-dt))


class ShortConv(nn.Module):
    """Causal depthwise conv over time followed by SiLU. x [B, T, C] -> [B, T, C]. The weight stays an
    nn.Conv1d's ([C, 1, size], the parameter name `conv.weight`); `backend` is kernels.backend
    (`kernels.short_conv.short_conv`)."""

    def __init__(self, channels: int, size: int, backend: str = "auto"):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, size, groups=channels, padding=size - 1, bias=False)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return short_conv(x, self.conv.weight[:, 0, :], self.backend)

    def step(self, x: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C], the inputs that follow `past` [B, size - 1, C] (zeros before a sequence's start) ->
        (y [B, T, C], the last size - 1 inputs): `forward` of the whole sequence, T positions at a time."""
        seen = torch.cat([past, x], dim=1)
        return self(seen)[:, past.shape[1]:], seen[:, seen.shape[1] - past.shape[1]:]


@dataclass
class KDACache:
    """One KDA layer's inference state for B sequences: `conv` the last conv_size - 1 inputs of the q, k and
    v short convs [B, conv_size - 1, H*K] each, `state` the recurrent state S [B, H, K, K] (fp32)."""
    conv: list[torch.Tensor]
    state: torch.Tensor


class KDA(nn.Module):
    """x [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, H, K = cfg.width, cfg.n_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.decay = H, K, cfg.decay
        self.backend = cfg.kernels.backend
        self.recompute_states = cfg.kernels.recompute_states
        self.recompute_chunks = cfg.kernels.recompute_chunks
        self.keep_intra = cfg.kernels.keep_intra
        self.checkpoint_kda = cfg.kernels.checkpoint_kda
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            tag(proj, "weight", head_blocks=H)  # per-head Muon (K3 §2.5) splits these rows by head
        self.q_conv, self.k_conv, self.v_conv = (ShortConv(H * K, cfg.conv_size, self.backend)
                                                  for _ in range(3))
        self.f_down = nn.Linear(D, K, bias=False)
        self.f_up = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, H * K, bias=False)
        self.o_norm = RMSNorm(K, cfg.norm_eps)
        self.o_proj = nn.Linear(H * K, D, bias=False)
        tag(self.o_proj, "weight", output_proj=True)
        self.A_log = nn.Parameter(torch.zeros(H))  # sigmoid map: A_h = 0 at init (K3)
        if cfg.decay.name == "softplus":
            tag(self, "A_log", init=partial(_uniform_log, low=cfg.decay.a_init_min, high=cfg.decay.a_init_max))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        tag(self, "dt_bias", init=partial(_inverse_softplus_log_uniform, low=cfg.decay.dt_min, high=cfg.decay.dt_max))

    def log_decay(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, T, H, K] -> g [B, T, H, K] (fp32, <= 0): the decay map that `forward` applies."""
        return log_decay(z, self.A_log, self.dt_bias, self.decay.name, self.decay.g_min)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor,
            beta_logits: torch.Tensor) -> torch.Tensor:
        """The short convs and the sequence mixing: projections q, k, v [B, T, H*K] (before the conv), z
        [B, T, H*K], beta logits [B, T, H] -> o [B, T, H, K]."""
        B, T, _ = q.shape
        heads = lambda t: t.view(B, T, self.n_heads, self.head_dim)  # noqa: E731
        # the sigmoid map bounds g below by g_min: with g_min >= -5 the Triton/fla kernels may run every
        # 16-token sub-tile as a tensor-core matmul (K3 §2.1.1). core: the chunkwise call of the torch and
        # fla backends, this module's `kda` (which tests replace to see what reaches the kernel)
        o, _ = kda_gated(heads(self.q_conv(q)), heads(self.k_conv(k)), heads(self.v_conv(v)), heads(z), beta_logits,
                         self.A_log, self.dt_bias, decay=self.decay.name, g_min=self.decay.g_min,
                         backend=self.backend, recompute_states=self.recompute_states,
                         recompute_chunks=self.recompute_chunks, keep_intra=self.keep_intra, core=kda)
        return o

    def empty_cache(self, batch_size: int, dtype: torch.dtype = torch.float32) -> KDACache:
        """The state before a sequence's first token: zero conv inputs, S = 0."""
        device, HK = self.q_proj.weight.device, self.n_heads * self.head_dim
        size = self.q_conv.conv.kernel_size[0]
        return KDACache(conv=[torch.zeros(batch_size, size - 1, HK, device=device, dtype=dtype) for _ in range(3)],
                        state=torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device))

    def mix_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor,
                 beta_logits: torch.Tensor, cache: KDACache) -> torch.Tensor:
        """`mix` continuing the sequence of `cache` (updated in place) with T new positions -> o [B, T, H, K]:
        T = 1 is one step of the recurrence (Kimi Linear eq. 1), T > 1 the chunkwise form from the cached S."""
        B, T, _ = q.shape
        heads = lambda t: t.view(B, T, self.n_heads, self.head_dim)  # noqa: E731
        stepped = [conv.step(t, past) for conv, t, past in zip((self.q_conv, self.k_conv, self.v_conv), (q, k, v),
                                                               cache.conv)]
        (q, k, v), cache.conv = [heads(y) for y, _ in stepped], [past for _, past in stepped]
        gate = dict(A_log=self.A_log, dt_bias=self.dt_bias, decay=self.decay.name, g_min=self.decay.g_min)
        if T == 1:
            q, k, g, beta = gated_inputs(q, k, heads(z), beta_logits, **gate)
            o, cache.state = kda_recurrent(q, k, v, g, beta, initial_state=cache.state, output_final_state=True)
        else:
            o, cache.state = kda_gated(q, k, v, heads(z), beta_logits, **gate, initial_state=cache.state,
                                       output_final_state=True, backend=self.backend)
        return o

    def forward(self, x: torch.Tensor, cache: KDACache | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; with `cache`, the T positions continue the cached sequence (inference)."""
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        inputs = (self.q_proj(x), self.k_proj(x), self.v_proj(x), self.f_up(self.f_down(x)), self.b_proj(x))
        if cache is not None:
            o = self.mix_step(*inputs, cache)
        elif self.checkpoint_kda and torch.is_grad_enabled():  # nothing random inside: no RNG state to keep
            o = checkpoint(self.mix, *inputs, use_reentrant=False, preserve_rng_state=False)
        else:
            o = self.mix(*inputs)
        o = self.o_norm(o) * torch.sigmoid(self.g_proj(x).view(B, T, H, K))
        return self.o_proj(o.reshape(B, T, H * K))
