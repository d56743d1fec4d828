"""Cost of Attention Residuals: step time and activation memory of residual=standard|block|full.

    python -m benchmarks.attnres_bench --device cpu            # small, a few minutes on 2 cores
    python -m benchmarks.attnres_bench --device cuda           # >= 12 layers, bf16 autocast (one H200)
    python -m benchmarks.attnres_bench --device cuda --profile --tune   # where the residual's time goes

Every variant is the same model (same seed, same tokens) with only the residual switched. By default
that is k3lab's K3Model (KDA/MLA 3:1, dense GLU FFN); `--model standin` (or when K3Model cannot be
imported) uses a plain stack of causal-SDPA attention and GLU MLP sublayers instead.

Measured per variant:
  ms/step      forward + cross-entropy + backward + AdamW step: the median step and its interquartile
               range (benchmarks.timing: triton.testing.do_bench on CUDA), variants one after another
  saved MB     activation memory: bytes of the distinct tensors autograd saves for backward in one
               forward (parameters excluded), counted with saved_tensors_hooks; works on any device
  peak MB      CUDA only: peak allocated during forward+backward minus what was allocated before it
and the overhead of each against `standard`. On CUDA the AttnRes mix runs as the fused Triton kernels
(kernels/attnres.py) wherever they apply. `--impl-variants` adds five alternative AttnRes mixes for
comparison: `torch` (the hand-written torch autograd.Function, the CPU path, also on CUDA), `autograd`
(the op in plain autograd ops, no hand-written backward), `nocache` (1/rms of every source recomputed by
every op), `stack` (torch.stack of the sources + RMSNorm + einsum, as in the paper's pseudocode) and
`twophase` (`kernels.attnres_two_phase`: one pass over a block's completed sources for all its ops, then a
merge per op; fused kernels/attnres_block.py on CUDA, torch ops on the CPU).
Any variant takes an implementation suffix, e.g. `--variants standard,block_attnres,block_attnres[torch]`.
A second table times the residual alone (the seam driven by cheap elementwise sublayers), where the cost
of the mix is not hidden by the layers. Instead of the tables, `--profile` lists the top kernels of
block_attnres' residual alone (torch.profiler; registers and occupancy on CUDA) and `--tune` times the
fused mix kernels alone over launch configs (rows per program, num_warps, backward programs per SM). Every
time is benchmarks.timing's median.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from benchmarks.kda_bench import saved_bytes
from benchmarks.table import markdown
from benchmarks.timing import time_ms
from k3lab.config import GLUConfig, ModelConfig, MoEConfig, ResidualConfig
from k3lab.model import attnres
from k3lab.model.ffn import GLU
from k3lab.model.norm import RMSNorm
from k3lab.model.residual import build_residual
from kernels.device import sm_count


# --- a stand-in stack (used when K3Model is unavailable, or with --model standin) -------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, head_dim: int):
        super().__init__()
        self.n_heads, self.head_dim = d // head_dim, head_dim
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).transpose(1, 3).unbind(2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, T, D))


class PreNorm(nn.Module):
    def __init__(self, d: int, fn: nn.Module):
        super().__init__()
        self.norm, self.fn = RMSNorm(d), fn

    def forward(self, x):
        return self.fn(self.norm(x))


class StandInLM(nn.Module):
    """tokens [B, T] -> logits [B, T, V]: L x (attention, GLU MLP), each PreNorm, driven by the residual seam."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D = cfg.width
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.sublayers = nn.ModuleList()
        for _ in range(cfg.n_layers):
            self.sublayers.append(PreNorm(D, CausalSelfAttention(D, cfg.head_dim)))
            self.sublayers.append(PreNorm(D, GLU(D, cfg.ffn_hidden, GLUConfig(name="swiglu"))))
        self.residual = build_residual(cfg.residual, len(self.sublayers), D, cfg.norm_eps)
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, cfg.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=cfg.init_std)

    def forward(self, tokens):
        state = self.residual.begin(self.embed(tokens))
        for i, sublayer in enumerate(self.sublayers):
            state = self.residual.write(state, i, sublayer(self.residual.read(state, i)))
        return self.lm_head(self.norm(self.residual.end(state))).float()


