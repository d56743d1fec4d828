"""The run directory (docs/run_directory.md): its name, metrics.jsonl, summary.json, atomic checkpoints.

`metrics.jsonl` is the source; metrics.csv (written at the end) and wandb are mirrors. Every line carries `step`,
`tokens` and `flops`, derived from the step (tokens per step and FLOPs per token are fixed per run,
so a resumed run continues the same axes).
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf


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


# --- where a run lives: naming, resuming, the metrics mirror --------------------------------------
def default_run_name(overrides: list[str]) -> str:
    """'decay=softplus seed=1' -> 'decay=softplus,seed=1'; no overrides -> 'k3'."""
    skip = ("resume=", "out_dir=", "group=", "run_name=", "overwrite=", "trainer=", "logger=", "sweep=", "hydra")
    kept = sorted(o for o in overrides if not o.startswith(skip))
    return re.sub(r"[^A-Za-z0-9=,._+-]", "_", ",".join(kept)) or "k3"


def find_resume_dir(cfg: DictConfig) -> Path:
    if cfg.resume == "last":
        candidates = sorted(Path(cfg.out_dir).glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise FileNotFoundError(f"resume=last: no checkpoints/last.ckpt under {Path(cfg.out_dir).resolve()}")
        return candidates[-1].parent.parent
    run_dir = Path(cfg.resume)
    if not (run_dir / "checkpoints" / "last.ckpt").exists():
        raise FileNotFoundError(f"resume={cfg.resume}: no checkpoint at {run_dir / 'checkpoints' / 'last.ckpt'}")
    return run_dir


def prepare_run_dir(cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, Path, Path | None]:
    """Returns (config to use, run directory, checkpoint to resume from or None)."""
    if cfg.resume:
        run_dir = find_resume_dir(cfg)
        saved = OmegaConf.load(run_dir / "config.yaml")
        return saved, run_dir, run_dir / "checkpoints" / "last.ckpt"
    run_dir = Path(str(cfg.out_dir)) / str(cfg.group) / str(cfg.run_name or default_run_name(overrides))
    if rank_zero_only.rank != 0:  # a DDP worker that Lightning started from this script: rank 0 owns the directory
        return OmegaConf.merge(cfg, {"run_name": run_dir.name}), run_dir, None
    if (run_dir / "summary.json").exists() and not cfg.overwrite:
        raise FileExistsError(f"run directory {run_dir} exists; pass resume={run_dir} to continue it, "
                              f"overwrite=true to start it again, or run_name=<new name>")
    if cfg.overwrite and run_dir.exists():
        for name in ("metrics.jsonl", "metrics.csv", "summary.json", "checkpoints/last.ckpt"):
            (run_dir / name).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = OmegaConf.merge(cfg, {"run_name": run_dir.name})
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    OmegaConf.save(OmegaConf.create(list(overrides)), run_dir / "overrides.yaml")
    return cfg, run_dir, None


@rank_zero_only
def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """On resume, drop lines logged after the checkpoint, so the resumed run continues one curve."""
    rows = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))



@rank_zero_only
def write_metrics_csv(run_dir: Path) -> None:
    """metrics.csv, a mirror of metrics.jsonl for spreadsheet users (one column per key)."""
    import pandas as pd

    rows = read_metrics(run_dir)
    if rows:
        pd.DataFrame(rows).to_csv(run_dir / "metrics.csv", index=False)
