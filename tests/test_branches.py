"""Cooldown branches of a WSD trunk (k3lab/branches.py), trained through k3lab.train.train_job as run.py trains
a job: the trunk keeps a checkpoint and a validation at every branch point; a branch is exactly the WSD run of
its budget (the same losses at every step as a run trained alone from step 0), its rows up to the branch point
are the trunk's, its learning rate is the trunk's up to there and then decays; summary.json counts the shared
prefix once; the same command again skips every completed run and resumes a killed one onto the uninterrupted
curves; a branch whose trunk has no checkpoint at its branch point stops with one line naming the trunk.

Killed runs are SIGKILLs of a forkserver child that trains the job (as tests/test_faults.py). Tiny model, byte
tokenizer, budgets in steps: a trunk of 10 steps with branches at 5 and 10 steps, decay_frac 0.4, so the
branches start from steps 3 and 6.
"""
import json
import multiprocessing
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from k3lab.branches import TrunkNotReady, branch_plan
from k3lab.config import OptimConfig
from k3lab.errors import ConfigError
from k3lab.lit import K3LitModule
from k3lab.optim import lr_lambda
from k3lab.train import train, train_job
from test_faults import base, one_thread  # noqa: F401 - fixtures: a corpus of six documents, one CPU thread

ROOT = Path(__file__).resolve().parents[1]
# one thread: the same computation in the same order whatever the machine's load (k3lab.rundir.cpu_threads)
FAST = ["trainer.threads=1", "model.n_layers=4",
        "model.d_model=64", "model.head_dim=32", "data.seq_len=32", "data.batch_size=4",
        "data.val_tokens=256", "train.log_every=1", "optim.warmup_steps=2", "data.tokenizer=byte"]
FAMILY = ["optim.schedule=wsd", "optim.decay_frac=0.4", "train.max_steps=10", "train.branches=[5,10]",
          "train.val_every=5", "train.ckpt_every=2"]
POINTS = {5: 3, 10: 6}  # budget (steps) -> branch point: 5 - round(0.4 * 5), 10 - round(0.4 * 10)
CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["k3lab.train"])
# The same computation in the same order on one CPU thread gives the same numbers; 1e-5 leaves room for the
# last bits of a float32 loss printed through JSON (as tests/test_faults.py)
SAME = 1e-5


def args(base: Path, out: Path, *extra: str) -> list[str]:
    return ["data=text", f"data.path={base / 'corpus'}", f"++data.cache_dir={base / 'cache'}", f"out_dir={out}",
            *FAST, *extra]


def compose_args(overrides: list[str]):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def job(overrides: list[str]) -> dict:
    return train_job(compose_args(overrides), overrides)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, key) -> loss; asserts that no step logs a loss twice."""
    points = [((r["step"], k), r[k]) for r in rows(run_dir) for k in ("loss/train", "loss/val") if k in r]
    assert len(points) == len(dict(points)), f"{run_dir}: a step logged twice"
    return dict(points)


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) < SAME, (key, got[key], value)


@pytest.fixture(scope="module")
def family(base, tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted trunk and its two branches: run name -> run directory."""
    out = tmp_path_factory.mktemp("family")
    summary = job(args(base, out, *FAMILY, "run_name=t"))
    assert [(name, outcome) for name, outcome, _ in summary["branches"]] == [("t,branch=5", "new"),
                                                                            ("t,branch=10", "new")]
    return {name: out / "default" / name for name in ("t", "t,branch=5", "t,branch=10")}


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_the_trunk_keeps_and_validates_every_branch_point_at_the_peak_rate(family):
    trunk = family["t"]
    assert sorted(p.name for p in (trunk / "checkpoints").glob("branch-*")) == ["branch-3.ckpt", "branch-6.ckpt"]
    for step in POINTS.values():
        assert torch.load(trunk / "checkpoints" / f"branch-{step}.ckpt", weights_only=False)["global_step"] == step
    val_steps = [r["step"] for r in rows(trunk) if "loss/val" in r]
    assert val_steps == [0, 3, 5, 6, 10]  # every val_every, every branch point and budget end, once
    lrs = [r["optim/lr"] for r in rows(trunk) if "optim/lr" in r]  # logged after each step: the next step's rate
    assert lrs == [OptimConfig.lr] * 10  # warmed up after 2 steps, then the stable phase to the end: no decay
    s = summary_of(trunk)
    assert (s["branches"], s["branch_steps"], s.get("trunk")) == ([5, 10], [3, 6], None)
    assert s["steps_trained"] == s["steps"] == 10 and s["flops_trained"] == s["flops"]


