"""Sweeps on other launchers (conf/hydra/launcher/, k3lab/preempt.py, k3lab/sweep.py), all on the CPU:

- the preemption signal saves a run at its next logging step; the same command continues the same curve;
- past K3LAB_STOP_AT a run saves and stops the same way, and a sweep starts nothing more and says so;
- hydra/launcher=slurm_local (submitit's local executor, the SLURM job path without SLURM): a job that gets
  the signal a preemption sends is requeued by submitit and ends with the uninterrupted run's losses;
- hydra/launcher=slurm becomes the sbatch script it promises (time, GPUs, tasks, warning signal, requeue);
- hydra/launcher=joblib gives each parallel job its own device, and every launcher ends with the table.
"""
import json
import os
import re
import signal
import time
from pathlib import Path

import lightning as L
import pytest
import submitit
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import k3lab.preempt
from k3lab.preempt import Preempted, StoppedAtDeadline
from k3lab.train import train

from test_train import ROOT, byte_args, rows, run_cli


pytestmark = pytest.mark.usefixtures("isolated_cache")


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
    common = byte_args(corpus, tmp_path, "train.max_steps=12", "train.log_every=3", "train.val_every=6",
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


class Clock:
    """k3lab.preempt's clock (its `time` module): 0 until `ClockJump` moves it past every deadline."""
    now = 0.0

    def time(self) -> float:
        return self.now


class ClockJump(L.Callback):
    """Moves `clock` to 1e12 at the end of one step (after k3lab's callback has read it at that step)."""

    def __init__(self, clock: Clock, step: int):
        self.clock, self.step = clock, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.clock.now = 1e12


def test_a_run_past_its_deadline_saves_at_the_next_logging_step_and_the_same_command_resumes(corpus, tmp_path,
                                                                                          monkeypatch):
    """K3LAB_STOP_AT passes after step 4 with log_every=3: the run saves at step 6, stops with
    StoppedAtDeadline before step 7 (no handler handed the signal: nothing was sent), and the same command,
    with no deadline, resumes from step 6 and ends on the uninterrupted run's curve."""
    common = byte_args(corpus, tmp_path, "train.max_steps=12", "train.log_every=3", "train.val_every=6",
                       "train.ckpt_every=100")
    run_inprocess([*common, "run_name=whole"])
    clock = Clock()
    monkeypatch.setattr(k3lab.preempt, "time", clock)
    monkeypatch.setenv("K3LAB_STOP_AT", "100")
    with pytest.raises(StoppedAtDeadline, match="at step 6"):
        run_inprocess([*common, "run_name=cut"], callbacks=[ClockJump(clock, 4)])
    cut = tmp_path / "default" / "cut"
    assert torch.load(cut / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    assert json.loads((cut / "summary.json").read_text())["error"].startswith("StoppedAtDeadline: stopped at "
                                                                              "K3LAB_STOP_AT at step 6")
    with pytest.raises(StoppedAtDeadline, match="not started"):  # past the deadline: not even resumed
        run_inprocess([*common, "run_name=cut"])
    monkeypatch.delenv("K3LAB_STOP_AT")
    resumed = run_inprocess([*common, "run_name=cut"])
    assert (resumed["status"], resumed["outcome"], resumed["steps"]) == ("completed", "resume", 12)
    same_curve(cut, tmp_path / "default" / "whole")


def test_a_sweep_past_its_deadline_starts_nothing_and_its_table_says_so(corpus, tmp_path):
    """A multirun under a deadline already passed ends normally with every job `stopped` in its table and no
    run directory written; a single run stops with the message; a deadline that is no time is one line."""
    common = byte_args(corpus, tmp_path, "train.max_steps=4", "group=late")
    env = {**os.environ, "K3LAB_STOP_AT": str(int(time.time()) - 5)}
    sweep = run_cli(["-m", *common, "seed=0,1"], env=env)
    log = sweep.communicate(timeout=300)[0]
    assert sweep.returncode == 0, log
    assert log.count("stopped (K3LAB_STOP_AT)") == 2 and "0 completed, 0 skipped, 0 failed, 2 stopped" in log, log
    single = run_cli([*common, "run_name=one"], env=env)
    log = single.communicate(timeout=300)[0]
    assert single.returncode != 0 and "not started: K3LAB_STOP_AT passed" in log, log
    assert not (tmp_path / "late").exists() or not any((tmp_path / "late").glob("*/summary.json"))
    bad = run_cli([*common, "run_name=one"], env={**os.environ, "K3LAB_STOP_AT": "soon"})
    log = bad.communicate(timeout=300)[0]
    assert bad.returncode == 2 and "error: K3LAB_STOP_AT='soon' is not a time" in log, log


def test_slurm_local_job_preempted_by_its_signal_is_requeued_and_ends_on_the_same_curve(corpus, tmp_path):
    """The SLURM job path on the CPU: `python run.py -m hydra/launcher=slurm_local ...` runs the run in a
    submitit job; SIGUSR2 (what SLURM sends before a time limit or at preemption) reaches the training
    process; with no periodic checkpoint (ckpt_every > max_steps) the run saves at the next step, submitit
    requeues the job with the same overrides, the new job resumes from that step, and the run ends with every
    loss of an uninterrupted run."""
    out = tmp_path / "runs"
    common = byte_args(corpus, out, "train.max_steps=16", "train.val_every=8", "train.ckpt_every=1000")
    run_inprocess([*common, "run_name=whole"])
    sweep = run_cli(["-m", "hydra/launcher=slurm_local", *common, "group=slurm", "run_name=cut"],
                    start_new_session=True)
    run_dir = out / "slurm" / "cut"
    def trained_steps() -> int:
        return max(losses(run_dir, "loss/train"), default=0) if (run_dir / "metrics.jsonl").exists() else 0

    try:
        deadline = time.time() + 300
        while sweep.poll() is None and time.time() < deadline and trained_steps() < 3:
            time.sleep(0.02)
        assert 3 <= trained_steps() < 16, f"the job did not reach step 3 while running (exit {sweep.poll()})"
        assert not (run_dir / "checkpoints" / "last.ckpt").exists()
        job = int((run_dir / ".lock").read_text())  # the process training into the run directory
        os.kill(job, signal.SIGUSR2)
        log = sweep.communicate(timeout=300)[0]
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    job_log = "\n".join(p.read_text() for p in sorted((out / "slurm" / ".submitit").rglob("*_log.*")))
    both = f"sweep:\n{log}\njob:\n{job_log}"
    assert sweep.returncode == 0, both
    saved = re.search(r"SIGUSR2 received: checkpoint saved at step (\d+), stopping", job_log)
    assert saved and 3 <= int(saved[1]) < 16, both
    assert "Requeued job" in job_log, both  # submitit's requeue, not a re-launch by hand
    assert f"resuming {run_dir} from step {saved[1]} (it had failed)" in job_log, both
    assert "completed (resumed)" in log, both  # the sweep's table, read back from the job's row
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["outcome"], summary["steps"]) == ("completed", "resume", 16), both
    same_curve(run_dir, out / "default" / "whole")


def test_slurm_preset_becomes_the_sbatch_script_it_promises(tmp_path, monkeypatch):
    """hydra/launcher=slurm through the submitit plugin's own launch, up to the sbatch script (nothing is
    submitted): time limit, one GPU and one task, SIGUSR2 120 s before the limit, --requeue, 20 requeues."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit's test for a SLURM cluster: srun on PATH
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    executors = []
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", lambda self, fn, *a: executors.append(self) or [])
    cfg = compose_run(["hydra/launcher=slurm", "hydra.launcher.partition=gpu", f"out_dir={tmp_path}"], hydra=True)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    assert launcher.launch([["seed=0"]], initial_job_idx=0) == []
    [executor] = executors
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit", "uid")
    for line in ("--time=240", "--gpus-per-node=1", "--ntasks-per-node=1", "--cpus-per-task=8",
                 "--signal=USR2@120", "--partition=gpu"):
        assert f"#SBATCH {line}\n" in script, script
    assert "#SBATCH --requeue\n" in script, script
    assert executor._executor.max_num_timeout == 20


def test_joblib_gives_each_parallel_job_its_own_device_and_the_sweep_its_table(corpus, tmp_path):
    """Three runs, two at a time: each worker process claims one device of the list for its life, so every
    run saw exactly one device (CUDA_VISIBLE_DEVICES, recorded in summary.json), runs of one worker the same,
    the two workers different ones; the launching process prints the table of all three."""
    out = tmp_path / "runs"
    sweep = run_cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                     "hydra.callbacks.device_per_job.devices=[3,5]", "seed=0,1,2", "group=j",
                     *byte_args(corpus, out, "train.max_steps=2", "train.val_every=2")])
    log = sweep.communicate(timeout=600)[0]
    assert sweep.returncode == 0, log
    assert "3 completed, 0 skipped, 0 failed" in log, log
    seen = {}  # worker pid -> devices its runs saw
    for summary_path in (out / "j").glob("*/summary.json"):
        summary = json.loads(summary_path.read_text())
        assert summary["status"] == "completed"
        pid = int((summary_path.parent / ".lock").read_text())
        seen.setdefault(pid, set()).add(summary["cuda_visible_devices"])
        assert "K3LAB_DEVICE_SHARED" not in (summary["device_shared_why"] or "")  # one job per device at a time
    assert sum(1 for _ in (out / "j").glob("*/summary.json")) == 3
    assert len(seen) == 2, seen
    assert all(len(devices) == 1 for devices in seen.values()), seen
    assert set.union(*seen.values()) == {"3", "5"}, seen


def test_joblib_with_more_parallel_jobs_than_devices_stops_before_any_run(corpus, tmp_path):
    sweep = run_cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=3",
                     "hydra.callbacks.device_per_job.devices=[0,1]", "seed=0,1,2",
                     *byte_args(corpus, tmp_path, "train.max_steps=2")])
    log = sweep.communicate(timeout=300)[0]
    assert sweep.returncode != 0
    assert "hydra.launcher.n_jobs=3 runs 3 jobs at once but there are 2 GPUs (0,1)" in log, log
    assert not list(tmp_path.glob("*/*/summary.json"))


@pytest.mark.parametrize("n_jobs, shared", [(2, True), (1, False)])
def test_jobs_sharing_a_gpu_are_marked_so_their_runs_record_it(tmp_path, monkeypatch, n_jobs, shared):
    """More parallel jobs than GPUs (jobs_per_device > 1): each job's environment says its GPU is shared,
    which summary.json records as device_shared, with the reason (analysis then takes no throughput ratio)."""
    from omegaconf import OmegaConf

    from k3lab.rundir import device_sharing
    from k3lab.sweep import DEVICE_SHARED_ENV, JOBLIB_LAUNCHER, DevicePerJob

    for name in (DEVICE_SHARED_ENV, "CUDA_VISIBLE_DEVICES"):  # the callback sets both: restored after the test
        monkeypatch.setenv(name, "unset")
    cfg = OmegaConf.create({"hydra": {"launcher": {"_target_": JOBLIB_LAUNCHER, "n_jobs": n_jobs},
                                      "sweep": {"dir": str(tmp_path)}}})
    callback = DevicePerJob(devices=[0], jobs_per_device=2)
    callback.on_multirun_start(cfg)
    callback.on_job_start(cfg)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    said = device_sharing(load_start=0.0, threads=1)["device_shared_why"] or ""  # a busy CPU may add its own reason
    assert (f"{DEVICE_SHARED_ENV}=1" in said) is shared


def _claim_and_hold(folder, jobs_per_device, results, release):
    from k3lab.sweep import SweepSetupError, claim_device

    try:
        results.put(claim_device(folder, ["0", "1"], jobs_per_device))
    except SweepSetupError as err:
        results.put(f"error: {err}")
    release.wait(60)


def test_jobs_per_device_lets_that_many_workers_share_each_gpu(tmp_path):
    """With jobs_per_device=2, four worker processes claim two slots of each of two GPUs, spreading over
    the GPUs first; a fifth finds no slot free."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    results, release = ctx.Queue(), ctx.Event()
    workers = []
    claimed = []
    for _ in range(5):
        worker = ctx.Process(target=_claim_and_hold, args=(tmp_path / "devices", 2, results, release))
        worker.start()
        workers.append(worker)
        claimed.append(results.get(timeout=60))  # one at a time: the order of the claims is the order here
    release.set()
    for worker in workers:
        worker.join(60)
    assert claimed[:4] == ["0", "1", "0", "1"], claimed
    assert claimed[4].startswith("error: every slot of the devices ['0', '1'] (2 per device) is held"), claimed
