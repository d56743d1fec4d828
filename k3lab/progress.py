"""What a run prints: a header (sizes, FLOPs, the loss floor) and progress, in a terminal and in a log file.

Both show the same: step, share done, the training loss, the last validation loss, tokens/s, elapsed time
and an ETA. In a terminal (stdout a TTY) a Rich progress bar redraws one line and prints a line per
validation above it (`RichProgress`); when stdout is a file (SLURM, nohup, CI), one plain line every few
percent of the run instead of carriage-return redraws (`LineProgress`), and tables without colour codes
(k3lab.console). The ETA divides the steps left by the mean rate since the first step ended, so the first
step's compilation and warm-up do not swing it, and validations count as part of the run's pace.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table

from k3lab.budget import RunLength
from k3lab.config import RunConfig
from k3lab.console import console
from k3lab.switches import SWITCHES


class Pace:
    """Steps, rate and ETA of a run since its first step ended (that step's compile time left out)."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.t_start = self.t0 = time.perf_counter()
        self.step0: int | None = None

    def update(self, step: int) -> dict[str, str]:
        """The fields shown at optimizer step `step` (steps done): elapsed, tokens/s factor and ETA as text."""
        now = time.perf_counter()
        if self.step0 is None:
            self.t0, self.step0 = now, step
        rate = (step - self.step0) / (now - self.t0) if step > self.step0 else 0.0
        eta = (self.max_steps - step) / rate if rate > 0 else math.nan
        return {"elapsed": clock(now - self.t_start), "eta": clock(eta), "rate": rate}


def fields(pl_module, pace: Pace, step: int) -> dict[str, str]:
    """Loss, last validation loss, tokens/s, elapsed and ETA at `step`, as text. The loss is the module's
    `last_train_loss` (the mean over ranks and steps since the last log, as of its last read from the
    device; `-` before the first read), so showing it adds no host sync."""
    p = pace.update(step)
    loss = pl_module.last_train_loss
    val = pl_module.last_val.get("loss/val")
    return {"loss": "-" if math.isnan(loss) else f"{loss:.3f}", "val": "-" if val is None else f"{val:.3f}",
            "tok_s": f"{p['rate'] * pl_module.tokens_per_step / 1e3:.1f}k" if p["rate"] else "-",
            "elapsed": p["elapsed"], "eta": p["eta"]}


def validation_line(trainer, pl_module) -> str | None:
    """`step 200: val loss 3.3100 acc 0.412`, or None when there is nothing to show."""
    if not pl_module.last_val or trainer.sanity_checking or not trainer.is_global_zero:
        return None
    return (f"step {trainer.global_step}: val loss {pl_module.last_val['loss/val']:.4f} "
            f"acc {pl_module.last_val['acc/val']:.3f}")


class LineProgress(Callback):
    """Prints `step 120/600 (20%) | loss 5.123 | val 5.301 | 14.2k tok/s | elapsed 0:31 | eta 2:04` about 20
    times a run, and a line per validation."""

    def __init__(self, max_steps: int, lines: int = 20):
        self.max_steps = max_steps
        self.every = max(1, max_steps // lines)
        self.pace = Pace(max_steps)

    def on_train_start(self, trainer, pl_module):
        self.pace = Pace(self.max_steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.pace.step0 is None:
            self.pace.update(step)
        if not trainer.is_global_zero or (step % self.every and step != self.max_steps):
            return
        f = fields(pl_module, self.pace, step)
        print(f"step {step}/{self.max_steps} ({100 * step / self.max_steps:.0f}%) | loss {f['loss']} | "
              f"val {f['val']} | {f['tok_s']} tok/s | elapsed {f['elapsed']} | eta {f['eta']}", flush=True)

    def on_validation_end(self, trainer, pl_module):
        line = validation_line(trainer, pl_module)
        if line:
            print(line, flush=True)


class RichProgress(Callback):
    """A Rich bar for a terminal: `step 120/600 ━━━━ 20% loss 5.123 val 5.301 14.2k tok/s 0:31 eta 2:04`,
    redrawn every step, with a line per validation printed above it."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.pace = Pace(max_steps)
        self.progress: Progress | None = None

    def on_train_start(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        self.pace = Pace(self.max_steps)
        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}"), BarColumn(), TaskProgressColumn(),
            TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  {task.fields[tok_s]} tok/s  "
                       "{task.fields[elapsed]}  eta {task.fields[eta]}"),
            console=console(120), transient=False)
        self.task = self.progress.add_task("train", total=self.max_steps, completed=trainer.global_step,
                                           loss="-", val="-", tok_s="-", elapsed="0:00", eta="-")
        self.progress.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.progress is not None:
            step = trainer.global_step
            self.progress.update(self.task, completed=step, **fields(pl_module, self.pace, step))

    def on_validation_end(self, trainer, pl_module):
        line = validation_line(trainer, pl_module)
        if self.progress is not None and line:
            self.progress.console.print(line)
            # the bar shows it now: a validation at the last step has no batch end after it to redraw the bar
            self.progress.update(self.task, val=f"{pl_module.last_val['loss/val']:.3f}")

    def on_train_end(self, trainer, pl_module):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def on_exception(self, trainer, pl_module, exception):
        self.on_train_end(trainer, pl_module)


def clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_callback(max_steps: int) -> Callback:
    return RichProgress(max_steps) if sys.stdout.isatty() else LineProgress(max_steps)


@rank_zero_only
def print_run_header(run: RunConfig, run_dir: Path, counts: dict, flops_per_token: float,
                     unigram_entropy: float, tokens_per_step: int, length: RunLength) -> None:
    table = Table(title=f"k3lab run -> {run_dir}", show_header=False)
    for switch in SWITCHES:
        table.add_row(switch, str(getattr(run, switch).name))
    table.add_row("model / data", f"{run.model.name} / {run.data.name}, seed {run.seed}")
    for key, value in counts.items():
        table.add_row(key.replace("_", " "), f"{value:,}")
    table.add_row("FLOPs / token", f"{flops_per_token:.3e}")
    table.add_row("tokens / step", f"{tokens_per_step:,}")
    by = f" (train.{length.set_by}={getattr(run.train, length.set_by)})" if length.set_by in ("tokens_per_param",
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
