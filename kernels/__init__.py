"""k3lab kernels: fast sequence-mixing kernels, each beside its plain-PyTorch reference.

- ``kernels.kda``: Kimi Delta Attention (arXiv:2510.26692), entry point :func:`kernels.kda.kda`.
- ``kernels.short_conv``: the KDA layer's causal depthwise conv + SiLU on [B, T, C], entry point
  :func:`kernels.short_conv.short_conv`.
"""
