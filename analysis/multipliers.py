"""Compute multipliers between variants, from their L(C) curves (analysis.power_law).

The compute multiplier of a variant against the baseline is how much more compute the baseline needs for
the variant's loss: separately fitted curves give C_base(L_var(C)) / C at each budget C; with L_inf and
alpha shared the multiplier is budget-invariant, (A_base / A_var)^(1/alpha).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd

from analysis._blas import single_thread_blas
from analysis.power_law import PowerLawFit, SharedPowerLawFit, fit_loss_vs_compute, fit_loss_vs_compute_shared


def compute_multiplier_separate(base: PowerLawFit, var: PowerLawFit, budgets) -> np.ndarray:
    """C_base(L_var(C)) / C at each budget C: >1 means the variant reaches the loss with less compute.
    inf where the variant's loss is below the baseline's asymptote."""
    budgets = np.asarray(budgets, float)
    return base.compute_for_loss(var.predict(budgets)) / budgets


def compute_multiplier_shared(fit: SharedPowerLawFit, baseline, variant) -> float:
    """Budget-invariant multiplier (A_base / A_var)^(1/alpha) under shared L_inf and alpha."""
    return float((fit.A[baseline] / fit.A[variant]) ** (1.0 / fit.alpha))


def compute_multipliers(df: pd.DataFrame, baseline, variant_col: str = "variant", c_col: str = "C",
                        loss_col: str = "loss", budgets: Optional[Sequence[float]] = None, n_boot: int = 500,
                        seed: int = 0, level: float = 0.95, progress: bool = False) -> pd.DataFrame:
    """Compute multiplier of every variant against `baseline`, with bootstrap percentile intervals
    (runs resampled within each variant, all curves refitted per replicate).

    Returns one row per (variant, kind, C): kind 'shared' (C = NaN) or 'separate' at each budget;
    columns multiplier, lo, hi, n_boot_ok. Budgets default to 3 log-spaced points over the
    baseline's compute range."""
    from rich.progress import track

    groups = {v: g for v, g in df.groupby(variant_col, sort=False)}
    if baseline not in groups:
        raise ValueError(f"baseline variant {baseline!r} not among {sorted(map(str, groups))}")
    variants = [v for v in groups if v != baseline]
    if not variants:
        raise ValueError("compute multipliers need at least one variant besides the baseline")
    cb = groups[baseline][c_col].to_numpy(float)
    budgets = np.geomspace(cb.min(), cb.max(), 3) if budgets is None else np.asarray(budgets, float)

    def estimate(gs: dict, start: Optional[dict] = None) -> tuple[dict, dict]:
        data = {v: (g[c_col].to_numpy(float), g[loss_col].to_numpy(float)) for v, g in gs.items()}
        st = start or {}
        sep = {v: fit_loss_vs_compute(*data[v], c0=c0[v], init=st.get(v)) for v in data}
        shared = fit_loss_vs_compute_shared(data, c0=c0["shared"], init=st.get("shared"))
        out = {}
        for v in variants:
            out[(v, "shared", np.nan)] = compute_multiplier_shared(shared, baseline, v)
            for c, m in zip(budgets, compute_multiplier_separate(sep[baseline], sep[v], budgets)):
                out[(v, "separate", c)] = m
        inits = {v: [f.L_inf, f.alpha, np.log(f.A)] for v, f in sep.items()}
        inits["shared"] = [shared.L_inf, shared.alpha] + [np.log(shared.A[v]) for v in data]
        return out, inits

    c0 = {v: float(np.exp(np.log(g[c_col].to_numpy(float)).mean())) for v, g in groups.items()}
    c0["shared"] = float(np.exp(np.log(df[c_col].to_numpy(float)).mean()))
    rng = np.random.default_rng(seed)
    reps = []
    with single_thread_blas():
        point, inits = estimate(groups)
        for _ in track(range(n_boot), description="bootstrap (compute multipliers)", disable=not progress,
                       transient=True):
            gs = {v: g.iloc[rng.integers(0, len(g), len(g))] for v, g in groups.items()}
            try:
                reps.append(estimate(gs, inits)[0])
            except ValueError:
                continue
    q = (1 - level) / 2
    rows = []
    for key, m in point.items():
        vals = np.array([r[key] for r in reps if np.isfinite(r[key])])
        rows.append({"variant": key[0], "kind": key[1], "C": key[2], "multiplier": m,
                     "lo": np.quantile(vals, q) if len(vals) else np.nan,
                     "hi": np.quantile(vals, 1 - q) if len(vals) else np.nan,
                     "n_boot_ok": len(vals), "n_boot": n_boot})
    return pd.DataFrame(rows)
