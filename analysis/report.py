"""One command: run directories (or an external CSV) -> a Markdown report with tables and figures.

    python -m analysis.report runs/my_sweep --out reports/my_sweep
    python -m analysis.report --csv table.csv --map 'N=Model Size,C=Training FLOP,loss=loss' \\
        --drop-highest 5 --out reports/chinchilla            # scaling-only report

Sections (each only when the data allow it): every run directory (used, partially read, skipped and
why); the headline per switch option (analysis.headline: delta at the largest size, per-size compute
multipliers and their trend, the fitted multiplier where its fit is adequate, throughput with its
utilisation, wall-clock multipliers); the ablation table (cells, the primary comparisons and their Holm
family, minimum detectable effects, parameters and FLOPs per token against the baseline; with --tune each
option at its own best rate, and the tuning table) and its figures (deltas, loss curves against step /
tokens / FLOPs per switch, MoE MaxVio); approach 3 with bootstrap intervals, its test against seed noise,
the compute-optimal allocation and a leave-largest-size-out check, for all rows and for every `--subset`;
approach 2 (isoFLOP parabolas); the seed noise, L(C) per variant with the fit tests, and the compute
multipliers (analysis.multipliers; multipliers.csv). N and C have one definition each for all of them
(--n, --c; analysis.collect.N_DEFINITIONS).

A source that does not exist stops the command with one line before anything is written.
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
from analysis.ablate import (add_ablation_args, display_table, parse_baseline, print_ablation, read_primary,
                             table_from_args)
from analysis.approach1 import MIN_TOKEN_COUNTS, applicable, fit_approach1
from analysis.approach3 import (MIN_POINTS, MIN_SIZES, bootstrap_chinchilla, fit_chinchilla, flops_per_param_token,
                                leave_largest_out, size_groups, why_not)
from analysis.cells import BOOKKEEPING, variant_labels
from analysis.checks import (check_ablation_options, check_metric, check_numeric_column, check_out_folder,
                             check_query, not_valid, one_line, parse_budgets, require_runs,
                             what_is_missing)
from analysis.collect import (C_DEFINITIONS, N_DEFINITIONS, Collection, _split, add_source_args, collect, print_dirs,
                              runs_to_scaling, scaling_table_from_args, select_rows)
from analysis.headline import MIN_MFU, display_headline, headline
from analysis.isoflop import fit_isoflop, flop_budgets
from analysis.multipliers import Multipliers, compute_multipliers
from analysis.noise import SeedNoise, adequacy, mean_covariance, points_table, pooled_noise, trunk_correlation
from analysis.plan import paired_comparisons, window_sd
from analysis.stats import ALPHA, POWER
from analysis.tables import fmt, interval_texts, markdown_table
from analysis.trunks import families, resampling_units
from analysis.tuning import TUNE_SEED_MIN, tuning_table


class Report:
    """Markdown lines plus figures and tables written beside them. The folder's `.report-files` lists what
    the last report wrote, so that a report written again removes its predecessor's files it did not
    write again (a figure of a section now skipped would otherwise stay, looking current); no other file
    in the folder is touched."""

    MANIFEST = ".report-files"

    def __init__(self, out: Path, formats: tuple = ("png", "svg")):
        self.out = out
        self.formats = formats
        self.lines: list[str] = []
        self.written: set[str] = set()
        self.holds: set[str] = set()  # what it has of 'headline', 'ablation', 'figure': none, and it is empty

    def path(self, name: str) -> Path:
        """The path of a file this report writes (recorded in the manifest); the folder is made on the first."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.written.add(name)
        return self.out / name

    def add(self, *text: str) -> None:
        self.lines.extend(text)
        self.lines.append("")

    def insert(self, at: int, *text: str) -> None:
        """Lines placed at position `at` (a section computed after the ones that follow it in the report)."""
        self.lines[at:at] = [*text, ""]

    def table(self, df: pd.DataFrame, digits: int = 4) -> None:
        self.add(markdown_table(df, digits))

    def figure(self, fig, name: str, caption: str) -> None:
        if fig is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self.written.update(p.name for p in plots.save(fig, self.out / name, formats=self.formats))
        self.holds.add("figure")
        link = f" ([SVG]({name}.svg))" if "svg" in self.formats else ""
        self.add(f"![{caption}]({name}.png)", f"*{caption}*{link}")

    def write(self, name: str = "report.md") -> Path:
        path = self.path(name)
        path.write_text("\n".join(self.lines))
        manifest = self.out / self.MANIFEST
        if manifest.exists():
            for stale in set(manifest.read_text().split()) - self.written:
                (self.out / stale).unlink(missing_ok=True)
        manifest.write_text("\n".join(sorted(self.written)) + "\n")
        return path


def default_budgets(c: np.ndarray) -> np.ndarray:
    """Every second decade from the smallest budget to two decades past the largest."""
    lo, hi = int(np.floor(np.log10(c.min()))), int(np.ceil(np.log10(c.max()))) + 2
    return 10.0 ** np.arange(lo, hi + 1, 2)


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------

