"""The learning rate tuned at every size of a ladder, in one command (docs/schedules.md, "The rate at every size").

    python tune.py ladders/cpu_tune.yaml                         # stage 1, widening, stage 2, the report
    python tune.py ladders/pycode_study2.yaml data.path=/tmp/pycode8k --dry-run   # the runs and their minutes
    python tune.py ladders/pycode_study2.yaml data.path=/tmp/pycode8k hydra/launcher=joblib --parallel 3
    K3LAB_STOP_AT=$(( $(date +%s) + 540 )) python tune.py ladders/pycode_study2.yaml --sizes d4 ...  # a slice

A ladder plan (a YAML file, ladders/*.yaml) has

    group        the runs' folder, <out_dir>/<group>
    command      run.py overrides every run shares (e.g. experiment=pycode_study2)
    tune_command overrides of the tuning runs only (e.g. a shorter length), optional
    sizes        name -> overrides, e.g. d4: [model.n_layers=4]
    variants     name -> overrides, or name -> {overrides: [...], sizes: [names], grid: {...}} for a
                 configuration on some sizes only or with a grid of its own; optional (one configuration)
    grid         key -> values tried, e.g. optim.lr_scale: [0.5, 1, 2]
    tune_seeds, seeds, max_widen (default 3)
    dry_run      vocab_size and tokens_per_s (per size name) for --dry-run

and for every configuration at each of its sizes:

    stage 1   the grid on the tuning seeds: one multirun, `python run.py -m <command> <tune_command>
              <variant> <size> <key>=<v1>,<v2>,... seed=<tuning seeds> group=<group>`
    widen     while the best setting sits at an edge of its grid (analysis.rates.grid_edges), the setting one
              step beyond it on the tuning seeds, at most `max_widen` rounds
    stage 2   the reported seeds at the chosen setting (analysis.rates: the lowest mean final validation loss
              of the cell's longest runs on the tuning seeds: a WSD trunk's longest branch)

then writes the report of the choices and the loss-vs-rate curves (analysis.rates.write_report) to
<out_dir>/<group>/rates. Each stage reads the run directories the previous one wrote, so nothing is edited by
hand, and the command run again skips every run that completed and resumes a killed one (run.py), then
chooses again from the same directories: the same choices. Overrides after the plan (data.path=...,
out_dir=..., hydra/launcher=joblib) go to every run.py command.

A slice of a plan: `--sizes` and `--variants` keep those of the plan's cells (each stage, choice and report is
per cell, so a slice decides what the whole plan would for its cells). Under a deadline (K3LAB_STOP_AT,
k3lab/preempt.py: every run saves and stops at it, and no run begins after it) the command stops after the
first stage that met it, before choosing from runs it did not finish, and says so; run again, it goes on.

This driver stands above training and analysis: it composes configs with k3lab (for --dry-run and to tell
which runs belong to which configuration and size) and reads run directories with analysis; the library
k3lab never imports analysis.
"""
from __future__ import annotations

import argparse
import functools
import math
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from analysis.collect import collect
from analysis.rates import tune_cell, value_text, write_report
from analysis.trunks import is_trunk
import k3lab.config  # noqa: F401  registers the schema conf/config.yaml composes onto (k3lab_schema)
from k3lab.errors import ConfigError, run_command
from k3lab.preempt import past_deadline

ROOT = Path(__file__).resolve().parent
PLAN_KEYS = {"group", "command", "tune_command", "sizes", "variants", "grid", "tune_seeds", "seeds", "max_widen",
             "dry_run"}
VARIANT_KEYS = {"overrides", "sizes", "grid"}


class Cell(NamedTuple):
    """One configuration at one size: its names and overrides, and the rate grid it is tuned on."""
    variant: str
    size: str
    overrides: tuple[str, ...]
    grid: dict


