"""Preemption and time limits: on the cluster's warning signal, save the checkpoint and stop, so the same
command (requeued by submitit, or typed again) resumes the run from it.

SLURM through submitit (hydra/launcher=slurm) warns a job with SIGUSR2 `signal_delay_s` before its time
limit, and at preemption where the cluster sends user signals then (PreemptParameters=send_user_signal);
`SUBMITIT_PREEMPT_SIGNAL` names another signal, and `train.preempt_signal` follows it. submitit's own
handler, installed before the job starts, checkpoints the job's callable (Hydra's submitit launcher
resubmits itself with the same overrides), requeues it and exits. `PreemptionCheckpoint` goes first:

    signal             remembered; training goes on to the next logging step (at most log_every - 1 steps)
    that step's end    every rank agrees (one all-reduce), checkpoints/last.ckpt is written
    next step's start  `Preempted` is raised before any work: summary.json says failed with the reason
    then               `hand_over` calls the handler that was there before (submitit's: requeue and exit);
                       with none (a plain `python run.py`) the process exits with the message

The requeued job finds the checkpoint in its run directory and resumes (k3lab.rundir.prepare_run_dir).

A deadline does the same without a signal: with K3LAB_STOP_AT set (unix seconds, inherited by every worker
and rank a run starts), a run saves at its first logging step past that time and stops
(`StoppedAtDeadline`), and a run that would start after it does not start. A sweep on a machine lent for a
fixed time (a device call of at most 10 minutes) thus ends with every run completed, checkpointed or not
begun, and the same command resumes them: `K3LAB_STOP_AT=$(( $(date +%s) + 540 )) python run.py -m ...`.
A signal sent to a whole sweep instead (`timeout -s USR2`) would also reach the sweep's own process, whose
default action for it is to die, leaving its workers running on.
Saving where Lightning's own ModelCheckpoint saves (the end of a training step) and only at a logging step
keeps the metrics of that step and the mean training loss of every logging interval on the same curve as
an uninterrupted run. Lightning's SLURM auto-requeue handler (SIGUSR1 by default) is left alone: it never
replaces a handler that is already installed, and submitit does not send SIGUSR1.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from k3lab.errors import ConfigError


class Preempted(SystemExit):
    """The run stopped for the preemption signal after saving its checkpoint; the same command resumes it.
    A SystemExit, so that Hydra does not record it as a failed job and the process ends with its message."""


class StoppedAtDeadline(Preempted):
    """The run stopped at K3LAB_STOP_AT, after saving its checkpoint, or was not started because that time had
    passed; the same command resumes (or starts) it. In a multirun, run.py records it as the job's outcome
    and the sweep goes on to its next job, which does not start either."""


STOP_AT = "K3LAB_STOP_AT"


def stop_at() -> float | None:
    """The time in K3LAB_STOP_AT (unix seconds), or None where it is unset or empty; a value that is not a
    number raises one ConfigError."""
    value = os.environ.get(STOP_AT, "").strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{STOP_AT}={value!r} is not a time: give unix seconds, e.g. "
                          f"{STOP_AT}=$(( $(date +%s) + 540 ))") from None


def past_deadline() -> bool:
    """Whether K3LAB_STOP_AT is set and has passed."""
    deadline = stop_at()
    return deadline is not None and time.time() >= deadline


def check_not_past_deadline() -> None:
    """Raise StoppedAtDeadline when K3LAB_STOP_AT has passed: a run not yet begun does not start."""
    if past_deadline():
        raise StoppedAtDeadline(f"not started: {STOP_AT} passed {time.time() - stop_at():.0f} s ago; the same "
                                "command starts it")


def signal_number(name: str) -> signal.Signals:
    """'USR2' or 'SIGUSR2' -> signal.SIGUSR2; an unknown name raises one ConfigError."""
    full = name if name.upper().startswith("SIG") else f"SIG{name}"
    try:
        return signal.Signals[full.upper()]
    except KeyError:
        raise ConfigError(f"train.preempt_signal={name!r} is not a signal name (e.g. USR2, USR1, TERM)") from None


class PreemptionCheckpoint(Callback):
    """On `signame` during training, or at the first logging step past `deadline` (unix seconds): save
    `ckpt_path` at that logging step and raise `Preempted` (`StoppedAtDeadline`) at the start of the step
    after it (module docstring). Install with `install()`, undo with `restore()`."""

    def __init__(self, ckpt_path: Path, signame: str | None, log_every: int, deadline: float | None = None):
        self.ckpt_path = Path(ckpt_path)
        self.signum = signal_number(signame) if signame else None
        self.log_every = log_every
        self.deadline = deadline
        self.received = False
        self.saved_at: int | None = None
        self.at_deadline = False
        self.previous: Any = None
        self.installed = False

    def install(self) -> None:
        """Catch the signal from now on, keeping the handler that was there for `hand_over` (signals can only
        be caught on the main thread: elsewhere, and with no signal configured, nothing is installed)."""
        if self.signum is None or threading.current_thread() is not threading.main_thread():
            return
        self.previous = signal.signal(self.signum, self._notice)
        self.installed = True

    def restore(self) -> None:
        if self.installed:
            signal.signal(self.signum, self.previous)
            self.installed = False

    def _notice(self, signum: int, frame: Any) -> None:
        self.received = True  # nothing else here: a handler that prints can interrupt a print of the main thread

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        off = self.signum is None and self.deadline is None
        if off or self.saved_at is not None or step % self.log_every or step >= trainer.max_steps:
            return  # off, already saved, not a logging step, or the last step (the run finishes instead)
        late = self.deadline is not None and time.time() >= self.deadline
        if trainer.strategy.reduce_boolean_decision(self.received or late, all=False):  # every rank stops together
            trainer.save_checkpoint(self.ckpt_path)
            self.saved_at, self.at_deadline = step, not self.received
            why = f"{STOP_AT} reached" if self.at_deadline else f"{signal.Signals(self.signum).name} received"
            rank_zero_only(print)(f"{why}: checkpoint saved at step {step}, stopping")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.saved_at is not None and self.at_deadline:
            raise StoppedAtDeadline(f"stopped at {STOP_AT} at step {self.saved_at}; checkpoints/last.ckpt holds it "
                                    "and the same command resumes the run")
        if self.saved_at is not None:
            name = signal.Signals(self.signum).name
            raise Preempted(f"preempted ({name}) at step {self.saved_at}; checkpoints/last.ckpt holds it and the "
                            f"same command resumes the run")

    def hand_over(self) -> None:
        """Pass the signal on to the handler that was installed before (submitit's requeues the job and exits).
        Returns when there is none that acts, or when it does not exit (submitit on ranks > 0)."""
        if callable(self.previous):
            self.previous(self.signum, None)
