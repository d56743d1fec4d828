"""Analysis on synthetic data with a known truth: scaling fits recover the parameters, bootstrap intervals
cover the truth at about the nominal rate, ablation statistics match the effects written into synthetic run
directories, cells never pool runs that differ in anything but the seed and bookkeeping, learning-rate
grids are never averaged and the tuned comparison picks each option's own best rate on the tuning seeds,
Holm and the minimum detectable effect agree with independent calculations, and every run directory is
reported: used, partially read or skipped with its reason. Compute multipliers:
tests/test_analysis_multipliers.py."""
import json
import shutil

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from scipy.optimize import check_grad

from analysis.ablate import ablation_table, display_table
from analysis.approach3 import (bootstrap_chinchilla, fit_chinchilla, flops_per_param_token, huber_lse_objective,
                                init_grid, leave_largest_out)
from analysis.cells import variant_labels
from analysis.collect import collect, load_csv, runs_to_scaling, select_rows
from analysis.headline import display_headline, headline
from analysis.isoflop import fit_isoflop
from analysis.stats import holm, mde_paired, mde_welch
from analysis.tuning import next_commands, tuning_table
from analysis.synthetic import (ABLATION_DELTAS, law, write_ablation_sweep, write_isoflop_grid, write_lr_grid,
                                write_run, write_scaling_ladder)

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
    iso = fit_isoflop(runs["params_active_non_embedding"], runs["flops"], runs["loss_val_final"], n_boot=50)
    assert iso.parabolas["valid"].all() and len(iso.parabolas) == 4
    assert iso.a == pytest.approx(0.5, abs=0.02)  # beta / (alpha + beta) with alpha = beta
    assert iso.a + iso.b == pytest.approx(1.0, abs=1e-9)


# --------------------------------------------------------------------------------------------------
# Run directories: collect and ablate
# --------------------------------------------------------------------------------------------------

@pytest.fixture()
def sweep(tmp_path):
    truth = write_ablation_sweep(tmp_path / "sweep", rng_seed=11)
    return tmp_path / "sweep", truth


def test_collect_reports_every_directory(sweep):
    """Used, partially read (a truncated metrics.jsonl: its summary and good lines count) or skipped with the
    reason, a directory without summary.json included; nothing is dropped silently."""
    root, truth = sweep
    col = collect([root])
    assert len(col.runs) == len(truth) == 18
    assert len(col.dirs) == 21 and set(col.dirs["state"]) == {"used", "partial", "skipped"}
    reasons = dict(zip(col.skipped["run_id"], col.skipped["reason"]))
    assert set(reasons) == {"failed-s0", "running-s0", "nosummary-s0"}
    assert reasons["failed-s0"].startswith("failed: RuntimeError")
    assert "running" in reasons["running-s0"]
    assert reasons["nosummary-s0"].startswith("summary.json missing")
    [(rid, why)] = zip(col.partial["run_id"], col.partial["reason"])
    assert rid == "baseline-s2" and "truncated" in why and "20 good lines" in why
    part = col.runs.set_index("run_id").loc["baseline-s2"]
    assert part["loss_val_final"] == pytest.approx(truth["baseline-s2"] + law(2e6, 5e7)) and "truncated" in part["read_note"]
    # switches flattened into columns, config read, curves long and complete
    assert {"decay", "glu", "balance", "optim", "residual", "moe", "mixer"} <= set(col.runs.columns)
    muon = col.runs["optim"] != "adamw"
    assert (col.runs.loc[muon, "config.optim.lr"] == 0.006).all() and col.runs.loc[~muon, "config.optim.lr"].isna().all()
    assert col.runs["overrides"].map(json.loads).map(lambda o: o[-1].startswith("seed=")).all()
    assert set(col.curves["run_id"]) == set(col.runs["run_id"])
    lv = col.curves[col.curves["metric"] == "loss/val"]
    sizes = lv.groupby("run_id").size()
    assert sizes.drop("baseline-s2").eq(21).all() and sizes["baseline-s2"] == 20  # step 0 + 20; the cut line lost
    last = lv.sort_values("step").groupby("run_id")["value"].last()
    whole = col.runs[col.runs["run_id"] != "baseline-s2"]
    np.testing.assert_allclose(last.loc[whole["run_id"]].to_numpy(), whole["loss_val_final"].to_numpy())
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
    write_isoflop_grid(tmp_path / "runs" / "iso", n_per_budget=5)  # baseline runs at several D/N per size
    path = report([str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--grid", "coarse", "--n-boot", "10",
                   "--n-boot-small", "10"])
    text = path.read_text()
    for needle in ("Skipped runs", "failed: RuntimeError", "summary.json missing", "Partially read runs",
                   "## Headline", "## Ablations", "paired t", "p (Holm)", "Approach 3", "Compute multiplier",
                   "Leave-largest-size-out", "kappa = 6", "N = active_non_embedding", "Approach 2 (isoFLOP"):
        assert needle in text, needle
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    assert ["model", "variant", "runs", "seeds", "tokens", "commits"] in rows  # who ran them
    assert any(r[-3:] == ["used", "", "synthetic"] for r in rows)
    assert text.index("## Headline") < text.index("## Ablations")
    pngs = list((tmp_path / "rep").glob("*.png"))
    assert {"ablation_deltas.png", "curves_glu.png", "maxvio_balance.png", "compute_multipliers.png"} <= {p.name for p in pngs}
    assert all(p.stat().st_size < 150_000 and p.with_suffix(".svg").exists() for p in pngs)



