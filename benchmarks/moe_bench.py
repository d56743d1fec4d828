"""MoE layer forward+backward: grouped-matmul dispatch vs a per-expert Python loop; the routed experts alone
in their checkpointed forms.

    python -m benchmarks.moe_bench                      # CUDA, bf16, 64-256 experts, top-8
    python -m benchmarks.moe_bench --experts            # the K3 default's routed experts, three forms
    python -m benchmarks.moe_bench --tune               # the fused experts' launch table, swept there
    python -m benchmarks.moe_bench --tune --tune-kernels bwd   # the backward's grid alone
    python -m benchmarks.moe_bench --routing            # QB's cutoffs and the expert counts, each form
    python -m benchmarks.moe_bench --combine            # the experts' outputs mixed back per token, two forms
    python -m benchmarks.moe_bench --routing --experts --tune  # the three tables above in one run
    python -m benchmarks.moe_bench --device cpu --small # tiny shapes, fp32 (a smoke test of the script)

Layer rows: both paths run the same k3lab.model.moe.MoE (router, sort by expert, shared expert, latent
projections); only the expert matmuls differ: `grouped` = three torch._grouped_mm calls over all experts,
`loop` = one matmul triple per expert with tokens (host sync for the segment sizes). One table row per
(shape, dispatch): milliseconds per forward+backward, tokens/s, and loop time / grouped time.

Every time here is benchmarks.timing's: the median call of about --iters after --warmup, with the
interquartile range beside it.

--experts: GroupedExperts alone at the K3 default's expert shape (64 experts of width 256 and hidden
1,408, SiTU; 262,144 (token, expert) pairs: batch 8 x 4,096, top-8), forward + backward with every
weight's gradient, uniformly random routing. Forms: `grouped` (torch.compile'd: Inductor fuses the GLU,
keeps gate and up), `grouped, checkpointed` (compiled, under torch.utils.checkpoint: what
kernels.checkpoint_experts ran before the fused kernels) and `fused, checkpointed` (kernels.grouped_glu,
what MoE runs for checkpoint_experts on CUDA). Per form: ms, the peak memory above the inputs, the largest
relative error of the output and gradients against eager `grouped`, and the time over the compiled
checkpointed form's. On the CPU (--small) the forms run eager, fused only under TRITON_INTERPRET=1.

--tune: the fused kernels alone at the same shape (kernels.grouped_glu: glu_fwd, glu_bwd), every launch
configuration of TUNE_SPACE (tiles BM x BN, K step BK, warps, stages; for the backward also where dh comes
from), each checked against the launch table's result and timed; prints the fastest rows per kernel and
the table's own (runs on CUDA, or on the CPU under TRITON_INTERPRET=1 with --small).

--routing: the two selections a MoE layer makes per step besides its top-k, at the K3 default's routing
(32,768 tokens, 64 experts, top-8): QB's cutoffs, the c-th largest margin of each expert's column
(c = 4,096), by kthvalue down the strided columns, kthvalue on the transpose, and topk on the transpose
(k3lab.model.router.qb_quantile_exact); the tokens per expert by scatter-add (router.count_ids), bincount
and the one-hot column sums (router.expert_load), eager and compiled. Each row is checked against the
first of its group; microseconds per call and the time over that first row.

--combine: the last step of k3lab.model.moe.dispatch_combine at the same routing (262,144 pairs of width 256,
bf16 on CUDA): the pairs' outputs gathered back into (token, slot) order and summed with the gating weights
in fp32, forward + backward, compiled. `slots added in turn` is `moe.combine` (k - 1 adds of slot slices, which
Inductor makes a pointwise kernel that gathers k rows per output row); `sum over slots` writes the same sum as
one reduction over the k slots, gathering along it. Each form's output and gradients are
checked against the first form's (fp32 rounding of the sum's order); microseconds per call and the time over
the first form.
"""
from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import dataclass

import torch

from benchmarks.table import markdown
from benchmarks.timing import Timing, peak_after, time_ms
from k3lab.config import BalanceConfig, GLUConfig, MoEConfig
from k3lab.model.moe import GroupedExperts, MoE


@dataclass
class Shape:
    moe: str
    d_model: int
    n_experts: int     # before latent scaling
    top_k: int         # before latent scaling
    hidden: int
    latent_ratio: int
    tokens: int


