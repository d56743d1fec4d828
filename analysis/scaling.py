"""Command line for the scaling fits: Chinchilla approach 3 (+ bootstrap) on run directories or an external CSV.

    python -m analysis.scaling runs/isoflop
    python -m analysis.scaling --csv table.csv --map 'N=Model Size,C=Training FLOP,loss=loss' --drop-highest 5

The fits themselves: analysis.approach3, analysis.isoflop (approach 2), analysis.power_law (L(C)) and
analysis.multipliers (compute multipliers between variants).
"""
from __future__ import annotations

import argparse
from typing import Optional

import numpy as np

from analysis.approach3 import bootstrap_chinchilla, fit_chinchilla, flops_per_param_token, why_not
from analysis.checks import one_line, parse_budgets
from analysis.trunks import resampling_units


def main(argv: Optional[list[str]] = None) -> None:
    from analysis.collect import add_source_args, scaling_table_from_args

    p = argparse.ArgumentParser(prog="python -m analysis.scaling",
                                description="Chinchilla approach-3 fit (+ bootstrap) on run directories or an "
                                            "external CSV.")
    add_source_args(p)
    p.add_argument("--grid", default="full", choices=["full", "coarse"], help="approach-3 init grid")
    p.add_argument("--n-boot", type=int, default=200, help="bootstrap replicates (0 = none)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--budgets", default="1e18,1e20,1e22", help="FLOP budgets for N_opt, D_opt (comma list)")
    args = p.parse_args(argv)
    try:  # the sources and options first: a mistake, or too few points for a fit, stops here in one line
        table = scaling_table_from_args(args)
        reason = why_not(table["N"], table["D"])
        if reason:
            raise ValueError(f"no approach-3 fit: {reason}")
        budgets = parse_budgets(args.budgets)
        if args.n_boot < 0:
            raise ValueError(f"--n-boot {args.n_boot}: a number of replicates, >= 0")
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise SystemExit(f"analysis.scaling: {one_line(e)}") from None
    kappa, k_lo, k_hi = flops_per_param_token(table["N"], table["D"], table["C"])
    fit = fit_chinchilla(table["N"], table["D"], table["loss"], grid=args.grid, kappa=kappa)
    print(f"approach 3 on {fit.n_points} points, {fit.n_starts} starts ({fit.n_near_best} reach the best), "
          f"converged={fit.converged}; allocations under C = kappa N D, kappa = {kappa:.4g} "
          f"(median C/(ND); {k_lo:.4g} to {k_hi:.4g})")
    for k, v in fit.params().items():
        print(f"  {k:>20s} = {v:.6g}")
    if args.n_boot:
        boot = bootstrap_chinchilla(table["N"], table["D"], table["loss"], n_boot=args.n_boot, seed=args.seed,
                                    init=fit.theta, progress=True, kappa=kappa, units=resampling_units(table))
        print(f"bootstrap: {boot.n_converged}/{boot.n_requested} replicates converged"
              + (f" (the {boot.units} resampling units draw a WSD trunk's branches together)"
                 if boot.units < len(table) else ""))
        print(boot.ci().to_string(float_format=lambda v: f"{v:.4g}"))
        print(boot.optimal_ci(budgets).to_string(float_format=lambda v: f"{v:.4g}"))
    n_opt, d_opt = fit.optimal(np.array(budgets))
    for c, nn, dd in zip(budgets, n_opt, d_opt):
        print(f"  C={c:.3g}: N_opt={nn:.4g}, D_opt={dd:.4g}, D/N={dd / nn:.3g}")


if __name__ == "__main__":
    main()