# --- alternative AttnRes mixes, to measure the choices made in k3lab.model.attnres ---------------
class StackedMix(attnres.AttnResidual):
    """Sources stacked into one [S, B, T, D] tensor per op; RMSNorm applied to the stack (paper pseudocode)."""

    def _mix(self, state, op):
        V = torch.stack(self.op_inputs(state)[0])
        K = self.norms[op](V)
        logits = (K @ self.queries[op].to(K.dtype)).float()
        alpha = logits.softmax(0)
        return torch.einsum("sbt,sbtd->btd", alpha.to(V.dtype), V)


class TorchMix(attnres.AttnResidual):
    """Like AttnResidual, but the mix always in torch ops (`_DepthSoftmaxMix`), never the Triton kernels."""
    mix = staticmethod(functools.partial(attnres.depth_softmax_mix, impl="torch"))


class NoCacheMix(attnres.AttnResidual):
    """Like AttnResidual, but every op recomputes 1/rms of every source."""

    def op_inputs(self, state):
        values = state.sources + ([state.partial] if state.partial is not None else [])
        return values, [attnres.inv_rms(v, self.eps) for v in values]


class AutogradMix(attnres.AttnResidual):
    """Like AttnResidual, but the op in plain autograd ops instead of the hand-written backward."""
    mix = staticmethod(attnres.depth_softmax_mix_autograd)


class TwoPhaseMix(attnres.AttnResidual):
    """Like AttnResidual with kernels.attnres_two_phase: phase 1 per block, a merge per op."""

    def __init__(self, cfg, n_sublayers, d_model, eps):
        super().__init__(cfg, n_sublayers, d_model, eps, two_phase=True)


IMPLS = {"torch": TorchMix, "stack": StackedMix, "nocache": NoCacheMix, "autograd": AutogradMix,
         "twophase": TwoPhaseMix}


def build_model(kind: str, cfg: ModelConfig) -> nn.Module:
    if kind in ("auto", "k3"):
        try:
            from k3lab.model.k3 import K3Model

            return K3Model(cfg)
        except ImportError as err:
            if kind == "k3":
                raise
            print(f"[attnres_bench] K3Model not importable ({err}); using the stand-in stack")
    return StandInLM(cfg)


def variant_model(kind: str, base: ModelConfig, variant: str, state_dict: dict | None) -> nn.Module:
    name, _, impl = variant.partition("[")
    cfg = copy.deepcopy(base)
    cfg.residual = ResidualConfig(name=name, block_size=base.residual.block_size, n_blocks=base.residual.n_blocks)
    model = build_model(kind, cfg)
    if impl:
        old = model.residual
        new = IMPLS[impl.rstrip("]")](cfg.residual, old.n_sublayers, cfg.width, cfg.norm_eps)
        new.load_state_dict(old.state_dict())
        model.residual = new
    if state_dict is not None:  # the same weights for every variant (AttnRes adds only its own params)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected and all(k.startswith("residual.") for k in missing), (missing, unexpected)
    return model


