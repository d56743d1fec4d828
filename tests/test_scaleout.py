"""Scale-out on 2 CPU processes (gloo), end to end through run.py: trainer=ddp and trainer=fsdp follow the
one-process curve over the same global batch (K3 default: optim=muon_per_head, balance=qb; fp32 with fp32
Newton-Schulz, to 1e-5), an FSDP run killed by SIGKILL after a sharded checkpoint resumes on the
uninterrupted run's curve, and a DDP multirun runs each of its configs once."""
import itertools
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from test_train import corpus, overrides, rows, run_cli, run_inprocess  # noqa: F401  (corpus: a fixture)

# seed 1: at seed 0 one token of the last MoE layer sits within fp32 rounding of a top-k tie, which one process
# and two break differently (a 9e-5 change of that layer's experts after 8 steps), which says nothing of DDP
STEPS = ["train.max_steps=8", "train.val_every=4", "train.ckpt_every=4", "optim.warmup_steps=2",
         "optim.ns_dtype=fp32", "seed=1"]
TWO_CPUS = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]
KEYS = ("loss/train", "loss/val", "optim/grad_norm")


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the workers run.py starts read it too
        mp.setenv("K3LAB_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        yield


_LAUNCHES = itertools.count()


def own_port() -> dict:
    """The environment of one 2-process launch with a rendezvous port of its own: below the kernel's
    ephemeral range (32768 and up on Linux), where the ports that Lightning and the other tests take by
    binding port 0 never fall, and distinct per xdist worker and per launch, so that two runs started at
    once (on two workers, or a killed run and its resumption) never meet at one rendezvous."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    return {**os.environ, "MASTER_PORT": str(21000 + 500 * worker + next(_LAUNCHES))}


def run_two(args: list[str], name: str) -> str:
    proc = run_cli([*args, *TWO_CPUS, f"run_name={name}"], env=own_port())
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log
    return log


@pytest.fixture(scope="module")
def runs(corpus, out) -> dict[str, Path]:
    """One process with batch 8, and DDP and FSDP with batch 4 on each of 2 processes: the same global batch."""
    run_inprocess(overrides(corpus, out, *STEPS, "data.batch_size=8", "run_name=single"))
    for trainer in ("ddp", "fsdp"):
        log = run_two(overrides(corpus, out, *STEPS, f"trainer={trainer}"), trainer)
        assert log.count("done:") == 1 and log.count("step 8/8") == 1, log  # rank 0 alone prints
    return {name: out / "default" / name for name in ("single", "ddp", "fsdp")}


def curve(run_dir: Path) -> dict[tuple[int, str], float]:
    return {(r["step"], k): r[k] for r in rows(run_dir) for k in KEYS if k in r}


def max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(abs(got[k] - want[k]) for k in want)


def weights(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model state of checkpoints/last.ckpt: a file, or a sharded directory gathered into one."""
    if ckpt.is_dir():
        dcp_to_torch_save(ckpt, tmp / "gathered.pt")
        ckpt = tmp / "gathered.pt"
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


def test_ddp_and_fsdp_follow_the_one_process_curve(runs, tmp_path):
    want = curve(runs["single"])
    assert len(want) == 8 + 3 + 8  # train loss and grad norm at steps 1-8, validation at 0, 4, 8
    single = weights(runs["single"] / "checkpoints" / "last.ckpt", tmp_path)
    for name in ("ddp", "fsdp"):
        summary = json.loads((runs[name] / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["tokens"] == 8 * 8 * 32, summary
        diff = max_diff(curve(runs[name]), want)
        assert diff < 1e-5, (name, diff)
        final = weights(runs[name] / "checkpoints" / "last.ckpt", tmp_path)
        assert final.keys() == single.keys()
        w_diff = max((final[k].double() - single[k].double()).abs().max().item() for k in single)
        bias = [k for k in single if k.endswith("router.bias")]
        assert bias and all(single[k].abs().sum() > 0 for k in bias)  # QB moved every router bias
        assert w_diff < 1e-5, (name, w_diff)  # every weight and router bias, after 8 steps
        print(f"{name}: max |curve diff| {diff:.2e}, max |weight or bias diff| {w_diff:.2e}")
    ckpt = runs["fsdp"] / "checkpoints"
    assert (ckpt / "last.ckpt").is_symlink() and len(list(ckpt.iterdir())) == 2  # the link and one directory
    assert sorted(p.name for p in (ckpt / "last.ckpt").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                      "meta.pt"]


def test_fsdp_killed_after_a_checkpoint_resumes_on_the_uninterrupted_curve(runs, corpus, out):
    victim = run_cli([*overrides(corpus, out, *STEPS, "trainer=fsdp"), *TWO_CPUS, "run_name=killed"],
                     start_new_session=True, env=own_port())
    killed = out / "default" / "killed"
    ckpt = killed / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not ckpt.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ckpt.exists(), victim.communicate()[0]
    os.killpg(victim.pid, signal.SIGKILL)  # both ranks at once, as a lost node or a scheduler would
    victim_log = victim.communicate()[0]
    status = json.loads((killed / "summary.json").read_text())["status"]
    assert status == "running", f"status {status!r} after the kill; the victim's output:\n{victim_log}"

    resumed = run_cli([f"resume={killed}", f"out_dir={out}"], env=own_port())
    log = resumed.communicate(timeout=600)[0]
    both = f"victim's output:\n{victim_log}\nresumed run's output:\n{log}"
    assert resumed.returncode == 0 and "resuming" in log and "from step 4" in log, both
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 8, (summary, both)
    got, whole = curve(killed), curve(runs["fsdp"])
    diff = max_diff(got, whole)  # every step logged once, as in the uninterrupted run
    assert diff < 1e-5, (diff, both)
    print(f"fsdp resumed after SIGKILL: max |curve diff| to the uninterrupted fsdp run {diff:.2e}")
    assert len(list((killed / "checkpoints").iterdir())) == 2  # a torn or older shard directory is gone


def test_ddp_multirun_runs_each_config_once(corpus, tmp_path):
    """Lightning re-runs sys.argv to start rank 1; in a multirun that was the whole sweep, so every worker
    ran the sweep again and printed a second table. Each worker now runs its one job."""
    proc = run_cli(["-m", *overrides(corpus, tmp_path, "train.max_steps=2", "train.val_every=2",
                                     "trainer=ddp", "group=sweep"), *TWO_CPUS, "seed=0,1"])
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log
    assert len(re.findall(r"\d+ completed, \d+ skipped, \d+ failed", log)) == 1, log  # one sweep table: rank 0's
    assert "2 completed, 0 skipped, 0 failed" in log, log
    assert log.count("k3lab run ->") == 2 and log.count("done:") == 2, log
    run_dirs = [p.parent for p in (tmp_path / "sweep").glob("*/summary.json")]
    summaries = sorted(((json.loads((d / "summary.json").read_text()), d) for d in run_dirs), key=lambda s: s[0]["seed"])
    assert [s["seed"] for s, _ in summaries] == [0, 1], run_dirs  # one directory per config
    for summary, run_dir in summaries:
        assert (summary["status"], summary["outcome"], summary["steps"]) == ("completed", "new", 2), summary
        assert [r["step"] for r in rows(run_dir) if "loss/train" in r] == [1, 2]  # trained once


def test_sharded_checkpoint_is_published_in_one_rename(tmp_path):
    """last.ckpt is a symlink to a finished shard directory: publishing a new one swaps the link and
    removes the older directory and any torn by a kill mid-write; the step is read from meta.pt alone;
    a new run removes the link with every shard directory; resume=last finds the link."""
    from omegaconf import OmegaConf

    from k3lab.rundir import checkpoint_step, checkpoint_version, find_resume_dir, publish_checkpoint, \
        remove_checkpoint

    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    link = ckpt / "last.ckpt"
    for step in (4, 8):
        target = ckpt / checkpoint_version(link, step)
        target.mkdir()
        torch.save({"global_step": step}, target / "meta.pt")
        (ckpt / checkpoint_version(link, step)).mkdir()  # a later save at the same step, torn by a kill
        publish_checkpoint(link, target)
        assert os.readlink(link) == f"last.ckpt.{step:08d}-0" and checkpoint_step(link) == step
        assert sorted(p.name for p in ckpt.iterdir()) == ["last.ckpt", f"last.ckpt.{step:08d}-0"]
    assert find_resume_dir(str(tmp_path), "last") == tmp_path / "run"
    remove_checkpoint(link)
    assert list(ckpt.iterdir()) == []
