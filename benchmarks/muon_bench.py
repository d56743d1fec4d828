"""The optimizer step of a config's model on random gradients, timed whole and by part, against its roofline.

    python -m benchmarks.muon_bench trainer=gpu model=small model.d_model=1024 model.n_layers=12 moe.n_experts=16
    python -m benchmarks.muon_bench trainer=gpu model=small --variants "optim=muon_per_head,optim=muon"
    python -m benchmarks.muon_bench trainer=gpu model=small --variants ",optim.ns_method=gram"
    python -m benchmarks.muon_bench trainer=cpu                      # the tiny default model: a smoke test

The positional arguments are run.py's Hydra overrides; --variants as in benchmarks.step (override sets
separated by commas, each on top of the positional ones). Per variant the model and optimizer come from the
project's builders (K3Model, build_optimizer) in the parameter dtype of trainer.precision, every gradient
drawn from N(0, 1). Each part is timed alone by benchmarks.timing (about --steps calls after --warmup; the
median call, with its interquartile range), on the same parameters, gradients and state:

  step        Muon.step(): every group, what training runs
  directions  every bucket's momentum update and directions written into its Newton-Schulz batch
              (Muon.bucket_directions: kernels.momentum's fused kernel on CUDA)
  ns          newton_schulz_factors of every bucket (the Frobenius norms included), by the group's
              ns_method: every iteration but the last product
  update      that last product taken into the parameters with the weight decay (Muon.apply_updates)
  adamw       the AdamW groups (embeddings, LM head, norms, biases): torch's fused AdamW on CUDA
  rest        step minus the parts above (what the step does beyond them, or the spread of the timings)

On a GPU each part also has its device time per call: the time of the kernels and copies it launched over
--steps more calls under torch.profiler. A part timed alone can be bound by its
launches (the host), which its wall time shows and its device time does not; inside a training step the
device is still busy with the backward while the host launches the optimizer's kernels.

ns TFLOP/s: ns_flops (per matrix of r <= c rows and columns, each iteration 4 r^2 c + 2 r^3) over the time
of ns and update, and its share of the device's dense bf16 peak (k3lab.lit.PEAK_FLOPS). The count is the
standard iteration's, so under optim.ns_method=gram, which does fewer FLOPs, it is the rate the standard
iteration would need to run at to take the same time, comparable across variants. elementwise GB/s: the
bytes the directions part moves (per Muon parameter element g and m read and m written in the parameter
dtype, the direction written in the Newton-Schulz dtype) over its time. Parts stay comparable across
variants of one call: optim=muon (one matrix per weight) against optim=muon_per_head (one per head block)
is the cost of the per-head switch. Two tables: the parts of each variant, one row per part, and each
variant's rates and buckets.
"""
from __future__ import annotations

import argparse
import shlex

import torch

from benchmarks.step import compose_config, device_of, precision_of, split_variants
from benchmarks.table import markdown
from benchmarks.timing import time_ms
from k3lab.config import run_config
from k3lab.lit import peak_flops
from k3lab.model import K3Model
from k3lab.optim import build_optimizer
from k3lab.optim.muon import NS_DTYPES, buckets, newton_schulz_factors

PARTS = ("step", "directions", "ns", "update", "adamw", "rest")


def ns_flops(shapes: list[tuple[int, int, int, int]]) -> float:
    """FLOPs of the quintic Newton-Schulz on batches (n, rows, cols, iterations): per matrix and iteration,
    with r the smaller and c the larger side, the Gram matrix (2 r^2 c), its polynomial (2 r^3) and the
    update (2 r^2 c)."""
    return float(sum(n * it * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for n, r, c, it in shapes))


def muon_parts(opt) -> tuple[dict, list[tuple[int, int, int, int]], int]:
    """Callables of the parts (see the module docstring) for optimizer `opt`, its Newton-Schulz batches
    (matrices, rows, cols, iterations) and the bytes the directions part moves."""
    muon = [g for g in opt.param_groups if g["use_muon"]]
    adamw = [g for g in opt.param_groups if not g["use_muon"]]
    for group in muon:  # the state a first step would create, so that every part runs on it
        for p in group["params"]:
            opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
    batches = []  # (group, one bucket), as the step makes them
    for group in muon:
        heads = [h if group["per_head"] else 0 for h in group["head_blocks"]]
        batches += [(group, b) for b in buckets(group["params"], heads)]
    stacks = [opt.bucket_directions(g, g["params"], b) for g, b in batches]
    factors = [newton_schulz_factors(s, g["ns_steps"], method=g["ns_method"]) for s, (g, _) in zip(stacks, batches)]
    shapes = [(*s.shape, g["ns_steps"]) for s, (g, _) in zip(stacks, batches)]
    moved = sum(p.numel() * (3 * p.element_size() + NS_DTYPES[g["ns_dtype"]].itemsize)
                for g in muon for p in g["params"])
    parts = {
        "step": opt.step,
        "directions": lambda: [opt.bucket_directions(g, g["params"], b) for g, b in batches],
        "ns": lambda: [newton_schulz_factors(s, g["ns_steps"], method=g["ns_method"])
                       for s, (g, _) in zip(stacks, batches)],
        "update": lambda: [opt.apply_updates(g, g["params"], b, q, y) for (g, b), (q, y) in zip(batches, factors)],
        "adamw": lambda: [opt._adamw_step(g, None) for g in adamw],
    }
    return parts, shapes, moved


