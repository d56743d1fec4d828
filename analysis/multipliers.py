"""Compute multipliers between variants, size by size and from a shared fit, with intervals from seed noise.

The compute multiplier of a variant at a point of compute C with mean loss L is how much more compute the
baseline needs to reach L: m = C_base(L) / C (> 1: the variant is better).

Per size (the primary estimate). C_base(L) is read off the baseline's own points, interpolated linearly in
log C against log L (exact for a pure power law L = A C^-alpha, and close between nearby points of a curve
with a floor); beyond the baseline's points the end segment is extended and the row says so
(`extrapolated`). The baseline's points are made decreasing in C first where noise makes them rise
(isotonic regression weighted by seeds, scipy.optimize.isotonic_regression).

The trend. The slope of log m against log C over a variant's sizes (least squares): > 0 the multiplier
grows with scale, < 0 it shrinks; a crossover is where it passes 1 between two consecutive sizes.

The fit (where it fits). L_inf and alpha shared by the baseline and the variant, one A each
(analysis.power_law.fit_loss_vs_compute_shared, weighted by seeds): m = (A_base / A_var)^(1/alpha) at every
C. It is tested against the seed noise (analysis.noise.adequacy), as is each variant's own L(C); a single
fitted multiplier means something only where its fit is adequate.

Intervals (all of them) from seed noise, never from dropping points: a parametric bootstrap in which every
point keeps its place and gets, per replicate, its mean moved by sd_b z / sqrt(n) (z standard normal, n its
seeds, sd_b a draw of the seed noise with its own estimation uncertainty, analysis.noise.SeedNoise.draw).
Per size the replicates move the observed means (there is no model to refit); for the fit they move the
fitted values and the fit is redone (analysis.power_law.refit_shared). Percentile intervals. Resampling the
seeds of a point instead would give its mean (n-1)/n of its variance from at most a handful of distinct
resamples at three seeds, and nothing at one. Cooldown branches of one trunk share their prefix: their
means move together, with the correlation measured from the seeds (analysis.noise.trunk_correlation,
replicate_means), and the fit tests use that covariance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd
from scipy.optimize import isotonic_regression

from analysis.noise import (SeedNoise, TrunkCorrelation, adequacy, mean_covariance, points_table, pooled_noise,
                            replicate_means, trunk_correlation)
from analysis.power_law import fit_loss_vs_compute, fit_loss_vs_compute_shared, pareto_frontier, refit_shared

TABLE_COLUMNS = ["variant", "N", "D", "C", "n", "loss", "multiplier", "lo", "hi", "method", "adequate",
                 "extrapolated", "chi2", "dof", "p_fit", "n_boot_ok"]


# --------------------------------------------------------------------------------------------------
# Per size
# --------------------------------------------------------------------------------------------------

def decreasing(log_l: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each row of log_l (B, K), points in increasing C, made non-increasing where it is not (weighted
    isotonic regression); rows already decreasing are returned as they are."""
    out = np.array(log_l, float)
    for i in np.flatnonzero((np.diff(out, axis=1) > 0).any(1)):
        out[i] = isotonic_regression(out[i], weights=weights, increasing=False).x
    return out


def log_compute_for_loss(log_c: np.ndarray, log_l: np.ndarray, target: np.ndarray) -> np.ndarray:
    """log C at which the baseline reaches each target log loss: log_c (K,) increasing; log_l (B, K)
    non-increasing; target (B, J). Linear in (log L, log C) between the two points around the target,
    and along the end segment beyond them; NaN on a flat segment."""
    k = log_l.shape[1]
    below = (log_l[:, None, :] > target[..., None]).sum(-1)  # points still above the target loss
    j = np.clip(below, 1, k - 1)  # the segment (j - 1, j), end segments extended
    y0 = np.take_along_axis(log_l, j - 1, 1)
    y1 = np.take_along_axis(log_l, j, 1)
    x0, x1 = log_c[j - 1], log_c[j]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(y1 != y0, x0 + (target - y0) * (x1 - x0) / (y1 - y0), np.nan)