def load_plan(path: Path) -> dict:
    """The plan's keys, checked: one line naming the key when one is unknown, missing or empty."""
    plan = yaml.safe_load(Path(path).read_text()) or {}
    unknown = set(plan) - PLAN_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; a ladder plan has {sorted(PLAN_KEYS)}")
    for key in ("group", "sizes", "grid", "tune_seeds", "seeds"):
        if not plan.get(key):
            raise ConfigError(f"{path}: `{key}` is missing or empty")
    variants = {}
    for name, v in (plan.get("variants") or {"default": []}).items():
        v = v if isinstance(v, dict) else {"overrides": v or []}
        if set(v) - VARIANT_KEYS:
            raise ConfigError(f"{path}: variants.{name} has unknown key(s) {sorted(set(v) - VARIANT_KEYS)}; a variant "
                              f"is a list of overrides or has {sorted(VARIANT_KEYS)}")
        missing = set(v.get("sizes") or ()) - set(plan["sizes"])
        if missing:
            raise ConfigError(f"{path}: variants.{name}.sizes names no size of `sizes`: {sorted(missing)}")
        variants[name] = {"overrides": v.get("overrides") or [], "sizes": v.get("sizes") or list(plan["sizes"]),
                          "grid": v.get("grid") or plan["grid"]}
    return {"command": [], "tune_command": [], "max_widen": 3, "dry_run": {}, **plan, "variants": variants}


def cells(plan: dict) -> list[Cell]:
    return [Cell(name, size, (*v["overrides"], *plan["sizes"][size]), v["grid"])
            for name, v in plan["variants"].items() for size in v["sizes"]]


def select(plan: dict, sizes: str | None = None, variants: str | None = None) -> dict:
    """The plan cut to the named sizes and variants (comma-separated; None: all), its cells those of both;
    one line naming a name the plan lacks, or a cut with no cell left."""
    keep = {}
    for option, names, valid in (("--sizes", sizes, plan["sizes"]), ("--variants", variants, plan["variants"])):
        wanted = [n.strip() for n in names.split(",") if n.strip()] if names else list(valid)
        unknown = [n for n in wanted if n not in valid]
        if unknown:
            raise ConfigError(f"{option}={names}: {', '.join(unknown)} not in the plan; it has {', '.join(valid)}")
        keep[option] = wanted
    cut = {name: {**v, "sizes": [s for s in v["sizes"] if s in keep["--sizes"]]}
           for name, v in plan["variants"].items() if name in keep["--variants"]}
    cut = {name: v for name, v in cut.items() if v["sizes"]}
    if not cut:
        raise ConfigError(f"--sizes={sizes} --variants={variants}: no configuration of the plan has these sizes")
    return {**plan, "variants": cut}


def sweep_value(values) -> str:
    return ",".join(value_text(v) for v in values)


def command(plan: dict, extra: list[str], cell: Cell, setting: dict, seeds, tuning: bool) -> list[str]:
    """The run.py multirun of `cell` at `setting` ({key: value or list of values}) on `seeds`; tuning: with
    the plan's tune_command."""
    rates = [f"{k}={sweep_value(v) if isinstance(v, list) else value_text(v)}" for k, v in setting.items()]
    return ["-m", *plan["command"], *(plan["tune_command"] if tuning else ()), *cell.overrides, *rates,
            f"seed={sweep_value(seeds)}", f"group={plan['group']}", *extra]


def run_all(commands: list[list[str]], parallel: int) -> None:
    """`python run.py <command>` for each, at most `parallel` at once; stops at the first that fails (its
    sweep's table says which run; the same tune.py command again resumes it)."""
    pending, running = list(commands), []
    while pending or running:
        while pending and len(running) < parallel:
            args = pending.pop(0)
            print("python run.py " + " ".join(args), flush=True)
            running.append((args, subprocess.Popen([sys.executable, "run.py", *args], cwd=ROOT)))
        args, proc = running.pop(0)
        if proc.wait() != 0:
            for _, other in running:
                other.wait()
            raise SystemExit(f"tune.py: a run of `python run.py {' '.join(args)}` failed (its table above says "
                             "which); run the same tune.py command again to resume it")


