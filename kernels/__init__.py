"""k3lab kernels: fast sequence-mixing kernels, each beside its plain-PyTorch reference.

- ``kernels.kda``: Kimi Delta Attention (arXiv:2510.26692), entry point :func:`kernels.kda.kda`.
"""
