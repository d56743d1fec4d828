"""Ablation tables: for each switch, each option against the K3 default, in cells of runs that differ in
nothing but the switch.

Cells. A run belongs to the ablation of switch S when every other switch is at its reference option. Two
such runs share a cell when their whole resolved config (config.yaml: the config.* columns) is equal
except for
  - the seed and the run bookkeeping keys, BOOKKEEPING: where and under which name the run is written and
    how it was started (run_name, group, out_dir, resume, overwrite), the logger, the kernel backend and the
    device layout (trainer.accelerator, devices, strategy, num_nodes; the global batch is still matched,
    through summary.json's tokens_per_step);
  - the keys under comparison: S's own group (config.S.*, the option and its settings, e.g. balance.gamma)
    and, in a tuned comparison, the tuned hyperparameters (TUNED: optim.lr, optim.adam_lr, optim.lr_scale);
and their summary columns in `match` (model, size, data, run length, global batch) are equal. The run
length is the rule that set it when a rule did (train.tokens_per_param or train.flop_budget: two options
of different sizes at 5 tokens per parameter train different token counts by design and still share a
cell), else the token count. A run differing in anything else is in another cell; the table names each
cell by the keys in which the cells of a switch differ (`cell`), so nothing is pooled silently.

Rows. In a cell, the runs of one option with one setting of the compared keys make one row: an LR grid is
never averaged (untuned, each rate is a cell of its own; for S = optim, whose group holds the rates, each
rate a row). Untuned (the default): every row against the baseline option's row; when the baseline option
has several settings in a cell the deltas are left out and the verdict says so. Tuned (`tune=True`): each
option at its own best setting, the one with the lowest mean metric on the tuning seeds (seed >=
TUNE_SEED_MIN unless `tune_seeds` names them), reported on the other seeds; `rate` says which rate the row
used and `grid_edge` whether the choice lies at an edge of the grid. tuning_table(table) lists every
setting tried with its tuning-seed mean and, for the chosen ones, the command that runs the reported seeds
at it.

Statistics per row: n seeds, mean, standard deviation, Student-t 95% CI of the mean. Runs repeating a seed
in one row are one sample (averaged) and flagged in `warnings`. Against the baseline: delta = mean(option)
- mean(baseline), its 95% CI and p-value from a paired t-test (scipy.stats.ttest_rel) when both sides have
the same >= 2 seeds, else Welch's t-test (ttest_ind, equal_var=False). `p_holm`: the p-values adjusted over
all comparisons of the table by Holm's step-down method (statsmodels multipletests), on which the verdict
is decided at ALPHA. `mde`: the minimum detectable effect, the smallest |delta| the test used detects with
power POWER at ALPHA given the row's n and spread (mde_paired: statsmodels TTestPower; mde_welch: by
simulation, since Welch's degrees of freedom are estimated). Each row also has its N (the
active non-embedding parameters by default) and FLOPs per token relative to the baseline row, and its
throughput (summary tokens_per_s_median) relative to the baseline's.

    python -m analysis.ablate runs/abl --metric loss_val_final --md abl.md --csv abl.csv --plot abl
    python -m analysis.ablate runs/tune_moe --tune                      # each option at its own best rate
    python -m analysis.ablate runs/tune_moe --tune --next               # only the commands to run next
"""
from __future__ import annotations