GPU_SHAPES = [
    Shape("standard", 1024, 64, 8, 512, 1, 16384),
    Shape("standard", 2048, 128, 8, 768, 1, 16384),
    Shape("latent_norm", 2048, 64, 2, 768, 4, 16384),     # 256 experts, top-8, width 512
    Shape("latent_norm", 4096, 64, 2, 1024, 4, 8192),     # 256 experts, top-8, width 1024
]
SMALL_SHAPES = [
    Shape("standard", 64, 16, 4, 32, 1, 512),
    Shape("latent_norm", 64, 16, 2, 32, 4, 512),          # 64 experts, top-8, width 16
]


def build(shape: Shape, device: str, dtype: torch.dtype) -> MoE:
    cfg = MoEConfig(name=shape.moe, n_experts=shape.n_experts, top_k=shape.top_k, n_shared=1,
                    expert_hidden=shape.hidden, latent_ratio=shape.latent_ratio)
    return MoE(shape.d_model, cfg, GLUConfig(name="situ"), BalanceConfig(name="qb")).to(device, dtype)


def time_fwd_bwd(moe: MoE, x: torch.Tensor, iters: int, warmup: int) -> Timing:
    """One forward + backward (parameter and input gradients), timed."""
    def step():
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).float().square().mean().backward()
    return time_ms(step, x.device, iters, warmup)


def grouped_available(device: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(16, 16, device=device, dtype=dtype)
        torch._grouped_mm(a, torch.ones(2, 16, 16, device=device, dtype=dtype),
                          offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


# --tune's grid: every combination, less tiles over 128 x 128 (out of shared memory on the H200) and pipelines
# deeper than the K loop (stages x BK over the width: Triton allocates every stage whether the loop fills it or
# not), 112 in all at the K3 width. Each of those compiles for sm_90 with pipelined loads and wgmma
# (`python -m benchmarks.kernel_resources --space tune`). The backward takes dh from torch._grouped_mm only:
# with dh in the kernel the best of 32 took 4.15 ms on the H200 against 3.80 (RESULTS.md); `glu_bwd` keeps both
# sources, and SMALL_TUNE_SPACE tests both.
TUNE_SPACE = dict(BM=(64, 128), BN=(64, 128), BK=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4),
                  dh=("grouped_mm",))
K3_WIDTH, SMALL_WIDTH = 256, 16  # the experts' width W (the kernels' K extent) of --experts and --tune
SMALL_TUNE_SPACE = dict(BM=(16,), BN=(16, 32), BK=(16,), num_warps=(1,), num_stages=(1,), dh=("kernel", "grouped_mm"))


def expert_inputs(device: str, dtype: torch.dtype, small: bool) -> tuple[GroupedExperts, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor]:
    """The experts, counts, xs and dy of --experts and --tune (module docstring)."""
    n, width, hidden, pairs = (8, SMALL_WIDTH, 24, 512) if small else (64, K3_WIDTH, 1408, 262_144)
    torch.manual_seed(0)
    experts = GroupedExperts(n, width, hidden, GLUConfig(name="situ")).to(device, dtype)
    counts = torch.bincount(torch.randint(0, n, (pairs,), device=device), minlength=n)
    xs = torch.randn(pairs, width, device=device, dtype=dtype)
    dy = torch.randn(pairs, width, device=device, dtype=dtype) * 1e-2
    return experts, counts, xs, dy


def tune_launches(kernel: str, space: dict, width: int) -> list[dict]:
    """The launch configurations of `kernel` ("fwd" or "bwd") in a TUNE_SPACE-like grid for experts of `width`:
    every combination (`dh` for the backward only), less tiles over 128 x 128 and stages beyond the K loop's
    steps (num_stages x BK > max(width, BK))."""
    keys = [k for k in space if kernel == "bwd" or k != "dh"]
    launches = [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]
    return [launch for launch in launches if launch["BM"] * launch["BN"] <= 128 * 128
            and launch["num_stages"] * launch["BK"] <= max(width, launch["BK"])]


def tune_rows(device: str, dtype: torch.dtype, small: bool, iters: int, warmup: int, top: int = 6,
              kernels: tuple[str, ...] = ("fwd", "bwd")) -> list[dict]:
    """The --tune table (module docstring): one row per kernel of `kernels` and launch configuration that ran."""
    from kernels import grouped_glu as gg

    experts, counts, xs, dy = expert_inputs(device, dtype, small)
    w1, w2, w3 = (w.detach() for w in (experts.w1, experts.w2, experts.w3))
    calls = {"fwd": lambda cfg: [gg.glu_fwd(xs, counts, w1, w2, w3, 4.0, 25.0, True, cfg)],
             "bwd": lambda cfg: list(gg.glu_bwd(xs, dy, counts, w1, w2, w3, 4.0, 25.0, True, cfg))}
    calls = {kernel: call for kernel, call in calls.items() if kernel in kernels}
    space = SMALL_TUNE_SPACE if small else TUNE_SPACE
    rows = []
    for kernel, call in calls.items():
        want = call(gg.LAUNCH[kernel])
        for cfg in tune_launches(kernel, space, xs.shape[1]):
            try:
                got = call(cfg)
            except Exception as err:  # noqa: BLE001 - a configuration the compiler refuses (resources) is skipped
                print(f"{kernel} {cfg}: {type(err).__name__}")
                continue
            error = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, want))
            timing = time_ms(lambda: call(cfg), device, iters, warmup)
            rows.append(dict(kernel=kernel, launch=cfg, default=cfg == gg.LAUNCH[kernel], max_rel_error=error,
                             ms=timing.median, iqr=timing.iqr()))
    shown = []
    for kernel in calls:
        ranked = sorted((r for r in rows if r["kernel"] == kernel), key=lambda r: r["ms"])
        shown += [{"kernel": kernel, "launch": f"{r['launch']}{' (table)' if r['default'] else ''}", "ms": f"{r['ms']:.3f}",
                   "IQR ms": r["iqr"], "max rel. error vs the launch table's": f"{r['max_rel_error']:.1e}"}
                  for r in ranked[:top] + [r for r in ranked[top:] if r["default"]]]
    print(markdown(shown))
    return rows


