"""Gated Multi-head Latent Attention with no positional encoding (Kimi K3, arXiv:2607.24653, eq. 7).

    c = RMSNorm(W_dkv x)                       [B, T, r]     low-rank KV latent (DeepSeek-V2, arXiv:2405.04434)
    q = W_q x,  k = W_uk c,  v = W_uv c        [B, T, H, d]
    o = softmax(q k^T / sqrt(d) + causal) v     (NoPE: order comes from the KDA layers)
    y = W_o[ sigmoid(W_g x) * o ]
"""
import torch
import torch.nn.functional as F
from torch import nn

from k3lab.config import ModelConfig
from k3lab.model.norm import RMSNorm
from k3lab.model.tags import tag


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        heads = lambda t: t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        c = self.kv_norm(self.kv_down(x))
        q, k, v = heads(self.q_proj(x)), heads(self.k_up(c)), heads(self.v_up(c))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, d]
        o = o.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(torch.sigmoid(self.g_proj(x)) * o)
