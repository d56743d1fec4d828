"""A run directory knows the config and the code it was trained with: the same command meeting another
config is refused with the keys that changed, another code revision is said, `resume=` takes the paths the
project prints and leaves a completed run alone, `resume=last` takes the newest unfinished run, debug presets
train again every time; and the newcomer's cases around it: one text file trains, the CPU thread count is a
setting, a non-finite first step says that no checkpoint exists."""
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from k3lab.lit import NonFiniteLossError
from k3lab.model.k3 import K3Model
from k3lab.rundir import ConfigChanged
from k3lab.train import train
from test_train import byte_args, rows

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], **kw) -> dict:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=args)
    return train(cfg, overrides=args, **kw)


class FailAt:
    """A Lightning callback that raises after optimizer step `step` (a run that dies after a checkpoint)."""

    def __new__(cls, step: int):
        from lightning.pytorch.callbacks import Callback

        class _Fail(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == step:
                    raise RuntimeError(f"killed after step {step}")

        return _Fail()


def test_a_completed_run_met_with_another_config_is_refused_with_the_keys_that_changed(corpus, tmp_path):
    """The same command after a default changed (here: the same run_name with another rate, as a changed
    YAML default would compose it) neither skips nor retrains silently; overwrite=true trains it again."""
    args = byte_args(corpus, tmp_path, "train.max_steps=2", "run_name=r")
    assert run(args)["outcome"] == "new"
    assert run(args)["outcome"] == "skip"
    with pytest.raises(ConfigChanged, match=r"holds a completed run of another config \(optim.lr_scale: 1.0 -> 2.0\): "
                                            r"add overwrite=true to train it again from scratch, or run_name=<new "
                                            r"name> to keep both"):
        run([*args, "optim.lr_scale=2"])
    assert run([*args, "optim.lr_scale=2", "overwrite=true"])["outcome"] == "new"


def test_a_killed_run_met_with_another_config_is_refused_and_resumes_with_its_own(corpus, tmp_path):
    args = byte_args(corpus, tmp_path, "train.max_steps=6", "train.ckpt_every=2", "run_name=k")
    with pytest.raises(RuntimeError, match="killed after step 3"):
        run(args, callbacks=[FailAt(3)])
    with pytest.raises(ConfigChanged, match=r"holds an unfinished run \(status failed\) of another config \(data.seq_len: 32 -> 16\)"):
        run([*args, "data.seq_len=16"])
    summary = run(args)
    assert (summary["outcome"], summary["status"], summary["steps"]) == ("resume", "completed", 6)


def test_a_completed_run_of_another_code_revision_is_skipped_with_a_line_that_says_so(corpus, tmp_path, monkeypatch,
                                                                                      capsys):
    args = byte_args(corpus, tmp_path, "train.max_steps=2", "run_name=rev")
    monkeypatch.setenv("K3LAB_GIT_REV", "aaaaaaa")
    run(args)
    monkeypatch.setenv("K3LAB_GIT_REV", "bbbbbbb")
    capsys.readouterr()
    assert run(args)["outcome"] == "skip"
    assert ("completed already (trained at aaaaaaa; the code is now bbbbbbb), skipped (overwrite=true trains it "
            "again)") in capsys.readouterr().out


def test_resuming_a_completed_run_does_nothing(corpus, tmp_path, capsys):
    run(byte_args(corpus, tmp_path, "train.max_steps=2", "run_name=done"))
    run_dir = tmp_path / "default" / "done"
    before = ((run_dir / "summary.json").read_text(), (run_dir / "metrics.jsonl").read_text())
    capsys.readouterr()
    assert run(byte_args(corpus, tmp_path, f"resume={run_dir}"))["outcome"] == "skip"
    assert f"{run_dir}: completed already (2 steps), nothing to resume" in capsys.readouterr().out
    assert ((run_dir / "summary.json").read_text(), (run_dir / "metrics.jsonl").read_text()) == before


def test_resume_last_takes_the_newest_unfinished_run_not_a_completed_one(corpus, tmp_path):
    with pytest.raises(RuntimeError):
        run(byte_args(corpus, tmp_path, "train.max_steps=6", "train.ckpt_every=2", "run_name=killed"),
            callbacks=[FailAt(3)])
    run(byte_args(corpus, tmp_path, "train.max_steps=2", "run_name=newer_but_completed"))
    summary = run(byte_args(corpus, tmp_path, "resume=last"))
    assert (summary["run_name"], summary["outcome"], summary["steps"]) == ("killed", "resume", 6)


def test_resume_takes_the_run_directories_the_project_names():
    """Run names hold `=` and `,` (decay=softplus,seed=1), which Hydra's grammar reads as syntax: run.py
    quotes the value of resume= before Hydra parses it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_script", ROOT / "run.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = "runs/ablate_decay/decay=softplus,seed=1"
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=script.quote_paths([f"resume={path}", "seed=2"]))
    assert (cfg.resume, cfg.seed) == (path, 2)
    assert script.quote_paths(["resume='a=b'"]) == ["resume='a=b'"]  # already quoted: as it is


def test_debug_presets_train_again_every_time(corpus, tmp_path):
    args = byte_args(corpus, tmp_path, "debug=fast_dev_run", "train.val_batches=1")
    assert [run(args)["outcome"], run(args)["outcome"]] == ["new", "new"]


def test_one_text_file_trains(tmp_path):
    """data.path naming one .txt file: its paragraphs make the documents (k3lab.data.corpus.split_text)."""
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(f"Chapter {i}. " + " ".join(f"word{j % 50}" for j in range(400)) for i in range(12)))
    args = ["data=text", f"data.path={book}", "data.tokenizer=byte", f"out_dir={tmp_path / 'runs'}", "model.d_model=64",
            "model.head_dim=32", "data.seq_len=32", "data.batch_size=4", "train.max_steps=2", "data.val_tokens=256"]
    summary = run(args)
    assert summary["status"] == "completed" and summary["loss_val_final"] is not None


def test_the_thread_count_is_a_setting(corpus, tmp_path):
    threads = torch.get_num_threads()
    try:
        summary = run(byte_args(corpus, tmp_path, "train.max_steps=1", "trainer.threads=1"))
    finally:
        torch.set_num_threads(threads)
    assert summary["threads"] == 1 and summary["device"] == "cpu (1 threads)"
    assert set(summary["cpu_load"]) == {"start", "now"} and isinstance(summary["device_shared"], bool)


def test_a_non_finite_first_step_says_no_checkpoint_was_written(corpus, tmp_path, monkeypatch):
    original = K3Model.forward

    def nan(self, tokens, targets=None):
        out = original(self, tokens, targets)
        return out._replace(sum=out.sum * float("nan")) if self.training else out

    monkeypatch.setattr(K3Model, "forward", nan)
    with pytest.raises(NonFiniteLossError, match=r"at step 0 .*No checkpoint was written before it \(lower optim.lr"):
        run(byte_args(corpus, tmp_path, "train.max_steps=4", "train.ckpt_every=2", "run_name=nan0"))
    assert not (tmp_path / "default" / "nan0" / "checkpoints" / "last.ckpt").exists()
    assert json.loads((tmp_path / "default" / "nan0" / "summary.json").read_text())["status"] == "failed"
    assert rows(tmp_path / "default" / "nan0")  # the step-0 validation was logged before the stop
