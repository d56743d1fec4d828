"""The run directory (docs/run_directory.md): metrics.jsonl, summary.json and atomic checkpoints.

`metrics.jsonl` is the source; Lightning's CSVLogger and wandb are mirrors. Every line carries `step`,
`tokens` and `flops`, derived from the step (tokens per step and FLOPs per token are fixed per run,
so a resumed run continues the same axes).
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file, then rename: a run killed mid-write keeps the previous checkpoint."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)


class JsonlLogger(Logger):
    """Appends one JSON object per logging call to <run_dir>/metrics.jsonl, adding tokens and flops."""

    def __init__(self, run_dir: Path, tokens_per_step: int, flops_per_token: float):
        super().__init__()
        self.run_dir = Path(run_dir)
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return ""

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass  # config.yaml holds the full config

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        step = int(metrics.pop("step", step or 0))
        metrics.pop("epoch", None)
        tokens = step * self.tokens_per_step
        row = {"step": step, "tokens": tokens, "flops": tokens * self.flops_per_token}
        row.update({k: _plain(v) for k, v in metrics.items()})
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def _plain(v: Any) -> Any:
    v = v.item() if isinstance(v, torch.Tensor) else v
    return None if isinstance(v, float) and not math.isfinite(v) else v


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl as a list of dicts, skipping a truncated last line."""
    rows = []
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment() -> dict[str, Any]:
    import lightning

    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    else:
        device = f"cpu ({torch.get_num_threads()} threads)"
    return {
        "git_rev": git_revision(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "lightning": lightning.__version__},
        "device": device,
    }


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Summary:
    """summary.json: written with status 'running' at start, updated in place, finalised at the end."""

    def __init__(self, run_dir: Path, fields: dict[str, Any]):
        self.path = Path(run_dir) / "summary.json"
        previous = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.data = {**previous, **fields, "status": "running", "error": None}
        self.data.setdefault("started_at", now_iso())
        self.t0 = time.time() - self.data.get("wall_time_s", 0.0)
        self.write()

    def update(self, **fields: Any) -> None:
        self.data.update({k: _plain(v) for k, v in fields.items()})
        self.data["wall_time_s"] = round(time.time() - self.t0, 2)
        self.write()

    def finish(self, status: str, error: str | None = None, **fields: Any) -> None:
        self.update(status=status, error=error, finished_at=now_iso(), **fields)

    @rank_zero_only
    def write(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=2) + "\n")