def section_runs(rep: Report, col: Collection, variants: pd.Series) -> str:
    """The Runs section; returns its text up to the list of every directory (what a report with nothing else
    shows in the terminal)."""
    n_used = int((col.dirs["state"] != "skipped").sum())
    rep.add("## Runs", f"{len(col.dirs)} run directories: {n_used} used ({len(col.partial)} partially read), "
                       f"{len(col.skipped)} skipped.")
    if not col.skipped.empty:
        rep.add("### Skipped runs")
        rep.table(col.skipped[["run_id", "reason"]])
    if not col.partial.empty:
        rep.add("### Partially read runs", "Used: their summary.json counts in every table; their curves have only "
                                           "the lines that could be read.")
        rep.table(col.partial[["run_id", "reason"]])
    every = col.dirs[["run_id", "state", "reason"]]
    if not col.runs.empty:
        r = col.runs.assign(variant=variants)
        cols = [c for c in ("model", "variant") if c in r]
        joined = lambda s: ",".join(map(str, sorted(set(s.dropna()))))  # noqa: E731
        agg = dict(runs=("run_id", "size"), seeds=("seed", joined), tokens=("tokens", "max"))
        if "git_rev" in r:  # the commits that ran them (summary.json's git_rev)
            agg["commits"] = ("git_rev", joined)
            every = every.merge(r[["run_id", "git_rev"]].rename(columns={"git_rev": "commit"}), on="run_id",
                                how="left")
        rep.table(r.groupby(cols, dropna=False).agg(**agg).reset_index())
    shown = "\n".join(rep.lines[rep.lines.index("## Runs"):]).rstrip()
    rep.add(f"<details><summary>Every run directory ({len(col.dirs)})</summary>", "", markdown_table(every), "",
            "</details>")
    return shown


def higher_is_better(col: Collection, metric: str) -> bool:
    """Whether a larger `metric` is better: downstream evals and recall probes as analysis.collect marks them
    (runs.attrs), every other metric (the losses) lower-is-better."""
    return bool(col.runs.attrs.get("higher_is_better", {}).get(metric, False))


def directed_table(col: Collection, args, metric: str) -> pd.DataFrame:
    """The ablation table of `metric`, its verdicts worded for the metric's direction: analysis.ablate calls a
    negative delta better, which for a higher-is-better metric (an accuracy) is worse."""
    if higher_is_better(col, metric) and args.tune:
        raise SystemExit(f"analysis.report: --tune picks each option's lowest mean, and {metric} is higher-is-better; "
                         "tune on a loss (--metric loss_val_final) and show this one with --also-metric")
    table = table_from_args(col.runs, argparse.Namespace(**{**vars(args), "metric": metric}))
    if higher_is_better(col, metric) and not table.empty:
        table["verdict"] = table["verdict"].replace({"better": "worse", "worse": "better"})
    return table


def section_also(rep: Report, col: Collection, args) -> None:
    """One more ablation table per --also-metric (an eval or probe beside the loss): the cells and tests of
    the main table, on that metric; its full table in ablation_<metric>.csv."""
    for metric in args.also_metric:
        if col.runs.empty or metric not in col.runs:
            rep.add(f"### `{metric}`", "No run has this column.")
            continue
        table = directed_table(col, args, metric)
        if table.empty:
            continue
        name = f"ablation_{_slug(metric)}.csv"
        rep.add(f"### `{metric}` ({'higher' if higher_is_better(col, metric) else 'lower'} is better)",
                "The cells, statistics and tests of the ablation table above, on this metric.")
        rep.table(display_table(table))
        table.to_csv(rep.path(name), index=False)
        rep.add(f"Full table: [{name}]({name}).")


