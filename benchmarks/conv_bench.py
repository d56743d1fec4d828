"""KDA short conv (causal depthwise conv over time + SiLU, k3lab/model/kda.py ShortConv): forward and
forward+backward time of the torch path, the fused Triton op and fla's causal_conv1d.

    python -m benchmarks.conv_bench                          # CUDA: bf16, B,T,C = 8,4096,1024 and 1,16384,2048
    python -m benchmarks.conv_bench --device cpu             # tiny shape, fp32, torch row only (a smoke test)
    python -m benchmarks.conv_bench --out conv.md            # also write the table to a file
    python -m benchmarks.conv_bench --sweep-bwd              # CUDA: the backward's weight-gradient kernel
                                                             # over launch configs, against the default

Rows per shape (x [B, T, C], w [C, W] fp32 as the layer's parameter; bf16 runs under bf16 autocast, as training does):
  torch   kernels.short_conv.short_conv_reference (transpose, conv1d, slice, SiLU, transpose back) and the copy
          that makes its [B, T, C] view contiguous, as the KDA kernels after the conv do
  triton  kernels.short_conv.short_conv (the k3lab::short_conv_fwd / short_conv_bwd custom ops); CUDA only
  fla     fla.modules.convolution.causal_conv1d(activation="silu") from fla-core, when it imports; CUDA only
fwd ms: the forward alone (no autograd); fwd+bwd ms: the forward with x and w requiring grad, then both
gradients from a fixed random dy. Each the median of about --reps timed calls after --warmup, with its
interquartile range (benchmarks.timing: triton.testing.do_bench on CUDA). "/ torch": the row's time over the
torch row's, measured in the same call; "y err": relative error (L2) of the row's output against the torch
row's.

--sweep-bwd (first shape only) times the whole Triton backward (``conv_bwd``) with ``_conv_bwd_g`` launched
at every tile (BT x BC), warp count and programs per SM of SWEEP_BWD, and prints the ten fastest against
the default launch timed in the same call, each checked against the default's dx (bitwise) and dw.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.table import markdown
from benchmarks.timing import Timing, time_ms
from kernels.short_conv import BWD_PROGRAMS_PER_SM, LAUNCH, conv_bwd, short_conv, short_conv_reference

GPU_SHAPES = "8,4096,1024;1,16384,2048"
CPU_SHAPES = "2,256,64"
# --sweep-bwd: _conv_bwd_g's tile rows, tile channels, warps and programs per SM
SWEEP_BWD = dict(BT=(8, 16, 32), BC=(64, 128, 256), num_warps=(2, 4, 8), programs_per_sm=(2, 4, 8, 16))


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """"8,4096,1024;1,16384,2048" -> [(B, T, C), ...]."""
    return [tuple(int(v) for v in part.split(",")) for part in text.split(";")]


def fla_conv() -> Callable | None:
    """fla's causal_conv1d as fn(x, w) -> y, or None when fla-core is not importable."""
    try:
        from fla.modules.convolution import causal_conv1d
    except ImportError:
        return None
    return lambda x, w: causal_conv1d(x, weight=w, activation="silu")[0]


def measure(fn: Callable, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, autocast: bool, reps: int,
            warmup: int) -> tuple[Timing, Timing, torch.Tensor]:
    """(forward, forward+backward, y) of fn(x, w) -> y [B, T, C]."""
    device = x.device
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def forward():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            return fn(x, w)

    def forward_backward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = fn(xg, wg)
        torch.autograd.grad(y, (xg, wg), dy)

    return time_ms(forward, device, reps, warmup), time_ms(forward_backward, device, reps, warmup), forward()


