"""Files that are whole or absent: every file k3lab writes in place (checkpoints, summary.json, the
rewritten metrics.jsonl, the token cache, token shards' meta.json) goes through `atomic_write`.

The bytes go to a private temporary file beside the target (`.<name>.tmp<pid>`), are flushed to the
disk (fsync), and the temporary file is renamed over the target, so a reader, a crash, a SIGKILL or a
full disk never leaves a torn file: the target is the old version or the new one. A write that fails
removes its temporary file. A process killed while writing leaves one behind; `remove_stale_temps`
clears them from a folder whose lock the caller holds.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMP_GLOB = ".*.tmp[0-9]*"


def temp_path(path: Path) -> Path:
    """Where `atomic_write` writes `path` before renaming it."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(file)` on a temporary file, fsync it, then rename it to `path`."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX); where a folder cannot be opened (Windows) the rename stands alone."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that killed writers left in `folder`; returns them. Only call it while
    holding the folder's lock, so that no live writer's temporary file can be among them."""
    removed = []
    for tmp in Path(folder).glob(TEMP_GLOB):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed
