"""Ablation tables: for each switch, each option against the K3 default, in cells of runs that differ in
nothing but the switch.

Cells (analysis.cells): the runs of the ablation of switch S have every other switch at its reference
option; a cell holds those whose whole resolved config is equal but for the seed, the bookkeeping and the
keys under comparison, and whose model, size, data, run length and global batch are equal. A run differing
in anything else is in another cell; the table names each cell by the keys in which the cells of a switch
differ (`cell`), so nothing is pooled silently.

Rows. In a cell, the runs of one option with one setting of the compared keys make one row: an LR grid is
never averaged (untuned, each rate is a cell of its own; for S = optim, whose group holds the rates, each
rate a row). Untuned (the default): every row against the baseline option's row; when the baseline option
has several settings in a cell the deltas are left out and the verdict says so. Tuned (`tune=True`,
analysis.tuning): each option at its own best setting, chosen on the tuning seeds and reported on the
others; `rate` says which rate the row used and `grid_edge` whether the choice lies at an edge of the grid.

Statistics per row (analysis.stats): n seeds, mean, standard deviation, Student-t 95% CI; against the
baseline the delta, its CI and p-value (paired t-test on matching seeds, else Welch), `p_holm` adjusted over
all comparisons of the table (Holm), the verdict at ALPHA, and `mde`, the minimum detectable effect. Each
row also has its N (the active non-embedding parameters by default) and FLOPs per token relative to the
baseline row, and its throughput relative to the baseline's (speed_ratio: the ratio of the two sides' median
tokens/s over seeds, with the range of the seed-paired ratios), none where either side's runs shared their
device (summary.json's device_shared; device_shared_why says why, and the row's warning repeats it).

    python -m analysis.ablate runs/abl --metric loss_val_final --md abl.md --csv abl.csv --plot abl
    python -m analysis.ablate runs/tune_moe --tune                      # each option at its own best rate
    python -m analysis.ablate runs/tune_moe --tune --next               # only the commands to run next
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd

from analysis.cells import (BOOKKEEPING, DEFAULT_MATCH, SHOWN, column_mean, differing, effective_baseline,
                            group_rows, length_label, ordered_options, rate_label, setting_label, shared_device,
                            show_value, under, variant_labels)
from analysis.checks import check_ablation_options, check_out_file, one_line, require_runs, what_is_missing
from analysis.collect import DEFAULT_N, N_DEFINITIONS, collect, print_dirs
from analysis.stats import ALPHA, compare, describe, holm, one_per_seed
from analysis.switches import SWITCHES
from analysis.tables import column_format, fmt, format_columns, interval_texts, markdown_table, ratio_text
from analysis.trunks import is_trunk
from analysis.tuning import TUNE_SEED_MIN, TUNED, next_commands, pick_tuned, tuning_table

TABLE_COLUMNS = ["switch", "option", "baseline", "cell", "rate", "setting", "grid_edge", "n", "seeds", "mean",
                 "std", "ci_lo", "ci_hi", "delta", "delta_lo", "delta_hi", "p_value", "p_holm", "family", "test",
                 "mde", "verdict", "warnings", "N", "N_rel", "tokens", "flops_per_token", "flops_rel", "tokens_per_s",
                 "tokens_per_s_rel", "tokens_per_s_lo", "tokens_per_s_hi", "mfu", "run_ids"]


def ablation_table(runs: pd.DataFrame, metric: str = "loss_val_final", baseline: Optional[dict] = None,
                   match: Optional[Sequence[str]] = None, level: float = 0.95, switches: Sequence[str] = SWITCHES,
                   ignore: Sequence[str] = (), tune: bool = False, tuned: Sequence[str] = TUNED,
                   tune_seeds: Optional[Sequence[int]] = None, n_def: str = DEFAULT_N,
                   report_seeds: str = "0,1,2", primary: Optional[Sequence[str]] = None) -> pd.DataFrame:
    """One row per (switch, cell, option, setting), the baseline first in each cell (module docstring).

    match: summary columns that must be equal (DEFAULT_MATCH); ignore: config keys (or prefixes, without
    'config.') treated as bookkeeping beside BOOKKEEPING; tune: each option at its own best setting of
    its group's keys and `tuned`, chosen on the tuning seeds (`tune_seeds`, default seed >= TUNE_SEED_MIN);
    n_def: the N definition of the N column (analysis.collect.N_DEFINITIONS); report_seeds: the seeds in
    the commands of tuning_table. Columns: TABLE_COLUMNS plus the match columns after `baseline`.
    attrs: notes (baseline choices, cells left out), metric, tune, n_comparisons (the Holm family),
    tuning (every setting tried, tuned comparisons only; read it with tuning_table)."""
    if metric not in runs.columns:
        raise KeyError(f"metric {metric!r} not in the runs table; choose one of {sorted(map(str, runs.columns))}")
    ref, notes = effective_baseline(runs, baseline, switches)
    if "length" not in runs.columns and "tokens" in runs.columns:
        runs = runs.assign(length=length_label(runs))
    match = [c for c in (DEFAULT_MATCH if match is None else match) if c in runs.columns]
    runs = runs[runs[metric].notna()]
    trunks = is_trunk(runs)
    if trunks.any():  # a WSD trunk ends at the peak rate: no end point to compare (analysis.trunks)
        notes.append(f"{int(trunks.sum())} WSD trunk(s) left out: a trunk ends at the peak rate; its cooldown "
                     "branches are compared")
        runs = runs[~trunks]
    is_tune: Callable[[pd.Series], pd.Series] = (
        (lambda s: s >= TUNE_SEED_MIN) if tune_seeds is None else (lambda s: s.isin(list(tune_seeds))))
    n_col = N_DEFINITIONS[n_def]
    config_cols = [c for c in runs.columns if c.startswith("config.")]
    skip = (*BOOKKEEPING, *ignore)
    rows, tuning = [], []
    for s, r in ref.items():
        if r is None or runs[s].nunique() < 2:
            continue
        mask = np.ones(len(runs), bool)
        for o, ro in ref.items():
            if o != s and ro is not None:
                mask &= (runs[o] == ro).to_numpy()
        sub = runs[mask]
        own = [c for c in config_cols if under(c.removeprefix("config."), (s,)) and c != f"config.{s}.name"]
        tuned_cols = [f"config.{k}" for k in tuned if f"config.{k}" in runs.columns]
        compared = set(own) | (set(tuned_cols) if tune else set())
        cell_cols = [*match, *(c for c in config_cols if c not in compared and c != f"config.{s}.name"
                               and not under(c.removeprefix("config."), skip))]
        setting_cols = [c for c in config_cols if c in compared]
        strip = f"config.{s}." if s == "optim" else "config."
        cells = group_rows(sub, cell_cols)
        named = [j for j in differing([k for k, _ in cells], cell_cols)
                 if cell_cols[j].startswith("config.") and cell_cols[j] not in SHOWN
                 and cell_cols[j] not in tuned_cols]
        for key, cell in cells:
            cell_name = setting_label(key, cell_cols, named)
            where = dict(zip(match, key[:len(match)]))
            options = ordered_options(s, cell[s].unique().tolist(), r)
            if options == [r]:
                continue  # baseline runs alone (the baseline of other switches' ablations): nothing to compare
            if r not in options:
                shown = cell_name or ", ".join(f"{k}={show_value(v)}" for k, v in where.items())
                notes.append(f"{s}: {len(cell)} run(s) of {', '.join(map(str, options))} in a cell with no {r!r} "
                             f"run ({shown}); not compared")
                continue
            picked = {}  # option -> [(setting, runs, grid edge, warning)], one entry per row
            for opt in options:
                settings = group_rows(cell[cell[s] == opt], setting_cols)
                vary = [j for j in differing([k for k, _ in settings], setting_cols)
                        if setting_cols[j] not in tuned_cols]  # the rates have a column of their own
                if tune:
                    picked[opt] = pick_tuned(s, opt, cell_name, settings, setting_cols, vary, tuned_cols, metric,
                                              is_tune, strip, report_seeds, tuning)
                else:
                    picked[opt] = [(setting_label(k, setting_cols, vary, strip), g, "", "") for k, g in settings]
            base_rows = picked[r]
            for opt in options:
                for setting, g, edge, extra in picked[opt]:
                    row = {"switch": s, "option": opt, "baseline": r, **where, "cell": cell_name,
                           "rate": rate_label(g, tuned_cols, strip), "setting": setting, "grid_edge": edge}
                    rows.append(_fill(row, g, base_rows, opt == r, metric, level, n_col, extra))
    columns = [*TABLE_COLUMNS[:3], *match, *(c for c in TABLE_COLUMNS[3:] if c not in match)]
    table = pd.DataFrame(rows, columns=columns)
    table["family"] = family(table, primary)
    in_family = table["family"].isin(["all", "primary"]).to_numpy()
    table["p_holm"] = np.where(in_family, holm(table["p_value"].where(in_family)), np.nan) if len(table) else []
    table["verdict"] = [_verdict(t) for t in table.itertuples()]
    table.attrs.update(notes=notes, metric=metric, tune=tune, tuning=tuning, primary=list(primary or []),
                       n_comparisons=int(table["p_value"].where(in_family).notna().sum()))
    return table


def family(table: pd.DataFrame, primary: Optional[Sequence[str]]) -> list[str]:
    """Each row's Holm family: 'primary' for the rows of a declared primary comparison ('switch=option'),
    'exploratory' for the others ('' for the baseline rows); 'all' for every row when none is declared (one
    report, one family). A
    primary comparison that names no row of the table raises ValueError."""
    if not primary:
        return ["all"] * len(table)
    names = [f"{s}={o}" for s, o in zip(table["switch"], table["option"])]
    missing = [p for p in primary if p not in names]
    if missing:
        compared = sorted({n for n, t in zip(names, table["test"]) if t != "baseline"})
        raise ValueError(f"primary comparison(s) {missing} name no row of the ablation table; its comparisons: "
                         f"{compared}")
    return ["" if t == "baseline" else "primary" if n in primary else "exploratory"
            for n, t in zip(names, table["test"])]


def _fill(row: dict, g: pd.DataFrame, base_rows: list, is_base: bool, metric: str, level: float, n_col: str,
          extra: str) -> dict:
    """Statistics of one row against the baseline (the only baseline row of the cell)."""
    sample, repeats = one_per_seed(g, metric)
    row.update(describe(sample[metric].to_numpy(), level))
    row["seeds"] = ",".join(map(str, sorted(sample["seed"].tolist()))) if "seed" in sample else ""
    warnings = [extra] if extra else []
    if row["n"] < 3:
        warnings.append(f"n={row['n']} < 3 seeds")
    warnings += [f"seed {k} run {v} times (averaged)" for k, v in repeats.items()]
    if row["grid_edge"]:
        warnings.append(f"best rate at the grid edge ({row['grid_edge']})")
    row.update(N=column_mean(g, n_col), tokens=column_mean(g, "tokens"),
               flops_per_token=column_mean(g, "flops_per_token"), tokens_per_s=column_mean(g, "tokens_per_s_median"),
               run_ids=";".join(g["run_id"]) if "run_id" in g else "")
    nan = {"delta": np.nan, "delta_lo": np.nan, "delta_hi": np.nan, "p_value": np.nan, "mde": np.nan}
    if is_base:
        row.update(nan, delta=0.0, test="baseline")
    elif len(base_rows) != 1:
        row.update(nan, test=f"baseline has {len(base_rows)} settings")
    elif row["n"] == 0 or len(base_rows[0][1]) == 0:
        row.update(nan, test="no runs")
    else:
        row.update(compare(sample, one_per_seed(base_rows[0][1], metric)[0], metric, level))
    base_g = base_rows[0][1] if len(base_rows) == 1 else g.iloc[:0]
    for col, src in (("N_rel", n_col), ("flops_rel", "flops_per_token")):
        base_mean = column_mean(base_g, src) if len(base_g) else np.nan
        row[col] = column_mean(g, src) / base_mean if base_mean else np.nan
    row["tokens_per_s_rel"], row["tokens_per_s_lo"], row["tokens_per_s_hi"] = speed_ratio(g, base_g)
    # the utilisation of the pair: the lower of the two runs' median MFU (NaN when not logged)
    row["mfu"] = min(column_mean(g, "mfu_median"), column_mean(base_g, "mfu_median")) if len(base_g) else np.nan
    shared = shared_device(pd.concat([g, base_g]))
    if shared:  # others trained on the same device, or the machine was busy: not the option's own speed
        row["tokens_per_s_rel"] = row["tokens_per_s_lo"] = row["tokens_per_s_hi"] = row["mfu"] = np.nan
        if not is_base:
            warnings.append(f"no throughput ratio: runs shared their device ({shared})")
    row["warnings"] = "; ".join(warnings)
    return row


def speed_ratio(g: pd.DataFrame, base_g: pd.DataFrame, col: str = "tokens_per_s_median") -> tuple:
    """(ratio, lo, hi): the runs' tokens/s over the baseline runs', as the ratio of the two sides' medians over
    seeds, and the range (min, max) of the ratios of the seeds both sides ran (a seed run twice: its median).
    The range is the spread a throughput ratio from a few seeds has; NaN with fewer than 2 paired seeds, all
    NaN where a side has no tokens/s."""
    nan = (np.nan, np.nan, np.nan)
    if col not in g or col not in base_g or not len(base_g):
        return nan
    by = "seed" if "seed" in g and "seed" in base_g else None
    side, base = ((x.groupby(by)[col].median() if by else x[col]).pipe(pd.to_numeric, errors="coerce").dropna()
                  for x in (g, base_g))
    if side.empty or base.empty or not base.median() > 0:
        return nan
    paired = (side / base).dropna() if by else pd.Series(dtype=float)
    lo, hi = (paired.min(), paired.max()) if len(paired) >= 2 else (np.nan, np.nan)
    return float(side.median() / base.median()), float(lo), float(hi)


def _verdict(t) -> str:
    if t.test == "baseline":
        return "baseline"
    if t.test.startswith("baseline has"):
        return f"no delta: the {t.test}; compare with --tune (each option at its best setting)"
    if t.test == "no runs":
        return "no runs to compare"
    if t.test == "n<2":
        return "no test (n < 2 on a side)"
    if t.test == "paired (constant)":
        return "same difference at every seed (no test)"
    if t.family == "exploratory":
        return f"exploratory (p {fmt(t.p_value, 3)} uncorrected; MDE {fmt(t.mde)})"
    if t.p_holm < ALPHA:
        return "better" if t.delta < 0 else "worse"
    return f"not significant (MDE {fmt(t.mde)})"



def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """The ablation table as text: intervals merged into readable strings, every column written by one rule
    (analysis.tables), columns with nothing in them left out."""
    out = table.copy()
    out["mean ± 95% CI"] = interval_texts(table["mean"], table["ci_lo"], table["ci_hi"])
    out["delta [95% CI]"] = ["—" if t == "baseline" else "" if np.isnan(d) else  # nats, to 1e-4 in every row
                             (f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}]" if not np.isnan(lo) else f"{d:+.4f}")
                             for d, lo, hi, t in zip(table["delta"], table["delta_lo"], table["delta_hi"], table["test"])]
    for name, col in (("p", "p_value"), ("p (Holm)", "p_holm")):
        out[name] = list(map(column_format(table[col], 3), table[col]))
    out["N / base"] = [ratio_text(v) for v in table["N_rel"]]
    out["FLOPs/token / base"] = [ratio_text(v) for v in table["flops_rel"]]
    out["tokens/s / base [seed range]"] = [ratio_text(*x) for x in zip(
        table["tokens_per_s_rel"], table["tokens_per_s_lo"], table["tokens_per_s_hi"])]
    out["MFU"] = [f"{100 * v:.1f}%" if np.isfinite(v) else "" for v in table["mfu"].astype(float)]
    drop = {"baseline", "mean", "ci_lo", "ci_hi", "delta", "delta_lo", "delta_hi", "p_value", "p_holm", "mde", "N",
            "N_rel", "flops_per_token", "flops_rel", "tokens_per_s", "tokens_per_s_rel", "tokens_per_s_lo",
            "tokens_per_s_hi", "mfu", "run_ids"}
    if (table["family"] == "all").all():
        drop.add("family")
    keep = [c for c in out.columns if c not in drop and c not in ("verdict", "warnings")] + ["verdict", "warnings"]
    out = format_columns(out[keep])
    return out.drop(columns=[c for c in out.columns if (out[c] == "").all()])


def print_ablation(table: pd.DataFrame) -> None:
    from rich.console import Console
    from rich.table import Table

    shown = display_table(table)
    disp = shown.drop(columns=[c for c in ("seeds",) if c in shown])
    constant = [c for c in disp.columns if c not in ("switch", "option", "n", "test", "verdict", "warnings")
                and disp[c].nunique() <= 1]
    disp = disp.drop(columns=constant)  # e.g. one model / data / token count: said in the title instead
    t = Table(title=f"Ablations ({table.attrs.get('metric', '')}, lower is better; "
                    f"Holm over {table.attrs.get('n_comparisons', 0)} comparisons)")
    for c in disp.columns:
        t.add_column(str(c), justify="right" if c in ("n", "std", "p", "p (Holm)") else "left", overflow="fold")
    for _, row in disp.iterrows():
        style = "dim" if row["test"] == "baseline" else None
        t.add_row(*[fmt(v) for v in row], style=style)
    con = Console()
    con.width = max(con.width, 150)
    same = [f"{c}={fmt(shown[c].iloc[0])}" for c in constant if fmt(shown[c].iloc[0]) not in ("", "nan")]
    if same:
        con.print("same for every row: " + ", ".join(same))
    con.print(t)
    for n in table.attrs.get("notes", []):
        con.print(f"[yellow]note:[/yellow] {n}")


def parse_baseline(items: Sequence[str]) -> dict:
    """--baseline's items ('moe=dense', or several joined by commas) -> {switch: option}; ValueError in one
    line for an item that is not SWITCH=OPTION."""
    out = {}
    for it in items:
        for part in it.split(","):
            if "=" not in part:
                raise ValueError(f"--baseline expects SWITCH=OPTION, got {part!r}")
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _seeds(s: Optional[str]) -> Optional[list[int]]:
    return None if not s else [int(x) for x in s.split(",") if x.strip()]


def add_ablation_args(p: argparse.ArgumentParser) -> None:
    """The options of the ablation table (shared by analysis.ablate and analysis.report)."""
    p.add_argument("--metric", default="loss_val_final", help="summary column to compare (lower is better)")
    p.add_argument("--baseline", action="append", default=[], help="override the reference, e.g. moe=dense")
    p.add_argument("--match", default=",".join(DEFAULT_MATCH),
                   help="summary columns that must be equal within a cell (besides the whole config.yaml)")
    p.add_argument("--ignore", default="", help="config keys (or prefixes) to treat as bookkeeping besides "
                                                f"{', '.join(BOOKKEEPING)}, e.g. train.log_every,data.num_workers")
    p.add_argument("--tune", action="store_true",
                   help="compare each option at its own best setting (rates and the switch's own keys), chosen on "
                        f"the tuning seeds (>= {TUNE_SEED_MIN} unless --tune-seeds) and reported on the others")
    p.add_argument("--tuned", default=",".join(TUNED), help="hyperparameters a tuned comparison chooses per option")
    p.add_argument("--tune-seeds", default=None, help="the tuning seeds, e.g. 1000,1001 (default: seed >= 1000)")
    p.add_argument("--report-seeds", default="0,1,2", help="seeds in the printed commands for the reported runs")
    p.add_argument("--primary", metavar="FILE", default=None,
                   help="the study's file declaring its primary comparisons (YAML, `primary: [residual=standard, "
                        "...]`): Holm over them alone, every other row exploratory (default: one family of all rows)")


def read_primary(path: Optional[str], runs: Optional[pd.DataFrame] = None) -> list[str]:
    """The primary comparisons a study file declares (`primary:`, a list of 'switch=option'), checked against
    the switches and, when given, the options the runs have; ValueError in one line otherwise."""
    if not path:
        return []
    import yaml

    try:
        spec = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--primary {path}: cannot be read ({type(e).__name__})") from None
    items = spec.get("primary") if isinstance(spec, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"--primary {path}: no `primary:` list (e.g. `primary: [residual=standard, optim=adamw]`)")
    for item in map(str, items):
        switch, _, option = item.partition("=")
        if switch not in SWITCHES or not option:
            raise ValueError(f"--primary {path}: {item!r} is not switch=option (switches: {', '.join(SWITCHES)})")
        if runs is not None and switch in runs and option not in set(runs[switch].dropna()):
            raise ValueError(f"--primary {path}: no run has {item}; options run: "
                             f"{sorted(map(str, set(runs[switch].dropna())))}")
    return [str(i) for i in items]


def table_from_args(runs: pd.DataFrame, args) -> pd.DataFrame:
    return ablation_table(runs, args.metric, parse_baseline(args.baseline), [c for c in args.match.split(",") if c],
                          ignore=[c for c in args.ignore.split(",") if c], tune=args.tune,
                          tuned=[c for c in args.tuned.split(",") if c], tune_seeds=_seeds(args.tune_seeds),
                          n_def=getattr(args, "n_def", DEFAULT_N), report_seeds=args.report_seeds,
                          primary=read_primary(args.primary))


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m analysis.ablate",
                                description="Per-switch ablation table against the K3 default.")
    p.add_argument("paths", nargs="+", help="run directories, sweep folders or globs")
    add_ablation_args(p)
    p.add_argument("--n", dest="n_def", default=DEFAULT_N, choices=list(N_DEFINITIONS), help="the N column")
    p.add_argument("--md", help="write the table as Markdown here")
    p.add_argument("--csv", help="write the full table as CSV here")
    p.add_argument("--plot", help="write the delta point plot here (path stem; .png and .svg)")
    p.add_argument("--next", action="store_true",
                   help="with --tune: print only the commands to run next, one per line (next_commands)")
    args = p.parse_args(argv)
    try:  # every option against the runs first: a mistake stops here, in one line, nothing written
        if args.next and not args.tune:
            raise ValueError("--next lists what a tuned comparison runs next: add --tune")
        for option in ("md", "csv", "plot"):
            check_out_file(getattr(args, option), f"--{option}")
        col = collect(args.paths, curves=False)
        require_runs(col, args.paths)
        check_ablation_options(col.runs, args)
        read_primary(args.primary, col.runs)
        table = table_from_args(col.runs, args)
        if table.empty:
            variants = variant_labels(col.runs, parse_baseline(args.baseline))
            missing = what_is_missing(col.runs, variants, table.attrs.get("notes", []), N_DEFINITIONS[args.n_def])
            raise ValueError(f"no ablation table: {missing}")
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise SystemExit(f"analysis.ablate: {one_line(e)}") from None
    if args.next:
        print("\n".join(next_commands(table)))
        return
    print_dirs(col)
    print_ablation(table)
    tuning = tuning_table(table)
    if not tuning.empty:
        print(tuning.to_string(index=False))
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown_table(display_table(table)) + "\n")
    if args.csv:
        table.to_csv(args.csv, index=False)
    if args.plot:
        from analysis.plots import plot_ablation, save

        save(plot_ablation(table), args.plot)


if __name__ == "__main__":
    main()