def sweep_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, reps: int, warmup: int) -> list[str]:
    """Lines of the --sweep-bwd table: the default launch, then the ten fastest of SWEEP_BWD."""
    import itertools

    import triton

    from kernels.device import sm_count

    B, C = x.shape[0], x.shape[2]
    ref_dx, ref_dw = conv_bwd(x, w, dy)
    base = time_ms(lambda: conv_bwd(x, w, dy), x.device, reps, warmup)
    default = LAUNCH["bwd_g"]
    rows = [(base.median, {"BT x BC": f"{default['BT']} x {default['BC']} (default)", "warps": default["num_warps"],
                           "programs/SM": BWD_PROGRAMS_PER_SM, "bwd ms": f"{base.median:.4f}", "IQR ms": base.iqr(4),
                           "/ default": "1.00", "same dx, dw": "yes"})]
    for bt, bc, nw, per_sm in itertools.product(*SWEEP_BWD.values()):
        block = dict(BT=bt, BC=bc, num_warps=nw)
        programs = triton.cdiv(per_sm * sm_count(x.device), triton.cdiv(C, bc) * B)
        dx, dw = conv_bwd(x, w, dy, time_programs=programs, block_g=block)
        same = torch.equal(dx, ref_dx) and torch.allclose(dw, ref_dw, rtol=1e-4, atol=1e-4 * ref_dw.abs().max().item())
        t = time_ms(lambda: conv_bwd(x, w, dy, time_programs=programs, block_g=block), x.device, reps, warmup)
        rows.append((t.median, {"BT x BC": f"{bt} x {bc}", "warps": nw, "programs/SM": per_sm, "bwd ms": f"{t.median:.4f}",
                                "IQR ms": t.iqr(4), "/ default": f"{t.median / base.median:.2f}",
                                "same dx, dw": "yes" if same else "NO"}))
    fastest = [cells for _, cells in sorted(rows[1:], key=lambda r: r[0])[:10]]
    return [f"_conv_bwd_g launch sweep, B x T x C = {'x'.join(map(str, x.shape))}: the whole backward's ms "
            f"(median of {reps}), against the default launch in the same call", "",
            *markdown([rows[0][1], *fastest]).splitlines()]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.conv_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default=None, help=f"B,T,C;... (default: {GPU_SHAPES} on CUDA, {CPU_SHAPES} on CPU)")
    p.add_argument("--width", type=int, default=4, help="conv kernel size W (conv_size)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--reps", type=int, default=None, help="timed calls per row (default 50 CUDA, 5 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per row (default 10 CUDA, 1 CPU)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table to this file")
    p.add_argument("--sweep-bwd", action="store_true", help="CUDA: sweep _conv_bwd_g's launch (SWEEP_BWD)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.sweep_bwd and not cuda:
        p.error("--sweep-bwd times the Triton kernels: it needs --device cuda")
    shapes = parse_shapes(args.shapes or (GPU_SHAPES if cuda else CPU_SHAPES))
    bf16 = (args.dtype or ("bf16" if cuda else "fp32")) == "bf16"
    reps, warmup = args.reps or (50 if cuda else 5), args.warmup if args.warmup is not None else (10 if cuda else 1)
    if not cuda:
        torch.set_num_threads(1)  # on a shared machine multi-threaded small ops time erratically

    impls: dict[str, Callable | None] = {"torch": short_conv_reference}
    notes = []
    if cuda:
        impls["triton"] = lambda x, w: short_conv(x, w, backend="triton")
        impls["fla"] = fla_conv()
        if impls["fla"] is None:
            notes.append("fla: skipped, fla-core not importable (pip install 'fla-core==0.6.0')")
    else:
        notes.append("triton, fla: skipped on the CPU (the Triton kernels run there only under TRITON_INTERPRET=1)")
    impls = {name: fn for name, fn in impls.items() if fn is not None}

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for B, T, C in shapes:
        x = torch.randn(B, T, C, generator=gen, device=device).to(torch.bfloat16 if bf16 else torch.float32)
        w = torch.randn(C, args.width, generator=gen, device=device) / args.width ** 0.5
        dy = torch.randn(B, T, C, generator=gen, device=device).to(x.dtype)
        base = None  # the torch row's (fwd ms, fwd+bwd ms, y)
        for name, fn in impls.items():
            run = (lambda x, w: fn(x, w).contiguous()) if name == "torch" else fn
            fwd, fwd_bwd, y = measure(run, x, w, dy, bf16, reps, warmup)
            base = (fwd.median, fwd_bwd.median, y) if base is None else base
            rows.append(dict(shape=f"{B}x{T}x{C}", impl=name, fwd_ms=fwd.median, fwd_iqr=fwd.iqr(),
                             fwd_ratio=fwd.median / base[0], fwd_bwd_ms=fwd_bwd.median, fwd_bwd_iqr=fwd_bwd.iqr(),
                             fwd_bwd_ratio=fwd_bwd.median / base[1], y_err=rel(y, base[2])))

    sweep = []
    if args.sweep_bwd:
        B, T, C = shapes[0]
        x, dy = (torch.randn(B, T, C, generator=gen, device=device).to(torch.bfloat16 if bf16 else torch.float32)
                 for _ in range(2))
        sweep = [""] + sweep_bwd(x, torch.randn(C, args.width, generator=gen, device=device) / args.width ** 0.5,
                                 dy, reps, warmup)

    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    lines = [f"short conv W={args.width}, {'bf16 (autocast, fp32 w)' if bf16 else 'fp32'}, {name}, "
             f"torch {torch.__version__}, median of {reps} calls", "",
             markdown([{"B x T x C": r["shape"], "impl": r["impl"], "fwd ms": f"{r['fwd_ms']:.3f}", "fwd IQR": r["fwd_iqr"],
                        "fwd / torch": f"{r['fwd_ratio']:.2f}", "fwd+bwd ms": f"{r['fwd_bwd_ms']:.3f}",
                        "fwd+bwd IQR": r["fwd_bwd_iqr"], "fwd+bwd / torch": f"{r['fwd_bwd_ratio']:.2f}",
                        "y err": f"{r['y_err']:.1e}"} for r in rows])]
    if notes:
        lines += [""] + notes
    lines += sweep
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
