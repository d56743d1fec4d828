"""Compute multipliers whose uncertainty is true (analysis.multipliers, analysis.noise, analysis.headline).

Known truths from synthetic ladders (analysis.synthetic): a constant multiplier under a shared exponent is
recovered size by size and by an adequate shared fit; a multiplier that grows with scale is recovered size by
size, with its trend, and its shared fit is marked inadequate; over many synthetic replicates the per-size and
fit intervals cover the truth at about their nominal 95%. Also: the seed noise and the fit test against
independent formulas, the batched least squares against scipy's, the multipliers.csv contract on run folders
and CSV tables, the headline's wall-clock rule, and the primary comparisons' Holm family.
"""
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from scipy.optimize import least_squares
from statsmodels.stats.multitest import multipletests

from analysis.ablate import ablation_table
from analysis.cells import variant_labels
from analysis.collect import collect, runs_to_scaling
from analysis.headline import headline
from analysis.multipliers import compute_multipliers, per_size, shared_fit
from analysis.noise import SeedNoise, adequacy, points_table, pooled_noise
from analysis.power_law import _stack, _starts, _weighted_residual, fit_loss_vs_compute_shared
from analysis.synthetic import law, write_ablation_sweep, write_scaling_ladder

# A ladder like the first study's: sizes 1.6x apart from 6.59M, 20 tokens per parameter.
SIZES = 6.59e6 * 1.6 ** np.arange(5)


def ladder(tmp_path, **kw):
    truth = write_scaling_ladder(tmp_path, sizes=SIZES, **kw)
    runs = collect([tmp_path], curves=False).runs
    return truth, runs, runs_to_scaling(runs.assign(variant=variant_labels(runs)))


# --------------------------------------------------------------------------------------------------
# Known truths
# --------------------------------------------------------------------------------------------------

def test_a_constant_multiplier_is_recovered_size_by_size_and_by_its_adequate_shared_fit(tmp_path):
    """A variant at 1.5x the compute at every size (L_var(C) = L_base(1.5 C), the exponent shared): every
    per-size interval and the fit's interval hold 1.5, the fit is adequate and within 5% of it, and no trend
    is detected."""
    truth, _, df = ladder(tmp_path, multiplier=1.5, seeds=(0, 1, 2), noise=0.01)
    m = compute_multipliers(df, n_boot=1000)
    assert m.noise.sd == pytest.approx(0.01, rel=0.35) and m.noise.dof == 20  # 10 points x (3 - 1)
    sizes = m.per_size
    assert len(sizes) == 5 and set(sizes["variant"]) == {"glu=swiglu"}
    assert ((sizes["lo"] <= 1.5) & (1.5 <= sizes["hi"])).all(), sizes
    assert sizes["extrapolated"].tolist() == [""] * 4 + ["beyond the baseline's largest point"]
    fit = m.fits[m.fits["kind"] == "shared"].iloc[0]
    assert fit["verdict"] == "adequate" and fit["dof"] == 6
    assert fit["multiplier"] == pytest.approx(1.5, rel=0.05) and fit["lo"] <= 1.5 <= fit["hi"]
    tr = m.trends.iloc[0]
    assert tr["lo"] < 0 < tr["hi"] and tr["verdict"] == "no trend detected"


def test_a_multiplier_growing_with_scale_is_recovered_size_by_size_and_its_shared_fit_is_inadequate(tmp_path):
    """m = 1.2 (C / C_smallest)^0.15: each size's interval holds that size's truth, the trend's interval holds
    0.15 and says the gain grows, and the shared fit (one multiplier at every C) fails its test."""
    truth, _, df = ladder(tmp_path, multiplier=1.2, growth=0.15, seeds=(0, 1, 2), noise=0.01)
    m = compute_multipliers(df, n_boot=1000)
    sizes = m.per_size
    want = sizes["N"].map(truth)
    assert want.iloc[-1] / want.iloc[0] == pytest.approx(1.6 ** (4 * 2 * 0.15))
    assert ((sizes["lo"] <= want) & (want <= sizes["hi"])).all(), sizes.assign(truth=want)
    tr = m.trends.iloc[0]
    assert tr["lo"] <= 0.15 <= tr["hi"] and tr["verdict"] == "grows with scale"
    fit = m.fits[m.fits["kind"] == "shared"].iloc[0]
    assert fit["verdict"] == "inadequate" and fit["p"] < 1e-3


