"""k3lab kernels: fused Triton kernels of the model's hot paths, each beside its plain-PyTorch reference.

- ``kernels.kda``: Kimi Delta Attention (arXiv:2510.26692), entry point :func:`kernels.kda.kda`.
- ``kernels.short_conv``: the KDA layer's causal depthwise conv + SiLU on [B, T, C], entry point
  :func:`kernels.short_conv.short_conv`.
- ``kernels.attnres`` and ``kernels.attnres_block``: the AttnRes mixes (full and block), see docs/attnres.md.
- ``kernels.grouped_glu``: the MoE's checkpointed routed experts, grouped GEMMs with the GLU in their
  epilogues, entry point :func:`kernels.grouped_glu.grouped_glu`.
- ``kernels.momentum``: Muon's momentum update and Newton-Schulz direction in one pass, entry point
  :func:`kernels.momentum.momentum_direction`.
"""
