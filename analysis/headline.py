"""The headline: one row per switch option, what it is worth.

    the delta       at the largest model size whose delta has an interval, with its CI and verdict
    per size        the compute multiplier at every size of the option's ladder, with seed intervals, and
                    the trend over sizes (analysis.multipliers)
    the fit         the shared-fit multiplier, shown only where that fit is adequate against seed noise
    throughput      the tokens/s ratio of runs each alone on its device, beside their utilisation (MFU)
    wall clock      the time to the same loss, base over option, only at a utilisation of MIN_MFU or more

The wall-clock multiplier: with T = C / (FLOPs per second), T_base / T_var = (C_base / C_var) x (F_var /
F_base) = compute multiplier x tokens/s ratio x FLOPs-per-token ratio (> 1: the option gets there sooner).
The compute multiplier is the fit's where the fit is adequate, else the per-size one at the size where the
throughput was measured. Its interval is the multiplier's times the throughput ratio taken as measured.

MIN_MFU = 0.2. Below it a step's time is mostly kernel launches, small kernels and host work that do not
grow with the model (the first study's depth-4 runs: 2.2-3.3% MFU), so a tokens/s ratio measured there
says little about the time to a loss at the scale a study's conclusion is for; 20% is within reach of a
model that fills the device (the K3 default trains at 25.5% MFU on one H200, benchmarks/RESULTS.md).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from analysis.multipliers import Multipliers
from analysis.tables import fmt, ratio_text

MIN_MFU = 0.2

HEADLINE_COLUMNS = ["switch", "option", "N", "tokens", "n", "delta", "delta_lo", "delta_hi", "verdict", "family",
                    "per_size", "trend", "trend_lo", "trend_hi", "trend_verdict", "fit_multiplier", "fit_lo", "fit_hi",
                    "fit_verdict", "fit_p", "tokens_per_s_rel", "tokens_per_s_lo", "tokens_per_s_hi",
                    "tokens_per_s_note", "mfu", "flops_rel", "flop_s_rel", "wall_clock",
                    "wall_clock_lo", "wall_clock_hi", "wall_clock_note"]


def per_size_text(rows: pd.DataFrame) -> str:
    """'6.59M: 1.03 [0.86, 1.21]; 18.6M: 2.52 [1.78, 4.61]*' (* extrapolated beyond the baseline's points)."""
    def one(r):
        ci = f" [{r['lo']:.3g}, {r['hi']:.3g}]" if np.isfinite(r["lo"]) else ""
        return f"{r['N'] / 1e6:.3g}M: {r['multiplier']:.3g}{ci}" + ("*" if r["extrapolated"] else "")
    return "; ".join(one(r) for _, r in rows.sort_values("C").iterrows())


def headline(table: pd.DataFrame, multipliers: Optional[Multipliers] = None, speed: Optional[pd.DataFrame] = None,
             min_mfu: float = MIN_MFU) -> pd.DataFrame:
    """One row per (switch, option) of the ablation table (analysis.ablate), with the multipliers of the
    variant 'switch=option' from `multipliers` (analysis.multipliers.compute_multipliers) where it has a
    ladder point.

    The delta: the table's row at the largest model size whose delta has an interval (the baseline row's N;
    ties: the most tokens, then the most seeds), or the largest size where none has one. The throughput:
    the variant's tokens/s over the baseline's in the same runs, or, where those shared their device
    (device_shared), in the longest cell of the same size whose runs did not, from `speed` (the ablation
    table of timing runs, each option alone) when given, else from `table`; `mfu` the lower of the two
    sides' median MFU in those runs. The module docstring says how the rest is made."""
    rows = []
    t = table[table["test"] != "baseline"]
    for (s, o), g in t.groupby(["switch", "option"], sort=False):
        size = (g["N"] / g["N_rel"]).where(g["N_rel"].notna(), g["N"])
        g = g.assign(_size=size.fillna(0), _tokens=g["tokens"] if "tokens" in g else 0,
                     _ci=np.isfinite(g["delta_lo"].astype(float)))
        r = g.sort_values(["_ci", "_size", "_tokens", "n"], ascending=False, kind="stable").iloc[0]
        speed_row = r
        if pd.isna(r["tokens_per_s_rel"]):  # e.g. the study's runs shared the GPU: a cell of the same size timed alone
            timed = g if speed is None else speed[(speed["switch"] == s) & (speed["option"] == o)]
            size = (timed["N"] / timed["N_rel"]).where(timed["N_rel"].notna(), timed["N"])
            alone = timed[np.isclose(size, r["_size"]) & timed["tokens_per_s_rel"].notna()]
            by = [c for c in ("tokens", "n") if c in alone]
            speed_row = alone.sort_values(by, ascending=False, kind="stable").iloc[0] if len(alone) else None
        tokens_per_s_rel, tokens_per_s_lo, tokens_per_s_hi = (
            (speed_row["tokens_per_s_rel"], speed_row["tokens_per_s_lo"], speed_row["tokens_per_s_hi"])
            if speed_row is not None else (np.nan, np.nan, np.nan))
        shared = "; ".join(w for w in str(r.get("warnings", "")).split("; ") if w.startswith("no throughput ratio"))
        mfu = speed_row["mfu"] if speed_row is not None else np.nan
        row = {"switch": s, "option": o, "N": r["_size"], "tokens": r["_tokens"], "n": r["n"], "delta": r["delta"],
               "delta_lo": r["delta_lo"], "delta_hi": r["delta_hi"], "verdict": r["verdict"],
               "family": r.get("family", "all"), "tokens_per_s_rel": tokens_per_s_rel,
               "tokens_per_s_lo": tokens_per_s_lo, "tokens_per_s_hi": tokens_per_s_hi,
               "tokens_per_s_note": "" if speed_row is not None else shared, "mfu": mfu,
               "flops_rel": r["flops_rel"], "flop_s_rel": tokens_per_s_rel * r["flops_rel"]}
        row.update(_multipliers(f"{s}={o}", multipliers, r["_size"]))
        row.update(_wall_clock(row, min_mfu))
        rows.append(row)
    return pd.DataFrame(rows, columns=HEADLINE_COLUMNS)


def _multipliers(variant: str, mult: Optional[Multipliers], size: float) -> dict:
    """The variant's per-size multipliers (text), trend and fit, and the compute multiplier for the wall clock
    (`_base`, `_base_lo`, `_base_hi`: the adequate fit's, else the per-size one at `size`)."""
    out = {"per_size": "", "trend": np.nan, "trend_lo": np.nan, "trend_hi": np.nan, "trend_verdict": "",
           "fit_multiplier": np.nan, "fit_lo": np.nan, "fit_hi": np.nan, "fit_verdict": "", "fit_p": np.nan,
           "_base": np.nan, "_base_lo": np.nan, "_base_hi": np.nan, "_base_from": ""}
    if mult is None:
        return out
    sizes = mult.per_size[mult.per_size["variant"] == variant]
    out["per_size"] = per_size_text(sizes)
    trend = mult.trends[mult.trends["variant"] == variant]
    if len(trend):
        tr = trend.iloc[0]
        out.update(trend=tr["slope"], trend_lo=tr["lo"], trend_hi=tr["hi"], trend_verdict=tr["verdict"])
    fit = mult.fits[(mult.fits["variant"] == variant) & (mult.fits["kind"] == "shared")]
    if len(fit):
        f = fit.iloc[0]
        out.update(fit_verdict=f["verdict"], fit_p=f["p"])
        if f["verdict"] == "adequate":
            out.update(fit_multiplier=f["multiplier"], fit_lo=f["lo"], fit_hi=f["hi"])
            out.update(_base=f["multiplier"], _base_lo=f["lo"], _base_hi=f["hi"], _base_from="the fit")
            return out
    here = sizes[np.isclose(sizes["N"].astype(float), size, rtol=0.01)]
    if len(here):
        h = here.iloc[0]
        out.update(_base=h["multiplier"], _base_lo=h["lo"], _base_hi=h["hi"], _base_from=f"N={size:.3g}")
    return out


def _wall_clock(row: dict, min_mfu: float) -> dict:
    """wall_clock [lo, hi] and, where there is none, the reason (module docstring)."""
    none = {"wall_clock": np.nan, "wall_clock_lo": np.nan, "wall_clock_hi": np.nan}
    base, flop_s, mfu = row.pop("_base"), row["flop_s_rel"], row["mfu"]
    lo, hi, source = row.pop("_base_lo"), row.pop("_base_hi"), row.pop("_base_from")
    if not np.isfinite(flop_s):
        return {**none, "wall_clock_note": "no throughput ratio from runs alone on their device"}
    if not np.isfinite(mfu):
        return {**none, "wall_clock_note": "utilisation not logged (speed/mfu): no wall-clock multiplier"}
    if mfu < min_mfu:
        return {**none, "wall_clock_note": f"utilisation {100 * mfu:.1f}% < {100 * min_mfu:g}%: the tokens/s ratio "
                                           "does not transfer, no wall-clock multiplier"}
    if not np.isfinite(base):
        return {**none, "wall_clock_note": "no compute multiplier at the size of the throughput"}
    return {"wall_clock": base * flop_s, "wall_clock_lo": lo * flop_s, "wall_clock_hi": hi * flop_s,
            "wall_clock_note": f"compute multiplier from {source}"}


def display_headline(h: pd.DataFrame) -> pd.DataFrame:
    """The headline with intervals merged into strings."""
    def ci(v, lo, hi, sign=False):
        if not np.isfinite(v):
            return "—"
        f = (lambda x: f"{x:+.4f}") if sign else (lambda x: f"{x:.3g}")
        return f(v) + (f" [{f(lo)}, {f(hi)}]" if np.isfinite(lo) else "")

    def fit(v, lo, hi, verdict, p):
        if verdict == "adequate":
            return f"{ci(v, lo, hi)} (adequate, p {fmt(p, 2)})"
        return {"inadequate": f"— (inadequate, p {fmt(p, 2)})", "not tested": "— (not tested)"}.get(verdict, "—")

    return pd.DataFrame({
        "switch": h["switch"], "option": h["option"], "N (delta)": h["N"], "n": h["n"],
        "delta [95% CI]": [ci(*x, sign=True) for x in zip(h["delta"], h["delta_lo"], h["delta_hi"])],
        "verdict": h["verdict"],
        "compute multiplier per size [95% CI]": [v or "—" for v in h["per_size"]],
        "trend: slope of log multiplier on log C [95% CI]": [
            f"{ci(*x, sign=True)}, {v}" if v else "—"
            for *x, v in zip(h["trend"], h["trend_lo"], h["trend_hi"], h["trend_verdict"])],
        "fitted multiplier [95% CI]": [fit(*x) for x in zip(h["fit_multiplier"], h["fit_lo"], h["fit_hi"],
                                                                h["fit_verdict"], h["fit_p"])],
        "tokens/s ratio [seed range]": [ratio_text(*x) if np.isfinite(x[0]) else f"— ({note})" if note else ""
                                        for *x, note in zip(h["tokens_per_s_rel"], h["tokens_per_s_lo"],
                                                            h["tokens_per_s_hi"], h["tokens_per_s_note"])],
        "MFU": [f"{100 * v:.1f}%" if np.isfinite(v) else "" for v in h["mfu"].astype(float)],
        "FLOPs/token ratio": [ratio_text(v) for v in h["flops_rel"]],
        "wall-clock multiplier [95% CI]": [ci(*x) if np.isfinite(x[0]) else f"— ({note})" for *x, note in zip(
            h["wall_clock"], h["wall_clock_lo"], h["wall_clock_hi"], h["wall_clock_note"])],
    })
