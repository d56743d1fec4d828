"""k3lab analysis: run directories (or external CSV tables) -> ablation tables, scaling-law fits, plots
and a Markdown report.

Reads only the files of the run-directory contract (docs/run_directory.md); never imports `k3lab`.

Modules (the commands: `python -m analysis.<name> --help`):
    collect     run directories / CSV -> runs and curves DataFrames; every directory used, partly read or
                skipped, and why; the one definition of N and C (N_DEFINITIONS, C_DEFINITIONS) (command)
    cells       which runs an ablation compares: the baseline, cells matched on the whole config, variant labels
    stats       mean and CI over seeds, paired / Welch t-test, Holm, minimum detectable effects
    tuning      each option at its own tuned rate: the choice, grid edges, the commands to run next
    ablate      the ablation table per switch, each option against the K3 default (command)
    headline    one row per switch option: delta, compute multiplier, throughput and wall-clock multipliers
    approach3   Chinchilla approach 3 (+ bootstrap, leave-largest-out, compute-optimal allocation)
    isoflop     Chinchilla approach 2 (isoFLOP parabolas)
    power_law   L(C) per variant, alone or with a shared exponent
    multipliers compute multipliers between variants
    scaling     approach 3 on run directories or a CSV (command)
    tables      number formatting and Markdown tables
    plots       matplotlib figures (PNG + SVG)
    report      one command: a sweep folder or a CSV -> a Markdown report with tables and figures (command)
    synthetic   synthetic run directories drawn from a known scaling law (tests, example figures) (command)
    switches    the switches and their options (analysis's copy of k3lab/switches.py, checked by a test)
"""
import importlib

# name -> submodule; imported on first use so that `python -m analysis.<tool>` runs cleanly (PEP 562)
_EXPORTS = {
    "Collection": "collect", "collect_runs": "collect", "load_csv": "collect",
    "N_DEFINITIONS": "collect", "C_DEFINITIONS": "collect",
    "DEFAULT_BASELINE": "cells", "ablation_table": "ablate", "tuning_table": "tuning", "headline": "headline",
    "ChinchillaFit": "approach3", "fit_chinchilla": "approach3", "bootstrap_chinchilla": "approach3",
    "leave_largest_out": "approach3", "fit_isoflop": "isoflop", "fit_loss_vs_compute": "power_law",
    "compute_multipliers": "multipliers", "compute_multiplier_separate": "multipliers",
    "compute_multiplier_shared": "multipliers",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"analysis.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")
