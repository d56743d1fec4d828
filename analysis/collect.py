"""Run directories (docs/run_directory.md) or an external CSV -> pandas DataFrames.

    runs    one row per usable run: every summary.json field, `switches` flattened into one column per
            switch (decay, glu, ...), other nested dicts as "versions.torch"-style columns, the resolved
            config as "config.<group>.<key>" columns, the overrides (a JSON list), the downstream evals of
            evals/<task>.json (`python -m k3lab.evaluate`) as "eval/<task>/<measure>" columns, plus run_id,
            path, read_note (what could not be read, empty when everything could) and mfu_median (the median
            of the run's logged speed/mfu, where summary.json has none). runs.attrs["higher_is_better"] names
            the columns where a larger value is better (eval measures as lm-eval says, recall-probe
            accuracies `probe/.../acc`); every other metric is lower-is-better.
    curves  long table of metrics.jsonl: run_id, step, tokens, flops, metric, value.
    dirs    every directory given or found: used, partially read (a completed run whose metrics.jsonl is
            missing or truncated: its summary and good lines count) or skipped, with the reason.

External tables: `load_csv(path, {"N": "Model Size", "C": "Training FLOP", "loss": "loss"})` renames the
mapped columns to canonical names and derives D = C / (6 N) or C = 6 N D when one is missing.

    python -m analysis.collect runs/sweep1 'runs/abl-*' --out runs.csv --curves curves.csv
    python -m analysis.collect --csv table.csv --map 'N=Model Size,C=Training FLOP,loss=loss'
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from analysis.switches import SWITCHES
from analysis.trunks import is_trunk, scaling_points

CANONICAL = ("N", "D", "C", "loss")

# One definition of N and of C serves every fit, allocation and multiplier (approach 3, approach 2, L(C)
# and the compute multipliers, the ablation table's parameter column): a name chosen once, mapped to the
# summary.json field it reads. The defaults: N = active non-embedding parameters (routed experts counted by
# top_k / n_experts, the input embedding left out, the LM head kept), C = the project's training FLOPs
# (k3lab/flops.py: 6 x active matmul weights plus the sequence-mixing terms, times tokens).
N_DEFINITIONS = {"active_non_embedding": "params_active_non_embedding", "active": "params_active",
                 "non_embedding": "params_non_embedding", "total": "params_total"}
C_DEFINITIONS = {"flops": "flops", "6nd": "flops_6nd"}
DEFAULT_N, DEFAULT_C = "active_non_embedding", "flops"

# Files only a run directory holds: a folder with one of them but no summary.json is a run that never
# wrote its summary (listed as skipped, never dropped).
RUN_FILES = ("summary.json", "config.yaml", "overrides.yaml", "metrics.jsonl")


@dataclass
class Collection:
    """runs: one row per usable run; curves: the long metrics table; dirs: every directory given or found,
    one row each (run_id, state, reason, path, run_name), state 'used', 'partial' (used, but part of its
    files could not be read: `reason` says what) or 'skipped' (not used: `reason` says why)."""
    runs: pd.DataFrame
    curves: pd.DataFrame
    dirs: pd.DataFrame

    @property
    def skipped(self) -> pd.DataFrame:
        return self.dirs[self.dirs["state"] == "skipped"].reset_index(drop=True)

    @property
    def partial(self) -> pd.DataFrame:
        return self.dirs[self.dirs["state"] == "partial"].reset_index(drop=True)


def find_run_dirs(paths: Iterable[str | os.PathLike]) -> tuple[list[Path], list[Path]]:
    """(run directories, given folders that hold none). Each path is a run directory, a folder searched
    recursively, a summary.json file, or a glob of any of these. A run directory is a folder holding one
    of RUN_FILES, its summary.json or not. Order kept, duplicates dropped. A path that does not exist, or
    a glob that matches nothing, raises FileNotFoundError; a file other than summary.json, ValueError."""
    found: list[Path] = []
    empty: list[Path] = []
    for p in paths:
        p = str(p)
        matches = sorted(glob.glob(p, recursive=True)) if glob.has_magic(p) else [p]
        if not matches:
            raise FileNotFoundError(f"{p!r} matches nothing")
        for m in map(Path, matches):
            if not m.exists():
                raise FileNotFoundError(f"{str(m)!r} does not exist")
            if m.is_file():
                if m.name != "summary.json":
                    raise ValueError(f"{str(m)!r} is a file but not a summary.json (use --csv for tables)")
                found.append(m.parent)
            elif any((m / f).exists() for f in RUN_FILES):
                found.append(m)
            else:
                below = sorted({f.parent for name in RUN_FILES for f in m.rglob(name)})
                found.extend(below)
                if not below:
                    empty.append(m)
    seen, out = set(), []
    for d in found:
        key = d.resolve()
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out, empty


def read_metrics(path: Path) -> tuple[list[dict], list[int]]:
    """Parsed metrics.jsonl lines and the 1-based numbers of the lines that failed to parse."""
    records, bad = [], []
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                bad.append(i)
                continue
            if isinstance(obj, dict):
                records.append(obj)
            else:
                bad.append(i)
    return records, bad


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out


def summary_row(summary: dict) -> dict:
    """summary.json -> one flat row; `switches` become top-level columns named by the switch."""
    row = {}
    for k, v in summary.items():
        if k == "switches" and isinstance(v, dict):
            row.update(v)
        elif isinstance(v, dict):
            row.update(_flatten(v, k + "."))
        else:
            row[k] = v
    return row


def _read_config(path: Path) -> dict:
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return _flatten(cfg, "config.") if isinstance(cfg, dict) else {}


def _read_overrides(path: Path) -> Optional[str]:
    """overrides.yaml (a YAML list of the command-line overrides) as a JSON list, or None."""
    import yaml

    try:
        items = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return json.dumps([str(i) for i in items]) if isinstance(items, list) else None


def read_evals(d: Path) -> tuple[dict, dict, list[str]]:
    """evals/<task>.json of run directory `d` -> ({"eval/<task>/<measure>": value}, {column: higher is better},
    the files that could not be read)."""
    values, higher, bad = {}, {}, []
    for path in sorted((d / "evals").glob("*.json")):
        try:
            record = json.loads(path.read_text())
            task, metrics = record["task"], record["metrics"]
        except (OSError, ValueError, KeyError, TypeError):
            bad.append(path.name)
            continue
        for measure, value in metrics.items():
            values[f"eval/{task}/{measure}"] = value
        higher.update({f"eval/{task}/{m}": bool(h) for m, h in record.get("higher_is_better", {}).items()})
    return values, higher, bad


def _check_run(d: Path) -> tuple[Optional[dict], list[dict], str, str]:
    """(summary or None, metrics records, state, reason): state 'used'; 'partial' for a completed run
    whose metrics.jsonl is missing, empty or has unparseable lines (its summary and its good lines are
    used); 'skipped' when summary.json is missing or unreadable or the run did not complete."""
    sp = d / "summary.json"
    if not sp.exists():
        return None, [], "skipped", "summary.json missing (the run never wrote it: killed at start, or deleted)"
    try:
        summary = json.loads(sp.read_text())
        if not isinstance(summary, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return None, [], "skipped", f"summary.json unreadable ({type(e).__name__}: {e})"
    status = summary.get("status")
    if status == "running":
        return summary, [], "skipped", "still running (status=running)"
    if status == "failed":
        return summary, [], "skipped", f"failed: {summary.get('error') or 'no error message'}"
    if status != "completed":
        return summary, [], "skipped", f"unknown status {status!r}"
    mp = d / "metrics.jsonl"
    if not mp.exists():
        return summary, [], "partial", "metrics.jsonl missing: the summary is used, no curves"
    records, bad = read_metrics(mp)
    if bad:
        return summary, records, "partial", (f"metrics.jsonl truncated or corrupt: {len(bad)} unparseable line(s), "
                                             f"first line {bad[0]}; the summary and {len(records)} good lines are used")
    if not records:
        return summary, [], "partial", "metrics.jsonl empty: the summary is used, no curves"
    return summary, records, "used", ""


def _run_ids(dirs: list[Path]) -> list[str]:
    """Run ids: paths relative to the runs' common parent (unique), or the folder name for one run."""
    if not dirs:
        return []
    if len(dirs) == 1:
        return [dirs[0].name]
    resolved = [d.resolve() for d in dirs]
    root = Path(os.path.commonpath([str(r.parent) for r in resolved]))
    return [str(r.relative_to(root)) for r in resolved]