def test_no_effect_gives_multipliers_of_one(tmp_path):
    _, _, df = ladder(tmp_path, multiplier=1.0, seeds=(0, 1, 2), noise=0.01)
    m = compute_multipliers(df, n_boot=1000)
    assert ((m.per_size["lo"] <= 1) & (1 <= m.per_size["hi"])).all()
    fit = m.fits[m.fits["kind"] == "shared"].iloc[0]
    assert fit["verdict"] == "adequate" and fit["lo"] <= 1 <= fit["hi"]


def test_per_size_reads_the_baseline_curve_exactly_where_it_is_a_power_law():
    """Interpolation in log C against log L is exact for L = A C^-alpha, inside the baseline's points and on
    the extended end segments (flagged), and with no noise the interval is the point itself."""
    c = np.geomspace(1e15, 1e17, 4)
    base = pd.DataFrame({"N": c, "C": c, "loss": 3.0 * (c / 1e15) ** -0.1, "n": 1.0})
    m_true = np.array([0.5, 1.3, 2.0, 40.0])
    var = pd.DataFrame({"N": c, "C": c, "loss": 3.0 * (m_true * c / 1e15) ** -0.1, "n": 1.0})
    rows, _ = per_size(base, var, SeedNoise.given(1e-12), n_boot=50)
    np.testing.assert_allclose(rows["multiplier"], m_true, rtol=1e-9)
    np.testing.assert_allclose(rows["lo"], m_true, rtol=1e-6)
    assert rows["extrapolated"].tolist() == ["before the baseline's smallest point", "", "",
                                             "beyond the baseline's largest point"]


# --------------------------------------------------------------------------------------------------
# Coverage over synthetic replicates
# --------------------------------------------------------------------------------------------------

def _replicate(rng, multipliers, seeds, sigma=0.02, sizes=6.59e6 * 1.6 ** np.arange(4)):
    """Point tables of one synthetic ladder: the baseline on analysis.synthetic.law at 20 tokens per parameter
    (a curve with a floor, so the interpolation's own error is in the test), the variant at the given
    multiplier per size, `seeds` runs per size, each with loss noise N(0, sigma)."""
    rows = []
    for variant, mult in (("baseline", np.ones(len(sizes))), ("variant", multipliers)):
        for n, m, k in zip(sizes, mult, seeds):
            s = np.sqrt(m)
            for seed in range(k):
                rows.append({"variant": variant, "N": n, "D": 20 * n, "C": 120 * n * n, "seed": seed,
                             "loss": law(s * n, s * 20 * n) + rng.normal(0, sigma)})
    points = points_table(pd.DataFrame(rows))
    return points[points["variant"] == "baseline"], points[points["variant"] == "variant"], pooled_noise(points)


def per_size_coverage(n_replicates: int, n_boot: int, seed: int = 11) -> tuple[np.ndarray, int]:
    """Hits of the per-size 95% intervals (replicates x 4 sizes) on a ladder like the first study's: 4 sizes
    1.6x apart, 3 seeds at the smallest and one above (the noise estimated there on 4 degrees of freedom),
    a multiplier growing from 1.3 as C^0.1."""
    rng = np.random.default_rng(seed)
    sizes = 6.59e6 * 1.6 ** np.arange(4)
    truth = 1.3 * (sizes / sizes[0]) ** 0.2
    hits = []
    for _ in range(n_replicates):
        base, var, noise = _replicate(rng, truth, (3, 1, 1, 1), sizes=sizes)
        rows, _ = per_size(base, var, noise, n_boot, rng)
        hits.append(((rows["lo"] <= truth) & (truth <= rows["hi"])).to_numpy())
    return np.array(hits), len(hits)


