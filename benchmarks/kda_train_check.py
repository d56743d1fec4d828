"""The fused kernels inside real training: the same loss curve as the plain path, and the step time they buy.

    python -m benchmarks.kda_train_check        # GPU: model=small, trainer=gpu, 50 steps, torch vs triton backend
    python -m benchmarks.kda_train_check --variants "kernels.backend=torch,kernels.backend=triton,kernels.backend=fla"
    python -m benchmarks.kda_train_check --variants "kernels.backend=torch,kernels.backend=triton,kernels.backend=triton" trainer.deterministic=true
    python -m benchmarks.kda_train_check trainer.deterministic=true \
        --variants "kernels.backend=torch train.compile=false,kernels.backend=triton train.compile=true"
    python -m benchmarks.kda_train_check \
        --variants "trainer=gpu,trainer=ddp trainer.devices=2,trainer=fsdp trainer.devices=2"
    python -m benchmarks.kda_train_check trainer.deterministic=true \
        --variants "trainer=gpu data.batch_size=16,trainer=ddp trainer.devices=2,trainer=fsdp trainer.devices=2"

Runs ``run.py`` once per override set of ``--variants`` (sets separated by commas, the overrides of a set
by spaces, as in ``benchmarks.step``) with the same seed, data and everything else; a set named twice
runs twice, the second time labelled ``-2``, which with ``trainer.deterministic=true`` shows whether the
step repeats bit for bit. Then compares the per-step training loss of each run with the first one (the
plain PyTorch path by default) and the median step time over the steps after ``--skip`` (compilation
and autotuning happen in the first steps). Tokens per step and tokens/s are each run's own (metrics.jsonl:
the global batch, every process counted), so runs over several GPUs compare too: the same per-GPU batch on
1 and 2 GPUs gives the scale-out speed-up (the third example), and the 1-GPU run with the 2-GPU run's
global batch (`--batch` is per process) the curve a data-parallel run must follow (the fourth; the
speed-up column divides tokens/s). Prints a table, and writes it to ``--out PATH`` only when given.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.step import split_variants
from benchmarks.table import markdown
from k3lab.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def train(variant: str, index: int, args) -> Path:
    out_dir = Path(args.out_dir)
    # the variant's overrides come last, so that a variant may change what the others set (its batch size)
    cmd = [sys.executable, "run.py", f"trainer={args.trainer}", f"model={args.model}",
           f"train.max_steps={args.steps}", "train.log_every=1",
           f"train.val_every={args.steps}", "train.ckpt_every=0", f"data.seq_len={args.seq}",
           f"data.batch_size={args.batch}", f"out_dir={out_dir}", "group=kda_train", f"run_name=v{index}",
           "overwrite=true", *args.overrides, *shlex.split(variant)]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"  {variant}: {time.perf_counter() - t0:.0f} s wall", flush=True)
    return out_dir / "kda_train" / f"v{index}"


def losses_step_ms_memory(run_dir: Path, skip: int) -> tuple[dict[int, float], float, float, int, float]:
    """Train loss per step, the median step time in ms and tokens/s after ``skip`` steps, the tokens per
    step (the global batch, from metrics.jsonl's tokens) and the peak memory in MB (rank 0's device)."""
    rows = [r for r in read_metrics(run_dir) if "loss/train" in r]
    loss = {r["step"]: r["loss/train"] for r in rows}
    tokens_per_step = rows[-1]["tokens"] // rows[-1]["step"]
    speeds = [r["speed/tokens_per_s"] for r in rows if r["step"] > skip]
    step_ms = [1e3 * tokens_per_step / v for v in speeds]
    peak_mb = json.loads((run_dir / "summary.json").read_text())["peak_memory_mb"]
    return loss, statistics.median(step_ms), statistics.median(speeds), tokens_per_step, peak_mb


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda_train_check", description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="kernels.backend=torch,kernels.backend=triton",
                   help="override sets, comma-separated, each space-separated; the first is the reference")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--skip", type=int, default=10, help="steps left out of the step-time median")
    p.add_argument("--model", default="small")
    p.add_argument("--trainer", default="gpu")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out-dir", default="runs")
    p.add_argument("--out", default=None, metavar="PATH", help="also write the table to PATH (markdown)")
    p.add_argument("overrides", nargs="*", help="extra run.py overrides, applied to every variant")
    args = p.parse_args(argv)

    variants = split_variants(args.variants)
    labels = [v if v not in variants[:i] else f"{v}-{variants[:i].count(v) + 1}" for i, v in enumerate(variants)]
    results = {label: losses_step_ms_memory(train(v, i, args), args.skip)
               for i, (v, label) in enumerate(zip(variants, labels))}
    ref = labels[0]
    ref_loss, _, ref_speed, _, _ = results[ref]
    rows = []
    for label in labels:
        loss, ms, speed, tokens_per_step, peak_mb = results[label]
        diffs = [abs(loss[s] - ref_loss[s]) for s in sorted(set(loss) & set(ref_loss))]
        rows.append({"run": label, "steps": len(diffs), f"max abs loss diff vs {ref}": f"{max(diffs):.4f}",
                     "mean abs diff": f"{statistics.mean(diffs):.4f}", "final train loss": f"{loss[max(loss)]:.4f}",
                     "tokens/step": f"{tokens_per_step:,}", f"median step ms (steps > {args.skip})": f"{ms:.1f}",
                     "median tokens/s": f"{speed:,.0f}", f"tokens/s vs {ref}": f"{speed / ref_speed:.2f}x",
                     "peak memory MB": f"{peak_mb:,.0f}"})
    lines = [f"Loss curve and step time by variant: model={args.model}, trainer={args.trainer}, "
             f"{args.steps} steps of {args.batch}x{args.seq} tokens per process, overrides "
             f"{args.overrides or 'none'}.", "", markdown(rows)]
    for v, label in zip(variants, labels):
        if label != v:  # a repeat: does the step repeat bit for bit?
            first, again = results[v][0], results[label][0]
            same = [s for s in first if s in again and first[s] == again[s]]
            lines.append(f"\nRepeat {label} vs {v}: {len(same)} of {len(first)} logged losses bitwise equal, "
                         f"max abs diff {max(abs(first[s] - again[s]) for s in first if s in again):.2e}.")
    shown = sorted(set(sorted(ref_loss)[:: max(1, args.steps // 10)]) | {max(ref_loss)})
    curve = markdown([{"step": s, **{r: f"{results[r][0].get(s, float('nan')):.4f}" for r in labels}} for s in shown])
    text = "\n".join([*lines, "", curve]) + "\n"
    print(text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
