"""Gated FFN with the `glu` switch.

situ  (K3):    y = W3( SiTU(W1 x; b1) * softcap(W2 x; b2) ),  SiTU(x; b) = b*tanh(x/b)*sigmoid(x),
               softcap(x; b) = b*tanh(x/b), b1 = 4, b2 = 25 (Kimi K3, arXiv:2607.24653).
swiglu:        y = W3( silu(W1 x) * W2 x ).
Both bound-free at small |x| (SiTU ~ silu, softcap ~ identity); SiTU caps the activations that
SwiGLU lets grow without limit.
"""
import torch
from torch import nn

from k3lab.config import GLUConfig
from k3lab.model.tags import tag


def softcap(x: torch.Tensor, b: float) -> torch.Tensor:
    return b * torch.tanh(x / b)


def situ(x: torch.Tensor, b: float) -> torch.Tensor:
    return softcap(x, b) * torch.sigmoid(x)


def glu_combine(gate: torch.Tensor, up: torch.Tensor, cfg: GLUConfig) -> torch.Tensor:
    """The elementwise part of the GLU: gate = W1 x, up = W2 x, both [..., hidden]."""
    if cfg.name == "situ":
        return situ(gate, cfg.b1) * softcap(up, cfg.b2)
    return torch.nn.functional.silu(gate) * up


class GLU(nn.Module):
    """x [..., d_in] -> [..., d_out] through a hidden width `hidden`."""

    def __init__(self, d_in: int, hidden: int, cfg: GLUConfig, d_out: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.w1 = nn.Linear(d_in, hidden, bias=False)
        self.w2 = nn.Linear(d_in, hidden, bias=False)
        self.w3 = nn.Linear(hidden, d_out or d_in, bias=False)
        tag(self.w3, "weight", output_proj=True)  # scaled-down init, see K3Model.init_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(glu_combine(self.w1(x), self.w2(x), self.cfg))
