"""The training step of any config, timed in a bare loop and through run.py's trainer, optionally beside fla.

    python -m benchmarks.step trainer=gpu model=small data.seq_len=4096 data.batch_size=8
    python -m benchmarks.step trainer=gpu model=small --fla
    python -m benchmarks.step trainer=gpu model=small --variants "train.compile=false,train.compile=true"
    python -m benchmarks.step trainer=gpu model=small --base HEAD~1      # the last commit against its parent

The positional arguments are run.py's Hydra overrides (the shape and everything else). `--variants` runs
several override sets in this one process, each on top of the positional ones, one table row per variant
and path: sets are separated by commas outside brackets and quotes, the overrides of a set by spaces (an
empty set, or none given, is the positional overrides alone). For each variant:

- bare: the model and optimizer from the project's builders (K3Model from RunConfig.model_config, build_optimizer),
  the training module's step without Lightning: loss = model(x, y).mean + aux_loss, backward, gradient
  clipping to optim.grad_clip, optimizer and LR-scheduler step, zero_grad, router-bias update; under
  torch.autocast(bf16) when trainer.precision is bf16-mixed, bf16 parameters under bf16-true; model.compile()
  when train.compile says so (k3lab.train.compile_model, with train.activation_memory_budget and
  train.compile_mode); the configured data's training batches of the first steps, put on the device beforehand
  (and used again in turn when the timer asks for more steps). --warmup steps, then about --steps steps timed
  one by one by benchmarks.timing (the median step and its interquartile range; do_bench on CUDA); peak
  memory: torch.cuda.max_memory_allocated over the warm-up steps and one more step after the timed ones (not
  over the timed steps, during which do_bench holds its L2-flush buffer: benchmarks.timing). With --profile N, N more steps under
  torch.profiler, printed as the ops with the most device time, the matrix products by input shapes with
  the TFLOP/s each reached (`matmul_shapes`) and, on a GPU, where the device waited
  (`idle_gaps`: its idle gaps, charged to the host ops running when they opened) and where its copies
  came from (`launch_sites`); none of it is in the table or the peak, and the trainer path does the same
  through a callback. A compiled row, on either path, also prints how many graphs dynamo compiled and its
  graph breaks with their reasons.
- trainer: k3lab.train.train, what run.py runs, for warmup + steps (+ profile) steps into a temporary run
  directory, logging every train.log_every steps as a run does (a log step reads the losses back, so a
  window of one step would time the host's wait each step), validating one batch at the start and the
  end, no periodic checkpoint: tokens/s over optimizer steps warmup+1 .. warmup+steps, timed by a callback
  that synchronises the device at both ends (`StepClock`: the mean step of that window, no spread; a trainer's
  loop is not a callable that benchmarks.timing could call); peak memory from summary.json.
- with --fla (needs fla-core and flash-linear-attention 0.6.0): fla's KDAForCausalLM at each variant's
  configuration (hidden size, layers, heads, head_dim, vocabulary, FFN width; softmax-attention layers
  where the model has MLA, through its `attn` config, which needs flash-attn: add mixer=kda for an all-KDA
  comparison without it; the sigmoid decay as safe_gate with its g_min, softplus as fla's default gate;
  block or full AttnRes as `attnres_block_size` in sublayers, as here), fused linear cross-entropy, bf16
  weights, torch's fused AdamW, timed like the bare loop on the same batches. Variants that map to the
  same fla model share one fla row. All fla rows run before the others (a missing package fails at
  once); each of our rows then shows ours / fla tokens/s and peak memory against its variant's fla row.
  fla autotunes its kernels in each new process (minutes for a cold softplus row on an H200); --fla turns on
  Triton's on-disk cache of autotuning results (TRITON_CACHE_AUTOTUNING=1, unless set), so a later process
  sharing TRITON_CACHE_DIR compiles only the configurations chosen before.

One table: tokens/s and ms/step (the median step; the trainer path's mean), the IQR of the step in ms (bare and
fla rows), MFU (FLOPs per token by k3lab.flops, with the fla model's own matmul
parameters for its row, times tokens/s over the device's dense bf16 peak, k3lab.lit.PEAK_FLOPS; "-" where
unknown, e.g. the CPU), peak memory in GiB (on the CPU the process's peak resident memory, which only
grows from row to row) and, of it, what the parameters, gradients and optimizer states hold (bare and fla
rows; the rest of the peak is activations and workspace). Only the trainer path writes files, into a temporary directory it removes; the
table goes to --out PATH when given. Runs on the CPU too (tiny shapes, no --fla).

--base REV first runs the same rows from git revision REV's code in a subprocess (`base_table`) and puts its
table above this one: a change and what it changed timed in one call, on one machine. REV may also be a
directory holding such a tree, for a machine whose copy of the repository lacks the commit:
`git archive REV benchmarks k3lab kernels conf run.py pyproject.toml | tar -x -C DIR` where the commit is.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import heapq
import io
import itertools
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torch._dynamo
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from benchmarks.table import markdown
from benchmarks.timing import Timing, peak_after, time_ms
from k3lab.config import ModelConfig, OptimConfig, compile_mode, run_config
from k3lab.data import K3DataModule
from k3lab.flops import flops_per_token, mixing_flops_per_token
from k3lab.lit import clip_grad_norm, peak_flops
from k3lab.model import K3Model
from k3lab.optim import build_optimizer
from k3lab.train import compile_model, peak_memory_mb, quiet_lightning, train

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    variant: str
    path: str           # bare | trainer | fla
    tokens_per_s: float
    ms_per_step: float
    flops_per_token: float
    peak_mb: float
    state_mb: float | None = None  # parameters, gradients and optimizer states (the rest of the peak: activations)
    fla: Row | None = None         # with --fla: fla's row at this variant's configuration, for the ratios
    timing: Timing | None = None   # bare and fla rows: the timed steps' median and quartiles


def timed_row(variant: str, path: str, timing: Timing, tokens_per_step: int, flops_per_token: float,
              peak_mb: float, state_mb: float | None) -> Row:
    """A row of steps timed by benchmarks.timing: tokens/s and ms/step from the median step."""
    return Row(variant, path, tokens_per_step / timing.seconds, timing.median, flops_per_token, peak_mb, state_mb,
               timing=timing)


def split_variants(text: str) -> list[str]:
    """'a=1 b=[2,3],c=4' -> ['a=1 b=[2,3]', 'c=4']: commas inside brackets or quotes do not split."""
    out, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return out + [cur.strip()]


def compose_config(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def device_of(cfg: DictConfig) -> torch.device:
    """The one device a bare loop runs on: trainer.accelerator gpu/cuda -> cuda, cpu -> cpu."""
    tc = cfg.trainer
    if tc.devices not in (1, "1") or tc.num_nodes != 1:
        raise ValueError(f"benchmarks.step times one device: trainer.devices={tc.devices}, "
                         f"trainer.num_nodes={tc.num_nodes} (use trainer=gpu or trainer=cpu)")
    if tc.accelerator in ("gpu", "cuda"):
        return torch.device("cuda")
    if tc.accelerator == "cpu":
        return torch.device("cpu")
    raise ValueError(f"trainer.accelerator={tc.accelerator!r}: benchmarks.step runs on gpu or cpu")


def precision_of(cfg: DictConfig, device: torch.device) -> tuple[torch.dtype, contextlib.AbstractContextManager]:
    """The bare loop's parameter dtype and autocast, as Lightning's precision plugin would set them:
    bf16-mixed: fp32 parameters under bf16 autocast; bf16-true: bf16 parameters (and optimizer states),
    no autocast (fla's setting); 32-true: fp32, no autocast."""
    precision = str(cfg.trainer.precision)
    if precision == "bf16-mixed":
        return torch.float32, torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "bf16-true":
        return torch.bfloat16, contextlib.nullcontext()
    if precision in ("32-true", "32"):
        return torch.float32, contextlib.nullcontext()
    raise ValueError(f"trainer.precision={precision!r}: the bare loop runs 32-true, bf16-mixed or bf16-true")


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def training_batches(cfg: DictConfig, n: int, device: torch.device) -> tuple[K3DataModule, list]:
    """The data module and the training batches (x, y) [B, T] of steps 0..n-1, on the device."""
    dm = K3DataModule(run_config(cfg).data, seed=cfg.seed)
    dm.prepare_data()
    dm.setup("fit")
    return dm, [tuple(t.to(device) for t in dm.train_batch(s)) for s in range(n)]


def saved_tensors_table(forward, rows: int = 12) -> str:
    """What one call of forward() keeps for its backward, grouped by shape and dtype (each storage counted
    once, the largest groups first), from torch's saved-tensor hooks; the graph is dropped unused."""
    storages: dict[int, tuple[tuple, torch.dtype, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages.setdefault(st.data_ptr(), (tuple(t.shape), t.dtype, st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    groups: dict[tuple, list[int]] = {}
    for shape, dtype, nbytes in storages.values():
        g = groups.setdefault((shape, str(dtype).removeprefix("torch.")), [0, 0])
        g[0] += 1
        g[1] += nbytes
    total = sum(b for _, b in groups.values())
    largest = sorted(groups.items(), key=lambda kv: -kv[1][1])[:rows]
    return (f"Saved for backward: {total / 2**30:.2f} GiB in {len(storages)} storages\n\n"
            + markdown([{"shape": list(shape), "dtype": dtype, "tensors": n, "GiB": f"{nbytes / 2**30:.3f}"}
                        for (shape, dtype), (n, nbytes) in largest], columns=["shape", "dtype", "tensors", "GiB"]))


def training_step(model: K3Model, opt, sched, clip: float, autocast, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of the bare loop on the batch x, y [B, T]: the loss (mean cross-entropy + router aux loss)
    under `autocast`, backward, gradient clipping to `clip` (k3lab.lit.clip_grad_norm), optimizer and
    LR-scheduler step, zero_grad and the router-bias update, as the training module does (which also marks
    each step's start for CUDA graphs: k3lab.lit.K3LitModule.training_step)."""
    torch.compiler.cudagraph_mark_step_begin()
    with autocast:
        loss = model(x, y).mean + model.aux_loss()
    loss.backward()
    clip_grad_norm(model.parameters(), clip, opt)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    model.update_router_biases()


def bare_row(variant: str, cfg: DictConfig, warmup: int, steps: int, profile: int = 0, saved: bool = False) -> Row:
    device = device_of(cfg)
    reset_peak(device)
    torch.manual_seed(cfg.seed)
    torch._dynamo.utils.counters.clear()
    dm, batches = training_batches(cfg, warmup + steps + profile + saved, device)
    dtype, autocast = precision_of(cfg, device)
    model = K3Model(run_config(cfg).model_config(dm.vocab_size)).to(device=device, dtype=dtype)
    fpt = flops_per_token(model, cfg.data.seq_len)
    compile_model(model, run_config(cfg))
    optim_cfg: OptimConfig = run_config(cfg).optim
    opt, sched = build_optimizer(model, optim_cfg, total_steps=warmup + steps)
    clip = optim_cfg.grad_clip if optim_cfg.grad_clip > 0 else float("inf")
    it = itertools.cycle(batches)

    def step():
        training_step(model, opt, sched, clip, autocast, *next(it))

    timing, peak = time_with_peak(step, device, warmup, steps)
    if compile_mode(run_config(cfg)):
        print(f"  {variant or '(overrides only)'} / bare: {compiled_graphs()}", flush=True)
    row = timed_row(variant, "bare", timing, cfg.data.batch_size * cfg.data.seq_len, fpt, peak, state_mb(model, opt))
    if profile:
        print(f"Profile of {profile} bare steps, {variant or '(overrides only)'}:\n{profile_table(step, profile, device)}",
              flush=True)
    if saved:
        x, y = next(it)
        with autocast:
            table_text = saved_tensors_table(lambda: model(x, y).mean)
        print(f"{variant or '(overrides only)'} / bare: {table_text}", flush=True)
    return row


def compiled_graphs() -> str:
    """What dynamo made of the step so far: graphs compiled and graph breaks, with the commonest reasons
    (a model that compiles whole is one graph for the forward; a break splits it and runs the frame
    around it eagerly)."""
    counters = torch._dynamo.utils.counters
    breaks = counters["unimplemented"]
    reasons = "".join(f"\n    {n} x {reason.splitlines()[0]}" for reason, n in breaks.most_common(3))
    skips = counters["inductor"]["cudagraph_skips"]  # train.compile_mode=reduce-overhead: graphs not recorded
    skipped = f", {skips} graphs not recorded as CUDA graphs (TORCH_LOGS=perf_hints says why)" if skips else ""
    return (f"compiled {counters['stats']['unique_graphs']} graphs, {sum(breaks.values())} graph breaks{skipped}"
            f"{reasons}")


def profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, record_shapes=True)


def top_ops(prof: torch.profiler.profile, device: torch.device, rows: int = 50) -> str:
    """The ops with the most time on the device (the CPU when there is no GPU), self time, as torch's
    key_averages table, then `matmul_shapes`, each matrix product's time and rate by input shapes; on a GPU
    followed by `idle_gaps`, where the device waited, and `launch_sites`, where its copies and generic
    elementwise kernels came from."""
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
    shapes = matmul_shapes(prof, key)
    if device.type != "cuda":
        return "\n".join([table, shapes])
    return "\n".join([table, shapes, idle_gaps(*timeline(prof)), launch_sites(prof.events())])


# products that add into their first input: the product op their other two inputs make
ADDED_TO = {"aten::addmm": "aten::mm", "aten::baddbmm": "aten::bmm", "aten::baddbmm_": "aten::bmm"}


def product_flops(op: str, shapes: list) -> int | None:
    """FLOPs of one call of a matrix-product op from its recorded input shapes (2 m k n per product; a
    grouped product's groups together), or None for any other op."""
    if op in ADDED_TO:
        op, shapes = ADDED_TO[op], shapes[1:]
    if op == "aten::mm" and len(shapes) >= 2 and len(shapes[0]) == len(shapes[1]) == 2:
        (m, k), (_, n) = shapes[:2]
        return 2 * m * k * n
    if op == "aten::bmm" and len(shapes) >= 2 and len(shapes[0]) == len(shapes[1]) == 3:
        (b, m, k), (_, _, n) = shapes[:2]
        return 2 * b * m * k * n
    if op == "aten::_grouped_mm" and len(shapes) >= 2 and len(shapes[0]) == 2 and len(shapes[1]) in (2, 3):
        (m, k), n = shapes[0], shapes[1][-1]  # [M, K] x [groups, K, N], or [K', M'] x [M', N] (groups along M')
        return 2 * m * k * n
    return None


def matmul_shapes(prof: torch.profiler.profile, key: str, rows: int = 25) -> str:
    """The matrix products of a profile by op and input shapes (the non-scalar ones, as recorded), the most
    time first: total self time (`key`), calls, and TFLOP/s by `product_flops` (what each GEMM shape reaches,
    which the per-op table cannot say)."""
    found = []
    for avg in prof.key_averages(group_by_input_shape=True):
        flops = product_flops(avg.key, avg.input_shapes)
        if flops is not None:
            found.append((getattr(avg, key), avg.count, avg.key, avg.input_shapes, flops))
    if not found:
        return "No matrix products in the profile."
    lines = ["Matrix products by input shapes (self time, calls, TFLOP/s):"]
    for us, count, op, shapes, flops in sorted(found, key=lambda f: -f[0])[:rows]:
        rate = f"{flops * count / us / 1e6:8.2f}" if us > 0 else "       -"
        lines.append(f"  {us / 1e3:9.3f} ms  {count:5d} x  {rate}  {op} {', '.join(str(s) for s in shapes if s)}")
    return "\n".join(lines)


# device kernels whose names do not say which code launched them: copies and torch's generic elementwise loops
GENERIC_KERNELS = ("Memcpy", "elementwise_kernel")


def launch_sites(events, top: int = 8) -> str:
    """The device time of the GENERIC_KERNELS by the chain of host ops that launched them, outermost first
    (a profiler event's `kernels` are those launched from it, its `cpu_parent` the op around it), largest
    first: what the table of device time per op cannot say about a copy (the step's `aten::copy_` rows come
    from the model, the optimizer and the compiled graph alike)."""
    from torch.autograd import DeviceType

    sites: dict[tuple[str, str], list] = {}  # (kernel kind, host chain) -> [microseconds, launches]
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        hits = [(kind, k.duration) for k in e.kernels for kind in GENERIC_KERNELS if kind in k.name]
        if not hits:
            continue
        chain, op = [], e
        while op is not None:
            chain.append(op.name[:50])
            op = op.cpu_parent
        where = " > ".join(reversed(chain if len(chain) <= 5 else [*chain[:4], "...", chain[-1]]))
        for kind, us in hits:
            site = sites.setdefault((kind, where), [0.0, 0])
            site[0] += us
            site[1] += 1
    if not sites:
        return "No copies or generic elementwise kernels on the device."
    lines = ["Copies and generic elementwise kernels by the host ops that launched them:"]
    for (kind, where), (us, n) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.3f} ms  {n:5d} x {kind}  from {where}")
    return "\n".join(lines)


def profile_table(step, n: int, device: torch.device) -> str:
    """`top_ops` over n calls of step()."""
    with profiler(device) as prof:
        for _ in range(n):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return top_ops(prof, device)


@dataclass(frozen=True)
class Span:
    """One event of a profile: [start, end) in microseconds, its name and (host ops) its thread."""
    start: float
    end: float
    name: str
    thread: int = 0


def timeline(prof: torch.profiler.profile) -> tuple[list[Span], list[Span]]:
    """(device kernels and copies, host ops) of a finished profile."""
    from torch.autograd import DeviceType

    kernels, host = [], []
    for e in prof.events():
        span = Span(e.time_range.start, e.time_range.end, e.name, e.thread)
        if e.device_type == DeviceType.CUDA:
            kernels.append(span)
        elif e.device_type == DeviceType.CPU and not e.is_async:
            host.append(span)
    return kernels, host


def idle_gaps(kernels: list[Span], host: list[Span], top: int = 8, min_us: float = 20.0) -> str:
    """Where the device waited: its busy time (kernels on any stream merged into one time line) over the
    span from its first kernel to its last, and each idle gap charged to what the host was doing when the
    gap opened: of the host threads inside some op then, the one whose innermost op started last (the
    thread that was launching), named by its ops from the outermost in. A device that waits in one place
    has a host-bound step there (the launches or a synchronisation), which the table of device time per op
    cannot show. Prints the idle time by outermost host op, then the `top` largest gaps of at least
    `min_us` microseconds with the kernels either side."""
    if not kernels:
        return "No device kernels in the profile."
    merged: list[list] = []  # busy intervals: [start, end, its first kernel, the kernel that ends it]
    for k in sorted(kernels, key=lambda k: k.start):
        if merged and k.start <= merged[-1][1]:
            if k.end > merged[-1][1]:
                merged[-1][1], merged[-1][3] = k.end, k.name
        else:
            merged.append([k.start, k.end, k.name, k.name])
    busy = sum(end - start for start, end, *_ in merged)
    window = max(merged[-1][1] - merged[0][0], 1e-9)  # a lone zero-length kernel spans no time
    opened = [end for _, end, *_ in merged[:-1]]
    by_op: dict[str, float] = {}
    gaps = []
    for (_, end, _, before), (start, _, after, _), chain in zip(merged, merged[1:], host_chains(host, opened)):
        outermost = chain[0] if chain else "(no host op)"
        by_op[outermost] = by_op.get(outermost, 0.0) + start - end
        gaps.append((start - end, before, after, chain))
    idle = window - busy
    lines = [f"Device busy {busy / 1e3:.2f} ms of the {window / 1e3:.2f} ms from its first kernel to its last "
             f"({busy / window:.1%}); idle {idle / 1e3:.2f} ms in {len(gaps)} gaps, "
             f"{sum(g[0] >= min_us for g in gaps)} of them >= {min_us:g} us.",
             "Idle time by the host op running when each gap opened (outermost op):"]
    lines += [f"  {us / 1e3:8.3f} ms  {name[:90]}" for name, us in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]]
    lines.append(f"Largest gaps (>= {min_us:g} us):")
    for us, before, after, chain in sorted((g for g in gaps if g[0] >= min_us), key=lambda g: -g[0])[:top]:
        where = " > ".join(name[:50] for name in chain) if chain else "(no host op)"
        lines.append(f"  {us / 1e3:8.3f} ms  after {before[:40]}, before {after[:40]}; host: {where}")
    return "\n".join(lines)


def host_chains(host: list[Span], times: list[float]) -> list[list[str]]:
    """For each time of `times` (ascending), the names of the host ops running then on the launching thread
    (see `idle_gaps`), outermost first: one sweep over the ops by start time, with a heap of those open."""
    spans = sorted(host, key=lambda s: s.start)
    open_ops: list[tuple[float, int]] = []  # (end, index into spans)
    chains, i = [], 0
    for t in times:
        while i < len(spans) and spans[i].start <= t:
            heapq.heappush(open_ops, (spans[i].end, i))
            i += 1
        while open_ops and open_ops[0][0] <= t:
            heapq.heappop(open_ops)
        by_thread: dict[int, list[Span]] = {}
        for _, j in open_ops:
            by_thread.setdefault(spans[j].thread, []).append(spans[j])
        ops = max(by_thread.values(), key=lambda ops: max(s.start for s in ops)) if by_thread else []
        chains.append([s.name for s in sorted(ops, key=lambda s: (s.start, -s.end))])
    return chains


class ProfileSteps(L.Callback):
    """torch.profiler over the trainer's optimizer steps first+1 .. first+n (after `first` have run); the
    table (`top_ops`) is in `self.table` once they have. A callback rather than Lightning's
    PyTorchProfiler, so that both paths' tables come from one `top_ops` over exactly the steps named."""

    def __init__(self, first: int, n: int, device: torch.device):
        self.first, self.n, self.device = first, n, device
        self.prof, self.table = None, ""

    def on_train_batch_start(self, trainer, *_):
        if trainer.global_step == self.first and self.prof is None:
            self.prof = profiler(self.device)
            self.prof.__enter__()

    def on_train_batch_end(self, trainer, *_):
        if self.prof is not None and not self.table and trainer.global_step == self.first + self.n:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.table = top_ops(self.prof, self.device)


class StepClock(L.Callback):
    """Wall time from the end of optimizer step `first` to the end of step `last`, the device synchronised at
    both (the first batch end that sees each step count, so gradient accumulation's later micro-batches do
    not move it): `seconds`, once both have passed."""

    def __init__(self, first: int, last: int, device: torch.device):
        self.first, self.last, self.device = first, last, device
        self.times: dict[int, float] = {}

    def on_train_batch_end(self, trainer, *_):
        if trainer.global_step in (self.first, self.last) and trainer.global_step not in self.times:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[trainer.global_step] = time.perf_counter()

    @property
    def seconds(self) -> float:
        return self.times[self.last] - self.times[self.first]


def trainer_row(variant: str, overrides: list[str], warmup: int, steps: int, tmp: Path, index: int,
                profile: int = 0, tail: int = 0, callbacks: Sequence[L.Callback] = ()) -> Row:
    """The trainer path's row (module docstring): warmup + steps (+ profile) steps, then `tail` more untimed
    ones, in run directory tmp/step/v<index> (its summary.json stays there); `callbacks` run before the
    clock's at each hook."""
    total = warmup + steps + profile + tail
    run = [f"train.max_steps={total}", f"train.val_every={total}", "train.val_batches=1", "train.ckpt_every=0",
           f"out_dir={tmp}", "group=step", f"run_name=v{index}", "overwrite=true"]
    cfg = compose_config([*overrides, *run])
    device = device_of(cfg)
    reset_peak(device)
    torch._dynamo.utils.counters.clear()
    clock = StepClock(warmup, warmup + steps, device)
    probe = ProfileSteps(warmup + steps, profile, device)
    summary = train(cfg, overrides=[*overrides, *run], callbacks=[*callbacks, clock, *([probe] if profile else [])])
    if compile_mode(run_config(cfg)):
        print(f"  {variant or '(overrides only)'} / trainer: {compiled_graphs()}", flush=True)
    if profile:
        print(f"Profile of {profile} trainer steps, {variant or '(overrides only)'}:\n{probe.table}", flush=True)
    tokens_per_s = steps * summary["tokens_per_step"] / clock.seconds
    return Row(variant, "trainer", tokens_per_s, 1e3 * summary["tokens_per_step"] / tokens_per_s,
               summary["flops_per_token"], summary["peak_memory_mb"])


def fla_config(cfg: DictConfig, vocab_size: int) -> dict:
    """The KDAConfig arguments of fla's model at this config (see the module docstring)."""
    mc: ModelConfig = run_config(cfg).model_config(vocab_size)
    attn_layers = [i for i, kind in enumerate(mc.layer_kinds()) if kind == "mla"]
    sigmoid = mc.decay.name == "sigmoid"
    attnres = None if mc.residual.name == "standard" else mc.residual.sublayers_per_block(2 * mc.n_layers)
    return dict(hidden_size=mc.width, num_hidden_layers=mc.n_layers, num_heads=mc.n_heads, head_dim=mc.head_dim,
                vocab_size=mc.vocab_size, intermediate_size=mc.ffn_hidden, conv_size=mc.conv_size,
                norm_eps=mc.norm_eps, tie_word_embeddings=mc.tie_embeddings, safe_gate=sigmoid,
                lower_bound=mc.decay.g_min if sigmoid else None,
                attn={"layers": attn_layers, "num_heads": mc.n_heads} if attn_layers else None,
                attnres_block_size=attnres, fuse_cross_entropy=True)


def fla_row(cfg: DictConfig, warmup: int, steps: int, variant: str = "") -> Row:
    """fla's KDAForCausalLM at this config (see the module docstring), on the same batches."""
    from fla.models import KDAConfig, KDAForCausalLM

    device = device_of(cfg)
    reset_peak(device)
    torch.manual_seed(cfg.seed)
    dm, batches = training_batches(cfg, warmup + steps, device)
    mc: ModelConfig = run_config(cfg).model_config(dm.vocab_size)
    config = KDAConfig(**fla_config(cfg, dm.vocab_size))
    try:
        model = KDAForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    except ImportError as err:
        raise ImportError(f"fla's softmax-attention layers (at the MLA positions {config.attn['layers']}) need "
                          f"flash-attn: "
                          f"{err}. Add mixer=kda to compare all-KDA models without it.") from err
    embed = model.get_input_embeddings().weight
    matmul = sum(p.numel() for p in model.parameters() if p.ndim >= 2 and p is not embed)
    fpt = 6.0 * matmul + mixing_flops_per_token(mc, cfg.data.seq_len)
    optim_cfg: OptimConfig = run_config(cfg).optim
    opt = torch.optim.AdamW(model.parameters(), lr=optim_cfg.adam_lr, betas=tuple(optim_cfg.betas),
                            eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay, fused=True)
    clip = optim_cfg.grad_clip if optim_cfg.grad_clip > 0 else float("inf")
    model.train()
    it = itertools.cycle(batches)

    def step():
        x, _ = next(it)
        loss = model(input_ids=x, labels=x).loss  # fla shifts the labels: next-token loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    timing, peak = time_with_peak(step, device, warmup, steps)
    return timed_row(variant, "fla", timing, cfg.data.batch_size * cfg.data.seq_len, fpt, peak, state_mb(model, opt))


def state_mb(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """MB held by the parameters, their gradients and the optimizer's state tensors (storages counted once)."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) / 2**20


def time_with_peak(step, device: torch.device, warmup: int, steps: int) -> tuple[Timing, float]:
    """benchmarks.timing's timing of `steps` calls of step() after `warmup` ones, and the peak memory in MB of
    the warm-up and of one more call after the timed ones (on CUDA; on the CPU the process's peak)."""
    for _ in range(warmup):
        step()
    warm = peak_mb(device)
    timing = time_ms(step, device, steps, warmup=0)
    if device.type != "cuda":
        return timing, peak_mb(device)
    return timing, max(warm, peak_after(step) / 2**20)


def peak_mb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_memory_mb()


def gpu_board(query=subprocess.run) -> str:
    """", board GPU-1a2b3c4d, power limit 700 W, SM clock up to 1980 MHz" for the first visible GPU, from
    nvidia-smi (the board by the start of its UUID); "" where it is missing or says nothing usable. Rows of
    one model's boards differ by up to 3% on the H200 (benchmarks/RESULTS.md): the header says which board a
    table came from, so that rows of separate calls are compared on one board."""
    try:
        out = query(["nvidia-smi", "--query-gpu=uuid,power.limit,clocks.max.sm", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=30).stdout
        uuid, watts, mhz = (v.strip() for v in out.splitlines()[0].split(","))
        watts, mhz = float(watts), float(mhz)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return ""
    return f", board {uuid[:12]}, power limit {watts:.0f} W, SM clock up to {mhz:.0f} MHz"


def progress(row: Row, seconds: float) -> str:
    """One line per finished row, so that a run stopped early still tells what it measured, with the
    row's wall time (compilation and autotuning included: what a device call has to leave room for)."""
    vs = (f" ({row.tokens_per_s / row.fla.tokens_per_s:.3f}x fla, {row.peak_mb / row.fla.peak_mb:.3f}x memory)"
          if row.fla else "")
    return (f"{row.variant or '(overrides only)'} / {row.path}: {row.tokens_per_s:,.0f} tokens/s, "
            f"{row.peak_mb / 1024:.2f} GiB{vs}; the row took {seconds:.0f} s")


def table(rows: list[Row], header: list[str]) -> str:
    peak = peak_flops()
    with_fla = any(r.fla for r in rows)
    cells = []
    for r in rows:
        cell = {"variant": r.variant or "(overrides only)", "path": r.path, "tokens/s": f"{r.tokens_per_s:,.0f}",
                "ms/step": f"{r.ms_per_step:.2f}", "IQR ms": r.timing.iqr(2) if r.timing else "-",
                "MFU": f"{r.tokens_per_s * r.flops_per_token / peak:.1%}" if peak else "-",
                "peak memory GiB": f"{r.peak_mb / 1024:.2f}",
                "of it parameters, gradients, optimizer states": f"{r.state_mb / 1024:.2f}" if r.state_mb is not None
                else "-"}
        if with_fla:  # three decimals: the goals are ratios (1.3x, 1.2x), and 1.296 printed as 1.30 would read as met
            cell["ours / fla tokens/s"] = f"{r.tokens_per_s / r.fla.tokens_per_s:.3f}" if r.fla else ""
            cell["ours / fla memory"] = f"{r.peak_mb / r.fla.peak_mb:.3f}" if r.fla else ""
        cells.append(cell)
    return "\n".join([*header, "", markdown(cells)]) + "\n"


BASE_PATHS = ("benchmarks", "k3lab", "kernels", "conf", "run.py", "pyproject.toml")  # the code a row runs


def base_argv(args: argparse.Namespace) -> list[str]:
    """The command line of these rows for `base_table`: every option but --base and --out."""
    flags = [f"--{name}" for name in ("saved", "fla") if getattr(args, name)]
    return [*args.overrides, "--warmup", str(args.warmup), "--steps", str(args.steps), "--variants", args.variants,
            "--paths", args.paths, "--profile", str(args.profile), *flags]


def base_table(rev: str, argv: list[str]) -> str:
    """Run `python -m benchmarks.step argv` from git revision rev's code (BASE_PATHS of `git archive rev`, in
    a temporary directory) or from rev itself where it is a directory holding such a tree (a commit the
    machine's repository lacks, archived elsewhere and copied over); returns its table under a line naming
    rev, for the rows of the working tree that follow in the same call (rows of separate calls differ by about
    a percent on the H200: benchmarks/RESULTS.md)."""
    if (Path(rev) / "benchmarks" / "step.py").is_file():
        return _base_rows(Path(rev).resolve(), f"{rev} (a tree)", argv)
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True)
    if commit.returncode:
        raise SystemExit(f"--base {rev!r}: not a commit of {ROOT} ({commit.stderr.strip()}), nor a directory "
                         f"holding benchmarks/step.py")
    sha = commit.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="k3lab-base-") as tree:
        archive = subprocess.run([*git, "archive", sha, *BASE_PATHS], capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        return _base_rows(Path(tree), f"{rev} ({sha[:7]})", argv)


def _base_rows(tree: Path, label: str, argv: list[str]) -> str:
    """`base_table`'s rows: the benchmark run in a subprocess that starts in `tree`, so that its packages come
    before any installed copy, its output streamed; its table under "Base <label>:"."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]))
    print(f"Base {label}, from {tree}:", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.step", *argv], cwd=tree, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    if proc.wait():
        raise SystemExit(f"--base {label}: its rows failed (exit {proc.returncode}); its output is above")
    table_lines = [line for line in lines if line.startswith("|")]
    return f"Base {label}:\n\n" + "".join(table_lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=int, default=10, help="steps before the timed ones (compilation happens here)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--variants", default="", help="override sets, comma-separated, each space-separated")
    p.add_argument("--paths", default="bare,trainer", help="comma-separated: bare, trainer")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each row's timed steps, profile N more and print the ops with the most device time "
                        "and, on a GPU, where the device waited and which host ops launched its copies")
    p.add_argument("--saved", action="store_true",
                   help="after each bare row, list what one forward keeps for the backward, by shape and dtype")
    p.add_argument("--fla", action="store_true", help="also fla's KDAForCausalLM at each variant's configuration")
    p.add_argument("--out", default=None, metavar="PATH", help="also write the table to PATH (markdown)")
    p.add_argument("--base", default=None, metavar="REV",
                   help="first run the same rows from git revision REV's code, or from the tree in directory REV "
                        "(`base_table`): an A/B in one call")
    p.add_argument("overrides", nargs="*", help="run.py overrides for every variant")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.profile < 0:
        p.error("--warmup and --steps must be >= 1, --profile >= 0")
    paths = args.paths.split(",")
    if not paths or set(paths) - {"bare", "trainer"}:
        p.error(f"--paths {args.paths!r}: valid paths are bare, trainer")
    base = base_table(args.base, base_argv(args)) if args.base else ""
    quiet_lightning()
    if args.fla:  # before fla's modules build their autotuners, which read it then
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    variants = split_variants(args.variants)
    configs = [compose_config([*args.overrides, *shlex.split(v)]) for v in variants]
    first = configs[0]
    # fla first, so that a missing package fails at once; one row per distinct fla model (the data config
    # stands in for the vocabulary, which comes from the data)
    fla_by_model: dict[str, Row] = {}
    fla_of_variant: list[Row | None] = []
    for variant, cfg in zip(variants, configs):
        key = repr((sorted(fla_config(cfg, 0).items()), cfg.data, cfg.optim)) if args.fla else None
        if args.fla and key not in fla_by_model:
            start = time.perf_counter()
            fla_by_model[key] = fla_row(cfg, args.warmup, args.steps, variant)
            print(f"  {progress(fla_by_model[key], time.perf_counter() - start)}", flush=True)
        fla_of_variant.append(fla_by_model.get(key))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="k3lab-step-") as tmp:
        for i, (variant, cfg) in enumerate(zip(variants, configs)):
            overrides = [*args.overrides, *shlex.split(variant)]
            for path in paths:
                start = time.perf_counter()
                torch._dynamo.reset()
                if path == "bare":
                    row = bare_row(variant, cfg, args.warmup, args.steps, args.profile, args.saved)
                else:
                    row = trainer_row(variant, overrides, args.warmup, args.steps, Path(tmp), i, args.profile)
                row.fla = fla_of_variant[i]
                rows.append(row)
                print(f"  {progress(row, time.perf_counter() - start)}", flush=True)
    rows += fla_by_model.values()
    device = torch.cuda.get_device_name() + gpu_board() if device_of(first).type == "cuda" else "CPU"
    header = [f"Training step, {device}, torch {torch.__version__}: {first.data.batch_size} x {first.data.seq_len} tokens, "
              f"{args.warmup} warm-up + {args.steps} timed steps (bare and fla: the median step, benchmarks.timing; "
              f"trainer: the mean over the window).",
              "", f"    python -m benchmarks.step {shlex.join(sys.argv[1:] if argv is None else argv)}"]
    text = base + table(rows, header)
    print(text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