def test_a_ladder_at_one_tokens_per_parameter_ratio_skips_approaches_3_and_2_and_keeps_the_multipliers(tmp_path):
    """Every run at 20 tokens per parameter: L(N, D) cannot separate N from D, so the report fits no approach 3
    or 2 (it says why) and still gives L(C) per variant and the compute multiplier."""
    from analysis.report import main as report

    write_scaling_ladder(tmp_path / "runs", sizes=np.geomspace(1e5, 3e7, 6))
    text = report([str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--n-boot-small", "10"]).read_text()
    assert "Approaches 3 and 2: skipped: every run has D/N between 20 and 20" in text
    assert "### Approach 3" not in text and "### Approach 2" not in text
    assert "### Compute multipliers" in text and "(multipliers.csv)" in text


def test_a_report_written_again_removes_the_figures_it_no_longer_writes_and_nothing_else(tmp_path):
    """First with an isoFLOP grid (approach 3 and 2 figures), then on a fixed-ratio ladder into the same
    folder: the approach figures of the first report go, the second's files and a file of the user's stay."""
    from analysis.report import main as report

    write_isoflop_grid(tmp_path / "iso", n_per_budget=5)
    write_scaling_ladder(tmp_path / "ladder", sizes=np.geomspace(1e5, 3e7, 6))
    out = tmp_path / "rep"
    report([str(tmp_path / "iso"), "--out", str(out), "--grid", "coarse", "--n-boot", "5", "--n-boot-small", "5"])
    assert (out / "isoflop.png").exists() and (out / "optimal_allocation.svg").exists()
    (out / "notes.txt").write_text("mine")
    report([str(tmp_path / "ladder"), "--out", str(out), "--n-boot-small", "5"])
    names = {p.name for p in out.iterdir()}
    assert not names & {"isoflop.png", "isoflop.svg", "optimal_allocation.png", "loss_vs_compute_fit.png"}, names
    assert {"report.md", "notes.txt", "compute_multipliers.png", "ablation.csv"} <= names, names
    assert set((out / ".report-files").read_text().split()) == names - {"notes.txt", ".report-files"}

def test_single_thread_blas_limits_every_blas_pool_and_restores_it():
    """Inside the block every BLAS thread pool that threadpoolctl sees runs one thread; after it, as before."""
    from threadpoolctl import threadpool_info

    from analysis._blas import single_thread_blas
    import scipy.optimize  # noqa: F401  (loads scipy's BLAS)

    def blas_threads():
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]

    before = blas_threads()
    assert before, "numpy and scipy load a BLAS"
    with single_thread_blas():
        assert set(blas_threads()) == {1}
    assert blas_threads() == before


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
    assert "seed 0 run 2 times (averaged)" in glu.loc["situ", "warnings"]  # flagged, never silently
    assert "times" not in glu.loc["swiglu", "warnings"] and "n=2 < 3 seeds" in glu.loc["swiglu", "warnings"]


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


def test_runs_sized_by_tokens_per_parameter_share_a_cell_across_option_sizes():
    """Under train.tokens_per_param an option with more parameters trains more tokens by design: it is
    compared with the baseline at the same rule. Runs whose lengths were given as steps match on tokens."""
    base = {"decay": "sigmoid", "glu": "situ", "balance": "qb", "optim": "muon_per_head",
            "residual": "block_attnres", "moe": "latent_norm", "mixer": "hybrid", "model": "ladder",
            "data": "tokens", "n_layers": 4, "d_model": 256, "tokens_per_step": 32768, "seed": 0}
    by_rule = [dict(base, residual=r, tokens=t, length_from="tokens_per_param", tokens_per_param=5,
                    flop_budget=None, loss_val_final=2.2 + (0.01 if r == "standard" else 0))
               for r, t in (("block_attnres", 32964608), ("standard", 32931840))]
    table = ablation_table(pd.DataFrame(by_rule))
    row = table[(table["switch"] == "residual") & (table["option"] == "standard")].iloc[0]
    assert row["length"] == "5 tokens per parameter" and row["tokens"] == 32931840
    assert row["delta"] == pytest.approx(0.01)

    by_steps = [dict(r, length_from="max_steps", tokens_per_param=None) for r in by_rule]
    table = ablation_table(pd.DataFrame(by_steps))
    assert not (table["switch"] == "residual").any()
    assert any("not compared" in n for n in table.attrs["notes"])


# --------------------------------------------------------------------------------------------------
# Cells: the whole config but the seed, the bookkeeping and the keys compared
# --------------------------------------------------------------------------------------------------

def test_a_run_differing_in_an_off_switch_key_is_a_cell_of_its_own(sweep, tmp_path):
    """Runs at another init scale (a key no switch owns) never pool with the rest: they form a cell of their
    own, named by the key; bookkeeping (run name, output folder, logger, kernel backend, device count) does
    not."""
    root, truth = sweep
    rng = np.random.default_rng(0)
    base, swiglu = dict(analysis_default()), {**analysis_default(), "glu": "swiglu"}
    for name, sw in (("std-base-s0", base), ("std-swiglu-s0", swiglu)):
        write_run(root / name, sw, 0, 2e6, 5e7, 0.5, rng, config={"model": {"init_std": 0.01}})
    write_run(root / "moved-swiglu-s5", swiglu, 5, 2e6, 5e7, 0.03, rng,
              config={"out_dir": "/elsewhere", "logger": {"wandb": True}, "kernels": {"backend": "triton"},
                      "trainer": {"devices": 2}})
    tab = ablation_table(collect([root], curves=False).runs)
    glu = tab[tab["switch"] == "glu"]
    assert sorted(glu["cell"].unique()) == ["model.init_std=0.01", "model.init_std=0.02"]
    main = glu[glu["cell"] == "model.init_std=0.02"].set_index("option")
    assert main.loc["situ", "n"] == 3 and main.loc["swiglu", "n"] == 4      # s5 pools: it differs in bookkeeping only
    assert "moved-swiglu-s5" in main.loc["swiglu", "run_ids"]
    odd = glu[glu["cell"] == "model.init_std=0.01"].set_index("option")
    assert odd.loc["situ", "run_ids"] == "std-base-s0" and odd.loc["swiglu", "n"] == 1
    assert odd.loc["swiglu", "delta"] == pytest.approx(0.0, abs=1e-12)  # both at offset 0.5: nothing from the rest
    assert not any("std-" in ids for ids in tab[tab["switch"] != "glu"]["run_ids"])  # the lone baseline: no row


def analysis_default() -> dict:
    from analysis.switches import K3_DEFAULT

    return K3_DEFAULT


# --------------------------------------------------------------------------------------------------
# Learning-rate grids and the tuned comparison
# --------------------------------------------------------------------------------------------------

OPTIMA = {"latent_norm": (0.006, 0.01, 0.0), "dense_matched": (0.012, 0.01, 0.02)}


def test_lr_grid_is_never_averaged(tmp_path):
    """Untuned, every rate is a cell of its own: each option has 9 rows of 4 seeds, never one row of 36, and
    each delta is the truth at that rate."""
    truth = write_lr_grid(tmp_path, "moe", OPTIMA)
    tab = ablation_table(collect([tmp_path], curves=False).runs)
    moe = tab[tab["switch"] == "moe"]
    for opt in OPTIMA:
        rows = moe[moe["option"] == opt]
        assert len(rows) == 9 and rows["rate"].nunique() == 9 and (rows["n"] == 4).all()
    for _, r in moe[moe["option"] == "dense_matched"].iterrows():
        ids = r["run_ids"].split(";")
        base = [i.replace("dense_matched", "latent_norm") for i in ids]
        assert r["delta"] == pytest.approx(np.mean([truth[i] for i in ids]) - np.mean([truth[i] for i in base]))


def test_tuned_comparison_picks_each_options_rate_on_the_tuning_seeds(tmp_path):
    """Tuned: each option at its own best rate, chosen on seed 1000 and reported on seeds 0-2; the row says the
    rate and that dense_matched's best lr is the highest of the grid. The choice follows the tuning seed
    alone: a tuning run made worse moves latent_norm's choice though the reported seeds disagree."""
    truth = write_lr_grid(tmp_path, "moe", OPTIMA)
    runs = collect([tmp_path], curves=False).runs
    tab = ablation_table(runs, tune=True).set_index("option")
    assert tab.loc["latent_norm", "rate"] == "optim.lr=0.006, optim.adam_lr=0.01"
    assert tab.loc["dense_matched", "rate"] == "optim.lr=0.012, optim.adam_lr=0.01"
    assert tab.loc["latent_norm", "grid_edge"] == "" and \
        tab.loc["dense_matched", "grid_edge"] == "optim.lr at the highest of 3 values"
    assert "grid edge" in tab.loc["dense_matched", "warnings"]
    assert (tab["seeds"] == "0,1,2").all() and (tab["n"] == 3).all()
    ids = tab.loc["dense_matched", "run_ids"].split(";")
    assert all("lr0.012-alr0.01-s" in i for i in ids)
    expected = np.mean([truth[i] for i in ids]) - np.mean([truth[i.replace("dense_matched", "latent_norm")
                                                           .replace("lr0.012", "lr0.006")] for i in ids])
    assert tab.loc["dense_matched", "delta"] == pytest.approx(expected)
    tuning = tuning_table(ablation_table(runs, tune=True))
    assert len(tuning) == 18 and tuning["chosen"].sum() == 2 and (tuning["n_tune"] == 1).all()
    chosen = tuning[tuning["chosen"]].set_index("option")
    assert chosen.loc["dense_matched", "command"] == ("python run.py -m moe=dense_matched optim.lr=0.012 "
                                                      "optim.adam_lr=0.01 sweep=tune_moe seed=0,1,2")
    assert chosen.loc["latent_norm", "command"].startswith("python run.py -m moe=latent_norm optim.lr=0.006 ")
    # make latent_norm's best rate look bad on the tuning seed only: the choice moves to a neighbour
    run = runs.index[runs["run_id"] == "moe-latent_norm-lr0.006-alr0.01-s1000"][0]
    runs.loc[run, "loss_val_final"] += 1.0
    moved = ablation_table(runs, tune=True).set_index("option")
    assert moved.loc["latent_norm", "rate"] != "optim.lr=0.006, optim.adam_lr=0.01"
    assert moved.loc["latent_norm", "seeds"] == "0,1,2"


def test_tuned_comparison_picks_an_options_query_rate_on_the_tuning_seed(tmp_path):
    """A key of the switch's own group (AttnRes' residual.query_lr_scale) is chosen per option like a rate, on
    the tuning seed alone: block_attnres is reported at the query rate that won on seed 1000 though its
    reported seeds favour the other one, and the standard residual, whose query rate stays at the unread
    default, is chosen on optim.lr_scale alone."""
    rng = np.random.default_rng(5)
    # true offsets: standard best at lr_scale 2; block best at query rate 0.1 on the tuning seed, 1 elsewhere
    grid = [("standard", 1.0, 1.0, 0.05, 0.05), ("standard", 1.0, 2.0, 0.02, 0.02),
            ("block_attnres", 0.1, 1.0, 0.03, 0.03), ("block_attnres", 0.1, 2.0, 0.00, 0.01),
            ("block_attnres", 1.0, 1.0, 0.06, 0.06), ("block_attnres", 1.0, 2.0, 0.04, -0.05)]
    seed_effect = {1000: 0.0, 0: 0.002, 1: -0.001, 2: 0.001}  # shared by every run of a seed (paired)
    truth = {}
    for opt, q, scale, tune_off, report_off in grid:
        for s, effect in seed_effect.items():
            rid = f"residual-{opt}-q{q:g}-x{scale:g}-s{s}"
            truth[rid] = (tune_off if s >= 1000 else report_off) + effect
            write_run(tmp_path / rid, {**analysis_default(), "residual": opt}, s, 2e6, 5e7, truth[rid], rng,
                      config={"residual": {"query_lr_scale": q}, "optim": {"lr_scale": scale}},
                      overrides=[f"residual={opt}", f"optim.lr_scale={scale:g}",
                                 *([f"residual.query_lr_scale={q:g}"] if opt != "standard" else []),
                                 "sweep=tune_residual"])
    tab = ablation_table(collect([tmp_path], curves=False).runs, tune=True, baseline={"residual": "standard"})
    res = tab[tab["switch"] == "residual"].set_index("option")
    assert res.loc["block_attnres", "setting"] == "residual.query_lr_scale=0.1"
    assert res.loc["block_attnres", "rate"].endswith("optim.lr_scale=2")
    assert res.loc["standard", "rate"].endswith("optim.lr_scale=2") and res.loc["standard", "setting"] == ""
    assert (res["seeds"] == "0,1,2").all()
    ids = res.loc["block_attnres", "run_ids"].split(";")
    assert all("-q0.1-x2-s" in i for i in ids)
    base = [i.replace("block_attnres-q0.1", "standard-q1") for i in ids]
    assert res.loc["block_attnres", "delta"] == pytest.approx(np.mean([truth[i] for i in ids])
                                                              - np.mean([truth[i] for i in base]))


def test_tuning_before_the_reported_seeds_prints_their_commands(tmp_path):
    """Grid on the tuning seed only: the tuned rows have no reported runs yet and say which command runs them."""
    write_lr_grid(tmp_path, "moe", OPTIMA, report_all=False)
    tab = ablation_table(collect([tmp_path], curves=False).runs, tune=True).set_index("option")
    assert (tab["n"] == 0).all() and tab.loc["dense_matched", "verdict"] == "no runs to compare"
    assert ("no reported seeds at the chosen setting yet: python run.py -m moe=dense_matched optim.lr=0.012 "
            "optim.adam_lr=0.01 sweep=tune_moe seed=0,1,2") in tab.loc["dense_matched", "warnings"]


def test_a_choice_at_the_grid_edge_widens_the_grid_before_its_seeds_run(tmp_path):
    """next_commands: dense_matched's best lr is the grid's highest, so it runs one geometric step beyond
    on the tuning seed first; latent_norm's is inside, so its reported seeds run. Once the wider point is
    worse, dense_matched's seeds run at the old edge."""
    write_lr_grid(tmp_path, "moe", OPTIMA, report_all=False)
    runs = collect([tmp_path], curves=False).runs
    assert next_commands(ablation_table(runs, tune=True)) == [
        "python run.py -m moe=latent_norm optim.lr=0.006 optim.adam_lr=0.01 sweep=tune_moe seed=0,1,2",
        "python run.py -m moe=dense_matched optim.lr=0.024 optim.adam_lr=0.01 sweep=tune_moe seed=1000"]
    write_lr_grid(tmp_path, "moe", {"dense_matched": OPTIMA["dense_matched"]}, lrs=(0.024,), adam_lrs=(0.01,),
                  report_all=False)
    runs = collect([tmp_path], curves=False).runs
    assert next_commands(ablation_table(runs, tune=True))[1] == (
        "python run.py -m moe=dense_matched optim.lr=0.012 optim.adam_lr=0.01 sweep=tune_moe seed=0,1,2")


def test_optimizers_are_tuned_on_their_own_rates(tmp_path):
    """optim: Muon on lr x adam_lr, AdamW on adam_lr alone; AdamW's best at the grid's top is flagged."""
    write_lr_grid(tmp_path, "optim", {"muon_per_head": (0.006, 0.01, 0.0), "adamw": (0.006, 0.02, 0.05)})
    tab = ablation_table(collect([tmp_path], curves=False).runs, tune=True)
    opt = tab[tab["switch"] == "optim"].set_index("option")
    assert opt.loc["muon_per_head", "rate"] == "lr=0.006, adam_lr=0.01"
    assert opt.loc["adamw", "rate"] == "adam_lr=0.02"
    assert opt.loc["adamw", "grid_edge"] == "adam_lr at the highest of 3 values"
    assert opt.loc["adamw", "delta"] == pytest.approx(0.05, abs=0.01)


# --------------------------------------------------------------------------------------------------
# Holm, minimum detectable effects, N and FLOPs per row
# --------------------------------------------------------------------------------------------------

def holm_by_hand(p):
    """Holm's step-down adjustment written out: sort, multiply the i-th smallest by m - i + 1, running max, cap 1."""
    p = np.asarray(p, float)
    order = np.argsort(p)
    m = len(p)
    adj = np.maximum.accumulate([(m - i) * p[j] for i, j in enumerate(order)])
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return out


def test_holm_adjusts_over_the_whole_table(sweep):
    from statsmodels.stats.multitest import multipletests

    root, _ = sweep
    tab = ablation_table(collect([root], curves=False).runs)
    p = tab["p_value"].dropna().to_numpy()
    assert tab.attrs["n_comparisons"] == len(p) == 5
    np.testing.assert_allclose(tab["p_holm"].dropna(), multipletests(p, method="holm")[1])
    np.testing.assert_allclose(tab["p_holm"].dropna(), holm_by_hand(p))
    np.testing.assert_allclose(holm([0.01, np.nan, 0.04, 0.03]), [0.03, np.nan, 0.06, 0.06])
    assert (tab["p_holm"].dropna() >= tab["p_value"].dropna()).all()


def test_mde_is_the_effect_the_test_detects_with_power_08():
    """Paired: d* x sd of the differences with d* from statsmodels' TTestPower, and the noncentral t power at
    the MDE is 0.8. Welch: an independent simulation of scipy's Welch test rejects in 80% of draws at the MDE
    (few seeds, unequal spreads), and with many seeds and equal spreads it meets the pooled t-test's
    TTestIndPower."""
    from statsmodels.stats.power import TTestIndPower, TTestPower

    sd, n = 0.02, 3
    mde = mde_paired(sd, n)
    assert mde == pytest.approx(TTestPower().solve_power(nobs=n, alpha=0.05, power=0.8) * sd)
    nc, crit = mde / (sd / np.sqrt(n)), stats.t.ppf(0.975, n - 1)
    assert stats.nct.sf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc) == pytest.approx(0.8, abs=1e-6)
    rng = np.random.default_rng(7)
    for sa, na, sb, nb in ((0.01, 3, 0.03, 5), (0.02, 3, 0.02, 3)):
        delta = mde_welch(sa, na, sb, nb)
        a = rng.normal(delta, sa, (50_000, na))
        b = rng.normal(0.0, sb, (50_000, nb))
        rejected = stats.ttest_ind(a, b, axis=1, equal_var=False).pvalue < 0.05
        assert rejected.mean() == pytest.approx(0.8, abs=0.006), (sa, na, sb, nb)
    pooled = TTestIndPower().solve_power(nobs1=30, ratio=1, alpha=0.05, power=0.8) * sd
    assert mde_welch(sd, 30, sd, 30) == pytest.approx(pooled, rel=0.01)
    assert mde_welch(0.02, 3, 0.02, 3) > TTestIndPower().solve_power(nobs1=3, ratio=1, alpha=0.05, power=0.8) * 0.02


