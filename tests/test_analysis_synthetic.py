"""Analysis on synthetic data with a known truth: scaling fits recover the parameters, bootstrap intervals
cover the truth at about the nominal rate, compute multipliers are recovered, ablation statistics match
the effects written into synthetic run directories, and broken runs are skipped with their reason."""
import json
import shutil

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from scipy.optimize import check_grad

from analysis.ablate import ablation_table, variant_labels
from analysis.collect import collect, load_csv, select_rows
from analysis.scaling import (bootstrap_chinchilla, compute_multipliers, fit_chinchilla, fit_isoflop,
                              fit_loss_vs_compute, huber_lse_objective, init_grid, leave_largest_out)
from analysis.synthetic import ABLATION_DELTAS, law, write_ablation_sweep, write_isoflop_grid, write_scaling_ladder

TRUTH = {"E": 1.8, "A": 400.0, "B": 1500.0, "alpha": 0.34, "beta": 0.30}
FEW_STARTS = np.array([[a, b, e, 0.5, 0.5] for a in (0.0, 10.0) for b in (0.0, 10.0) for e in (0.0, 1.0)])


def dataset(rng, sigma=0.004, sizes=8, ratios=6):
    """Runs on a grid of sizes x tokens-per-parameter, loss with multiplicative noise exp(N(0, sigma))."""
    n = np.repeat(np.geomspace(1e6, 1e9, sizes), ratios)
    d = n * np.tile(np.geomspace(2, 200, ratios), sizes)
    return n, d, law(n, d, TRUTH) * np.exp(rng.normal(0, sigma, len(n)))


def test_gradient_is_analytic_derivative():
    rng = np.random.default_rng(0)
    n, d, loss = dataset(rng, sigma=0.05)
    args = (np.log(n), np.log(d), np.log(loss), 1e-3)
    for theta in ([6.0, 7.0, 0.6, 0.34, 0.3], [3.0, 5.0, -0.5, 0.2, 0.4], [9.0, 2.0, 1.0, 0.6, 0.1]):
        err = check_grad(lambda t: huber_lse_objective(t, *args)[0], lambda t: huber_lse_objective(t, *args)[1],
                         np.array(theta), epsilon=1e-7)
        scale = np.linalg.norm(huber_lse_objective(np.array(theta), *args)[1])
        assert err < 1e-4 * max(scale, 1e-3)


def test_grids():
    full, coarse = init_grid("full"), init_grid("coarse")
    assert full.shape == (4500, 5) and coarse.shape == (108, 5)
    assert set(full[:, 3]) == {0, 0.5, 1, 1.5, 2} and set(full[:, 0]) == {0, 5, 10, 15, 20, 25}
    with pytest.raises(ValueError):
        init_grid("fine")


def test_fit_recovers_truth():
    n, d, loss = dataset(np.random.default_rng(1), sigma=0.002)
    fit = fit_chinchilla(n, d, loss, grid="coarse")
    assert fit.converged
    assert fit.alpha == pytest.approx(TRUTH["alpha"], abs=0.02)
    assert fit.beta == pytest.approx(TRUTH["beta"], abs=0.01)
    assert fit.E == pytest.approx(TRUTH["E"], rel=0.03)
    np.testing.assert_allclose(fit.predict(n, d), law(n, d, TRUTH), rtol=0.005)
    n_opt, d_opt = fit.optimal(1e21)
    assert n_opt * d_opt * 6 == pytest.approx(1e21)
    g = (TRUTH["alpha"] * TRUTH["A"] / (TRUTH["beta"] * TRUTH["B"])) ** (1 / (TRUTH["alpha"] + TRUTH["beta"]))
    true_n = g * (1e21 / 6) ** (TRUTH["beta"] / (TRUTH["alpha"] + TRUTH["beta"]))
    assert n_opt == pytest.approx(true_n, rel=0.25)


