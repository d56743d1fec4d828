"""The run directory (docs/run_directory.md): its name, metrics.jsonl, summary.json, atomic checkpoints.

`metrics.jsonl` is the source; metrics.csv (written at the end), wandb and TensorBoard are mirrors. Every
line carries `step`, `tokens` and `flops`, derived from the step (tokens per step and FLOPs per token are
fixed per run, so a resumed run continues the same axes). Checkpoints and summary.json are written whole
or not at all (k3lab.fileio), so a kill or a full disk at any moment keeps the previous version.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.load import _METADATA_FILENAME as SHARDED_META  # non-tensor state: loops, global_step
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from k3lab.errors import ConfigError, UserError
from k3lab.fileio import atomic_write, atomic_write_text, remove_stale_temps
from k3lab.sweep import DEVICE_SHARED_ENV


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file, fsync, then rename: a run killed mid-write, or one whose disk fills,
    keeps the previous checkpoint whole."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save(checkpoint, f))


class UnreadableCheckpoint(UserError):
    """checkpoints/last.ckpt exists but cannot be loaded (truncated or damaged outside k3lab's atomic writes)."""


# --- sharded checkpoints (trainer=fsdp): a directory of DCP shards behind the last.ckpt symlink ------
def checkpoint_version(link: Path, step: int) -> str:
    """A name beside `link` that no directory has yet, for the shards of the checkpoint at `step`:
    `<link name>.<step, 8 digits>-<n>`, n counting saves at the same step."""
    n = 0
    while (link.parent / f"{link.name}.{step:08d}-{n}").exists():
        n += 1
    return f"{link.name}.{step:08d}-{n}"


def publish_checkpoint(link: Path, target: Path) -> None:
    """Point the symlink `link` at the finished checkpoint directory `target` (a sibling) in one rename,
    then remove every other `<link name>.*` directory: older checkpoints, and any torn by a kill mid-write.
    The link is relative, so a copied or moved run directory keeps its checkpoint."""
    tmp = link.with_name(f".{link.name}.link{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    if link.is_dir() and not link.is_symlink():  # a directory of shards in its place (os.replace cannot)
        shutil.rmtree(link)
    os.replace(tmp, link)
    for old in link.parent.glob(f"{link.name}.*"):
        if old.name != target.name and old.is_dir():
            shutil.rmtree(old)


def remove_checkpoint(path: Path) -> None:
    """Delete the checkpoint at `path`: a file, or the symlink with every sharded directory beside it."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    for version in path.parent.glob(f"{path.name}.*"):
        if version.is_dir():
            shutil.rmtree(version)


def branch_checkpoint(run_dir: Path, step: int) -> Path:
    """Where a WSD trunk keeps its state at branch point `step`, the start of a cooldown branch
    (k3lab/branches.py): checkpoints/branch-<step>.ckpt, written like last.ckpt (whole or not at all)."""
    return Path(run_dir) / "checkpoints" / f"branch-{step}.ckpt"


def branch_checkpoint_steps(run_dir: Path) -> list[int]:
    """The branch points a trunk's run directory holds a checkpoint of, in order."""
    found = (re.fullmatch(r"branch-(\d+)\.ckpt", p.name) for p in (Path(run_dir) / "checkpoints").glob("branch-*"))
    return sorted(int(m.group(1)) for m in found if m)


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint was taken at: from the file itself, or from a sharded checkpoint's
    meta.pt (the shards are not read). UnreadableCheckpoint when it cannot be loaded; the checkpoint is left
    as it is: deleting it makes the next run of the same command restart from step 0."""
    path = Path(path)
    meta = path / SHARDED_META if path.is_dir() else path
    try:
        return int(torch.load(meta, map_location="cpu", weights_only=False)["global_step"])
    except Exception as err:  # noqa: BLE001 - a damaged zip, a short read, a missing key: all mean unreadable
        raise UnreadableCheckpoint(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {' '.join(str(err).split())[:200]}); "
            "it is kept as it is: delete it and run the same command again to restart this run from step 0") from err


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
    """The commit of the code that runs: $K3LAB_GIT_REV when set (a copy of the tree without its git
    history, e.g. on a remote machine, is told its commit), else `git rev-parse --short HEAD`, with
    "-dirty" when tracked files differ from it; None outside a git checkout."""
    if os.environ.get("K3LAB_GIT_REV"):
        return os.environ["K3LAB_GIT_REV"]
    git = ["git", "-C", str(Path(__file__).parent)]
    try:
        rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        if not rev.stdout.strip():
            return None
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def cpu_threads(threads: int | None, processes: int = 1) -> int:
    """CPU threads for one training process: `threads` (trainer.threads) when set, else the cores this
    process may use (its affinity, shared among the run's `processes` on the machine) less what the rest of
    the machine keeps busy (the 1-minute load average), at least 1. On a 2-core machine a run's intra-op
    threads that wait for a core held by other work stall every op (OpenMP's barriers spin), so a busy
    machine gets fewer threads (docs/default_run.md has the measurement)."""
    if threads:
        return threads
    cores = max(1, len(os.sched_getaffinity(0)) // max(1, processes))
    return max(1, min(cores, round(cores - os.getloadavg()[0])))


def cpu_load() -> float:
    """The machine's 1-minute load average: runnable processes, averaged."""
    return os.getloadavg()[0]


def environment() -> dict[str, Any]:
    """Where the run trains: versions, git revision, device and its threads."""
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
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # as the launcher set it (joblib, SLURM)
        "threads": torch.get_num_threads(),
    }


def device_sharing(load_start: float, threads: int) -> dict[str, Any]:
    """Whether the run shared its device, so that its tokens/s is not the config's own, and why. A GPU is shared
    when whoever started the run says so (DEVICE_SHARED_ENV: k3lab.sweep.DevicePerJob, a study's slice script);
    a CPU also when the rest of the machine kept at least half a core busy at the run's start or now (the
    1-minute load average, less this run's own `threads` now that it has run for a while)."""
    reasons = [f"{DEVICE_SHARED_ENV}=1"] if os.environ.get(DEVICE_SHARED_ENV) == "1" else []
    if torch.cuda.is_available():
        return {"device_shared": bool(reasons), "device_shared_why": "; ".join(reasons) or None}
    load_now = cpu_load()
    others = max(load_start, load_now - threads)
    if others >= 0.5:
        reasons.append(f"other work kept {others:.1f} cores of the CPU busy")
    return {"cpu_load": {"start": round(load_start, 2), "now": round(load_now, 2)}, "device_shared": bool(reasons),
            "device_shared_why": "; ".join(reasons) or None}


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Summary:
    """summary.json: written with status 'running' at start, updated in place, finalised at the end."""

    def __init__(self, run_dir: Path, fields: dict[str, Any], elapsed_s: float = 0.0):
        """elapsed_s: wall time the run already spent before this process (a resume), so wall_time_s adds up."""
        self.path = Path(run_dir) / "summary.json"
        self.data = {**read_summary(run_dir), **fields, "status": "running", "error": None}
        self.data.setdefault("started_at", now_iso())
        self.t0 = time.time() - elapsed_s
        self.write()

    def add_elapsed(self, seconds: float) -> None:
        """Count `seconds` of training that preceded this process (a branch's shared prefix) in wall_time_s."""
        self.t0 -= seconds

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
def file_name_part(text: str) -> str:
    """`text` as part of a file or directory name: letters, digits and `=,._+-` kept, anything else `_`."""
    return re.sub(r"[^A-Za-z0-9=,._+-]", "_", text)


def default_run_name(overrides: list[str], max_len: int = 120) -> str:
    """'decay=softplus seed=1' -> 'decay=softplus,seed=1'; no overrides -> 'k3'. A name longer than
    max_len keeps its first characters and ends in a hash of the whole name (file systems cap names at 255)."""
    skip = ("resume=", "out_dir=", "group=", "run_name=", "overwrite=", "trainer=", "logger=", "sweep=", "hydra")
    kept = sorted(o for o in overrides if not o.startswith(skip))
    name = file_name_part(",".join(kept)) or "k3"
    if len(name) > max_len:
        name = f"{name[:max_len - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def find_resume_dir(out_dir: str, resume: str) -> Path:
    """The run directory `resume` names: a path (as the project prints them), or `last`, the unfinished run
    (a checkpoint, and summary.json not `completed`) under out_dir whose checkpoint is the newest."""
    if resume == "last":
        unfinished = [p.parent.parent for p in Path(out_dir).glob("**/checkpoints/last.ckpt")
                      if read_summary(p.parent.parent).get("status") != "completed"]
        if not unfinished:
            raise ConfigError(f"resume=last: no unfinished run (a checkpoint, and not completed) under "
                              f"{Path(out_dir).resolve()}")
        return max(unfinished, key=lambda d: (d / "checkpoints" / "last.ckpt").stat().st_mtime)
    run_dir = Path(resume.rstrip("/")).expanduser()
    if not (run_dir / "checkpoints" / "last.ckpt").exists():
        raise ConfigError(f"resume={resume}: no checkpoint at {run_dir / 'checkpoints' / 'last.ckpt'}")
    return run_dir


# The keys that do not change what a run computes: where and under which name it is written, how it was
# started, its mirrors, its kernels and device layout, caches and workers. Any other difference between a
# run directory's config.yaml and the command run again makes it another run (config_changes).
IDENTITY_FREE = ("run_name", "group", "out_dir", "resume", "overwrite", "kernels", "logger", "trainer.accelerator",
                 "trainer.devices", "trainer.strategy", "trainer.num_nodes", "data.cache_dir", "data.num_workers",
                 "train.preempt_signal", "train.compile", "train.compile_backend")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config container as {dotted key: value}, lists kept whole."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def _identity(cfg: DictConfig | dict) -> dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    return {k: v for k, v in _flat(container).items() if not any(k == f or k.startswith(f + ".") for f in IDENTITY_FREE)}


def config_fingerprint(cfg: DictConfig) -> str:
    """A short hash of what the run computes: its resolved config less IDENTITY_FREE."""
    return hashlib.sha256(json.dumps(_identity(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_changes(saved: DictConfig, cfg: DictConfig) -> list[str]:
    """What differs between a run directory's config.yaml and the config of the command run again, as
    `optim.lr: 0.006 -> 0.003`. A key the saved config lacks (added to the schema since it was written)
    counts only when its new value is not the schema's default."""
    from k3lab.config import RunConfig

    old, new = _identity(saved), _identity(cfg)
    default = _identity(OmegaConf.structured(RunConfig))
    changes = []
    for key in sorted(old.keys() | new.keys()):
        if key not in old and new[key] == default.get(key, object()):
            continue
        before, after = old.get(key, "(absent)"), new.get(key, "(not a key)")
        if before != after:
            changes.append(f"{key}: {before} -> {after}")
    return changes


class RunDirBusy(UserError, RuntimeError):
    """Another live process holds the run directory's lock."""


class RunPlan(NamedTuple):
    """What `prepare_run_dir` decided: the config to train, where, and how to start."""
    cfg: DictConfig
    run_dir: Path
    ckpt_path: Path | None   # resume from this checkpoint, or None to start from step 0
    action: str              # "new" | "resume" | "restart" (a failed or dead run with no checkpoint) | "skip"
    previous: dict           # the summary.json found in the directory ({} if none)
    fingerprint: str = ""    # config_fingerprint of the config it trains
    reason: str = ""         # a line for the user: why it skips, or that the code changed since the run began


def read_summary(run_dir: Path) -> dict:
    """summary.json of `run_dir`, or {} when it is missing or unreadable."""
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


_LOCKS: dict[Path, Any] = {}  # run directory -> the open lock file this process holds until it exits


def lock_run_dir(run_dir: Path) -> None:
    """Hold an exclusive advisory lock (flock on <run_dir>/.lock, pid inside) for this process's life, so two
    processes never train into one directory; a process that dies releases it with its file descriptors."""
    import fcntl

    path = Path(run_dir).resolve()
    if path in _LOCKS:
        return
    f = open(path / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RunDirBusy(f"run directory {run_dir} is in use by another process (pid {holder}); "
                         f"wait for it, or pass run_name=<new name>") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    _LOCKS[path] = f


def unlock_run_dir(run_dir: Path) -> None:
    """Give up this process's lock on `run_dir` (a run it found completed and skipped)."""
    import fcntl

    f = _LOCKS.pop(Path(run_dir).resolve(), None)
    if f is not None:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _decide(overwrite: bool, previous: dict, has_checkpoint: bool) -> str:
    """How a run starts from what its directory holds (the table of prepare_run_dir)."""
    if overwrite:
        return "new"
    if previous.get("status") == "completed":
        return "skip"
    if has_checkpoint:
        return "resume"
    return "restart" if previous else "new"


def _code_note(previous: dict) -> str:
    """' (trained at abc123; the code is now def456)' when the run's git revision is not the current one."""
    then, now = previous.get("git_rev"), git_revision()
    return f" (trained at {then}; the code is now {now})" if then and now and then != now else ""


def _refuse_changed(run_dir: Path, saved: DictConfig, cfg: DictConfig, previous: dict) -> None:
    """ConfigChanged when the command's config is not the one the directory was trained with."""
    changes = config_changes(saved, cfg)
    if changes:
        shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
        status = previous.get("status", "started")
        kind = "a completed run" if status == "completed" else f"an unfinished run (status {status})"
        raise ConfigChanged(f"{run_dir} holds {kind} of another config ({shown}): add overwrite=true to "
                            f"train it again from scratch, or run_name=<new name> to keep both")


class ConfigChanged(UserError):
    """The same command meets a run directory whose config.yaml differs from the command's config."""


def prepare_run_dir(cfg: DictConfig, overrides: list[str]) -> RunPlan:
    """Decide how this run starts, from what its directory holds, so the same command can be run again:

        nothing there, or overwrite=true        new       start at step 0 (overwrite clears the old files)
        summary says completed                  skip      nothing to do
        a checkpoint (killed, failed, running)  resume    continue from checkpoints/last.ckpt
        failed or dead before any checkpoint    restart   start at step 0 again

    A directory whose config.yaml differs from this config (config_changes: any key but IDENTITY_FREE) is
    neither skipped nor resumed: ConfigChanged names the keys and what to do. A directory trained at another
    git revision is skipped or resumed with a line that says so (`reason`). `resume=<dir>` or `resume=last`
    names the directory instead and continues it with its own config.yaml; a completed one is left as it is
    (skip). A cooldown branch (train.trunk set) starts its new and restarted runs from its trunk's checkpoint
    at its branch point instead of step 0 (k3lab/branches.py); a new or restarted run drops the branch-point
    checkpoints of an earlier run in its directory with its other files. A directory whose lock a live process holds raises RunDirBusy. The decision is taken while
    holding the lock, from what the directory holds then (a process that held it may have completed the run
    meanwhile); only a run already completed is skipped without the lock, since another live process may
    still hold it (a sweep keeps its runs' locks until it exits). Under DDP every rank takes the same
    decision from the same files; only rank 0 locks and writes. Temporary files that killed writers left
    behind are removed."""
    if cfg.resume:
        run_dir = find_resume_dir(str(cfg.out_dir), str(cfg.resume))
        saved, previous = OmegaConf.load(run_dir / "config.yaml"), read_summary(run_dir)
        if previous.get("status") == "completed":
            return RunPlan(saved, run_dir, None, "skip", previous, config_fingerprint(saved),
                           f"completed already ({previous.get('steps')} steps), nothing to resume")
        if rank_zero_only.rank == 0:
            lock_run_dir(run_dir)
            _remove_stale_temps(run_dir)
        return RunPlan(saved, run_dir, run_dir / "checkpoints" / "last.ckpt", "resume", previous,
                       config_fingerprint(saved), _code_note(previous).strip(" ()"))
    run_dir = Path(str(cfg.out_dir)) / str(cfg.group) / str(cfg.run_name or default_run_name(overrides))
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    previous = read_summary(run_dir)
    fingerprint = config_fingerprint(cfg)
    saved_path = run_dir / "config.yaml"
    if not cfg.overwrite and saved_path.exists() and (previous.get("status") == "completed" or ckpt.exists()):
        _refuse_changed(run_dir, OmegaConf.load(saved_path), cfg, previous)
    if rank_zero_only.rank != 0:  # a DDP worker that Lightning started from this script: rank 0 owns the directory
        action = _decide(cfg.overwrite, previous, ckpt.exists())
        if action == "resume":
            return RunPlan(OmegaConf.load(saved_path), run_dir, ckpt, action, previous, fingerprint)
        return RunPlan(OmegaConf.merge(cfg, {"run_name": run_dir.name}), run_dir, None, action, previous, fingerprint)
    skipped = f"completed already{_code_note(previous)}, skipped (overwrite=true trains it again)"
    if not cfg.overwrite and previous.get("status") == "completed":
        return RunPlan(cfg, run_dir, None, "skip", previous, fingerprint, skipped)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_run_dir(run_dir)
    previous = read_summary(run_dir)
    action = _decide(cfg.overwrite, previous, ckpt.exists())
    if action == "skip":
        unlock_run_dir(run_dir)
        return RunPlan(cfg, run_dir, None, action, previous, fingerprint, skipped)
    _remove_stale_temps(run_dir)
    if action == "resume":
        return RunPlan(OmegaConf.load(saved_path), run_dir, ckpt, action, previous, fingerprint,
                       _code_note(previous).strip(" ()"))
    remove_checkpoint(run_dir / "checkpoints" / "last.ckpt")  # first: never a checkpoint without its summary
    for step in branch_checkpoint_steps(run_dir):  # a trunk's branch points: its branches would start from them
        remove_checkpoint(branch_checkpoint(run_dir, step))
    for name in ("summary.json", "metrics.jsonl", "metrics.csv"):
        (run_dir / name).unlink(missing_ok=True)
    cfg = OmegaConf.merge(cfg, {"run_name": run_dir.name})
    OmegaConf.save(cfg, saved_path, resolve=True)
    OmegaConf.save(OmegaConf.create(list(overrides)), run_dir / "overrides.yaml")
    return RunPlan(cfg, run_dir, None, action, previous, fingerprint)


def _remove_stale_temps(run_dir: Path) -> None:
    """Half-written files (a checkpoint, summary.json) of a process killed while writing them; the caller holds the lock."""
    for folder in (run_dir, run_dir / "checkpoints"):
        remove_stale_temps(folder)


def truncate_metrics(run_dir: Path, last_step: int) -> float:
    """On resume, drop lines logged after the checkpoint (rank 0 rewrites the file), so the resumed run
    continues one curve. Returns the training time already spent (the last kept `time/elapsed_s`), from
    which the resumed run's clocks continue."""
    rows = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
    if rank_zero_only.rank == 0:
        atomic_write_text(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return max((r["time/elapsed_s"] for r in rows if r.get("time/elapsed_s") is not None), default=0.0)



@rank_zero_only
def write_metrics_csv(run_dir: Path) -> None:
    """metrics.csv, a mirror of metrics.jsonl for spreadsheet users (one column per key)."""
    import pandas as pd

    rows = read_metrics(run_dir)
    if rows:
        pd.DataFrame(rows).to_csv(run_dir / "metrics.csv", index=False)
