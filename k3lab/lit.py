"""LightningModule: the training step, validation, router balancing and metric logging around K3Model.

Metrics go straight to the trainer's loggers (JsonlLogger, plus wandb when enabled) with explicit
steps, so every line of metrics.jsonl has a known step and a resumed run continues the same curve; a
step's training row is written (by the TrainMetrics callback) before that step's checkpoint.

Host syncs. A training step reads nothing back from the device: its loss and gradient norm join a window
of device tensors, and `check_finite` reads the window (one all-reduce, one copy to the host) only at the
steps that need it: those that log (every train.log_every and the last) and those after which the
checkpoint callback saves (every train.ckpt_every); a step's read runs in configure_gradient_clipping,
after its backward and before its optimizer step. A validation that finds unread steps (training stopped
between reads, by a callback) reads them first; k3lab.train validates before its final checkpoint. A non-finite loss or gradient norm anywhere in the
window stops every rank there, naming the first bad step. A bad step between two reads has already
updated the weights when it is found, but they are never saved: the next checkpoint step is a read step
and stops before its update, so checkpoints/last.ckpt keeps the last weights of a fully finite window.
Reading at the log and checkpoint steps, rather than keeping a device-side flag that skips bad updates,
costs no sync beyond the one logging needs and keeps the optimizer's code as it is. Validation sums its
loss, hits and counts on the device and reads them once, at its end.

train.compile compiles the model (k3lab.train.compile_model); training steps run it compiled, validation
eagerly (validation_step says why). Each training step marks its start for torch's CUDA graph trees
(train.compile_mode=reduce-overhead), so that a step's recorded graphs may reuse the memory of the previous
step's outputs; what the module keeps of a step's outputs (the window's losses) it copies within the step.

Under trainer=fsdp, `configure_model` shards the model (k3lab.parallel); the reads above are then one
all-reduce over every data-parallel rank, as under DDP.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from k3lab.config import OptimConfig
from k3lab.errors import UserError
from k3lab.model.k3 import K3Model
from k3lab.model.moe import STATS, MoE
from k3lab.optim import lightning_optimizers
from k3lab.parallel import is_sharded, shard_model

# the optimizer groups every model has (k3lab/optim/build.py), logged as optim/lr and optim/lr_adamw
CORE_GROUPS = ("muon", "adamw", "adamw_no_decay")
# dense bf16 peak FLOP/s by device-name fragment, for MFU
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def peak_flops() -> float | None:
    """The dense bf16 peak FLOP/s of this process's CUDA device (PEAK_FLOPS), None without one or when unknown."""
    if not torch.cuda.is_available():
        return None
    return next((v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name()), None)


class NonFiniteLossError(UserError, RuntimeError):
    """The loss stopped being finite; the message gives the step and what to change (printed as one line)."""


def check_finite(loss: torch.Tensor, step: int, reduce, grad_norm: torch.Tensor | None = None,
                 checkpoint_kept: bool = True) -> tuple[list[float], list[float]]:
    """Read the training losses of the W steps ending at `step`, and stop every rank if one is not finite.

    loss [W] (or 0-dim: W = 1): this rank's losses of steps step-W+1 .. step, a step numbered by the
    global_step it runs at (0-based); grad_norm [W] or None: their gradient norms (the same on every rank,
    taken from the averaged gradients). `reduce` is the strategy's (tensor, reduce_op) -> tensor: one
    all-reduce (sum) of the losses and their non-finite flags under DDP, the identity on one device; then
    one copy to the host. Every rank reads the same sums, so all raise NonFiniteLossError together (none is
    left waiting in the next collective), naming the first step whose loss was not finite on some rank, or
    whose gradient norm was not; the message says whether a checkpoint of earlier steps is kept
    (`checkpoint_kept`). Returns the losses summed over ranks and the gradient norms (empty without
    grad_norm), one per step, as floats.
    """
    loss = loss.detach().reshape(-1).double()
    reduced = reduce(torch.stack([loss, (~torch.isfinite(loss)).double()]), reduce_op="sum")
    norms = grad_norm.detach().reshape(-1).double() if grad_norm is not None else loss.new_zeros(0)
    values = torch.cat([reduced.reshape(-1), norms]).tolist()
    W = loss.numel()
    sums, n_bad, norms = values[:W], values[W:2 * W], values[2 * W:]
    keep = ("The last good checkpoint is kept in checkpoints/last.ckpt" if checkpoint_kept else
            "No checkpoint was written before it") + " (lower optim.lr or check the data)"
    for i in range(W):
        at = step - W + 1 + i
        if n_bad[i] > 0:
            raise NonFiniteLossError(f"loss is {sums[i]} at step {at} (not finite on {int(n_bad[i])} rank(s)); "
                                     f"stopping. {keep}")
        if norms and not math.isfinite(norms[i]):
            raise NonFiniteLossError(f"gradient norm is {norms[i]} at step {at} (the loss was finite); "
                                     f"stopping. {keep}")
    return sums, norms