# --- which runs belong to a cell ----------------------------------------------------------------------------
def compose_cell(plan: dict, extra: list[str], cell: Cell, tuning: bool = False):
    """The composed config of a cell's runs, its tuning runs with `tuning` (the hydra/... overrides left out:
    they change no run)."""
    overrides = [o for o in (*plan["command"], *(plan["tune_command"] if tuning else ()), *cell.overrides, *extra)
                 if not o.startswith("hydra")]
    return compose_overrides(tuple(overrides))


@functools.lru_cache(maxsize=None)
def compose_overrides(overrides: tuple[str, ...]):
    """run.py's config composed from `overrides` (read-only: shared by every caller asking for the same)."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def cell_keys(plan: dict) -> list[str]:
    """Every key a variant or size sets (a group name stands for its option, `<group>.name`)."""
    keys = {o.split("=", 1)[0].lstrip("+~") for c in cells(plan) for o in c.overrides}
    return sorted(k if "." in k else f"{k}.name" for k in keys)


def _same(run_value, value) -> bool:
    """A run's config value (as analysis.collect reads it) against the composed one."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (run_value, value))
    return math.isclose(run_value, value) if numbers else value_text(run_value) == value_text(value)


def cell_runs(runs: pd.DataFrame, cfg, keys: list[str]) -> pd.DataFrame:
    """The runs whose config has the cell's value at every key a variant or size sets."""
    mask = pd.Series(True, index=runs.index)
    for key in keys:
        value = OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(cfg, key)}))["v"]
        column = f"config.{key}"
        mask &= runs[column].map(lambda v: _same(v, value)) if column in runs else False
    return runs[mask]


def choose(runs: pd.DataFrame, grid: dict, tune_seeds) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the cell's tuning table on its longest runs, the chosen row) from its runs (analysis.rates.tune_cell)."""
    tuning = runs[runs["seed"].isin(tune_seeds) & ~is_trunk(runs)]
    longest = tuning[tuning["tokens"] == tuning["tokens"].max()]
    table = tune_cell(longest, list(grid))
    return table, table[table["chosen"]]


# --- the stages ---------------------------------------------------------------------------------------------
def stopped_after(stage: str) -> bool:
    """Whether K3LAB_STOP_AT has passed (the runs `stage` launched may have stopped unfinished); says so."""
    late = past_deadline()
    if late:
        print(f"tune.py: stopped at K3LAB_STOP_AT after {stage}, before choosing from runs it may not have "
              "finished; the same command goes on from here", flush=True)
    return late


def tune(plan: dict, extra: list[str], parallel: int) -> Path | None:
    """Stage 1, the widening rounds, stage 2 and the report (module docstring): the report's path, or None
    when K3LAB_STOP_AT stopped it (after saying so)."""
    out = ROOT / next((o.split("=", 1)[1] for o in extra if o.startswith("out_dir=")), "runs") / plan["group"]
    ladder = cells(plan)
    run_all([command(plan, extra, c, c.grid, plan["tune_seeds"], tuning=True) for c in ladder], parallel)
    if stopped_after("stage 1"):
        return None
    configs = [compose_cell(plan, extra, c) for c in ladder]
    keys = cell_keys(plan)
    for round_ in range(plan["max_widen"] + 1):
        runs = collect([out]).runs
        wider, chosen = [], []
        for c, cfg in zip(ladder, configs):
            table, best = choose(cell_runs(runs, cfg, keys), c.grid, plan["tune_seeds"])
            if best.empty:
                raise SystemExit(f"tune.py: no completed tuning run of {c.variant} at {c.size} under {out}")
            chosen.append(best.iloc[0])
            tried = {tuple(value_text(r[k]) for k in c.grid) for _, r in table.iterrows()}
            beyond = [s for s in chosen[-1]["beyond"] or [] if tuple(value_text(s[k]) for k in c.grid) not in tried]
            wider += [command(plan, extra, c, s, plan["tune_seeds"], tuning=True) for s in beyond]
        if not wider or round_ == plan["max_widen"]:
            break
        print(f"widening {len(wider)} grid edge(s), round {round_ + 1} of at most {plan['max_widen']}", flush=True)
        run_all(wider, parallel)
        if stopped_after(f"widening round {round_ + 1}"):
            return None
    for c, best in zip(ladder, chosen):
        edge = f" (at an edge: {best['edge']})" if best["edge"] else ""
        print(f"{c.variant} at {c.size}: " + ", ".join(f"{k}={value_text(best[k])}" for k in c.grid) + edge)
    run_all([command(plan, extra, c, {k: best[k] for k in c.grid}, plan["seeds"], tuning=False)
             for c, best in zip(ladder, chosen)], parallel)
    if stopped_after("stage 2"):
        return None
    return write_report([str(out)], out / "rates", rate_keys=sorted({k for c in ladder for k in c.grid}),
                        tune_seeds=plan["tune_seeds"])


