"""Keep BLAS single-threaded around many tiny optimisations.

scipy's L-BFGS-B calls BLAS on 5-vectors thousands of times; a multi-threaded OpenBLAS spends far more
time waking its threads than computing (measured 10-75x slower on a busy 2-core machine). threadpoolctl
(a dependency) limits the loaded BLAS libraries for the duration of a `with` block.
"""
from threadpoolctl import threadpool_limits


def single_thread_blas():
    """Context manager: BLAS limited to one thread for the duration of the block."""
    return threadpool_limits(limits=1, user_api="blas")