def device_ms(fn, calls: int) -> float:
    """Milliseconds of device time per call of fn() (every kernel and copy it launches), over `calls` calls
    under torch.profiler (CUDA only)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(avg.self_device_time_total for avg in prof.key_averages()) / 1e3 / calls


def measure(cfg, warmup: int, steps: int) -> dict:
    """The parts' timings (benchmarks.timing; on a GPU also their device time, ms) and the roofline numbers of
    one variant."""
    device = device_of(cfg)
    dtype, _ = precision_of(cfg, device)
    torch.manual_seed(cfg.seed)
    model = K3Model(run_config(cfg).model_config(cfg.data.vocab_size)).to(device=device, dtype=dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt, _ = build_optimizer(model, run_config(cfg).optim, total_steps=warmup + steps)
    parts, shapes, moved = muon_parts(opt)
    with torch.no_grad():  # as in Muon.step
        timings = {name: time_ms(fn, device, steps, warmup) for name, fn in parts.items()}
        device_time = ({name: device_ms(fn, steps) for name, fn in parts.items()} if device.type == "cuda"
                       else None)
    ms = {name: t.median for name, t in timings.items()}
    for times in filter(None, (ms, device_time)):
        times["rest"] = times["step"] - sum(times[n] for n in PARTS[1:5])
    return dict(ms=ms, timings=timings, device_ms=device_time, ns_flops=ns_flops(shapes), moved=moved,
                matrices=sum(s[0] for s in shapes), buckets=len(shapes))


def table(rows: list[tuple[str, dict]], device: torch.device) -> str:
    """The parts' table (median ms, its IQR, device ms on a GPU; `rest` has no spread of its own) and the
    rates' table."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops() if device.type == "cuda" else None
    parts, rates = [], []
    for variant, r in rows:
        label, ms, dev = variant or "(overrides only)", r["ms"], r["device_ms"]
        for part in PARTS:
            timing = r["timings"].get(part)
            cells = {"variant": label, "part": part, "ms": f"{ms[part]:.2f}", "IQR ms": timing.iqr(2) if timing else "-"}
            if dev:
                cells["device ms"] = f"{dev[part]:.2f}"
            parts.append(cells)
        ns = ms["ns"] + ms["update"]
        tflops = r["ns_flops"] / (ns * 1e-3) / 1e12 if ns > 0 else float("nan")
        share = f" ({tflops * 1e12 / peak:.0%})" if peak else ""
        gbs = r["moved"] / (ms["directions"] * 1e-3) / 1e9 if ms["directions"] > 0 else float("nan")
        rates.append({"variant": label, "ns TFLOP/s (of peak)": f"{tflops:.1f}{share}", "elementwise GB/s": f"{gbs:.0f}",
                      "matrices in buckets": f"{r['matrices']} in {r['buckets']}"})
    return (f"optimizer step on {name}, torch {torch.__version__}; ms per call of each part (the median, "
            f"benchmarks.timing)\n\n{markdown(parts)}\n\n{markdown(rates)}\n")


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python -m benchmarks.muon_bench", description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each part")
    p.add_argument("--steps", type=int, default=10, help="timed calls of each part")
    p.add_argument("--variants", default="", help="override sets, comma-separated, each space-separated")
    p.add_argument("--out", default=None, metavar="PATH", help="also write the table to PATH (markdown)")
    p.add_argument("overrides", nargs="*", help="run.py overrides for every variant")
    args = p.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        p.error("--warmup must be >= 0 and --steps >= 1")
    rows = []
    for variant in split_variants(args.variants):
        cfg = compose_config([*args.overrides, *shlex.split(variant)])
        if cfg.data.get("vocab_size") is None:
            p.error(f"data={cfg.data.name} takes its vocabulary from the corpus: give data.vocab_size=N")
        rows.append((variant, measure(cfg, args.warmup, args.steps)))
        print(f"  {variant or '(overrides only)'}: step {rows[-1][1]['ms']['step']:.2f} ms", flush=True)
    text = table(rows, device_of(cfg))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
