"""Seed noise: the points of a ladder (runs that differ only by seed), the seed-to-seed spread measured at
them, and the test of a fit against that spread.

A point is one (variant, N, D): its runs differ only by seed, and its loss is their mean. The seed noise is
the standard deviation of one run's loss from seed to seed, pooled over every point with two seeds or more:

    sd^2 = sum_p (n_p - 1) s_p^2 / nu,   nu = sum_p (n_p - 1)   (s_p: the sample sd of point p's seeds)

It assumes one spread for every variant and size, so a point of one seed gets the spread measured at the
points that have several (a ladder with seeds at its smallest size only borrows that size's spread). Given
instead (SeedNoise.given), it is taken as exact (nu infinite).

Fit adequacy (adequacy): a fit describes its points within noise when its residuals at the point means are
no larger than the seed noise says they should be. With r_p = mean_p - fit(p) and the mean of n_p seeds
having variance sd^2 / n_p,

    chi2 = sum_p n_p r_p^2 / sd^2   on k = points - parameters degrees of freedom;

with sd estimated on nu degrees of freedom, (chi2 / k) follows F(k, nu) when the fit is right (the point
means are independent of the spreads within points), chi2 itself chi-square(k) when sd is given. The fit is
inadequate when p < ALPHA; with k = 0 it is not tested (and not called adequate).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd
from scipy import stats

from analysis.stats import ALPHA


@dataclass
class SeedNoise:
    """The seed-to-seed standard deviation `sd` of one run's loss, estimated on `dof` degrees of freedom
    (inf: given, not estimated), and where it comes from (`source`, in words)."""
    sd: float
    dof: float
    source: str

    @classmethod
    def given(cls, sd: float) -> "SeedNoise":
        return cls(float(sd), np.inf, f"given: {sd:g}")

    @property
    def known(self) -> bool:
        return bool(np.isfinite(self.sd) and self.sd > 0)

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """`size` draws of the sd with its estimation uncertainty: sd * sqrt(nu / chi2_nu) (the scaled
        inverse chi-square of a variance estimated on nu degrees of freedom), so that a normal deviate times
        a draw is sd times a Student t_nu deviate; the sd itself when given."""
        if not np.isfinite(self.dof):
            return np.full(size, self.sd)
        return self.sd * np.sqrt(self.dof / rng.chisquare(self.dof, size))


def points_table(df: pd.DataFrame, variant_col: str = "variant", seed_col: str = "seed") -> pd.DataFrame:
    """One row per point (variant, N, D) of a scaling table (N, D, C, loss; analysis.collect): C and the loss
    are the means over the point's runs, n the number of seeds, sd their sample sd (NaN for one), seeds the
    seed list. Runs of one point that repeat a seed are one sample (averaged); `repeats` counts the extra
    runs. Without a seed column every row is a point of its own."""
    df = df.copy()
    if variant_col not in df:
        df[variant_col] = "baseline"
    keys = [variant_col, "N", "D"]
    if seed_col not in df:  # no seeds: nothing says two rows are seeds of one point
        df[seed_col], df["_row"] = 0, np.arange(len(df))
        keys.append("_row")
    runs = df.groupby([*keys, seed_col], sort=False)[["C", "loss"]].agg(["mean", "size"])
    per_seed = pd.DataFrame({"C": runs[("C", "mean")], "loss": runs[("loss", "mean")],
                             "runs": runs[("loss", "size")]}).reset_index()
    out = per_seed.groupby(keys, sort=False).agg(
        C=("C", "mean"), loss=("loss", "mean"), n=("loss", "size"), sd=("loss", "std"),
        seeds=(seed_col, lambda s: ",".join(map(str, sorted(s)))), runs=("runs", "sum")).reset_index()
    out["repeats"] = out.pop("runs") - out["n"]
    out["sd"] = out["sd"].where(out["n"] > 1)
    out = out.drop(columns="_row", errors="ignore").rename(columns={variant_col: "variant"})
    out[["N", "D"]] = out[["N", "D"]].astype(float)
    return out[["variant", "N", "D", "C", "loss", "n", "sd", "seeds", "repeats"]]


def pooled_noise(points: pd.DataFrame) -> SeedNoise:
    """The seed noise pooled over the points with two seeds or more (module docstring); sd NaN (and dof 0)
    when no point has two."""
    several = points[points["n"] >= 2]
    dof = float((several["n"] - 1).sum())
    if not dof:
        return SeedNoise(np.nan, 0.0, "not measured: no point has two seeds")
    sd = float(np.sqrt(((several["n"] - 1) * several["sd"] ** 2).sum() / dof))
    where = ", ".join(sorted({f"{v} N={n:.3g}" for v, n in zip(several["variant"], several["N"])}))
    return SeedNoise(sd, dof, f"pooled over {len(several)} points with >= 2 seeds ({where}); {dof:g} dof")


@dataclass
class Adequacy:
    """A fit against the seed noise: chi2 on dof degrees of freedom, its p-value, and the verdict:
    'adequate', 'inadequate' (p < ALPHA) or 'not tested' (no degrees of freedom left, or no noise)."""
    chi2: float
    dof: int
    p: float
    verdict: str

    @property
    def adequate(self) -> bool:
        return self.verdict == "adequate"


def adequacy(residuals, n_seeds, noise: SeedNoise, n_params: int) -> Adequacy:
    """The fit's residuals at its point means (loss units), the seeds per point and the seed noise ->
    Adequacy (module docstring)."""
    r, n = np.asarray(residuals, float), np.asarray(n_seeds, float)
    dof = len(r) - n_params
    if dof < 1 or not noise.known:
        return Adequacy(np.nan, max(dof, 0), np.nan, "not tested")
    chi2 = float(np.sum(n * r ** 2) / noise.sd ** 2)
    p = float(stats.chi2.sf(chi2, dof) if not np.isfinite(noise.dof) else stats.f.sf(chi2 / dof, dof, noise.dof))
    return Adequacy(chi2, dof, p, "inadequate" if p < ALPHA else "adequate")


def noise_from_args(points: pd.DataFrame, given: Optional[float]) -> SeedNoise:
    """The seed noise a report uses: the given sd (--seed-noise) when there is one, else the pooled one."""
    return SeedNoise.given(given) if given else pooled_noise(points)