@functools.lru_cache(maxsize=None)
def model_counts(model_yaml: str, vocab_size: int, seq_len: int) -> tuple[int, float]:
    """(N, FLOPs per token) of the model a config's model, kernels and switch groups build (as YAML text, so
    that the configurations of a plan that share a model build it once)."""
    from k3lab.config import RunConfig, typed
    from k3lab.flops import flops_per_token
    from k3lab.model import K3Model

    model = K3Model(typed(RunConfig, OmegaConf.create(model_yaml)).model_config(vocab_size))
    return model.param_counts()["params_active_non_embedding"], flops_per_token(model, seq_len)


class JobLength(NamedTuple):
    """What one job of a composed run config trains, without data or training."""
    n: int               # active non-embedding parameters
    flops_per_token: float
    steps: int           # the steps the job trains: a WSD trunk and each branch's own steps after its branch point
    tokens_per_step: int
    separate: int        # the steps of its points as separate runs (every branch from step 0)
    first: int           # the steps of its shortest and longest (N, D) point (the one run without branches)
    last: int


def job_length(cfg, vocab_size: int) -> JobLength:
    """One job's length (JobLength) from a composed run config (k3lab/branches.py for a WSD trunk's job)."""
    from k3lab.branches import branch_plan
    from k3lab.budget import run_length
    from k3lab.config import SWITCH_SCHEMAS, OptimConfig, TrainConfig, typed

    groups = ["model", "kernels", *(s for s in SWITCH_SCHEMAS if s != "optim")]
    n, fpt = model_counts(OmegaConf.to_yaml({g: cfg[g] for g in groups}), vocab_size, cfg.data.seq_len)
    per_step = cfg.data.batch_size * cfg.data.seq_len * max(cfg.trainer.devices, 1) * cfg.trainer.num_nodes
    steps = run_length(cfg.train, n, fpt, per_step).max_steps
    if not cfg.train.get("branches"):
        return JobLength(n, fpt, steps, per_step, steps, steps, steps)
    branches = branch_plan(typed(TrainConfig, cfg.train), typed(OptimConfig, cfg.optim), steps, n, fpt, per_step)
    return JobLength(n, fpt, steps + sum(b.steps - b.start for b in branches), per_step,
                     sum(b.steps for b in branches), branches[0].steps, branches[-1].steps)


def dry_run(plan: dict, extra: list[str]) -> pd.DataFrame:
    """The jobs stage 1 and stage 2 launch, without training: per cell and stage, the jobs, their steps and
    tokens, the device minutes at the plan's tokens/s of each size alone on the device (dry_run.tokens_per_s),
    and the minutes the same points would take as separate runs (a WSD family's shared prefix trained once
    per branch), and the compute of each job's shortest and longest point (C_first, C_last: FLOPs per token x
    tokens). Widening adds one tuning job per edge."""
    speed = plan["dry_run"].get("tokens_per_s", {})
    rows = []
    for c in cells(plan):
        grid_points = math.prod(len(v) for v in c.grid.values())
        for stage, tuning, jobs in (("tune", True, grid_points * len(plan["tune_seeds"])),
                                    ("seeds", False, len(plan["seeds"]))):
            cfg = compose_cell(plan, extra, c, tuning)
            vocab = plan["dry_run"].get("vocab_size") or cfg.data.get("vocab_size")
            if not vocab:
                raise ConfigError(f"dry_run.vocab_size: data={cfg.data.name} takes its vocabulary from its files; "
                                  "state it in the plan")
            job = job_length(cfg, vocab)
            per_minute = speed[c.size] * 60 if c.size in speed else float("nan")
            tokens = job.steps * job.tokens_per_step
            rows.append({"variant": c.variant, "size": c.size, "N": job.n, "stage": stage, "jobs": jobs,
                         "steps_per_job": job.steps, "tokens_per_job": tokens, "minutes_per_job": tokens / per_minute,
                         "minutes": jobs * tokens / per_minute,
                         "minutes_if_separate": jobs * job.separate * job.tokens_per_step / per_minute,
                         "C_first": job.flops_per_token * job.first * job.tokens_per_step,
                         "C_last": job.flops_per_token * job.last * job.tokens_per_step})
    return pd.DataFrame(rows)