def curves_frame(run_id: str, records: list[dict]) -> pd.DataFrame:
    """metrics.jsonl records -> long rows (run_id, step, tokens, flops, metric, value), numeric values only."""
    df = pd.DataFrame.from_records(records)
    for col in ("step", "tokens", "flops"):
        if col not in df:
            df[col] = np.nan
    long = df.melt(id_vars=["step", "tokens", "flops"], var_name="metric", value_name="value")
    long["value"] = pd.to_numeric(long["value"], errors="coerce")
    long = long.dropna(subset=["value"])
    long.insert(0, "run_id", run_id)
    return long


def collect(paths: Iterable[str | os.PathLike], include_config: bool = True, curves: bool = True,
            verbose: bool = False) -> Collection:
    """Read every run directory under `paths` (see find_run_dirs). Never raises on a bad run: every
    directory gets a row of `dirs` (used, partial or skipped, with the reason). Raises only for a path
    that does not exist (FileNotFoundError). verbose: print the counts and the skipped and partially
    read directories."""
    dirs, empty = find_run_dirs(paths)
    ids = _run_ids(dirs)
    rows, curve_parts, listed, higher = [], [], [], {}
    for d, rid in zip(dirs, ids):
        summary, records, state, reason = _check_run(d)
        evals, eval_higher, bad_evals = read_evals(d) if state != "skipped" else ({}, {}, [])
        if bad_evals:
            state, reason = "partial", "; ".join(filter(None, [reason, f"unreadable evals: {', '.join(bad_evals)}"]))
        listed.append({"run_id": rid, "state": state, "reason": reason, "path": str(d),
                       "run_name": (summary or {}).get("run_name", d.name)})
        if state == "skipped":
            continue
        higher.update(eval_higher)
        higher.update({k: True for k in summary if k.startswith("probe/") and k.endswith("/acc")})
        row = {"run_id": rid, "path": str(d), **summary_row(summary), **evals, "read_note": reason}
        if "mfu_median" not in row:  # the run's utilisation: the median of its logged speed/mfu
            mfu = [r["speed/mfu"] for r in records if isinstance(r.get("speed/mfu"), (int, float))]
            row["mfu_median"] = float(np.median(mfu)) if mfu else np.nan
        if include_config and (d / "config.yaml").exists():
            row.update(_read_config(d / "config.yaml"))
        if (d / "overrides.yaml").exists():
            row["overrides"] = _read_overrides(d / "overrides.yaml")
        rows.append(row)
        if curves and records:
            curve_parts.append(curves_frame(rid, records))
    for m in empty:
        listed.append({"run_id": str(m), "state": "skipped", "path": str(m), "run_name": m.name,
                       "reason": "no run directory here (no summary.json, config.yaml or metrics.jsonl in it "
                                 "or below it)"})
    runs = pd.DataFrame(rows)
    runs.attrs["higher_is_better"] = higher
    curv = (pd.concat(curve_parts, ignore_index=True) if curve_parts
            else pd.DataFrame(columns=["run_id", "step", "tokens", "flops", "metric", "value"]))
    col = Collection(runs=runs, curves=curv,
                     dirs=pd.DataFrame(listed, columns=["run_id", "state", "reason", "path", "run_name"]))
    if verbose:
        print_dirs(col)
    return col


