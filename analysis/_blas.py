"""Keep BLAS single-threaded around many tiny optimisations.

scipy's L-BFGS-B calls BLAS on 5-vectors thousands of times; a multi-threaded OpenBLAS spends far more
time waking its threads than computing (measured 75x slower on a busy 2-core machine). threadpoolctl
limits the loaded BLAS libraries for the duration of a `with` block; without it this is a no-op.
"""
from __future__ import annotations

import contextlib

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # optional dependency
    threadpool_limits = None


def single_thread_blas():
    """Context manager: BLAS limited to one thread (no-op when threadpoolctl is absent)."""
    if threadpool_limits is None:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")
