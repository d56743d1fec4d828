"""Approach 1 and the points that share a trunk (analysis/approach1.py, analysis/trunks.py, analysis/noise.py).

Synthetic ladders with a known truth: per size a power law in tokens, L_N(D) = A_N D^-b_N, and seed noise
in which the branches of one trunk share a component (correlation rho). The fit must recover each b_N and
the envelope's crossovers exactly without noise, the correlation must be measured, the seed-noise intervals
must cover the truth at their nominal rate, and the report must leave the trunks out and name the families.
"""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.approach1 import crossovers, fit_approach1, fit_sizes, optimal_exponent
from analysis.approach3 import bootstrap_chinchilla, unit_members
from analysis.collect import collect, runs_to_scaling
from analysis.noise import SeedNoise, TrunkCorrelation, adequacy, mean_covariance, points_table, trunk_correlation
from analysis.trunks import families, resampling_units

KAPPA = 6.0
TOKENS_PER_PARAM = (2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def sizes_crossing_at(first_a: float, slopes: dict, cross: list) -> dict:
    """N: (A_N, b_N) for sizes whose lines L = A_N (C / (KAPPA N))^-b_N cross consecutively at the computes
    `cross`: each A_N set so that its line meets the previous size's there."""
    out, ns = {}, list(slopes)
    out[ns[0]] = (first_a, slopes[ns[0]])
    for prev, n, c in zip(ns, ns[1:], cross):
        a, b = out[prev]
        loss = a * (c / (KAPPA * prev)) ** -b
        out[n] = (loss * (c / (KAPPA * n)) ** slopes[n], slopes[n])
    return out


# three sizes whose lines cross inside the compute both sizes of each pair train (the larger size steeper)
SIZES = sizes_crossing_at(30.0, {1e5: 0.20, 3e5: 0.25, 1e6: 0.30}, [2.5e12, 2.5e13])  # N: (A_N, b_N)


def truth(n: float, d: np.ndarray) -> np.ndarray:
    a, b = SIZES[n]
    return a * np.asarray(d, float) ** -b


def ladder(seeds: int, sd: float, rho: float, rng: np.random.Generator) -> pd.DataFrame:
    """A scaling table of branch points: one trunk per size and seed, its branches at each tokens-per-param;
    a run's error is sd (sqrt(rho) u_trunk + sqrt(1 - rho) v_run)."""
    rows = []
    for n in SIZES:
        d = n * np.array(TOKENS_PER_PARAM)
        for s in range(seeds):
            err = sd * (np.sqrt(rho) * rng.standard_normal() + np.sqrt(1 - rho) * rng.standard_normal(len(d)))
            for di, li in zip(d, truth(n, d) + err):
                rows.append({"N": n, "D": di, "C": KAPPA * n * di, "loss": li, "seed": s, "trunk_id": f"{n:g}/{s}"})
    return pd.DataFrame(rows)


def test_without_noise_each_size_and_the_envelope_are_recovered_exactly():
    df = ladder(seeds=2, sd=0.0, rng=np.random.default_rng(0), rho=0.0)
    points = points_table(df.assign(variant="baseline"))
    fits = fit_sizes(points, points["loss"].to_numpy())
    for _, f in fits.iterrows():
        a, b = SIZES[f["N"]]
        assert f["b"][0] == pytest.approx(b, rel=1e-10) and np.exp(f["log_a"][0]) == pytest.approx(a, rel=1e-9)
        assert np.exp(f["log_k"]) == pytest.approx(KAPPA * f["N"])
    span = np.log(points["C"])
    cross = crossovers(fits, np.linspace(span.min(), span.max(), 4001))
    assert [(c["from_N"], c["to_N"]) for c in cross] == [(1e5, 3e5), (3e5, 1e6)]
    assert np.exp([c["log_C"] for c in cross]) == pytest.approx([2.5e12, 2.5e13], rel=1e-9)
    for c in cross:  # where the two true laws give one loss at one compute
        d_i, d_j = np.exp(c["log_C"]) / (KAPPA * c["from_N"]), np.exp(c["log_C"]) / (KAPPA * c["to_N"])
        assert truth(c["from_N"], d_i) == pytest.approx(truth(c["to_N"], d_j), rel=1e-9)
        assert np.exp(c["log_L"]) == pytest.approx(truth(c["from_N"], d_i), rel=1e-9)
    x = [c["log_C"] for c in cross]
    y = [0.5 * np.log(c["from_N"] * c["to_N"]) for c in cross]
    assert optimal_exponent(cross) == pytest.approx((y[1] - y[0]) / (x[1] - x[0]))
    result = fit_approach1(df, n_boot=0)
    assert list(result.crossovers["in data range"]) == ["yes", "yes"] and np.isfinite(result.a)
    assert result.lowest == 1e5


def test_the_correlation_of_a_trunks_branches_is_measured():
    """Many seeds: the pooled estimate is within 4 of its standard errors, (1 - rho^2) / sqrt(pairs x seeds)
    for the correlation of normal pairs, of the truth; independent branches measure about 0."""
    for rho in (0.0, 0.7):
        df = ladder(seeds=200, sd=0.02, rho=rho, rng=np.random.default_rng(1))
        corr = trunk_correlation(df.assign(variant="baseline"))
        se = (1 - rho ** 2) / np.sqrt(len(SIZES) * 15 * 200)  # 15 pairs of points per size
        assert abs(corr.rho - rho) < 4 * se + 0.02, corr  # + the pairs' overlap (the same seeds in every pair)
        assert corr.dof == len(SIZES) * 199
    single = ladder(seeds=1, sd=0.02, rho=0.5, rng=np.random.default_rng(2))
    assert not np.isfinite(trunk_correlation(single.assign(variant="baseline")).rho)


def test_the_covariance_of_point_means_counts_the_shared_trunks():
    points = pd.DataFrame({"n": [2, 2, 3], "trunks": ["a|b", "a|b", "c|d|e"]})
    k = mean_covariance(points, 0.5)
    assert np.allclose(np.diag(k), [1 / 2, 1 / 2, 1 / 3])
    assert k[0, 1] == pytest.approx(0.5 * 2 / 4) and k[0, 2] == 0 and k[1, 2] == 0
    r, noise = np.array([0.01, -0.02, 0.03]), SeedNoise.given(0.01)
    independent = adequacy(r, points["n"], noise, 1)
    assert adequacy(r, points["n"], noise, 1, mean_covariance(points, 0.0)).chi2 == pytest.approx(independent.chi2)
    assert adequacy(r, points["n"], noise, 1, k).chi2 == pytest.approx(r @ np.linalg.solve(k, r) / 0.01 ** 2)


def test_the_intervals_cover_the_truth_at_their_nominal_rate_and_need_the_correlation():
    """Over 100 ladders of 3 seeds whose branches share most of their noise (rho 0.9), the 95% intervals of
    the three b_N and of the two crossovers cover the truth at a rate within 3 binomial standard deviations
    of 0.95. Drawn as if the points were independent, the crossovers' intervals (which move with a family's
    level) fall short of that."""
    rng = np.random.default_rng(3)
    truth_c = {(1e5, 3e5): 2.5e12, (3e5, 1e6): 2.5e13}
    slopes, cross, cross_independent = [], [], []
    for _ in range(100):
        df, seed = ladder(seeds=3, sd=0.02, rho=0.9, rng=rng), int(rng.integers(1 << 30))
        fit = fit_approach1(df, n_boot=200, seed=seed)
        slopes += [r["b_lo"] <= SIZES[r["N"]][1] <= r["b_hi"] for _, r in fit.sizes.iterrows()]
        for hits, f in ((cross, fit), (cross_independent, fit_approach1(df, n_boot=200, seed=seed,
                                                                         correlation=TrunkCorrelation(0.0, 1, "")))):
            hits += [c["C_lo"] <= truth_c[(c["from_N"], c["to_N"])] <= c["C_hi"] for _, c in f.crossovers.iterrows()]

    def within(hits):
        return abs(np.mean(hits) - 0.95) < 3 * np.sqrt(0.95 * 0.05 / len(hits))

    assert len(slopes) == 300 and len(cross) == len(cross_independent) == 200
    assert within(slopes) and within(cross), (np.mean(slopes), np.mean(cross))
    assert np.mean(cross_independent) < 0.95 - 3 * np.sqrt(0.95 * 0.05 / 200), np.mean(cross_independent)


def test_a_cluster_bootstrap_draws_a_trunks_branches_together():
    labels = ["t0", "t0", "x", "t1", "t1", "t0"]
    members = unit_members(len(labels), labels)
    assert [list(m) for m in members] == [[0, 1, 5], [2], [3, 4]]
    assert [list(m) for m in unit_members(3)] == [[0], [1], [2]]
    df = ladder(seeds=2, sd=0.01, rho=0.5, rng=np.random.default_rng(4))
    units = resampling_units(df)
    assert len(set(units)) == len(SIZES) * 2  # one unit per trunk
    boot = bootstrap_chinchilla(df["N"], df["D"], df["loss"], n_boot=3, units=units)
    assert boot.units == 6 and boot.n_requested == 3


def write_run(folder: Path, name: str, steps: int, loss: float, seed: int, **fields) -> None:
    run = folder / name
    run.mkdir(parents=True)
    summary = {"status": "completed", "run_name": name, "seed": seed, "model": "ladder", "data": "sotu",
               "n_layers": fields.get("scale", 1), "params_active_non_embedding": 1000 * fields.pop("scale", 1),
               "length_from": "max_steps",
               "max_steps": steps, "steps": steps, "tokens": steps * 10, "flops": steps * 10 * 6e3,
               "loss_val_final": loss, **fields}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text(json.dumps({"step": steps, "tokens": steps * 10, "loss/val": loss}) + "\n")


def test_trunks_are_no_points_and_the_report_names_the_families(tmp_path):
    from analysis.report import main as report

    sweep = tmp_path / "wsd"
    for residual, shift in (("block_attnres", 0.0), ("standard", 0.02)):
        for scale in (1, 3):
            for seed in (0, 1):
                trunk = f"{residual},n={scale},seed={seed}"
                fields = {"scale": scale, "switches": {"residual": residual}}
                write_run(sweep, trunk, 400, 3.0, seed, branches=[100, 200, 400], branch_steps=[80, 160, 320],
                          **fields)
                for steps in (100, 200, 400):
                    write_run(sweep, f"{trunk},branch={steps}", steps,
                              5.0 * (steps * scale) ** -0.1 + 0.003 * seed + shift, seed, trunk=trunk,
                              branch_step=int(0.8 * steps), **fields)
    df = runs_to_scaling(collect([sweep]).runs)
    assert len(df) == 24 and df.attrs["trunks_left_out"] == 8 and df["trunk_id"].notna().all()
    fam = families(df.assign(variant=df["residual"]))
    assert list(fam["trunk"][:4]) == ["block_attnres,n=1,seed=0", "block_attnres,n=1,seed=1",
                                      "block_attnres,n=3,seed=0", "block_attnres,n=3,seed=1"]  # run ids
    assert (fam["points"] == 3).all() and fam["D"].iloc[0] == "1,000, 2,000, 4,000"
    path = report([str(sweep), "--out", str(tmp_path / "report"), "--n-boot", "0"])
    text = path.read_text()
    assert "hold 8 WSD trunk(s), none of them a point" in text and "standard,n=3,seed=1 " in text
    assert "8 WSD trunk(s) left out: a trunk ends at the peak rate" in text  # nor cells of the ablation table
    assert "run 2 times" not in text  # no trunk pooled with its branch of the same length
    for variant in ("baseline", "residual=standard"):  # approach 1 of each variant, its figure named safely
        assert f"### Approach 1 — L(D) per size, {variant}" in text
    assert (tmp_path / "report" / "approach1_baseline.png").exists()
    assert (tmp_path / "report" / "approach1_residual_standard.png").exists()
