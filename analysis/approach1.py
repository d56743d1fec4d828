"""Approach 1 on a ladder: the loss against tokens at each model size, and the compute-optimal size read off
the envelope of those curves (Hoffmann et al. 2022, arXiv:2203.15556, sec. 3.1).

Per size. At each size N with points at two token counts or more (the cooldown branches of its trunks, or
separate runs), the loss against tokens is fitted as a power law in log-log space, weighted by seeds:

    log L_N(D) = log A_N - b_N log D.

Over the few-fold range of D a ladder trains, the curvature a floor would add is small against the seed
noise, and each size's fit is tested against that noise (analysis.noise.adequacy, on k - 2 degrees of
freedom). At fixed N compute is proportional to tokens, C = k_N D (k_N: the size's median C / D), so each
size's curve is also a line in log L against log C.

The envelope. Approach 1 takes, at each compute, the lowest loss any size reaches. With a ladder's few
sizes the envelope is piecewise: size N_i is best from where its line crosses the line of the size before
it to where the next size's line crosses it. At a crossover C_x the optimum moves from N_i to N_j, so the
compute-optimal size there is taken as their geometric mean, and N_opt ∝ C^a is the least-squares line of
log sqrt(N_i N_j) on log C_x (two crossovers or more; three sizes give two). The envelope is searched over
the compute the ladder trained; a crossover outside the compute both of its sizes trained is an
extrapolation of one of their lines, and the table says so.

Intervals from the seed noise: a parametric bootstrap of the point means (analysis.noise.replicate_means)
in which the branches of one trunk move together, with the correlation measured from the seeds; each
replicate refits every size and finds the envelope again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.noise import SeedNoise, TrunkCorrelation, adequacy, mean_covariance, points_table, pooled_noise, \
    replicate_means, trunk_correlation

MIN_TOKEN_COUNTS = 2  # points of distinct D a size needs for its L(D)


def applicable(df: pd.DataFrame) -> bool:
    """Whether some size (N) of a scaling table or points table has points at MIN_TOKEN_COUNTS token counts."""
    return bool(len(df)) and bool((df.groupby("N")["D"].nunique() >= MIN_TOKEN_COUNTS).any())


def fit_sizes(points: pd.DataFrame, loss: np.ndarray) -> pd.DataFrame:
    """One row per size (N) of one variant's points (N, D, C, n): log A, b and log k (C = k D) of the
    weighted least-squares line log L = log A - b log D through the points' losses `loss` (P,) or
    replicates (R, P), as arrays (R,) per column; sizes with fewer than MIN_TOKEN_COUNTS values of D left out."""
    loss = np.atleast_2d(loss)
    rows = []
    for n_value, g in points.groupby("N", sort=True):
        if g["D"].nunique() < MIN_TOKEN_COUNTS:
            continue
        x, w = np.log(g["D"].to_numpy(float)), g["n"].to_numpy(float)
        y = np.log(loss[:, g.index.to_numpy()])
        xm = (w * x).sum() / w.sum()
        ym = (y * w).sum(1) / w.sum()
        slope = ((y - ym[:, None]) * (w * (x - xm))).sum(1) / (w * (x - xm) ** 2).sum()
        rows.append({"N": float(n_value), "log_a": ym - slope * xm, "b": -slope,
                     "log_k": float(np.median(np.log(g["C"] / g["D"]))),
                     "c_lo": float(g["C"].min()), "c_hi": float(g["C"].max())})
    return pd.DataFrame(rows)


def crossovers(sizes: pd.DataFrame, log_c: np.ndarray, rep: int = 0) -> list[dict]:
    """Where the envelope min_N L_N(C) changes size on the grid `log_c`, for replicate `rep` of `sizes`
    (fit_sizes): each change from N_i to N_j at the exact crossing of their two lines."""
    log_a = np.array([r[rep] for r in sizes["log_a"]])
    b = np.array([r[rep] for r in sizes["b"]])
    log_k = sizes["log_k"].to_numpy()
    log_l = log_a[:, None] - b[:, None] * (log_c[None, :] - log_k[:, None])
    best = np.argmin(log_l, axis=0)
    out = []
    for g in np.flatnonzero(np.diff(best)):
        i, j = best[g], best[g + 1]
        # log_a_i - b_i (x - log_k_i) = log_a_j - b_j (x - log_k_j)
        x = (log_a[i] - log_a[j] + b[i] * log_k[i] - b[j] * log_k[j]) / (b[i] - b[j])
        out.append({"from_N": sizes["N"].iloc[i], "to_N": sizes["N"].iloc[j], "log_C": float(x),
                    "log_L": float(log_a[i] - b[i] * (x - log_k[i]))})
    return out


def optimal_exponent(cross: list[dict]) -> float:
    """a of N_opt ∝ C^a: the slope of log sqrt(N_i N_j) on log C over the crossovers; NaN for fewer than two."""
    if len(cross) < 2:
        return np.nan
    x = np.array([c["log_C"] for c in cross])
    y = np.array([0.5 * np.log(c["from_N"] * c["to_N"]) for c in cross])
    return float(np.polyfit(x, y, 1)[0])


@dataclass
class Approach1:
    """One variant's approach 1. sizes: one row per size (N, D values, points, b with its interval, the
    loss at the smallest and largest D, the fit test); crossovers: one row per change of the envelope's
    size (C with its interval, the loss there, whether both sizes trained that compute); a and its interval
    (NaN below two crossovers); lowest: the size the envelope starts with, at the lowest compute trained;
    fits: fit_sizes' rows at the point estimate; the noise and correlation
    the intervals used, and the replicates drawn."""
    variant: str
    sizes: pd.DataFrame
    crossovers: pd.DataFrame
    a: float
    a_lo: float
    a_hi: float
    lowest: float
    fits: pd.DataFrame
    noise: SeedNoise
    correlation: TrunkCorrelation
    n_boot: int

    def predict(self, n: float, c: np.ndarray) -> np.ndarray:
        """The fitted L_N(C) of size n (one of the sizes) at compute c."""
        r = self.fits[self.fits["N"] == n].iloc[0]
        return np.exp(r["log_a"][0] - r["b"][0] * (np.log(c) - r["log_k"]))


def fit_approach1(df: pd.DataFrame, variant: str = "baseline", noise: SeedNoise | None = None,
                  correlation: TrunkCorrelation | None = None, n_boot: int = 1000, seed: int = 0,
                  level: float = 0.95) -> Approach1:
    """Approach 1 for the rows of one variant of a scaling table (N, D, C, loss, seed; trunk_id for branches).
    noise, correlation: default measured on these rows (pooled seed noise, trunk correlation). ValueError
    when no size has points at two token counts."""
    points = points_table(df.assign(variant=variant), seed_col="seed")
    if not applicable(points):
        raise ValueError(f"approach 1 needs a size with points at >= {MIN_TOKEN_COUNTS} token counts; the sizes "
                         f"have {points.groupby('N')['D'].nunique().max()} at most")
    noise = pooled_noise(points) if noise is None else noise
    correlation = trunk_correlation(df.assign(variant=variant)) if correlation is None else correlation
    rho = correlation.used
    loss = points["loss"].to_numpy(float)
    fits = fit_sizes(points, loss)
    span = np.log(points["C"].to_numpy(float))
    log_c = np.linspace(span.min(), span.max(), 4001)  # the envelope over the compute the ladder trained
    cross = crossovers(fits, log_c)
    at_start = fits["log_a"].map(lambda v: v[0]) - fits["b"].map(lambda v: v[0]) * (log_c[0] - fits["log_k"])
    lowest = float(fits["N"].iloc[int(np.argmin(at_start))])  # the envelope's size at the least compute
    reps = (replicate_means(points, noise, rho, n_boot, np.random.default_rng(seed))
            if noise.known and n_boot else np.empty((0, len(points))))
    boot = fit_sizes(points, reps) if len(reps) else None
    q = (1 - level) / 2

    def interval(values) -> tuple[float, float]:
        v = np.asarray(values, float)
        v = v[np.isfinite(v)]
        return (float(np.quantile(v, q)), float(np.quantile(v, 1 - q))) if len(v) else (np.nan, np.nan)

    size_rows = []
    for i, f in fits.iterrows():
        g = points[points["N"] == f["N"]].sort_values("D")
        cov = mean_covariance(g, rho)
        resid = g["loss"].to_numpy(float) - np.exp(f["log_a"][0] - f["b"][0] * np.log(g["D"].to_numpy(float)))
        test = adequacy(resid, g["n"], noise, 2, cov)
        lo, hi = interval(boot["b"].iloc[i]) if boot is not None else (np.nan, np.nan)
        size_rows.append({"N": f["N"], "points": len(g), "seeds": int(g["n"].max()),
                          "D": ", ".join(f"{d:,.0f}" for d in g["D"]), "b": f["b"][0], "b_lo": lo, "b_hi": hi,
                          "loss_first": g["loss"].iloc[0], "loss_last": g["loss"].iloc[-1],
                          "chi2": test.chi2, "dof": test.dof, "p": test.p, "verdict": test.verdict})
    per_rep = [crossovers(boot, log_c, r) for r in range(len(reps))] if boot is not None else []
    cross_rows = []
    for c in cross:
        same = [x["log_C"] for rc in per_rep for x in rc if (x["from_N"], x["to_N"]) == (c["from_N"], c["to_N"])]
        lo, hi = interval(np.exp(same))
        inside = all(f["c_lo"] <= np.exp(c["log_C"]) <= f["c_hi"]
                     for _, f in fits[fits["N"].isin([c["from_N"], c["to_N"]])].iterrows())
        cross_rows.append({"from_N": c["from_N"], "to_N": c["to_N"], "C": float(np.exp(c["log_C"])), "C_lo": lo,
                           "C_hi": hi, "share": len(same) / max(len(per_rep), 1), "loss": float(np.exp(c["log_L"])),
                           "in data range": "yes" if inside else "extrapolated"})
    a_lo, a_hi = interval([optimal_exponent(rc) for rc in per_rep])
    return Approach1(variant=variant, sizes=pd.DataFrame(size_rows),
                     crossovers=pd.DataFrame(cross_rows, columns=["from_N", "to_N", "C", "C_lo", "C_hi", "share",
                                                                  "loss", "in data range"]),
                     a=optimal_exponent(cross), a_lo=a_lo, a_hi=a_hi, lowest=lowest, fits=fits, noise=noise,
                     correlation=correlation, n_boot=len(reps))