def test_the_paired_mde_holds_its_power_where_statsmodels_solver_fails():
    """Few seeds and a small alpha need large effects, where statsmodels' TTestPower.solve_power ends at a wrong
    root (n = 2, power 0.9: 10.0, power 0.73 there). The MDE is the root of the paired test's power at every
    (n, alpha, power) here, and 200,000 simulated paired t-tests at the MDE reject at that rate (Monte Carlo
    error of a rate of 0.9: 0.0007; bound 0.004)."""
    from analysis.stats import paired_power

    for n in (2, 3, 4, 10):
        for alpha in (0.05, 0.01, 0.001):
            for power in (0.8, 0.9, 0.95):
                mde = mde_paired(1.0, n, alpha, power)
                assert paired_power(mde, n, alpha)[0] == pytest.approx(power, abs=1e-9), (n, alpha, power)
    rng = np.random.default_rng(3)
    for n, alpha in ((2, 0.05), (3, 0.01)):
        mde = mde_paired(0.02, n, alpha, 0.9)
        x = rng.normal(mde, 0.02, (200_000, n))
        rate = np.mean(stats.ttest_1samp(x, 0.0, axis=1).pvalue < alpha)
        assert rate == pytest.approx(0.9, abs=0.004), (n, alpha)


def test_not_significant_rows_carry_their_mde_and_small_n_is_flagged():
    """A null effect: the verdict is 'not significant' with the MDE of the paired test at this n and spread;
    n = 2 seeds is said on the row. N and FLOPs per token are shown against the baseline."""
    base = {**analysis_default(), "model": "tiny", "data": "sotu", "tokens": 1000}
    rng = np.random.default_rng(1)
    rows = []
    for seed in (0, 1):
        shared = rng.normal(0, 0.01)
        rows.append(dict(base, seed=seed, loss_val_final=3.0 + shared, params_active_non_embedding=1e6,
                         flops_per_token=6e6, tokens_per_s_median=1000.0))
        rows.append(dict(base, moe="dense", seed=seed, loss_val_final=3.0 + shared + rng.normal(0, 0.01),
                         params_active_non_embedding=8e5, flops_per_token=5.1e6, tokens_per_s_median=1500.0))
    tab = ablation_table(pd.DataFrame(rows)).set_index("option")
    r = tab.loc["dense"]
    d = (pd.DataFrame(rows).query("moe == 'dense'")["loss_val_final"].to_numpy()
         - pd.DataFrame(rows).query("moe == 'latent_norm'")["loss_val_final"].to_numpy())
    assert r["test"] == "paired t" and r["p_holm"] > 0.05
    assert r["mde"] == pytest.approx(mde_paired(d.std(ddof=1), 2))
    assert r["verdict"].startswith("not significant (MDE ") and "n=2 < 3 seeds" in r["warnings"]
    assert (r["N_rel"], r["flops_rel"], r["tokens_per_s_rel"]) == pytest.approx((0.8, 0.85, 1.5))