def per_size(base: pd.DataFrame, var: pd.DataFrame, noise: SeedNoise, n_boot: int = 1000,
             rng: Optional[np.random.Generator] = None, level: float = 0.95,
             rho: float = 0.0) -> tuple[pd.DataFrame, np.ndarray]:
    """The variant's multiplier at each of its points against the baseline's interpolated points, with
    intervals from seed noise. base, var: points (C, loss, n, trunks) of one variant each
    (analysis.noise.points_table); rho: the correlation of branch points of one trunk (TrunkCorrelation.used).
    Returns (var's rows in increasing C with multiplier, lo, hi, extrapolated, crossover; the replicates of
    log m, (n_boot, J), NaN where undefined)."""
    rng = np.random.default_rng(0) if rng is None else rng
    base, var = base.sort_values("C"), var.sort_values("C").reset_index(drop=True)
    if len(base) < 2:
        raise ValueError(f"the baseline has {len(base)} point(s); interpolating its L(C) needs two sizes")
    log_cb, nb = np.log(base["C"].to_numpy(float)), base["n"].to_numpy(float)
    lb, lv = base["loss"].to_numpy(float), var["loss"].to_numpy(float)
    log_cv = np.log(var["C"].to_numpy(float))

    def log_m(b_loss, v_loss):
        return log_compute_for_loss(log_cb, decreasing(np.log(b_loss), nb), np.log(v_loss)) - log_cv

    point = log_m(lb[None], lv[None])[0]
    if noise.known and n_boot:
        reps = log_m(replicate_means(base, noise, rho, n_boot, rng), replicate_means(var, noise, rho, n_boot, rng))
    else:
        reps = np.full((0, len(var)), np.nan)
    q = (1 - level) / 2
    with np.errstate(over="ignore"):  # a replicate far beyond the baseline's points: an infinite multiplier
        out = var.assign(multiplier=np.exp(point), lo=_quantile(np.exp(reps), q), hi=_quantile(np.exp(reps), 1 - q),
                         n_boot_ok=np.isfinite(reps).sum(0))
    lmin, lmax = lb.min(), lb.max()
    out["extrapolated"] = np.where(lv < lmin, "beyond the baseline's largest point",
                                   np.where(lv > lmax, "before the baseline's smallest point", ""))
    sign = np.sign(point)
    out["crossover"] = [""] + [f"crosses 1 from N={out['N'].iloc[i - 1]:.3g}" if sign[i] * sign[i - 1] < 0 else ""
                               for i in range(1, len(out))]
    return out, reps


def _quantile(x: np.ndarray, q: float) -> np.ndarray:
    """Column quantiles over the finite values (NaN for a column with none)."""
    out = np.full(x.shape[1], np.nan)
    for j in range(x.shape[1]):
        v = x[np.isfinite(x[:, j]), j]
        if len(v):
            out[j] = np.quantile(v, q)
    return out


def trend(rows: pd.DataFrame, reps: np.ndarray, level: float = 0.95) -> dict:
    """The slope of log m against log C over a variant's sizes (least squares) with its percentile interval
    over the replicates of per_size, its verdict, the crossovers, and how many of the sizes are extrapolated
    (their chord errors enter the slope). rows, reps: per_size's output."""
    x = np.log(rows["C"].to_numpy(float))
    x = x - x.mean()
    slope = float(np.dot(x, np.log(rows["multiplier"].to_numpy(float))) / np.dot(x, x))
    fine = np.isfinite(reps).all(1)
    draws = reps[fine] @ x / np.dot(x, x)
    q = (1 - level) / 2
    lo, hi = (np.quantile(draws, [q, 1 - q]) if len(draws) else (np.nan, np.nan))
    verdict = ("no interval" if not np.isfinite(lo) else "grows with scale" if lo > 0 else
               "shrinks with scale" if hi < 0 else "no trend detected")
    crossings = [c for c in rows["crossover"] if c]
    return {"sizes": len(rows), "extrapolated": int(rows["extrapolated"].astype(bool).sum()), "slope": slope,
            "lo": float(lo), "hi": float(hi), "verdict": verdict,
            "crossovers": "; ".join(f"{c} to N={n:.3g}" for c, n in zip(rows["crossover"], rows["N"]) if c)
            if crossings else "none", "n_boot_ok": int(fine.sum())}


# --------------------------------------------------------------------------------------------------
# The analysis of a ladder
# --------------------------------------------------------------------------------------------------

@dataclass
class Multipliers:
    """Every compute multiplier of a ladder against its baseline, and the fits behind the fitted ones.

    points: one row per point (analysis.noise.points_table) with `used` (on the variant's frontier when the
    points are selected so); noise: the seed noise of every interval; correlation: that of the branch
    points of one trunk (analysis.noise.trunk_correlation); per_size: one row per variant point
    (per_size); trends: one row per variant with >= 2 sizes (trend); fits: every L(C) fit with its adequacy
    (kind 'own' per variant, 'shared' per baseline-variant pair); curves: the variants' own fits."""
    baseline: str
    points: pd.DataFrame
    noise: SeedNoise
    correlation: TrunkCorrelation
    per_size: pd.DataFrame
    trends: pd.DataFrame
    fits: pd.DataFrame
    curves: dict

    def table(self) -> pd.DataFrame:
        """multipliers.csv: one row per variant and size (method per_size) and one per variant for the
        shared fit (method fit, adequate true/false)."""
        sizes = self.per_size.assign(method="per_size", adequate="", chi2=np.nan, dof=np.nan, p_fit=np.nan)
        shared = self.fits[self.fits["kind"] == "shared"]
        fit = shared.assign(method="fit", N=np.nan, D=np.nan, C=np.nan, n=np.nan, loss=np.nan, extrapolated="",
                            adequate=shared["verdict"] == "adequate", p_fit=shared["p"])
        return pd.concat([sizes, fit], ignore_index=True)[TABLE_COLUMNS]


FIT_COLUMNS = ["kind", "variant", "points", "L_inf", "alpha", "A", "C0", "multiplier", "lo", "hi", "n_boot_ok",
               "chi2", "dof", "p", "verdict"]


