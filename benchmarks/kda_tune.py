"""Search the launch configurations of the Triton KDA kernels (``kernels.kda.triton_fwd.LAUNCH``) on a GPU.

    python -m benchmarks.kda_tune [--shape 4,4096,16,128,128] [--reps 10] [--budget-s 300]
    python -m benchmarks.kda_tune --budget-s 0 --set output.BV=128 --set output.num_warps=8   # time one table
    python -m benchmarks.kda_tune --decay softplus-fast --kernels intra,bwd_diag,bwd_local_k   # the softplus path

Coordinate descent, one option at a time: for each kernel and each of its options (V-block width,
warps, pipeline stages) every candidate value is timed with the others held, and the fastest is kept
before moving on if it beats the current time by more than --min-gain (run-to-run spread is 1-2%).
The time is forward+backward of ``kda_gated`` with the gate case of ``--decay`` (default sigmoid; a key of
``benchmarks.kda_bench.CASES``: softplus-fast is where a model trained with softplus sits), bf16, gate, L2
norm and beta sigmoid in the call; median of CUDA-event timings after warm-up, as ``benchmarks.kda_bench``.
Each new value recompiles one kernel, so the search costs a few minutes; ``--budget-s`` stops it early
with the best table found so far. Every configuration computes the same result up to summation order.
Prints each trial as it lands, then the tuned table and both decay maps timed with the starting and the
tuned table, and with fla's ``chunk_kda`` when fla-core is installed (same process, same inputs; not with
--no-fla). ``--set`` changes the starting table, so ``--budget-s 0`` times a given configuration; run one
process per configuration when a configuration may crash the process (see the grid's notes).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import time

import torch
from triton.runtime.errors import OutOfResources

from benchmarks.kda_bench import CASES, make_inputs, run_fla, run_ours, time_sets
from benchmarks.table import markdown
from kernels.kda import triton_fwd

# candidate values per kernel and option (the current value is always among those tried)
GRID = {
    "bwd_local_v": dict(BV=[16, 32, 64], num_warps=[4, 8], num_stages=[1, 2]),
    "bwd_local_kv": dict(BKS=[32, 64], BV=[16, 32, 64], num_warps=[4, 8], num_stages=[1, 2]),
    # operands take dO's dtype: with bf16, 3 stages fit at BV=64 (205 KB of shared memory); with float32
    # (fp32 inputs) 2 stages need 262144 B (232448 available), and float32 operands at BV=16 made an
    # illegal memory access on the H200 under Triton 3.6
    "bwd_state": dict(BV=[16, 32, 64], num_warps=[4, 8], num_stages=[1, 2, 3]),
    "bwd_local_k": dict(RB=[16, 32, 64], num_warps=[4, 8, 16]),
    # no 8 warps: with BV=16 they make an illegal memory access on the H200 under Triton 3.6, which ends the
    # process; at BV=64 they are no faster than 4
    "state": dict(BV=[16, 32, 64], num_warps=[2, 4], num_stages=[1, 2, 3]),
    "wy": dict(BKS=[32, 64, 128], num_warps=[2, 4, 8], num_stages=[1, 2, 3]),
    "intra": dict(BKS=[16, 32, 64], num_warps=[2, 4, 8]),
    "output": dict(BV=[32, 64, 128], num_warps=[4, 8]),
    "gate_cumsum": dict(BKS=[16, 32, 64, 128], num_warps=[2, 4, 8]),
    "dg_bwd": dict(BKS=[16, 32, 64, 128], num_warps=[2, 4, 8]),
    "bwd_diag": dict(BKS=[16, 32, 64, 128], num_warps=[2, 4, 8]),  # unbounded gates only (softplus)
}


def set_option(table: dict, item: str) -> None:
    """Apply one ``KERNEL.OPTION=VALUE`` (an int) to a launch table; ValueError naming the valid choices."""
    key, sep, value = item.partition("=")
    kernel, dot, option = key.partition(".")
    if not (sep and dot):
        raise ValueError(f"--set takes KERNEL.OPTION=VALUE, got {item!r}")
    if kernel not in table:
        raise ValueError(f"unknown kernel {kernel!r} in --set; valid: {', '.join(table)}")
    valid = set(table[kernel]) | set(GRID.get(kernel, {})) | {"num_warps", "num_stages"}
    if option not in valid:
        raise ValueError(f"unknown option {option!r} of {kernel} in --set; valid: {', '.join(sorted(valid))}")
    try:
        table[kernel][option] = int(value)
    except ValueError:
        raise ValueError(f"--set {item!r}: the value must be an integer") from None


def fwd_bwd_ms(shape, case, reps, run=run_ours) -> float:
    """Forward+backward milliseconds (the median, benchmarks.timing) of kda_gated for a gate case (a key of
    CASES) under the current LAUNCH table (or of ``run``)."""
    sets = [make_inputs(*shape, case, "cuda", seed=s) for s in range(2)]
    return time_sets(lambda *xs: run(*xs, CASES[case]), sets, True, reps).median


def tune(shape, reps, budget_s, min_gain, kernels=tuple(GRID), case="sigmoid") -> dict:
    """Coordinate descent over GRID (the given kernels only) timing gate case ``case``; returns the best
    LAUNCH table found (LAUNCH is left set to it)."""
    start = time.monotonic()
    best = fwd_bwd_ms(shape, case, reps)
    print(f"start: {best:.3f} ms  {triton_fwd.LAUNCH}", flush=True)
    for kernel, options in ((name, GRID[name]) for name in kernels):
        for option, values in options.items():
            for value in values:
                current = triton_fwd.LAUNCH[kernel].get(option)
                if value == current:
                    continue
                if time.monotonic() - start > budget_s:
                    print(f"budget of {budget_s} s spent; stopping the search", flush=True)
                    return copy.deepcopy(triton_fwd.LAUNCH)
                triton_fwd.LAUNCH[kernel][option] = value
                try:
                    ms = fwd_bwd_ms(shape, case, reps)
                except OutOfResources as err:  # e.g. shared memory for this tile: the value is skipped
                    ms = float("inf")
                    print(f"  {kernel}.{option}={value}: failed ({type(err).__name__}: {str(err)[:80]})")
                keep = ms < best * (1 - min_gain)
                print(f"  {kernel}.{option}={value}: {ms:.3f} ms {'(kept)' if keep else ''}  "
                      f"[{time.monotonic() - start:.0f} s]", flush=True)
                if keep:
                    best = ms
                else:
                    triton_fwd.LAUNCH[kernel][option] = current
    return copy.deepcopy(triton_fwd.LAUNCH)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda_tune", description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.split(",")), default=(4, 4096, 16, 128, 128),
                   help="B,T,H,K,V")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop searching after this many seconds")
    p.add_argument("--min-gain", type=float, default=0.01,
                   help="keep a new value only if it is faster by more than this fraction")
    p.add_argument("--kernels", type=lambda s: s.split(","), default=list(GRID),
                   help=f"comma-separated kernels to search (default: all of {', '.join(GRID)})")
    p.add_argument("--set", action="append", default=[], metavar="KERNEL.OPTION=VALUE",
                   help="change the starting table (repeatable), e.g. bwd_state.num_warps=4")
    p.add_argument("--decay", default="sigmoid", choices=list(CASES),
                   help="gate case timed by the search (benchmarks.kda_bench.CASES)")
    p.add_argument("--no-fla", action="store_true", help="do not time fla's chunk_kda")
    args = p.parse_args(argv)
    unknown = sorted(set(args.kernels) - set(GRID))
    if unknown:
        p.error(f"unknown kernel(s) {', '.join(unknown)}; valid: {', '.join(GRID)}")
    for item in args.set:
        try:
            set_option(triton_fwd.LAUNCH, item)
        except ValueError as err:
            p.error(str(err))
    if not torch.cuda.is_available():
        raise SystemExit("kda_tune needs a CUDA device")
    initial = copy.deepcopy(triton_fwd.LAUNCH)
    tuned = tune(args.shape, args.reps, args.budget_s, args.min_gain, args.kernels, args.decay)
    print("\ntuned LAUNCH = {", flush=True)
    for name, opts in tuned.items():
        print(f"    {name!r}: dict({', '.join(f'{k}={v}' for k, v in opts.items())}),")
    with_fla = not args.no_fla and importlib.util.find_spec("fla") is not None
    print("}\n", flush=True)
    rows = []
    for decay in ("sigmoid", "softplus-fast"):
        triton_fwd.LAUNCH.clear()
        triton_fwd.LAUNCH.update(copy.deepcopy(initial))
        before = fwd_bwd_ms(args.shape, decay, args.reps)
        triton_fwd.LAUNCH.clear()
        triton_fwd.LAUNCH.update(copy.deepcopy(tuned))
        after = fwd_bwd_ms(args.shape, decay, args.reps)
        fla = fwd_bwd_ms(args.shape, decay, args.reps, run_fla) if with_fla else float("nan")
        print(f"  {decay}: starting table {before:.3f} ms, tuned {after:.3f} ms, fla {fla:.3f} ms", flush=True)
        rows.append({"decay": decay, "starting table ms": f"{before:.3f}", "tuned table ms": f"{after:.3f}",
                     "speed-up": f"{before / after:.2f}x", "fla chunk_kda ms": f"{fla:.3f}",
                     "tuned / fla": f"{after / fla:.2f}"})
    print(markdown(rows), flush=True)

if __name__ == "__main__":
    main()
