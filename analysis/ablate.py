"""Ablation tables: for each switch, each option against the K3 default at a matched configuration.

A run belongs to the ablation of switch S when it differs from the baseline configuration only in S:
every other switch at its baseline option. Runs are then matched on the columns that identify the rest
of the configuration (default: model, data, tokens); each such cell compares the options of S.

Per option: n seeds, mean, standard deviation, Student-t 95% CI of the mean. Against the baseline:
delta = mean(option) - mean(baseline) with a 95% CI and p-value from a paired t-test when both sides
have the same seeds (scipy.stats.ttest_rel), else Welch's t-test (scipy.stats.ttest_ind, equal_var=False).

    python -m analysis.ablate runs/abl --metric loss_val_final --md abl.md --csv abl.csv --plot abl
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from analysis.collect import collect
from analysis.switches import K3_DEFAULT, SWITCH_OPTIONS, SWITCHES

# The baseline of an ablation: the K3 default of each switch (the first option of each group).
DEFAULT_BASELINE = K3_DEFAULT
# What must be equal for two runs to be compared: the model config and its size (a ladder shares one
# config name across depths), the data and the training length.
DEFAULT_MATCH = ("model", "n_layers", "d_model", "data", "tokens")


def effective_baseline(runs: pd.DataFrame, baseline: Optional[dict] = None,
                       switches: Sequence[str] = SWITCHES) -> tuple[dict, list[str]]:
    """The reference option of every switch present in `runs`, and notes on the choices made.

    The reference is the baseline option (DEFAULT_BASELINE updated by `baseline`) when some run has it;
    a switch that takes a single value in the whole sweep is held fixed at that value; otherwise the
    switch has no reference (None) and a note says so."""
    want = {**DEFAULT_BASELINE, **(baseline or {})}
    ref, notes = {}, []
    for s in switches:
        if s not in runs.columns:
            continue
        values = runs[s].dropna().unique().tolist()
        if want.get(s) in values:
            ref[s] = want[s]
        elif len(values) == 1:
            ref[s] = values[0]
            notes.append(f"{s}: no run uses the baseline {want.get(s)!r}; held fixed at {values[0]!r}")
        else:
            ref[s] = None
            notes.append(f"{s}: no run uses the baseline {want.get(s)!r} among {values}; pass --baseline {s}=OPTION")
    return ref, notes


def variant_labels(runs: pd.DataFrame, baseline: Optional[dict] = None) -> pd.Series:
    """'baseline' for runs at the reference configuration, else e.g. 'glu=swiglu' or 'glu=swiglu,moe=dense'."""
    ref, _ = effective_baseline(runs, baseline)

    def label(row):
        diff = [f"{s}={row[s]}" for s, r in ref.items() if r is not None and row[s] != r]
        return ",".join(diff) if diff else "baseline"

    return runs.apply(label, axis=1) if len(runs) else pd.Series(dtype=str)


def describe(x: np.ndarray, level: float = 0.95) -> dict:
    """n, mean, std (ddof=1), Student-t CI of the mean (NaN when n < 2)."""
    x = np.asarray(x, float)
    n = len(x)
    mean = float(x.mean()) if n else np.nan
    if n < 2:
        return {"n": n, "mean": mean, "std": np.nan, "ci_lo": np.nan, "ci_hi": np.nan}
    std = float(x.std(ddof=1))
    lo, hi = stats.t.interval(level, n - 1, loc=mean, scale=std / np.sqrt(n)) if std > 0 else (mean, mean)
    return {"n": n, "mean": mean, "std": std, "ci_lo": float(lo), "ci_hi": float(hi)}


def compare(opt: pd.DataFrame, base: pd.DataFrame, metric: str, level: float = 0.95) -> dict:
    """delta = mean(opt) - mean(base), its CI and p-value; paired on seeds when both have the same seeds."""
    a, b = opt[metric].to_numpy(float), base[metric].to_numpy(float)
    out = {"delta": float(a.mean() - b.mean()), "delta_lo": np.nan, "delta_hi": np.nan, "p_value": np.nan, "test": ""}
    sa = opt["seed"].tolist() if "seed" in opt else []
    sb = base["seed"].tolist() if "seed" in base else []
    paired = len(sa) >= 2 and len(set(sa)) == len(sa) and sorted(sa) == sorted(sb)
    if paired:
        a = opt.set_index("seed")[metric].astype(float)
        b = base.set_index("seed")[metric].astype(float).loc[a.index]
        d = (a - b).to_numpy()
        if np.all(d == d[0]):  # zero variance of the differences: exact, no test
            out.update(delta_lo=float(d[0]), delta_hi=float(d[0]), test="paired (constant)")
            return out
        res = stats.ttest_rel(a.to_numpy(), b.to_numpy())
        test = "paired t"
    elif len(a) >= 2 and len(b) >= 2:
        res = stats.ttest_ind(a, b, equal_var=False)
        test = "Welch t"
    else:
        out["test"] = "n<2"
        return out
    ci = res.confidence_interval(level)
    out.update(delta_lo=float(ci.low), delta_hi=float(ci.high), p_value=float(res.pvalue), test=test)
    return out


def _ordered(switch: str, options: Sequence, ref) -> list:
    known = SWITCH_OPTIONS.get(switch, ())
    rest = sorted((o for o in options if o not in known and o != ref), key=str)
    return [ref] + [o for o in known if o in options and o != ref] + rest


def one_per_seed(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Repeated runs of one configuration with the same seed are one sample, not several: average them
    per seed (they differ only by nondeterminism), so n counts independent seeds."""
    if "seed" not in runs or not runs["seed"].duplicated().any():
        return runs
    return runs.groupby("seed", as_index=False)[metric].mean()


