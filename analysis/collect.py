"""Run directories (docs/run_directory.md) or an external CSV -> pandas DataFrames.

    runs    one row per usable run: every summary.json field, `switches` flattened into one column per
            switch (decay, glu, ...), other nested dicts as "versions.torch"-style columns, the resolved
            config as "config.<group>.<key>" columns, plus run_id and path.
    curves  long table of metrics.jsonl: run_id, step, tokens, flops, metric, value.
    skipped run directories left out, with the reason (failed, running, truncated metrics.jsonl, ...).

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

CANONICAL = ("N", "D", "C", "loss")


@dataclass
class Collection:
    runs: pd.DataFrame
    curves: pd.DataFrame
    skipped: pd.DataFrame  # columns: path, run_name, reason


def find_run_dirs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Run directories under `paths`: each a run dir, a folder searched recursively for summary.json,
    a summary.json file, or a glob of any of these. Order kept, duplicates dropped."""
    found: list[Path] = []
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
            elif (m / "summary.json").exists():
                found.append(m)
            else:
                found.extend(sorted(s.parent for s in m.rglob("summary.json")))
    seen, out = set(), []
    for d in found:
        key = d.resolve()
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


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


def _check_run(d: Path) -> tuple[Optional[dict], Optional[list[dict]], Optional[str]]:
    """(summary, metrics records, None) for a usable run, else (summary or None, None, reason)."""
    sp = d / "summary.json"
    try:
        summary = json.loads(sp.read_text())
        if not isinstance(summary, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return None, None, f"summary.json unreadable ({type(e).__name__}: {e})"
    status = summary.get("status")
    if status == "running":
        return summary, None, "still running (status=running)"
    if status == "failed":
        return summary, None, f"failed: {summary.get('error') or 'no error message'}"
    if status != "completed":
        return summary, None, f"unknown status {status!r}"
    mp = d / "metrics.jsonl"
    if not mp.exists():
        return summary, None, "metrics.jsonl missing"
    records, bad = read_metrics(mp)
    if bad:
        return summary, None, f"metrics.jsonl truncated or corrupt (line {bad[0]} unparseable, {len(bad)} bad lines)"
    if not records:
        return summary, None, "metrics.jsonl empty"
    return summary, records, None


def _run_ids(dirs: list[Path]) -> list[str]:
    """Run ids: paths relative to the runs' common parent (unique), or the folder name for one run."""
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
    """Read every run directory under `paths` (see find_run_dirs). Never raises on a bad run: it goes
    into `skipped` with its reason. verbose: print the skipped-runs table."""
    dirs = find_run_dirs(paths)
    ids = _run_ids(dirs)
    rows, curve_parts, skipped = [], [], []
    for d, rid in zip(dirs, ids):
        summary, records, reason = _check_run(d)
        if reason is not None:
            skipped.append({"run_id": rid, "run_name": (summary or {}).get("run_name", d.name), "reason": reason,
                            "path": str(d)})
            continue
        row = {"run_id": rid, "path": str(d), **summary_row(summary)}
        if include_config and (d / "config.yaml").exists():
            row.update(_read_config(d / "config.yaml"))
        rows.append(row)
        if curves:
            curve_parts.append(curves_frame(rid, records))
    runs = pd.DataFrame(rows)
    curv = (pd.concat(curve_parts, ignore_index=True) if curve_parts
            else pd.DataFrame(columns=["run_id", "step", "tokens", "flops", "metric", "value"]))
    skip = pd.DataFrame(skipped, columns=["run_id", "run_name", "reason", "path"])
    if verbose:
        print_skipped(skip)
    return Collection(runs=runs, curves=curv, skipped=skip)


collect_runs = collect  # package-level name (`analysis.collect` is the module)


def print_skipped(skipped: pd.DataFrame) -> None:
    """Rich table of skipped runs (nothing when none)."""
    if skipped.empty:
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Skipped runs ({len(skipped)})")
    for c in ("run_id", "reason"):
        t.add_column(c)
    for _, r in skipped.iterrows():
        t.add_row(str(r["run_id"]), str(r["reason"]))
    Console(stderr=True).print(t)


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
    group (e.g. the best LR per (model, D)); apply each pandas `where` query (e.g. 'D >= 1e9')."""
    if drop_highest:
        df = df.sort_values("loss").iloc[:-drop_highest]
    if best_of:
        bad = [c for c in best_of if c not in df.columns]
        if bad:
            raise KeyError(f"--best-of columns {bad} not found; available: {list(df.columns)}")
        df = df.loc[df.groupby(list(best_of), dropna=False)["loss"].idxmin()]
    for q in where:
        df = df.query(q)
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
    p.add_argument("--n-col", default="params_active", help="run column used as N (run directories)")
    p.add_argument("--d-col", default="tokens", help="run column used as D (run directories)")
    p.add_argument("--c-col", default="flops", help="run column used as C (run directories)")
    p.add_argument("--loss-col", default="loss_val_final", help="run column used as the loss (run directories)")


def runs_to_scaling(runs: pd.DataFrame, n_col: str = "params_active", d_col: str = "tokens",
                    c_col: str = "flops", loss_col: str = "loss_val_final") -> pd.DataFrame:
    """runs DataFrame -> the canonical table (N, D, C, loss and every other column kept)."""
    missing = [c for c in (n_col, d_col, loss_col) if c not in runs.columns]
    if missing:
        raise KeyError(f"runs have no column(s) {missing}; choose with --n-col/--d-col/--loss-col")
    df = runs.copy()
    df["N"], df["D"], df["loss"] = runs[n_col].astype(float), runs[d_col].astype(float), runs[loss_col].astype(float)
    df["C"] = runs[c_col].astype(float) if c_col in runs.columns else 6.0 * df["N"] * df["D"]
    return df.dropna(subset=["N", "D", "C", "loss"]).reset_index(drop=True)


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def scaling_table_from_args(args, collection: Optional[Collection] = None) -> pd.DataFrame:
    if args.csv:
        df = load_csv(args.csv, args.map)
    else:
        if not args.paths:
            raise SystemExit("give run directories (or globs) or --csv FILE")
        collection = collection or collect(args.paths, verbose=True)
        if collection.runs.empty:
            raise SystemExit("no usable runs")
        df = runs_to_scaling(collection.runs, args.n_col, args.d_col, args.c_col, args.loss_col)
    return select_rows(df, args.drop_highest, _split(args.best_of), args.where)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m analysis.collect",
                                description="Collect run directories (or a CSV) into tables; list skipped runs.")
    add_source_args(p)
    p.add_argument("--out", help="write the runs (or CSV rows after selection) table here (.csv)")
    p.add_argument("--curves", help="write the long curves table here (.csv)")
    args = p.parse_args(argv)
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
    print(f"{len(col.runs)} usable runs, {len(col.skipped)} skipped, {len(col.curves)} curve points")
    if not col.runs.empty:
        show = [c for c in ("run_id", "status", "model", *SWITCHES, "seed", "tokens", "loss_val_final") if c in col.runs]
        print(col.runs[show].to_string(index=False))
    if args.out:
        col.runs.to_csv(args.out, index=False)
    if args.curves:
        col.curves.to_csv(args.curves, index=False)


if __name__ == "__main__":
    main()
