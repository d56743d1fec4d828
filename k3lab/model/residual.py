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

import math

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
    writes (`output_rms`), the RMS of what the final norm sees (`final_rms`) and, for AttnRes, per op the
    token means of its depth weights alpha_s, of each source's amplitude share alpha_s rms_s / sum_s'
    alpha_s' rms_s' (rms_s: the RMS of source s at that token), of the normalised entropy of the weights
    (-sum_s alpha_s log alpha_s / log S over its S sources: 1 for a uniform mix, 0 for one source) and of
    the largest weight max_s alpha_s. `diagnostics()` returns the means over the recorded forwards as
    plain Python numbers and clears them. RMS = sqrt(mean over batch, tokens and channels of x^2).
    """

    record: bool = False

    def init_recorder(self) -> None:
        self.record = False
        self.reset_diagnostics()

    def reset_diagnostics(self) -> None:
        self._rms_sum: dict[str, dict[int, torch.Tensor]] = {}
        self._rms_count: dict[str, dict[int, int]] = {}
        self._mix_sum: dict[int, dict[str, torch.Tensor]] = {}
        self._mix_cols: dict[int, list[int]] = {}
        self._mix_count: dict[int, int] = {}

    @torch.no_grad()
    def record_rms(self, key: str, i: int, x: torch.Tensor) -> None:
        rms = x.detach().float().square().mean().sqrt()
        sums, counts = self._rms_sum.setdefault(key, {}), self._rms_count.setdefault(key, {})
        sums[i] = sums[i] + rms if i in sums else rms
        counts[i] = counts.get(i, 0) + 1

    @torch.no_grad()
    def record_weights(self, op: int, cols: list[int], alpha: torch.Tensor, inv_rms: torch.Tensor) -> None:
        """alpha [S, B, T]: the depth weights of op `op` over the sources with column ids `cols`;
        inv_rms [S, B, T]: 1/rms of each source at each token (the values the op's logits use)."""
        alpha = alpha.detach().float().flatten(1)                    # [S, N tokens]
        amplitude = alpha / inv_rms.detach().float().flatten(1)      # alpha_s rms_s
        n_sources = alpha.shape[0]
        entropy = -torch.xlogy(alpha, alpha).sum(0) / math.log(n_sources) if n_sources > 1 else alpha[0] * math.nan
        stats = {"weight": alpha.mean(1), "share": (amplitude / amplitude.sum(0)).mean(1),
                 "entropy": entropy.mean(), "max_weight": alpha.max(0).values.mean()}
        sums = self._mix_sum.get(op)
        self._mix_sum[op] = stats if sums is None else {k: sums[k] + v for k, v in stats.items()}
        self._mix_cols[op] = cols
        self._mix_count[op] = self._mix_count.get(op, 0) + 1

    def column_labels(self) -> list[str]:
        return []

    def op_label(self, op: int) -> str:
        return sublayer_label(op)

    def query_norms(self) -> list[float]:
        """The L2 norm of each op's pseudo-query (AttnRes); none here."""
        return []

    def diagnostics(self, reset: bool = True) -> dict:
        """{"name", "n_forwards", "output_rms": [per sublayer], "input_rms": [...], "final_rms",
        "depth_weights" and "depth_shares": op x source matrices of the mean weight and amplitude share (NaN
        where the op does not see that source) or None, "entropy" and "max_weight": per op (entropy NaN for
        an op with one source), "query_norm": per op, "op_labels", "column_labels"}."""

        def series(key: str) -> list[float]:
            sums, counts = self._rms_sum.get(key, {}), self._rms_count.get(key, {})
            return [(sums[i] / counts[i]).item() for i in sorted(sums)]

        ops = sorted(self._mix_sum)
        labels = self.column_labels() if ops else []
        means = {op: {k: (v / self._mix_count[op]).tolist() for k, v in self._mix_sum[op].items()} for op in ops}

        def matrix(stat: str) -> list[list[float]] | None:
            if not ops:
                return None
            rows = [[math.nan] * len(labels) for _ in ops]
            for row, op in zip(rows, ops):
                for col, value in zip(self._mix_cols[op], means[op][stat]):
                    row[col] = value
            return rows

        final = series("final_rms")
        out = {
            "name": getattr(self, "name", type(self).__name__),
            "n_forwards": max(self._rms_count.get("output_rms", {0: 0}).values(), default=0),
            "output_rms": series("output_rms"),
            "input_rms": series("input_rms"),
            "final_rms": final[0] if final else math.nan,
            "depth_weights": matrix("weight"),
            "depth_shares": matrix("share"),
            "entropy": [means[op]["entropy"] for op in ops],
            "max_weight": [means[op]["max_weight"] for op in ops],
            "query_norm": self.query_norms() if ops else [],
            "op_labels": [self.op_label(op) for op in ops],
            "column_labels": labels,
        }
        if reset:
            self.reset_diagnostics()
        return out


SATURATED_WEIGHT = 0.99  # an op whose token-mean largest weight reaches this reads, in effect, one source
LOW_ENTROPY = 0.1        # ... or whose normalised entropy lies below this


def attnres_saturation(diag: dict) -> dict | None:
    """summary.json's `attnres_saturation`, from one validation's diagnostics (None without AttnRes ops).

    Over the ops that mix two or more sources: `ops` (how many), `saturated_ops` (token-mean largest weight
    >= SATURATED_WEIGHT), `low_entropy_ops` (normalised entropy < LOW_ENTROPY), `entropy_mean`,
    `entropy_min` (normalised entropy: 1 for the uniform mix of zero queries, 0 for one source) and
    `max_weight_mean`; `query_norm_max`, the largest pseudo-query norm of all ops; `step`, the validation's."""
    mixing = [op for op, entropy in enumerate(diag.get("entropy", [])) if not math.isnan(entropy)]
    if not mixing:
        return None
    entropy = [diag["entropy"][op] for op in mixing]
    max_weight = [diag["max_weight"][op] for op in mixing]
    return {"step": diag.get("step"), "ops": len(mixing),
            "saturated_ops": sum(w >= SATURATED_WEIGHT for w in max_weight),
            "low_entropy_ops": sum(h < LOW_ENTROPY for h in entropy),
            "entropy_mean": sum(entropy) / len(entropy), "entropy_min": min(entropy),
            "max_weight_mean": sum(max_weight) / len(max_weight), "query_norm_max": max(diag["query_norm"])}


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
