"""Approach 3 against Epoch's replication of Chinchilla (Besiroglu et al. 2024, arXiv:2404.10102).

Data: tests/data/chinchilla_epoch_replication.csv (source, commit, sha256 and licence in tests/data/README.md).
Protocol (tests/data/README.md): D = C/(6N), drop the 5 highest-loss rows (240 left), summed Huber
(delta 1e-3) on log loss in LSE form, L-BFGS-B from the 4,500-start grid.
"""
from pathlib import Path

import numpy as np
import pytest

from analysis.approach3 import HOFFMANN_THETA, bootstrap_chinchilla, fit_chinchilla
from analysis.collect import load_csv, select_rows

CSV = Path(__file__).resolve().parent / "data" / "chinchilla_epoch_replication.csv"

EPOCH_GRID = {"E": 1.8172, "A": 477.8, "B": 2143.9, "alpha": 0.3473, "beta": 0.3672}
EPOCH_OBJECTIVE = 1.01827e-3
EPOCH_CI = {"alpha": (0.317, 0.373), "beta": (0.331, 0.415)}


@pytest.fixture(scope="module")
def table():
    df = load_csv(CSV, "N=Model Size,C=Training FLOP,loss=loss")
    return select_rows(df, drop_highest=5)


@pytest.fixture(scope="module")
def fit(table):
    return fit_chinchilla(table["N"], table["D"], table["loss"], grid="full")


def test_protocol_rows(table):
    assert len(table) == 240
    np.testing.assert_allclose(table["D"], table["Training FLOP"] / (6 * table["Model Size"]))
    full = load_csv(CSV, "N=Model Size,C=Training FLOP,loss=loss")
    assert table["loss"].max() < full["loss"].nlargest(5).min()


def test_grid_fit_reproduces_epoch(fit):
    assert fit.n_starts == 4500 and fit.n_points == 240
    assert fit.converged
    assert fit.objective == pytest.approx(EPOCH_OBJECTIVE, rel=1e-3)
    for name, want in EPOCH_GRID.items():
        assert getattr(fit, name) == pytest.approx(want, rel=1e-2), name


def test_report_cli_reproduces_epoch(tmp_path):
    """The same check through `python -m analysis.report --csv` (the command docs/analysis.md publishes): the
    approach-3 table of its report.md gives each parameter within 1% of Epoch's grid fit."""
    from analysis.report import main as report

    text = report(["--csv", str(CSV), "--map", "N=Model Size,C=Training FLOP,loss=loss", "--drop-highest", "5",
                   "--grid", "coarse", "--n-boot", "0", "--n-boot-small", "0", "--formats", "png",
                   "--out", str(tmp_path / "rep")]).read_text()
    rows = {r[0]: r[1] for r in ([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
                                 if line.startswith("|")) if len(r) > 1}
    for name, want in EPOCH_GRID.items():
        assert float(rows[name]) == pytest.approx(want, rel=1e-2), name


def test_coarse_grid_finds_the_same_optimum(table, fit):
    coarse = fit_chinchilla(table["N"], table["D"], table["loss"], grid="coarse")
    assert coarse.objective == pytest.approx(fit.objective, rel=1e-6)
    np.testing.assert_allclose(coarse.theta, fit.theta, rtol=1e-3, atol=1e-3)


def test_bootstrap_intervals_overlap_epoch(table, fit):
    boot = bootstrap_chinchilla(table["N"], table["D"], table["loss"], n_boot=200, seed=42, init=fit.theta)
    assert boot.n_converged >= 190  # each replicate's convergence is checked, failures dropped
    ci = boot.ci()
    for name, (lo, hi) in EPOCH_CI.items():
        blo, bhi = ci.loc[name, "lo"], ci.loc[name, "hi"]
        assert blo < getattr(fit, name) < bhi
        assert blo < hi and bhi > lo, f"{name}: [{blo:.3f}, {bhi:.3f}] misses Epoch's [{lo}, {hi}]"
        assert 0.5 < (bhi - blo) / (hi - lo) < 2.0, f"{name}: width {bhi - blo:.3f} vs Epoch's {hi - lo:.3f}"


@pytest.mark.slow
def test_bootstrap_4000_epoch_protocol(table):
    """Epoch's protocol: 4,000 resamples (seed 42), BFGS from Hoffmann's unrounded estimate."""
    boot = bootstrap_chinchilla(table["N"], table["D"], table["loss"], n_boot=4000, seed=42, init=HOFFMANN_THETA,
                                method="BFGS")
    assert boot.n_converged >= 3900
    ci = boot.ci()
    for name, (lo, hi) in EPOCH_CI.items():
        assert ci.loc[name, "lo"] == pytest.approx(lo, abs=0.01)
        assert ci.loc[name, "hi"] == pytest.approx(hi, abs=0.01)
