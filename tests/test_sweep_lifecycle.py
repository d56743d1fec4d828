"""A sweep survives its runs: one failing run is recorded and the others go on, the sweep ends with a
table and a non-zero exit, and the same command again skips what completed, resumes a killed run from
its checkpoint (the same curve) and retries the failed one. Also: the lock that keeps two processes out
of one run directory, and a run that fails before training (its data folder holds no text yet) ends
`failed`, not `running`. (A run that fails its config checks creates nothing: tests/test_messages.py.)"""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3lab.rundir import read_summary

from test_train import FAST, ROOT, run_cli, small_corpus as corpus  # noqa: F401  (ROOT: the repo)

TINY = [*FAST, "train.max_steps=16", "train.val_every=8", "train.ckpt_every=2", "data.tokenizer=byte"]


pytestmark = pytest.mark.usefixtures("isolated_cache")


def run_dir_of(out: Path, path: Path) -> Path:
    """The run directory a sweep made for data.path=<path> (run names spell '/' as '_')."""
    key = f"data.path={path}".replace("/", "_")
    [found] = [p.parent for p in out.rglob("config.yaml") if key + "," in p.parent.name + ","]
    return found


def test_failed_run_is_reported_and_a_rerun_skips_resumes_and_retries(tmp_path):
    out = tmp_path / "runs"
    a, c = corpus(tmp_path / "a"), corpus(tmp_path / "c", seed=1)
    empty = tmp_path / "b"  # no text in it yet: that run fails while reading its data
    empty.mkdir()
    sweep = ["-m", "data=text", f"data.path={a},{empty},{c}", f"out_dir={out}", "group=s", *TINY]

    first = run_cli(sweep)
    log1 = first.communicate(timeout=900)[0]
    assert first.returncode != 0, log1
    assert "2 completed, 0 skipped, 1 failed" in log1, log1
    assert "FAILED" in log1 and "error: no .txt or .jsonl files under data.path" in log1, log1
    done_a = json.loads((run_dir_of(out, a) / "summary.json").read_text())
    reference_c = json.loads((run_dir_of(out, c) / "summary.json").read_text())
    failed = json.loads((run_dir_of(out, empty) / "summary.json").read_text())
    assert (done_a["status"], reference_c["status"], failed["status"]) == ("completed", "completed", "failed")
    assert "no .txt or .jsonl files" in failed["error"]

    # c is trained again from scratch and killed after a checkpoint; the empty folder gets its text
    c_dir = run_dir_of(out, c)
    overrides = (c_dir / "overrides.yaml").read_text().split("\n")
    victim = run_cli([o[2:] for o in overrides if o.startswith("- ")] + ["overwrite=true"])
    ckpt = c_dir / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while victim.poll() is None and time.time() < deadline:
        if ckpt.exists() and read_summary(c_dir).get("status") == "running":  # the new run's checkpoint
            break
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim_log = victim.communicate()[0]
    assert json.loads((c_dir / "summary.json").read_text())["status"] == "running", victim_log
    corpus(empty, seed=2)

    second = run_cli(sweep)
    log2 = second.communicate(timeout=900)[0]
    assert second.returncode == 0, log2
    assert "2 completed, 1 skipped, 0 failed" in log2, log2
    assert "completed (resumed)" in log2 and "completed (restarted)" in log2, log2
    assert json.loads((run_dir_of(out, a) / "summary.json").read_text()) == done_a  # skipped: untouched
    resumed_c = json.loads((c_dir / "summary.json").read_text())
    assert resumed_c["status"] == "completed" and resumed_c["steps"] == 16, log2
    assert abs(resumed_c["loss_val_final"] - reference_c["loss_val_final"]) < 1e-5, (resumed_c, reference_c)
    assert json.loads((run_dir_of(out, empty) / "summary.json").read_text())["status"] == "completed"


def test_a_run_that_fails_before_training_ends_failed_and_reruns_without_a_flag(tmp_path):
    out = tmp_path / "runs"
    path = tmp_path / "later"
    path.mkdir()
    args = ["data=text", f"data.path={path}", f"out_dir={out}", "run_name=r", *TINY]
    first = run_cli(args)
    log = first.communicate(timeout=300)[0]
    assert first.returncode == 2, log
    assert log.splitlines()[-1] == f"error: no .txt or .jsonl files under data.path {str(path)!r}", log
    summary = json.loads((out / "default" / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and "no .txt or .jsonl files" in summary["error"], log
    corpus(path)
    again = run_cli(args)
    log = again.communicate(timeout=300)[0]
    assert again.returncode == 0, log
    assert json.loads((out / "default" / "r" / "summary.json").read_text())["status"] == "completed"


def test_two_processes_never_train_into_one_run_directory(tmp_path):
    from k3lab.rundir import RunDirBusy, lock_run_dir

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    script = (f"import pathlib, time; from k3lab.rundir import lock_run_dir; "
              f"lock_run_dir(pathlib.Path({str(run_dir)!r})); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusy, match=f"in use by another process \\(pid {holder.pid}\\)"):
            lock_run_dir(run_dir)
    finally:
        holder.kill()
        holder.wait()
    lock_run_dir(run_dir)  # the dead holder's lock went with it


def test_multiruns_side_by_side_in_one_group_each_report_their_own_jobs(tmp_path, capsys):
    """Two multiruns launched at once into one sweep folder (a study slice starts several): each closing
    table lists its own jobs only, and nothing of either is left under .sweep/report once printed."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from k3lab.sweep import SweepReport

    reports = [SweepReport(), SweepReport()]
    for report in reports:
        report.on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    for num in range(2):  # both launches number their jobs from 0
        for which, report in enumerate(reports):
            done = JobReturn(overrides=[f"sweep={which}", f"seed={num}"], status=JobStatus.COMPLETED)
            done.return_value = {"outcome": "new", "loss_val_final": 1.0 + which}
            report.on_job_end(OmegaConf.create({"hydra": {"job": {"num": num}}}), done)
    for which, report in enumerate(reports):
        assert [r[0] for r in report.rows()] == [(f"sweep={which}", "seed=0"), (f"sweep={which}", "seed=1")]
        report.on_multirun_end(OmegaConf.create({}))
        assert f"val loss {1.0 + which:.4f}" in capsys.readouterr().out
    assert not any((tmp_path / ".sweep" / "report").iterdir())