def routing_rows(device: str, small: bool, iters: int, warmup: int) -> list[dict]:
    """The --routing table (module docstring): one row per form."""
    from k3lab.model.router import count_ids, expert_load, qb_quantile_exact, qb_target_rank

    tokens, n, k = (512, 16, 4) if small else (32_768, 64, 8)
    torch.manual_seed(0)
    margins = torch.randn(tokens, n, device=device)
    idx = torch.randint(0, n, (tokens, k), device=device)
    c = qb_target_rank(tokens, n, k)
    forms = {
        "QB cutoffs": {
            "kthvalue, strided columns": lambda: -torch.kthvalue(-margins, c, dim=0).values,
            "kthvalue, transposed": lambda: torch.kthvalue(margins.t().contiguous(), tokens - c + 1, dim=1).values,
            "topk, transposed (qb_quantile_exact)": lambda: qb_quantile_exact(margins, k),
        },
        "tokens per expert": {
            "scatter-add (count_ids), eager": lambda: count_ids(idx, n),
            "scatter-add (count_ids), compiled": torch.compile(lambda: count_ids(idx, n)),
            "bincount, eager": lambda: torch.bincount(idx.reshape(-1), minlength=n),
            "one-hot sums (expert_load), eager": lambda: expert_load(idx, n),
            "one-hot sums (expert_load), compiled": torch.compile(lambda: expert_load(idx, n)),
        },
    }
    rows = []
    for group, fns in forms.items():
        want, first = None, None
        for form, fn in fns.items():
            got = fn()
            want = got if want is None else want
            if not torch.equal(got, want):
                raise AssertionError(f"{group}: {form} gives {got.tolist()}, the first form {want.tolist()}")
            timing = time_ms(fn, device, iters, warmup).scaled(1e3)
            first = first or timing.median
            rows.append(dict(selection=group, form=form, us=timing.median, iqr=timing.iqr(1), ratio=timing.median / first))
    print(f"routing selections: {tokens:,} tokens, {n} experts, top-{k}, {device}; median of {iters}\n")
    print(markdown([{"selection": r["selection"], "form": r["form"], "us": f"{r['us']:.1f}", "IQR us": r["iqr"],
                     "time / first form": f"{r['ratio']:.2f}"} for r in rows]))
    return rows


