"""Faults a run must survive: killed at any point (before its first checkpoint, at a random step, while
writing a checkpoint or a metrics line, during a validation, while building the token cache), damaged
files (a truncated checkpoint, a damaged tokenizer cache), a full disk, and two processes aimed at one
run directory. Each case must end in a clear state and lose nothing that was complete: the run, run
again with the same command, ends on the curve of an uninterrupted run, with every step logged once and
no half-written file left behind.

Killed runs are real SIGKILLs of a training process, at a point chosen by a fault built into it. The
processes come from a forkserver that has imported k3lab.train once (a fork of this process, which has
run torch ops, could hang in torch's thread pool), so each costs a fraction of a second, not an import.
Tiny model, byte tokenizer (where the tokenizer is not the point), 8 steps, one torch thread (two threads
on two busy cores spin more than they compute).
"""
import errno
import io
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from k3lab.config import DataConfig
from k3lab.data import datamodule, tokenizer
from k3lab.fileio import TEMP_GLOB
from k3lab.lit import K3LitModule
from k3lab.rundir import JsonlLogger, RunDirBusy, UnreadableCheckpoint, read_summary
from k3lab.train import train

ROOT = Path(__file__).resolve().parents[1]
# one thread: the same computation in the same order whatever the machine's load (k3lab.rundir.cpu_threads)
FAST = ["trainer.threads=1", "model.n_layers=4",
        "model.d_model=64", "model.head_dim=32", "data.seq_len=32", "data.batch_size=4",
        "data.val_tokens=256", "train.log_every=1", "optim.warmup_steps=2", "data.tokenizer=byte"]
STEPS = ["train.max_steps=8", "train.val_every=4", "train.ckpt_every=2"]  # checkpoints at 2, 4, 6, 8; validation at 0, 4, 8
CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["k3lab.train"])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A folder with the corpus (6 small documents) and the token cache every run of this module shares."""
    root = tmp_path_factory.mktemp("faults")
    (root / "corpus").mkdir()
    for d in range(6):
        (root / "corpus" / f"doc{d}.txt").write_text(
            " ".join(f"line {j} of document {d} says {(j * 7) % 13}." for j in range(300)))
    return root


def run_args(base: Path, out: Path, name: str, cache: Path | None = None) -> list[str]:
    """The command line of run `name` under `out`; the token cache is `cache` or the module's."""
    return ["data=text", f"data.path={base / 'corpus'}", f"++data.cache_dir={cache or base / 'cache'}",
            f"out_dir={out}", *FAST, *STEPS, f"run_name={name}"]


def compose_args(args: list[str]):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=args)


def run(args: list[str]) -> dict:
    return train(compose_args(args), overrides=args)


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> Path:
    """The run directory of the uninterrupted run that every case must end up equal to."""
    out = tmp_path_factory.mktemp("reference")
    run(run_args(base, out, "whole"))
    return out / "default" / "whole"


# -- faults built into a training process ------------------------------------------------------------

def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after_step(step: int, action) -> None:
    original = K3LitModule.on_train_batch_end

    def hooked(self, outputs, batch, batch_idx):
        original(self, outputs, batch, batch_idx)
        if self.global_step == step:
            action()

    K3LitModule.on_train_batch_end = hooked


