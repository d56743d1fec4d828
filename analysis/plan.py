"""The planner: how many seeds a claim needs, what the runs cost, and how much noise the validation set adds.

    python -m analysis.plan results/pycode_study/runs/pycode_study --tune --tuned optim.lr_scale \
        --mde 0.03 --primaries 2 --tokens-per-param 20 --size depth4:6590476:471816 --size depth6:18564350:275082
    python -m analysis.plan --sd-diff 0.03 --mde 0.03 --size s:1e7:3e5          # a given seed spread

Seeds. A primary comparison is a two-sided paired t-test of the per-seed differences (analysis.stats). Its
seeds per point n are the fewest (>= --min-seeds) at which the test detects the minimum detectable effect
(MDE) with power POWER at alpha / k, k the number of primary comparisons (Holm's first step; planning every
test at it is the safe side): the noncentral-t power at effect size MDE / sd_diff (paired_power), sd_diff the standard
deviation of a paired difference. Also at sd_diff's upper 90% confidence bound, sd_diff sqrt(nu /
chi2_{0.10, nu}), since a pilot measures it on few degrees of freedom.

The seed spread of a pilot. sd_diff pooled over the pilot's paired comparisons (analysis.ablate rows tested
by the paired t-test): sd^2 = sum (n_c - 1) s_c^2 / sum (n_c - 1), with s_c the sd of comparison c's
per-seed differences.

Validation size. A run's validation loss is the mean over W windows (data.val_tokens / data.seq_len), the
same windows for every run. Model: sd_diff(W)^2 = sd_seed^2 + sd_window^2 / W, where sd_window is the
standard deviation over windows of the difference between the two runs' per-window losses, and sd_seed the
part that a larger validation set does not remove. sd_window is not logged; it is estimated from the data
there is. Two runs of one seed train on the same batches (the seed fixes the data order), so the
difference of their logged training losses at a step is the mean difference over the same w windows
(train.log_every x tokens_per_step / seq_len of them, each window seen for the first time): its noise
around its smooth trend has variance sd_window^2 / w. That variance is the variance of the second
differences of the series over the second half of the run, divided by 6 (white noise e: var(e_{t+1} - 2
e_t + e_{t-1}) = 6 var(e); a smooth trend hardly moves second differences). sd_seed^2 = max(0, sd_diff^2 -
sd_window^2 / W_pilot). The assumption on the safe side: the window term varies from seed to seed in full,
so that more seeds average it away; part of it is common to every seed of a pair of configurations (a
configuration that is better on some files), which more seeds do not remove and only a larger validation
set does.

Cost. A plan is a list of planned runs (PlannedRun: size, configuration, seed, purpose, tokens and the
tokens/s it trains at); plan_cost sums each size's runs and device minutes (tokens / tokens/s, each run
alone on its device) and flags a run longer than a slice of device time (a run cannot carry its checkpoint
from one slice to the next). plan_runs builds the usual plan: per size and configuration, the reported
seeds and a tuning grid on one tuning seed.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from analysis.checks import check_out_file, one_line
from analysis.stats import ALPHA, POWER, paired_power
from analysis.tables import markdown_table

VAL_TOKENS = (65_536, 262_144, 1_048_576, 4_194_304)


# --------------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------------

def seeds_for_mde(sd_diff: float, mde: float, primaries: int = 1, alpha: float = ALPHA, power: float = POWER,
                  min_seeds: int = 2, max_seeds: int = 1000) -> int:
    """The fewest seeds per point (>= min_seeds) at which a two-sided paired t-test at alpha / primaries
    detects `mde` with `power` (paired_power), given the sd of a paired difference (module docstring);
    max_seeds + 1 when even max_seeds do not."""
    if not (sd_diff > 0 and mde > 0):
        raise ValueError(f"sd_diff {sd_diff} and mde {mde} must be > 0")
    ns = np.arange(max(2, min_seeds), max_seeds + 1)
    enough = paired_power(mde / sd_diff, ns, alpha / primaries) >= power
    return int(ns[np.argmax(enough)]) if enough.any() else max_seeds + 1


def upper_bound(sd: float, dof: float, level: float = 0.90) -> float:
    """The upper `level` confidence bound of a standard deviation estimated on `dof` degrees of freedom:
    sd sqrt(dof / chi2_{1 - level, dof}); the sd itself for a given (infinite-dof) one."""
    if not np.isfinite(dof):
        return sd
    return sd * np.sqrt(dof / stats.chi2.ppf(1 - level, dof))


# --------------------------------------------------------------------------------------------------
# The seed spread and the validation term from a pilot
# --------------------------------------------------------------------------------------------------

@dataclass
class PilotNoise:
    """What a pilot says about the noise of a paired comparison: sd_diff on dof degrees of freedom (pooled
    over its paired comparisons, `comparisons` lists them), sd_window per validation window (NaN when the
    training losses could not give it) from `pairs` same-seed run pairs, and the pilot's validation windows."""
    sd_diff: float
    dof: float
    sd_window: float
    pairs: int
    val_windows: float
    comparisons: pd.DataFrame

    def sd_seed(self) -> float:
        """The part of sd_diff that a larger validation set does not remove (module docstring)."""
        if not np.isfinite(self.sd_window):
            return self.sd_diff
        return float(np.sqrt(max(0.0, self.sd_diff ** 2 - self.sd_window ** 2 / self.val_windows)))

    def sd_at(self, val_windows: float) -> float:
        """sd_diff with `val_windows` validation windows."""
        if not np.isfinite(self.sd_window):
            return self.sd_diff
        return float(np.sqrt(self.sd_seed() ** 2 + self.sd_window ** 2 / val_windows))


