"""Keep BLAS single-threaded around many tiny optimisations.

scipy's L-BFGS-B calls BLAS on 5-vectors thousands of times; a multi-threaded OpenBLAS spends far more
time waking its threads than computing (measured 10-75x slower on a busy 2-core machine). threadpoolctl
limits the loaded BLAS libraries for the duration of a `with` block. Without it, the OpenBLAS builds
that numpy and scipy load are found in /proc/self/maps (Linux) and limited through their
`*_set_num_threads` entry points; elsewhere this is a no-op.
"""
from __future__ import annotations

import contextlib
import ctypes

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # optional dependency
    threadpool_limits = None

_SYMBOLS = [(f"{p}_get_num_threads{s}", f"{p}_set_num_threads{s}")
            for p in ("openblas", "scipy_openblas") for s in ("", "64_")]


def _openblas_handles() -> list[tuple]:
    """(get, set) ctypes functions of every loaded OpenBLAS."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return []
    out = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get, set_ in _SYMBOLS:
            if hasattr(lib, get) and hasattr(lib, set_):
                out.append((getattr(lib, get), getattr(lib, set_)))
                break
    return out


@contextlib.contextmanager
def _openblas_single_thread():
    handles = _openblas_handles()
    before = [get() for get, _ in handles]
    for _, set_ in handles:
        set_(1)
    try:
        yield
    finally:
        for (_, set_), n in zip(handles, before):
            set_(n)


def single_thread_blas():
    """Context manager: BLAS limited to one thread for the duration of the block."""
    if threadpool_limits is not None:
        return threadpool_limits(limits=1, user_api="blas")
    return _openblas_single_thread()
