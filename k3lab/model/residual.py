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


def sublayer_label(i: int) -> str:
    """Sublayer i of the stack: layer i // 2, mixer (even i) or FFN (odd i)."""
    return f"L{i // 2}.{'mix' if i % 2 == 0 else 'ffn'}"


class DepthRecorder:
    """Opt-in depth diagnostics for any residual (the PreNorm-dilution curve, arXiv:2603.15031 Fig. 5).

    Off by default (no cost). Set `residual.record = True` (e.g. for validation): every forward then
    accumulates, per sublayer i, the RMS of what sublayer i reads (`input_rms`, before its PreNorm) and
    writes (`output_rms`), the RMS of what the final norm sees (`final_rms`) and, for AttnRes, the mean
    depth-attention weights of each op. `diagnostics()` returns the means over the recorded forwards as
    plain Python numbers and clears them. RMS = sqrt(mean over batch, tokens and channels of x^2).
    """

    record: bool = False

    def init_recorder(self) -> None:
        self.record = False
        self.reset_diagnostics()

    def reset_diagnostics(self) -> None:
        self._rms_sum: dict[str, dict[int, torch.Tensor]] = {}
        self._rms_count: dict[str, dict[int, int]] = {}
        self._w_sum: dict[int, torch.Tensor] = {}
        self._w_cols: dict[int, list[int]] = {}
        self._w_count: dict[int, int] = {}

    @torch.no_grad()
    def record_rms(self, key: str, i: int, x: torch.Tensor) -> None:
        rms = x.detach().float().square().mean().sqrt()
        sums, counts = self._rms_sum.setdefault(key, {}), self._rms_count.setdefault(key, {})
        sums[i] = sums[i] + rms if i in sums else rms
        counts[i] = counts.get(i, 0) + 1

    @torch.no_grad()
    def record_weights(self, op: int, cols: list[int], alpha: torch.Tensor) -> None:
        """alpha [S, B, T]: the depth weights of op `op` over the sources with column ids `cols`."""
        mean = alpha.detach().float().flatten(1).mean(1)
        self._w_sum[op] = self._w_sum[op] + mean if op in self._w_sum else mean
        self._w_cols[op] = cols
        self._w_count[op] = self._w_count.get(op, 0) + 1

    def column_labels(self) -> list[str]:
        return []

    def op_label(self, op: int) -> str:
        return sublayer_label(op)

    def diagnostics(self, reset: bool = True) -> dict:
        """{"name", "n_forwards", "output_rms": [per sublayer], "input_rms": [...], "final_rms",
        "depth_weights": op x source matrix (NaN where the op does not see that source) or None,
        "op_labels", "column_labels"}."""

        def series(key: str) -> list[float]:
            sums, counts = self._rms_sum.get(key, {}), self._rms_count.get(key, {})
            return [(sums[i] / counts[i]).item() for i in sorted(sums)]

        weights, op_labels = None, []
        if self._w_sum:
            labels = self.column_labels()
            weights = [[float("nan")] * len(labels) for _ in sorted(self._w_sum)]
            for row, op in enumerate(sorted(self._w_sum)):
                for col, w in zip(self._w_cols[op], (self._w_sum[op] / self._w_count[op]).tolist()):
                    weights[row][col] = w
                op_labels.append(self.op_label(op))
        final = series("final_rms")
        out = {
            "name": getattr(self, "name", type(self).__name__),
            "n_forwards": max(self._rms_count.get("output_rms", {0: 0}).values(), default=0),
            "output_rms": series("output_rms"),
            "input_rms": series("input_rms"),
            "final_rms": final[0] if final else float("nan"),
            "depth_weights": weights,
            "op_labels": op_labels,
            "column_labels": self.column_labels() if weights is not None else [],
        }
        if reset:
            self.reset_diagnostics()
        return out


class StandardResidual(DepthRecorder, nn.Module):
    """h_{i+1} = h_i + f_i(h_i); the state is the running sum [B, T, D]."""

    name = "standard"

    def __init__(self):
        super().__init__()
        self.init_recorder()

    def begin(self, embedding: torch.Tensor) -> torch.Tensor:
        return embedding

    def read(self, state: torch.Tensor, sublayer: int) -> torch.Tensor:
        if self.record:
            self.record_rms("input_rms", sublayer, state)
        return state

    def write(self, state: torch.Tensor, sublayer: int, out: torch.Tensor) -> torch.Tensor:
        if self.record:
            self.record_rms("output_rms", sublayer, out)
        return state + out

    def end(self, state: torch.Tensor) -> torch.Tensor:
        if self.record:
            self.record_rms("final_rms", 0, state)
        return state


def build_residual(cfg: ResidualConfig, n_sublayers: int, d_model: int, eps: float,
                   two_phase: bool = False) -> nn.Module:
    """The residual seam for residual.name; two_phase (kernels.attnres_two_phase) goes to AttnResidual."""
    if cfg.name == "standard":
        return StandardResidual()
    from k3lab.model.attnres import AttnResidual

    return AttnResidual(cfg, n_sublayers, d_model, eps, two_phase)