def section_ablation(rep: Report, col: Collection, variants: pd.Series, args) -> pd.DataFrame:
    """The ablation table with its figures and notes; the table is returned, empty when no switch has a
    comparison (its attrs' notes say what kept the runs apart)."""
    table = directed_table(col, args, args.metric)
    notes = table.attrs.get("notes", [])
    if table.empty:
        if notes:
            rep.add("## Ablations", "No switch has runs differing from the baseline in that switch only.",
                    *[f"- {n}" for n in notes])
        return table
    print_ablation(table)
    ignored = ", ".join([*BOOKKEEPING, *[c for c in args.ignore.split(",") if c]])
    rep.add("## Ablations",
            f"Metric `{args.metric}` ({'higher' if higher_is_better(col, args.metric) else 'lower'} is better). "
            "A cell holds the runs whose whole config.yaml is equal "
            f"except for the seed, the bookkeeping keys ({ignored}) and the keys under comparison (the switch's "
            "own group" + (", optim.lr, optim.adam_lr and optim.lr_scale" if args.tune else "") + "), and whose "
            f"{', '.join(c for c in args.match.split(',') if c in table.columns)} are equal; `cell` names what "
            "differs between the cells of a switch. Mean with Student-t 95% CI over seeds; delta with 95% CI and "
            f"p-value; the verdict decided on `p (Holm)` at {ALPHA}; MDE: the smallest |delta| the test used detects "
            f"with power {POWER} at alpha {ALPHA} given the row's n and spread. `N / base`, `FLOPs/token / base`, "
            f"`tokens/s / base`: active parameters ({N_DEFINITIONS[args.n_def]}), FLOPs per token and throughput "
            "against the baseline row (throughput: the ratio of median tokens/s over seeds, in brackets the range "
            "of the seed-paired ratios; none where runs shared their device); `MFU`: the lower of the two rows' median utilisation (speed/mfu), where "
            "logged and the runs had their device alone.", "",
            "**The test, chosen before the data:** two-sided paired t-test of the per-seed differences (a seed "
            "fixes both the initialisation and the data order, so it pairs an option's run with the baseline's); "
            "Welch's t-test only for a row whose seeds are not the baseline's.", "",
            primary_text(table, args.primary), "", validation_text(table, col, args.metric))
    if args.tune:
        rep.add(f"**Tuned comparison.** Each option at its own best setting of the rates ({args.tuned}) and of its "
                "own group's keys: the lowest mean metric on the tuning seeds (" +
                (args.tune_seeds or f"seed >= {TUNE_SEED_MIN}") + "), reported on the other seeds. `rate` is the "
                "rate each row used, `grid_edge` says when the choice lies at an edge of the grid tried (widen it).")
    rep.table(display_table(table))
    rep.holds.add("ablation")
    table.to_csv(rep.path("ablation.csv"), index=False)
    rep.add("Full table (with every run id): [ablation.csv](ablation.csv).", *[f"- note: {n}" for n in notes])
    tuning = tuning_table(table)
    if not tuning.empty:
        rep.add("### Tuning", "Every setting tried, with its mean on the tuning seeds; the chosen one per option with "
                              "the command that runs the reported seeds at it.")
        rep.table(tuning)
        tuning.to_csv(rep.path("tuning.csv"), index=False)
    rep.figure(plots.plot_ablation(table), "ablation_deltas", "Delta against the baseline with 95% CIs")
    metric = "loss/val" if (col.curves["metric"] == "loss/val").any() else "loss/train"
    for s in dict.fromkeys(table["switch"]):
        # curves of the rows of one cell: the one with the most runs (one size / length / rate per figure)
        t = table[table["switch"] == s]
        keys = list(table.columns[3:table.columns.get_loc("cell") + 1])
        if not args.tune and s != "optim":
            keys.append("rate")  # untuned, the rates are part of the cell (for optim, of the option's setting)
        cells = t.groupby(keys, dropna=False, sort=False)["n"].sum()
        cell = cells.idxmax() if len(keys) > 1 else (cells.idxmax(),)
        rows = t[np.logical_and.reduce([t[k].astype(str) == str(v) for k, v in zip(keys, cell)])]
        label = {rid: (o if (rows["option"] == o).sum() == 1 else " ".join(x for x in (o, st, rate) if x))
                 for o, st, rate, ids in zip(rows["option"], rows["setting"], rows["rate"], rows["run_ids"])
                 for rid in ids.split(";") if rid}  # an option with several rows: each row its own colour
        runs = col.runs[col.runs["run_id"].isin(label)]
        runs = runs.assign(**{s: runs["run_id"].map(label)})  # colour by row: the option, with its setting if several
        try:
            fig = plots.plot_curves(col.curves, runs, s, metric=metric, order=list(dict.fromkeys(label.values())))
        except ValueError:
            continue
        where = ", ".join(f"{k}={fmt(v)}" for k, v in zip(keys, cell)
                          if fmt(v) not in ("", "nan") and t[k].astype(str).nunique() > 1)  # what tells the cells apart
        where = f" ({where})" if where else ""
        rep.figure(fig, f"curves_{s}", f"{metric} by {s} option against step, tokens and FLOPs{where}")
        if s == "balance" or ("balance" not in set(table["switch"]) and s == "moe"):
            rep.figure(plots.plot_maxvio(col.curves, runs, by=s, order=list(dict.fromkeys(label.values()))),
                       f"maxvio_{s}", f"MoE MaxVio by {s} option{where}")
    if "balance" not in set(table["switch"]) and "moe" not in set(table["switch"]):
        rep.figure(plots.plot_maxvio(col.curves, col.runs.assign(variant=variants), by="variant"), "maxvio",
                   "MoE MaxVio over training by variant (the switches each run sets apart from the baseline)")
    return table


def primary_text(table: pd.DataFrame, path: Optional[str]) -> str:
    """The Holm family of the report, in words."""
    n = table.attrs["n_comparisons"]
    if not table.attrs.get("primary"):
        return (f"**Holm family:** no primary comparisons declared (--primary), so all {n} comparisons of this "
                "report form one family.")
    return (f"**Primary comparisons** (declared in `{path}`): {', '.join(table.attrs['primary'])}; `p (Holm)` is "
            f"adjusted over their {n} tests alone. Every other row is exploratory: its p-value is uncorrected and "
            "decides nothing.")