def test_runs_that_shared_a_gpu_give_no_throughput_ratio_and_the_headline_takes_one_timed_alone():
    """A study whose runs trained several to a GPU (device_shared): their tokens/s say nothing of the
    option, so the row has no throughput ratio and says why; a short cell of the same size, each option
    run alone, gives the headline its ratio (0.8), and the delta stays the study cell's."""
    base = {**analysis_default(), "model": "tiny", "data": "sotu", "params_active_non_embedding": 1e6,
            "flops_per_token": 6e6}
    rng = np.random.default_rng(2)
    rows = []
    for seed in (0, 1, 2):
        noise = rng.normal(0, 0.01)
        rows.append(dict(base, tokens=1e8, seed=seed, loss_val_final=3.0 + noise, tokens_per_s_median=900.0,
                         device_shared=True, device_shared_why="load 3.1 on 2 cores"))
        rows.append(dict(base, glu="swiglu", tokens=1e8, seed=seed, loss_val_final=3.1 + noise,
                         tokens_per_s_median=1100.0, device_shared=True))
    rows.append(dict(base, tokens=1e6, seed=0, loss_val_final=4.0, tokens_per_s_median=1000.0, device_shared=False))
    rows.append(dict(base, glu="swiglu", tokens=1e6, seed=0, loss_val_final=4.1, tokens_per_s_median=800.0,
                     device_shared=False))
    tab = ablation_table(pd.DataFrame(rows))
    study = tab[(tab["option"] == "swiglu") & (tab["tokens"] == 1e8)].iloc[0]
    timing = tab[(tab["option"] == "swiglu") & (tab["tokens"] == 1e6)].iloc[0]
    assert np.isnan(study["tokens_per_s_rel"]) and np.isnan(study["tokens_per_s_lo"])
    assert "no throughput ratio: runs shared their device (6 of 6 runs: load 3.1 on 2 cores)" in study["warnings"]
    assert timing["tokens_per_s_rel"] == pytest.approx(0.8) and "shared" not in timing["warnings"]
    head = headline(tab).set_index("option").loc["swiglu"]
    assert head["tokens_per_s_rel"] == pytest.approx(0.8) and head["tokens"] == 1e8
    assert head["delta"] == pytest.approx(0.1)
    alone = tab[tab["tokens"] == 1e6].index
    shown = display_headline(headline(tab.drop(index=alone))).iloc[0]  # no cell timed alone: no ratio, and why
    assert shown["tokens/s ratio [seed range]"] == ("— (no throughput ratio: runs shared their device (6 of 6 runs: "
                                                    "load 3.1 on 2 cores))")


