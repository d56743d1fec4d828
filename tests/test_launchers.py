"""Runs that survive preemption (k3lab/preempt.py), on the CPU: the preemption signal saves a run at its
next logging step; the same command continues the same curve."""
import json
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir

from k3lab.preempt import Preempted
from k3lab.train import train

from test_train import FAST, ROOT, rows


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3LAB_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for d in range(6):
        (folder / f"doc{d}.txt").write_text(" ".join(f"line {j} of document {d} says {(j * 7) % 13}."
                                                     for j in range(300)))
    return folder


def args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["data=text", f"data.path={corpus}", "data.tokenizer=byte", f"out_dir={out}", *FAST, *extra]


def compose_run(overrides: list[str], hydra: bool = False):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra)


def run_inprocess(overrides: list[str], callbacks=()) -> dict:
    return train(compose_run(overrides), overrides=overrides, callbacks=callbacks)


def losses(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows(run_dir) if key in r}


def same_curve(run_dir: Path, reference_dir: Path) -> None:
    """Every training and validation loss of run_dir equals the reference run's, step for step (1e-5)."""
    for key in ("loss/train", "loss/val"):
        got, want = losses(run_dir, key), losses(reference_dir, key)
        assert got.keys() == want.keys(), (key, sorted(got), sorted(want))
        for step in want:
            assert abs(got[step] - want[step]) < 1e-5, (key, step, got[step], want[step])


class SignalAt(L.Callback):
    """Sends this process the preemption signal at the end of one step (only once k3lab's handler holds it)."""

    def __init__(self, step: int):
        self.step = step
        self.sent = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None):
            os.kill(os.getpid(), signal.SIGUSR2)
            self.sent = True


def test_preemption_signal_saves_at_the_next_logging_step_and_the_same_command_resumes(corpus, tmp_path):
    """SIGUSR2 after step 4 with log_every=3: the run saves at step 6 (a logging step, so the mean training
    loss of every interval stays whole), stops with Preempted before step 7 and gives the handler back; the
    same command resumes from step 6 and ends on the uninterrupted run's curve."""
    common = args(corpus, tmp_path, "train.max_steps=12", "train.log_every=3", "train.val_every=6",
                  "train.ckpt_every=100")
    run_inprocess([*common, "run_name=whole"])
    before = signal.getsignal(signal.SIGUSR2)
    probe = SignalAt(4)
    with pytest.raises(Preempted, match="at step 6"):
        run_inprocess([*common, "run_name=cut"], callbacks=[probe])
    assert probe.sent and signal.getsignal(signal.SIGUSR2) is before
    cut = tmp_path / "default" / "cut"
    assert torch.load(cut / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    stopped = json.loads((cut / "summary.json").read_text())
    assert stopped["status"] == "failed" and stopped["error"].startswith("Preempted: preempted (SIGUSR2) at step 6")
    assert sorted(losses(cut, "loss/train")) == [3, 6]

    resumed = run_inprocess([*common, "run_name=cut"])
    assert (resumed["status"], resumed["outcome"], resumed["steps"]) == ("completed", "resume", 12)
    assert sorted(losses(cut, "loss/train")) == [3, 6, 9, 12]
    same_curve(cut, tmp_path / "default" / "whole")