def _fault(name: str, arg, events) -> None:
    if name == "kill_after_step":
        _after_step(arg, _kill)
    elif name == "kill_in_validation":
        original = K3LitModule.validation_step

        def validation_step(self, batch, batch_idx):
            if self.global_step == arg and batch_idx == 1:
                _kill()
            return original(self, batch, batch_idx)

        K3LitModule.validation_step = validation_step
    elif name == "kill_writing_checkpoint":  # a slow save: half of the bytes are on disk when the kill comes
        real_save, calls = torch.save, []

        def half_save(obj, f, *a, **kw):
            calls.append(1)
            if len(calls) < arg:
                return real_save(obj, f, *a, **kw)
            buf = io.BytesIO()
            real_save(obj, buf)
            f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
            f.flush()
            _kill()

        torch.save = half_save
    elif name == "kill_writing_metrics":
        original = JsonlLogger.log_metrics

        def log_metrics(self, metrics, step=None):
            if step == arg and "loss/train" in metrics:
                line = json.dumps({"step": step, "loss/train": float(metrics["loss/train"])})
                with open(self.run_dir / "metrics.jsonl", "a") as f:
                    f.write(line[:len(line) // 2])
                _kill()
            return original(self, metrics, step)

        JsonlLogger.log_metrics = log_metrics
    elif name == "kill_writing_cache":
        def half_save(f, array, *a, **kw):
            f.write(b"\x93NUMPY half")
            f.flush()
            _kill()

        np.save = half_save
    elif name == "pause_after_step":  # events: (paused, go)
        def pause():
            events[0].set()
            events[1].wait(120)

        _after_step(arg, pause)


def _child(args: list[str], fault: str, arg=None, events=()) -> None:
    """A training process with a fault built in (runs in a forkserver child)."""
    torch.set_num_threads(1)
    _fault(fault, arg, events)
    train(compose_args(args), overrides=args)


def in_child(args: list[str], fault: str, arg=None, events=()) -> multiprocessing.Process:
    proc = CTX.Process(target=_child, args=(args, fault, arg, events))
    proc.start()
    return proc


def killed(args: list[str], fault: str, arg=None) -> None:
    proc = in_child(args, fault, arg)
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL, f"the fault {fault}({arg}) did not fire (exit code {proc.exitcode})"


# -- what a clean end looks like ---------------------------------------------------------------------

def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_curve(run_dir: Path, reference: Path) -> None:
    """Every line of metrics.jsonl parses, each (step, loss) is logged once, and the losses are the
    uninterrupted run's."""
    def curve(d):
        points = [((r["step"], k), r[k]) for r in rows(d) for k in ("loss/train", "loss/val") if k in r]
        assert len(points) == len(dict(points)), f"{d}: a step logged twice"
        return dict(points)

    got, want = curve(run_dir), curve(reference)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) < 1e-5, (key, got[key], value)


def temp_files(folder: Path) -> list[Path]:
    return [p for d in (folder, folder / "checkpoints") for p in d.glob(TEMP_GLOB)]


def assert_completed_cleanly(summary: dict, run_dir: Path, reference: Path) -> None:
    assert summary["status"] == "completed" and summary["steps"] == 8, summary
    assert read_summary(run_dir) == summary
    assert_same_curve(run_dir, reference)
    assert not temp_files(run_dir), temp_files(run_dir)
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 8


def checkpoint_step(run_dir: Path) -> int:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]


# -- kills -------------------------------------------------------------------------------------------

def test_killed_before_its_first_checkpoint_restarts_from_step_0(base, reference, tmp_path):
    args = run_args(base, tmp_path, "r")
    run_dir = tmp_path / "default" / "r"
    killed(args, "kill_after_step", 1)
    assert read_summary(run_dir)["status"] == "running" and not (run_dir / "checkpoints" / "last.ckpt").exists()
    summary = run(args)
    assert summary["outcome"] == "restart"
    assert_completed_cleanly(summary, run_dir, reference)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_killed_at_a_random_step_the_same_command_ends_on_the_same_curve(base, reference, tmp_path, seed):
    step = random.Random(seed).randint(1, 7)
    args = run_args(base, tmp_path, "r")
    killed(args, "kill_after_step", step)
    summary = run(args)
    assert summary["outcome"] == ("resume" if step >= 2 else "restart"), step
    assert_completed_cleanly(summary, tmp_path / "default" / "r", reference)


def test_killed_while_writing_a_checkpoint_keeps_the_previous_one(base, reference, tmp_path):
    args = run_args(base, tmp_path, "r")
    run_dir = tmp_path / "default" / "r"
    killed(args, "kill_writing_checkpoint", 3)  # the third save: step 6
    assert checkpoint_step(run_dir) == 4  # the checkpoint before it, whole
    assert [p.name.split(".tmp")[0] for p in temp_files(run_dir)] == [".last.ckpt"]  # the half-written one
    summary = run(args)
    assert summary["outcome"] == "resume"
    assert_completed_cleanly(summary, run_dir, reference)  # the half checkpoint is gone too