def compute_overlaps(table: pd.DataFrame) -> pd.DataFrame:
    """Per configuration, each pair of neighbouring sizes (by N) of its reported seeds (dry_run's table): the
    compute the smaller size's longest point trains over what the larger size's shortest point trains. Above
    1 the two sizes train overlapping compute, so approach 1 can measure where their loss curves cross
    (analysis/approach1.py); below, the crossover is an extrapolation."""
    rows = []
    for variant, g in table[table["stage"] == "seeds"].groupby("variant", sort=False):
        g = g.sort_values("N")
        for (_, small), (_, large) in zip(g.iterrows(), g.iloc[1:].iterrows()):
            rows.append({"variant": variant, "sizes": f"{small['size']}-{large['size']}",
                         "overlap": small["C_last"] / large["C_first"]})
    return pd.DataFrame(rows, columns=["variant", "sizes", "overlap"])


def main(argv: list[str] | None = None) -> None:
    """The command line (module docstring); a bad plan or setting is one line `error: ...` (run_command)."""
    p = argparse.ArgumentParser(prog="python tune.py", description=__doc__.splitlines()[0])
    p.add_argument("plan", type=Path, help="a ladder plan, e.g. ladders/cpu_tune.yaml")
    p.add_argument("overrides", nargs="*", help="run.py overrides for every run, e.g. data.path=/tmp/pycode8k")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their device minutes; train nothing")
    p.add_argument("--parallel", type=int, default=1, help="run.py multiruns at once (each may itself be parallel)")
    p.add_argument("--sizes", help="only these sizes of the plan, comma-separated (a slice)")
    p.add_argument("--variants", help="only these configurations of the plan, comma-separated (a slice)")
    args = p.parse_intermixed_args(argv)  # options before, between or after the run.py overrides
    plan = select(load_plan(args.plan), args.sizes, args.variants)
    if args.dry_run:
        table = dry_run(plan, args.overrides)
        with pd.option_context("display.width", 160, "display.max_columns", 20):
            print(table.drop(columns=["C_first", "C_last"]).to_string(index=False, float_format=lambda v: f"{v:,.1f}"))
        overlaps = compute_overlaps(table)
        if len(overlaps):
            print("approach 1, compute of a size's longest point over its larger neighbour's shortest (> 1: the "
                  "crossover is measured): " + "; ".join(f"{r.variant} {r.sizes} {r.overlap:.2f}"
                                                          for r in overlaps.itertuples()))
        tokens = (table["jobs"] * table["tokens_per_job"]).sum()
        minutes = (f"{table['minutes'].sum():,.0f} device minutes alone on the device (stage 1 "
                   f"{table[table.stage == 'tune']['minutes'].sum():,.0f}, stage 2 "
                   f"{table[table.stage == 'seeds']['minutes'].sum():,.0f}; as separate runs "
                   f"{table['minutes_if_separate'].sum():,.0f})" if table["minutes"].notna().all()
                   else "no device minutes (the plan's dry_run.tokens_per_s lacks a size)")
        print(f"{int(table['jobs'].sum())} jobs, {tokens:,.0f} tokens, {minutes}; each widened edge adds one "
              "tuning job")
        return
    report = tune(plan, args.overrides, args.parallel)
    if report is not None:
        print(report)


if __name__ == "__main__":
    run_command(main)
