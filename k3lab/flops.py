"""Training FLOPs per token, from the model config alone.

    flops/token = 6 * N_matmul_active  +  sequence-mixing terms
      N_matmul_active: every weight used in a matmul by one token (LM head included, input embedding
                       excluded since a lookup is not a matmul), routed experts counted top_k times.
      MLA layer:       12 * H * d * T   (QK^T and AV, forward 2 x 2*H*d*T, backward twice that; the
                       full T counted, not T/2, as in PaLM's MFU convention, arXiv:2204.02311 App. B)
      KDA layer:       3 * H * [2C(3K + 2V) + 6KV]   per token, chunk C = 64: intra-chunk QK^T, KK^T,
                       the WY products W = AK and U = AV, the intra output, and three K x V state
                       products (q S, w S, k^T u); x3 for forward + backward.
The 6*N*D count (N = active non-embedding params) is reported beside it; MFU uses this function.
"""
from torch import nn

from k3lab.config import ModelConfig

KDA_CHUNK = 64


def matmul_params_per_token(model: nn.Module) -> int:
    """Active weights a token multiplies with: every parameter of >= 2 dims (depthwise conv kernels
    included: 2 FLOPs per weight per token, like a matmul) except the input embedding; MoE routed
    experts counted by their active share (top_k / n_experts)."""
    embed = 0 if model.cfg.tie_embeddings else model.embed.weight.numel()
    vectors = sum(p.numel() for p in model.parameters() if p.ndim < 2)
    return model.param_counts()["params_active"] - embed - vectors


def mixing_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    H, d = cfg.n_heads, cfg.head_dim
    kinds = cfg.layer_kinds()
    mla = kinds.count("mla") * 12 * H * d * seq_len
    kda = kinds.count("kda") * 3 * H * (2 * KDA_CHUNK * (3 * d + 2 * d) + 6 * d * d)
    return float(mla + kda)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    return 6.0 * matmul_params_per_token(model) + mixing_flops_per_token(model.cfg, seq_len)
