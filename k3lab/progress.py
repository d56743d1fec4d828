"""What a run prints: a header (sizes, FLOPs, the loss floor) and progress that reads well in a log file.

In a terminal, Lightning's RichProgressBar; when stdout is a file (SLURM, nohup, CI), one plain line every
few percent of the run instead of carriage-return redraws, and tables without colour codes (k3lab.console).
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig
from rich.table import Table

from k3lab.budget import RunLength
from k3lab.console import console
from k3lab.switches import SWITCHES


class LineProgress(Callback):
    """Prints `step 120/600 (20%) | loss 5.123 | 14.2k tok/s | elapsed 0:31 | eta 2:04` about 20 times a run.
    The loss is the training module's `last_train_loss` (the mean over ranks and steps since the last log,
    as of its last read from the device; `-` before the first read), so printing adds no host sync."""

    def __init__(self, max_steps: int, lines: int = 20):
        self.max_steps = max_steps
        self.every = max(1, max_steps // lines)

    def on_train_start(self, trainer, pl_module):
        self.t0, self.step0 = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if not trainer.is_global_zero or (step % self.every and step != self.max_steps):
            return
        elapsed = time.perf_counter() - self.t0
        rate = (step - self.step0) / max(elapsed, 1e-9)
        eta = (self.max_steps - step) / max(rate, 1e-9)
        loss = pl_module.last_train_loss  # nan until the first read (a non-finite loss stops the run instead)
        tok_s = rate * pl_module.tokens_per_step
        print(f"step {step}/{self.max_steps} ({100 * step / self.max_steps:.0f}%) | "
              f"loss {'-' if math.isnan(loss) else f'{loss:.3f}'} | "
              f"{tok_s / 1e3:.1f}k tok/s | elapsed {_clock(elapsed)} | eta {_clock(eta)}", flush=True)

    def on_validation_end(self, trainer, pl_module):
        if pl_module.last_val and not trainer.sanity_checking and trainer.is_global_zero:
            print(f"step {trainer.global_step}: val loss {pl_module.last_val['loss/val']:.4f} "
                  f"acc {pl_module.last_val['acc/val']:.3f}", flush=True)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_callback(max_steps: int) -> Callback:
    return RichProgressBar() if sys.stdout.isatty() else LineProgress(max_steps)


@rank_zero_only
def print_run_header(cfg: DictConfig, run_dir: Path, counts: dict, flops_per_token: float,
                     unigram_entropy: float, tokens_per_step: int, length: RunLength) -> None:
    table = Table(title=f"k3lab run -> {run_dir}", show_header=False)
    for switch in SWITCHES:
        table.add_row(switch, str(cfg[switch].name))
    table.add_row("model / data", f"{cfg.model.name} / {cfg.data.name}, seed {cfg.seed}")
    for key, value in counts.items():
        table.add_row(key.replace("_", " "), f"{value:,}")
    table.add_row("FLOPs / token", f"{flops_per_token:.3e}")
    table.add_row("tokens / step", f"{tokens_per_step:,}")
    by = f" (train.{length.set_by}={cfg.train[length.set_by]})" if length.set_by in ("tokens_per_param",
                                                                                  "flop_budget") else ""
    table.add_row("steps", f"{length.max_steps:,}{by}")
    table.add_row("training FLOPs", f"{flops_per_token * tokens_per_step * length.max_steps:.3e}")
    table.add_row("unigram entropy", f"{unigram_entropy:.4f} nats (the loss of a frequency-only model)")
    console(110).print(table)


@rank_zero_only
def print_final(s: dict) -> None:
    """The last line of a run: its validation loss against the unigram floor, length and wall time."""
    if s.get("loss_val_final") is None:
        print(f"done: no validation loss, {s['steps']} steps, {s['wall_time_s']:.0f} s")
        return
    gap = s["unigram_entropy"] - s["loss_val_final"]
    where = f"{gap:.3f} nats below" if gap >= 0 else f"{-gap:.3f} nats above"
    print(f"done: val loss {s['loss_val_final']:.4f} ({where} the unigram entropy {s['unigram_entropy']:.4f}), "
          f"{s['steps']} steps, {s['tokens']:,} tokens, {s['wall_time_s']:.0f} s")
