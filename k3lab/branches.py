"""Cooldown branches of the WSD schedule: one stable trunk, one decay per budget (docs/schedules.md).

A run with optim.schedule=wsd and `train.branches` listing budgets D_1, D_2, ... (in the unit of its
run-length key, k3lab/budget.py: tokens per parameter, FLOPs, or steps) is a *trunk*. It warms up and then
holds the peak rate to its own end (the stable phase alone, no decay). Budget D_i lasts T_i steps (the run
length with the length key set to D_i) and decays over its last K_i = round(decay_frac * T_i) steps, so it
branches from the trunk at b_i = T_i - K_i. The trunk validates at every b_i and every T_i it reaches, and
after the validation of step b_i writes checkpoints/branch-<b_i>.ckpt (k3lab.rundir.branch_checkpoint), kept
beside last.ckpt.

A *branch* is a run of its own, in a directory beside its trunk's named `<trunk>,branch=<D_i>`: the trunk's
config with the length key set to D_i, `train.trunk` naming the trunk, and the trunk's warm-up in steps. A
new or restarted branch starts from the trunk's checkpoint at b_i: weights, optimizer state, the schedule's
position and the data's (batches are a function of seed and step), so at every step s <= b_i its learning
rate is the trunk's, and from b_i it decays to T_i. Its metrics.jsonl begins with the trunk's rows up to b_i
(the shared prefix, copied), so its directory alone holds its whole curve; summary.json names the trunk and
the branch point (`trunk`, `branch_step`) and counts what the run itself trained (`steps_trained`,
`flops_trained`), so that a sweep counts the shared prefix once. Killed, a branch resumes from its own
last.ckpt like any run.

One job trains a trunk and then each of its branches (k3lab.train.train_job), in order: a branch never waits
for its trunk, whichever launcher runs jobs in parallel, and a sweep of sizes x seeds with `train.branches`
is one command that, run again, skips the runs that completed and resumes the one that was killed. A branch
run on its own (its command names `train.trunk`) whose trunk has no checkpoint at its branch point stops with
one line naming the trunk.

Sources: the WSD schedule and branching from its stable phase, Hu et al. (MiniCPM, arXiv:2404.06395) and
Wen et al. (arXiv:2410.05192); cooldowns of about 20% matching a cosine of the same length, Hagele et al.
(arXiv:2405.18392).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from k3lab.budget import LENGTH_KEYS, length_key, run_length
from k3lab.config import OptimConfig, TrainConfig, typed
from k3lab.errors import ConfigError, UserError
from k3lab.fileio import atomic_write_text
from k3lab.optim import decay_steps, warmup_steps
from k3lab.rundir import branch_checkpoint, branch_checkpoint_steps, read_metrics


class Branch(NamedTuple):
    """One cooldown branch of a trunk: its budget (in the length key's unit), its length and its branch point."""
    budget: float
    steps: int    # T_i
    start: int    # b_i = T_i - round(decay_frac * T_i): the trunk's step it starts from


class TrunkNotReady(UserError):
    """A branch's trunk holds no checkpoint at the branch's branch point."""


def branch_length_key(train: TrainConfig) -> str:
    """The key a branch sets to its budget: the trunk's length key (max_steps when the trunk took default_steps)."""
    key = length_key(train)
    return "max_steps" if key == "default_steps" else key


def budget_value(key: str, budget: float) -> int | float:
    """A budget as the length key takes it (a whole number of steps for max_steps)."""
    if key != "max_steps":
        return budget
    if not float(budget).is_integer():
        raise ConfigError(f"train.branches: {budget} is not a whole number of steps (the trunk's length is "
                          "train.max_steps or train.default_steps, so its budgets are steps)")
    return int(budget)


def trunk_warmup(optim: OptimConfig, trunk_steps: int) -> int:
    """The trunk's warm-up in steps as its schedule takes it (k3lab.optim.lr_lambda: at most half the run)."""
    return min(warmup_steps(optim, trunk_steps), trunk_steps // 2)


def stable_phase(optim: OptimConfig) -> OptimConfig:
    """The trunk's optimizer settings: the WSD schedule without its decay (the branches decay)."""
    return dataclasses.replace(optim, decay_frac=0.0)


def branch_plan(train: TrainConfig, optim: OptimConfig, trunk_steps: int, params_active_non_embedding: int,
                flops_per_token: float, tokens_per_step: int) -> list[Branch]:
    """The branches of a trunk of `trunk_steps` steps, shortest first. ConfigError (one line) when a budget's
    branch point lies past the trunk's end or inside its warm-up, when a branch is shorter than twice the
    warm-up (its schedule would shorten the warm-up: lr_lambda), or when two budgets give the same length."""
    key = branch_length_key(train)
    warmup = trunk_warmup(optim, trunk_steps)
    trunk_length = f"train.{length_key(train)}={getattr(train, length_key(train))}"
    plan: dict[int, Branch] = {}
    for budget in sorted(train.branches):
        rule = OmegaConf.create({k: None for k in LENGTH_KEYS} | {key: budget_value(key, budget)})
        steps = run_length(rule, params_active_non_embedding, flops_per_token, tokens_per_step).max_steps
        start = steps - decay_steps(optim, steps)
        if steps in plan:
            raise ConfigError(f"train.branches: the budgets {plan[steps].budget:g} and {budget:g} both last "
                              f"{steps} steps; drop one")
        if start > trunk_steps:
            raise ConfigError(f"train.branches: budget {budget:g} ({steps} steps) branches at step {start}, past "
                              f"the trunk's end at step {trunk_steps} ({trunk_length}): lengthen the trunk or "
                              "drop the budget")
        if start < warmup or warmup > steps // 2:
            raise ConfigError(f"train.branches: budget {budget:g} lasts {steps} steps and decays from step {start}, "
                              f"too short for the trunk's warm-up of {warmup} steps (at most half a branch): "
                              "shorten the warm-up (optim.warmup_frac, optim.warmup_steps) or drop the budget")
        plan[steps] = Branch(budget, steps, start)
    return list(plan.values())


def branch_name(trunk: str, budget: float) -> str:
    return f"{trunk},branch={budget:g}"


def branch_run(trunk_dir: Path, trunk_summary: dict, budget: float, trunk_overrides: list[str],
               overwrite: bool) -> tuple[DictConfig, list[str]]:
    """A branch's config, from its trunk's config.yaml, and the command-line overrides that compose the same
    config (the trunk's, then the branch's keys), which the ranks a multi-process run starts are given."""
    saved = OmegaConf.load(Path(trunk_dir) / "config.yaml")
    key = branch_length_key(saved.train)
    value = budget_value(key, budget)
    warmup = trunk_warmup(typed(OptimConfig, saved.optim), trunk_summary["max_steps"])
    name = branch_name(saved.run_name, budget)
    cfg = OmegaConf.merge(saved, {"train": {key: value, "branches": None, "trunk": saved.run_name},
                                  "optim": {"warmup_steps": warmup, "warmup_frac": None},
                                  "run_name": name, "overwrite": overwrite, "resume": None})
    keys = [f"train.{key}={value}", "train.branches=null", f"train.trunk='{saved.run_name}'",
            f"optim.warmup_steps={warmup}", "optim.warmup_frac=null", f"run_name='{name}'"]
    own = {o.split("=", 1)[0] for o in keys}
    return cfg, [o for o in trunk_overrides if o.split("=", 1)[0].lstrip("+~") not in own] + keys


def start_from_trunk(run_dir: Path, trunk: str, start: int) -> tuple[Path, float]:
    """A new or restarted branch: the trunk's checkpoint at branch point `start`, after rank 0 wrote the
    trunk's metrics rows up to `start` as the branch's metrics.jsonl; also the training time those rows took
    (the branch's clocks continue from it)."""
    trunk_dir = Path(run_dir).parent / trunk
    ckpt = branch_checkpoint(trunk_dir, start)
    if not ckpt.exists():
        kept = branch_checkpoint_steps(trunk_dir)
        raise TrunkNotReady(f"train.trunk={trunk}: the trunk {trunk_dir} has no checkpoint at this branch's branch "
                            f"point, step {start} (it keeps {kept or 'none'}): train the trunk first, with this "
                            "budget in its train.branches (its command trains its branches after it)")
    rows = [r for r in read_metrics(trunk_dir) if r["step"] <= start]
    if rank_zero_only.rank == 0:
        atomic_write_text(Path(run_dir) / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    elapsed = max((r["time/elapsed_s"] for r in rows if r.get("time/elapsed_s") is not None), default=0.0)
    return ckpt, elapsed


class KeepBranchPoints(Callback):
    """The trunk's checkpoint at each branch point: checkpoints/branch-<step>.ckpt, written after the step's
    validation (k3lab.train validates at every branch point), so the trunk's metrics rows up to the step are
    on disk whenever the checkpoint is. Lightning runs checkpoint callbacks (last.ckpt) after the others, so
    a run killed between the two saves resumes before the step and writes this one again. A branch point at
    the trunk's last step is kept by k3lab.train after its final checkpoint."""

    def __init__(self, run_dir: Path, steps: list[int]):
        self.run_dir = Path(run_dir)
        self.steps = set(steps)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and trainer.global_step in self.steps:
            trainer.save_checkpoint(branch_checkpoint(self.run_dir, trainer.global_step))