def test_bootstrap_coverage_is_nominal():
    """40 datasets; each fitted, bootstrapped (40 replicates) and its 95% percentile interval checked."""
    rng = np.random.default_rng(2024)
    names = ("E", "alpha", "beta")
    hits = {k: 0 for k in names}
    est, width = {k: [] for k in names}, {k: [] for k in names}
    for i in range(40):
        n, d, loss = dataset(rng, sizes=6, ratios=5)
        fit = fit_chinchilla(n, d, loss, grid=FEW_STARTS, n_jobs=1)
        boot = bootstrap_chinchilla(n, d, loss, n_boot=40, seed=i, init=fit.theta)
        assert boot.n_converged >= 36
        ci = boot.ci()
        for k in names:
            hits[k] += ci.loc[k, "lo"] <= TRUTH[k] <= ci.loc[k, "hi"]
            est[k].append(getattr(fit, k))
            width[k].append(ci.loc[k, "hi"] - ci.loc[k, "lo"])
    for k in names:
        assert 32 <= hits[k], f"{k}: {hits[k]}/40 intervals cover the truth"
        # calibrated width: mean interval width against the 95% spread of the estimates across datasets
        ratio = np.mean(width[k]) / (2 * 1.96 * np.std(est[k]))
        assert 0.6 < ratio < 1.7, f"{k}: width/spread {ratio:.2f}"


def test_leave_largest_out_predicts_held_out_size():
    n, d, loss = dataset(np.random.default_rng(3), sigma=0.002)
    fit, held = leave_largest_out(n, d, loss, n_sizes=1, grid="coarse")
    assert len(held) == 6 and np.all(held["N"] == n.max())
    assert held["rel_err"].abs().max() < 0.02
    assert fit.n_points == len(n) - 6


def test_isoflop_recovers_allocation_exponent(tmp_path):
    write_isoflop_grid(tmp_path, noise=0.0)
    runs = collect([tmp_path], curves=False).runs
    iso = fit_isoflop(runs["params_active"], runs["flops"], runs["loss_val_final"], n_boot=50)
    assert iso.parabolas["valid"].all() and len(iso.parabolas) == 4
    assert iso.a == pytest.approx(0.5, abs=0.02)  # beta / (alpha + beta) with alpha = beta
    assert iso.a + iso.b == pytest.approx(1.0, abs=1e-9)


def _ladder(rng, m, noise=0.002):
    """Baseline and variant ladders; the variant reaches the baseline's loss with 1/m of the compute."""
    rows = []
    p = {"E": 2.0, "A": 60.0, "B": 150.0, "alpha": 0.3, "beta": 0.3}
    for variant, k in (("baseline", 1.0), ("better", np.sqrt(m))):
        for n in np.geomspace(1e5, 3e7, 8):
            d = 20 * n
            rows.append({"variant": variant, "C": 6 * n * d,
                         "loss": law(k * n, k * d, p) * np.exp(rng.normal(0, noise))})
    return pd.DataFrame(rows)


def test_compute_multiplier_recovered():
    df = _ladder(np.random.default_rng(5), m=2.0)
    mult = compute_multipliers(df, "baseline", n_boot=100, seed=0)
    shared = mult[mult["kind"] == "shared"].iloc[0]
    assert shared["multiplier"] == pytest.approx(2.0, rel=0.05)
    assert shared["lo"] <= 2.0 <= shared["hi"]
    sep = mult[mult["kind"] == "separate"]
    assert len(sep) == 3
    assert sep["multiplier"].iloc[1] == pytest.approx(2.0, rel=0.1)
    assert (sep["lo"] <= 2.0).all() and (sep["hi"] >= 2.0).all()
    # L(C) itself: the variant's curve is the baseline's shifted by m in compute
    fb = fit_loss_vs_compute(df.loc[df.variant == "baseline", "C"], df.loc[df.variant == "baseline", "loss"])
    c = np.geomspace(1e13, 1e17, 5)
    np.testing.assert_allclose(fb.compute_for_loss(fb.predict(c)), c, rtol=1e-6)


def test_no_effect_gives_multiplier_one():
    df = _ladder(np.random.default_rng(6), m=1.0)
    shared = compute_multipliers(df, "baseline", n_boot=100, seed=0).query("kind == 'shared'").iloc[0]
    assert shared["lo"] <= 1.0 <= shared["hi"]


# --------------------------------------------------------------------------------------------------
# Run directories: collect and ablate
# --------------------------------------------------------------------------------------------------

@pytest.fixture()
def sweep(tmp_path):
    truth = write_ablation_sweep(tmp_path / "sweep", rng_seed=11)
    return tmp_path / "sweep", truth