def ablation_table(runs: pd.DataFrame, metric: str = "loss_val_final", baseline: Optional[dict] = None,
                   match: Optional[Sequence[str]] = None, level: float = 0.95,
                   switches: Sequence[str] = SWITCHES) -> pd.DataFrame:
    """One row per (switch, matched cell, option), the baseline option first in each cell.

    Columns: switch, option, baseline, <match columns>, n, seeds, mean, std, ci_lo, ci_hi, delta,
    delta_lo, delta_hi, p_value, test. A table attribute `notes` lists the baseline choices made."""
    if metric not in runs.columns:
        raise KeyError(f"metric {metric!r} not in the runs table; choose one of {sorted(map(str, runs.columns))}")
    ref, notes = effective_baseline(runs, baseline, switches)
    match = [c for c in (DEFAULT_MATCH if match is None else match) if c in runs.columns]
    runs = runs[runs[metric].notna()]
    rows = []
    for s, r in ref.items():
        if r is None or runs[s].nunique() < 2:
            continue
        others = [o for o, ro in ref.items() if o != s and ro is not None]
        mask = np.ones(len(runs), bool)
        for o in others:
            mask &= (runs[o] == ref[o]).to_numpy()
        sub = runs[mask]
        groups = sub.groupby(match, dropna=False, sort=True) if match else [((), sub)]
        for key, cell in groups:
            key = key if isinstance(key, tuple) else (key,)
            if cell[s].nunique() < 2:
                continue  # nothing to compare in this cell
            base = one_per_seed(cell[cell[s] == r], metric)
            if base.empty:
                notes.append(f"{s}: cell {dict(zip(match, key))} has no baseline run; skipped")
                continue
            for opt in _ordered(s, cell[s].unique().tolist(), r):
                g = one_per_seed(cell[cell[s] == opt], metric)
                row = {"switch": s, "option": opt, "baseline": r, **dict(zip(match, key))}
                row.update(describe(g[metric].to_numpy(), level))
                row["seeds"] = ",".join(map(str, sorted(g["seed"].tolist()))) if "seed" in g else ""
                if opt == r:
                    row.update(delta=0.0, delta_lo=np.nan, delta_hi=np.nan, p_value=np.nan, test="baseline")
                else:
                    row.update(compare(g, base, metric, level))
                rows.append(row)
    cols = ["switch", "option", "baseline", *match, "n", "seeds", "mean", "std", "ci_lo", "ci_hi",
            "delta", "delta_lo", "delta_hi", "p_value", "test"]
    table = pd.DataFrame(rows, columns=cols)
    table.attrs["notes"] = notes
    table.attrs["metric"] = metric
    return table


