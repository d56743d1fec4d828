"""The headline: one row per switch option, what it is worth (the delta at the largest size, the compute
multiplier from the ladder, the throughput ratio and the wall-clock multiplier)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from analysis.tables import ratio_text


HEADLINE_COLUMNS = ["switch", "option", "N", "tokens", "n", "delta", "delta_lo", "delta_hi", "verdict", "multiplier",
                    "multiplier_lo", "multiplier_hi", "tokens_per_s_rel", "flops_rel", "flop_s_rel", "wall_clock",
                    "wall_clock_lo", "wall_clock_hi"]


def headline(table: pd.DataFrame, multipliers: Optional[pd.DataFrame] = None,
             speed: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """One row per (switch, option): what the option is worth.

    delta [CI] and verdict: the table's row at the largest model size whose delta has an interval (the
    baseline row's N; ties: the most tokens, then the most seeds), or the largest size where none has
    one (a ladder of one seed per size above the size that has the seeds). multiplier [CI]: the
    shared-exponent compute multiplier of the variant 'switch=option' against the baseline from
    `multipliers` (analysis.scaling.compute_multipliers; NaN without a ladder per variant); > 1: the
    baseline needs that many times the FLOPs for the variant's loss. tokens_per_s_rel: the variant's throughput over the baseline's in the same runs as the delta, or,
    where those shared their GPU with other runs (device_shared), in the longest cell of the same size
    whose runs did not, from `speed` (the ablation table of timing runs, each option alone) when given,
    else from `table`;
    flop_s_rel = tokens_per_s_rel x flops_rel, the ratio of FLOPs per second. wall_clock = multiplier x
    flop_s_rel: T_base / T_var for the same loss, with T = C / (FLOPs per second), so > 1 means the variant
    reaches the loss sooner; its interval is the multiplier's interval times flop_s_rel (the throughput
    ratio taken as measured)."""
    rows = []
    t = table[table["test"] != "baseline"]
    for (s, o), g in t.groupby(["switch", "option"], sort=False):
        size = (g["N"] / g["N_rel"]).where(g["N_rel"].notna(), g["N"])
        g = g.assign(_size=size.fillna(0), _tokens=g["tokens"] if "tokens" in g else 0,
                     _ci=np.isfinite(g["delta_lo"].astype(float)))
        r = g.sort_values(["_ci", "_size", "_tokens", "n"], ascending=False, kind="stable").iloc[0]
        tokens_per_s_rel = r["tokens_per_s_rel"]
        if pd.isna(tokens_per_s_rel):  # e.g. the study's runs shared the GPU: a cell of the same size timed alone
            timed = g if speed is None else speed[(speed["switch"] == s) & (speed["option"] == o)]
            size = (timed["N"] / timed["N_rel"]).where(timed["N_rel"].notna(), timed["N"])
            alone = timed[np.isclose(size, r["_size"]) & timed["tokens_per_s_rel"].notna()]
            by = [c for c in ("tokens", "n") if c in alone]
            tokens_per_s_rel = alone.sort_values(by, ascending=False, kind="stable")["tokens_per_s_rel"].iloc[0] \
                if len(alone) else np.nan
        m = pd.DataFrame() if multipliers is None else multipliers[
            (multipliers["variant"] == f"{s}={o}") & (multipliers["kind"] == "shared")]
        mult, lo, hi = (m.iloc[0][["multiplier", "lo", "hi"]].astype(float) if len(m) else (np.nan,) * 3)
        flop_s = tokens_per_s_rel * r["flops_rel"]
        rows.append({"switch": s, "option": o, "N": r["_size"], "tokens": r["_tokens"], "n": r["n"],
                     "delta": r["delta"], "delta_lo": r["delta_lo"], "delta_hi": r["delta_hi"], "verdict": r["verdict"],
                     "multiplier": mult, "multiplier_lo": lo, "multiplier_hi": hi,
                     "tokens_per_s_rel": tokens_per_s_rel, "flops_rel": r["flops_rel"], "flop_s_rel": flop_s,
                     "wall_clock": mult * flop_s, "wall_clock_lo": lo * flop_s, "wall_clock_hi": hi * flop_s})
    return pd.DataFrame(rows, columns=HEADLINE_COLUMNS)


def display_headline(h: pd.DataFrame) -> pd.DataFrame:
    """The headline with intervals merged into strings."""
    def ci(v, lo, hi, sign=False):
        if not np.isfinite(v):
            return "—"
        f = (lambda x: f"{x:+.4f}") if sign else (lambda x: f"{x:.3g}")
        return f(v) + (f" [{f(lo)}, {f(hi)}]" if np.isfinite(lo) else "")

    return pd.DataFrame({
        "switch": h["switch"], "option": h["option"], "N (largest)": h["N"], "n": h["n"],
        "delta [95% CI]": [ci(*x, sign=True) for x in zip(h["delta"], h["delta_lo"], h["delta_hi"])],
        "verdict": h["verdict"],
        "compute multiplier [95% CI]": [ci(*x) for x in zip(h["multiplier"], h["multiplier_lo"], h["multiplier_hi"])],
        "tokens/s ratio": [ratio_text(v) for v in h["tokens_per_s_rel"]],
        "FLOPs/token ratio": [ratio_text(v) for v in h["flops_rel"]],
        "wall-clock multiplier [95% CI]": [ci(*x) for x in zip(h["wall_clock"], h["wall_clock_lo"], h["wall_clock_hi"])],
    })
