"""Tuned comparisons: each option at its own best setting of the rates and of its switch's own keys.

The rule: the tuning seeds are the seeds >= TUNE_SEED_MIN (or those named); per option and cell, the chosen
setting is the one with the lowest mean metric over its tuning-seed runs; the row reports that setting's
runs on the other seeds only, so the seeds that chose a rate never measure it. A choice at the lowest or
highest value tried of a key is a grid edge (widen the grid). tuning_table lists every setting tried with
its tuning-seed mean and, for the chosen ones, the command that runs the reported seeds at it;
next_commands is what a tuned study runs next.
"""
from __future__ import annotations

import json
import shlex
from typing import Optional, Sequence

import pandas as pd

from analysis.cells import differing, rate_label, setting_label
from analysis.stats import one_per_seed

# The hyperparameters a tuned comparison chooses per option (where the option's config has them).
TUNED = ("optim.lr", "optim.adam_lr", "optim.lr_scale")
# Seeds at or above this are tuning seeds unless named explicitly; the others are reported.
TUNE_SEED_MIN = 1000


def _edges(chosen: tuple, keys: Sequence[tuple], cols: Sequence[str], strip: str) -> tuple[str, dict]:
    """Which numeric keys of the chosen setting sit at the lowest or highest value of the grid tried, in
    words, and the next value beyond each edge ({config key: value}), one geometric step of the grid's
    (the edge value times edge / its neighbour: 0.5 of 0.5, 1, 2 gives 0.25)."""
    out, beyond = [], {}
    for j in differing(keys, cols):
        vals = sorted({k[j] for k in keys if isinstance(k[j], (int, float)) and not isinstance(k[j], bool)})
        if len(vals) < 2 or not isinstance(chosen[j], (int, float)):
            continue
        where = "lowest" if chosen[j] == vals[0] else "highest" if chosen[j] == vals[-1] else None
        if where:
            out.append(f"{cols[j].removeprefix(strip)} at the {where} of {len(vals)} values")
            neighbour = vals[1] if where == "lowest" else vals[-2]
            if neighbour:
                beyond[cols[j].removeprefix("config.")] = chosen[j] * chosen[j] / neighbour
    return "; ".join(out), beyond


def _command(g: pd.DataFrame, seeds: str, values: Optional[dict] = None) -> str:
    """The command that runs `seeds` at this row's setting, with `values` ({config key: value}) replaced
    or added: a tuning run's overrides with the seed replaced (a sweep's own parameters are overridden by
    the same keys on the command line)."""
    if "overrides" not in g or g["overrides"].isna().all():
        return ""
    values = {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in (values or {}).items()}
    items = {}  # key -> override, in the run's order
    for o in json.loads(g["overrides"].dropna().iloc[0]):
        items[o.split("=", 1)[0]] = o
    items.pop("seed", None)
    items.update({k: f"{k}={v}" for k, v in values.items()})
    items = list(items.values())
    return "python run.py -m " + " ".join(shlex.quote(o) for o in [*items, f"seed={seeds}"])


TUNING_COLUMNS = ["switch", "cell", "option", "setting", "rate", "n_tune", "mean_tune", "chosen", "grid_edge",
                  "command", "widen"]


def tuning_table(table: pd.DataFrame) -> pd.DataFrame:
    """Every setting a tuned comparison tried: its tuning-seed count and mean, which one was chosen, whether
    it sits at a grid edge, the command that runs the reported seeds at the chosen setting and, at an
    edge, the command that widens the grid by one point beyond it on the tuning seeds (`widen`)."""
    return pd.DataFrame(table.attrs.get("tuning", []), columns=TUNING_COLUMNS)


def next_commands(table: pd.DataFrame) -> list[str]:
    """What a tuned study runs next, one command per configuration (the baseline once): the grid widened
    where the chosen setting sits at its edge, else the reported seeds at the chosen setting. Run the
    printed commands until every choice is inside its grid; sweeps skip the runs already done."""
    tuning = tuning_table(table)
    chosen = tuning[tuning["chosen"].astype(bool)]
    return list(dict.fromkeys(w if w else c for w, c in zip(chosen["widen"], chosen["command"]) if w or c))


def pick_tuned(s, opt, cell_name, settings, setting_cols, vary, tuned_cols, metric, is_tune, strip, report_seeds,
                tuning: list) -> list[tuple[str, pd.DataFrame, str, str]]:
    """The option's best setting on the tuning seeds, as [(setting, reported runs, grid edge, warning)];
    every setting tried goes into `tuning`."""
    cands = []
    for k, g in settings:
        t = g[is_tune(g["seed"])] if "seed" in g else g.iloc[:0]
        if len(t):
            cands.append((k, g, float(one_per_seed(t, metric)[0][metric].mean()), t["seed"].nunique()))
    if not cands:
        if len(settings) == 1:
            k, g = settings[0]
            return [(setting_label(k, setting_cols, vary, strip), g, "", "one setting, no tuning runs (not tuned)")]
        return [(setting_label(k, setting_cols, vary, strip), g, "", f"{len(settings)} settings and no tuning runs: "
                 "not compared at a chosen setting") for k, g in settings]
    best = min(range(len(cands)), key=lambda i: cands[i][2])
    keys = [c[0] for c in cands]
    edge, beyond = _edges(cands[best][0], keys, setting_cols, strip)
    for i, (k, g, m, nt) in enumerate(cands):
        tune_seeds = ",".join(map(str, sorted(g.loc[is_tune(g["seed"]), "seed"].unique())))
        tuning.append({"switch": s, "cell": cell_name, "option": opt,
                       "setting": setting_label(k, setting_cols, vary, strip),
                       "rate": rate_label(g, tuned_cols, strip), "n_tune": nt, "mean_tune": m, "chosen": i == best,
                       "grid_edge": edge if i == best else "", "command": _command(g, report_seeds) if i == best else "",
                       "widen": _command(g, tune_seeds, beyond) if i == best and beyond else ""})
    k, g, _, _ = cands[best]
    reported = g[~is_tune(g["seed"])]
    extra = "" if len(cands) > 1 else "one setting tried (not tuned)"
    if reported.empty:
        extra = f"no reported seeds at the chosen setting yet: {_command(g, report_seeds)}"
    return [(setting_label(k, setting_cols, vary, strip), reported, edge, extra)]