collect_runs = collect  # package-level name (`analysis.collect` is the module)


def print_dirs(col: Collection) -> None:
    """One line of counts, then rich tables of the skipped and the partially read directories (stderr)."""
    from rich.console import Console
    from rich.table import Table

    con = Console(stderr=True)
    n_used = int((col.dirs["state"] != "skipped").sum())
    con.print(f"{len(col.dirs)} run directories: {n_used} used ({len(col.partial)} partially read), "
              f"{len(col.skipped)} skipped")
    for title, part in ((f"Skipped ({len(col.skipped)})", col.skipped),
                        (f"Partially read ({len(col.partial)})", col.partial)):
        if part.empty:
            continue
        t = Table(title=title)
        for c in ("run_id", "reason"):
            t.add_column(c, overflow="fold")
        for _, r in part.iterrows():
            t.add_row(str(r["run_id"]), str(r["reason"]))
        con.print(t)


# --------------------------------------------------------------------------------------------------
# External CSV tables
# --------------------------------------------------------------------------------------------------

def parse_mapping(spec: str | dict | None) -> dict:
    """'N=Model Size,C=Training FLOP,loss=loss' -> {'N': 'Model Size', ...} (canonical name = CSV column)."""
    if spec is None:
        return {}
    if isinstance(spec, dict):
        return dict(spec)
    out = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ValueError(f"bad mapping item {part!r}: expected canonical=CSV column, e.g. 'N=Model Size'")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def load_csv(path: str | os.PathLike, mapping: str | dict | None = None) -> pd.DataFrame:
    """Read a CSV; rename mapped columns to canonical names (N, D, C, loss, or any name you choose);
    derive D = C/(6N) or C = 6ND when missing. Unmapped columns are kept."""
    df = pd.read_csv(path)
    mapping = parse_mapping(mapping)
    missing = [v for v in mapping.values() if v not in df.columns]
    if missing:
        raise KeyError(f"{path}: columns {missing} not found; available: {list(df.columns)}")
    for canon, col in mapping.items():
        if canon != col:
            df[canon] = df[col]
    for c in CANONICAL:  # huge integers (FLOPs > 2^63) load as object/uint64
        if c in df.columns:
            df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    df = _derive(df, str(path))
    return df


