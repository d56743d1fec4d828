"""Gated FFN with the `glu` switch.

situ  (K3):    y = W3( SiTU(W1 x; b1) * softcap(W2 x; b2) ),  SiTU(x; b) = b*tanh(x/b)*sigmoid(x),
               softcap(x; b) = b*tanh(x/b), b1 = 4, b2 = 25 (Kimi K3, arXiv:2607.24653).
swiglu:        y = W3( silu(W1 x) * W2 x ).
Both bound-free at small |x| (SiTU ~ silu, softcap ~ identity); SiTU caps the activations that
SwiGLU lets grow without limit.
With kernels.recompute_glu, W3 and the elementwise part run under torch.utils.checkpoint (`GLU.out`): the
backward keeps W1 x and W2 x and reruns glu_combine for W3's weight gradient instead of keeping its input.
"""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

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
    """x [..., d_in] -> [..., d_out] through a hidden width `hidden`.

    recompute_glu (kernels.recompute_glu): `out` runs under torch.utils.checkpoint, so the backward keeps
    only gate = W1 x and up = W2 x [..., hidden] and rebuilds glu_combine(gate, up), W3's input, from them.
    Compiled, that is one [tokens, hidden] tensor less per FFN in the activation dtype (Inductor otherwise
    keeps gate, up and the product); eager also drops glu_combine's per-op intermediates. W3 sits inside
    the checkpoint because its matmul is what keeps the product; the rerun stops once that input is rebuilt
    (eager: non-reentrant checkpoint's early stop; compiled: the partitioner reruns only what the backward
    reads), so no matmul runs twice.
    """

    def __init__(self, d_in: int, hidden: int, cfg: GLUConfig, d_out: int | None = None,
                 recompute_glu: bool = False):
        super().__init__()
        self.cfg = cfg
        self.recompute_glu = recompute_glu
        self.w1 = nn.Linear(d_in, hidden, bias=False)
        self.w2 = nn.Linear(d_in, hidden, bias=False)
        self.w3 = nn.Linear(hidden, d_out or d_in, bias=False)
        tag(self.w3, "weight", output_proj=True)  # scaled-down init, see K3Model.init_weights

    def out(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """W3 glu_combine(gate, up): gate, up [..., hidden] -> [..., d_out]."""
        return self.w3(glu_combine(gate, up, self.cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w2(x)
        if self.recompute_glu and torch.is_grad_enabled():  # nothing random inside: no RNG state to keep
            return checkpoint(self.out, gate, up, use_reentrant=False, preserve_rng_state=False)
        return self.out(gate, up)
