"""The one timer of the benchmarks: milliseconds per call of a callable, as a median with its quartiles.

    from benchmarks.timing import time_ms
    t = time_ms(step, device, calls=20, warmup=5)    # Timing(median=..., q1=..., q3=..., n=...)

Every benchmark that times a callable (a kernel, a layer's forward and backward, an optimizer step, a whole
training step of the bare loop) goes through `time_ms`, and every table reports the same statistic: the
median of the per-call times, with the interquartile range (first to third quartile) beside it.

- On CUDA: `triton.testing.do_bench`. Each call runs between two CUDA events, with the L2 cache flushed
  before it (so a kernel never reads what the previous call left in cache), after do_bench's own warm-up;
  it returns every call's time. do_bench sizes its work by time, not calls: `time_ms` gives it a budget of
  `calls` times one call's duration (the last warm-up call, timed between two synchronisations), so it
  runs about `calls` timed calls; `Timing.n` says how many it ran.
- Elsewhere: the standard library's `timeit.Timer(fn).repeat(repeat=calls, number=1)`, the same per-call
  times on the host clock (perf_counter, garbage collection paused while timing): exactly `calls` timed
  calls. torch.utils.benchmark.Timer is not used because its `timeit` runs hidden warm-up calls before
  every measurement and its autorange modes pick their own call count and report block means; the
  benchmarks' command lines give a number of calls, and a per-call median is what do_bench gives on CUDA.

`warmup` calls run first on both (compilation and autotuning belong there). A callable that consumes state
(a training step's next batch) must accept a few more calls than asked for: on CUDA do_bench adds its own
estimate and warm-up calls. `grad_to_none`: tensors whose gradients are reset before each timed call,
outside the timed span (a forward and backward that would otherwise accumulate into them).

While do_bench times it holds a 256 MB buffer (what it writes to flush the L2 cache), so a peak of device
memory taken over a timing would count it: `peak_after` measures one more call alone, for the benchmarks
that report a peak beside a time.

Timing whole training steps through Lightning's trainer is the one other method (benchmarks.step.StepClock:
the wall time between two device synchronisations over real training steps, used by benchmarks.step's
trainer path and benchmarks.ladder_speed), because a callable cannot stand for a trainer's loop; its
docstring says so. benchmarks.kda_train_check times nothing itself: it reads the speed its runs logged.
"""
from __future__ import annotations

import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: the median and the first and third quartiles of n timed calls."""
    median: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, times_ms: Sequence[float]) -> "Timing":
        if not len(times_ms):
            raise ValueError("no timed calls")
        q1, median, q3 = np.percentile(np.asarray(times_ms, dtype=np.float64), [25, 50, 75])
        return cls(float(median), float(q1), float(q3), len(times_ms))

    @property
    def seconds(self) -> float:
        """The median in seconds."""
        return self.median / 1e3

    def iqr(self, digits: int = 3) -> str:
        """The interquartile range as text, "q1-q3" in ms (a table's spread column)."""
        return f"{self.q1:.{digits}f}-{self.q3:.{digits}f}"

    def scaled(self, factor: float) -> "Timing":
        """The same timing in another unit (factor 1e3: microseconds)."""
        return Timing(self.median * factor, self.q1 * factor, self.q3 * factor, self.n)


def time_ms(fn: Callable[[], object], device: torch.device | str, calls: int, warmup: int = 1,
            grad_to_none: Sequence[torch.Tensor] = ()) -> Timing:
    """`fn()`'s milliseconds per call on `device` (module docstring): `warmup` untimed calls, then about
    `calls` timed ones (exactly `calls` off CUDA)."""
    if calls < 1 or warmup < 0:
        raise ValueError(f"calls={calls} must be >= 1 and warmup={warmup} >= 0")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        return Timing.of(_do_bench(fn, calls, list(grad_to_none)))

    def reset():
        for t in grad_to_none:
            t.grad = None

    seconds = timeit.Timer(fn, setup=reset).repeat(repeat=calls, number=1)
    return Timing.of([1e3 * s for s in seconds])


def peak_after(fn: Callable[[], object]) -> int:
    """CUDA bytes allocated at the peak of one call of fn(), all of this process's tensors counted (the
    allocator's peak statistic, reset at the call's start)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _do_bench(fn: Callable[[], object], calls: int, grad_to_none: list[torch.Tensor]) -> list[float]:
    """Per-call milliseconds from triton.testing.do_bench, with a budget of `calls` times one call."""
    from triton.testing import do_bench

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one_ms = 1e3 * (time.perf_counter() - start)
    return do_bench(fn, warmup=0, rep=calls * one_ms, grad_to_none=grad_to_none or None, return_mode="all")