def fit_coverage(n_replicates: int, n_boot: int, seed: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """Hits of the shared fit's 95% interval, and its verdicts, on ladders of 5 sizes with 3 seeds each and a
    constant multiplier of 1.3 (the shared fit's form holds exactly: adequate but for chance)."""
    rng = np.random.default_rng(seed)
    hits, verdicts = [], []
    for _ in range(n_replicates):
        base, var, noise = _replicate(rng, np.full(5, 1.3), (3,) * 5, sizes=6.59e6 * 1.6 ** np.arange(5))
        fit = shared_fit(base, var, "baseline", "variant", noise, n_boot, rng, 0.95)
        hits.append(fit["lo"] <= 1.3 <= fit["hi"])
        verdicts.append(fit["verdict"])
    return np.array(hits), np.array(verdicts)


def binomial_bounds(n: int, lo: float = 0.90, hi: float = 0.98, tail: float = 5e-4) -> tuple[float, float]:
    """The observed rates a count of n independent intervals can show when the true coverage is anywhere in
    [lo, hi]: from the lower `tail` quantile of Binomial(n, lo) to the upper one of Binomial(n, hi)."""
    return stats.binom.ppf(tail, n, lo) / n, stats.binom.isf(tail, n, hi) / n


def test_per_size_and_fit_intervals_cover_the_truth_at_their_nominal_rate():
    """Over 300 synthetic ladders (1,200 per-size intervals) and 100 shared fits, 95% intervals cover the
    truth at a rate that a true coverage of 90-98% can show given the binomial spread of these counts
    (tests/..._slow checks 90-98% itself on 1,000 of each); the adequacy test calls a right fit inadequate
    about 5% of the time."""
    hits, n = per_size_coverage(300, n_boot=300)
    lo, hi = binomial_bounds(hits.size)
    assert lo <= hits.mean() <= hi, f"per-size coverage {hits.mean():.3f} outside [{lo:.3f}, {hi:.3f}]"
    hits, verdicts = fit_coverage(100, n_boot=300)
    lo, hi = binomial_bounds(len(hits))
    assert lo <= hits.mean() <= hi, f"fit coverage {hits.mean():.3f} outside [{lo:.3f}, {hi:.3f}]"
    false_alarms = (verdicts == "inadequate").sum()
    assert stats.binom.ppf(5e-4, len(verdicts), 0.05) <= false_alarms <= stats.binom.isf(5e-4, len(verdicts), 0.05)


@pytest.mark.slow
def test_per_size_and_fit_intervals_cover_the_truth_90_to_98_percent_slow():
    """The same with 1,000 ladders and 1,000 fits: each rate itself within 90-98% (intervals too narrow and
    too wide both fail), and the right fit called inadequate 3-7% of the time."""
    hits, _ = per_size_coverage(1000, n_boot=1000)
    assert 0.90 <= hits.mean() <= 0.98, hits.mean()
    assert all(0.90 <= h <= 0.98 for h in hits.mean(0)), hits.mean(0)  # at every size
    hits, verdicts = fit_coverage(1000, n_boot=1000)
    assert 0.90 <= hits.mean() <= 0.98, hits.mean()
    assert 0.03 <= (verdicts == "inadequate").mean() <= 0.07


# --------------------------------------------------------------------------------------------------
# The pieces
# --------------------------------------------------------------------------------------------------

def test_points_pool_the_seed_noise_and_the_fit_test_follows_f():
    """The pooled sd is the square root of the dof-weighted mean of the points' variances; a point's repeated
    seed is one sample; the test's chi2 is sum n r^2 / sd^2 with its p from F(k, nu) (chi-square(k) for a given
    sd), and a fit with no dof left is not tested."""
    df = pd.DataFrame({"variant": ["a"] * 5 + ["b"] * 3, "N": [1, 1, 1, 1, 2, 1, 1, 1], "D": 1.0, "C": 1.0,
                       "seed": [0, 1, 2, 2, 0, 0, 1, 2], "loss": [1.0, 1.2, 1.1, 1.3, 2.0, 3.0, 3.4, 3.2]})
    points = points_table(df)
    a = points[(points["variant"] == "a") & (points["N"] == 1)].iloc[0]
    assert a["n"] == 3 and a["repeats"] == 1 and a["loss"] == pytest.approx((1.0 + 1.2 + 1.2) / 3)
    noise = pooled_noise(points)
    va, vb = np.var([1.0, 1.2, 1.2], ddof=1), np.var([3.0, 3.4, 3.2], ddof=1)
    assert noise.dof == 4 and noise.sd == pytest.approx(np.sqrt((2 * va + 2 * vb) / 4))
    r, n = np.array([0.01, -0.02, 0.015, 0.0]), np.array([3, 1, 2, 3])
    test = adequacy(r, n, SeedNoise(0.01, 12, "x"), 2)
    chi2 = float(np.sum(n * r ** 2) / 0.01 ** 2)
    assert (test.chi2, test.dof) == (pytest.approx(chi2), 2) and test.p == pytest.approx(stats.f.sf(chi2 / 2, 2, 12))
    assert adequacy(r, n, SeedNoise.given(0.01), 2).p == pytest.approx(stats.chi2.sf(chi2, 2))
    assert adequacy(r, n, SeedNoise(0.01, 12, "x"), 4).verdict == "not tested"
    assert not pooled_noise(points_table(df.drop(columns="seed"))).known  # no seeds: every row a point of one


def test_the_batched_least_squares_reaches_scipys_optimum():
    """levenberg_marquardt (numpy, batched over starts and replicates) ends where scipy.optimize.least_squares
    (trf) ends from the same starts, on 30 random shared-fit problems: its cost at most 1e-9 of itself above
    scipy's (both stop at relative cost changes far below that)."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        k, n_points = rng.integers(1, 4), rng.integers(4, 8)
        c = np.geomspace(1e14, 1e14 * rng.uniform(10, 1000), n_points)
        l_inf, alpha = rng.uniform(0, 2), rng.uniform(0.05, 0.6)
        data = {v: (c, (l_inf + rng.uniform(0.5, 3) * (c / c[0]) ** -alpha) * np.exp(rng.normal(0, 0.02, n_points)),
                    rng.integers(1, 4, n_points).astype(float)) for v in range(k)}
        fit = fit_loss_vs_compute_shared(data)
        x, which, log_l, w, _ = _stack(data, list(data), None)
        lmin = float(np.exp(log_l.min()))
        lower, upper = [0.0, 1e-3] + [-50.0] * k, [lmin * (1 - 1e-9), 3.0] + [50.0] * k

        def resid(p):
            return _weighted_residual(p[None], x, which, log_l[None], w)[0][0]

        medians = [float(np.median(np.exp(log_l[which == i]))) for i in range(k)]
        best = min((least_squares(resid, np.clip(p0, np.array(lower) + 1e-12, np.array(upper) - 1e-12),
                                  bounds=(lower, upper), method="trf", x_scale="jac", ftol=1e-12, xtol=1e-12,
                                  gtol=1e-12) for p0 in _starts(lmin, medians, None)), key=lambda r: r.cost)
        assert 0.5 * np.sum(resid(fit.theta) ** 2) <= best.cost * (1 + 1e-9)


# --------------------------------------------------------------------------------------------------
# The report: multipliers.csv, the headline, the primary comparisons
# --------------------------------------------------------------------------------------------------

CONTRACT = ["variant", "N", "C", "multiplier", "lo", "hi", "method", "adequate"]


def test_multipliers_csv_from_run_folders(tmp_path):
    from analysis.report import main as report

    write_scaling_ladder(tmp_path / "runs", sizes=SIZES, multiplier=1.5, seeds=(0, 1, 2), noise=0.01)
    text = report([str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--formats", "png",
                   "--n-boot-multipliers", "300"]).read_text()
    table = pd.read_csv(tmp_path / "rep" / "multipliers.csv")
    assert set(CONTRACT) <= set(table.columns)
    per = table[table["method"] == "per_size"]
    assert len(per) == 5 and (per["variant"] == "glu=swiglu").all() and per["N"].notna().all()
    [fit] = table[table["method"] == "fit"].to_dict("records")
    assert fit["variant"] == "glu=swiglu" and fit["adequate"] in (True, "True")
    for needle in ("### Compute multipliers", "**Seed noise**", "**Per size.**", "**Trend.**",
                   "**L(C) fits against the seed noise.**", "[multipliers.csv](multipliers.csv)"):
        assert needle in text, needle


def test_multipliers_csv_from_an_external_table_with_seeds(tmp_path):
    """--csv with `seed` in --map, --variant-col and --baseline-variant: points pool their seeds, and the table
    has the same contract."""
    from analysis.report import main as report

    rng = np.random.default_rng(0)
    rows = [{"arch": arch, "params": n, "tokens": 20 * n, "flops": 120 * n * n, "run_seed": s,
             "val": law(k * n, k * 20 * n) + rng.normal(0, 0.01)}
            for arch, k in (("ref", 1.0), ("new", np.sqrt(1.5))) for n in SIZES for s in range(3)]
    pd.DataFrame(rows).to_csv(tmp_path / "t.csv", index=False)
    report(["--csv", str(tmp_path / "t.csv"), "--map", "N=params,D=tokens,C=flops,loss=val,seed=run_seed",
            "--variant-col", "arch", "--baseline-variant", "ref", "--out", str(tmp_path / "rep"), "--formats", "png",
            "--n-boot-multipliers", "300"])
    table = pd.read_csv(tmp_path / "rep" / "multipliers.csv")
    assert set(CONTRACT) <= set(table.columns)
    per = table[table["method"] == "per_size"]
    assert (per["variant"] == "new").all() and (per["n"] == 3).all() and len(per) == 5
    inside = per[per["extrapolated"].isna()]  # one step beyond the last point the chord errs by a few % (below)
    assert len(inside) == 4 and ((inside["lo"] <= 1.5) & (1.5 <= inside["hi"])).all()
    assert table.loc[table["method"] == "fit", "adequate"].astype(str).tolist() == ["True"]


def test_the_headline_gives_a_wall_clock_multiplier_only_at_a_stated_utilisation(tmp_path):
    """A SwiGLU ladder at 1/1.5 of the compute and 0.8x the tokens/s: at 40% MFU the headline's wall-clock
    multiplier is the adequate fit's 1.5 x 0.8 = 1.2; the same runs at 5% MFU get none, and say why; the MFU
    is the runs' median speed/mfu."""
    _, runs, df = ladder(tmp_path / "fast", multiplier=1.5, seeds=(0, 1, 2), noise=0.001, throughput=0.8, mfu=0.4)
    assert runs["mfu_median"].eq(0.4).all()
    mult = compute_multipliers(df, n_boot=300)
    h = headline(ablation_table(runs), mult).iloc[0]
    assert (h["switch"], h["option"], h["n"]) == ("glu", "swiglu", 3) and h["N"] == pytest.approx(SIZES[-1], rel=1e-6)
    assert h["fit_verdict"] == "adequate" and h["fit_multiplier"] == pytest.approx(1.5, rel=0.05)
    assert h["tokens_per_s_rel"] == pytest.approx(0.8) and h["mfu"] == pytest.approx(0.4)
    assert h["wall_clock"] == pytest.approx(0.8 * h["fit_multiplier"])
    assert h["wall_clock_lo"] <= 1.2 <= h["wall_clock_hi"]
    assert h["per_size"].count("M: ") == 5 and h["per_size"].endswith("*")  # the largest size extrapolated
    _, runs, df = ladder(tmp_path / "idle", multiplier=1.5, seeds=(0, 1, 2), noise=0.001, throughput=0.8, mfu=0.05)
    h = headline(ablation_table(runs), compute_multipliers(df, n_boot=300)).iloc[0]
    assert np.isnan(h["wall_clock"]) and h["wall_clock_note"].startswith("utilisation 5.0% < 20%")


def test_an_inadequate_fit_gives_the_headline_no_fitted_multiplier(tmp_path):
    _, runs, df = ladder(tmp_path, multiplier=1.2, growth=0.15, seeds=(0, 1, 2), noise=0.01)
    h = headline(ablation_table(runs), compute_multipliers(df, n_boot=300)).iloc[0]
    assert h["fit_verdict"] == "inadequate" and np.isnan(h["fit_multiplier"])
    assert h["trend_verdict"] == "grows with scale" and h["per_size"].startswith("6.59M: 1.")
    assert h["wall_clock_note"] == "compute multiplier from N=4.32e+07"  # the per-size one, where throughput was timed


def test_holm_runs_over_the_primary_comparisons_alone(tmp_path):
    """Two primaries: their p-values adjusted over a family of two (statsmodels' Holm), every other comparison
    exploratory with no adjusted p and a verdict that says so; a primary that names no run stops the report in
    one line before anything is written."""
    write_ablation_sweep(tmp_path / "sweep", broken=False)
    runs = collect([tmp_path / "sweep"], curves=False).runs
    table = ablation_table(runs, primary=["glu=swiglu", "residual=standard"])
    tested = table[table["test"] == "paired t"]
    primary = tested[tested["family"] == "primary"]
    assert table.attrs["n_comparisons"] == 2 and set(primary["option"]) == {"swiglu", "standard"}
    np.testing.assert_allclose(primary["p_holm"], multipletests(primary["p_value"], method="holm")[1])
    exploratory = tested[tested["family"] == "exploratory"]
    assert len(exploratory) == 3 and exploratory["p_holm"].isna().all()
    assert exploratory["verdict"].str.startswith("exploratory (p ").all()
    assert (ablation_table(runs)["family"] == "all").all()

    import subprocess
    import sys
    from pathlib import Path

    study = tmp_path / "study.yaml"
    study.write_text("primary:\n  - glu=swiglu\n  - moe=dense\n")
    out = tmp_path / "rep"
    res = subprocess.run([sys.executable, "-m", "analysis.report", str(tmp_path / "sweep"), "--primary", str(study),
                          "--out", str(out)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode != 0 and not out.exists()
    assert res.stderr.strip().splitlines()[-1].startswith("analysis.report: --primary") and "moe=dense" in res.stderr
    study.write_text("primary: [glu=swiglu, residual=standard]\n")
    from analysis.report import main as report

    text = report([str(tmp_path / "sweep"), "--primary", str(study), "--out", str(out), "--formats", "png"]).read_text()
    assert "**Primary comparisons** (declared in" in text and "over their 2 tests alone" in text
    assert "**The test, chosen before the data:** two-sided paired t-test" in text
    assert "**Validation set:** 65,536 tokens per run (256 windows of 256). The part of a paired difference" in text
    assert json.loads(pd.read_csv(out / "headline.csv")["family"].value_counts().to_json()) == {
        "exploratory": 3, "primary": 2}