def test_killed_during_a_validation_validates_that_step_again(base, reference, tmp_path):
    """The checkpoint of a step that validates is written after the validation: killed during it, the
    run resumes from the checkpoint before and the curve keeps that validation."""
    args = run_args(base, tmp_path, "r")
    run_dir = tmp_path / "default" / "r"
    killed(args, "kill_in_validation", 4)
    assert checkpoint_step(run_dir) == 2
    summary = run(args)
    assert summary["outcome"] == "resume"
    assert_completed_cleanly(summary, run_dir, reference)
    assert [r["step"] for r in rows(run_dir) if "loss/val" in r] == [0, 4, 8]


def test_killed_while_writing_a_metrics_line_drops_the_half_line(base, reference, tmp_path):
    args = run_args(base, tmp_path, "r")
    run_dir = tmp_path / "default" / "r"
    killed(args, "kill_writing_metrics", 5)
    last = (run_dir / "metrics.jsonl").read_text().splitlines()[-1]
    with pytest.raises(json.JSONDecodeError):
        json.loads(last)
    summary = run(args)
    assert_completed_cleanly(summary, run_dir, reference)  # every line parses: the half line went with the resume


def test_killed_while_writing_the_token_cache_builds_it_again(base, reference, tmp_path):
    cache = tmp_path / "cache"
    args = run_args(base, tmp_path, "r", cache=cache)
    killed(args, "kill_writing_cache")
    [entry] = (cache / "lm").iterdir()
    assert not (entry / "meta.json").exists() and list(entry.glob(TEMP_GLOB))
    summary = run(args)
    assert_completed_cleanly(summary, tmp_path / "default" / "r", reference)
    assert (entry / "meta.json").exists() and not list(entry.glob(TEMP_GLOB))


# -- damaged files -------------------------------------------------------------------------------------

class StopAt(Exception):
    pass


def stopped_at(args: list[str], step: int) -> None:
    """A run that fails at `step` (after its checkpoint at step 4): the state a damaged file is put into."""
    from lightning.pytorch.callbacks import Callback

    class Stop(Callback):
        def on_train_batch_end(self, trainer, *a):
            if trainer.global_step == step:
                raise StopAt(f"stopped at step {step}")

    with pytest.raises(StopAt):
        train(compose_args(args), overrides=args, callbacks=[Stop()])


def test_truncated_checkpoint_stops_with_a_clear_message_and_keeps_every_file(base, reference, tmp_path):
    args = run_args(base, tmp_path, "r")
    run_dir = tmp_path / "default" / "r"
    stopped_at(args, 5)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:ckpt.stat().st_size // 2])
    kept = {p: p.read_bytes() for p in (ckpt, run_dir / "metrics.jsonl", run_dir / "config.yaml")}
    with pytest.raises(UnreadableCheckpoint, match=r"last\.ckpt cannot be read .*delete it and run the same command"):
        run(args)
    assert all(p.read_bytes() == data for p, data in kept.items())
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and "cannot be read" in summary["error"]
    ckpt.unlink()  # what the message says to do
    summary = run(args)
    assert summary["outcome"] == "restart"
    assert_completed_cleanly(summary, run_dir, reference)


@pytest.mark.parametrize("damaged", ["tokenizer.json", "train.npy", "meta.json"])
def test_damaged_tokenizer_cache_is_built_again(tmp_path, base, capsys, damaged):
    cfg = DataConfig(name="text", path=str(base / "corpus"), vocab_size=300, cache_dir=str(tmp_path))
    first = datamodule.prepare_lm(cfg)
    [entry] = (tmp_path / "lm").iterdir()
    (entry / damaged).write_bytes((entry / damaged).read_bytes()[:40])
    calls = tokenizer.train_calls
    again = datamodule.prepare_lm(cfg)
    assert "cannot be read" in capsys.readouterr().out
    assert tokenizer.train_calls == calls + 1 and not again.cache_hit
    assert np.array_equal(again.train, first.train) and np.array_equal(again.val, first.val)
    assert datamodule.prepare_lm(cfg).cache_hit  # whole again


# -- a full disk ---------------------------------------------------------------------------------------

