"""What the analysis commands check before they compute: each option against what the runs hold, the paths
they write, and, when the runs allow no table, what they lack.

Every check raises ValueError with one line: the option, the value, and what is valid, closest first
(difflib), with a "did you mean" where one is close. The commands (analysis.report, ablate, scaling, plan)
print it as `analysis.<tool>: <line>` and exit non-zero before anything is computed or written; an empty
result (no usable run, no table) is never a success either.
"""
from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

import pandas as pd

from analysis.switches import SWITCHES

# The columns --metric and --loss-col may name: summary.json's losses (lower is better, as the ablation's
# verdicts and every fit assume).
METRIC_PREFIX = "loss_"
LISTED = 12  # valid names shown in one line at most (the closest)


def closest_first(word: str, valid: Iterable[str]) -> list[str]:
    """`valid` ordered by similarity to `word` (difflib's ratio), the most similar first."""
    valid = list(dict.fromkeys(map(str, valid)))
    return sorted(valid, key=lambda v: -difflib.SequenceMatcher(None, word, v).ratio())


def not_valid(option: str, value: str, what: str, valid: Iterable[str]) -> str:
    """`--metric 'loss_vall' is not a metric of these runs; did you mean loss_val_final? valid, closest
    first: loss_val_final, loss_val_best, loss_train_final` (at most LISTED names)."""
    ranked = closest_first(value, valid)
    guess = difflib.get_close_matches(value, ranked, n=1, cutoff=0.6)
    hint = f" did you mean {guess[0]}?" if guess else ""
    shown = ", ".join(ranked[:LISTED]) + (f" (and {len(ranked) - LISTED} more)" if len(ranked) > LISTED else "")
    return f"{option} {value!r} is not {what};{hint} valid, closest first: {shown or 'none'}"


def one_line(err: BaseException) -> str:
    """An error's message on one line (a KeyError's without the quotes str() adds)."""
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(str(text).split())


# --------------------------------------------------------------------------------------------------
# Numbers and outputs
# --------------------------------------------------------------------------------------------------

def _writable_folder(folder: Path, option: str, path: str) -> None:
    """The folder `folder` can hold new files, or the nearest folder above it that exists can (the command
    creates the rest): a file is created there and removed at once."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{option} {path}: {probe} is a file, so no folder can be made below it")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot write in {probe} ({e.strerror or type(e).__name__})") from None


def parse_budgets(text: str, option: str = "--budgets") -> list[float]:
    """'1e18,1e20' -> [1e18, 1e20]: FLOP budgets, each a number > 0."""
    try:
        budgets = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        budgets = []
    if not budgets or not all(b > 0 for b in budgets):
        raise ValueError(f"{option} {text!r}: FLOP budgets > 0, comma-separated, e.g. 1e18,1e20")
    return budgets


def check_out_folder(path: str, option: str = "--out") -> None:
    """A report folder: a folder, or none yet, where files can be written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option} {path}: a file of that name is there; give a folder")
    _writable_folder(p, option, path)
    report = p / "report.md"
    if report.exists() and not os.access(report, os.W_OK):
        raise ValueError(f"{option} {path}: its report.md cannot be overwritten (permission)")


