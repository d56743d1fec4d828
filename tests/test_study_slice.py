"""results/pycode_study/slice.sh on the CPU, at a stand-in size: a stage starts detached and returns, `wait`
sees it finish, `collect` packs the run directories without checkpoints, the corpus identity is recorded,
`import` takes the completed runs into the study; started again on a fresh run folder with the imported runs
put back, the stage skips every run; stage `next` runs what the tuning says comes next and stage `ladder`
refuses a configuration with no tuned rate."""
import pytest
import json
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ("trainer=cpu model.aspect=16 model.head_dim=16 data.seq_len=32 data.batch_size=2 data.val_tokens=256 "
        "train.tokens_per_param=null train.max_steps=3 train.val_every=3 train.ckpt_every=2 optim.warmup_frac=null "
        "optim.warmup_steps=1")


def slice_sh(*args: str, env: dict, check: bool = True) -> str:
    done = subprocess.run(["bash", "results/pycode_study/slice.sh", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=600)
    assert (done.returncode == 0) == check, done.stdout + done.stderr
    return done.stdout + ("" if check else done.stderr)


@pytest.mark.slow  # minutes of CPU: `python -m pytest -m slow` runs it
def test_a_stage_runs_detached_is_collected_and_is_skipped_when_started_again(tmp_path):
    study = tmp_path / "study"
    study.mkdir()
    env = {**os.environ, "STUDY": str(study), "CORPUS": str(tmp_path / "corpus"), "RUNS": str(tmp_path / "runs"),
           "PREPARE": "--source python-code --max-docs 80 --vocab-size 300 --workers 1", "EXTRA": TINY,
           "CONFIGS": "\ndecay=softplus", "OMP_NUM_THREADS": "1", "K3LAB_CACHE": str(tmp_path / "cache")}
    started = slice_sh("start", "tune", env=env)
    assert started.count("python3 run.py -m experiment=pycode_study") == 2 and "started stage tune" in started
    assert "stage finished" in slice_sh("wait", "400", env=env)
    out = tmp_path / "out"
    out.mkdir()
    slice_sh("collect", str(out), env=env)
    with tarfile.open(out / "runs.tgz") as tar:
        names = tar.getnames()
    summaries = [n for n in names if n.endswith("summary.json")]
    assert len(summaries) == 6 and not any("checkpoints" in n for n in names)  # 2 configurations x 3 scales
    with tarfile.open(out / "runs.tgz") as tar:
        assert all(json.load(tar.extractfile(n))["device_shared"] is True for n in summaries)
    identity = json.loads((out / "corpus.json").read_text())
    assert identity == json.loads((study / "corpus.json").read_text()) and identity["vocab_size"] == 300

    # here: `import` puts the completed runs into the study folder, five files each, once; a run that did not
    # complete stays out and is named
    with tarfile.open(out / "runs.tgz") as tar:
        failed = sorted(n for n in names if n.endswith("summary.json"))[0]
        summary = json.load(tar.extractfile(failed))
    (tmp_path / "failed" / Path(failed).parent).mkdir(parents=True)
    (tmp_path / "failed" / failed).write_text(json.dumps({**summary, "status": "failed", "error": "AcceleratorError: x"}))
    with tarfile.open(tmp_path / "failed.tgz", "w:gz") as tar:
        tar.add(tmp_path / "failed", arcname=".")
    imported = slice_sh("import", str(tmp_path / "failed.tgz"), env=env)
    assert "imported 0 completed runs" in imported and "1 not completed" in imported and "AcceleratorError" in imported
    assert "imported 6 completed runs" in slice_sh("import", str(out / "runs.tgz"), env=env)
    assert "imported 0 completed runs" in slice_sh("import", str(out / "runs.tgz"), env=env)
    kept = {p.name for p in (study / "runs").glob("pycode_study/*/*")}
    assert kept == {"config.yaml", "metrics.csv", "metrics.jsonl", "overrides.yaml", "summary.json"}, kept

    # a later slice: a fresh run folder, the imported runs in the study folder; the same stage trains nothing
    env["RUNS"] = str(tmp_path / "runs2")
    slice_sh("start", "tune", env=env)
    assert "stage finished" in slice_sh("wait", "400", env=env)
    logs = "".join(p.read_text() for p in (tmp_path / "runs2" / ".slice").glob("log.*"))
    assert logs.count("completed already, skipped") == 6, logs[-2000:]

    # what comes next: per configuration, one point beyond the grid's edge (the tuning seed) or the reported seeds
    started = slice_sh("start", "next", env=env)
    multiruns = [line for line in started.splitlines() if line.startswith("python3 run.py -m")]
    assert len(multiruns) == 2 and sum("decay=softplus" in m for m in multiruns) == 1
    for m in multiruns:
        scale = float(m.split("optim.lr_scale=")[1].split()[0])
        assert (m.split("seed=")[1].split()[0], scale in (0.5, 1, 2)) in (("1000", False), ("0,1,2", True)), m
    assert "stage finished" in slice_sh("wait", "400", env=env)
    # the ladder needs residual's rows, which this stand-in tuning (the default and softplus) lacks
    refused = slice_sh("start", "ladder", "5", env=env, check=False)
    assert "ladder: residual=block_attnres has no rate inside its grid yet" in refused
    assert "ladder: no configuration is ready" in refused


@pytest.mark.slow  # minutes of CPU: `python -m pytest -m slow` runs it
def test_the_speed_stage_runs_each_configuration_alone_into_its_own_group(tmp_path):
    """Stage `speed`: one multirun after another (each run alone on the GPU, device_shared false), at the
    two depths, into runs/pycode_speed/, which `collect` packs beside the study's runs."""
    env = {**os.environ, "STUDY": str(tmp_path / "study"), "CORPUS": str(tmp_path / "corpus"),
           "RUNS": str(tmp_path / "runs"), "PREPARE": "--source python-code --max-docs 80 --vocab-size 300 --workers 1",
           "EXTRA": TINY, "CONFIGS": "\ndecay=softplus", "OMP_NUM_THREADS": "1", "K3LAB_CACHE": str(tmp_path / "cache")}
    (tmp_path / "study").mkdir()
    state = tmp_path / "runs" / ".slice"
    state.mkdir(parents=True)
    (state / "running.tune").touch()  # a stage whose runs have not finished: none completed yet
    assert "10 s: 0 runs completed\nstill running: tune" in slice_sh("wait", "1", env=env)
    (state / "running.tune").unlink()
    stage = slice_sh("start", "speed", env=env)
    assert stage.count("group=pycode_speed model.n_layers=4,7") == 2
    assert "stage finished" in slice_sh("wait", "400", env=env)
    script = (state / "stage.speed.sh").read_text()
    assert "K3LAB_DEVICE_SHARED=0" in script and not any(line.endswith("&") for line in script.splitlines())
    out = tmp_path / "out"
    out.mkdir()
    slice_sh("collect", str(out), env=env)
    with tarfile.open(out / "runs.tgz") as tar:
        summaries = [json.load(tar.extractfile(n)) for n in tar.getnames() if n.endswith("summary.json")]
    assert len(summaries) == 4 and {s["group"] for s in summaries} == {"pycode_speed"}
    # no run was marked as sharing its device by the stage (a busy test machine may add its own CPU reason)
    assert all("K3LAB_DEVICE_SHARED" not in (s["device_shared_why"] or "") and s["status"] == "completed"
               for s in summaries)
    assert sorted(s["n_layers"] for s in summaries) == [4, 4, 7, 7]


def test_ladder_plan_from_the_committed_tuning_runs_every_configuration_and_depth_at_once(tmp_path):
    """`plan ladder 6,7` on the study's committed runs: the K3 default, residual=standard and optim=adamw at
    the rates their tuning chose (1, 1 and 0.5), seed 0, one multirun per configuration and depth (so all six
    run side by side); nothing is started."""
    import shutil

    study = tmp_path / "study"
    shutil.copytree(ROOT / "results" / "pycode_study" / "runs", study / "runs")
    env = {**os.environ, "STUDY": str(study), "RUNS": str(tmp_path / "runs")}
    lines = [line for line in slice_sh("plan", "ladder", "6,7", env=env).splitlines()
             if line.startswith("python3 run.py -m experiment=pycode_study")]
    planned = set()
    for line in lines:
        words = dict(w.split("=", 1) for w in line.split()[3:])
        planned.add((words.get("residual", ""), words.get("optim", ""), words["optim.lr_scale"],
                     words["model.n_layers"], words["seed"]))
    assert len(lines) == 6 and planned == {(r, o, rate, depth, "0") for r, o, rate in
                                           [("", "", "1"), ("standard", "", "1"), ("", "adamw", "0.5")]
                                           for depth in ("6", "7")}
    assert not list((tmp_path / "runs" / ".slice").glob("running.*"))


def test_speed_stage_takes_its_depths(tmp_path):
    """`plan speed 4`: one timing multirun per configuration at depth 4 only (the headline's size); without
    depths, 4 and 7."""
    env = {**os.environ, "STUDY": str(tmp_path / "study"), "RUNS": str(tmp_path / "runs"), "CONFIGS": "\ndecay=softplus"}
    for depths, want in (("4", "model.n_layers=4 "), ("", "model.n_layers=4,7 ")):
        lines = [line for line in slice_sh("plan", "speed", *[d for d in [depths] if d], env=env).splitlines()
                 if line.startswith("python3 run.py -m")]
        assert len(lines) == 2 and all("group=pycode_speed " + want in line for line in lines), lines


def test_a_multirun_whose_run_fails_is_started_once_more_and_completes(tmp_path):
    """A run that dies (here: its first process exits 1 before training, as a CUDA fault would end it) is
    retried at once by a new `run.py -m` of the same multirun, which completes it; the log says so."""
    shim = tmp_path / "bin"
    shim.mkdir()
    real = subprocess.run(["bash", "-c", "command -v python3"], capture_output=True, text=True).stdout.strip()
    (shim / "python3").write_text(  # the first run.py call fails, every other call is the real interpreter
        f'#!/bin/bash\nif [ "$1" = run.py ] && [ ! -e {tmp_path}/failed-once ]; then\n'
        f'  touch {tmp_path}/failed-once; echo "AcceleratorError: CUDA error: unspecified launch failure"; exit 1\n'
        f'fi\nexec {real} "$@"\n')
    (shim / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "STUDY": str(tmp_path / "study"),
           "CORPUS": str(tmp_path / "corpus"), "RUNS": str(tmp_path / "runs"),
           "PREPARE": "--source python-code --max-docs 80 --vocab-size 300 --workers 1", "EXTRA": TINY,
           "CONFIGS": "glu=swiglu", "OMP_NUM_THREADS": "1", "K3LAB_CACHE": str(tmp_path / "cache")}
    (tmp_path / "study").mkdir()
    slice_sh("start", "speed", "4", env=env)
    assert "stage finished" in slice_sh("wait", "400", env=env)
    log = (tmp_path / "runs" / ".slice" / "log.speed4.1").read_text()
    assert "unspecified launch failure" in log and "a run failed: the multirun once more" in log
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("pycode_speed/*/summary.json")]
    assert [s["status"] for s in summaries] == ["completed"]
