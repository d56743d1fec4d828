"""The mirrors of metrics.jsonl, offline: TensorBoard's event files hold the same points (a resumed run
included: the events logged after the checkpoint by the stopped process are purged), and wandb in
offline mode writes its run files, one wandb run per run directory across a resume. Tiny model, byte
tokenizer, one torch thread."""
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Callback

from k3lab.rundir import read_summary
from k3lab.train import train

pytest.importorskip("tensorboard")
ROOT = Path(__file__).resolve().parents[1]
FAST = ["model.n_layers=4", "model.d_model=64", "model.head_dim=32", "data.seq_len=32", "data.batch_size=4",
        "data.val_tokens=256", "train.log_every=1", "optim.warmup_steps=2", "data.tokenizer=byte",
        "train.max_steps=6", "train.val_every=3", "train.ckpt_every=2"]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """One thread; the token cache and wandb's own folders in tmp_path; no network."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("K3LAB_CACHE", str(tmp_path / "cache"))
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    yield
    torch.set_num_threads(threads)


def args(tmp_path: Path, logger: str, *extra: str) -> list[str]:
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for d in range(4):
        (corpus / f"doc{d}.txt").write_text(" ".join(f"line {j} of document {d}." for j in range(200)))
    return ["data=text", f"data.path={corpus}", f"out_dir={tmp_path / 'runs'}", "run_name=r", f"logger={logger}",
            *FAST, *extra]


def run(overrides: list[str], callbacks=()) -> dict:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return train(cfg, overrides=overrides, callbacks=callbacks)


class Stop(Callback):
    """Fails the run after step 3: checkpoint at step 2, steps 3 logged past it."""

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == 3:
            raise RuntimeError("stopped at step 3")


def stopped_then_resumed(overrides: list[str]) -> Path:
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        run(overrides, callbacks=[Stop()])
    summary = run(overrides)
    assert summary["outcome"] == "resume" and summary["status"] == "completed"
    return Path(overrides[2].split("=", 1)[1]) / "default" / "r"


def jsonl(run_dir: Path, key: str) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in lines if key in r}


def test_tensorboard_mirrors_metrics_jsonl_across_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = stopped_then_resumed(args(tmp_path, "tensorboard"))
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for key in ("loss/train", "loss/val", "optim/lr"):
        scalars = events.Scalars(key)
        want = jsonl(run_dir, key)
        assert [s.step for s in scalars] == sorted(want), key  # each step once: step 3 of the stopped run purged
        for s in scalars:
            assert s.value == pytest.approx(want[s.step], rel=1e-6), (key, s.step)


def test_wandb_offline_writes_one_run_per_run_directory(tmp_path, capsys):
    pytest.importorskip("wandb")
    run_dir = stopped_then_resumed(args(tmp_path, "wandb"))
    wandb_id = read_summary(run_dir)["wandb_id"]
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{wandb_id}.wandb"] * 2  # the stopped process's and the resumed one's
    last = files[-1].read_bytes()
    assert last.count(b"loss/train") >= 3  # steps 3 to 6 of the resumed process
    assert json.dumps(jsonl(run_dir, "loss/train")[6]).encode() in last
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "\x1b" not in out and "Run history" not in out  # quiet, no colour codes in a captured log