import argparse
import json
import shlex
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from analysis.collect import DEFAULT_N, N_DEFINITIONS, collect
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
# The hyperparameters a tuned comparison chooses per option (where the option's config has them).
TUNED = ("optim.lr", "optim.adam_lr", "optim.lr_scale")
# Seeds at or above this are tuning seeds unless named explicitly; the others are reported.
TUNE_SEED_MIN = 1000
ALPHA, POWER = 0.05, 0.8
# config keys shown by a summary column of DEFAULT_MATCH already (left out of the cell names)
_SHOWN = {"config.model.name": "model", "config.model.n_layers": "n_layers", "config.model.d_model": "d_model",
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


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------

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


def mde_paired(sd_diff: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """Minimum detectable effect of a two-sided paired t-test on n pairs: MDE = d* x sd_diff, where d* is
    the effect size (mean difference / sd of the differences) that a one-sample t-test (df n - 1,
    noncentrality d sqrt(n)) detects with `power` at `alpha` (statsmodels TTestPower.solve_power)."""
    if n < 2 or not np.isfinite(sd_diff) or sd_diff <= 0:
        return np.nan
    from statsmodels.stats.power import TTestPower

    d = TTestPower().solve_power(effect_size=None, nobs=n, alpha=alpha, power=power, alternative="two-sided")
    return float(np.squeeze(d)) * float(sd_diff)


WELCH_SIMULATIONS = 100_000


def mde_welch(sd_a: float, n_a: int, sd_b: float, n_b: int, alpha: float = ALPHA, power: float = POWER,
              n_sim: int = WELCH_SIMULATIONS, seed: int = 0) -> float:
    """Minimum detectable effect of the two-sided Welch t-test, by simulation: Welch's degrees of freedom are
    estimated from the sample variances, so the noncentral-t formula of the pooled test overstates its power
    at a few seeds (0.69 instead of 0.8 at n = 3 + 3). For n_sim draws i of two normal samples with these
    sds and no true difference: m_i = the difference of the means, se_i = sqrt(s_a^2/n_a + s_b^2/n_b),
    nu_i = se_i^4 / ((s_a^2/n_a)^2/(n_a-1) + (s_b^2/n_b)^2/(n_b-1)), c_i = t_{1-alpha/2, nu_i} se_i. A true
    difference delta is detected in draw i when delta + m_i > c_i or delta + m_i < -c_i; the MDE is the
    smallest delta > 0 detected in a fraction `power` of the draws (fixed seed: the same value every call;
    Monte Carlo error of the power about 0.0013 at 100,000 draws)."""
    if min(n_a, n_b) < 2 or not (np.isfinite(sd_a) and np.isfinite(sd_b)) or sd_a + sd_b <= 0:
        return np.nan
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n_sim, n_a)) * sd_a
    b = rng.standard_normal((n_sim, n_b)) * sd_b
    va, vb = a.var(1, ddof=1) / n_a, b.var(1, ddof=1) / n_b
    se = np.sqrt(va + vb)
    nu = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
    c = stats.t.ppf(1 - alpha / 2, nu) * se
    m = a.mean(1) - b.mean(1)
    above, below = np.sort(c - m), np.sort(-c - m)  # detected when delta > above_i or delta < below_i

    def detected(delta: float) -> float:
        return (np.searchsorted(above, delta) + n_sim - np.searchsorted(below, delta, side="right")) / n_sim

    lo, hi = 0.0, float(np.sqrt(sd_a ** 2 / n_a + sd_b ** 2 / n_b))
    while detected(hi) < power:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if detected(mid) < power else (lo, mid)
    return hi


def compare(opt: pd.DataFrame, base: pd.DataFrame, metric: str, level: float = 0.95) -> dict:
    """delta = mean(opt) - mean(base), its CI, p-value and MDE; paired on seeds when both have the same seeds.
    opt, base: one row per seed (see one_per_seed)."""
    a, b = opt[metric].to_numpy(float), base[metric].to_numpy(float)
    out = {"delta": float(a.mean() - b.mean()), "delta_lo": np.nan, "delta_hi": np.nan, "p_value": np.nan,
           "test": "", "mde": np.nan}
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
        test, mde = "paired t", mde_paired(float(d.std(ddof=1)), len(d))
    elif len(a) >= 2 and len(b) >= 2:
        res = stats.ttest_ind(a, b, equal_var=False)
        test, mde = "Welch t", mde_welch(float(a.std(ddof=1)), len(a), float(b.std(ddof=1)), len(b))
    else:
        out["test"] = "n<2"
        return out
    ci = res.confidence_interval(level)
    out.update(delta_lo=float(ci.low), delta_hi=float(ci.high), p_value=float(res.pvalue), test=test, mde=mde)
    return out


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (statsmodels multipletests, method 'holm'): sorted ascending,
    p_(i) -> max_{j <= i} min(1, (m - j + 1) p_(j)); NaN entries are left out of the family and stay NaN."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(p_values, float)
    out = np.full(len(p), np.nan)
    ok = np.isfinite(p)
    if ok.any():
        out[ok] = multipletests(p[ok], alpha=ALPHA, method="holm")[1]
    return out


def one_per_seed(runs: pd.DataFrame, metric: str) -> tuple[pd.DataFrame, dict]:
    """(one row per seed, {seed: number of runs} for the seeds run more than once). Runs of one row that
    repeat a seed are one sample (they differ only by nondeterminism): averaged, and reported by the
    caller, so n counts independent seeds."""
    if "seed" not in runs:
        return runs, {}
    counts = runs["seed"].value_counts()
    repeats = {k: int(v) for k, v in counts[counts > 1].sort_index().items()}
    if not repeats:
        return runs, {}
    return runs.groupby("seed", as_index=False)[metric].mean(), repeats