def combine_by_sum(ys: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`k3lab.model.moe.combine` with the sum over the k slots written as one reduction."""
    m, k = weight.shape
    y = ys[inverse].reshape(m, k, -1)
    acc = torch.promote_types(y.dtype, torch.float32)
    return (y.to(acc) * weight[..., None].to(acc)).sum(1).to(dtype)


def combine_rows(device: str, dtype: torch.dtype, small: bool, iters: int, warmup: int) -> list[dict]:
    """The --combine table (module docstring): one row per form."""
    from k3lab.model.moe import combine

    tokens, k, width = (512, 4, 16) if small else (32_768, 8, K3_WIDTH)
    torch.manual_seed(0)
    ys = torch.randn(tokens * k, width, device=device, dtype=dtype)
    inverse = torch.randperm(tokens * k, device=device)
    weight = torch.rand(tokens, k, device=device).softmax(-1)
    g = torch.randn(tokens, width, device=device, dtype=dtype)
    compiled = torch.compile if device.startswith("cuda") else (lambda fn: fn)
    forms = {"slots added in turn (moe.combine)": compiled(combine), "sum over slots": compiled(combine_by_sum)}

    def fwd_bwd(fn) -> list[torch.Tensor]:
        y, w = ys.detach().requires_grad_(), weight.detach().requires_grad_()
        out = fn(y, inverse, w, dtype)
        out.backward(g)
        return [out.detach().float(), y.grad.float(), w.grad.float()]

    rows, want, first = [], None, None
    for form, fn in forms.items():
        got = fwd_bwd(fn)
        want = want or got
        error = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want))
        if error > 1e-2:
            raise AssertionError(f"combine: {form} differs from the first form by {error:.1e} (relative)")
        timing = time_ms(lambda: fwd_bwd(fn), device, iters, warmup).scaled(1e3)
        first = first or timing.median
        rows.append(dict(form=form, us=timing.median, iqr=timing.iqr(1), max_rel_error=error, ratio=timing.median / first))
    print(f"combine: {tokens:,} tokens, top-{k}, width {width}, {str(dtype).removeprefix('torch.')}, {device}; "
          f"forward + backward, median of {iters}\n")
    print(markdown([{"form": r["form"], "us": f"{r['us']:.1f}", "IQR us": r["iqr"],
                     "max rel. error vs the first": f"{r['max_rel_error']:.1e}", "time / first form": f"{r['ratio']:.2f}"}
                    for r in rows]))
    return rows


def experts_rows(device: str, dtype: torch.dtype, small: bool, iters: int, warmup: int) -> list[dict]:
    """The --experts table (module docstring): one row per form that runs on this device."""
    experts, counts, xs, dy = expert_inputs(device, dtype, small)
    (pairs, width), (n, hidden, _) = xs.shape, experts.w1.shape
    dispatch = "grouped" if grouped_available(device, dtype) else "loop"
    cuda = device.startswith("cuda")
    compiled = torch.compile if cuda else (lambda fn: fn)
    forms = {
        "grouped": compiled(lambda x: experts(x, counts, dispatch)),
        "grouped, checkpointed": compiled(lambda x: torch.utils.checkpoint.checkpoint(
            experts, x, counts, dispatch, use_reentrant=False)),
        "fused, checkpointed": lambda x: experts.fused(x, counts)}
    if not (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        del forms["fused, checkpointed"]

    def fwd_bwd(fn) -> list[torch.Tensor]:
        x = xs.detach().requires_grad_()
        experts.zero_grad(set_to_none=True)
        y = fn(x)
        y.backward(dy)
        return [y.detach().float(), x.grad.float()] + [w.grad.float() for w in (experts.w1, experts.w2, experts.w3)]

    reference = fwd_bwd(lambda x: experts(x, counts, dispatch))
    rows = []
    for form, fn in forms.items():
        error = max(((a - b).norm() / b.norm()).item() for a, b in zip(fwd_bwd(fn), reference))
        timing = time_ms(lambda: fwd_bwd(fn), device, iters, warmup)
        base = torch.cuda.memory_allocated() if cuda else 0
        peak = (peak_after(lambda: fwd_bwd(fn)) - base) / 2**30 if cuda else float("nan")
        rows.append(dict(form=form, ms=timing.median, iqr=timing.iqr(), peak_gib=peak, max_rel_error=error))
    anchor = next(r["ms"] for r in rows if r["form"] == "grouped, checkpointed")
    for r in rows:
        r["ratio"] = r["ms"] / anchor
    print(f"routed experts alone: {n} experts, width {width}, hidden {hidden}, {pairs:,} pairs, SiTU, "
          f"{str(dtype).removeprefix('torch.')}, {device}; forward + backward, median of {iters}\n")
    print(markdown([{"form": r["form"], "ms": f"{r['ms']:.3f}", "IQR ms": r["iqr"],
                     "peak GiB above inputs": f"{r['peak_gib']:.2f}",
                     "max rel. error vs eager grouped": f"{r['max_rel_error']:.1e}",
                     "time / grouped, checkpointed": f"{r['ratio']:.2f}"} for r in rows]))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.moe_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 | float32 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--experts", action="store_true", help="the routed experts alone, three forms (docstring)")
    ap.add_argument("--tune", action="store_true", help="sweep the fused experts' launch table (docstring)")
    ap.add_argument("--tune-kernels", default="fwd,bwd", metavar="K",
                    help="with --tune: the kernels whose grids run, comma-separated (fwd, bwd)")
    ap.add_argument("--routing", action="store_true", help="QB's cutoffs and the expert counts, each form")
    ap.add_argument("--combine", action="store_true", help="the experts' outputs mixed back per token, two forms")
    args = ap.parse_args(argv)
    tune_kernels = tuple(args.tune_kernels.split(","))
    if not set(tune_kernels) <= {"fwd", "bwd"}:
        ap.error(f"--tune-kernels {args.tune_kernels!r}: valid kernels are fwd and bwd, comma-separated")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    shapes = SMALL_SHAPES if args.small else GPU_SHAPES
    iters = args.iters or (2 if args.small else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.small else 5)
    if args.routing or args.combine or args.experts or args.tune:  # the parts alone: any of the tables, in order
        return ((routing_rows(args.device, args.small, iters, warmup) if args.routing else [])
                + (combine_rows(args.device, dtype, args.small, iters, warmup) if args.combine else [])
                + (experts_rows(args.device, dtype, args.small, iters, warmup) if args.experts else [])
                + (tune_rows(args.device, dtype, args.small, iters, warmup, kernels=tune_kernels)
                   if args.tune else []))
    has_grouped = grouped_available(args.device, dtype)
    torch.manual_seed(0)

    rows = []
    for shape in shapes:
        moe = build(shape, args.device, dtype)
        x = torch.randn(1, shape.tokens, shape.d_model, device=args.device, dtype=dtype, requires_grad=True)
        times, outs = {}, {}
        for dispatch in (["grouped"] if has_grouped else []) + ["loop"]:
            moe.dispatch = dispatch
            with torch.no_grad():
                outs[dispatch] = moe(x).float()
            times[dispatch] = time_fwd_bwd(moe, x, iters, warmup)
        diff = float((outs["grouped"] - outs["loop"]).abs().max()) if has_grouped else float("nan")
        for dispatch, timing in times.items():
            ratio = times["loop"].median / times["grouped"].median if has_grouped else float("nan")
            rows.append(dict(moe=shape.moe, d_model=shape.d_model, experts=moe.n_experts, top_k=moe.top_k,
                             width=moe.width, hidden=moe.hidden, tokens=shape.tokens, dispatch=dispatch,
                             ms=timing.median, iqr=timing.iqr(2), tokens_per_s=shape.tokens / timing.seconds,
                             ratio=ratio, max_abs_diff=diff))
            print(f"  {shape.moe}, width {shape.d_model}, {dispatch}: {timing.median:.2f} ms", flush=True)
        del moe, x
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"MoE layer forward + backward, {args.device}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, "
          f"grouped_mm {'yes' if has_grouped else 'no'}; median of {iters}\n")
    print(markdown([{"moe": r["moe"], "D": r["d_model"], "experts": r["experts"], "top_k": r["top_k"], "width": r["width"],
                     "hidden": r["hidden"], "tokens": r["tokens"], "dispatch": r["dispatch"], "ms": f"{r['ms']:.2f}",
                     "IQR ms": r["iqr"], "tokens/s": f"{r['tokens_per_s']:,.0f}",
                     "loop / grouped": f"{r['ratio'] if r['dispatch'] == 'grouped' else 1.0:.2f}",
                     "max abs diff": f"{r['max_abs_diff']:.2e}"} for r in rows]))
    return rows


if __name__ == "__main__":
    main()