def test_a_throughput_ratio_is_the_ratio_of_medians_with_the_range_of_the_seed_paired_ratios():
    """Option runs at 1100, 1000, 1200 tokens/s and baseline runs at 1000, 1000, 800 on seeds 0, 1, 2: the
    ratio is 1100 / 1000, the range that of 1.1, 1.0, 1.5; one paired seed gives no range."""
    base = {**analysis_default(), "model": "tiny", "data": "sotu", "params_active_non_embedding": 1e6,
            "flops_per_token": 6e6, "tokens": 1e6}
    rows = [dict(base, seed=s, loss_val_final=3.0 + 0.01 * s, tokens_per_s_median=b)
            for s, b in enumerate((1000., 1000., 800.))]
    rows += [dict(base, glu="swiglu", seed=s, loss_val_final=3.1 + 0.01 * s, tokens_per_s_median=v)
             for s, v in enumerate((1100., 1000., 1200.))]
    row = ablation_table(pd.DataFrame(rows)).set_index("option").loc["swiglu"]
    assert (row["tokens_per_s_rel"], row["tokens_per_s_lo"], row["tokens_per_s_hi"]) == pytest.approx((1.1, 1.0, 1.5))
    assert display_table(ablation_table(pd.DataFrame(rows)))["tokens/s / base [seed range]"].tolist()[-1] == \
        "1.100 [1.000, 1.500]"
    one = ablation_table(pd.DataFrame([rows[0], rows[3]])).set_index("option").loc["swiglu"]
    assert one["tokens_per_s_rel"] == pytest.approx(1.1) and np.isnan(one["tokens_per_s_lo"])


