"""The K3 model in plain PyTorch: one layer per file, built from a ModelConfig alone.

    k3.py        K3Model: embedding -> (mixer, FFN) sublayers on the residual stream -> LM head
    kda.py       Kimi Delta Attention (the `decay` switch), calling kernels.kda
    mla.py       gated multi-head latent attention (NoPE)
    ffn.py       the gated FFN (the `glu` switch)
    moe.py       Stable LatentMoE and its variants (the `moe` switch)
    router.py    the sigmoid top-k router and the balancing rules (the `balance` switch)
    residual.py  the residual stream interface and the PreNorm residual
    attnres.py   Attention Residuals (the `residual` switch)
    norm.py      RMSNorm
    matmul.py    products of 16-bit operands with fp32 results (the router's logits, the head's dL/dW)
    tags.py      parameter tags read by the initialiser and the optimizer

Training, compilation, distribution and logging are applied from outside (k3lab/lit.py, k3lab/train.py).
"""
from k3lab.model.k3 import K3Model

__all__ = ["K3Model"]
