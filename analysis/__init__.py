"""k3lab analysis: run directories (or external CSV tables) -> ablation tables, scaling-law fits, plots
and a Markdown report.

Reads only the files of the run-directory contract (docs/run_directory.md); never imports `k3lab`.

Modules (each also a command, `python -m analysis.<name> --help`):
    collect   run directories / CSV -> runs and curves DataFrames; every directory used, partly read or
              skipped, and why; the one definition of N and C (N_DEFINITIONS, C_DEFINITIONS)
    ablate    per switch, each option against the K3 default in cells matched on the whole config: mean, CI,
              delta, Welch / paired t-test, Holm-adjusted p, minimum detectable effect, N and FLOPs per
              token against the baseline; optionally each option at its own tuned rate; the headline rows
    scaling   Chinchilla approaches 3 and 2, L(C) per variant, compute multipliers, bootstrap intervals
    plots     matplotlib figures (PNG + SVG)
    report    one command: a sweep folder or a CSV -> a Markdown report with tables and figures
    synthetic synthetic run directories drawn from a known scaling law (tests, example figures)
    branches  WSD cooldown branches: against their trunk and separate runs, the compute their shared prefix saves
    rates     the learning rate tuned at every size: the choice per cell, grid edges, its drift across widths
    switches  the switches and their options (analysis's copy of k3lab/switches.py, checked by a test)
"""
import importlib

# name -> submodule; imported on first use so that `python -m analysis.<tool>` runs cleanly (PEP 562)
_EXPORTS = {
    "Collection": "collect", "collect_runs": "collect", "load_csv": "collect",
    "N_DEFINITIONS": "collect", "C_DEFINITIONS": "collect",
    "DEFAULT_BASELINE": "ablate", "ablation_table": "ablate", "tuning_table": "ablate", "headline": "ablate",
    "ChinchillaFit": "scaling", "fit_chinchilla": "scaling", "bootstrap_chinchilla": "scaling",
    "leave_largest_out": "scaling", "fit_isoflop": "scaling", "fit_loss_vs_compute": "scaling",
    "compute_multipliers": "scaling", "compute_multiplier_separate": "scaling",
    "compute_multiplier_shared": "scaling",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"analysis.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")
