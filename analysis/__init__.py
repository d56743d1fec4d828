"""k3lab analysis: run directories (or external CSV tables) -> ablation tables, scaling-law fits, plots
and a Markdown report.

Reads only the files of the run-directory contract (docs/run_directory.md); never imports `k3lab`.

Modules (each also a command, `python -m analysis.<name> --help`):
    collect   run directories / CSV -> runs and curves DataFrames, with the skipped runs and why
    ablate    per switch, each option against the K3 default: mean, CI, delta, Welch / paired t-test
    scaling   Chinchilla approaches 3 and 2, L(C) per variant, compute multipliers, bootstrap intervals
    plots     matplotlib figures (PNG + SVG)
    report    one command: a sweep folder or a CSV -> a Markdown report with tables and figures
    synthetic synthetic run directories drawn from a known scaling law (tests, example figures)
"""
from analysis.collect import Collection, collect, load_csv
from analysis.ablate import DEFAULT_BASELINE, ablation_table
from analysis.scaling import (
    ChinchillaFit,
    bootstrap_chinchilla,
    compute_multiplier_separate,
    compute_multiplier_shared,
    fit_chinchilla,
    fit_isoflop,
    fit_loss_vs_compute,
    leave_largest_out,
)

__all__ = [
    "Collection", "collect", "load_csv",
    "DEFAULT_BASELINE", "ablation_table",
    "ChinchillaFit", "fit_chinchilla", "bootstrap_chinchilla", "leave_largest_out",
    "fit_isoflop", "fit_loss_vs_compute", "compute_multiplier_separate", "compute_multiplier_shared",
]
