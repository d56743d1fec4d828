"""What the fused experts' kernels (kernels/grouped_glu.py) ask of an H100/H200 per launch configuration, found
without a GPU: each kernel compiled for sm_90 by the installed Triton, whose CUDA backend runs on any machine.

    python -m benchmarks.kernel_resources                  # the launch table (kernels.grouped_glu.LAUNCH)
    python -m benchmarks.kernel_resources --space tune     # every configuration moe_bench --tune times

Per kernel and configuration: the shared memory one program needs (KiB), the registers of a thread and the
bytes it spills to local memory (ptxas's allocation, read from the cubin by the cuobjdump that ships with
Triton), how many programs fit on one SM by both (SM_SHARED_KIB and SM_REGISTERS per SM), whether the K
loop's loads are pipelined (asynchronous copies into shared memory in the compiled TTGIR, which a GPU
overlaps with the products) and whether the products run on the Hopper tensor-core instruction (wgmma). A
configuration that fits one program per SM, spills, or a loop that is not pipelined are the first suspects
when a kernel runs far from its roofline; `moe_bench --tune` times them.
Pointers and the sizes H and W are compiled as multiples of 16, as Triton specializes them at launch for
the K3 shapes (contiguous bf16 tensors, H = 1,408, W = 256). Uses triton.compiler.ASTSource and GPUTarget
(Triton 3.6 and 3.9 give the same numbers for the launch table).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

from benchmarks.table import markdown
from kernels import grouped_glu as gg

SM_SHARED_KIB = 228  # shared memory per SM on the H100 and H200 (227 KiB of it usable by one program)
SM_REGISTERS = 65536  # 32-bit registers per SM, allocated to a warp in units of 256 (8 per thread)
TILE_ARGS = ["tile_expert", "tile_start", "tile_end"]
SIGNATURES = {  # kernel: (its tensor arguments in order, then H, W, b1, b2)
    "fwd": (gg._glu_fwd, ["x", "w1", "w2", "h"]),
    "bwd": (gg._glu_bwd, ["x", "dy", "w1", "w2", "w3", "dh_in", "h", "dgu"]),
}


def compile_sm90(kernel: str, launch: dict, dtype: str = "bf16") -> dict:
    """The resources of `kernel` ("fwd" or "bwd") at `launch` (a LAUNCH-style dict) compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, tensors = SIGNATURES[kernel]
    names = tensors + TILE_ARGS + ["H", "W", "b1", "b2"]
    signature = dict(zip(names, [f"*{dtype}"] * len(tensors) + ["*i32"] * 3 + ["i32", "i32", "fp32", "fp32"]))
    constexprs = dict(SITU=True, GPU=True, BM=launch["BM"], BN=launch["BN"], BK=launch["BK"])
    if kernel == "bwd":
        constexprs["DH_IN"] = launch["dh"] == "grouped_mm"
    signature.update({name: "constexpr" for name in constexprs})
    order = list(fn.arg_names)
    source = ASTSource(fn=fn, signature={name: signature[name] for name in order},
                       constexprs={(order.index(name),): value for name, value in constexprs.items()},
                       attrs={(order.index(name),): [["tt.divisibility", 16]] for name in names[:-2]})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"]))
    ttgir = compiled.asm["ttgir"]
    shared_kib = compiled.metadata.shared / 1024
    registers, spilled = register_usage(compiled.asm["cubin"])
    by_registers = SM_REGISTERS // (-(-registers // 8) * 8 * 32 * launch["num_warps"])
    by_shared = int(SM_SHARED_KIB // shared_kib) if shared_kib else by_registers
    return dict(kernel=kernel, launch=launch, shared_kib=shared_kib, registers=registers, spilled_bytes=spilled,
                programs_per_sm=min(by_shared, by_registers),
                pipelined="async_copy_global_to_local" in ttgir or "async_tma_copy" in ttgir,
                wgmma=bool(re.search(r"warp_group_dot\b", ttgir)))


def register_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local-memory bytes per thread: what ptxas spilled) of a one-kernel cubin, from
    `cuobjdump --dump-resource-usage` (Triton's NVIDIA backend ships the binary beside ptxas)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
    registers, local = re.search(r"REG:(\d+).*LOCAL:(\d+)", usage).groups()
    return int(registers), int(local)


def launches(space: str) -> list[tuple[str, dict]]:
    """(kernel, launch) pairs: the launch table's (its backward with either dh source), or those of
    benchmarks.moe_bench.TUNE_SPACE."""
    if space == "table":
        return [("fwd", gg.LAUNCH["fwd"])] + [("bwd", dict(gg.LAUNCH["bwd"], dh=dh)) for dh in gg.DH_SOURCES]
    from benchmarks.moe_bench import K3_WIDTH, TUNE_SPACE, tune_launches

    return [(kernel, launch) for kernel in ("fwd", "bwd") for launch in tune_launches(kernel, TUNE_SPACE, K3_WIDTH)]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernel_resources", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--space", choices=("table", "tune"), default="table")
    ap.add_argument("--out", default=None, metavar="PATH", help="also write the table to PATH (markdown)")
    args = ap.parse_args(argv)
    rows = [compile_sm90(kernel, launch) for kernel, launch in launches(args.space)]
    table = markdown([{"kernel": r["kernel"], "launch": r["launch"], "shared KiB": f"{r['shared_kib']:.0f}",
                       "registers": r["registers"], "spilled bytes": r["spilled_bytes"],
                       "programs per SM": r["programs_per_sm"], "pipelined": "yes" if r["pipelined"] else "no",
                       "wgmma": "yes" if r["wgmma"] else "no"} for r in rows])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return rows


if __name__ == "__main__":
    main()
