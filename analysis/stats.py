"""Statistics of an ablation row: the mean over seeds with its interval, the delta against the baseline with
its test, Holm's adjustment over a family of comparisons and the minimum detectable effect.

Per row: n seeds, mean, standard deviation, Student-t 95% CI of the mean (describe). Runs repeating a seed in
one row are one sample (one_per_seed: averaged, and reported by the caller). Against the baseline (compare):
delta = mean(option) - mean(baseline), its 95% CI and p-value from a paired t-test (scipy.stats.ttest_rel)
when both sides have the same >= 2 seeds, else Welch's t-test (ttest_ind, equal_var=False). holm: p-values
adjusted by Holm's step-down method (statsmodels multipletests); verdicts are decided on them at ALPHA. The
minimum detectable effect is the smallest |delta| the test used detects with power POWER at ALPHA given n and
the spread (mde_paired: the root of the paired test's noncentral-t power, paired_power; mde_welch: by
simulation, since Welch's degrees of freedom are estimated).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from scipy import stats

ALPHA, POWER = 0.05, 0.8


def describe(x: np.ndarray, level: float = 0.95) -> dict:
    """n, mean, std (ddof=1), Student-t CI of the mean (NaN when n < 2)."""
    x = np.asarray(x, float)
    n = len(x)
    mean = float(x.mean()) if n else np.nan
    if n < 2:
        return {"n": n, "mean": mean, "std": np.nan, "ci_lo": np.nan, "ci_hi": np.nan}
    std = float(x.std(ddof=1))
    lo, hi = stats.t.interval(level, n - 1, loc=mean, scale=std / np.sqrt(n)) if std > 0 else (mean, mean)
    return {"n": n, "mean": mean, "std": std, "ci_lo": float(lo), "ci_hi": float(hi)}


def paired_power(effect_size: float, n, alpha: float) -> np.ndarray:
    """Power of the two-sided one-sample (paired) t-test on n differences (scalar or array) at `alpha` for a
    true mean of effect_size standard deviations: with c = t_{1-alpha/2, n-1} and the noncentrality
    nc = d sqrt(n), P(T > c) + P(T < -c) for T noncentral t (statsmodels' TTestPower.power). The lower tail is
    taken as P(T' > c) for T' of noncentrality -nc, the same probability by symmetry: scipy's noncentral-t cdf
    returns NaN there at large effects and few seeds (d = 5, n = 3), where statsmodels gives NaN."""
    n = np.atleast_1d(np.asarray(n, float))
    df, nc = n - 1, effect_size * np.sqrt(n)
    c = stats.t.ppf(1 - alpha / 2, df)
    return stats.nct.sf(c, df, nc) + stats.nct.sf(c, df, -nc)


def mde_paired(sd_diff: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """Minimum detectable effect of a two-sided paired t-test on n pairs: MDE = d* x sd_diff, where d* is
    the effect size (mean difference / sd of the differences) at which the test has `power` at `alpha`:
    the root of paired_power(d, n, alpha) = power (brentq; the power grows with d from alpha at d = 0).
    statsmodels' TTestPower.solve_power is not used: its power is NaN at large effects and few seeds, where
    its root finder stops at a wrong value without a word (n = 2, power 0.9: d* = 10.0, at which the power
    is 0.73)."""
    if n < 2 or not np.isfinite(sd_diff) or sd_diff <= 0:
        return np.nan
    from scipy.optimize import brentq

    def short(d: float) -> float:
        return float(paired_power(d, n, alpha)[0]) - power

    hi = 1.0
    while short(hi) < 0:
        hi *= 2
    return float(brentq(short, 0.0, hi, xtol=1e-12, rtol=1e-12)) * float(sd_diff)


WELCH_SIMULATIONS = 100_000


def mde_welch(sd_a: float, n_a: int, sd_b: float, n_b: int, alpha: float = ALPHA, power: float = POWER,
              n_sim: int = WELCH_SIMULATIONS, seed: int = 0) -> float:
    """Minimum detectable effect of the two-sided Welch t-test, by simulation: Welch's degrees of freedom are
    estimated from the sample variances, so the noncentral-t formula of the pooled test overstates its power
    at a few seeds (0.69 instead of 0.8 at n = 3 + 3). For n_sim draws i of two normal samples with these
    sds and no true difference: m_i = the difference of the means, se_i = sqrt(s_a^2/n_a + s_b^2/n_b),
    nu_i = se_i^4 / ((s_a^2/n_a)^2/(n_a-1) + (s_b^2/n_b)^2/(n_b-1)), c_i = t_{1-alpha/2, nu_i} se_i. A true
    difference delta is detected in draw i when delta + m_i > c_i or delta + m_i < -c_i; the MDE is the
    smallest delta > 0 detected in a fraction `power` of the draws (fixed seed: the same value every call;
    Monte Carlo error of the power about 0.0013 at 100,000 draws)."""
    if min(n_a, n_b) < 2 or not (np.isfinite(sd_a) and np.isfinite(sd_b)) or sd_a + sd_b <= 0:
        return np.nan
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n_sim, n_a)) * sd_a
    b = rng.standard_normal((n_sim, n_b)) * sd_b
    va, vb = a.var(1, ddof=1) / n_a, b.var(1, ddof=1) / n_b
    se = np.sqrt(va + vb)
    nu = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
    c = stats.t.ppf(1 - alpha / 2, nu) * se
    m = a.mean(1) - b.mean(1)
    above, below = np.sort(c - m), np.sort(-c - m)  # detected when delta > above_i or delta < below_i

    def detected(delta: float) -> float:
        return (np.searchsorted(above, delta) + n_sim - np.searchsorted(below, delta, side="right")) / n_sim

    lo, hi = 0.0, float(np.sqrt(sd_a ** 2 / n_a + sd_b ** 2 / n_b))
    while detected(hi) < power:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if detected(mid) < power else (lo, mid)
    return hi


def compare(opt: pd.DataFrame, base: pd.DataFrame, metric: str, level: float = 0.95) -> dict:
    """delta = mean(opt) - mean(base), its CI, p-value and MDE; paired on seeds when both have the same seeds.
    opt, base: one row per seed (see one_per_seed)."""
    a, b = opt[metric].to_numpy(float), base[metric].to_numpy(float)
    out = {"delta": float(a.mean() - b.mean()), "delta_lo": np.nan, "delta_hi": np.nan, "p_value": np.nan,
           "test": "", "mde": np.nan}
    sa = opt["seed"].tolist() if "seed" in opt else []
    sb = base["seed"].tolist() if "seed" in base else []
    paired = len(sa) >= 2 and len(set(sa)) == len(sa) and sorted(sa) == sorted(sb)
    if paired:
        a = opt.set_index("seed")[metric].astype(float)
        b = base.set_index("seed")[metric].astype(float).loc[a.index]
        d = (a - b).to_numpy()
        if np.all(d == d[0]):  # zero variance of the differences: exact, no test
            out.update(delta_lo=float(d[0]), delta_hi=float(d[0]), test="paired (constant)")
            return out
        res = stats.ttest_rel(a.to_numpy(), b.to_numpy())
        test, mde = "paired t", mde_paired(float(d.std(ddof=1)), len(d))
    elif len(a) >= 2 and len(b) >= 2:
        res = stats.ttest_ind(a, b, equal_var=False)
        test, mde = "Welch t", mde_welch(float(a.std(ddof=1)), len(a), float(b.std(ddof=1)), len(b))
    else:
        out["test"] = "n<2"
        return out
    ci = res.confidence_interval(level)
    out.update(delta_lo=float(ci.low), delta_hi=float(ci.high), p_value=float(res.pvalue), test=test, mde=mde)
    return out


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (statsmodels multipletests, method 'holm'): sorted ascending,
    p_(i) -> max_{j <= i} min(1, (m - j + 1) p_(j)); NaN entries are left out of the family and stay NaN."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(p_values, float)
    out = np.full(len(p), np.nan)
    ok = np.isfinite(p)
    if ok.any():
        out[ok] = multipletests(p[ok], alpha=ALPHA, method="holm")[1]
    return out


def one_per_seed(runs: pd.DataFrame, metric: str) -> tuple[pd.DataFrame, dict]:
    """(one row per seed, {seed: number of runs} for the seeds run more than once). Runs of one row that
    repeat a seed are one sample (they differ only by nondeterminism): averaged, and reported by the
    caller, so n counts independent seeds."""
    if "seed" not in runs:
        return runs, {}
    counts = runs["seed"].value_counts()
    repeats = {k: int(v) for k, v in counts[counts > 1].sort_index().items()}
    if not repeats:
        return runs, {}
    return runs.groupby("seed", as_index=False)[metric].mean(), repeats