@pytest.mark.parametrize("budget", [5, 10])
def test_a_branch_is_the_wsd_run_of_its_budget(base, family, tmp_path, budget):
    """A WSD run of the budget's length trained alone from step 0 (same seed, same warm-up) has the branch's
    losses at every step: the trunk's prefix and the branch's decay add up to that run exactly."""
    alone = job(args(base, tmp_path, "optim.schedule=wsd", "optim.decay_frac=0.4", f"train.max_steps={budget}",
                     "train.val_every=5", "train.ckpt_every=2", "run_name=alone"))
    got = losses(family[f"t,branch={budget}"])
    want = losses(tmp_path / "default" / "alone")
    extra = {k for k in got if k[1] == "loss/val" and k[0] % 5}  # the trunk validated at its branch points too
    assert_same({k: v for k, v in got.items() if k not in extra}, want)
    assert alone["loss_val_final"] == pytest.approx(summary_of(family[f"t,branch={budget}"])["loss_val_final"],
                                                    abs=SAME)


@pytest.mark.parametrize("budget", [5, 10])
def test_a_branch_starts_from_the_trunk_and_counts_its_prefix_once(family, budget):
    start = POINTS[budget]
    branch, trunk = family[f"t,branch={budget}"], family["t"]
    assert [r for r in rows(branch) if r["step"] <= start] == [r for r in rows(trunk) if r["step"] <= start]
    assert max(r["step"] for r in rows(branch)) == budget
    factor = lr_lambda(2, budget, OptimConfig.min_lr_ratio, "wsd", budget - start, "sqrt")
    for r in rows(branch):
        if "optim/lr" in r:  # the rate of step r["step"] (0-based): the trunk's up to the branch point, then the decay
            assert r["optim/lr"] == pytest.approx(OptimConfig.lr * factor(r["step"]), rel=1e-12), r["step"]
    s, t = summary_of(branch), summary_of(trunk)
    assert (s["trunk"], s["branch_step"], s["steps"], s["steps_trained"]) == ("t", start, budget, budget - start)
    assert s["shared_prefix_tokens"] == start * s["tokens_per_step"]
    assert s["shared_prefix_flops"] + s["flops_trained"] == pytest.approx(s["flops"], rel=1e-12)
    assert (branch / "overrides.yaml").read_text() == (trunk / "overrides.yaml").read_text()  # the command making it


def test_the_same_command_again_skips_the_trunk_and_every_branch(base, family):
    before = {name: summary_of(d) for name, d in family.items()}
    summary = job(args(base, family["t"].parent.parent, *FAMILY, "run_name=t"))
    assert summary["outcome"] == "skip" and [o for _, o, _ in summary["branches"]] == ["skip", "skip"]
    assert {name: summary_of(d) for name, d in family.items()} == before


# -- a branch killed mid-decay, a trunk killed between its branch points ------------------------------------

def _kill_in(run_name: str, step: int) -> None:
    original = K3LitModule.on_train_batch_end

    def hooked(self, outputs, batch, batch_idx):
        original(self, outputs, batch, batch_idx)
        if self.global_step == step and Path(self.trainer.default_root_dir).name == run_name:
            os.kill(os.getpid(), signal.SIGKILL)

    K3LitModule.on_train_batch_end = hooked


def _child(overrides: list[str], run_name: str, step: int) -> None:
    torch.set_num_threads(1)
    _kill_in(run_name, step)
    train_job(compose_args(overrides), overrides)


