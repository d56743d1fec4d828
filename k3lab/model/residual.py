"""How sublayers read from and write to the residual stream.

The stack numbers its sublayers 0..2L-1 (layer l: mixer = 2l, FFN = 2l+1) and drives a `Residual`:

    state = residual.begin(embedding)            # embedding [B, T, D]
    for i, sublayer in enumerate(sublayers):
        x = residual.read(state, i)              # what sublayer i sees (before its own PreNorm)
        state = residual.write(state, i, sublayer(x))
    h = residual.end(state)                      # what the final norm and LM head see

`StandardResidual` is the PreNorm residual h <- h + f(norm(h)). Attention Residuals
(arXiv:2603.15031) replace the sum by a learned softmax over depth (`k3lab.model.attnres`).
"""
from __future__ import annotations

import torch
from torch import nn

from k3lab.config import ResidualConfig


class StandardResidual(nn.Module):
    """h_{i+1} = h_i + f_i(h_i); the state is the running sum [B, T, D]."""

    def begin(self, embedding: torch.Tensor) -> torch.Tensor:
        return embedding

    def read(self, state: torch.Tensor, sublayer: int) -> torch.Tensor:
        return state

    def write(self, state: torch.Tensor, sublayer: int, out: torch.Tensor) -> torch.Tensor:
        return state + out

    def end(self, state: torch.Tensor) -> torch.Tensor:
        return state


def build_residual(cfg: ResidualConfig, n_sublayers: int, d_model: int, eps: float) -> nn.Module:
    if cfg.name == "standard":
        return StandardResidual()
    from k3lab.model.attnres import AttnResidual

    return AttnResidual(cfg, n_sublayers, d_model, eps)