# --------------------------------------------------------------------------------------------------
# One N and C; the compute multiplier and the headline
# --------------------------------------------------------------------------------------------------

def test_one_definition_of_n_and_c(tmp_path):
    """N = active non-embedding parameters and C = the project's FLOPs by default; the allocation's kappa =
    C / (N D) is then 6 for these runs (flops = 6 N D), and another named N gives its own kappa."""
    write_scaling_ladder(tmp_path, multiplier=1.0)
    runs = collect([tmp_path], curves=False).runs
    df = runs_to_scaling(runs)
    np.testing.assert_array_equal(df["N"], runs["params_active_non_embedding"].astype(float))
    np.testing.assert_array_equal(df["C"], runs["flops"].astype(float))
    assert flops_per_param_token(df["N"], df["D"], df["C"]) == pytest.approx((6.0, 6.0, 6.0))
    other = runs_to_scaling(runs, n="active", c="6nd")
    assert flops_per_param_token(other["N"], other["D"], other["C"])[0] == pytest.approx(6 / 1.1, rel=1e-3)
    fit = fit_chinchilla(other["N"], other["D"], other["loss"], grid="coarse", kappa=6 / 1.1)
    n_opt, d_opt = fit.optimal(1e18)
    assert (6 / 1.1) * n_opt * d_opt == pytest.approx(1e18)