def _derive(df: pd.DataFrame, where: str) -> pd.DataFrame:
    has = {c: c in df.columns for c in ("N", "D", "C")}
    if has["N"] and has["C"] and not has["D"]:
        df["D"] = df["C"] / (6.0 * df["N"])
    elif has["N"] and has["D"] and not has["C"]:
        df["C"] = 6.0 * df["N"] * df["D"]
    elif has["D"] and has["C"] and not has["N"]:
        df["N"] = df["C"] / (6.0 * df["D"])
    if "loss" not in df.columns:
        raise KeyError(f"{where}: no 'loss' column; map one, e.g. --map loss=<column>")
    return df


def select_rows(df: pd.DataFrame, drop_highest: int = 0, best_of: Sequence[str] = (),
                where: Sequence[str] = ()) -> pd.DataFrame:
    """In this order: drop the `drop_highest` highest-loss rows; keep the lowest-loss row per `best_of`
    group (e.g. the best LR per (model, D)); apply each pandas `where` query (e.g. 'D >= 1e9'). A column
    that is not there, a query that cannot run or keeps no row: ValueError in one line."""
    from analysis.checks import check_query, not_valid

    if drop_highest:
        if not 0 <= drop_highest < len(df):
            raise ValueError(f"--drop-highest {drop_highest}: between 0 and {len(df) - 1} for {len(df)} rows")
        df = df.sort_values("loss").iloc[:-drop_highest]
    for c in best_of:
        if c not in df.columns:
            raise ValueError(not_valid("--best-of", c, "a column", df.columns))
    if best_of:
        df = df.loc[df.groupby(list(best_of), dropna=False)["loss"].idxmin()]
    for q in where:
        df = check_query(df, q, "--where")
    return df.reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# Shared command-line plumbing
# --------------------------------------------------------------------------------------------------

def add_source_args(p: argparse.ArgumentParser) -> None:
    """Arguments every tool shares: run directories or a CSV, and how to make the (N, D, C, loss) table."""
    p.add_argument("paths", nargs="*", help="run directories, sweep folders (searched recursively) or globs")
    p.add_argument("--csv", help="external table instead of run directories")
    p.add_argument("--map", default=None, help="CSV column mapping, e.g. 'N=Model Size,C=Training FLOP,loss=loss'")
    p.add_argument("--drop-highest", type=int, default=0, help="drop the K highest-loss rows first")
    p.add_argument("--best-of", default="", help="keep the lowest-loss row per group, e.g. 'model,D'")
    p.add_argument("--where", action="append", default=[], help="pandas query on canonical columns, e.g. 'D >= 1e9'")
    p.add_argument("--n", dest="n_def", default=DEFAULT_N, choices=list(N_DEFINITIONS),
                   help=f"which parameter count is N, for every fit and the ablation table (run directories; "
                        f"default {DEFAULT_N}: {N_DEFINITIONS[DEFAULT_N]})")
    p.add_argument("--c", dest="c_def", default=DEFAULT_C, choices=list(C_DEFINITIONS),
                   help="which compute is C: the project's FLOPs (flops) or 6ND (flops_6nd) (run directories)")
    p.add_argument("--d-col", default="tokens", help="run column used as D (run directories)")
    p.add_argument("--loss-col", default="loss_val_final", help="run column used as the loss (run directories)")