def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_disk_full_while_checkpointing_fails_the_run_and_keeps_the_previous_checkpoint(base, reference, tmp_path,
                                                                                      monkeypatch):
    args = run_args(base, tmp_path, "r")
    run_dir = tmp_path / "default" / "r"
    real_save, calls = torch.save, []

    def save_until_full(obj, f, *a, **kw):
        calls.append(1)
        if len(calls) == 3:  # step 6: a few bytes fit, then the disk is full
            f.write(b"PK\x03\x04")
            raise no_space(f.name)
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(OSError, match="No space left on device"):
        run(args)
    monkeypatch.undo()
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and "No space left on device" in summary["error"], summary
    assert checkpoint_step(run_dir) == 4 and not temp_files(run_dir)
    summary = run(args)
    assert summary["outcome"] == "resume"
    assert_completed_cleanly(summary, run_dir, reference)


def test_disk_full_while_logging_fails_the_run_and_keeps_the_previous_checkpoint(base, reference, tmp_path,
                                                                                monkeypatch):
    import builtins

    import k3lab.rundir

    args = run_args(base, tmp_path, "r")
    run_dir = tmp_path / "default" / "r"
    lines = []

    class FullFile(io.StringIO):
        def write(self, text):
            raise no_space(run_dir / "metrics.jsonl")

    def open_until_full(path, mode="r", *a, **kw):
        if Path(path).name == "metrics.jsonl" and mode == "a":
            lines.append(1)
            if len(lines) > 6:  # step 5's line (after validation 0, steps 1-4 and validation 4)
                return FullFile()
        return builtins.open(path, mode, *a, **kw)

    monkeypatch.setattr(k3lab.rundir, "open", open_until_full, raising=False)
    with pytest.raises(OSError, match="No space left on device"):
        run(args)
    monkeypatch.undo()
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and "No space left on device" in summary["error"], summary
    assert checkpoint_step(run_dir) == 4
    summary = run(args)
    assert_completed_cleanly(summary, run_dir, reference)


# -- two processes, one directory ----------------------------------------------------------------------

def paused(args: list[str], step: int):
    """A training process paused after `step` (holding its run directory), and the event that lets it go on."""
    events = (CTX.Event(), CTX.Event())
    proc = in_child(args, "pause_after_step", step, events)
    assert events[0].wait(120), "the training process did not reach its pause"
    return proc, events[1]


def test_a_second_process_is_refused_a_busy_run_directory_and_changes_nothing(base, reference, tmp_path):
    args = run_args(base, tmp_path, "r")
    run_dir = tmp_path / "default" / "r"
    proc, go = paused(args, 3)
    try:
        before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
        with pytest.raises(RunDirBusy, match=f"in use by another process \\(pid {proc.pid}\\)"):
            run(args)
        cli = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert (cli.returncode, cli.stdout) == (2, ""), cli
        assert cli.stderr == (f"error: run directory {run_dir} is in use by another process (pid {proc.pid}); "
                              "wait for it, or pass run_name=<new name>\n")
        assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    finally:
        go.set()
        proc.join(120)
    assert proc.exitcode == 0
    assert_completed_cleanly(read_summary(run_dir), run_dir, reference)


def test_a_run_found_unfinished_is_decided_again_under_the_lock(base, reference, tmp_path, monkeypatch):
    """Process B reads the directory while A trains in it (no checkpoint yet: B would restart the run),
    then A completes before B gets the lock: B must skip the completed run, not train it again."""
    import k3lab.rundir

    args = run_args(base, tmp_path, "r")
    run_dir = tmp_path / "default" / "r"
    proc, go = paused(args, 1)
    real_lock = k3lab.rundir.lock_run_dir

    def lock_after_the_other_finished(path):
        go.set()
        proc.join(120)
        real_lock(path)

    monkeypatch.setattr(k3lab.rundir, "lock_run_dir", lock_after_the_other_finished)
    summary = run(args)
    assert proc.exitcode == 0
    assert summary["outcome"] == "skip"
    assert_completed_cleanly(read_summary(run_dir), run_dir, reference)
    assert read_summary(run_dir)["outcome"] == "new"  # A's own run, untouched