def test_the_headline_delta_comes_from_the_largest_size_with_an_interval(tmp_path):
    """A ladder of one seed per size above a smallest size run at three seeds (the study's design): the
    headline's delta is the smallest size's, the only one with an interval; with one seed everywhere it is
    the largest size's, without an interval."""
    sizes = np.geomspace(1e5, 3e7, 4)
    write_scaling_ladder(tmp_path, multiplier=1.5, sizes=sizes, seeds=(0, 1, 2), noise=0.001)
    for run in tmp_path.iterdir():
        if not run.name.startswith(f"ladder-base-n{sizes[0]:.2g}-") and not run.name.startswith(
                f"ladder-glu-swiglu-n{sizes[0]:.2g}-") and not run.name.endswith("-s0"):
            shutil.rmtree(run)
    runs = collect([tmp_path], curves=False).runs
    h = headline(ablation_table(runs)).iloc[0]
    assert h["N"] == pytest.approx(sizes[0], rel=1e-6) and h["n"] == 3 and h["delta_lo"] < h["delta"] < h["delta_hi"]
    for run in tmp_path.iterdir():
        if not run.name.endswith("-s0"):
            shutil.rmtree(run)
    h = headline(ablation_table(collect([tmp_path], curves=False).runs)).iloc[0]
    assert h["N"] == pytest.approx(sizes[-1], rel=1e-6) and h["n"] == 1 and np.isnan(h["delta_lo"])


# --------------------------------------------------------------------------------------------------
# The report and its figures: nothing lost, nothing cryptic
# --------------------------------------------------------------------------------------------------