# --- measurement ----------------------------------------------------------------------------------
def make_step(model, tokens, args, device):
    """Returns (step, forward): step() runs one timed training step and returns its loss."""
    model.to(device)
    compiled = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            logits = compiled(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def step():
        loss = forward()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, forward


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(models: dict, tokens, args, device) -> dict:
    """Time each variant's training step, then measure its memory; the loss is that of one more step."""
    steps = {v: make_step(m, tokens, args, device) for v, m in models.items()}
    rows = {}
    for v, (step, forward) in steps.items():
        timing = time_ms(step, device, args.steps, args.warmup)
        row = {"ms": timing.median, "iqr": timing.iqr(1), "loss": step().item()}
        row["saved_mb"] = saved_bytes(forward, exclude=list(models[v].parameters()))[0] / 2**20
        for p in models[v].parameters():
            p.grad = None
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            forward().backward()
            sync(device)
            row["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            for p in models[v].parameters():
                p.grad = None
        rows[v] = row
    return rows


def seam_steps(variants, args, device) -> dict:
    """variant -> step(): one forward + backward of the residual alone, begin/read/write/end over 2L cheap
    sublayers f_i(x) = x * c_i + n_i (n_i fixed random [B, T, D]). Isolates the residual's cost from the layers'."""
    n_sub, D = 2 * args.layers, args.d_model
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    noise = [torch.randn(args.batch, args.seq, D, generator=g).to(device, dtype) for _ in range(n_sub)]
    emb0 = torch.randn(args.batch, args.seq, D, generator=g).to(device, dtype)
    scales = torch.linspace(0.5, 1.0, n_sub).tolist()
    residuals = {}
    for v in variants:
        name, _, impl = v.partition("[")
        cfg = ResidualConfig(name=name, block_size=args.block_size)
        cls = IMPLS[impl.rstrip("]")] if impl else None
        res = build_residual(cfg, n_sub, D, 1e-6) if cls is None else cls(cfg, n_sub, D, 1e-6)
        residuals[v] = res.to(device)

    def seam(res, emb):
        state = res.begin(emb)
        for i in range(n_sub):
            state = res.write(state, i, res.read(state, i) * scales[i] + noise[i])
        return res.end(state).float().square().mean()

    def step(fn):
        fn(emb0.clone().requires_grad_(True)).backward()

    return {v: functools.partial(step, torch.compile(functools.partial(seam, res)) if args.compile
                                 else functools.partial(seam, res)) for v, res in residuals.items()}


def bench_seam(variants, args, device) -> dict:
    """Each `seam_steps` step timed (3 x --steps calls): its median and IQR in ms."""
    steps = seam_steps(variants, args, device)
    timings = {v: time_ms(step, device, 3 * args.steps, args.warmup) for v, step in steps.items()}
    return {v: {"ms": t.median, "iqr": t.iqr(2)} for v, t in timings.items()}


def kernel_resources(prof) -> dict[str, str]:
    """CUDA kernel name -> its registers per thread and Kineto's estimated occupancy, as ranges over its
    launches (one name covers every compiled variant, e.g. _mix_fwd for each source count)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    seen = defaultdict(lambda: (set(), set()))
    for e in events:
        if e.get("cat") == "kernel":
            regs, occ = seen[e["name"]]
            regs.add(e.get("args", {}).get("registers per thread"))
            occ.add(e.get("args", {}).get("est. achieved occupancy %"))

    def span(xs):
        xs = sorted(x for x in xs if x is not None)
        return "?" if not xs else f"{xs[0]}" if xs[0] == xs[-1] else f"{xs[0]}-{xs[-1]}"

    return {name: f"{span(regs)} regs, {span(occ)}% occ" for name, (regs, occ) in seen.items()}


def profile_seam(args, device, variant: str = "block_attnres", n_steps: int = 3, top: int = 15) -> None:
    """torch.profiler over `n_steps` steps of the residual alone (after args.warmup): the `top` CUDA kernels
    (CPU ops on CPU) by self time, per step, and busy time against the unprofiled step's time
    (benchmarks.timing, n_steps calls)."""
    step = seam_steps([variant], args, device)[variant]
    wall = time_ms(step, device, n_steps, args.warmup)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(n_steps):
            step()
        sync(device)
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        self_us = {e.key: e.self_device_time_total for e in events}
        resources = kernel_resources(prof)
    else:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU]
        self_us = {e.key: e.self_cpu_time_total for e in events}
        resources = {}
    total_us = sum(self_us.values())
    unit = "CUDA kernels" if cuda else "CPU ops"
    print(f"\nprofile: residual alone, {variant}, {n_steps} steps after {args.warmup} warm-up; "
          f"top {top} {unit} by self time")
    print(f"{'name':60} | calls/step | ms/step |  us/call | share" + (" | resources" if cuda else ""))
    for e in sorted(events, key=lambda e: -self_us[e.key])[:top]:
        us = self_us[e.key]
        print(f"{e.key[:60]:60} | {e.count / n_steps:10.1f} | {us / 1e3 / n_steps:7.3f} | {us / e.count:8.1f} | "
              f"{100 * us / total_us:4.1f}%" + (f" | {resources.get(e.key, '')}" if cuda else ""))
    print(f"{unit} {'busy' if cuda else 'self time'} {total_us / 1e3 / n_steps:.2f} ms/step; the unprofiled step "
          f"{wall.median:.2f} ms (IQR {wall.iqr(2)})"
          + (" (a step well above busy: bound by launches / CPU)" if cuda else ""))


TUNE_ROWS = (1, 2, 4)
TUNE_WARPS = (1, 2, 4, 8)
TUNE_PROGRAMS_PER_SM = (4, 8, 12, 16)


def parse_sources(text: str) -> list[int]:
    """"1-10" or "2,5,9" -> source counts."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def tune_mix(args, device) -> None:
    """Time the fused mix kernels alone on S random bf16 sources [N, D] (N = --tune-rows, D = --d-model) for
    S in --tune-sources, over launch configs (rows per program BT, num_warps) from TUNE_ROWS x TUNE_WARPS
    with 2..32 elements of a [BT, BD] tile per thread, plus the defaults of `kernels.attnres`: the forward;
    the backward with each config for the values kernel (scores kernel at its default); the backward with
    each config and programs per SM for the scores kernel (values kernel at its default). Per S a table,
    best marked with *, then the defaults against the best."""
    import triton

    from kernels import attnres as fused

    N, D = args.tune_rows, args.d_model
    BD = triton.next_power_of_2(D)

    def per_thread(cfg):
        return cfg[0] * BD // (32 * cfg[1])

    sms = sm_count(device)
    print(f"\ntune: fused mix alone, N={N} rows, D={D}, bf16 sources; {sms} SMs")
    default, default_s = fused.default_launch(D), fused.default_launch(D, fused.SCORES_ELEMENTS_PER_THREAD)
    grid = [(bt, w) for bt in TUNE_ROWS for w in TUNE_WARPS if 2 <= per_thread((bt, w)) <= 32]
    configs = grid + [c for c in {default, default_s} if c not in grid]
    pps_list = sorted(set(TUNE_PROGRAMS_PER_SM) | {fused.PROGRAMS_PER_SM})
    summary = []
    for S in parse_sources(args.tune_sources):
        gen = torch.Generator(device=device).manual_seed(S)
        values = [torch.randn(1, N, D, generator=gen, device=device).to(torch.bfloat16) for _ in range(S)]
        scales = [attnres.inv_rms(v, 1e-6) for v in values]
        query = torch.randn(D, generator=gen, device=device) * 0.5
        g_h = torch.randn(1, N, D, generator=gen, device=device).to(torch.bfloat16)
        _, logits = fused.mix_forward(values, scales, query)
        fwd_gb = ((S + 1) * N * D * 2 + 2 * S * N * 4) / 1e9  # S reads, h write; r reads, alpha write
        # g_h read by both backward kernels, S reads, S writes; per-source row scalars [S, N]: alpha and r
        # read twice, g_alpha written and read, the logits read, g_r written; c [N] fp64 written and read
        bwd_gb = ((2 * S + 2) * N * D * 2 + 8 * S * N * 4 + 16 * N) / 1e9

        def backward(values_cfg=default, scores_cfg=default_s, pps=fused.PROGRAMS_PER_SM):
            return time_ms(lambda: fused.mix_backward(values, scales, query, logits, g_h, launch=values_cfg,
                                                      scores_launch=scores_cfg, programs=pps * sms),
                           device, args.steps).median

        fwd = {cfg: time_ms(lambda: fused.mix_forward(values, scales, query, launch=cfg), device, args.steps).median
               for cfg in configs}
        val = {cfg: backward(values_cfg=cfg) for cfg in configs}
        sco = {(cfg, pps): backward(scores_cfg=cfg, pps=pps) for cfg in configs for pps in pps_list}
        best_f, best_v, best_s = min(fwd, key=fwd.get), min(val, key=val.get), min(sco, key=sco.get)
        print(f"\nS={S}: forward moves {1e3 * fwd_gb:.1f} MB, backward {1e3 * bwd_gb:.1f} MB")
        sco_header = f"backward ms, scores kernel's config at {', '.join(map(str, pps_list))} programs/SM"
        print(f"  BT warps elem/thr |   fwd ms   GB/s | bwd ms, values' config | {sco_header}")
        for cfg in configs:
            marks = ["*" if (cfg, p) == best_s else " " for p in pps_list]
            tags = [name for name, d in (("forward and values", default), ("scores", default_s)) if cfg == d]
            print(f"{cfg[0]:4} {cfg[1]:5} {per_thread(cfg):8} | {fwd[cfg]:8.3f}{'*' if cfg == best_f else ' '}"
                  f"{fwd_gb / fwd[cfg] * 1e3:6.0f} | {val[cfg]:21.3f}{'*' if cfg == best_v else ' '} | "
                  + " ".join(f"{sco[cfg, p]:8.3f}{m}" for p, m in zip(pps_list, marks))
                  + (f"  <- default ({', '.join(tags)})" if tags else ""))
        base = sco[default_s, fused.PROGRAMS_PER_SM]
        summary.append((S, fwd[default], fwd[best_f], best_f, val[default], val[best_v], best_v,
                        base, sco[best_s], best_s, bwd_gb))
    print("\ndefaults vs best, ms (forward; backward by the values kernel's config; by the scores kernel's)")
    for S, f0, f1, cf, v0, v1, cv, s0, s1, (cs, pps), gb in summary:
        print(f"S={S}: fwd {f0:.3f} -> {f1:.3f} (BT={cf[0]}, warps={cf[1]}); values {v0:.3f} -> {v1:.3f} "
              f"(BT={cv[0]}, warps={cv[1]}); scores {s0:.3f} -> {s1:.3f} (BT={cs[0]}, warps={cs[1]}, {pps}/SM); "
              f"backward at the defaults {gb / s0 * 1e3:.0f} GB/s")


def print_table(rows: dict, cols: list[tuple[str, str, bool]]) -> None:
    """One row per variant; cols: (header, key, with overhead vs standard), a time's IQR after it."""
    ref = rows.get("standard")
    cells = []
    for v, r in rows.items():
        cell = {"variant": v}
        for title, key, pct in cols:
            cell[title] = f"{r[key]:.1f}" if key != "loss" else f"{r[key]:.4f}"
            if key == "ms":
                cell[f"{title} IQR"] = r["iqr"]
            if pct and ref:
                cell[f"{title} vs std"] = f"{100 * (r[key] / ref[key] - 1):+.1f}%"
        cells.append(cell)
    print(markdown(cells))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.attnres_bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="auto", choices=["auto", "k3", "standin"])
    p.add_argument("--layers", type=int, default=None, help="default: 4 on CPU, 12 on CUDA")
    p.add_argument("--d-model", type=int, default=None, help="default: 256 on CPU, 1024 on CUDA")
    p.add_argument("--batch", type=int, default=None, help="default: 4 on CPU, 8 on CUDA")
    p.add_argument("--seq", type=int, default=None, help="default: 128 on CPU, 2048 on CUDA")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=None, help="sublayers per block; default: about 8 blocks, at least 2")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 5 CPU, 20 CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (default 1 CPU, 3 CUDA)")
    p.add_argument("--variants", default="standard,block_attnres,full_attnres")
    p.add_argument("--impl-variants", action="store_true",
                   help="also time block_attnres[torch|autograd|nocache|stack|twophase]")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default 1: on a shared machine, multi-threaded tiny ops time erratically)")
    p.add_argument("--compile", action="store_true", help="torch.compile each model (as train.compile=true)")
    p.add_argument("--no-seam", action="store_true", help="skip the residual-alone micro-benchmark")
    p.add_argument("--profile", action="store_true",
                   help="instead of the tables: torch.profiler over 3 steps of block_attnres' residual alone, "
                        "top 15 CUDA kernels (CPU ops on CPU) by self time, busy vs wall time per step")
    p.add_argument("--tune", action="store_true",
                   help="instead of the tables (after --profile if given): time the fused mix kernels alone over "
                        "launch configs, for --tune-sources bf16 sources [--tune-rows, --d-model]; on CPU only "
                        "under TRITON_INTERPRET=1")
    p.add_argument("--tune-sources", default="1-10", help="source counts for --tune, e.g. 1-10 or 2,5,9")
    p.add_argument("--tune-rows", type=int, default=None,
                   help="rows N of --tune's sources (their width is --d-model); default: 64 on CPU, 16384 on CUDA")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.layers = args.layers or (12 if cuda else 4)
    args.d_model = args.d_model or (1024 if cuda else 256)
    args.batch = args.batch or (8 if cuda else 4)
    args.seq = args.seq or (2048 if cuda else 128)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.steps = args.steps or (20 if cuda else 5)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.block_size = args.block_size or max(2, round(2 * args.layers / 8))  # tiny: 2 (conf default)
    if args.threads or not cuda:
        torch.set_num_threads(args.threads or 1)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.profile or args.tune:
        if args.tune and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--tune on CPU needs TRITON_INTERPRET=1")
        args.tune_rows = args.tune_rows or (16384 if cuda else 64)
        print(f"device={torch.cuda.get_device_name() if cuda else 'cpu'} torch={torch.__version__} "
              f"layers={args.layers} d_model={args.d_model} batch={args.batch} seq={args.seq} dtype={args.dtype} "
              f"block_size={args.block_size} compile={args.compile}")
        if args.profile:
            profile_seam(args, device)
        if args.tune:
            tune_mix(args, device)
        return None

    base = ModelConfig(n_layers=args.layers, d_model=args.d_model, vocab_size=args.vocab, moe=MoEConfig(name="dense"),
                       residual=ResidualConfig(name="standard", block_size=args.block_size))
    variants = args.variants.split(",")
    if args.impl_variants:
        variants += [f"block_attnres[{impl}]" for impl in IMPLS]
    torch.manual_seed(0)
    reference = build_model(args.model, copy.deepcopy(base))
    kind = "standin" if isinstance(reference, StandInLM) else "k3"
    state = reference.state_dict()
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    n_params = sum(p.numel() for p in reference.parameters())
    print(f"model={kind} layers={args.layers} (sublayers={2 * args.layers}) d_model={base.width} "
          f"params={n_params / 1e6:.1f}M batch={args.batch} seq={args.seq} dtype={args.dtype} "
          f"device={torch.cuda.get_device_name() if cuda else 'cpu'} threads={torch.get_num_threads()} "
          f"block_size={args.block_size} (n_blocks={-(-2 * args.layers // args.block_size)}) compile={args.compile} "
          f"torch={torch.__version__}")
    models = {}
    for v in variants:
        torch.manual_seed(0)
        models[v] = variant_model(kind, base, v, state)
    rows = bench(models, tokens, args, device)

    cols = [("ms/step", "ms", True), ("saved MB", "saved_mb", True)] + ([("peak MB", "peak_mb", True)] if cuda else [])
    print("\nwhole model: forward + loss + backward + AdamW step (the median step)")
    print_table(rows, cols + [("loss", "loss", False)])
    if not args.no_seam:
        seam = bench_seam(variants, args, device)
        print("\nresidual alone (cheap elementwise sublayers): forward + backward")
        print_table(seam, [("ms", "ms", True)])
        for v in rows:
            rows[v]["seam_ms"] = seam[v]["ms"]
    return rows


if __name__ == "__main__":
    main()
