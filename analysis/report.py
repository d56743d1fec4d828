"""One command: run directories (or an external CSV) -> a Markdown report with tables and figures.

    python -m analysis.report runs/my_sweep --out reports/my_sweep
    python -m analysis.report --csv table.csv --map 'N=Model Size,C=Training FLOP,loss=loss' \\
        --drop-highest 5 --out reports/chinchilla            # scaling-only report

Sections (each only when the data allow it): skipped runs; ablation table and its figures (deltas,
loss curves against step / tokens / FLOPs per switch, MoE MaxVio); approach 3 with bootstrap intervals,
the compute-optimal allocation and a leave-largest-size-out check, for all rows and for every
`--subset`; approach 2 (isoFLOP parabolas); L(C) per variant and compute multipliers.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from analysis import plots
from analysis.ablate import (DEFAULT_MATCH, _parse_baseline, ablation_table, display_table, effective_baseline, fmt,
                             markdown_table, print_ablation, variant_labels)
from analysis.collect import (Collection, _split, add_source_args, collect, runs_to_scaling, scaling_table_from_args,
                              select_rows)
from analysis.scaling import (bootstrap_chinchilla, compute_multipliers, fit_chinchilla, fit_isoflop,
                              fit_loss_vs_compute, flop_budgets, leave_largest_out, pareto_frontier, size_groups)


class Report:
    """Markdown lines plus figures written beside them."""

    def __init__(self, out: Path, formats: tuple = ("png", "svg")):
        self.out = out
        self.formats = formats
        self.lines: list[str] = []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, *text: str) -> None:
        self.lines.extend(text)
        self.lines.append("")

    def table(self, df: pd.DataFrame, digits: int = 4) -> None:
        self.add(markdown_table(df, digits))

    def figure(self, fig, name: str, caption: str) -> None:
        if fig is None:
            return
        plots.save(fig, self.out / name, formats=self.formats)
        link = f" ([SVG]({name}.svg))" if "svg" in self.formats else ""
        self.add(f"![{caption}]({name}.png)", f"*{caption}*{link}")

    def write(self, name: str = "report.md") -> Path:
        path = self.out / name
        path.write_text("\n".join(self.lines))
        return path


def _ci(v, lo, hi, digits: int = 4) -> str:
    return f"{fmt(v, digits)} [{fmt(lo, digits)}, {fmt(hi, digits)}]"


def default_budgets(c: np.ndarray) -> np.ndarray:
    """Every second decade from the smallest budget to two decades past the largest."""
    lo, hi = int(np.floor(np.log10(c.min()))), int(np.ceil(np.log10(c.max()))) + 2
    return 10.0 ** np.arange(lo, hi + 1, 2)


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------

def section_runs(rep: Report, col: Collection, variants: pd.Series) -> None:
    rep.add("## Runs", f"{len(col.runs)} usable runs, {len(col.skipped)} skipped.")
    if not col.skipped.empty:
        rep.add("### Skipped runs")
        rep.table(col.skipped[["run_id", "reason"]])
    if not col.runs.empty:
        r = col.runs.assign(variant=variants)
        cols = [c for c in ("model", "variant") if c in r]
        summ = r.groupby(cols, dropna=False).agg(runs=("run_id", "size"),
                                                 seeds=("seed", lambda s: ",".join(map(str, sorted(set(s))))),
                                                 tokens=("tokens", "max")).reset_index()
        rep.table(summ)


def section_ablation(rep: Report, col: Collection, args) -> None:
    if col.runs.empty or args.metric not in col.runs:
        return
    table = ablation_table(col.runs, args.metric, _parse_baseline(args.baseline),
                           [c for c in args.match.split(",") if c])
    notes = table.attrs.get("notes", [])
    if table.empty:
        if notes:
            rep.add("## Ablations", "No switch has runs differing from the baseline in that switch only.",
                    *[f"- {n}" for n in notes])
        return
    print_ablation(table)
    rep.add("## Ablations",
            f"Metric `{args.metric}` (lower is better). Each option against the baseline at matched "
            f"{', '.join(c for c in args.match.split(',') if c in table.columns)}; mean with Student-t 95% CI over "
            "seeds; delta with 95% CI and p-value from a paired t-test when the seeds match, else Welch's t-test.")
    rep.table(display_table(table))
    table.to_csv(rep.out / "ablation.csv", index=False)
    rep.add("Full table: [ablation.csv](ablation.csv).", *[f"- note: {n}" for n in notes])
    rep.figure(plots.plot_ablation(table), "ablation_deltas", "Delta against the baseline with 95% CIs")
    ref, _ = effective_baseline(col.runs, _parse_baseline(args.baseline))
    metric = "loss/val" if (col.curves["metric"] == "loss/val").any() else "loss/train"
    match = [c for c in args.match.split(",") if c in table.columns]
    for s in dict.fromkeys(table["switch"]):
        # curves of the matched cell with the most runs (one model size / token budget per figure)
        t = table[table["switch"] == s]
        cell = t.groupby(match, dropna=False)["n"].sum().idxmax() if match else ()
        cell = cell if isinstance(cell, tuple) else (cell,)
        m = col.runs[s].isin(t["option"])
        for o, ro in ref.items():
            if o != s and ro is not None:
                m &= col.runs[o] == ro
        for c, v in zip(match, cell):
            m &= col.runs[c] == v
        runs = col.runs[m]
        order = list(dict.fromkeys(t["option"]))
        try:
            fig = plots.plot_curves(col.curves, runs, s, metric=metric, order=order)
        except ValueError:
            continue
        where = ", ".join(f"{c}={fmt(v)}" for c, v in zip(match, cell))
        rep.figure(fig, f"curves_{s}", f"{metric} by {s} option against step, tokens and FLOPs ({where})")
        if s == "balance" or ("balance" not in set(table["switch"]) and s == "moe"):
            rep.figure(plots.plot_maxvio(col.curves, runs, by=s, order=order), f"maxvio_{s}", f"MoE MaxVio by {s} option ({where})")
    if "balance" not in set(table["switch"]) and "moe" not in set(table["switch"]):
        rep.figure(plots.plot_maxvio(col.curves, col.runs, by="model"), "maxvio", "MoE MaxVio over training")


def _approach3(rep: Report, name: str, df: pd.DataFrame, args, budgets: np.ndarray) -> Optional[dict]:
    n, d, loss = df["N"].to_numpy(), df["D"].to_numpy(), df["loss"].to_numpy()
    if len(df) < 6 or len(np.unique(size_groups(n))) < 3:
        rep.add(f"### Approach 3 — {name}", f"Skipped: {len(df)} points, "
                f"{len(np.unique(size_groups(n)))} sizes (needs >= 6 points and >= 3 sizes).")
        return None
    fit = fit_chinchilla(n, d, loss, grid=args.grid)
    boot = bootstrap_chinchilla(n, d, loss, n_boot=args.n_boot, seed=args.seed, init=fit.theta, progress=True,
                                description=f"bootstrap approach 3 ({name})") if args.n_boot else None
    rep.add(f"### Approach 3 — {name}",
            f"{len(df)} points, {len(np.unique(size_groups(n)))} sizes; {fit.n_starts} L-BFGS-B starts, "
            f"{fit.n_near_best} end within 0.01% of the best objective {fit.objective:.6g} "
            f"(converged: {fit.converged}). "
            + (f"Bootstrap: {boot.n_converged}/{boot.n_requested} replicates converged (seed {args.seed}; "
               "refit from the best point; non-converged dropped)." if boot else ""))
    ci = boot.ci() if boot else None
    vals = {"E": fit.E, "A": fit.A, "B": fit.B, "alpha": fit.alpha, "beta": fit.beta, "a_exp": fit.a_exp}
    rows = []
    for k, v in vals.items():
        row = {"parameter": "a = beta/(alpha+beta)" if k == "a_exp" else k, "estimate": v}
        if ci is not None:
            row.update({"95% CI": f"[{fmt(ci.loc[k, 'lo'])}, {fmt(ci.loc[k, 'hi'])}]", "SE": ci.loc[k, "se"]})
        rows.append(row)
    rep.table(pd.DataFrame(rows))
    if fit.E < 1e-3 * loss.min():
        rep.add(f"**Warning:** E collapsed to {fit.E:.3g} (its lower limit): the irreducible-loss term is not "
                "identified by these points, the objective's gradient in e vanishes there, so bootstrap replicates "
                "stay at the boundary and E's interval says nothing; the other parameters absorb the missing E.")
    n_opt, d_opt = fit.optimal(budgets)
    opt = pd.DataFrame({"C": budgets, "N_opt": n_opt, "D_opt": d_opt, "D/N": d_opt / n_opt})
    if boot:
        oc = boot.optimal_ci(budgets)
        opt["N_opt 95% CI"] = [f"[{fmt(a)}, {fmt(b)}]" for a, b in zip(oc["N_lo"], oc["N_hi"])]
        opt["D/N 95% CI"] = [f"[{fmt(a, 3)}, {fmt(b, 3)}]" for a, b in zip(oc["D/N_lo"], oc["D/N_hi"])]
    inside = (budgets >= df["C"].min()) & (budgets <= df["C"].max())
    opt["in data range"] = np.where(inside, "yes", "extrapolated")
    rep.add("Compute-optimal allocation (C = 6ND):")
    rep.table(opt)
    out = {"fit": fit, "boot": boot, "llo": None}
    try:
        llo_fit, held = leave_largest_out(n, d, loss, n_sizes=args.llo_sizes, grid=args.grid)
    except ValueError as e:
        rep.add(f"Leave-largest-size-out: skipped ({e}).")
        return out
    out["llo"] = llo_fit
    rep.add(f"Leave-largest-size-out: refit without the {args.llo_sizes} largest size(s) ({len(held)} points, "
            f"N >= {fmt(held['N'].min())}), then predict them. Mean |error| "
            f"{100 * held['rel_err'].abs().mean():.2f}%, max {100 * held['rel_err'].abs().max():.2f}%; "
            f"refit alpha {llo_fit.alpha:.3f} (full {fit.alpha:.3f}), beta {llo_fit.beta:.3f} "
            f"(full {fit.beta:.3f}), E {llo_fit.E:.3f} (full {fit.E:.3f}); D/N at C={budgets[0]:.0e}: "
            f"{(lambda no, do: do / no)(*llo_fit.optimal(budgets[0])):.3g} (full {(d_opt / n_opt)[0]:.3g}).")
    show = held.assign(**{"error %": 100 * held["rel_err"]}).drop(columns="rel_err")
    rep.table(show.head(12))
    return out


def section_scaling(rep: Report, df: pd.DataFrame, args, label: str = "all rows") -> None:
    df = df.dropna(subset=["N", "D", "C", "loss"])
    if len(df) < 6:
        return
    rep.add("## Scaling laws")
    budgets = (np.array([float(x) for x in args.budgets.split(",")]) if args.budgets
               else default_budgets(df["C"].to_numpy()))
    scen = {label: df}
    for sub in args.subset:
        name, _, q = sub.partition(":")
        scen[name.strip()] = df.query(q.strip() if q else name)
    for alt in args.alt_n:
        if alt not in df:
            raise SystemExit(f"--alt-n {alt!r}: no such column; available: {list(df.columns)}")
        scen[f"N = {alt}"] = df.assign(N=df[alt].astype(float))
    results = {k: _approach3(rep, k, v, args, budgets) for k, v in scen.items()}
    results = {k: v for k, v in results.items() if v}
    if len(results) > 1 or any(r["llo"] for r in results.values()):
        rep.add("### Sensitivity of approach 3",
                "The same fit on each subset, and without the largest model size(s); spread across rows is the "
                "uncertainty a single point estimate hides.")
        rows = []
        for k, r in results.items():
            for tag, f, b in ((k, r["fit"], r["boot"]), (f"{k}, largest size left out", r["llo"], None)):
                if f is None:
                    continue
                no, do = f.optimal(budgets[0])
                row = {"fit": tag, "E": f.E, "alpha": f.alpha, "beta": f.beta, "a": f.a_exp,
                       f"D/N @ {budgets[0]:.0e}": float(do / no)}
                if b is not None and b.n_converged:
                    ci, oc = b.ci(), b.optimal_ci(budgets[:1])
                    row.update({"alpha 95% CI": f"[{fmt(ci.loc['alpha', 'lo'])}, {fmt(ci.loc['alpha', 'hi'])}]",
                                "beta 95% CI": f"[{fmt(ci.loc['beta', 'lo'])}, {fmt(ci.loc['beta', 'hi'])}]",
                                "D/N 95% CI": f"[{fmt(oc['D/N_lo'][0], 3)}, {fmt(oc['D/N_hi'][0], 3)}]"})
                rows.append(row)
        rep.table(pd.DataFrame(rows))
    fits = {k: r["fit"] for k, r in results.items()}
    fits.update({f"{k} (largest left out)": r["llo"] for k, r in results.items() if r["llo"] is not None})
    cg = np.geomspace(min(df["C"].min(), budgets.min()), max(df["C"].max(), budgets.max()), 60)
    rep.figure(plots.plot_optimal(fits, cg, {k: r["boot"] for k, r in results.items() if r["boot"]}),
               "optimal_allocation", "Approach 3 compute-optimal N and D/N per fit, bootstrap 95% bands")
    extra = {}
    for k, f in fits.items():
        extra[f"approach 3 optimum: {k}"] = (lambda f: lambda c: f.predict(*f.optimal(c)))(f)
    color_by = "variant" if "variant" in df and df["variant"].nunique() > 1 else "N"
    rep.figure(plots.plot_loss_vs_compute(df, color_by=color_by, extra_curves=extra,
                                          title="Loss against compute (dashed: approach-3 compute-optimal loss)"),
               "loss_vs_compute_fit", "Loss against compute with the data frontier and approach-3 optima")
    section_isoflop(rep, df, args)


def section_isoflop(rep: Report, df: pd.DataFrame, args) -> None:
    budget = df["budget"].to_numpy(float) if "budget" in df else flop_budgets(df["C"].to_numpy(), args.iso_tol)
    try:
        iso = fit_isoflop(df["N"], df["C"], df["loss"], budget=budget, n_boot=args.n_boot_small, seed=args.seed)
    except ValueError as e:
        rep.add("### Approach 2 (isoFLOP parabolas)", f"Not applicable to these points: {str(e).splitlines()[0]}")
        return
    ci = iso.ci()
    rep.add("### Approach 2 (isoFLOP parabolas)",
            f"Budgets are runs whose log10 C lie within {args.iso_tol} dex of each other. "
            f"N_opt ∝ C^a with a = {iso.a:.3f} [{fmt(ci.loc['a', 'lo'])}, {fmt(ci.loc['a', 'hi'])}]; "
            f"D_opt ∝ C^b with b = {iso.b:.3f} [{fmt(ci.loc['b', 'lo'])}, {fmt(ci.loc['b', 'hi'])}] "
            f"(95% bootstrap over runs within budgets, {len(iso.boot)}/{args.n_boot_small} replicates usable).")
    rep.table(iso.parabolas[["C", "n_runs", "N_opt", "L_opt", "valid", "why"]])
    rep.figure(plots.plot_isoflop(df, iso, budget), "isoflop", "isoFLOP parabolas and N_opt against C")


def section_multipliers(rep: Report, df: pd.DataFrame, args) -> None:
    if "variant" not in df or df["variant"].nunique() < 2:
        return
    if len(rep.lines) and not any(l.startswith("## Scaling") for l in rep.lines):
        rep.add("## Scaling laws")
    base = args.baseline_variant
    pts = []
    for v, g in df.groupby("variant", sort=False):
        g = g[pareto_frontier(g["C"], g["loss"])] if args.lc_points == "frontier" else g
        pts.append(g)
    pts = pd.concat(pts)
    counts = pts.groupby("variant").size()
    ok = counts[counts >= 4].index
    pts = pts[pts["variant"].isin(ok)]
    if base not in ok or len(ok) < 2:
        rep.add("### Loss against compute per variant",
                f"Skipped: needs the baseline '{base}' and another variant with >= 4 {args.lc_points} points each "
                f"(have {counts.to_dict()}).")
        return
    fits = {v: fit_loss_vs_compute(g["C"], g["loss"]) for v, g in pts.groupby("variant", sort=False)}
    rep.add("### Loss against compute per variant",
            f"L(C) = L_inf + A (C/C0)^-alpha fitted in log space on each variant's {args.lc_points} points.")
    rep.table(pd.DataFrame([{"variant": v, "points": int(counts[v]), "L_inf": f.L_inf, "A": f.A, "alpha": f.alpha,
                             "C0": f.C0} for v, f in fits.items()]))
    mult = compute_multipliers(pts, base, n_boot=args.n_boot_small, seed=args.seed, progress=True)
    rep.add("Compute multiplier against the baseline (how much more compute the baseline needs for the variant's "
            "loss; > 1: the variant is better). *separate*: curves fitted independently, at each budget; *shared*: "
            "L_inf and alpha shared, budget-invariant (A_base/A_var)^(1/alpha). 95% bootstrap intervals.")
    shown = mult.assign(**{"95% CI": [f"[{fmt(a)}, {fmt(b)}]" for a, b in zip(mult["lo"], mult["hi"])]})
    rep.table(shown[["variant", "kind", "C", "multiplier", "95% CI", "n_boot_ok"]])
    rep.figure(plots.plot_loss_vs_compute(pts, fits=fits, color_by="variant", title="L(C) per variant"),
               "loss_vs_compute_variants", "L(C) per variant with fitted curves and the frontier")
    rep.figure(plots.plot_multipliers(mult), "compute_multipliers", "Compute multipliers with 95% intervals")


# --------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.split("\n")[0])
    add_source_args(p)
    p.add_argument("--out", required=True, help="report folder (report.md, figures, ablation.csv)")
    p.add_argument("--title", default=None)
    p.add_argument("--metric", default="loss_val_final", help="ablation metric (summary column)")
    p.add_argument("--baseline", action="append", default=[], help="override a switch reference, e.g. moe=dense")
    p.add_argument("--match", default=",".join(DEFAULT_MATCH), help="columns that identify a matched ablation cell")
    p.add_argument("--grid", default="full", choices=["full", "coarse"], help="approach-3 init grid")
    p.add_argument("--n-boot", type=int, default=400, help="approach-3 bootstrap replicates (0 = none)")
    p.add_argument("--n-boot-small", type=int, default=200, help="bootstrap replicates for approach 2 and multipliers")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--budgets", default=None, help="FLOP budgets for the allocation tables, e.g. 1e18,1e20,1e22")
    p.add_argument("--subset", action="append", default=[],
                   help="extra approach-3 fit on a subset, 'NAME: pandas query', e.g. 'D >= 1e9: D >= 1e9'")
    p.add_argument("--alt-n", action="append", default=[],
                   help="extra approach-3 fit with another column as N (e.g. non-embedding parameters)")
    p.add_argument("--llo-sizes", type=int, default=1, help="largest model sizes left out in the prediction check")
    p.add_argument("--iso-tol", type=float, default=0.05, help="dex within which runs share a FLOP budget")
    p.add_argument("--variant-col", default=None, help="CSV column naming the variant for L(C) and multipliers")
    p.add_argument("--baseline-variant", default="baseline", help="variant the multipliers are relative to")
    p.add_argument("--formats", default="png,svg", help="figure formats (png is always written)")
    p.add_argument("--lc-points", default="frontier", choices=["frontier", "all"],
                   help="points of each variant used for L(C): its Pareto frontier or all runs")
    return p


def main(argv: Optional[list[str]] = None) -> Path:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    rep = Report(out, tuple(f for f in args.formats.split(",") if f))
    src = args.csv or " ".join(args.paths)
    rep.add(f"# {args.title or 'Analysis report: ' + src}",
            f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} by",
            "```", "python -m analysis.report " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])), "```")
    if args.csv:
        df = scaling_table_from_args(args)
        if args.variant_col:
            df["variant"] = df[args.variant_col].astype(str)
        rep.add(f"Source: `{args.csv}`, {len(df)} rows after selection "
                f"(drop-highest {args.drop_highest}, best-of '{args.best_of}', where {args.where}).")
        section_scaling(rep, df, args)
        section_multipliers(rep, df, args)
    else:
        if not args.paths:
            raise SystemExit("give run directories (or globs) or --csv FILE")
        col = collect(args.paths, verbose=True)
        variants = variant_labels(col.runs, _parse_baseline(args.baseline)) if not col.runs.empty else pd.Series(dtype=str)
        section_runs(rep, col, variants)
        section_ablation(rep, col, args)
        if not col.runs.empty and args.n_col in col.runs:
            df = runs_to_scaling(col.runs.assign(variant=variants), args.n_col, args.d_col, args.c_col, args.loss_col)
            df = select_rows(df, args.drop_highest, _split(args.best_of), args.where)
            base = df[df["variant"] == args.baseline_variant]
            if len(np.unique(size_groups(base["N"]))) >= 3:
                rep.add("Approaches 3 and 2 use the baseline variant's runs; L(C) and the multipliers use every variant.")
                section_scaling(rep, base, args, label=args.baseline_variant)
            section_multipliers(rep, df, args)
    path = rep.write()
    print(f"report: {path}")
    return path


if __name__ == "__main__":
    main()