def compute_multipliers(df: pd.DataFrame, baseline: str = "baseline", variant_col: str = "variant",
                        seed_col: str = "seed", noise: Optional[SeedNoise] = None, select: str = "all",
                        n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> Multipliers:
    """Per-size multipliers, trends and shared-fit multipliers of every variant against `baseline`.

    df: a scaling table (N, D, C, loss, a variant column and, for seeds, a seed column); noise: the seed
    noise (default: pooled over the points with >= 2 seeds, analysis.noise.pooled_noise); select: 'all'
    points, or each variant's compute-efficient 'frontier'. A variant's own L(C) needs 4 points, the shared
    fit 2 of the baseline and 2 of the variant (5 in all, one degree of freedom for its test)."""
    points = points_table(df, variant_col, seed_col)
    if baseline not in set(points["variant"]):
        raise ValueError(f"baseline variant {baseline!r} is not among the variants "
                         f"({', '.join(sorted(map(str, set(points['variant']))))})")
    points["used"] = True
    if select == "frontier":
        for v, g in points.groupby("variant", sort=False):
            points.loc[g.index, "used"] = pareto_frontier(g["C"], g["loss"])
    noise = pooled_noise(points) if noise is None else noise
    corr = trunk_correlation(df, variant_col, seed_col)
    rho = corr.used
    rng = np.random.default_rng(seed)
    used = points[points["used"]]
    groups = {v: g.sort_values("C") for v, g in used.groupby("variant", sort=False)}
    base = groups[baseline]
    sizes, trends, fits, curves = [], [], [], {}
    for v, g in groups.items():
        if len(g) >= 4:
            curves[v] = fit = fit_loss_vs_compute(g["C"], g["loss"], g["n"])
            a = adequacy(g["loss"] - fit.predict(g["C"]), g["n"], noise, 3, mean_covariance(g, rho))
            fits.append({"kind": "own", "variant": v, "points": len(g), "L_inf": fit.L_inf, "alpha": fit.alpha,
                         "A": fit.A, "C0": fit.C0, "chi2": a.chi2, "dof": a.dof, "p": a.p, "verdict": a.verdict})
        if v == baseline or len(base) < 2:
            continue
        rows, reps = per_size(base, g, noise, n_boot, rng, level, rho)
        sizes.append(rows)
        if len(rows) >= 2:
            trends.append({"variant": v, **trend(rows, reps, level)})
        if len(g) >= 2 and len(base) + len(g) >= 5:
            fits.append(shared_fit(base, g, baseline, v, noise, n_boot, rng, level, rho))
    per_size_rows = (pd.concat(sizes, ignore_index=True) if sizes else pd.DataFrame(columns=[*points.columns,
                     "multiplier", "lo", "hi", "n_boot_ok", "extrapolated", "crossover"]))
    return Multipliers(baseline=baseline, points=points, noise=noise, correlation=corr, per_size=per_size_rows,
                       trends=pd.DataFrame(trends, columns=["variant", "sizes", "extrapolated", "slope", "lo", "hi",
                                                            "verdict", "crossovers", "n_boot_ok"]),
                       fits=pd.DataFrame(fits, columns=FIT_COLUMNS), curves=curves)


def shared_fit(base: pd.DataFrame, var: pd.DataFrame, baseline: str, variant: str, noise: SeedNoise, n_boot: int,
               rng: np.random.Generator, level: float, rho: float = 0.0) -> dict:
    """The baseline-variant shared fit, its adequacy and its multiplier with a seed-noise interval: one row
    of Multipliers.fits. base, var: points (C, loss, n, trunks) of the baseline and of the variant; rho: the
    correlation of branch points of one trunk."""
    data = {k: (g["C"].to_numpy(float), g["loss"].to_numpy(float), g["n"].to_numpy(float))
            for k, g in ((baseline, base), (variant, var))}
    fit = fit_loss_vs_compute_shared(data)
    both = pd.concat([base, var], ignore_index=True)
    predicted = np.concatenate([fit.curve(k).predict(d[0]) for k, d in data.items()])
    a = adequacy(both["loss"].to_numpy(float) - predicted, both["n"], noise, fit.n_params,
                 mean_covariance(both, rho))
    mult = (fit.A[baseline] / fit.A[variant]) ** (1 / fit.alpha)
    lo = hi = np.nan
    ok = 0
    if noise.known and n_boot:
        reps = replicate_means(both, noise, rho, n_boot, rng, center=predicted)
        losses = {baseline: reps[:, :len(base)], variant: reps[:, len(base):]}
        theta, good = refit_shared(fit, data, losses)
        m = np.exp((theta[good, 2] - theta[good, 3]) / theta[good, 1])
        q = (1 - level) / 2
        lo, hi = np.quantile(m, [q, 1 - q]) if len(m) else (np.nan, np.nan)
        ok = int(good.sum())
    return {"kind": "shared", "variant": variant, "points": len(base) + len(var), "L_inf": fit.L_inf,
            "alpha": fit.alpha, "A": fit.A[variant], "C0": fit.C0, "multiplier": float(mult),
            "lo": float(lo), "hi": float(hi), "n_boot_ok": ok, "chi2": a.chi2, "dof": a.dof, "p": a.p,
            "verdict": a.verdict}
