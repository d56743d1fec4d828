"""The K3-style hybrid decoder: KDA and gated MLA layers (3:1), GLU FFN or Stable LatentMoE.

    tokens [B, T] -> embed -> L x (mixer sublayer, FFN sublayer) -> RMSNorm -> lm_head -> logits [B, T, V]

With targets, `forward(tokens, targets)` returns the cross-entropy instead of the logits, through
k3lab.model.loss.linear_cross_entropy: the head's logits are formed chunk by chunk and never held whole.
`logits_at` keeps only the logits of chosen positions (evaluation, recall probes); `cache` (from
`empty_cache`) makes the call continue a sequence from its mixers' inference states (k3lab.generate).

Every sublayer is PreNorm (`f(RMSNorm(x))`); how its input is formed and its output joins the stream is
the `residual` switch (k3lab.model.residual). Embeddings are untied by default: K3 unties them, and
tying would put the LM head (AdamW) and the embedding under one update rule, which confounds the
optimizer ablations.

Init (`init_weights`): every parameter is drawn from its own generator, seeded by the run seed and the
parameter's name, so a switch never shifts the initial values of tensors it does not own (an ablation
compares the same network). Linear, embedding and stacked-expert weights ~ N(0, init_std), scaled by
1/sqrt(2 * n_layers) for projections that write into the residual stream (tag `output_proj`, GPT-2);
depthwise convs ~ U(+-1/sqrt(kernel)); norms at 1; a tensor with an `init` tag (a function of the
tensor and a generator) uses it (KDA decay parameters, the router); others keep their layer's value.
Tags: k3lab/model/tags.py.
"""
import math
import zlib

import torch
from torch import nn

from k3lab.config import ModelConfig
from k3lab.model.ffn import GLU
from k3lab.model.kda import KDA
from k3lab.model.loss import IGNORE_INDEX, TokenLoss, linear_cross_entropy
from k3lab.model.mla import GatedMLA
from k3lab.model.moe import MoE, matched_dense_hidden
from k3lab.model.norm import RMSNorm
from k3lab.model.residual import build_residual
from k3lab.model.tags import tags_by_param


