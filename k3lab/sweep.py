"""Hydra callbacks of a multirun (conf/config.yaml, `hydra.callbacks`), for every launcher.

SweepReport: the closing table of which runs completed, were skipped, resumed or failed, and why. Hydra
runs `on_job_end` where the job ran (this process under the basic launcher, a worker under joblib, the job
under submitit), so each job writes its row to <sweep dir>/.sweep/report/<launch>/<job number>.json and the
launching process reads them all, then removes its folder. <launch> is the launching process's own (host, pid
and start time): multiruns launched side by side into one group folder (a study's slice starts several)
each report their own jobs. The job of a WSD trunk (train.branches) is one row, with each branch's loss. A run
that fails is reported where it ends (`k3lab.errors.report`: one line `error: ...` for a bad setting, else the
traceback) and the sweep goes on. Hydra then re-raises the
first failure, which run.py does not print again, and exits non-zero without calling `on_multirun_end`;
so the table is printed at interpreter exit unless the sweep ended cleanly. It is what a researcher reads before re-running
the same command (completed runs are then skipped, killed or failed runs resumed from their last
checkpoint: k3lab.rundir.prepare_run_dir).

DevicePerJob: under hydra/launcher=joblib, one GPU per parallel job. Hydra's joblib launcher runs jobs in a
pool of `hydra.launcher.n_jobs` worker processes and sets no device; a CUDA process sees the devices of
CUDA_VISIBLE_DEVICES as it was when CUDA started, so the device must be fixed before a worker's first job and
kept for its later ones. Each worker therefore claims one device for its lifetime (an flock on
<sweep dir>/.sweep/devices/<device>.<slot>.lock, released when the worker exits) at the start of its first
job and sets CUDA_VISIBLE_DEVICES to it: parallel jobs never share a GPU beyond `jobs_per_device` (default
1), whatever order the jobs finish in.

Hydra turns an exception raised in a callback into a warning and carries on; a sweep that cannot run as
configured therefore stops with SweepSetupError, a SystemExit, which Hydra lets through.
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.table import Table

from k3lab.console import console
from k3lab.errors import report, user_message
from k3lab.fileio import atomic_write_text

# "1" in a run's environment: other runs train on its GPU at the same time (summary.json's device_shared)
DEVICE_SHARED_ENV = "K3LAB_DEVICE_SHARED"

OUTCOME = {"new": "completed", "restart": "completed (restarted)", "resume": "completed (resumed)",
           "skip": "skipped (completed before)"}
STOPPED = "stopped (K3LAB_STOP_AT)"  # saved and stopped at the deadline, or not begun (k3lab.preempt)


class SweepReport(Callback):
    def __init__(self) -> None:
        self.sweep_dir = ""
        self.rows_dir: Path | None = None  # set in the launching process, travels to the jobs with the callback

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = str(config.hydra.sweep.dir)
        launch = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        self.rows_dir = Path(self.sweep_dir).resolve() / ".sweep" / "report" / launch
        self.rows_dir.mkdir(parents=True)
        atexit.register(self.print_table)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.rows_dir is None:  # a single run, not a multirun
            return
        overrides = list(job_return.overrides or ())
        if job_return.status == JobStatus.COMPLETED and (job_return.return_value or {}).get("outcome") == "stopped":
            row = [overrides, STOPPED, job_return.return_value.get("message", "")]
        elif job_return.status == JobStatus.COMPLETED:
            summary = job_return.return_value or {}
            runs = [(summary.get("outcome"), summary.get("loss_val_final"), "")]
            for name, outcome, loss in summary.get("branches") or []:  # a WSD trunk's job: its branches too
                runs.append((outcome, loss, f"{name.rsplit(',', 1)[-1]} "))
            trained = [outcome for outcome, _, _ in runs if outcome != "skip"]  # the first run the job trained
            row = [overrides, OUTCOME.get(trained[0] if trained else "skip", "completed"),
                   ", ".join(f"{label}val loss {loss:.4f}" for _, loss, label in runs if isinstance(loss, float))]
        else:
            err = job_return._return_value  # the exception; .return_value would re-raise it
            report(err)
            row = [overrides, "FAILED", (user_message(err) or f"{type(err).__name__}: {err}")[:200]]
        atomic_write_text(self.rows_dir / f"{config.hydra.job.num}.json", json.dumps(row))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self.print_table)
        self.print_table()

    def rows(self) -> list[tuple[tuple[str, ...], str, str]]:
        """(overrides, outcome, result or error) of every job that ended, in job order."""
        if self.rows_dir is None or not self.rows_dir.exists():
            return []
        files = sorted(self.rows_dir.glob("*.json"), key=lambda p: int(p.stem))
        return [(tuple(o), outcome, result) for o, outcome, result in (json.loads(p.read_text()) for p in files)]

    def print_table(self) -> None:
        rows = self.rows()
        if self.rows_dir is not None:  # read once: the run directories keep the outcomes
            shutil.rmtree(self.rows_dir, ignore_errors=True)
        if not rows:
            return
        common = set.intersection(*(set(r[0]) for r in rows))
        table = Table(title=f"sweep {self.sweep_dir}: {' '.join(o for o in rows[0][0] if o in common)}",
                      show_lines=False)
        table.add_column("run (the overrides that differ)", overflow="fold")
        table.add_column("outcome", no_wrap=True)
        table.add_column("result / error", overflow="fold")
        for overrides, outcome, result in rows:
            table.add_row(" ".join(o for o in overrides if o not in common) or "(the only run)", outcome, result,
                          style="red" if outcome == "FAILED" else None)
        failed = sum(r[1] == "FAILED" for r in rows)
        skipped = sum(r[1].startswith("skipped") for r in rows)
        stopped = sum(r[1] == STOPPED for r in rows)
        out = console(140)
        out.print(table)
        out.print(f"{len(rows) - failed - skipped - stopped} completed, {skipped} skipped, {failed} failed"
                  + (f", {stopped} stopped at K3LAB_STOP_AT" if stopped else "")
                  + ("; run the same command again to retry the failed runs and resume the stopped ones (completed "
                     "ones are skipped)" if failed or stopped else ""))


class SweepSetupError(SystemExit):
    """The sweep cannot run as configured; raised from a callback, it ends the sweep with its message."""


JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
_CLAIMED: dict[Path, tuple[Any, str]] = {}  # claims folder -> (the open lock file, the device) of this process


def visible_devices() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's list when it is set, else every GPU torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def claim_device(folder: Path, devices: Sequence[str], jobs_per_device: int = 1) -> str:
    """The device this process holds in `folder`, claiming the first free slot on the first call: each
    device has `jobs_per_device` slots (lock files <device>.<slot>.lock), filled one slot of every device
    before the next, so parallel jobs spread over the devices first."""
    if folder in _CLAIMED:
        return _CLAIMED[folder][1]
    folder.mkdir(parents=True, exist_ok=True)
    for slot in range(jobs_per_device):
        for device in devices:
            f = open(folder / f"{device}.{slot}.lock", "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            f.truncate(0)
            f.write(str(os.getpid()))
            f.flush()
            _CLAIMED[folder] = (f, device)
            return device
    raise SweepSetupError(f"every slot of the devices {list(devices)} ({jobs_per_device} per device) is held by "
                          f"another job of this sweep ({folder})")


class DevicePerJob(Callback):
    """One GPU per parallel job under hydra/launcher=joblib (module docstring); other launchers set devices
    themselves (submitit: gpus_per_node) or run one job at a time, and are left alone.

    devices: the GPUs to share out, a list or a comma-separated string; null: those the launching process
    sees. jobs_per_device: how many parallel jobs one GPU takes (small models that leave a GPU idle: a
    study's ladder on one GPU). hydra.launcher.n_jobs must not exceed devices x jobs_per_device. With no GPU
    (a CPU machine), nothing is set."""

    def __init__(self, devices: Sequence[Any] | str | None = None, jobs_per_device: int = 1) -> None:
        if not isinstance(jobs_per_device, int) or jobs_per_device < 1:
            raise SweepSetupError(f"hydra.callbacks.device_per_job.jobs_per_device={jobs_per_device!r} must be "
                                  "an integer >= 1")
        self.devices = devices
        self.jobs_per_device = jobs_per_device
        self.share: list[str] = []   # the devices jobs claim from; empty: leave CUDA_VISIBLE_DEVICES alone
        self.shared = False
        self.claims: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.launcher.get("_target_") != JOBLIB_LAUNCHER:
            return
        if self.devices is None:
            share = visible_devices()
        elif isinstance(self.devices, str):
            share = [d.strip() for d in self.devices.split(",") if d.strip()]
        else:
            share = [str(d) for d in self.devices]
        if not share:
            return
        from joblib import effective_n_jobs

        n_jobs = effective_n_jobs(config.hydra.launcher.n_jobs)
        slots = len(share) * self.jobs_per_device
        if n_jobs > slots:
            raise SweepSetupError(f"hydra.launcher.n_jobs={config.hydra.launcher.n_jobs} runs {n_jobs} jobs at once "
                                  f"but there are {len(share)} GPUs ({','.join(share)}) taking "
                                  f"hydra.callbacks.device_per_job.jobs_per_device={self.jobs_per_device} job(s) "
                                  f"each: pass hydra.launcher.n_jobs={slots} (or fewer), or more jobs_per_device")
        self.share = share
        self.shared = n_jobs > len(share)  # some GPU holds several jobs at once: their tokens/s are not their own
        self.claims = Path(str(config.hydra.sweep.dir)).resolve() / ".sweep" / "devices"

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.share:
            os.environ["CUDA_VISIBLE_DEVICES"] = claim_device(self.claims, self.share, self.jobs_per_device)
            os.environ[DEVICE_SHARED_ENV] = "1" if self.shared else "0"  # summary.json's device_shared