def check_out_file(path: Optional[str], option: str) -> None:
    """A file a command writes (--md, --csv, a figure's path stem): not a folder, in a folder it can write."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option} {path}: a folder of that name is there; give a file")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{option} {path}: cannot be overwritten (permission)")
    _writable_folder(p.parent, option, path)


# --------------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------------

def _reason_kind(reason: str) -> str:
    """'failed: RuntimeError: ...' -> 'failed'; 'still running (status=running)' -> 'still running'."""
    return reason.split(":")[0].split(" (")[0]


def require_runs(col, paths: Sequence[str]) -> None:
    """At least one usable run among the directories `col` (analysis.collect.Collection) read from `paths`;
    else one line: no run directory at all, or every one skipped, with how many for each reason."""
    where = " ".join(map(str, paths))
    if not col.runs.empty:
        return
    dirs = col.dirs[~col.dirs["reason"].str.startswith("no run directory here")]
    if dirs.empty:
        raise ValueError(f"no run directory in {where} (a run directory holds summary.json, config.yaml or "
                         "metrics.jsonl)")
    kinds = dirs["reason"].map(_reason_kind).value_counts()
    said = ", ".join(f"{k}: {v}" for k, v in kinds.items())
    raise ValueError(f"no usable run in {where}: {len(dirs)} run director{'y' if len(dirs) == 1 else 'ies'}, "
                     f"all skipped ({said}); python -m analysis.collect {where} lists them")


def metrics(runs: pd.DataFrame) -> list[str]:
    """The metrics the runs hold: summary.json's numeric loss_* fields with a value in some run."""
    return [c for c in runs.columns if str(c).startswith(METRIC_PREFIX)
            and pd.to_numeric(runs[c], errors="coerce").notna().any()]


def check_metric(runs: pd.DataFrame, name: str, option: str = "--metric") -> None:
    if name not in metrics(runs):
        raise ValueError(not_valid(option, name, "a metric of these runs (summary.json's losses)", metrics(runs)))


def check_numeric_column(runs: pd.DataFrame, name: str, option: str) -> None:
    """A summary column with a number in some run (e.g. --d-col tokens)."""
    numeric = [c for c in runs.columns if not str(c).startswith("config.")
               and pd.to_numeric(runs[c], errors="coerce").notna().any()]
    if name not in numeric:
        raise ValueError(not_valid(option, name, "a numeric column of these runs' summary.json", numeric))


def check_baseline(runs: pd.DataFrame, baseline: dict) -> None:
    """Each --baseline SWITCH=OPTION names a switch, and an option of it that some run has."""
    for switch, option in baseline.items():
        item = f"{switch}={option}"
        if switch not in SWITCHES:
            raise ValueError(not_valid("--baseline", switch, f"a switch (in {item!r})", SWITCHES))
        run = sorted(map(str, runs[switch].dropna().unique())) if switch in runs else []
        if option not in run:
            raise ValueError(not_valid("--baseline", item, "an option these runs have",
                                       [f"{switch}={o}" for o in run]))


def check_columns(runs: pd.DataFrame, names: Sequence[str], option: str, also: Sequence[str] = ()) -> None:
    """Each name a column of the runs table (or one of `also`, columns made on the way, e.g. `length`)."""
    valid = [*(c for c in runs.columns if not str(c).startswith("config.")), *also]
    for name in names:
        if name not in valid:
            raise ValueError(not_valid(option, name, "a column of these runs' summary.json", valid))


def config_keys(runs: pd.DataFrame) -> list[str]:
    """Every config.yaml key of the runs, dotted, with the groups above them (`optim`, `optim.lr`)."""
    keys = [str(c).removeprefix("config.") for c in runs.columns if str(c).startswith("config.")]
    groups = {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 1)}
    return sorted(set(keys) | groups)


def check_config_keys(runs: pd.DataFrame, names: Sequence[str], option: str, also: Sequence[str] = ()) -> None:
    """Each name a key or group of the runs' config.yaml (or one of `also`)."""
    valid = config_keys(runs)
    for name in names:
        if name not in valid and name not in also:
            raise ValueError(not_valid(option, name, "a key of these runs' config.yaml", valid))


def check_seeds(runs: pd.DataFrame, seeds: Optional[Sequence[int]], option: str) -> None:
    have = sorted(set(pd.to_numeric(runs["seed"], errors="coerce").dropna().astype(int))) if "seed" in runs else []
    missing = [s for s in seeds or () if s not in have]
    if missing:
        raise ValueError(f"{option}: no run has seed {', '.join(map(str, missing))}; the runs' seeds: "
                         f"{', '.join(map(str, have)) or 'none'}")