def clip_grad_norm(params, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Clip the gradients of `params` to global L2 norm `max_norm` (inf: only measure); returns the norm
    before clipping as a 0-dim device tensor (no host sync). Gradients may be DTensor shards (FSDP2): their
    norm is the full gradient's. The factor is torch's, min(1, max_norm / (norm + 1e-6)), in fp32; an
    optimizer with `scale_grads` (Muon) takes it and applies it where its step reads the gradients (no pass
    over them here), else the gradients are multiplied in place (torch.nn.utils.clip_grads_with_norm_)."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if math.isinf(max_norm):
        return norm
    if hasattr(optimizer, "scale_grads"):
        optimizer.scale_grads((max_norm / (norm.float() + 1e-6)).clamp(max=1.0))
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def depth_metrics(diag: dict, prefix: str = "depth") -> dict[str, float]:
    """Flat scalars for metrics.jsonl from one `residual.diagnostics()`: {prefix}/output_rms/{i:02d},
    {prefix}/input_rms/{i:02d}, {prefix}/final_rms and, for AttnRes, per op (op i forms the input of
    sublayer i, the last op the final norm's): {prefix}/query_norm/{op:02d}; {prefix}/weight/{op:02d}/{source}
    and {prefix}/share/{op:02d}/{source}, the mean weight and amplitude share of each source the op sees
    (source: a column label, emb, block1, ... or L0.mix, ...); for ops over >= 2 sources
    {prefix}/entropy/{op:02d} (normalised, 1 = uniform) and {prefix}/max_weight/{op:02d}."""
    out = {f"{prefix}/final_rms": diag["final_rms"]}
    for key in ("output_rms", "input_rms"):
        out.update({f"{prefix}/{key}/{i:02d}": v for i, v in enumerate(diag[key])})
    rows = zip(diag.get("depth_weights") or [], diag.get("depth_shares") or [], diag.get("entropy", []),
               diag.get("max_weight", []), diag.get("query_norm", []))
    for op, (weights, shares, entropy, max_weight, query_norm) in enumerate(rows):
        out[f"{prefix}/query_norm/{op:02d}"] = query_norm
        for source, weight, share in zip(diag["column_labels"], weights, shares):
            if not math.isnan(weight):
                out[f"{prefix}/weight/{op:02d}/{source}"] = weight
                out[f"{prefix}/share/{op:02d}/{source}"] = share
        if not math.isnan(entropy):
            out[f"{prefix}/entropy/{op:02d}"] = entropy
            out[f"{prefix}/max_weight/{op:02d}"] = max_weight
    return out


class TrainMetrics(L.Callback):
    """Writes the training module's metrics row of each log step (K3LitModule.log_train_step) before any
    checkpoint of that step. Lightning runs the callbacks' on_train_batch_end before the module's, and the
    checkpoint callbacks last among them; a row written from the module's own hook would follow its step's
    checkpoint, and a run killed between the two would resume after a step whose row is missing."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log_train_step()


class K3LitModule(L.LightningModule):
    def __init__(self, model: K3Model, optim_cfg: OptimConfig, max_steps: int, log_every: int,
                 tokens_per_step: int, flops_per_token: float, ckpt_every: int = 0):
        super().__init__()
        self.model = model
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps
        self.log_every = log_every
        self.ckpt_every = ckpt_every
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops()
        self._step_loss: torch.Tensor | None = None
        self._window: list[torch.Tensor] = []  # per step since the last read: [loss, grad norm] on the device
        self._loss_sum, self._loss_count, self._steps = 0.0, 0, 0  # since the last log: read losses, steps run
        self._grad_norm = float("nan")
        self.last_train_loss = float("nan")  # mean over ranks and steps since the last log, as of the last read
        self._t_last = time.perf_counter()
        self._val_totals: torch.Tensor | None = None
        self.last_val: dict[str, float] = {}
        self.last_depth: dict = {}
        self.elapsed_offset = 0.0  # wall time of the run before a resume
        self._t_start = time.perf_counter()

    def on_fit_start(self):
        self._t_start = self._t_last = time.perf_counter()

    # --- training -------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        x, y = batch
        torch.compiler.cudagraph_mark_step_begin()
        loss = self.model(x, y).mean
        self._step_loss = loss.detach()
        self._steps += 1
        return loss + self.model.aux_loss()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Clip to optim.grad_clip, and read the window when the step about to be taken logs or is saved."""
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        norm = clip_grad_norm(self.parameters(), clip, optimizer)
        self._window.append(torch.stack([self._step_loss.float(), norm.float()]))
        if self.read_due(self.global_step + 1):
            self.read_window(self.global_step)

    def read_due(self, done: int) -> bool:
        """Whether the window is read in the step after which `done` optimizer steps are complete: it logs
        (a multiple of log_every, or the last step) or the checkpoint callback saves after it."""
        return (done % self.log_every == 0 or done == self.max_steps
                or (self.ckpt_every > 0 and done % self.ckpt_every == 0))

    def read_window(self, last_step: int) -> None:
        """check_finite on the window, whose last step is `last_step` (0-based); adds its losses to the log's."""
        window = torch.stack(self._window)  # [W, 2]
        self._window = []
        sums, norms = check_finite(window[:, 0], last_step, self.trainer.strategy.reduce, window[:, 1],
                                   checkpoint_kept=self.checkpoint_written())
        self._loss_sum += sum(sums)
        self._loss_count += len(sums) * self.trainer.world_size
        self._grad_norm = norms[-1]
        self.last_train_loss = self._loss_sum / self._loss_count

    def checkpoint_written(self) -> bool:
        """Whether the run directory holds a checkpoint (what a stopped run's message can promise)."""
        callback = self.trainer.checkpoint_callback
        return callback is not None and callback.dirpath is not None and (Path(callback.dirpath) / "last.ckpt").exists()

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.model.update_router_biases()  # bias from step t is used from step t+1 (K3 §2.3)

    def log_train_step(self) -> None:
        """The training metrics of the step just taken, at a log step (TrainMetrics calls it)."""
        step = self.global_step
        if step % self.log_every and step != self.max_steps:
            return
        now = time.perf_counter()
        tokens_per_s = self._steps * self.tokens_per_step / max(now - self._t_last, 1e-9)
        groups = {g["name"]: g["lr"] for g in self.optimizers().param_groups}
        metrics = {
            "loss/train": self.last_train_loss,  # the global batch: mean over every rank's steps since the last log
            "optim/lr": groups.get("muon", groups.get("adamw")),
            "optim/lr_adamw": groups.get("adamw", groups.get("adamw_no_decay")),
            # groups a layer asked for (the `adamw_group` tag), e.g. optim/lr_attnres
            **{f"optim/lr_{name}": lr for name, lr in groups.items() if name not in CORE_GROUPS},
            "optim/grad_norm": self._grad_norm,
            "speed/tokens_per_s": tokens_per_s,
            **self.router_metrics(),
        }
        if self.peak_flops:
            metrics["speed/mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * self.trainer.world_size)
        self.log_metrics(metrics)
        self._loss_sum, self._loss_count, self._steps, self._t_last = 0.0, 0, 0, now

    def router_metrics(self) -> dict[str, float]:
        """moe/<stat>/layer<i> of every MoE layer (MoE.stats_tensor) and their mean moe/maxvio, read from the
        device in one copy."""
        layers = [(i // 2, sub.fn) for i, sub in enumerate(self.model.sublayers) if isinstance(sub.fn, MoE)]
        if not layers:
            return {}
        values = torch.stack([moe.stats_tensor() for _, moe in layers]).tolist()
        out = {f"moe/{name}/layer{layer}": v for (layer, _), row in zip(layers, values) for name, v in zip(STATS, row)}
        out["moe/maxvio"] = sum(row[0] for row in values) / len(values)
        return out

    def log_metrics(self, metrics: dict[str, float]) -> None:
        metrics = {**metrics, "time/elapsed_s": self.elapsed_offset + time.perf_counter() - self._t_start}
        for logger in self.trainer.loggers:
            logger.log_metrics(dict(metrics), step=self.global_step)

    # --- validation -----------------------------------------------------------------------------
    def on_validation_epoch_start(self):
        if self._window:  # training stopped between reads (a callback): name its bad step, not the NaN it causes
            self.read_window(self.global_step - 1)
        self.model.residual.record = True  # depth diagnostics (output RMS per sublayer, AttnRes weights)

    def validation_step(self, batch, batch_idx):
        """Eager even when the model is compiled: dynamo would otherwise add inference graphs (and, with the
        depth recording on, graphs of its own) to every compiled frame, which with graph-breaking sublayers
        (MoE) passes its recompile limit; validation is a small share of a run's steps."""
        x, y = batch
        with torch.compiler.set_stance("force_eager"):
            out = self.model(x, y)
        totals = torch.stack([out.sum.double(), out.correct.double(), out.count.double()])
        self._val_totals = totals if self._val_totals is None else self._val_totals + totals

    def on_validation_epoch_end(self):
        totals = self._val_totals if self._val_totals is not None else torch.zeros(3, dtype=torch.float64,
                                                                                    device=self.device)
        self._val_totals = None
        loss_sum, correct, count = self.trainer.strategy.reduce(totals, reduce_op="sum").tolist()
        self.model.residual.record = False
        self.last_depth = {**self.model.residual.diagnostics(), "step": self.global_step}
        if count == 0 or self.trainer.sanity_checking:
            return
        self.last_val = {"loss/val": loss_sum / count, "acc/val": correct / count}
        self.log_metrics({**self.last_val, **depth_metrics(self.last_depth)})
        if not math.isfinite(self.last_val["loss/val"]):
            raise NonFiniteLossError(f"validation loss is {self.last_val['loss/val']} at step {self.global_step}")

    # --- sharding and optimisation ----------------------------------------------------------------
    def configure_model(self):
        """Under trainer=fsdp (ModelParallelStrategy, which sets `device_mesh`), shard the model over the
        data-parallel mesh (k3lab.parallel.shard_model), once: Lightning calls this hook again for each
        trainer.validate/fit. Other strategies pass no mesh, and the model stays as it is.

        The mesh must span every process: the model's own collectives (QB quantiles, router load, the
        NaN flag; k3lab/distributed.py) pool over the default (world) process group, which is then
        exactly the data-parallel group."""
        mesh = self.device_mesh
        if mesh is None or is_sharded(self.model):
            return
        dp = mesh["data_parallel"]
        if dp.size() != self.trainer.world_size:
            raise ValueError(f"the data-parallel mesh has {dp.size()} of {self.trainer.world_size} processes; "
                             "k3lab pools router statistics over all processes, so every process must be a "
                             "data-parallel rank")
        shard_model(self.model, dp, bf16=self.trainer.precision == "bf16-mixed")

    def configure_optimizers(self):
        return lightning_optimizers(self.model, self.optim_cfg, total_steps=self.max_steps)