def paired_comparisons(table: pd.DataFrame, runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per paired-t row of an ablation table: the option's and the baseline's run of each seed and the sd of
    their differences. Columns: switch, option, N, n, sd_diff, pairs (list of (seed, option run, baseline
    run))."""
    by_id = runs.set_index("run_id")
    rows = []
    for i, r in table[table["test"] == "paired t"].iterrows():
        base = table[(table["switch"] == r["switch"]) & (table["test"] == "baseline") & (table["cell"] == r["cell"])
                     & (table.index < i)]
        cell_keys = [c for c in table.columns[3:table.columns.get_loc("cell")]]
        for k in cell_keys:
            base = base[base[k].astype(str) == str(r[k])]
        if base.empty:
            continue
        opt = by_id.loc[r["run_ids"].split(";")].groupby("seed")
        ref = by_id.loc[base.iloc[-1]["run_ids"].split(";")].groupby("seed")
        seeds = sorted(set(opt.groups) & set(ref.groups))
        diffs = [opt.get_group(s)[metric].mean() - ref.get_group(s)[metric].mean() for s in seeds]
        pairs = [(s, opt.get_group(s).index[0], ref.get_group(s).index[0]) for s in seeds]
        rows.append({"switch": r["switch"], "option": r["option"], "N": r["N"], "n": len(diffs),
                     "sd_diff": float(np.std(diffs, ddof=1)), "pairs": pairs})
    return pd.DataFrame(rows, columns=["switch", "option", "N", "n", "sd_diff", "pairs"])


def second_difference_variance(y: np.ndarray) -> float:
    """var(e) of a smooth trend plus white noise e: the variance of the second differences over 6."""
    d = np.diff(np.asarray(y, float), 2)
    return float(np.var(d, ddof=1) / 6) if len(d) > 2 else np.nan


def window_sd(pairs: Sequence[tuple], runs: pd.DataFrame, curves: pd.DataFrame) -> tuple[float, int]:
    """sd_window (module docstring) pooled over same-seed run pairs (seed, run a, run b): per pair, the
    difference of the two runs' loss/train at their common logged steps in the second half of the run, its
    noise variance by second differences, times the windows per logged value. Returns (sd_window, pairs
    used)."""
    train = curves[curves["metric"] == "loss/train"].set_index("run_id")
    by_id = runs.set_index("run_id")
    variances = []
    for _, a, b in pairs:
        if a not in train.index or b not in train.index:
            continue
        sa = train.loc[[a]].set_index("step")["value"]
        sb = train.loc[[b]].set_index("step")["value"]
        common = sa.index.intersection(sb.index).sort_values()
        common = common[common > common.max() / 2]
        if len(common) < 8:
            continue
        r = by_id.loc[a]
        windows = r["config.train.log_every"] * r["tokens_per_step"] / r["config.data.seq_len"]
        variances.append(second_difference_variance((sa.loc[common] - sb.loc[common]).to_numpy()) * windows)
    return (float(np.sqrt(np.mean(variances))) if variances else np.nan), len(variances)


def pilot_noise(paths: Sequence[str], args) -> PilotNoise:
    """PilotNoise of the run directories under `paths`, their ablation table made as analysis.report makes it
    (args: the ablation options)."""
    from analysis.ablate import table_from_args
    from analysis.checks import check_ablation_options, require_runs
    from analysis.collect import collect

    col = collect(paths, curves=True)
    require_runs(col, paths)
    check_ablation_options(col.runs, args)
    table = table_from_args(col.runs, args)
    comps = paired_comparisons(table, col.runs, args.metric)
    if comps.empty:
        raise ValueError("the pilot has no paired comparison (an option and the baseline on the same >= 2 seeds)")
    dof = float((comps["n"] - 1).sum())
    sd = float(np.sqrt(((comps["n"] - 1) * comps["sd_diff"] ** 2).sum() / dof))
    sdw, used = window_sd([p for ps in comps["pairs"] for p in ps], col.runs, col.curves)
    runs = col.runs
    val_windows = float((runs["config.data.val_tokens"] // runs["config.data.seq_len"]).median()) \
        if "config.data.val_tokens" in runs else np.nan
    return PilotNoise(sd, dof, sdw, used, val_windows, comps.drop(columns="pairs"))


# --------------------------------------------------------------------------------------------------
# Cost
# --------------------------------------------------------------------------------------------------

@dataclass
class PlannedRun:
    """One run of a plan: its size (label and N), configuration, seed, purpose ('tuning' or 'reported'),
    the tokens it trains and the tokens/s it trains at alone on its device."""
    size: str
    N: float
    config: str
    seed: int
    purpose: str
    tokens: float
    tokens_per_s: float

    @property
    def minutes(self) -> float:
        return self.tokens / self.tokens_per_s / 60


def plan_runs(sizes: Sequence[tuple[str, float, float]], configs: Sequence[str], seeds: int,
              tokens_per_param: float, tune_runs: int = 3, tune_seed: int = 1000) -> list[PlannedRun]:
    """The usual plan: at every size (label, N, tokens/s) and configuration, `tune_runs` runs of a rate grid
    on the tuning seed and `seeds` reported seeds at the chosen rate, each run tokens_per_param x N tokens."""
    runs = []
    for label, n, tps in sizes:
        for config in configs:
            runs += [PlannedRun(label, n, config, tune_seed, "tuning", tokens_per_param * n, tps)] * tune_runs
            runs += [PlannedRun(label, n, config, s, "reported", tokens_per_param * n, tps) for s in range(seeds)]
    return runs


def plan_cost(runs: Sequence[PlannedRun], slice_minutes: float = 25.0) -> pd.DataFrame:
    """Per size: runs, tokens, minutes of one run and device minutes of all (each run alone on its device),
    and whether one run fits a slice of `slice_minutes`; a last row 'all' with the totals."""
    df = pd.DataFrame([{**asdict(r), "minutes": r.minutes} for r in runs])
    out = df.groupby("size", sort=False).agg(N=("N", "first"), runs=("seed", "size"), tuning=("purpose",
                                             lambda p: int((p == "tuning").sum())), tokens=("tokens", "sum"),
                                             run_minutes=("minutes", "max"), device_minutes=("minutes", "sum"))
    out["fits_a_slice"] = out["run_minutes"] <= slice_minutes
    total = pd.DataFrame([{"N": np.nan, "runs": out["runs"].sum(), "tuning": out["tuning"].sum(),
                           "tokens": out["tokens"].sum(), "run_minutes": out["run_minutes"].max(),
                           "device_minutes": out["device_minutes"].sum(),
                           "fits_a_slice": bool(out["fits_a_slice"].all())}], index=["all"])
    return pd.concat([out, total]).rename_axis("size").reset_index()


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def parse_size(text: str) -> tuple[str, float, float]:
    """'depth4:6590476:471816' -> (label, N, tokens/s)."""
    parts = text.split(":")
    try:
        label, n, tps = parts[0], float(parts[1]), float(parts[2])
        if len(parts) != 3 or not label or n <= 0 or tps <= 0:
            raise ValueError
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"--size {text!r}: expected LABEL:N:TOKENS_PER_S with N and tokens/s > 0, "
                                         "e.g. depth4:6590476:471816") from None
    return label, n, tps


def build_parser() -> argparse.ArgumentParser:
    from analysis.ablate import add_ablation_args

    p = argparse.ArgumentParser(prog="python -m analysis.plan", description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="*", help="a pilot's run directories (its paired comparisons give the seed spread)")
    p.add_argument("--sd-diff", type=float, default=None,
                   help="the sd of a paired difference, given instead of a pilot (taken as exact)")
    p.add_argument("--window-sd", type=float, default=None,
                   help="with --sd-diff: the sd per validation window of a paired difference, for the validation table")
    p.add_argument("--val-windows", type=float, default=None, help="with --sd-diff: the windows it was measured on")
    p.add_argument("--mde", type=float, required=True, help="minimum detectable effect, in the metric's units (nats)")
    p.add_argument("--primaries", type=int, default=1, help="primary comparisons (Holm's alpha / k)")
    p.add_argument("--power", type=float, default=POWER)
    p.add_argument("--alpha", type=float, default=ALPHA)
    p.add_argument("--min-seeds", type=int, default=3, help="seeds per point at least")
    p.add_argument("--val-tokens", default=",".join(map(str, VAL_TOKENS)), help="validation sizes to tabulate")
    p.add_argument("--plan-val-tokens", type=int, default=1_048_576, help="the validation size the plan uses")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per validation window")
    p.add_argument("--size", action="append", type=parse_size, default=[], metavar="LABEL:N:TOKENS_PER_S",
                   help="a size of the plan: its label, N (active non-embedding parameters) and tokens/s alone on the "
                        "device (repeatable)")
    p.add_argument("--configs", default="K3 default,residual=standard,optim=adamw",
                   help="configurations run at every size (comma list)")
    p.add_argument("--tokens-per-param", type=float, default=20.0)
    p.add_argument("--tune-runs", type=int, default=3, help="tuning runs per size and configuration (one seed)")
    p.add_argument("--slice-minutes", type=float, default=25.0, help="device minutes one run must fit in")
    p.add_argument("--md", help="write the tables as Markdown here")
    add_ablation_args(p)
    return p


def main(argv: Optional[list[str]] = None) -> str:
    args = build_parser().parse_args(argv)
    try:
        if bool(args.paths) == (args.sd_diff is not None):
            raise ValueError("give a pilot's run directories or --sd-diff, one of the two")
        for name in ("mde", "sd_diff", "window_sd", "val_windows"):
            v = getattr(args, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} {v}: must be > 0")
        if args.primaries < 1 or args.min_seeds < 2 or not 0 < args.power < 1 or not 0 < args.alpha < 1:
            raise ValueError("--primaries >= 1, --min-seeds >= 2, --power and --alpha in (0, 1)")
        check_out_file(args.md, "--md")
        try:
            val_tokens = [int(v) for v in args.val_tokens.split(",") if v.strip()]
        except ValueError:
            val_tokens = []
        if not val_tokens or min(val_tokens) <= 0:
            raise ValueError(f"--val-tokens {args.val_tokens!r}: validation sizes in tokens > 0, e.g. 65536,1048576")
        if args.paths:
            noise = pilot_noise(args.paths, args)
        else:
            noise = PilotNoise(args.sd_diff, np.inf, args.window_sd if args.window_sd else np.nan, 0,
                               args.val_windows or np.nan, pd.DataFrame())
            if args.window_sd and not args.val_windows:
                raise ValueError("--window-sd needs --val-windows (the windows --sd-diff was measured on)")
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise SystemExit(f"analysis.plan: {one_line(e)}") from None
    text = plan_text(noise, args, val_tokens)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    return text


def plan_text(noise: PilotNoise, args, val_tokens: Sequence[int]) -> str:
    """The planner's tables as Markdown: the noise, seeds against validation size, and the plan's cost."""
    alpha_k = args.alpha / args.primaries
    lines = []
    if len(noise.comparisons):
        lines += [f"**Seed spread of a paired difference**: sd_diff = {noise.sd_diff:.4g} nats, pooled over "
                  f"{len(noise.comparisons)} paired comparisons of the pilot ({noise.dof:g} dof; 90% upper bound "
                  f"{upper_bound(noise.sd_diff, noise.dof):.4g}), measured with {noise.val_windows:g} validation "
                  "windows:", "", markdown_table(noise.comparisons), ""]
    else:
        lines += [f"**Seed spread of a paired difference** (given): sd_diff = {noise.sd_diff:.4g} nats.", ""]
    if np.isfinite(noise.sd_window):
        source = (f"from the training losses of {noise.pairs} same-seed run pairs" if noise.pairs else "given")
        lines += [f"**Validation windows**: sd_window = {noise.sd_window:.4g} nats per window of a paired difference "
                  f"({source}); sd_diff(W)^2 = sd_seed^2 + sd_window^2 / W with sd_seed = {noise.sd_seed():.4g}.", ""]
    rows = []
    for v in val_tokens:
        w = v / args.seq_len
        sd = noise.sd_at(w)
        rows.append({"validation tokens": v, "windows": w,
                     "window term": noise.sd_window / np.sqrt(w) if np.isfinite(noise.sd_window) else np.nan,
                     "sd_diff": sd, "seeds": seeds_for_mde(sd, args.mde, args.primaries, args.alpha, args.power,
                                                           args.min_seeds),
                     "seeds at the 90% bound": seeds_for_mde(upper_bound(sd, noise.dof), args.mde, args.primaries,
                                                             args.alpha, args.power, args.min_seeds)})
    lines += [f"**Seeds per point** for an MDE of {args.mde:g} nats: two-sided paired t-test, power {args.power}, "
              f"alpha {args.alpha} / {args.primaries} primaries = {alpha_k:.4g}, at least {args.min_seeds}:", "",
              markdown_table(pd.DataFrame(rows)), ""]
    if args.size:
        w = args.plan_val_tokens / args.seq_len
        seeds = seeds_for_mde(noise.sd_at(w), args.mde, args.primaries, args.alpha, args.power, args.min_seeds)
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        runs = plan_runs(args.size, configs, seeds, args.tokens_per_param, args.tune_runs)
        cost = plan_cost(runs, args.slice_minutes)
        total = cost.iloc[-1]
        lines += [f"**Cost**: {len(configs)} configurations ({', '.join(configs)}) at every size, {seeds} reported "
                  f"seeds each (validation {args.plan_val_tokens:,} tokens) and {args.tune_runs} tuning runs on one "
                  f"seed, {args.tokens_per_param:g} tokens per parameter; minutes at the given tokens/s, each run alone "
                  f"on its device; `fits_a_slice`: one run within {args.slice_minutes:g} minutes.", "",
                  markdown_table(cost), "",
                  f"In all {int(total['runs'])} runs, {total['device_minutes']:.0f} device minutes "
                  f"({total['device_minutes'] / 60:.1f} hours), at least "
                  f"{math.ceil(total['device_minutes'] / args.slice_minutes)} "
                  f"slices of {args.slice_minutes:g} minutes" + ("." if total["fits_a_slice"] else
                                                                 "; some runs are longer than a slice."), ""]
    return "\n".join(lines).rstrip()


if __name__ == "__main__":
    main()