# --------------------------------------------------------------------------------------------------
# Cells and settings
# --------------------------------------------------------------------------------------------------

def _norm(v):
    """A config value as a hashable, comparable key: NaN and None -> None, numpy scalars -> Python."""
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return None
    return v


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _show(v) -> str:
    if v is None:
        return "unset"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _groups(df: pd.DataFrame, cols: Sequence[str]) -> list[tuple[tuple, pd.DataFrame]]:
    """Rows of df grouped by the normalised values of `cols` (NaN equal to NaN), in order of appearance."""
    if not cols:
        return [((), df)]
    keys = [tuple(_norm(v) for v in row) for row in df[list(cols)].itertuples(index=False, name=None)]
    order: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        order.setdefault(k, []).append(i)
    return [(k, df.iloc[idx]) for k, idx in order.items()]


def _differing(keys: Sequence[tuple], cols: Sequence[str]) -> list[int]:
    """Indices of the columns whose values differ between the keys."""
    return [j for j in range(len(cols)) if len({k[j] for k in keys}) > 1]


def _label(key: tuple, cols: Sequence[str], idx: Sequence[int], strip: str = "config.") -> str:
    return ", ".join(f"{cols[j].removeprefix(strip)}={_show(key[j])}" for j in idx)


def _rate(g: pd.DataFrame, tuned_cols: Sequence[str], strip: str) -> str:
    """'lr=0.006, adam_lr=0.01': the tuned keys the runs of a row share (unset keys left out)."""
    parts = []
    for c in tuned_cols:
        vals = {_norm(v) for v in g[c]}
        if vals != {None}:
            parts.append(f"{c.removeprefix(strip)}=" + "/".join(sorted(map(_show, vals))))
    return ", ".join(parts)


def _edges(chosen: tuple, keys: Sequence[tuple], cols: Sequence[str], strip: str) -> tuple[str, dict]:
    """Which numeric keys of the chosen setting sit at the lowest or highest value of the grid tried, in
    words, and the next value beyond each edge ({config key: value}), one geometric step of the grid's
    (the edge value times edge / its neighbour: 0.5 of 0.5, 1, 2 gives 0.25)."""
    out, beyond = [], {}
    for j in _differing(keys, cols):
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


def _shared_device(g: pd.DataFrame) -> bool:
    """Whether any run of g trained beside other runs on its GPU (summary.json's device_shared)."""
    return "device_shared" in g and bool(g["device_shared"].fillna(False).astype(bool).any())


def _mean(g: pd.DataFrame, col: str) -> float:
    return float(pd.to_numeric(g[col], errors="coerce").mean()) if col in g else np.nan


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------

TABLE_COLUMNS = ["switch", "option", "baseline", "cell", "rate", "setting", "grid_edge", "n", "seeds", "mean",
                 "std", "ci_lo", "ci_hi", "delta", "delta_lo", "delta_hi", "p_value", "p_holm", "test", "mde",
                 "verdict", "warnings", "N", "N_rel", "tokens", "flops_per_token", "flops_rel", "tokens_per_s",
                 "tokens_per_s_rel", "run_ids"]


