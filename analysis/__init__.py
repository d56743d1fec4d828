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
    headline    one row per switch option: delta, per-size multipliers and trend, the fitted multiplier where
                its fit is adequate, throughput at its utilisation, the wall-clock multiplier
    approach1   Chinchilla approach 1 on a ladder: L(D) per size, the envelope's crossovers, N_opt ∝ C^a
    approach3   Chinchilla approach 3 (+ bootstrap, leave-largest-out, compute-optimal allocation)
    isoflop     Chinchilla approach 2 (isoFLOP parabolas)
    power_law   L(C) per variant, alone or with a shared exponent
    noise       points of a ladder, the seed noise pooled over them and its correlation within a trunk's
                branches, a fit's test against it, seed-noise replicates of the point means
    trunks      which runs are WSD trunks and branches, which points share a trunk
    multipliers compute multipliers per size and from a shared fit, with seed-noise intervals, and their trend
    plan        seeds per point for a minimum detectable effect, the validation-size term, a plan's cost (command)
    scaling     approach 3 on run directories or a CSV (command)
    branches    WSD cooldown branches: against their trunk and separate runs, the compute their shared prefix
                saves (command)
    rates       the learning rate tuned at every size: the choice per cell, grid edges, its drift across
                widths (command)
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
    "fit_approach1": "approach1", "ChinchillaFit": "approach3", "fit_chinchilla": "approach3",
    "bootstrap_chinchilla": "approach3",
    "leave_largest_out": "approach3", "fit_isoflop": "isoflop", "fit_loss_vs_compute": "power_law",
    "compute_multipliers": "multipliers", "Multipliers": "multipliers", "SeedNoise": "noise",
    "points_table": "noise", "seeds_for_mde": "plan",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"analysis.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")
