"""LightningModule: the training step, validation, router balancing and metric logging around K3Model.

Metrics go straight to the trainer's loggers (JsonlLogger, plus wandb when enabled) with explicit
steps, so every line of metrics.jsonl has a known step and a resumed run continues the same curve.
The loss is checked for NaN/inf on every step (one host sync per step, and under DDP one all-reduce
of a flag so every rank stops together): a bad step must fail before the checkpoint callback can save it.
"""
from __future__ import annotations

import math
import time

import lightning as L
import torch
import torch.nn.functional as F

from k3lab.config import OptimConfig
from k3lab.errors import UserError
from k3lab.model.k3 import K3Model
from k3lab.model.moe import MoE
from k3lab.optim import lightning_optimizers

# dense bf16 peak FLOP/s by device-name fragment, for MFU
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


class NonFiniteLossError(UserError, RuntimeError):
    """The loss stopped being finite; the message gives the step and what to change (printed as one line)."""


def check_finite(loss: torch.Tensor, step: int, reduce) -> None:
    """Raise NonFiniteLossError on every rank when the loss is not finite on any rank. `reduce` is the
    strategy's (tensor, reduce_op) -> tensor: one all-reduce of a flag under DDP, so no rank stops alone
    and leaves the others waiting in the next collective; the identity on one device."""
    bad = reduce(torch.tensor(float(not torch.isfinite(loss)), device=loss.device), reduce_op="sum")
    if bad > 0:
        raise NonFiniteLossError(
            f"loss is {loss.item()} at step {step} (not finite on {int(bad)} rank(s)); stopping. The last "
            f"good checkpoint is kept in checkpoints/last.ckpt (lower optim.lr or check the data)")


def depth_metrics(diag: dict, prefix: str = "depth") -> dict[str, float]:
    """Flat scalars for metrics.jsonl: {prefix}/output_rms/{i:02d}, {prefix}/input_rms/{i:02d},
    {prefix}/final_rms and, for AttnRes, {prefix}/emb_weight/{op:02d} (mean weight on the embedding)."""
    out = {f"{prefix}/final_rms": diag["final_rms"]}
    for key in ("output_rms", "input_rms"):
        out.update({f"{prefix}/{key}/{i:02d}": v for i, v in enumerate(diag[key])})
    for op, row in enumerate(diag.get("depth_weights") or []):
        out[f"{prefix}/emb_weight/{op:02d}"] = row[0]
    return out


class K3LitModule(L.LightningModule):
    def __init__(self, model: K3Model, optim_cfg: OptimConfig, max_steps: int, log_every: int,
                 tokens_per_step: int, flops_per_token: float):
        super().__init__()
        self.model = model
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps
        self.log_every = log_every
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = next((v for k, v in PEAK_FLOPS.items()
                                if torch.cuda.is_available() and k in torch.cuda.get_device_name()), None)
        self._loss_sum, self._loss_count, self._grad_norm = 0.0, 0, float("nan")
        self._t_last = time.perf_counter()
        self._val_loss_sum = self._val_correct = self._val_count = 0
        self.last_val: dict[str, float] = {}
        self.last_depth: dict = {}
        self.elapsed_offset = 0.0  # wall time of the run before a resume
        self._t_start = time.perf_counter()

    def on_fit_start(self):
        self._t_start = self._t_last = time.perf_counter()

    # --- training -------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        check_finite(loss, self.global_step, self.trainer.strategy.reduce)
        self._loss_sum += loss.item()
        self._loss_count += 1
        return loss + self.model.aux_loss().to(loss.device)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters(), clip).item()

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.model.update_router_biases()  # bias from step t is used from step t+1 (K3 §2.3)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        step = self.global_step
        if step % self.log_every and step != self.max_steps:
            return
        now = time.perf_counter()
        tokens_per_s = self._loss_count * self.tokens_per_step / max(now - self._t_last, 1e-9)
        # the training loss of the global batch: mean over every rank's micro-batches (one all-reduce)
        totals = torch.tensor([self._loss_sum, self._loss_count], dtype=torch.float64, device=self.device)
        loss_sum, loss_count = self.trainer.strategy.reduce(totals, reduce_op="sum").tolist()
        groups = {g["name"]: g["lr"] for g in self.optimizers().param_groups}
        metrics = {
            "loss/train": loss_sum / max(loss_count, 1),
            "optim/lr": groups.get("muon", groups.get("adamw")),
            "optim/lr_adamw": groups.get("adamw", groups.get("adamw_no_decay")),
            "optim/grad_norm": self._grad_norm,
            "speed/tokens_per_s": tokens_per_s,
            **self.router_metrics(),
        }
        if self.peak_flops:
            metrics["speed/mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * self.trainer.world_size)
        self.log_metrics(metrics)
        self._loss_sum, self._loss_count, self._t_last = 0.0, 0, now

    def router_metrics(self) -> dict[str, float]:
        out, maxvio = {}, []
        for i, sub in enumerate(self.model.sublayers):
            if isinstance(sub.fn, MoE):
                for name, value in sub.fn.stats().items():
                    out[f"moe/{name}/layer{i // 2}"] = value
                maxvio.append(out[f"moe/maxvio/layer{i // 2}"])
        if maxvio:
            out["moe/maxvio"] = sum(maxvio) / len(maxvio)
        return out

    def log_metrics(self, metrics: dict[str, float]) -> None:
        metrics = {**metrics, "time/elapsed_s": self.elapsed_offset + time.perf_counter() - self._t_start}
        for logger in self.trainer.loggers:
            logger.log_metrics(dict(metrics), step=self.global_step)

    # --- validation -----------------------------------------------------------------------------
    def on_validation_epoch_start(self):
        self.model.residual.record = True  # depth diagnostics (output RMS per sublayer, AttnRes weights)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        mask = y != -100
        self._val_loss_sum += F.cross_entropy(logits[mask], y[mask], reduction="sum").item()
        self._val_correct += (logits[mask].argmax(-1) == y[mask]).sum().item()
        self._val_count += mask.sum().item()

    def on_validation_epoch_end(self):
        totals = torch.tensor([self._val_loss_sum, self._val_correct, self._val_count], dtype=torch.float64,
                              device=self.device)
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        loss_sum, correct, count = totals.tolist()
        self._val_loss_sum = self._val_correct = self._val_count = 0
        self.model.residual.record = False
        self.last_depth = self.model.residual.diagnostics()
        if count == 0 or self.trainer.sanity_checking:
            return
        self.last_val = {"loss/val": loss_sum / count, "acc/val": correct / count}
        self.log_metrics({**self.last_val, **depth_metrics(self.last_depth)})
        if not math.isfinite(self.last_val["loss/val"]):
            raise NonFiniteLossError(f"validation loss is {self.last_val['loss/val']} at step {self.global_step}")

    # --- optimisation ---------------------------------------------------------------------------
    def configure_optimizers(self):
        return lightning_optimizers(self.model, self.optim_cfg, total_steps=self.max_steps)