def ablation_table(runs: pd.DataFrame, metric: str = "loss_val_final", baseline: Optional[dict] = None,
                   match: Optional[Sequence[str]] = None, level: float = 0.95, switches: Sequence[str] = SWITCHES,
                   ignore: Sequence[str] = (), tune: bool = False, tuned: Sequence[str] = TUNED,
                   tune_seeds: Optional[Sequence[int]] = None, n_def: str = DEFAULT_N,
                   report_seeds: str = "0,1,2") -> pd.DataFrame:
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
        own = [c for c in config_cols if _under(c.removeprefix("config."), (s,)) and c != f"config.{s}.name"]
        tuned_cols = [f"config.{k}" for k in tuned if f"config.{k}" in runs.columns]
        compared = set(own) | (set(tuned_cols) if tune else set())
        cell_cols = [*match, *(c for c in config_cols if c not in compared and c != f"config.{s}.name"
                               and not _under(c.removeprefix("config."), skip))]
        setting_cols = [c for c in config_cols if c in compared]
        strip = f"config.{s}." if s == "optim" else "config."
        cells = _groups(sub, cell_cols)
        named = [j for j in _differing([k for k, _ in cells], cell_cols)
                 if cell_cols[j].startswith("config.") and cell_cols[j] not in _SHOWN
                 and cell_cols[j] not in tuned_cols]
        for key, cell in cells:
            cell_name = _label(key, cell_cols, named)
            where = dict(zip(match, key[:len(match)]))
            options = _ordered(s, cell[s].unique().tolist(), r)
            if options == [r]:
                continue  # baseline runs alone (the baseline of other switches' ablations): nothing to compare
            if r not in options:
                shown = cell_name or ", ".join(f"{k}={_show(v)}" for k, v in where.items())
                notes.append(f"{s}: {len(cell)} run(s) of {', '.join(map(str, options))} in a cell with no {r!r} "
                             f"run ({shown}); not compared")
                continue
            picked = {}  # option -> [(setting, runs, grid edge, warning)], one entry per row
            for opt in options:
                settings = _groups(cell[cell[s] == opt], setting_cols)
                vary = [j for j in _differing([k for k, _ in settings], setting_cols)
                        if setting_cols[j] not in tuned_cols]  # the rates have a column of their own
                if tune:
                    picked[opt] = _pick_tuned(s, opt, cell_name, settings, setting_cols, vary, tuned_cols, metric,
                                              is_tune, strip, report_seeds, tuning)
                else:
                    picked[opt] = [(_label(k, setting_cols, vary, strip), g, "", "") for k, g in settings]
            base_rows = picked[r]
            for opt in options:
                for setting, g, edge, extra in picked[opt]:
                    row = {"switch": s, "option": opt, "baseline": r, **where, "cell": cell_name,
                           "rate": _rate(g, tuned_cols, strip), "setting": setting, "grid_edge": edge}
                    rows.append(_fill(row, g, base_rows, opt == r, metric, level, n_col, extra))
    columns = [*TABLE_COLUMNS[:3], *match, *(c for c in TABLE_COLUMNS[3:] if c not in match)]
    table = pd.DataFrame(rows, columns=columns)
    table["p_holm"] = holm(table["p_value"]) if len(table) else []
    table["verdict"] = [_verdict(t) for t in table.itertuples()]
    table.attrs.update(notes=notes, metric=metric, tune=tune, n_comparisons=int(table["p_value"].notna().sum()),
                       tuning=tuning)
    return table


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