@pytest.mark.parametrize("run_name, step, outcomes", [
    ("t,branch=10", 8, ("skip", "skip", "resume")),  # mid-decay (6 -> 10), after its checkpoint at 8
    ("t", 4, ("resume", "new", "new")),              # between branch points 3 and 6
])
def test_a_killed_job_run_again_ends_on_the_uninterrupted_curves(base, family, tmp_path, run_name, step, outcomes):
    overrides = args(base, tmp_path, *FAMILY, "run_name=t")
    proc = CTX.Process(target=_child, args=(overrides, run_name, step))
    proc.start()
    proc.join(300)
    assert proc.exitcode == -signal.SIGKILL, f"the kill in {run_name} at step {step} did not fire ({proc.exitcode})"
    killed = tmp_path / "default" / run_name
    assert summary_of(killed)["status"] == "running"
    summary = job(overrides)
    assert (summary["outcome"], *(o for _, o, _ in summary["branches"])) == outcomes
    for name, reference in family.items():
        run_dir = tmp_path / "default" / name
        assert summary_of(run_dir)["status"] == "completed"
        assert_same(losses(run_dir), losses(reference))


# -- what a branch needs, and what a trunk can give -----------------------------------------------------------

def test_a_branch_whose_trunk_lacks_its_branch_point_stops_with_one_line(base, family):
    out = family["t"].parent.parent
    branch = args(base, out, "optim.schedule=wsd", "optim.decay_frac=0.4", "train.max_steps=15", "train.trunk=t",
                  "run_name=b15")
    with pytest.raises(TrunkNotReady, match=r"has no checkpoint at this branch's branch point, step 9 \(it keeps "
                                            r"\[3, 6\]\): train the trunk first") as err:
        train(compose_args(branch), branch)
    assert "\n" not in str(err.value)
    assert summary_of(out / "default" / "b15")["status"] == "failed"
    missing = args(base, out, "optim.schedule=wsd", "train.max_steps=15", "train.trunk=nowhere", "run_name=b")
    with pytest.raises(TrunkNotReady, match="train.trunk=nowhere: no run directory"):
        train(compose_args(missing), missing)
    assert not (out / "default" / "b").exists()


@pytest.mark.parametrize("length, branches, warmup, message", [
    ("max_steps=20", "[10,30]", 2, "budget 30 (30 steps) branches at step 24, past the trunk's end at step 20"),
    ("max_steps=20", "[4,20]", 3, "budget 4 lasts 4 steps and decays from step 3, too short for the trunk's warm-up"),
    ("max_steps=20", "[10,10.5]", 2, "train.branches: 10.5 is not a whole number of steps"),
    ("tokens_per_param=2.5", "[2.47,2.5]", 2, "the budgets 2.47 and 2.5 both last 20 steps"),  # 1,000 x 2.5 / 128
])
def test_a_trunk_refuses_branches_it_cannot_give(length, branches, warmup, message):
    """1,000 parameters, 128 tokens a step; the trunk lasts 20 steps."""
    train_cfg = compose_args([f"train.{length}", f"train.branches={branches}"]).train
    optim = OptimConfig(schedule="wsd", decay_frac=0.2, warmup_steps=warmup)
    with pytest.raises(ConfigError, match=re.escape(message)):
        branch_plan(train_cfg, optim, 20, 1000, 1.0, 128)


def test_a_trunk_may_end_at_its_last_branch_point():
    """Budgets in tokens per parameter: 1,000 parameters, 128 tokens a step; a trunk of 125 steps (16 tokens
    per parameter) reaches the branch point of 20 (157 steps, decaying from 126) only if it is 126 long."""
    train_cfg = compose_args(["train.tokens_per_param=16", "train.branches=[5,10,20]"]).train
    optim = OptimConfig(schedule="wsd", decay_frac=0.2, warmup_steps=2)
    with pytest.raises(ConfigError, match="past the trunk's end at step 125"):
        branch_plan(train_cfg, optim, 125, 1000, 1.0, 128)
    plan = branch_plan(train_cfg, optim, 126, 1000, 1.0, 128)
    assert [(b.budget, b.steps, b.start) for b in plan] == [(5, 40, 32), (10, 79, 63), (20, 157, 126)]
