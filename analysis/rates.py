"""The learning rate tuned at every size, read from run directories: per cell (a configuration at one size
and length), the loss of every rate setting tried on the tuning seeds, the setting chosen, whether it sits
at an edge of the grid, and the point beyond that edge; and how far the chosen rate drifts across widths.

Cells. Runs share a cell when their resolved config.yaml is equal except for the seed, the run bookkeeping
(analysis.ablate.BOOKKEEPING, and train.trunk: a branch names a trunk of its own seed) and the rate keys
(`rate_keys`, e.g. optim.lr_scale, or optim.lr_scale, optim.embed_lr_scale and optim.betas for a tuned
AdamW). WSD trunks are left out (their end is at the peak rate: analysis.trunks), so the branches of a
trunk family are cells of their own, one per length. A cell's choice is the setting with the lowest mean
final validation loss over its runs on the tuning seeds (seed >= analysis.ablate.TUNE_SEED_MIN unless named).

Edges. A rate key is at an edge when the chosen value is the lowest or highest tried among the settings that
agree with the chosen one on every other key (the grid's line through the choice); the point beyond it is
one geometric step further, the chosen value times chosen / its neighbour (0.5 of 0.5, 1, 2 gives 0.25),
the other keys kept. `choices` keeps, per configuration and size, the cell of its longest runs: the rate a
ladder's reported seeds train at.

    rate_table(runs, rate_keys)     every setting tried: cell, width, N, tokens, setting, n, loss, chosen, edge
    choices(table)                  per configuration and size: the chosen setting of its longest cell
    plot_transfer(table, key)       loss against the rate per size, and the chosen rate against width

    python -m analysis.rates runs/cpu_tune_ladder --out docs/reports/wsd_ladder/tuning
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd
from matplotlib.ticker import ScalarFormatter

from analysis import plots
from analysis.ablate import BOOKKEEPING, TUNE_SEED_MIN
from analysis.collect import DEFAULT_N, N_DEFINITIONS, collect
from analysis.tables import markdown_table
from analysis.trunks import is_trunk

RATE_KEYS = ("optim.lr_scale",)
LENGTH_KEYS = ("train.max_steps", "train.tokens_per_param", "train.flop_budget")
N_COL = N_DEFINITIONS[DEFAULT_N]
TABLE_COLUMNS = ["cell", "configuration", "n_layers", "width", "N", "tokens", "setting", "n", "loss", "chosen",
                 "edge", "beyond"]


def _norm(v):
    """A config value as a hashable key: NaN and None -> None, numpy scalars -> Python."""
    if isinstance(v, np.generic):
        v = v.item()
    return None if v is None or (isinstance(v, float) and np.isnan(v)) else v


def _skip(key: str, rate_keys: Sequence[str]) -> bool:
    prefixes = (*BOOKKEEPING, "train.trunk", *rate_keys)
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _label(keys: dict, cols: Sequence[str]) -> str:
    return ", ".join(f"{c.removeprefix('config.')}={keys[c]}" for c in cols) or "all runs"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def value_text(v) -> str:
    """A config value as a command-line override takes it: 0.25, [0.9,0.99] (a list, or a config list read
    back as JSON text)."""
    if isinstance(v, str) and v.startswith("["):
        v = json.loads(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(value_text(x) for x in v) + "]"
    return f"{v:g}" if isinstance(v, float) else str(v)


def grid_edges(settings: pd.DataFrame, best: int, rate_keys: Sequence[str]) -> tuple[str, list[dict]]:
    """(the keys at an edge, in words; the settings beyond those edges, one per key) for the chosen row `best`
    of `settings` (one row per setting tried, a column per rate key)."""
    chosen = settings.loc[best]
    words, beyond = [], []
    for key in rate_keys:
        others = [k for k in rate_keys if k != key]
        line = settings[(settings[others] == chosen[others]).all(axis=1)] if others else settings
        values = sorted({v for v in line[key] if _number(v)})
        if len(values) < 2 or not _number(chosen[key]):
            continue
        where = "lowest" if chosen[key] == values[0] else "highest" if chosen[key] == values[-1] else None
        if where:
            neighbour = values[1] if where == "lowest" else values[-2]
            words.append(f"{key} at the {where} of {len(values)}")
            beyond.append({**{k: chosen[k] for k in rate_keys}, key: chosen[key] * chosen[key] / neighbour})
    return "; ".join(words), beyond


def tune_cell(runs: pd.DataFrame, rate_keys: Sequence[str], metric: str = "loss_val_final") -> pd.DataFrame:
    """One cell's tuning runs -> one row per setting (a column per rate key, n, loss: the mean metric), the
    lowest-loss one `chosen`, with its `edge` and `beyond` (grid_edges)."""
    cols = [f"config.{k}" for k in rate_keys]
    runs = runs.dropna(subset=[metric])
    keys = runs[cols].apply(lambda r: tuple(_norm(v) for v in r), axis=1)
    rows = [dict(zip(rate_keys, k), n=len(g), loss=float(g[metric].mean())) for k, g in runs.groupby(keys, sort=True)]
    table = pd.DataFrame(rows, columns=[*rate_keys, "n", "loss"])
    table["chosen"], table["edge"], table["beyond"] = False, "", None
    if len(table):
        best = int(table["loss"].idxmin())
        table.loc[best, "chosen"] = True
        edge, beyond = grid_edges(table, best, rate_keys)
        table.at[best, "edge"], table.at[best, "beyond"] = edge, beyond
    return table


def _cells(runs: pd.DataFrame, rate_keys: Sequence[str]) -> tuple[list[tuple[dict, pd.DataFrame]], list[str]]:
    """Runs grouped into cells (module docstring) and the config columns in which cells differ."""
    cols = [c for c in runs.columns if c.startswith("config.") and not _skip(c.removeprefix("config."), rate_keys)]
    keys = runs[cols].apply(lambda r: tuple(_norm(v) for v in r), axis=1) if cols else pd.Series([()] * len(runs))
    groups = [(dict(zip(cols, k)), g) for k, g in runs.groupby(keys, sort=False)]
    differ = [c for c in cols if len({str(key[c]) for key, _ in groups}) > 1]
    return groups, differ


def rate_table(runs: pd.DataFrame, rate_keys: Sequence[str] = RATE_KEYS, tune_seeds: Optional[Sequence[int]] = None,
               metric: str = "loss_val_final") -> pd.DataFrame:
    """Every setting tried on the tuning seeds, per cell (module docstring): TABLE_COLUMNS plus one column per
    rate key. `configuration` names the cell without its size and length (the keys of model.* and the length
    keys left out), the unit `choices` picks one rate for."""
    missing = [k for k in rate_keys if f"config.{k}" not in runs]
    if missing:
        raise KeyError(f"no run has the rate key(s) {missing} in its config.yaml")
    seeds = runs["seed"] >= TUNE_SEED_MIN if tune_seeds is None else runs["seed"].isin(list(tune_seeds))
    tuning = runs[seeds & ~is_trunk(runs)]
    groups, differ = _cells(tuning, rate_keys)
    config_cols = [c for c in differ
                   if not c.startswith("config.model.") and c.removeprefix("config.") not in LENGTH_KEYS]
    parts = []
    for key, g in groups:
        t = tune_cell(g, rate_keys, metric)
        t.insert(0, "setting", [", ".join(f"{k}={value_text(r[k])}" for k in rate_keys) for _, r in t.iterrows()])
        t.insert(0, "tokens", g["tokens"].median())
        t.insert(0, "N", g[N_COL].median())
        t.insert(0, "width", g["d_model"].median())
        t.insert(0, "n_layers", g["n_layers"].median())
        t.insert(0, "configuration", _label(key, config_cols) if config_cols else "all runs")
        t.insert(0, "cell", _label(key, differ))
        parts.append(t)
    if not parts:
        return pd.DataFrame(columns=[*TABLE_COLUMNS, *rate_keys])
    return pd.concat(parts, ignore_index=True).sort_values(["configuration", "N", "tokens", *rate_keys],
                                                           ignore_index=True)


def choices(table: pd.DataFrame) -> pd.DataFrame:
    """The chosen row of the longest cell of each (configuration, size): the setting its reported seeds train at."""
    chosen = table[table["chosen"]]
    longest = chosen.groupby(["configuration", "N"])["tokens"].transform("max") == chosen["tokens"]
    return chosen[longest].reset_index(drop=True)


def plot_transfer(table: pd.DataFrame, key: str = "optim.lr_scale"):
    """Left: the final validation loss against the rate `key` for each size (the longest cells of each
    configuration; other rate keys at their chosen values). Right: the chosen rate against width, one line
    per configuration: flat when the optimum transfers across widths."""
    best = choices(table)
    if best.empty:
        return None
    configurations = sorted(best["configuration"].unique())
    fig, (left, right) = plots.plt.subplots(1, 2, figsize=(10, 3.8))
    sizes = sorted(best["N"].unique())
    colors = {n: plots.PALETTE[i % len(plots.PALETTE)] for i, n in enumerate(sizes)}
    styles = ["-", "--", ":", "-."]
    others = [c for c in table.columns if c.startswith(("optim.", "model.", "train.")) and c != key]
    for j, conf in enumerate(configurations):
        for _, b in best[best["configuration"] == conf].iterrows():
            cell = table[(table["cell"] == b["cell"])]
            line = cell[(cell[others] == b[others]).all(axis=1)] if others else cell
            line = line.sort_values(key)
            left.plot(line[key], line["loss"], color=colors[b["N"]], ls=styles[j % len(styles)], marker="o", ms=3,
                      label=f"{conf}: width {b['width']:.0f}" if len(configurations) > 1 else f"width {b['width']:.0f}")
            left.plot([b[key]], [b["loss"]], color=colors[b["N"]], marker="*", ms=11, ls="none")
        pts = best[best["configuration"] == conf].sort_values("width")
        right.plot(pts["width"], pts[key], marker="o", ls=styles[j % len(styles)], color="k", label=conf)
        for _, p in pts[pts["edge"] != ""].iterrows():
            right.annotate("edge", (p["width"], p[key]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    left.set_xscale("log", base=2)
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.set_xticks(sorted(best["width"].unique()))  # every ladder width, powers of 2 or not (e.g. 48)
    for axis in (left.xaxis, right.xaxis, right.yaxis):  # plain numbers (0.5, 1, 2; 32, 64), not powers of 2
        axis.set_major_formatter(ScalarFormatter())
    left.set_xlabel(key)
    left.set_ylabel("final validation loss (tuning seed)")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.set_xlabel("width (d_model)")
    right.set_ylabel(f"chosen {key}")
    right.grid(alpha=0.3)
    if len(configurations) > 1:
        right.legend(fontsize=7)
    fig.suptitle("The learning rate at every size: the loss against the rate, and the chosen rate against width",
                 fontsize=10)
    fig.tight_layout()
    return fig


def write_report(paths: list[str], out: Path, rate_keys: Sequence[str] = RATE_KEYS,
                 tune_seeds: Optional[Sequence[int]] = None) -> Path:
    """report.md, rates.csv (every setting), choices.csv and transfer.png for the runs under `paths`."""
    col = collect(paths, verbose=True)
    table = rate_table(col.runs, rate_keys, tune_seeds)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "rates.csv", index=False)
    best = choices(table)
    best.to_csv(out / "choices.csv", index=False)
    show = ["configuration", "n_layers", "width", "N", "tokens", "setting", "loss", "edge"]
    lines = ["# The learning rate at every size", "",
             f"{len(col.runs)} runs from {', '.join(paths)}; tuning seeds: "
             f"{'>= %d' % TUNE_SEED_MIN if tune_seeds is None else ','.join(map(str, tune_seeds))}; "
             f"rate keys: {', '.join(rate_keys)}.", "",
             "## The chosen rate per configuration and size", "",
             "The longest cell of each configuration and size; `edge` names a key whose chosen value is the "
             "lowest or highest tried on its line of the grid (the optimum may lie beyond it).", "",
             markdown_table(best[show]), "", "## Every setting tried", "",
             markdown_table(table[["cell", "setting", "n", "loss", "chosen", "edge"]]), ""]
    fig = plot_transfer(table, rate_keys[0])
    if fig is not None:
        plots.save(fig, out / "transfer", formats=("png",))
        lines += ["![the loss against the rate per size, and the chosen rate against width](transfer.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m analysis.rates", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="run directories or sweep folders")
    p.add_argument("--rate", default=",".join(RATE_KEYS), help="the rate keys tuned, comma-separated")
    p.add_argument("--tune-seeds", default=None, help=f"the tuning seeds (default: seed >= {TUNE_SEED_MIN})")
    p.add_argument("--out", required=True, help="folder for report.md, rates.csv, choices.csv and transfer.png")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.tune_seeds.split(",")] if args.tune_seeds else None
    try:
        print(write_report(args.paths, Path(args.out), [k for k in args.rate.split(",") if k], seeds))
    except (FileNotFoundError, KeyError) as e:
        raise SystemExit(f"analysis.rates: {e}") from None


if __name__ == "__main__":
    main()