def test_collect_skips_broken_runs(sweep):
    root, truth = sweep
    col = collect([root])
    assert len(col.runs) == len(truth) == 18
    reasons = dict(zip(col.skipped["run_id"], col.skipped["reason"]))
    assert set(reasons) == {"failed-s0", "running-s0", "truncated-s0"}
    assert reasons["failed-s0"].startswith("failed: RuntimeError")
    assert "running" in reasons["running-s0"]
    assert "truncated" in reasons["truncated-s0"]
    # switches flattened into columns, config read, curves long and complete
    assert {"decay", "glu", "balance", "optim", "residual", "moe", "mixer"} <= set(col.runs.columns)
    assert (col.runs["config.optim.lr"] == 0.02).all()
    assert set(col.curves["run_id"]) == set(col.runs["run_id"])
    lv = col.curves[col.curves["metric"] == "loss/val"]
    assert lv.groupby("run_id").size().eq(20).all()
    last = lv.sort_values("step").groupby("run_id")["value"].last()
    np.testing.assert_allclose(last.loc[col.runs["run_id"]].to_numpy(), col.runs["loss_val_final"].to_numpy())
    # globs and several paths give the same runs
    col2 = collect([str(root / "baseline-*"), str(root / "glu-*")], curves=False)
    assert len(col2.runs) == 6


def test_ablation_statistics(sweep):
    root, truth = sweep
    runs = collect([root], curves=False).runs
    tab = ablation_table(runs)
    base_ids = [f"baseline-s{s}" for s in range(3)]
    for (sw, opt), effect in ABLATION_DELTAS.items():
        row = tab[(tab.switch == sw) & (tab.option == opt)].iloc[0]
        ids = [f"{sw}-{opt}-s{s}" for s in range(3)]
        expected = np.mean([truth[i] for i in ids]) - np.mean([truth[i] for i in base_ids])
        assert row["delta"] == pytest.approx(expected, abs=1e-9)
        assert row["n"] == 3 and row["test"] == "paired t"
        assert row["delta_lo"] < effect < row["delta_hi"] or abs(row["delta"] - effect) < 0.003
        assert row["p_value"] < 0.05
        diffs = [truth[a] - truth[b] for a, b in zip(ids, base_ids)]
        assert row["p_value"] == pytest.approx(stats.ttest_1samp(diffs, 0).pvalue, rel=1e-6)
    base = tab[(tab.switch == "glu") & (tab.option == "situ")].iloc[0]
    vals = runs.loc[runs.run_id.isin(base_ids), "loss_val_final"]
    lo, hi = stats.t.interval(0.95, 2, loc=vals.mean(), scale=vals.std(ddof=1) / np.sqrt(3))
    assert (base["ci_lo"], base["ci_hi"]) == pytest.approx((lo, hi))
    assert set(tab.switch) == {"glu", "balance", "residual", "optim"}


def test_ablation_matching_and_welch(sweep):
    root, truth = sweep
    # a run that differs from the baseline in two switches belongs to neither ablation
    src = root / "glu-swiglu-s0"
    two = root / "two-switches-s0"
    shutil.copytree(src, two)
    s = json.loads((two / "summary.json").read_text())
    s["switches"]["balance"] = "sign"
    (two / "summary.json").write_text(json.dumps(s))
    # unmatched seeds -> Welch's test
    shutil.rmtree(root / "glu-swiglu-s2")
    runs = collect([root], curves=False).runs
    tab = ablation_table(runs)
    glu = tab[(tab.switch == "glu") & (tab.option == "swiglu")].iloc[0]
    assert glu["n"] == 2 and glu["test"] == "Welch t"
    a = runs.loc[runs.run_id.isin(["glu-swiglu-s0", "glu-swiglu-s1"]), "loss_val_final"]
    b = runs.loc[runs.run_id.str.startswith("baseline-"), "loss_val_final"]
    assert glu["p_value"] == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert tab[(tab.switch == "balance") & (tab.option == "sign")].iloc[0]["n"] == 3
    labels = variant_labels(runs)
    assert labels[runs.run_id == "two-switches-s0"].iloc[0] == "glu=swiglu,balance=sign"
    # overriding the baseline: swiglu becomes the reference of glu
    tab2 = ablation_table(runs, baseline={"glu": "swiglu"})
    assert tab2[(tab2.switch == "glu") & (tab2.test == "baseline")].iloc[0]["option"] == "swiglu"


