"""Cost of Attention Residuals: step time and activation memory of residual=standard|block|full.

    python -m benchmarks.attnres_bench --device cpu            # small, a few minutes on 2 cores
    python -m benchmarks.attnres_bench --device cuda           # >= 12 layers, bf16 autocast (one H200)

Every variant is the same model (same seed, same tokens) with only the residual switched. By default
that is k3lab's K3Model (KDA/MLA 3:1, dense GLU FFN); `--model standin` (or when K3Model cannot be
imported) uses a plain stack of causal-SDPA attention and GLU MLP sublayers instead.

Measured per variant:
  ms/step      median wall time of forward + cross-entropy + backward + AdamW step
  saved MB     activation memory: bytes of the distinct tensors autograd saves for backward in one
               forward (parameters excluded), counted with saved_tensors_hooks; works on any device
  peak MB      CUDA only: peak allocated during forward+backward minus what was allocated before it
  cpu ms/step  CPU only: process CPU time per step (steadier than wall time on a shared machine)
and the overhead of each against `standard`. On CUDA the AttnRes mix runs as the fused Triton kernels
(kernels/attnres.py) wherever they apply. `--impl-variants` adds four alternative AttnRes mixes for
comparison: `torch` (the hand-written torch autograd.Function, the CPU path, also on CUDA), `autograd`
(the op in plain autograd ops, no hand-written backward), `nocache` (1/rms of every source recomputed by
every op) and `stack` (torch.stack of the sources + RMSNorm + einsum, as in the paper's pseudocode).
Any variant takes an implementation suffix, e.g. `--variants standard,block_attnres,block_attnres[torch]`.
A second table times the residual alone (the seam driven by cheap elementwise sublayers), where the cost
of the mix is not hidden by the layers.
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3lab.config import GLUConfig, ModelConfig, ResidualConfig  # noqa: E402
from k3lab.model import attnres  # noqa: E402
from k3lab.model.ffn import GLU  # noqa: E402
from k3lab.model.norm import RMSNorm  # noqa: E402
from k3lab.model.residual import build_residual  # noqa: E402


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


IMPLS = {"torch": TorchMix, "stack": StackedMix, "nocache": NoCacheMix, "autograd": AutogradMix}


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
def saved_activation_bytes(model: nn.Module, run_forward) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during one forward."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run_forward()
    loss.backward()
    return sum(seen.values())


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
    """Time all variants interleaved (round r: one step of each), so load drift on a shared machine
    hits every variant alike; then measure memory one variant at a time."""
    steps = {v: make_step(m, tokens, args, device) for v, m in models.items()}
    times = {v: [] for v in models}
    cpu_times = {v: [] for v in models}
    losses = {}
    for r in range(args.warmup + args.steps):
        for v, (step, _) in steps.items():
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            losses[v] = step()
            sync(device)
            if r >= args.warmup:
                times[v].append(time.perf_counter() - t0)
                cpu_times[v].append(time.process_time() - c0)
    rows = {}
    for v, (_, forward) in steps.items():
        row = {"ms": 1e3 * statistics.median(times[v]), "loss": losses[v].item(),
               "cpu_ms": 1e3 * statistics.median(cpu_times[v])}
        row["saved_mb"] = saved_activation_bytes(models[v], forward) / 2**20
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


def bench_seam(variants, args, device) -> dict:
    """The residual alone: begin/read/write/end over 2L cheap sublayers f_i(x) = x * c_i + n_i (n_i fixed
    random [B, T, D]), forward + backward. Isolates the cost of the residual from the layers'."""
    n_sub, D = 2 * args.layers, args.d_model
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    noise = [torch.randn(args.batch, args.seq, D, generator=g).to(device, dtype) for _ in range(n_sub)]
    emb0 = torch.randn(args.batch, args.seq, D, generator=g).to(device, dtype)
    scales = torch.linspace(0.5, 1.0, n_sub).tolist()
    rows = {}
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

    seams = {v: torch.compile(functools.partial(seam, res)) if args.compile else functools.partial(seam, res)
             for v, res in residuals.items()}
    times = {v: [] for v in variants}
    cpu_times = {v: [] for v in variants}
    for r in range(args.warmup + 3 * args.steps):
        for v in residuals:
            emb = emb0.clone().requires_grad_(True)
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            seams[v](emb).backward()
            sync(device)
            if r >= args.warmup:
                times[v].append(time.perf_counter() - t0)
                cpu_times[v].append(time.process_time() - c0)
    for v in variants:
        rows[v] = {"ms": 1e3 * statistics.median(times[v]), "cpu_ms": 1e3 * statistics.median(cpu_times[v])}
    return rows


def print_table(rows: dict, cols: list[tuple[str, str, bool]]) -> None:
    """cols: (header, key, with overhead vs standard)."""
    ref = rows.get("standard")
    header = ["variant"]
    for title, _, pct in cols:
        header += [title] + (["vs std"] if pct and ref else [])
    lines = [header]
    for v, r in rows.items():
        line = [v]
        for _, key, pct in cols:
            line.append(f"{r[key]:.1f}" if key != "loss" else f"{r[key]:.4f}")
            if pct and ref:
                line.append(f"{100 * (r[key] / ref[key] - 1):+.1f}%")
        lines.append(line)
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(header))]
    for i, row in enumerate(lines):
        print(" | ".join(str(c).rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    p.add_argument("--impl-variants", action="store_true", help="also time block_attnres[torch|autograd|nocache|stack]")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default 1: on a shared machine, multi-threaded tiny ops time erratically)")
    p.add_argument("--compile", action="store_true", help="torch.compile each model (as train.compile=true)")
    p.add_argument("--no-seam", action="store_true", help="skip the residual-alone micro-benchmark")
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

    base = ModelConfig(n_layers=args.layers, d_model=args.d_model, vocab_size=args.vocab,
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

    cols = [("ms/step", "ms", True), ("cpu ms/step", "cpu_ms", True), ("saved MB", "saved_mb", True)]
    if cuda:
        cols = [("ms/step", "ms", True), ("saved MB", "saved_mb", True), ("peak MB", "peak_mb", True)]
    print("\nwhole model: forward + loss + backward + AdamW step (median over interleaved steps)")
    print_table(rows, cols + [("loss", "loss", False)])
    if not args.no_seam:
        seam = bench_seam(variants, args, device)
        print("\nresidual alone (cheap elementwise sublayers): forward + backward")
        print_table(seam, [("ms", "ms", True)] + ([] if cuda else [("cpu ms", "cpu_ms", True)]))
        for v in rows:
            rows[v]["seam_ms"] = seam[v]["ms"]
    return rows


if __name__ == "__main__":
    main()