def check_query(df: pd.DataFrame, query: str, option: str) -> pd.DataFrame:
    """The rows of `df` a pandas query keeps; a query that cannot run, or keeps no row, in one line."""
    try:
        kept = df.query(query)
    except (NameError, SyntaxError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"{option} {query!r}: {type(e).__name__}: {' '.join(str(e).split())} (columns: "
                         f"{', '.join(map(str, df.columns[:LISTED]))}{', ...' if len(df.columns) > LISTED else ''})"
                         ) from None
    if kept.empty:
        raise ValueError(f"{option} {query!r} keeps none of the {len(df)} rows")
    return kept


def check_ablation_options(runs: pd.DataFrame, args) -> None:
    """The ablation options (analysis.ablate.add_ablation_args) against the runs: the metric, the baseline,
    the match columns, the ignored and tuned keys, the tuning seeds; the tuning options only with --tune."""
    from analysis.ablate import parse_baseline
    from analysis.cells import DEFAULT_MATCH
    from analysis.tuning import TUNED

    check_metric(runs, args.metric)
    check_baseline(runs, parse_baseline(args.baseline))
    check_columns(runs, _items(args.match), "--match", also=DEFAULT_MATCH)
    check_config_keys(runs, _items(args.ignore), "--ignore")
    check_config_keys(runs, _items(args.tuned), "--tuned", also=TUNED)
    seeds = [int(s) for s in _items(args.tune_seeds or "")]
    if not args.tune:
        defaults = (("--tune-seeds", args.tune_seeds, None), ("--tuned", args.tuned, ",".join(TUNED)),
                    ("--report-seeds", args.report_seeds, "0,1,2"))
        given = [option for option, value, default in defaults if value != default]
        if given:
            raise ValueError(f"{given[0]} sets how --tune chooses each option's rate: add --tune, or leave it out")
    check_seeds(runs, seeds, "--tune-seeds")


def _items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# --------------------------------------------------------------------------------------------------
# What the runs lack
# --------------------------------------------------------------------------------------------------

def what_is_missing(runs: pd.DataFrame, variants: pd.Series, notes: Sequence[str] = (),
                    n_col: str = "params_active_non_embedding") -> str:
    """Why runs give no ablation, no headline and no scaling fit, in words: what they hold (runs, seeds,
    sizes, options) and what each table needs that they lack (a second option of a switch beside the
    baseline's, seeds, sizes). notes: the ablation table's notes (cells with no baseline run, ...)."""
    n = len(runs)
    seeds = runs["seed"].nunique() if "seed" in runs else 0
    sizes = runs[n_col].nunique() if n_col in runs else 0
    base = runs[variants == "baseline"] if len(variants) else runs.iloc[:0]
    base_sizes = base[n_col].nunique() if n_col in base else 0
    varied = [s for s in SWITCHES if s in runs and runs[s].nunique() > 1]
    held = ", ".join(f"{s}={runs[s].dropna().iloc[0]}" for s in SWITCHES if s in runs and runs[s].nunique() == 1)
    what = (f"{n} run{'s' if n != 1 else ''} ({seeds} seed{'s' if seeds != 1 else ''}, {sizes} "
            f"size{'s' if sizes != 1 else ''}; variants: {', '.join(sorted(set(variants))) or 'none'})")
    if not varied:
        held = f" ({held})" if held else ""
        ablation = (f"every run has the same option of every switch{held}, and an ablation needs runs of a "
                    "second option of a switch beside the baseline's, equal in everything else")
    elif notes:
        ablation = "; ".join(notes)
    else:
        ablation = (f"the runs of {', '.join(varied)} differ from the baseline's in more than that switch (another "
                    "switch, the model, the data, the length or a config key), so no cell holds both")
    seeds_need = "" if seeds >= 2 else "; a delta's interval also needs >= 2 seeds of each side"
    fit = (f"no scaling fit: the baseline has {base_sizes} size{'s' if base_sizes != 1 else ''} here (approach 3 "
           "needs >= 6 runs over >= 3 sizes at several tokens per parameter, the compute multipliers the baseline "
           "at >= 2 sizes and another variant)")
    return f"{what}: no ablation and no headline, since {ablation}{seeds_need}; {fit}."