def validation_text(table: pd.DataFrame, col: Collection, metric: str) -> str:
    """The runs' validation size and the noise it leaves in a paired difference (analysis.plan: estimated from
    the training losses of same-seed run pairs), in words; empty where the runs do not tell."""
    runs = col.runs
    if not {"config.data.val_tokens", "config.data.seq_len"} <= set(runs.columns):
        return ""
    seq_len = float(runs["config.data.seq_len"].median())
    windows = float((runs["config.data.val_tokens"] // runs["config.data.seq_len"]).median())
    text = f"**Validation set:** {windows * seq_len:,.0f} tokens per run ({windows:g} windows of {seq_len:g})."
    comparisons = paired_comparisons(table, runs, metric)
    if comparisons.empty or col.curves.empty:
        return text
    sd, pairs = window_sd([p for ps in comparisons["pairs"] for p in ps], runs, col.curves)
    if not pairs:
        return text
    million = 2 ** 20 / seq_len
    return (text + f" The part of a paired difference's sd that comes from so many windows: {sd / np.sqrt(windows):.3g} "
            f"nats (sd per window {sd:.3g}, from the training losses of {pairs} same-seed run pairs; analysis.plan); "
            f"a validation set of 1M tokens would leave {sd / np.sqrt(million):.3g}.")


def section_headline(rep: Report, at: int, table: pd.DataFrame, mult: Optional[Multipliers],
                     speed: Optional[pd.DataFrame], min_mfu: float) -> None:
    h = headline(table, mult, speed, min_mfu)
    if h.empty:
        return
    rep.holds.add("headline")
    h.to_csv(rep.path("headline.csv"), index=False)
    ladder = ("" if mult is not None else " No ladder of the baseline here, so no compute multiplier: run a size "
              "ladder (sweeps/scaling_ladder.yaml) of the baseline and of the option to get one.")
    rep.insert(at, "## Headline",
               "Per switch option: the delta at the largest model size with a 95% CI and its verdict (from the "
               "ablation table); the compute multiplier at each size of the option's ladder (> 1: the baseline needs "
               "that many times the FLOPs for the option's loss; * where the baseline's curve is extended beyond its "
               "points) with its seed-noise interval, and its trend over sizes; the multiplier of the shared "
               "L(C) fit only where that fit is adequate against the seed noise (*Compute multipliers* below); the "
               "throughput against the baseline's from runs each alone on its device (the ratio of median tokens/s "
               "over seeds, in brackets the range of the seed-paired ratios; where the ablation's runs shared their "
               "device, from the --speed runs of the same size, else none and why), beside their utilisation; and "
               "the wall-clock multiplier = compute multiplier x tokens/s ratio x FLOPs/token ratio (> 1: the option "
               f"reaches the loss sooner), given only at a utilisation of {100 * min_mfu:g}% or more (below it the "
               "step time is mostly launches and host work, which do not scale with the model)." + ladder, "",
               markdown_table(display_headline(h)), "", "Table: [headline.csv](headline.csv).")


def _approach3(rep: Report, name: str, df: pd.DataFrame, args, budgets: np.ndarray) -> Optional[dict]:
    n, d, loss = df["N"].to_numpy(), df["D"].to_numpy(), df["loss"].to_numpy()
    reason = why_not(n, d)
    if reason:
        rep.add(f"### Approach 3 — {name}", f"Skipped: {reason}.")
        return None
    kappa, k_lo, k_hi = flops_per_param_token(n, d, df["C"].to_numpy())
    fit = fit_chinchilla(n, d, loss, grid=args.grid, kappa=kappa)
    boot = bootstrap_chinchilla(n, d, loss, n_boot=args.n_boot, seed=args.seed, init=fit.theta, progress=True,
                                description=f"bootstrap approach 3 ({name})", kappa=kappa,
                                units=resampling_units(df)) if args.n_boot else None
    rep.add(f"### Approach 3 — {name}",
            f"{len(df)} points, {len(np.unique(size_groups(n)))} sizes; {fit.n_starts} L-BFGS-B starts, "
            f"{fit.n_near_best} end within 0.01% of the best objective {fit.objective:.6g} "
            f"(converged: {fit.converged}). "
            + (f"Bootstrap: {boot.n_converged}/{boot.n_requested} replicates converged (seed {args.seed}; "
               "refit from the best point; non-converged dropped; "
               + ("the branches of a trunk drawn together)." if boot.units < len(df) else "runs drawn one by one).")
               if boot else ""))
    points = points_table(df, seed_col="seed")
    noise = SeedNoise.given(args.seed_noise) if args.seed_noise else pooled_noise(points)
    test = adequacy(points["loss"] - fit.predict(points["N"], points["D"]), points["n"], noise, 5,
                    mean_covariance(points, trunk_correlation(df).used))
    rep.add("Against the seed noise (" + (f"sd {noise.sd:.4g}, {noise.source}" if noise.known else noise.source)
            + f"), at the {len(points)} point means: " + (
                f"chi2 {test.chi2:.4g} on {test.dof} dof, p {fmt(test.p, 3)}: **{test.verdict}**." if test.dof and
                noise.known else f"**not tested** ({'no degrees of freedom left' if noise.known else 'no noise'})."))
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
    spread = "" if np.isclose(k_lo, k_hi, rtol=1e-6) else f"; {k_lo:.4g} to {k_hi:.4g} over the runs"
    rep.add(f"Compute-optimal allocation under C = kappa N D, kappa = {kappa:.4g} (median C / (N D){spread}):")
    rep.table(opt)
    out = {"fit": fit, "boot": boot, "llo": None}
    try:
        llo_fit, held = leave_largest_out(n, d, loss, n_sizes=args.llo_sizes, grid=args.grid, kappa=kappa)
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


def definitions(args) -> str:
    """The one definition of N, D and C every fit, allocation and multiplier of the report uses."""
    if args.csv:
        return f"N, D, C and the loss are the CSV's columns as mapped ({args.map or 'canonical names'})."
    return (f"N = {args.n_def} ({N_DEFINITIONS[args.n_def]}), D = {args.d_col}, C = {args.c_def} "
            f"({C_DEFINITIONS[args.c_def]}), loss = {args.loss_col}, for every fit, allocation and multiplier below "
            "(other definitions: --n, --c).")


def section_trunks(rep: Report, df: pd.DataFrame) -> None:
    """The WSD trunks left out of the points, and which points share a trunk."""
    fam, left_out = families(df), df.attrs.get("trunks_left_out", 0)
    if fam.empty and not left_out:
        return
    corr = trunk_correlation(df)
    rep.add("### Points that share a trunk",
            f"The runs read hold {left_out} WSD trunk(s), none of them a point: a trunk ends at the peak rate. Its "
            "cooldown branches are points of their own, one per budget; the branches of one trunk share their "
            "prefix, so they are never seeds of one point, and their seed noise is correlated: rho "
            + (f"{corr.rho:.3f}, {corr.source} (used: {corr.used:.3f})" if np.isfinite(corr.rho) else
               f"{corr.source}, so treated as 0 and the intervals below that average a family's points are too "
               "narrow") + ". The fit tests use that covariance, and every resampling draws a trunk's branches "
            "together (approach 1 and the multipliers: the seed-noise replicates; approach 3: its bootstrap).")
    if len(fam):
        rep.table(fam.rename(columns={"points": "branch points", "D": "D of its branch points"}))


def section_approach1(rep: Report, df: pd.DataFrame, args, label: str) -> None:
    """Approach 1 (analysis.approach1): L(D) per size, the envelope's crossovers and N_opt ∝ C^a."""
    noise = SeedNoise.given(args.seed_noise) if args.seed_noise else None
    fit = fit_approach1(df, label, noise=noise, n_boot=args.n_boot_small, seed=args.seed)
    sd = fmt(fit.noise.sd, 4) if fit.noise.known else "unknown"
    rep.add(f"### Approach 1 — L(D) per size, {label}",
            f"At each size with points at >= {MIN_TOKEN_COUNTS} token counts, log L = log A_N - b_N log D "
            "(weighted by seeds), tested against the seed noise (sd " + sd + f"; {fit.noise.source}) on points - 2 "
            f"dof; 95% intervals from {fit.n_boot} seed-noise replicates of the point means (a trunk's "
            "branches together). The envelope (the lowest loss of any size at each compute, searched over the "
            "compute the ladder trained) changes size at the crossovers; N_opt ∝ C^a through them "
            "(analysis/approach1.py).")
    sizes = fit.sizes.assign(**{"b [95% CI]": interval_texts(fit.sizes["b"], fit.sizes["b_lo"], fit.sizes["b_hi"])})
    rep.table(sizes[["N", "points", "seeds", "D", "b [95% CI]", "loss_first", "loss_last", "chi2", "dof", "p",
                     "verdict"]].rename(columns={"loss_first": "loss at first D", "loss_last": "loss at last D"}))
    if fit.crossovers.empty:
        rep.add(f"The envelope keeps N = {fit.lowest:,.0f} over all the compute the ladder trained: no crossover.")
    else:
        c = fit.crossovers
        cross = c.assign(**{"C [95% CI]": interval_texts(c["C"], c["C_lo"], c["C_hi"]), "in replicates": c["share"]})
        rep.table(cross[["from_N", "to_N", "C [95% CI]", "in replicates", "loss", "in data range"]])
        smaller = (fit.crossovers["to_N"] < fit.crossovers["from_N"]).any()
        rep.add(("N_opt ∝ C^a: a = " + interval_texts([fit.a], [fit.a_lo], [fit.a_hi], 3)[0] + "."
                 if np.isfinite(fit.a) else "N_opt ∝ C^a needs two crossovers; a is not estimated.")
                + (" The envelope moves to a smaller size at some crossover: a smaller size's line is steeper, and "
                   "its extrapolation, not a measurement, puts it below the larger one there." if smaller else ""))
    points = points_table(df.assign(variant=label), seed_col="seed")
    rep.figure(plots.plot_approach1(points[points["N"].isin(fit.fits["N"])], fit), f"approach1_{_slug(label)}",
               f"Approach 1: loss against compute per size, {label} (dotted: a size's line beyond its points)")


def _slug(text: str) -> str:
    """A label as a file-name part: letters, digits, '-', '_', '.' kept, anything else '_'."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def section_scaling(rep: Report, df: pd.DataFrame, args, label: str = "all rows",
                    every_variant: Optional[pd.DataFrame] = None) -> None:
    """The fits of one variant's rows `df` (approaches 1, 3 and 2); with `every_variant` (the rows of all
    variants), the trunks of all of them and approach 1 of each other variant too."""
    df = df.dropna(subset=["N", "D", "C", "loss"])
    rep.add("## Scaling laws", definitions(args))
    section_trunks(rep, df if every_variant is None else every_variant)
    if applicable(df):
        section_approach1(rep, df, args, label)
    if every_variant is not None:
        for variant, rows in every_variant[every_variant["variant"] != label].groupby("variant", sort=True):
            if applicable(rows):
                section_approach1(rep, rows, args, str(variant))
    reason = why_not(df["N"], df["D"])
    if reason:
        rep.add(f"Approaches 3 and 2: skipped: {reason}. L(C) and the compute multipliers (below, where there are "
                "variants) need neither.")
        return
    budgets = (np.array(parse_budgets(args.budgets)) if args.budgets
               else default_budgets(df["C"].to_numpy()))
    scen = {label: df}
    for sub in args.subset:
        name, _, q = sub.partition(":")
        scen[name.strip()] = df.query(q.strip() if q else name)
    for alt in args.alt_n:
        column = alt if args.csv else N_DEFINITIONS[alt]
        scen[f"N = {alt}"] = df.assign(N=df[column].astype(float))
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
    kappa = flops_per_param_token(df["N"], df["D"], df["C"])[0]
    try:
        iso = fit_isoflop(df["N"], df["C"], df["loss"], budget=budget, n_boot=args.n_boot_small, seed=args.seed,
                          kappa=kappa)
    except ValueError as e:
        rep.add("### Approach 2 (isoFLOP parabolas)", f"Not applicable to these points: {str(e).splitlines()[0]}")
        return
    ci = iso.ci()
    rep.add("### Approach 2 (isoFLOP parabolas)",
            f"Budgets are runs whose log10 C lie within {args.iso_tol} dex of each other; D_opt = C / (kappa N_opt), "
            f"kappa = {kappa:.4g}. "
            f"N_opt ∝ C^a with a = {iso.a:.3f} [{fmt(ci.loc['a', 'lo'])}, {fmt(ci.loc['a', 'hi'])}]; "
            f"D_opt ∝ C^b with b = {iso.b:.3f} [{fmt(ci.loc['b', 'lo'])}, {fmt(ci.loc['b', 'hi'])}] "
            f"(95% bootstrap over runs within budgets, {len(iso.boot)}/{args.n_boot_small} replicates usable).")
    rep.table(iso.parabolas[["C", "n_runs", "N_opt", "L_opt", "valid", "why"]])
    rep.figure(plots.plot_isoflop(df, iso, budget), "isoflop", "isoFLOP parabolas and N_opt against C")


def section_multipliers(rep: Report, df: pd.DataFrame, args) -> Optional[Multipliers]:
    """Seed noise, L(C) per variant with its tests, and the compute multipliers against the baseline variant
    (returned; None when there is no baseline with two sizes and another variant). Writes multipliers.csv."""
    if "variant" not in df or df["variant"].nunique() < 2:
        return None
    if len(rep.lines) and not any(line.startswith("## Scaling") for line in rep.lines):
        rep.add("## Scaling laws", definitions(args))
    base = args.baseline_variant
    noise = SeedNoise.given(args.seed_noise) if args.seed_noise else None
    try:
        mult = compute_multipliers(df, base, seed_col="seed", noise=noise, select=args.lc_points,
                                   n_boot=args.n_boot_multipliers, seed=args.seed)
    except ValueError as e:
        rep.add("### Compute multipliers", f"Skipped: {e}.")
        return None
    if mult.per_size.empty:
        rep.add("### Compute multipliers", f"Skipped: the baseline '{base}' has fewer than two sizes.")
        return None
    pts = mult.points
    rep.add("### Compute multipliers",
            f"Points: the runs of one variant, N and D, their loss the mean over seeds ({args.lc_points} points of each "
            "variant used). **Seed noise**: "
            + (f"sd = {mult.noise.sd:.4g} of one run's loss, {mult.noise.source}. " if mult.noise.known else
               f"{mult.noise.source}, and no --seed-noise given: no intervals and no fit tests. ")
            + "A point with one seed is given this spread too (the same for every variant and size). Every interval "
            f"below is a 95% percentile interval of a parametric bootstrap ({args.n_boot_multipliers} replicates) in "
            "which each point keeps its place and its mean moves by the seed noise over the square root of its seeds "
            "(the noise's own uncertainty drawn too; the branches of one trunk together, correlated by "
            + (f"rho {mult.correlation.used:.3f}, {mult.correlation.source}" if np.isfinite(mult.correlation.rho)
               else f"nothing: {mult.correlation.source}") + "): never from dropping points.")
    shown = pts.assign(_other=pts["variant"] != base).sort_values(["_other", "variant", "C"]).drop(columns="_other")
    shown = shown.drop(columns="trunks")  # the trunks each point's branches came from: the families table has them
    quiet = [c for c, v in (("repeats", shown["repeats"].any()), ("used", not shown["used"].all())) if not v]
    rep.table(shown.drop(columns=quiet))  # repeated seeds and unused points, only where there are any
    rep.add("**Per size.** At each point of a variant, how much more compute the baseline needs to reach the "
            "variant's mean loss, read off the baseline's own points interpolated in log C against log L (> 1: the "
            "variant is better); `extrapolated` where the baseline's end segment is extended beyond its points.")
    ps = mult.per_size
    rep.table(pd.DataFrame({"variant": ps["variant"], "N": ps["N"], "C": ps["C"], "seeds": ps["n"], "loss": ps["loss"],
                            "multiplier [95% CI]": interval_texts(ps["multiplier"], ps["lo"], ps["hi"]),
                            "extrapolated": ps["extrapolated"], "crossover": ps["crossover"]}))
    if not mult.trends.empty:
        tr = mult.trends
        rep.add("**Trend.** The slope of log multiplier against log C over a variant's sizes (least squares), with its "
                "interval from the same replicates: > 0 the gain grows with scale, < 0 it shrinks.")
        rep.table(pd.DataFrame({"variant": tr["variant"], "sizes": tr["sizes"],
                                "of them extrapolated": tr["extrapolated"],
                                "slope [95% CI]": interval_texts(tr["slope"], tr["lo"], tr["hi"]),
                                "verdict": tr["verdict"], "crossovers": tr["crossovers"]}))
    fits = mult.fits
    rep.add("**L(C) fits against the seed noise.** L(C) = L_inf + A (C/C0)^-alpha, weighted least squares on the "
            "point means: `own` per variant (>= 4 points), `shared` L_inf and alpha with the baseline (one A each). "
            "chi2 = sum of seeds x residual^2 / sd^2 on points - parameters degrees of freedom, its p-value from F "
            "(the noise estimated) or chi-square (given); `inadequate` at p < 0.05. The shared fit's multiplier "
            "(A_base / A_var)^(1/alpha) holds at every C only where that fit is adequate; an inadequate fit's "
            "multiplier is shown for the record, not as a result.")
    rep.table(pd.DataFrame({"fit": fits["kind"], "variant": fits["variant"], "points": fits["points"],
                            "L_inf": fits["L_inf"], "alpha": fits["alpha"], "A": fits["A"],
                            "multiplier [95% CI]": interval_texts(*(fits[c].where(fits["kind"] == "shared")
                                                                    for c in ("multiplier", "lo", "hi"))),
                            "chi2": fits["chi2"], "dof": fits["dof"], "p": fits["p"], "verdict": fits["verdict"]}))
    mult.table().to_csv(rep.path("multipliers.csv"), index=False)
    rep.add("Table (one row per variant and size, method per_size, and one per variant for the shared fit, method "
            "fit): [multipliers.csv](multipliers.csv).")
    used = pts[pts["used"]]
    rep.figure(plots.plot_loss_vs_compute(used, fits=mult.curves, color_by="variant", title="L(C) per variant"),
               "loss_vs_compute_variants", "L(C) per variant: point means, each variant's own fit, the frontier")
    rep.figure(plots.plot_multipliers(mult), "compute_multipliers",
               "Compute multipliers per size with seed-noise 95% intervals (open: extrapolated); adequate shared "
               "fits as bands")
    return mult


# --------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.split("\n")[0])
    add_source_args(p)
    p.add_argument("--out", required=True, help="report folder (report.md, figures, ablation.csv)")
    p.add_argument("--speed", action="append", default=[], metavar="PATH",
                   help="timing runs (repeatable), each option alone on its device: the headline's throughput ratio "
                        "where the ablation's runs shared theirs (summary.json's device_shared)")
    p.add_argument("--title", default=None)
    add_ablation_args(p)
    p.add_argument("--also-metric", action="append", default=[], metavar="COLUMN",
                   help="another summary column with an ablation table of its own beside --metric's (repeatable), "
                        "e.g. eval/<task>/acc (python -m k3lab.evaluate) or probe/mqar/1024/acc")
    p.add_argument("--grid", default="full", choices=["full", "coarse"], help="approach-3 init grid")
    p.add_argument("--n-boot", type=int, default=400, help="approach-3 bootstrap replicates (0 = none)")
    p.add_argument("--n-boot-small", type=int, default=200, help="bootstrap replicates of approach 2")
    p.add_argument("--n-boot-multipliers", type=int, default=2000,
                   help="parametric bootstrap replicates of the compute multipliers and their trend (seed noise)")
    p.add_argument("--seed-noise", type=float, default=None, metavar="SD",
                   help="the seed-to-seed sd of one run's loss, taken as exact, instead of the one pooled over the "
                        "points with >= 2 seeds (e.g. for a table with no seeds)")
    p.add_argument("--min-mfu", type=float, default=MIN_MFU,
                   help="the utilisation (MFU, 0-1) below which the headline gives no wall-clock multiplier")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--budgets", default=None, help="FLOP budgets for the allocation tables, e.g. 1e18,1e20,1e22")
    p.add_argument("--subset", action="append", default=[],
                   help="extra approach-3 fit on a subset, 'NAME: pandas query', e.g. 'D >= 1e9: D >= 1e9'")
    p.add_argument("--alt-n", action="append", default=[],
                   help="extra approach-3 fit with another N: a name of --n for run directories (e.g. total), "
                        "a column for a CSV (e.g. N_no_emb); its allocation uses its own kappa = C / (N D)")
    p.add_argument("--llo-sizes", type=int, default=1, help="largest model sizes left out in the prediction check")
    p.add_argument("--iso-tol", type=float, default=0.05, help="dex within which runs share a FLOP budget")
    p.add_argument("--variant-col", default=None, help="CSV column naming the variant for L(C) and multipliers")
    p.add_argument("--baseline-variant", default=None,
                   help="variant the multipliers are relative to (default: baseline, the runs at the K3 default)")
    p.add_argument("--formats", default="png,svg", help="figure formats (png is always written)")
    p.add_argument("--lc-points", default="frontier", choices=["frontier", "all"],
                   help="points of each variant used for L(C) and the multipliers: its Pareto frontier or all")
    return p


def check_settings(args) -> None:
    """The report's own numbers and formats, in one line each (ValueError)."""
    if args.seed_noise is not None and not args.seed_noise > 0:
        raise ValueError(f"--seed-noise {args.seed_noise}: must be a standard deviation > 0")
    if not 0 <= args.min_mfu <= 1:
        raise ValueError(f"--min-mfu {args.min_mfu}: a utilisation between 0 and 1")
    for name in ("n_boot", "n_boot_small", "n_boot_multipliers"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: a number of replicates, >= 0")
    if args.llo_sizes < 1 or not args.iso_tol > 0:
        raise ValueError(f"--llo-sizes {args.llo_sizes} (>= 1) and --iso-tol {args.iso_tol} (> 0)")
    formats = [f for f in args.formats.split(",") if f]
    supported = plots.FORMATS
    for f in formats:
        if f not in supported:
            raise ValueError(not_valid("--formats", f, "a figure format", supported))
    if args.budgets:
        parse_budgets(args.budgets)


def check_scaling_options(df: pd.DataFrame, args, variants: list[str]) -> None:
    """--alt-n, --subset and --baseline-variant against the table the scaling sections read (ValueError)."""
    valid = list(df.columns) if args.csv else [k for k, column in N_DEFINITIONS.items() if column in df]
    for alt in args.alt_n:
        if alt not in valid:
            raise ValueError(not_valid("--alt-n", alt, "a CSV column" if args.csv else "a count of N these runs have",
                                       valid))
    for sub in args.subset:
        name, _, query = sub.partition(":")
        check_query(df, (query or name).strip(), "--subset")
    if args.baseline_variant is not None and args.baseline_variant not in variants:
        raise ValueError(not_valid("--baseline-variant", args.baseline_variant, "a variant of these runs", variants))


def main(argv: Optional[list[str]] = None) -> Path:
    args = build_parser().parse_args(argv)
    try:  # every option against the sources first: a mistake stops here, in one line, nothing computed or written
        if not args.csv and not args.paths:
            raise ValueError("give run directories (or globs) or --csv FILE")
        check_out_folder(args.out)
        check_settings(args)
        if args.csv:
            df = scaling_table_from_args(args)
            if args.variant_col and args.variant_col not in df:
                raise ValueError(not_valid("--variant-col", args.variant_col, "a CSV column", df.columns))
            if args.variant_col:
                df["variant"] = df[args.variant_col].astype(str)
            check_scaling_options(df, args, sorted(set(df["variant"])) if "variant" in df else [])
        else:
            col = collect(args.paths)
            require_runs(col, args.paths)
            check_ablation_options(col.runs, args)
            read_primary(args.primary, col.runs)
            variants = variant_labels(col.runs, parse_baseline(args.baseline))
            df = scaling_from_runs(col.runs.assign(variant=variants), args)
            base_variant = args.baseline_variant or "baseline"
            if df is not None:
                check_scaling_options(df[df["variant"] == base_variant], args, sorted(set(variants)))
        speed_runs = None
        if args.speed:
            speed = collect(args.speed, curves=False)
            require_runs(speed, args.speed)
            speed_runs = speed.runs
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise SystemExit(f"analysis.report: {one_line(e)}") from None
    args.baseline_variant = args.baseline_variant or "baseline"
    rep = Report(Path(args.out), tuple(f for f in args.formats.split(",") if f))
    src = args.csv or " ".join(args.paths)
    rep.add(f"# {args.title or 'Analysis report: ' + src}",
            f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} by",
            "```", "python -m analysis.report " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])), "```")
    if args.csv:
        rep.add(f"Source: `{args.csv}`, {len(df)} rows after selection "
                f"(drop-highest {args.drop_highest}, best-of '{args.best_of}', where {' and '.join(args.where) or '-'}).")
        section_scaling(rep, df, args)
        section_multipliers(rep, df, args)
        missing = (f"{len(df)} rows after selection; approach 3: {why_not(df['N'], df['D']) or 'no fit'}; compute "
                   "multipliers: " + ("need --variant-col" if not args.variant_col else
                                      f"need the baseline variant {args.baseline_variant!r} at >= 2 sizes and another "
                                      "variant"))
    else:
        print_dirs(col)
        runs_text = section_runs(rep, col, variants)
        headline_at = len(rep.lines)
        try:
            table = section_ablation(rep, col, variants, args)
        except ValueError as e:  # e.g. a primary comparison with no row to compare
            raise SystemExit(f"analysis.report: {e}") from None
        section_also(rep, col, args)
        mult = None
        if df is not None:
            base = df[df["variant"] == args.baseline_variant]
            if (len(base) >= MIN_POINTS and len(np.unique(size_groups(base["N"]))) >= MIN_SIZES
                    or applicable(base)):
                rep.add("Approaches 3 and 2 use the baseline variant's runs; approach 1 is fitted to each variant, "
                        "L(C) and the multipliers use every variant.")
                section_scaling(rep, base, args, label=args.baseline_variant, every_variant=df)
            mult = section_multipliers(rep, df, args)
        if not table.empty:
            speed = None
            if speed_runs is not None:
                speed = table_from_args(speed_runs, argparse.Namespace(**{**vars(args), "tune": False, "primary": None}))
                rep.add(f"Throughput where the ablation's runs shared their device: from the {len(speed_runs)} "
                        f"timing runs of {' '.join(args.speed)}.")
            section_headline(rep, headline_at, table, mult, speed, args.min_mfu)
        missing = what_is_missing(col.runs, variants, table.attrs.get("notes", []), N_DEFINITIONS[args.n_def])
    if not rep.holds:  # no headline, no ablation, no figure: an empty report is no success
        if not args.csv:
            print(runs_text)
        raise SystemExit(f"analysis.report: nothing to report, so nothing written to {args.out}: {missing}")
    path = rep.write()
    print(f"report: {path}")
    return path


def scaling_from_runs(runs: pd.DataFrame, args) -> Optional[pd.DataFrame]:
    """The runs as the scaling table (N, D, C, loss by --n, --c, --d-col, --loss-col; --drop-highest, --best-of,
    --where applied), the options checked against them; None when the runs have no parameter count."""
    if N_DEFINITIONS[args.n_def] not in runs:
        return None
    check_metric(runs, args.loss_col, "--loss-col")
    check_numeric_column(runs, args.d_col, "--d-col")
    df = runs_to_scaling(runs, args.n_def, args.c_def, args.d_col, args.loss_col)
    return select_rows(df, args.drop_highest, _split(args.best_of), args.where)


if __name__ == "__main__":
    main()