class PreNorm(nn.Module):
    """x -> f(RMSNorm(x)); extra arguments (a mixer's inference cache) go to f."""

    def __init__(self, dim: int, fn: nn.Module, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.fn = fn

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return self.fn(self.norm(x), *args)


def build_ffn(cfg: ModelConfig, layer: int) -> nn.Module:
    """The FFN of one layer: the dense GLU of width ffn_hidden (moe=dense, and the first moe.first_dense
    layers of the other options), a dense GLU with the active parameters of a latent_norm MoE layer
    (moe=dense_matched: width matched_dense_hidden), or the MoE. kernels.recompute_glu reaches every GLU
    built here, the MoE's shared experts included; kernels.checkpoint_experts every MoE but those of the
    last kernels.keep_experts layers."""
    recompute_glu = cfg.kernels.recompute_glu
    if cfg.moe.name == "dense" or layer < cfg.moe.first_dense:
        return GLU(cfg.width, cfg.ffn_hidden, cfg.glu, recompute_glu=recompute_glu)
    if cfg.moe.name == "dense_matched":
        return GLU(cfg.width, matched_dense_hidden(cfg.width, cfg.moe, cfg.ffn_hidden), cfg.glu,
                   recompute_glu=recompute_glu)
    checkpoint_experts = cfg.kernels.checkpoint_experts and layer < cfg.n_layers - cfg.kernels.keep_experts
    return MoE(cfg.width, cfg.moe, cfg.glu, cfg.balance, cfg.norm_eps, ffn_hidden=cfg.ffn_hidden,
               checkpoint_experts=checkpoint_experts, recompute_glu=recompute_glu, backend=cfg.kernels.backend)


class K3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (run.py takes it from the data)")
        self.cfg = cfg
        D, eps = cfg.width, cfg.norm_eps
        init_seed = int(torch.randint(2**62, ()))  # drawn before any layer touches the global RNG
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.sublayers = nn.ModuleList()
        for layer, kind in enumerate(cfg.layer_kinds()):
            mixer = KDA(cfg) if kind == "kda" else GatedMLA(cfg)
            self.sublayers.append(PreNorm(D, mixer, eps))
            self.sublayers.append(PreNorm(D, build_ffn(cfg, layer), eps))
        self.residual = build_residual(cfg.residual, len(self.sublayers), D, eps, cfg.kernels.attnres_two_phase)
        self.norm = RMSNorm(D, eps)
        self.lm_head = nn.Linear(D, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_weights(init_seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        std, out_scale = self.cfg.init_std, 1 / math.sqrt(2 * self.cfg.n_layers)
        owners = {id(p): m for m in self.modules() for p in m.parameters(recurse=False)}
        tags = tags_by_param(self)
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
            module, p_tags = owners[id(p)], tags.get(id(p), {})
            if "init" in p_tags:
                p.copy_(p_tags["init"](p, gen))
            elif isinstance(module, nn.Conv1d):
                bound = 1 / math.sqrt(p[0].numel())
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
            elif isinstance(module, RMSNorm):
                p.fill_(1.0)
            elif p.ndim >= 2:
                scale = out_scale if p_tags.get("output_proj") else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * std * scale)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the router auxiliary losses of the last forward (0 unless balance=aux)."""
        return sum((m.aux_loss for m in self.moe_layers()),
                   torch.zeros((), dtype=torch.float32, device=self.embed.weight.device))

    @torch.no_grad()
    def update_router_biases(self) -> None:
        """Balancing step; call once per optimizer step, after it (the bias is used from the next step)."""
        for m in self.moe_layers():
            m.update_bias()

    def param_counts(self) -> dict[str, int]:
        """total, active (routed experts counted by top_k/n_experts), and both without the input embedding."""
        total = sum(p.numel() for p in self.parameters())
        inactive = sum(m.n_params_total() - m.n_params_active() for m in self.moe_layers())
        embedding = 0 if self.cfg.tie_embeddings else self.embed.weight.numel()
        return {
            "params_total": total,
            "params_active": total - inactive,
            "params_non_embedding": total - embedding,
            "params_active_non_embedding": total - inactive - embedding,
        }

    def empty_cache(self, batch_size: int) -> list:
        """The inference state of B empty sequences for `forward(..., cache=)`: per sublayer, its mixer's cache
        (k3lab.model.kda.KDACache, k3lab.model.mla.MLACache), None for the FFNs, which see one position at a
        time. The residual stream needs none: every op of it, AttnRes included, mixes over depth at one position."""
        dtype = self.embed.weight.dtype
        return [sub.fn.empty_cache(batch_size, dtype) if hasattr(sub.fn, "empty_cache") else None
                for sub in self.sublayers]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                logits_at: torch.Tensor | None = None, cache: list | None = None) -> torch.Tensor | TokenLoss:
        """tokens [B, T] (int64) -> logits [B, T, vocab] (fp32); with targets [B, T] (int64, -100 = no loss)
        -> TokenLoss (k3lab.model.loss): the summed cross-entropy over the targets != -100 (0-dim fp32), how
        many of them the argmax predicts and how many there are, the logits formed a chunk of tokens at a
        time (kernels.ce_chunk) and never whole. logits_at, a bool mask [B, T]: the logits of those positions
        alone, [M, vocab] in row-major order. cache (`empty_cache`, updated in place): the T tokens continue
        the sequences it holds, each mixer in its inference form (KDA's recurrent state, MLA's latent cache).

        Under torch.compile, traced whole, the sublayer loop unrolls into the graph with the residual's
        bookkeeping. A graph break inside a sublayer (data-dependent MoE routing, the torch KDA path) makes
        dynamo run this frame eagerly instead and compile every call it makes as a frame of its own; the
        residual's read/write/end, whose Python state differs at every sublayer (the op index and, under
        AttnRes, the number of depth sources), would then be compiled once per sublayer until dynamo's
        recompile limit. In that case they run eagerly (`_seam`), the sublayers compiled as before.
        """
        if logits_at is not None and targets is not None:
            raise ValueError("logits_at selects logits to return; with targets the loss is returned instead")
        call = _call if torch.compiler.is_compiling() else _seam
        res = self.residual
        state = call(res.begin, self.embed(tokens))
        for i, sublayer in enumerate(self.sublayers):
            x = call(res.read, state, i)
            out = sublayer(x) if cache is None or cache[i] is None else sublayer(x, cache[i])
            state = call(res.write, state, i, out)
        h = self.norm(call(res.end, state))                                   # [B, T, D]
        if logits_at is not None:
            h = h[logits_at]                                                  # [M, D]
        if targets is None:
            return self.lm_head(h).float()
        return linear_cross_entropy(h.flatten(0, 1), self.lm_head.weight, targets.flatten(), IGNORE_INDEX,
                                    self.cfg.kernels.ce_chunk)


def _call(fn, *args):
    """fn(*args): for the residual's methods inside a trace, which inlines them."""
    return fn(*args)


@torch.compiler.disable
def _seam(fn, *args):
    """fn(*args) with dynamo off: for the residual's methods when K3Model.forward runs outside a trace."""
    return fn(*args)
