"""Gated Multi-head Latent Attention with no positional encoding (Kimi K3, arXiv:2607.24653, eq. 7).

    c = RMSNorm(W_dkv x)                       [B, T, r]     low-rank KV latent (DeepSeek-V2, arXiv:2405.04434)
    q = W_q x,  k = W_uk c,  v = W_uv c        [B, T, H, d]
    o = softmax(q k^T / sqrt(d) + causal) v     (NoPE: order comes from the KDA layers)
    y = W_o[ sigmoid(W_g x) * o ]

Inference (`forward(x, cache)`, k3lab.generate): the cache holds the latent c alone, r numbers per token
instead of the 2 H d of k and v. Each head's up-projections are absorbed into the query and the output
(DeepSeek-V2 §2.1.2): q_h . (W_uk,h c_t) = (W_uk,h^T q_h) . c_t and sum_t a_t W_uv,h c_t = W_uv,h sum_t a_t c_t,
so attention runs over the cached latents directly; the result is `forward`'s up to rounding.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3lab.config import ModelConfig
from k3lab.model.norm import RMSNorm
from k3lab.model.tags import tag


@dataclass
class MLACache:
    """One MLA layer's inference state for B sequences: the latents c [B, t, r] of the t positions seen."""
    latent: torch.Tensor


class GatedMLA(nn.Module):
    """x [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, H, d, r = cfg.width, cfg.n_heads, cfg.head_dim, cfg.kv_rank
        self.n_heads, self.head_dim = H, d
        self.q_proj = nn.Linear(D, H * d, bias=False)
        self.kv_down = nn.Linear(D, r, bias=False)
        self.kv_norm = RMSNorm(r, cfg.norm_eps)
        self.k_up = nn.Linear(r, H * d, bias=False)
        self.v_up = nn.Linear(r, H * d, bias=False)
        for proj in (self.q_proj, self.k_up, self.v_up):
            tag(proj, "weight", head_blocks=H)  # per-head Muon (K3 §2.5) splits these rows by head
        self.g_proj = nn.Linear(D, H * d, bias=False)
        self.o_proj = nn.Linear(H * d, D, bias=False)
        tag(self.o_proj, "weight", output_proj=True)

    def empty_cache(self, batch_size: int, dtype: torch.dtype = torch.float32) -> MLACache:
        """The state before a sequence's first token: no latents."""
        return MLACache(torch.zeros(batch_size, 0, self.kv_down.out_features, device=self.kv_down.weight.device,
                                    dtype=dtype))

    def attend_latent(self, q: torch.Tensor, c: torch.Tensor, cache: MLACache) -> torch.Tensor:
        """q [B, H, T, d] and c [B, T, r] of T new positions after the cached ones -> o [B, H, T, d]; appends c."""
        B, H, T, d = q.shape
        cache.latent = torch.cat([cache.latent, c], dim=1)                         # [B, P + T, r]
        P = cache.latent.shape[1] - T
        w_uk = self.k_up.weight.view(H, d, -1)                                     # [H, d, r]
        w_uv = self.v_up.weight.view(H, d, -1)
        q_latent = torch.einsum("bhtd,hdr->bhtr", q, w_uk)                          # W_uk,h^T q_h
        seen = torch.arange(P + T, device=q.device)
        causal = seen[None, :] <= P + torch.arange(T, device=q.device)[:, None]     # [T, P + T]
        mixed = F.scaled_dot_product_attention(q_latent, cache.latent[:, None].expand(B, H, -1, -1),
                                               cache.latent[:, None].expand(B, H, -1, -1), attn_mask=causal,
                                               scale=d ** -0.5)                    # sum_t a_t c_t [B, H, T, r]
        return torch.einsum("bhtr,hdr->bhtd", mixed, w_uv)

    def forward(self, x: torch.Tensor, cache: MLACache | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; with `cache`, the T positions continue the cached sequence (inference)."""
        B, T, _ = x.shape
        heads = lambda t: t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        c = self.kv_norm(self.kv_down(x))
        q = heads(self.q_proj(x))
        if cache is None:
            o = F.scaled_dot_product_attention(q, heads(self.k_up(c)), heads(self.v_up(c)), is_causal=True)
        else:
            o = self.attend_latent(q, c, cache)                                    # [B, H, T, d]
        o = o.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(torch.sigmoid(self.g_proj(x)) * o)