def test_csv_mapping(tmp_path):
    p = tmp_path / "t.csv"
    pd.DataFrame({"Model Size": [1e6, 2e6, 2e6], "Training FLOP": [6e12, 2.4e13, 1.2e13], "val": [3.0, 2.9, 3.1],
                  "lr": [1, 1, 2]}).to_csv(p, index=False)
    df = load_csv(p, "N=Model Size,C=Training FLOP,loss=val")
    np.testing.assert_allclose(df["D"], [1e6, 2e6, 1e6])
    best = select_rows(df, best_of=["N"], where=["D >= 1e6"])
    assert list(best["loss"]) == [3.0, 2.9]
    with pytest.raises(KeyError, match="not found"):
        load_csv(p, "N=params,C=Training FLOP,loss=val")


def test_report_end_to_end(tmp_path):
    from analysis.report import main as report

    write_ablation_sweep(tmp_path / "runs" / "ablation")
    write_scaling_ladder(tmp_path / "runs" / "ladder", sizes=np.geomspace(1e5, 3e7, 6))
    path = report([str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--grid", "coarse", "--n-boot", "10",
                   "--n-boot-small", "10"])
    text = path.read_text()
    for needle in ("Skipped runs", "failed: RuntimeError", "## Ablations", "paired t", "Approach 3",
                   "Compute multiplier", "Leave-largest-size-out"):
        assert needle in text, needle
    pngs = list((tmp_path / "rep").glob("*.png"))
    assert {"ablation_deltas.png", "curves_glu.png", "maxvio_balance.png", "compute_multipliers.png"} <= {p.name for p in pngs}
    assert all(p.stat().st_size < 150_000 and p.with_suffix(".svg").exists() for p in pngs)


def test_single_thread_blas_without_threadpoolctl(monkeypatch):
    """The ctypes fallback limits every loaded OpenBLAS to one thread inside the block and restores it."""
    import analysis._blas as blas
    import scipy.optimize  # noqa: F401  (loads scipy's OpenBLAS)

    monkeypatch.setattr(blas, "threadpool_limits", None)
    handles = blas._openblas_handles()
    if not handles:
        pytest.skip("no OpenBLAS loaded (other BLAS vendor or not Linux)")
    before = [get() for get, _ in handles]
    with blas.single_thread_blas():
        assert all(get() == 1 for get, _ in handles)
    assert [get() for get, _ in handles] == before


def test_repeated_runs_of_one_seed_count_once():
    """Two run directories of the same configuration and seed (e.g. the baseline run by two sweeps)
    are one sample: n counts seeds, and the interval is not made up from a duplicate."""
    base = {"decay": "sigmoid", "glu": "situ", "balance": "qb", "optim": "muon_per_head",
            "residual": "block_attnres", "moe": "latent_norm", "mixer": "hybrid", "model": "tiny",
            "data": "sotu", "tokens": 1000}
    rows = [dict(base, seed=0, loss_val_final=3.0), dict(base, seed=0, loss_val_final=3.0),
            dict(base, seed=1, loss_val_final=3.2),
            dict(base, glu="swiglu", seed=0, loss_val_final=3.1), dict(base, glu="swiglu", seed=1, loss_val_final=3.3)]
    table = ablation_table(pd.DataFrame(rows))
    glu = table[table["switch"] == "glu"].set_index("option")
    assert glu.loc["situ", "n"] == 2 and glu.loc["swiglu", "n"] == 2
    assert glu.loc["swiglu", "delta"] == pytest.approx(0.1)


def test_sizes_of_one_model_config_are_separate_cells():
    """A ladder shares one model config name across depths: runs of different sizes are never pooled
    into one cell (nor collapsed as repeats of one seed); each size gets its own comparison."""
    base = {"decay": "sigmoid", "glu": "situ", "balance": "qb", "optim": "muon_per_head",
            "residual": "block_attnres", "moe": "latent_norm", "mixer": "hybrid", "model": "ladder",
            "data": "sotu", "tokens": 1000, "seed": 0}
    rows = [dict(base, n_layers=L, d_model=64 * L, glu=g, loss_val_final=4.0 - 0.1 * L + (0.05 if g == "swiglu" else 0))
            for L in (2, 4) for g in ("situ", "swiglu")]
    table = ablation_table(pd.DataFrame(rows))
    swiglu = table[(table["switch"] == "glu") & (table["option"] == "swiglu")].set_index("n_layers")
    assert sorted(swiglu.index) == [2, 4]
    assert (swiglu["n"] == 1).all()
    assert swiglu["delta"].tolist() == pytest.approx([0.05, 0.05])
