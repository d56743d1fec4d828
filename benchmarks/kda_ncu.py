"""One forward+backward of the Triton KDA kernels between profiler start and stop, for Nsight Compute.

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats python -m benchmarks.kda_ncu [--shape 4,4096,16,128,128] [--decay sigmoid]

Two warm-up calls first (kernel compilation), so that ncu sees each kernel of one call once, at the
given shape (bf16, gate, q/k L2 norm and beta sigmoid in the call, as ``benchmarks.kda_bench``).
Writes no file itself: ncu prints the report (or saves it with its own ``-o``).
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.kda_bench import make_inputs, run_ours


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda_ncu", description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.split(",")), default=(4, 4096, 16, 128, 128),
                   help="B,T,H,K,V")
    p.add_argument("--decay", choices=["sigmoid", "softplus"], default="sigmoid")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kda_ncu needs a CUDA device")
    xs = make_inputs(*args.shape, args.decay, "cuda")

    def step():
        o = run_ours(*xs, args.decay)
        o.backward(torch.randn_like(o))

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