def test_report_on_a_missing_folder_writes_nothing_and_says_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "rep"
    res = subprocess.run([sys.executable, "-m", "analysis.report", str(tmp_path / "nowhere"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode != 0 and not out.exists()
    assert len(res.stderr.strip().splitlines()) == 1 and "nowhere" in res.stderr and "does not exist" in res.stderr


def test_a_folder_with_no_run_is_listed(tmp_path):
    (tmp_path / "empty").mkdir()
    write_ablation_sweep(tmp_path / "sweep", broken=False)
    col = collect([tmp_path / "sweep", tmp_path / "empty"], curves=False)
    row = col.skipped.set_index("run_id").loc[str(tmp_path / "empty")]
    assert row["reason"].startswith("no run directory here")


def test_tuned_report_has_the_tuning_table(tmp_path):
    from analysis.report import main as report

    write_lr_grid(tmp_path / "runs", "moe", OPTIMA)
    text = report([str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--tune", "--formats", "png"]).read_text()
    for needle in ("**Tuned comparison.**", "### Tuning", "optim.lr at the highest of 3 values", "## Headline",
                   "moe=dense_matched optim.lr=0.012 optim.adam_lr=0.01 sweep=tune_moe seed=0,1,2"):
        assert needle in text, needle
    assert pd.read_csv(tmp_path / "rep" / "tuning.csv")["chosen"].sum() == 2


def test_report_takes_the_headline_throughput_from_speed_runs_where_the_study_shared_a_gpu(tmp_path):
    """The study's runs shared their GPU (device_shared): the report's headline takes each option's
    throughput ratio from --speed, short runs of the same size each alone (SwiGLU at 0.8x), and says so;
    those runs do not enter the ablation table (its Holm family is the study's comparisons alone)."""
    from analysis.report import main as report

    def mark(root, shared: bool, swiglu_speed: float = 1.0) -> None:
        for path in root.glob("*/summary.json"):
            summary = json.loads(path.read_text())
            summary["device_shared"] = shared
            if summary["switches"]["glu"] == "swiglu" and summary["tokens_per_s_median"]:
                summary["tokens_per_s_median"] *= swiglu_speed
            path.write_text(json.dumps(summary))

    write_ablation_sweep(tmp_path / "study", broken=False)
    mark(tmp_path / "study", shared=True, swiglu_speed=1.3)
    write_ablation_sweep(tmp_path / "speed", seeds=(0,), tokens=1e6, broken=False)
    mark(tmp_path / "speed", shared=False, swiglu_speed=0.8)
    out = tmp_path / "rep"
    text = report([str(tmp_path / "study"), "--speed", str(tmp_path / "speed"), "--out", str(out),
                   "--formats", "png"]).read_text()
    head = pd.read_csv(out / "headline.csv").set_index("option")
    assert head.loc["swiglu", "tokens_per_s_rel"] == pytest.approx(0.8)
    assert head.loc["swiglu", "tokens"] == 5e7  # the delta is still the study's
    assert "timing runs" in text
    table = pd.read_csv(out / "ablation.csv")
    assert set(table["tokens"]) == {5e7} and table["tokens_per_s_rel"].isna().all()


def test_delta_plot_explains_its_colours(sweep):
    from analysis.plots import plot_ablation

    root, _ = sweep
    fig = plot_ablation(ablation_table(collect([root], curves=False).runs))
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("worse") for t in texts) and any(t.startswith("better") for t in texts)
    assert any("not significant" in t for t in texts) and "Holm" in fig.legends[0].get_title().get_text()


def test_a_delta_plot_of_one_row_keeps_its_legend_inside_the_figure(sweep):
    """One option of one switch: the narrowest figure the plot draws; its legend lies within it."""
    from analysis.plots import plot_ablation

    root, _ = sweep
    runs = collect([root], curves=False).runs
    one = runs[runs["run_id"].str.startswith(("baseline-", "glu-swiglu-"))]
    fig = plot_ablation(ablation_table(one))
    fig.canvas.draw()
    box, page = fig.legends[0].get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0, (box, page)


def test_the_reports_maxvio_figure_colours_runs_by_variant(tmp_path, monkeypatch):
    """MoE runs of SiTU and SwiGLU (no balance or moe comparison): the report's MaxVio figure has one colour
    per variant, 'baseline' and 'glu=swiglu', not one per model."""
    from analysis import plots
    from analysis.report import main as report

    rng = np.random.default_rng(0)
    for option, maxvio in (("situ", 1.0), ("swiglu", 3.0)):
        for seed in (0, 1):
            write_run(tmp_path / "runs" / f"glu-{option}-s{seed}", {**analysis_default(), "glu": option}, seed, 1e6,
                      2e7, 0.01 * (option == "swiglu"), rng, maxvio=maxvio)
    drawn = []
    monkeypatch.setattr(plots, "plot_maxvio", lambda curves, runs, by, **kw: drawn.append(set(runs[by])))
    report([str(tmp_path / "runs"), "--out", str(tmp_path / "rep"), "--formats", "png"])
    assert drawn == [{"baseline", "glu=swiglu"}]


def test_log_axis_panels_leave_out_step_0_and_show_short_runs(tmp_path):
    """A run validated only at step 0 and at its end: the step panel has both points, the tokens and FLOPs
    panels (log x) the last one alone, drawn with a marker so that it shows."""
    from analysis.plots import plot_curves

    write_run(tmp_path / "short", analysis_default(), 0, 2e6, 1e6, 0.0, np.random.default_rng(0), n_log=1)
    col = collect([tmp_path / "short"])
    fig = plot_curves(col.curves, col.runs.assign(v="baseline"), "v")
    step, tokens, flops = (ax.lines[0] for ax in fig.axes)
    assert list(step.get_xdata()) == [0, 200]
    assert list(tokens.get_xdata()) == [1e6] and tokens.get_marker() == "o"
    assert list(flops.get_xdata()) == [6 * 2e6 * 1e6] and fig.axes[1].get_xscale() == "log"


def test_a_figure_saved_again_has_the_same_bytes(tmp_path):
    """plots.save writes no date and fixed SVG ids: the same figure saved twice is the same file, so committed
    report figures change only with their content."""
    import matplotlib.pyplot as plt

    from analysis import plots

    contents = []
    for folder in ("a", "b"):
        fig, ax = plt.subplots()
        ax.plot([1, 2, 3], [3, 1, 2], label="loss")
        ax.legend()
        contents.append([p.read_bytes() for p in plots.save(fig, tmp_path / folder / "curve")])
    assert contents[0] == contents[1] and len(contents[0]) == 2