def _pick_tuned(s, opt, cell_name, settings, setting_cols, vary, tuned_cols, metric, is_tune, strip, report_seeds,
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
            return [(_label(k, setting_cols, vary, strip), g, "", "one setting, no tuning runs (not tuned)")]
        return [(_label(k, setting_cols, vary, strip), g, "", f"{len(settings)} settings and no tuning runs: "
                 "not compared at a chosen setting") for k, g in settings]
    best = min(range(len(cands)), key=lambda i: cands[i][2])
    keys = [c[0] for c in cands]
    edge, beyond = _edges(cands[best][0], keys, setting_cols, strip)
    for i, (k, g, m, nt) in enumerate(cands):
        tune_seeds = ",".join(map(str, sorted(g.loc[is_tune(g["seed"]), "seed"].unique())))
        tuning.append({"switch": s, "cell": cell_name, "option": opt, "setting": _label(k, setting_cols, vary, strip),
                       "rate": _rate(g, tuned_cols, strip), "n_tune": nt, "mean_tune": m, "chosen": i == best,
                       "grid_edge": edge if i == best else "", "command": _command(g, report_seeds) if i == best else "",
                       "widen": _command(g, tune_seeds, beyond) if i == best and beyond else ""})
    k, g, _, _ = cands[best]
    reported = g[~is_tune(g["seed"])]
    extra = "" if len(cands) > 1 else "one setting tried (not tuned)"
    if reported.empty:
        extra = f"no reported seeds at the chosen setting yet: {_command(g, report_seeds)}"
    return [(_label(k, setting_cols, vary, strip), reported, edge, extra)]


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
    row.update(N=_mean(g, n_col), tokens=_mean(g, "tokens"), flops_per_token=_mean(g, "flops_per_token"),
               tokens_per_s=_mean(g, "tokens_per_s_median"), run_ids=";".join(g["run_id"]) if "run_id" in g else "")
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
    for col, src in (("N_rel", n_col), ("flops_rel", "flops_per_token"), ("tokens_per_s_rel", "tokens_per_s_median")):
        row[col] = _mean(g, src) / _mean(base_g, src) if len(base_g) and _mean(base_g, src) else np.nan
    if _shared_device(g) or _shared_device(base_g):  # others trained on the same GPU: not the option's own speed
        row["tokens_per_s_rel"] = np.nan
        if not is_base:
            warnings.append("tokens/s of runs that shared a GPU: no throughput ratio")
    row["warnings"] = "; ".join(warnings)
    return row


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
    if t.p_holm < ALPHA:
        return "better" if t.delta < 0 else "worse"
    return f"not significant (MDE {fmt(t.mde)})"


def _ordered(switch: str, options: Sequence, ref) -> list:
    known = SWITCH_OPTIONS.get(switch, ())
    rest = sorted((o for o in options if o not in known and o != ref), key=str)
    head = [ref] if ref in options else []
    return head + [o for o in known if o in options and o != ref] + rest


# --------------------------------------------------------------------------------------------------
# Headline
# --------------------------------------------------------------------------------------------------

HEADLINE_COLUMNS = ["switch", "option", "N", "tokens", "n", "delta", "delta_lo", "delta_hi", "verdict", "multiplier",
                    "multiplier_lo", "multiplier_hi", "tokens_per_s_rel", "flops_rel", "flop_s_rel", "wall_clock",
                    "wall_clock_lo", "wall_clock_hi"]


def headline(table: pd.DataFrame, multipliers: Optional[pd.DataFrame] = None,
             speed: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """One row per (switch, option): what the option is worth.

    delta [CI] and verdict: the table's row at the largest model size whose delta has an interval (the
    baseline row's N; ties: the most tokens, then the most seeds), or the largest size where none has
    one (a ladder of one seed per size above the size that has the seeds). multiplier [CI]: the
    shared-exponent compute multiplier of the variant 'switch=option' against the baseline from
    `multipliers` (analysis.scaling.compute_multipliers; NaN without a ladder per variant); > 1: the
    baseline needs that many times the FLOPs for the variant's loss. tokens_per_s_rel: the variant's throughput over the baseline's in the same runs as the delta, or,
    where those shared their GPU with other runs (device_shared), in the longest cell of the same size
    whose runs did not, from `speed` (the ablation table of timing runs, each option alone) when given,
    else from `table`;
    flop_s_rel = tokens_per_s_rel x flops_rel, the ratio of FLOPs per second. wall_clock = multiplier x
    flop_s_rel: T_base / T_var for the same loss, with T = C / (FLOPs per second), so > 1 means the variant
    reaches the loss sooner; its interval is the multiplier's interval times flop_s_rel (the throughput
    ratio taken as measured)."""
    rows = []
    t = table[table["test"] != "baseline"]
    for (s, o), g in t.groupby(["switch", "option"], sort=False):
        size = (g["N"] / g["N_rel"]).where(g["N_rel"].notna(), g["N"])
        g = g.assign(_size=size.fillna(0), _tokens=g["tokens"] if "tokens" in g else 0,
                     _ci=np.isfinite(g["delta_lo"].astype(float)))
        r = g.sort_values(["_ci", "_size", "_tokens", "n"], ascending=False, kind="stable").iloc[0]
        tokens_per_s_rel = r["tokens_per_s_rel"]
        if pd.isna(tokens_per_s_rel):  # e.g. the study's runs shared the GPU: a cell of the same size timed alone
            timed = g if speed is None else speed[(speed["switch"] == s) & (speed["option"] == o)]
            size = (timed["N"] / timed["N_rel"]).where(timed["N_rel"].notna(), timed["N"])
            alone = timed[np.isclose(size, r["_size"]) & timed["tokens_per_s_rel"].notna()]
            by = [c for c in ("tokens", "n") if c in alone]
            tokens_per_s_rel = alone.sort_values(by, ascending=False, kind="stable")["tokens_per_s_rel"].iloc[0] \
                if len(alone) else np.nan
        m = pd.DataFrame() if multipliers is None else multipliers[
            (multipliers["variant"] == f"{s}={o}") & (multipliers["kind"] == "shared")]
        mult, lo, hi = (m.iloc[0][["multiplier", "lo", "hi"]].astype(float) if len(m) else (np.nan,) * 3)
        flop_s = tokens_per_s_rel * r["flops_rel"]
        rows.append({"switch": s, "option": o, "N": r["_size"], "tokens": r["_tokens"], "n": r["n"],
                     "delta": r["delta"], "delta_lo": r["delta_lo"], "delta_hi": r["delta_hi"], "verdict": r["verdict"],
                     "multiplier": mult, "multiplier_lo": lo, "multiplier_hi": hi,
                     "tokens_per_s_rel": tokens_per_s_rel, "flops_rel": r["flops_rel"], "flop_s_rel": flop_s,
                     "wall_clock": mult * flop_s, "wall_clock_lo": lo * flop_s, "wall_clock_hi": hi * flop_s})
    return pd.DataFrame(rows, columns=HEADLINE_COLUMNS)


def display_headline(h: pd.DataFrame) -> pd.DataFrame:
    """The headline with intervals merged into strings."""
    def ci(v, lo, hi, sign=False):
        if not np.isfinite(v):
            return "—"
        f = (lambda x: f"{x:+.4f}") if sign else (lambda x: f"{x:.3g}")
        return f(v) + (f" [{f(lo)}, {f(hi)}]" if np.isfinite(lo) else "")

    return pd.DataFrame({
        "switch": h["switch"], "option": h["option"], "N (largest)": h["N"], "n": h["n"],
        "delta [95% CI]": [ci(*x, sign=True) for x in zip(h["delta"], h["delta_lo"], h["delta_hi"])],
        "verdict": h["verdict"],
        "compute multiplier [95% CI]": [ci(*x) for x in zip(h["multiplier"], h["multiplier_lo"], h["multiplier_hi"])],
        "tokens/s ratio": [_ratio(v) for v in h["tokens_per_s_rel"]],
        "FLOPs/token ratio": [_ratio(v) for v in h["flops_rel"]],
        "wall-clock multiplier [95% CI]": [ci(*x) for x in zip(h["wall_clock"], h["wall_clock_lo"], h["wall_clock_hi"])],
    })


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------

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


def _ratio(v) -> str:
    return "" if not np.isfinite(v) else f"{v:.3f}"


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """The ablation table with intervals merged into readable strings; columns with nothing in them left out."""
    out = table.copy()
    out["mean ± 95% CI"] = [f"{fmt(m)} [{fmt(lo)}, {fmt(hi)}]" if not np.isnan(lo) else fmt(m)
                            for m, lo, hi in zip(table["mean"], table["ci_lo"], table["ci_hi"])]
    out["delta [95% CI]"] = ["—" if t == "baseline" else "" if np.isnan(d) else
                             (f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}]" if not np.isnan(lo) else f"{d:+.4f}")
                             for d, lo, hi, t in zip(table["delta"], table["delta_lo"], table["delta_hi"], table["test"])]
    out["p"] = [fmt(p, 3) for p in table["p_value"]]
    out["p (Holm)"] = [fmt(p, 3) for p in table["p_holm"]]
    out["N / base"] = [_ratio(v) for v in table["N_rel"]]
    out["FLOPs/token / base"] = [_ratio(v) for v in table["flops_rel"]]
    out["tokens/s / base"] = [_ratio(v) for v in table["tokens_per_s_rel"]]
    drop = {"baseline", "mean", "ci_lo", "ci_hi", "delta", "delta_lo", "delta_hi", "p_value", "p_holm", "mde", "N",
            "N_rel", "flops_per_token", "flops_rel", "tokens_per_s", "tokens_per_s_rel", "run_ids"}
    keep = [c for c in out.columns if c not in drop and c not in ("verdict", "warnings")] + ["verdict", "warnings"]
    out = out[keep]
    empty = [c for c in out.columns if out[c].map(lambda v: fmt(v) == "").all()]
    return out.drop(columns=empty)


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


def _parse_baseline(items: Sequence[str]) -> dict:
    out = {}
    for it in items:
        for part in it.split(","):
            if "=" not in part:
                raise SystemExit(f"--baseline expects SWITCH=OPTION, got {part!r}")
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


def table_from_args(runs: pd.DataFrame, args) -> pd.DataFrame:
    return ablation_table(runs, args.metric, _parse_baseline(args.baseline), [c for c in args.match.split(",") if c],
                          ignore=[c for c in args.ignore.split(",") if c], tune=args.tune,
                          tuned=[c for c in args.tuned.split(",") if c], tune_seeds=_seeds(args.tune_seeds),
                          n_def=getattr(args, "n_def", DEFAULT_N), report_seeds=args.report_seeds)


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
    if args.next and not args.tune:
        raise SystemExit("--next lists what a tuned comparison runs next: add --tune")
    try:
        col = collect(args.paths, verbose=not args.next, curves=False)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"analysis.ablate: {e}") from None
    if col.runs.empty:
        raise SystemExit("no usable runs")
    table = table_from_args(col.runs, args)
    if table.empty:
        raise SystemExit("no switch has runs that differ from the baseline in that switch only")
    if args.next:
        print("\n".join(next_commands(table)))
        return
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