def fmt(v, digits: int = 4) -> str:
    """Compact number formatting for tables."""
    if isinstance(v, (float, np.floating)):
        if np.isnan(v):
            return ""
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}g}" if abs(v) >= 1 else f"{v:.{digits}f}"
    return str(v)


def markdown_table(df: pd.DataFrame, digits: int = 4) -> str:
    """DataFrame -> GitHub Markdown table (no extra dependency)."""
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(fmt(v, digits).replace("|", "\\|") for v in row) + " |"
            for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *body])


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """The ablation table with intervals merged into readable strings."""
    out = table.copy()
    out["mean ± 95% CI"] = [f"{fmt(m)} [{fmt(lo)}, {fmt(hi)}]" if not np.isnan(lo) else fmt(m)
                            for m, lo, hi in zip(table["mean"], table["ci_lo"], table["ci_hi"])]
    out["delta [95% CI]"] = ["—" if t == "baseline" else
                             (f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}]" if not np.isnan(lo) else f"{d:+.4f}")
                             for d, lo, hi, t in zip(table["delta"], table["delta_lo"], table["delta_hi"], table["test"])]
    out["p"] = [fmt(p, 3) for p in table["p_value"]]
    keep = [c for c in out.columns if c not in ("baseline", "mean", "ci_lo", "ci_hi", "delta", "delta_lo",
                                                  "delta_hi", "p_value")]
    return out[keep]


def print_ablation(table: pd.DataFrame) -> None:
    from rich.console import Console
    from rich.table import Table

    disp = display_table(table).drop(columns=["seeds"])
    constant = [c for c in disp.columns if c not in ("switch", "option", "n", "test") and disp[c].nunique() <= 1]
    disp = disp.drop(columns=constant)  # e.g. one model / data / token count: said in the title instead
    t = Table(title=f"Ablations ({table.attrs.get('metric', '')}, lower is better)")
    for c in disp.columns:
        t.add_column(str(c), justify="right" if c in ("n", "std", "p") else "left")
    for _, row in disp.iterrows():
        style = "dim" if row["test"] == "baseline" else None
        t.add_row(*[fmt(v) for v in row], style=style)
    con = Console()
    con.width = max(con.width, 150)
    same = [f"{c}={fmt(display_table(table)[c].iloc[0])}" for c in constant
            if fmt(display_table(table)[c].iloc[0]) not in ("", "nan")]
    if same:
        con.print("same for every row: " + ", ".join(same))
    con.print(t)
    for n in table.attrs.get("notes", []):
        con.print(f"[yellow]note:[/yellow] {n}")


def _parse_baseline(items: Sequence[str]) -> dict:
    out = {}
    for it in items:
        for part in it.split(","):
            if "=" not in part:
                raise SystemExit(f"--baseline expects SWITCH=OPTION, got {part!r}")
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m analysis.ablate",
                                description="Per-switch ablation table against the K3 default.")
    p.add_argument("paths", nargs="+", help="run directories, sweep folders or globs")
    p.add_argument("--metric", default="loss_val_final", help="summary column to compare (lower is better)")
    p.add_argument("--baseline", action="append", default=[], help="override the reference, e.g. moe=dense")
    p.add_argument("--match", default=",".join(DEFAULT_MATCH), help="columns that identify a matched cell")
    p.add_argument("--md", help="write the table as Markdown here")
    p.add_argument("--csv", help="write the full table as CSV here")
    p.add_argument("--plot", help="write the delta point plot here (path stem; .png and .svg)")
    args = p.parse_args(argv)
    col = collect(args.paths, verbose=True, curves=False)
    if col.runs.empty:
        raise SystemExit("no usable runs")
    table = ablation_table(col.runs, args.metric, _parse_baseline(args.baseline),
                           [c for c in args.match.split(",") if c])
    if table.empty:
        raise SystemExit("no switch has runs that differ from the baseline in that switch only")
    print_ablation(table)
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
