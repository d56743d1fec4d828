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

Points that share a trunk (cooldown branches of one WSD trunk per seed, analysis.trunks) are not
independent: a seed's branches share its prefix. One run's error at point i is then sqrt(rho) u_t +
sqrt(1 - rho) v_i (u_t shared by the trunk t's branches, v_i its own), so the point means have the
covariance sd^2 K with

    K_ii = 1 / n_i,   K_ij = rho m_ij / (n_i n_j)   (m_ij: the trunks points i and j share).

rho is measured from the seeds (trunk_correlation): the correlation of the seed deviations of two points
of one family, pooled over every pair and family. The test above then reads chi2 = r' K^-1 r / sd^2, and
replicates of the point means (replicate_means) are drawn with that covariance, a family together.
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
    seed list, trunks the trunks its branches came from ('|'-joined; '' for separate runs). Runs of one
    point that repeat a seed are one sample (averaged); `repeats` counts the extra runs. Without a seed
    column every row is a point of its own."""
    df = df.copy()
    if variant_col not in df:
        df[variant_col] = "baseline"
    keys = [variant_col, "N", "D"]
    if seed_col not in df:  # no seeds: nothing says two rows are seeds of one point
        df[seed_col], df["_row"] = 0, np.arange(len(df))
        keys.append("_row")
    if "trunk_id" not in df:
        df["trunk_id"] = np.nan
    df["trunk_id"] = df["trunk_id"].where(df["trunk_id"].notna(), "")
    runs = df.groupby([*keys, seed_col], sort=False).agg(
        C=("C", "mean"), loss=("loss", "mean"), runs=("loss", "size"), trunk=("trunk_id", "first")).reset_index()
    out = runs.groupby(keys, sort=False).agg(
        C=("C", "mean"), loss=("loss", "mean"), n=("loss", "size"), sd=("loss", "std"),
        seeds=(seed_col, lambda s: ",".join(map(str, sorted(s)))), runs=("runs", "sum"),
        trunks=("trunk", lambda t: "|".join(sorted(x for x in t if x)))).reset_index()
    out["repeats"] = out.pop("runs") - out["n"]
    out["sd"] = out["sd"].where(out["n"] > 1)
    out = out.drop(columns="_row", errors="ignore").rename(columns={variant_col: "variant"})
    out[["N", "D"]] = out[["N", "D"]].astype(float)
    return out[["variant", "N", "D", "C", "loss", "n", "sd", "seeds", "repeats", "trunks"]]


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
class TrunkCorrelation:
    """The correlation `rho` of two branch points' errors through their shared trunk (module docstring),
    measured on `dof` degrees of freedom (NaN and 0 when no family has two seeds), and where from."""
    rho: float
    dof: float
    source: str
    cap: float = 0.98  # the largest rho used: K stays invertible where two points share every trunk

    @property
    def used(self) -> float:
        """The rho the covariance uses: the measured one within [0, cap]; 0 where none was measured."""
        return float(np.clip(self.rho, 0.0, self.cap)) if np.isfinite(self.rho) else 0.0


def trunk_correlation(df: pd.DataFrame, variant_col: str = "variant", seed_col: str = "seed") -> TrunkCorrelation:
    """rho from a scaling table's runs (N, D, loss, seed, trunk_id): within each family (the branch points
    of one variant and size, one trunk per seed), the deviations of each seed's loss from its point's mean
    over the family's seeds; rho = sum of the products over every pair of points / the root of the products
    of their sums of squares, pooled over pairs and families (only seeds present at both points of a pair)."""
    none = TrunkCorrelation(np.nan, 0.0, "not measured: no family of branch points has two seeds")
    if "trunk_id" not in df or seed_col not in df or df["trunk_id"].isna().all():
        return none
    b = df[df["trunk_id"].notna()]
    b = b.assign(_v=b[variant_col] if variant_col in b else "baseline")
    cross = sq_i = sq_j = dof = 0.0
    families = 0
    for _, g in b.groupby(["_v", "N"], sort=False):
        table = g.pivot_table(index=seed_col, columns="D", values="loss", aggfunc="mean")
        if len(table) < 2 or table.shape[1] < 2:
            continue
        d = table.columns
        used = False
        for i in range(len(d)):
            for j in range(i + 1, len(d)):
                both = table[[d[i], d[j]]].dropna()
                if len(both) < 2:
                    continue
                x, y = both[d[i]] - both[d[i]].mean(), both[d[j]] - both[d[j]].mean()
                cross, sq_i, sq_j, used = cross + float(x @ y), sq_i + float(x @ x), sq_j + float(y @ y), True
        if used:
            families += 1
            dof += table.notna().all(axis=1).sum() - 1
    if not families or sq_i * sq_j == 0:
        return none
    rho = cross / np.sqrt(sq_i * sq_j)
    return TrunkCorrelation(float(rho), float(dof), f"measured over {families} families of branch points "
                            f"({dof:g} dof)")


def mean_covariance(points: pd.DataFrame, rho: float) -> np.ndarray:
    """K (module docstring), the covariance of the point means in units of sd^2: points (n, trunks) as
    points_table writes them."""
    n = points["n"].to_numpy(float)
    sets = [set(t.split("|")) - {""} for t in points.get("trunks", pd.Series([""] * len(points)))]
    k = np.diag(1.0 / n)
    for i in range(len(n)):
        for j in range(i + 1, len(n)):
            shared = len(sets[i] & sets[j])
            if shared:
                k[i, j] = k[j, i] = rho * shared / (n[i] * n[j])
    return k


def replicate_means(points: pd.DataFrame, noise: SeedNoise, rho: float, n_boot: int, rng: np.random.Generator,
                    center: Optional[np.ndarray] = None) -> np.ndarray:
    """(n_boot, P) replicates of the P point means: center (default the points' losses) + sd_b z, z drawn
    with covariance K (mean_covariance), sd_b the seed noise with its estimation uncertainty (SeedNoise.draw)."""
    center = points["loss"].to_numpy(float) if center is None else np.asarray(center, float)
    chol = np.linalg.cholesky(mean_covariance(points, rho))
    sd = noise.draw(rng, n_boot)[:, None]
    return center[None, :] + sd * (rng.standard_normal((n_boot, len(center))) @ chol.T)


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


def adequacy(residuals, n_seeds, noise: SeedNoise, n_params: int, cov: Optional[np.ndarray] = None) -> Adequacy:
    """The fit's residuals at its point means (loss units), the seeds per point and the seed noise ->
    Adequacy (module docstring). cov: K of the points (mean_covariance) where some share a trunk; default
    diag(1 / n), independent points."""
    r, n = np.asarray(residuals, float), np.asarray(n_seeds, float)
    dof = len(r) - n_params
    if dof < 1 or not noise.known:
        return Adequacy(np.nan, max(dof, 0), np.nan, "not tested")
    chi2 = float((np.sum(n * r ** 2) if cov is None else r @ np.linalg.solve(cov, r)) / noise.sd ** 2)
    p = float(stats.chi2.sf(chi2, dof) if not np.isfinite(noise.dof) else stats.f.sf(chi2 / dof, dof, noise.dof))
    return Adequacy(chi2, dof, p, "inadequate" if p < ALPHA else "adequate")


def noise_from_args(points: pd.DataFrame, given: Optional[float]) -> SeedNoise:
    """The seed noise a report uses: the given sd (--seed-noise) when there is one, else the pooled one."""
    return SeedNoise.given(given) if given else pooled_noise(points)