def runs_to_scaling(runs: pd.DataFrame, n: str = DEFAULT_N, c: str = DEFAULT_C, d_col: str = "tokens",
                    loss_col: str = "loss_val_final") -> pd.DataFrame:
    """runs DataFrame -> the canonical table (N, D, C, loss and every other column kept). n, c: names of
    N_DEFINITIONS and C_DEFINITIONS; the table's attrs record them (`n_def`, `c_def`) and the WSD trunks
    left out (`trunks_left_out`: a trunk ends at the peak rate, no (N, D) point; analysis.trunks), and
    `trunk_id` names each cooldown branch's trunk."""
    n_col, c_col = N_DEFINITIONS[n], C_DEFINITIONS[c]
    missing = [x for x in (n_col, c_col, d_col, loss_col) if x not in runs.columns]
    if missing:
        raise KeyError(f"runs have no column(s) {missing}; choose N with --n, C with --c, D and the loss with "
                       "--d-col / --loss-col")
    df = scaling_points(runs)
    df["N"], df["D"], df["loss"] = df[n_col].astype(float), df[d_col].astype(float), df[loss_col].astype(float)
    df["C"] = df[c_col].astype(float)
    df = df.dropna(subset=["N", "D", "C", "loss"]).reset_index(drop=True)
    df.attrs.update(n_def=f"{n} ({n_col})", c_def=f"{c} ({c_col})", trunks_left_out=int(is_trunk(runs).sum()))
    return df


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def scaling_table_from_args(args, collection: Optional[Collection] = None) -> pd.DataFrame:
    """The (N, D, C, loss) table of a command's sources: the CSV (--csv, --map) or the runs under args.paths
    (--n, --c, --d-col, --loss-col, each checked against them), rows selected by select_rows. ValueError in
    one line for a source or option that does not fit."""
    from analysis.checks import check_metric, check_numeric_column, require_runs

    if args.csv:
        df = load_csv(args.csv, args.map)
    else:
        if not args.paths:
            raise ValueError("give run directories (or globs) or --csv FILE")
        collection = collection or collect(args.paths)
        require_runs(collection, args.paths)
        check_metric(collection.runs, args.loss_col, "--loss-col")
        check_numeric_column(collection.runs, args.d_col, "--d-col")
        df = runs_to_scaling(collection.runs, args.n_def, args.c_def, args.d_col, args.loss_col)
    return select_rows(df, args.drop_highest, _split(args.best_of), args.where)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m analysis.collect",
                                description="Collect run directories (or a CSV) into tables; list every "
                                            "directory that was skipped or only partly read.")
    add_source_args(p)
    p.add_argument("--out", help="write the runs (or CSV rows after selection) table here (.csv)")
    p.add_argument("--curves", help="write the long curves table here (.csv)")
    p.add_argument("--dirs", help="write the table of every directory (used / partial / skipped, why) here (.csv)")
    args = p.parse_args(argv)
    try:
        if args.csv:
            df = scaling_table_from_args(args)
            print(f"{len(df)} rows after selection; columns: {', '.join(map(str, df.columns))}")
            print(df[[c for c in CANONICAL if c in df]].describe().to_string())
            if args.out:
                df.to_csv(args.out, index=False)
            return
        if not args.paths:
            p.error("give run directories (or globs) or --csv FILE")
        col = collect(args.paths, verbose=True)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"analysis.collect: {e}") from None
    print(f"{len(col.runs)} usable runs ({len(col.partial)} partially read), {len(col.skipped)} skipped, "
          f"{len(col.curves)} curve points")
    if not col.runs.empty:
        show = [c for c in ("run_id", "status", "model", *SWITCHES, "seed", "tokens", "loss_val_final") if c in col.runs]
        print(col.runs[show].to_string(index=False))
    if args.out:
        col.runs.to_csv(args.out, index=False)
    if args.curves:
        col.curves.to_csv(args.curves, index=False)
    if args.dirs:
        col.dirs.to_csv(args.dirs, index=False)


if __name__ == "__main__":
    main()
