"""Chinchilla approach 2 (isoFLOP parabolas): per FLOP budget a parabola of L in log N; its vertex is
N_opt(C); then log N_opt = k + a log C and D_opt = C / (kappa N_opt)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from analysis._blas import single_thread_blas


def flop_budgets(c, tol_dex: float = 0.05) -> np.ndarray:
    """Group runs into FLOP budgets: sorted log10 C split wherever consecutive values differ by more
    than `tol_dex`; each group is labelled by its geometric mean. c: (k,) -> labels (k,)."""
    logc = np.log10(np.asarray(c, float))
    order = np.argsort(logc)
    labels = np.empty(len(logc))
    start = 0
    for j in range(1, len(order) + 1):
        if j == len(order) or logc[order[j]] - logc[order[j - 1]] > tol_dex:
            grp = order[start:j]
            labels[grp] = 10 ** logc[grp].mean()
            start = j
    return labels


@dataclass
class IsoFlopFit:
    """Approach 2. `parabolas`: one row per budget (C, n_runs, p2, p1, p0, N_opt, L_opt, valid, why).
    N_opt = k C^a, D_opt = k' C^b over the valid budgets."""
    parabolas: pd.DataFrame
    a: float
    log_k: float
    b: float
    log_kd: float
    boot: Optional[pd.DataFrame] = None  # bootstrap replicates of (a, b)

    def n_opt(self, c) -> np.ndarray:
        return np.exp(self.log_k + self.a * np.log(np.asarray(c, float)))

    def ci(self, level: float = 0.95) -> pd.DataFrame:
        if self.boot is None or self.boot.empty:  # no replicates (n_boot = 0): no interval
            return pd.DataFrame({"lo": np.nan, "hi": np.nan}, index=["a", "b"])
        q = (1 - level) / 2
        return pd.DataFrame({"lo": self.boot.quantile(q), "hi": self.boot.quantile(1 - q)})


def _parabolas(log_n, loss, budget) -> pd.DataFrame:
    rows = []
    for c in np.unique(budget):
        m = budget == c
        x, y = log_n[m], loss[m]
        row = {"C": c, "n_runs": int(m.sum()), "p2": np.nan, "p1": np.nan, "p0": np.nan,
               "N_opt": np.nan, "L_opt": np.nan, "valid": False, "why": ""}
        if len(np.unique(x)) < 3:
            row["why"] = "fewer than 3 sizes"
        else:
            p2, p1, p0 = np.polyfit(x, y, 2)
            row.update(p2=p2, p1=p1, p0=p0)
            if p2 <= 0:
                row["why"] = "not convex"
            else:
                xv = -p1 / (2 * p2)
                with np.errstate(over="ignore"):  # a far-away vertex is flagged below, not an error
                    row.update(N_opt=np.exp(xv), L_opt=p0 - p1 * p1 / (4 * p2))
                if xv < x.min() or xv > x.max():
                    row["why"] = "vertex outside the sampled sizes"
                else:
                    row["valid"] = True
        rows.append(row)
    return pd.DataFrame(rows)


def _powerlaw_from_parabolas(par: pd.DataFrame, kappa: float = 6.0) -> tuple[float, float, float, float]:
    v = par[par["valid"]]
    if len(v) < 2:
        raise ValueError(f"approach 2 needs >= 2 budgets with a valid parabola, got {len(v)}:\n"
                         f"{par[['C', 'n_runs', 'why']].to_string(index=False)}")
    lc, ln = np.log(v["C"].to_numpy()), np.log(v["N_opt"].to_numpy())
    a, log_k = np.polyfit(lc, ln, 1)
    b, log_kd = np.polyfit(lc, lc - np.log(kappa) - ln, 1)
    return a, log_k, b, log_kd


def fit_isoflop(n, c, loss, budget=None, tol_dex: float = 0.05, n_boot: int = 1000, seed: int = 0,
                kappa: float = 6.0) -> IsoFlopFit:
    """Approach 2: per budget a parabola L = p2 x^2 + p1 x + p0 in x = log N (>= 3 sizes, convex, vertex
    inside the sampled sizes), then log N_opt = log k + a log C by least squares over budgets; D_opt =
    C / (kappa N_opt). Bootstrap: runs resampled within each budget."""
    n, c, loss = (np.asarray(x, float) for x in (n, c, loss))
    budget = flop_budgets(c, tol_dex) if budget is None else np.asarray(budget, float)
    log_n = np.log(n)
    par = _parabolas(log_n, loss, budget)
    a, log_k, b, log_kd = _powerlaw_from_parabolas(par, kappa)
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(budget == cb) for cb in np.unique(budget)]
    boots = []
    with single_thread_blas():
        for _ in range(n_boot):
            idx = np.concatenate([rng.choice(g, len(g)) for g in groups])
            try:
                ab = _powerlaw_from_parabolas(_parabolas(log_n[idx], loss[idx], budget[idx]), kappa)
            except ValueError:
                continue
            boots.append((ab[0], ab[2]))
    boot = pd.DataFrame(boots, columns=["a", "b"])
    return IsoFlopFit(parabolas=par, a=float(a), log_k=float(log_k), b=float(b), log_kd=float(log_kd), boot=boot)
