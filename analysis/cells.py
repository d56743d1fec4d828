"""Cells: which runs an ablation compares, and under which names.

A run belongs to the ablation of switch S when every other switch is at its reference option
(effective_baseline: DEFAULT_BASELINE, the K3 default, unless overridden). Two such runs share a cell when
their whole resolved config (config.yaml: the config.* columns) is equal except for
  - the seed and the run bookkeeping keys, BOOKKEEPING: where and under which name the run is written and
    how it was started (run_name, group, out_dir, resume, overwrite), the logger, the kernel backend and the
    device layout (trainer.accelerator, devices, strategy, num_nodes; the global batch is still matched,
    through summary.json's tokens_per_step);
  - the keys under comparison: S's own group (config.S.*, the option and its settings, e.g. balance.gamma)
    and, in a tuned comparison, the tuned hyperparameters (analysis.tuning.TUNED);
and their summary columns in `match` (DEFAULT_MATCH: model, size, data, run length, global batch) are
equal. The run length is the rule that set it when a rule did (train.tokens_per_param or
train.flop_budget: two options of different sizes at 5 tokens per parameter train different token counts
by design and still share a cell), else the token count (length_label). The helpers here group rows by
normalised config values and name groups by the keys in which they differ.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd

from analysis.switches import K3_DEFAULT, SWITCH_OPTIONS, SWITCHES


# The baseline of an ablation: the K3 default of each switch (the first option of each group).
DEFAULT_BASELINE = K3_DEFAULT
# summary.json columns that must be equal for two runs to be compared: the model config and its size (a
# ladder shares one config name across depths), the data, the training length (length_label) and the global
# batch.
DEFAULT_MATCH = ("model", "n_layers", "d_model", "data", "length", "tokens_per_step")
# config.yaml keys (and key prefixes) that never make two runs different cells: the seed and the run's
# bookkeeping (train.trunk: a cooldown branch names the trunk of its own seed). Everything else in
# config.yaml does, except the keys under comparison.
BOOKKEEPING = ("seed", "run_name", "group", "out_dir", "resume", "overwrite", "kernels", "logger",
               "trainer.accelerator", "trainer.devices", "trainer.strategy", "trainer.num_nodes", "train.trunk")
# config keys shown by a summary column of DEFAULT_MATCH already (left out of the cell names)
SHOWN = {"config.model.name": "model", "config.model.n_layers": "n_layers", "config.model.d_model": "d_model",
         "config.data.name": "data"}


def length_label(runs: pd.DataFrame) -> pd.Series:
    """What fixed each run's length, as a label: '5 tokens per parameter' or '1e+18 FLOPs' where the rule
    in summary.json's length_from set it, else the token count ('32964608 tokens')."""
    def label(r):
        rule = r.get("length_from")
        if rule == "tokens_per_param":
            return f"{r['tokens_per_param']:g} tokens per parameter"
        if rule == "flop_budget":
            return f"{r['flop_budget']:.4g} FLOPs"
        return f"{r['tokens']:.0f} tokens" if pd.notna(r.get("tokens")) else "unknown length"

    return runs.apply(label, axis=1) if len(runs) else pd.Series(dtype=str)


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


def _norm(v):
    """A config value as a hashable, comparable key: NaN and None -> None, numpy scalars -> Python."""
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return None
    return v


def under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def show_value(v) -> str:
    if v is None:
        return "unset"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def group_rows(df: pd.DataFrame, cols: Sequence[str]) -> list[tuple[tuple, pd.DataFrame]]:
    """Rows of df grouped by the normalised values of `cols` (NaN equal to NaN), in order of appearance."""
    if not cols:
        return [((), df)]
    keys = [tuple(_norm(v) for v in row) for row in df[list(cols)].itertuples(index=False, name=None)]
    order: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        order.setdefault(k, []).append(i)
    return [(k, df.iloc[idx]) for k, idx in order.items()]


def differing(keys: Sequence[tuple], cols: Sequence[str]) -> list[int]:
    """Indices of the columns whose values differ between the keys."""
    return [j for j in range(len(cols)) if len({k[j] for k in keys}) > 1]


def setting_label(key: tuple, cols: Sequence[str], idx: Sequence[int], strip: str = "config.") -> str:
    return ", ".join(f"{cols[j].removeprefix(strip)}={show_value(key[j])}" for j in idx)


def rate_label(g: pd.DataFrame, tuned_cols: Sequence[str], strip: str) -> str:
    """'lr=0.006, adam_lr=0.01': the tuned keys the runs of a row share (unset keys left out)."""
    parts = []
    for c in tuned_cols:
        vals = {_norm(v) for v in g[c]}
        if vals != {None}:
            parts.append(f"{c.removeprefix(strip)}=" + "/".join(sorted(map(show_value, vals))))
    return ", ".join(parts)


def shared_device(g: pd.DataFrame) -> str:
    """Why runs of g did not have their device to themselves, '' when they did: summary.json's device_shared
    (other runs on the same GPU, or a busy CPU) with its device_shared_why where the run wrote one."""
    if "device_shared" not in g:
        return ""
    shared = g[g["device_shared"].fillna(False).astype(bool)]
    if shared.empty:
        return ""
    why = sorted(set(shared["device_shared_why"].dropna().astype(str))) if "device_shared_why" in shared else []
    return f"{len(shared)} of {len(g)} runs: " + ("; ".join(why) if why else "device_shared")


def column_mean(g: pd.DataFrame, col: str) -> float:
    return float(pd.to_numeric(g[col], errors="coerce").mean()) if col in g else np.nan


def ordered_options(switch: str, options: Sequence, ref) -> list:
    known = SWITCH_OPTIONS.get(switch, ())
    rest = sorted((o for o in options if o not in known and o != ref), key=str)
    head = [ref] if ref in options else []
    return head + [o for o in known if o in options and o != ref] + rest
