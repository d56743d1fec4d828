"""The training step reads nothing back to the host (k3lab/lit.py's contract): on a GPU a sync stalls the host
until the device drains its queue, and the device then idles while the host launches the next work."""
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.overrides import TorchFunctionMode

from k3lab.config import ModelConfig, OptimConfig
from k3lab.lit import clip_grad_norm
from k3lab.model import K3Model
from k3lab.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]

# Tensor methods that read a value to the host, or build a tensor from host values (on a GPU: a blocking copy)
HOST_VALUE_CALLS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "new_tensor"}
HOST_VALUE_FUNCTIONS = {torch.tensor, torch.as_tensor, torch.nonzero, torch.masked_select}


class HostValues(TorchFunctionMode):
    """Records the calls that would wait for the device: HOST_VALUE_CALLS, HOST_VALUE_FUNCTIONS and indexing
    with a boolean tensor (whose result size is data-dependent). Device-independent, so it runs on the CPU."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_VALUE_CALLS or func in HOST_VALUE_FUNCTIONS:
            self.calls.append(name)
        elif name == "__getitem__" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                           for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.calls.append("boolean index")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("balance", ["qb", "sign"])
def test_router_bias_update_reads_nothing_back(balance):
    """update_router_biases after a training forward on one process (exact QB or the sign update): no value read
    to the host, no tensor built from host values, no boolean index. The recorder is checked on a call it must
    catch."""
    cfg = ModelConfig(n_layers=2, d_model=64, head_dim=32, vocab_size=128)
    cfg.balance.name = balance
    model = K3Model(cfg)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    model(tokens)
    with HostValues() as rec:
        model.update_router_biases()
    assert rec.calls == [], rec.calls
    with HostValues() as rec:
        tokens[tokens > 3].new_tensor(5).item()
    assert rec.calls == ["boolean index", "new_tensor", "item"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("balance", ["qb", "sign"])
def test_k3_default_training_step_never_syncs_the_host(balance):
    """The K3 default (Triton KDA, grouped MoE dispatch, exact Quantile Balancing or the sign update, block
    AttnRes, per-head Muon with the fused AdamW) in bf16, one step as K3LitModule takes it: forward with the
    loss, backward, gradient clipping, optimizer and scheduler step, router-bias update. After a first step
    (Triton compiles and tunes its kernels), the second runs under CUDA's sync debug mode set to error, which
    raises at any operation that waits for the device."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=4, d_model=256, head_dim=64, vocab_size=512)
    cfg.balance.name = balance
    model = K3Model(cfg).cuda().to(torch.bfloat16)
    opt, sched = build_optimizer(model, OptimConfig(), total_steps=10)
    gen = torch.Generator("cuda").manual_seed(1)
    tokens, targets = (torch.randint(0, 512, (2, 256), device="cuda", generator=gen) for _ in range(2))

    def step():
        (model(tokens, targets).mean + model.aux_loss()).backward()
        clip_grad_norm(model.parameters(), 1.0, opt)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_biases()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def in_repository(filename: str) -> bool:
    """A file of this repository's code, not of an environment installed inside the checkout (CI's .venv)."""
    return filename.startswith(str(ROOT)) and "site-packages" not in Path(filename).parts


class HarnessReads(HostValues):
    """HostValues that keeps, of each call, the innermost function of this repository that made it
    ("k3lab/lit.py:check_finite"): the reads of the training module's bookkeeping, told apart from those of the
    model's CPU paths and of torch's CPU optimizer (the GPU step above makes none of those)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        before = len(self.calls)
        out = super().__torch_function__(func, types, args, kwargs)
        frame = sys._getframe(1)
        while frame is not None and not in_repository(frame.f_code.co_filename):
            frame = frame.f_back
        if len(self.calls) > before and frame is not None:
            self.calls[-1] = f"{Path(frame.f_code.co_filename).relative_to(ROOT).as_posix()}:{frame.f_code.co_name}"
        return out


# Reads of the CPU's own paths, which a CUDA step does not take (it runs Triton KDA, grouped matmuls and fused
# AdamW: test_k3_default_training_step_never_syncs_the_host): the chunkwise torch KDA's check of its gates, the
# per-expert loop's segment sizes, torch's single-tensor AdamW's step count.
CPU_PATHS = {"kernels/kda/chunk_torch.py:__init__", "k3lab/model/moe.py:_loop", "k3lab/optim/muon.py:_adamw_step"}


class StepReads(L.Callback):
    """HarnessReads around each training step as the trainer runs it, from its batch's start to its end (the
    metrics row of a log step, which TrainMetrics writes at the batch's end, included): each step's reads
    outside CPU_PATHS, by the optimizer steps done after it."""

    def __init__(self):
        self.by_step: dict[int, list[str]] = {}
        self.recorder: HarnessReads | None = None

    def on_train_batch_start(self, trainer, *_):
        self.recorder = HarnessReads()
        self.recorder.__enter__()

    def on_train_batch_end(self, trainer, *_):
        self.recorder.__exit__(None, None, None)
        self.by_step[trainer.global_step] = [c for c in self.recorder.calls if c not in CPU_PATHS]


def test_a_run_reads_the_device_only_at_its_log_steps_and_once_for_the_routers(tmp_path):
    """Through the trainer (the K3 default: three MoE layers with Quantile Balancing), logging every 3 steps: no
    step between log steps reads anything back to the host; a log step reads twice, the window of losses and
    gradient norms (k3lab.lit.check_finite) and every MoE layer's routing statistics in one copy
    (K3LitModule.router_metrics), which metrics.jsonl then holds."""
    from hydra import compose, initialize_config_dir

    from k3lab.rundir import read_metrics
    from k3lab.train import train
    from test_train import byte_args, small_corpus

    args = byte_args(small_corpus(tmp_path / "corpus"), tmp_path, "train.max_steps=6", "train.log_every=3",
                     "train.val_every=6", "train.ckpt_every=0", "run_name=reads")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=args)
    reads = StepReads()
    train(cfg, overrides=args, callbacks=[reads])
    log_step = ["k3lab/lit.py:check_finite", "k3lab/lit.py:router_metrics"]
    assert reads.by_step == {1: [], 2: [], 3: log_step, 4: [], 5: [], 6: log_step}, reads.by_step
    logged = [r for r in read_metrics(tmp_path / "default" / "reads") if "loss/train" in r]
    assert [r["step"] for r in logged] == [3, 6]
    assert all(len([k for k in r if k.startswith("moe/maxvio/layer")]) == 3 for r in logged), logged
