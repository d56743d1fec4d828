"""KDA kernels: our Triton forward+backward against fla's ``chunk_kda``, with accuracy and a profile.

    python -m benchmarks.kda_bench --check --profile          # the two default shapes, every gate case
    python -m benchmarks.kda_bench --reps 20 --no-torch-path --check --profile --out kda_bench.md
    python -m benchmarks.kda_bench --decay sigmoid --shape 4,4096,16,128,128 --no-fla --saving all --saving states
    python -m benchmarks.kda_bench --no-fla --decay softplus-fast --saving chunks+intra --profile   # as trained

For each shape and gate case (sigmoid; softplus; softplus with a fast-forgetting channel, see CASES)
it times, in bf16 with the gate, the q/k L2 norm and the beta sigmoid folded into the call: our Triton
KDA (``kernels.kda.triton.kda_gated``), fla's ``chunk_kda`` (fla-core, when installed, with
``use_gate_in_kernel``, ``use_qk_l2norm_in_kernel``, ``use_beta_sigmoid_in_kernel`` and, for sigmoid,
``safe_gate`` with ``lower_bound=-5``), the plain
PyTorch chunkwise path and causal SDPA (flash attention) at the same shape. Forward and forward+backward
are timed by benchmarks.timing (triton.testing.do_bench: each call between CUDA events, the L2 cache
flushed before it): warm-up, then the median of about ``--reps`` calls with its interquartile range,
cycling over several sets of fresh random (never zero) inputs. ``--check`` then measures bf16 relative
errors of our kernel against the float64 recurrent reference (outputs and every gradient), and ``--profile`` prints a per-kernel
breakdown (after the timing, so that kernel compilation and autotuning are done once, by the first
timed shape's warm-up) and the registers and spills of each of our compiled kernels. ``--saving`` picks
what our forward keeps for the backward (SAVING; repeatable, one row each; the profile takes the first).
The markdown tables (with the command, commit, date and device) go to the terminal, and to ``--out PATH``
only when it is given.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import itertools
import math
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.table import markdown
from benchmarks.timing import Timing, time_ms

SHAPES = [(4, 4096, 16, 128, 128), (1, 16384, 16, 128, 128)]

# The gate cases timed: the decay map and its inputs. "softplus-fast" is the softplus map with one
# fast-forgetting channel per head (dt_bias = 8, so g <= -8 per token there): every 16-token sub-block
# then decays past the sigmoid map's bound, as most do in a model trained with softplus (benchmarks.kda_decay),
# and fla's softplus path computes its diagonal blocks exactly either way. A sigmoid gate bounded below
# never gets there.
CASES = {"sigmoid": "sigmoid", "softplus": "softplus", "softplus-fast": "softplus"}
FAST_DT_BIAS = 8.0


def make_inputs(B, T, H, K, V, case, device, dtype=torch.bfloat16, seed=0):
    """Raw layer-side inputs for a gate case (a key of CASES): q, k (un-normalised), v, gate
    pre-activation z, beta logits, A_log, dt_bias (the model's init for both maps: inverse softplus of
    log-uniform [1e-3, 1e-1])."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q, k, v, z = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V), randn(B, T, H, K)
    beta_logits = randn(B, T, H)
    if case == "sigmoid":
        A_log = 0.5 * randn(H)
    else:
        A_log = torch.log(1 + 15 * torch.rand(H, generator=gen, device=device))
    dt = torch.exp(torch.rand(H * K, generator=gen, device=device) * (math.log(1e-1) - math.log(1e-3))
                   + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))             # inverse softplus
    if case == "softplus-fast":
        dt_bias.view(H, K)[:, 0] = FAST_DT_BIAS
    xs = [t.to(dtype).requires_grad_() for t in (q, k, v, z, beta_logits)]
    return xs + [A_log.requires_grad_(), dt_bias.requires_grad_()]


# What our forward keeps for the backward: kda_gated's keywords per --saving mode (the model's
# kernels.recompute_states, kernels.recompute_chunks and kernels.keep_intra).
SAVING = {"all": {}, "states": dict(recompute_states=True), "chunks": dict(recompute_chunks=True),
          "chunks+intra": dict(recompute_chunks=True, keep_intra=True)}


def run_ours(q, k, v, z, bl, A_log, dt_bias, decay, saving="all"):
    from kernels.kda.triton import kda_gated

    return kda_gated(q, k, v, z, bl, A_log, dt_bias, decay=decay, **SAVING[saving])[0]


def run_torch(q, k, v, z, bl, A_log, dt_bias, decay):
    from kernels.kda.triton import kda_gated_reference

    return kda_gated_reference(q, k, v, z, bl, A_log, dt_bias, decay=decay, backend="torch")[0]


def run_fla(q, k, v, z, bl, A_log, dt_bias, decay, **state):
    """fla's chunk_kda with the same in-kernel gate, L2 norm and beta sigmoid; `state`: initial_state,
    output_final_state. Returns o, or (o, final state) when `state` is given."""
    from fla.ops.kda import chunk_kda

    extra = dict(safe_gate=True, lower_bound=-5.0) if decay == "sigmoid" else {}
    out = chunk_kda(q, k, v, z, bl, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias, **extra, **state)
    return out if state else out[0]


def run_sdpa(q, k, v, *_):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True)


def time_sets(fn, input_sets, backward, reps, warmup=3) -> Timing:
    """fn on the input sets in turn (and a backward with a fixed random cotangent), timed on CUDA by
    benchmarks.timing; the inputs' gradients are reset before each timed call."""
    do = torch.randn_like(fn(*input_sets[0]))
    sets = itertools.cycle(input_sets)

    def call():
        o = fn(*next(sets))
        if backward:
            o.backward(do)

    leaves = [x for xs in input_sets for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    return time_ms(call, "cuda", reps, warmup, grad_to_none=leaves)


def saved_bytes(run, exclude=()) -> tuple[int, object]:
    """(bytes of the distinct storages autograd saves for backward while run() executes, run()'s result),
    leaving out the storages of the tensors in `exclude` (inputs, parameters)."""
    skip = {x.untyped_storage().data_ptr() for x in exclude if isinstance(x, torch.Tensor)}
    sizes = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            sizes[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(sizes.values()), out


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_accuracy(device, B=1, T=1000, H=16, K=128, V=128, impls=("ours",)):
    """bf16 relative errors against the float64 recurrent reference, every gate case: rows of (impl, case,
    tensor, error, limit, ok). impls: "ours" (kda_gated) and/or "fla" (chunk_kda, same inputs)."""
    from kernels.kda.triton import kda_gated

    rows = []
    for impl in impls:
        for case, decay in CASES.items():
            xs = make_inputs(B, T, H, K, V, case, device, seed=11)
            h0 = torch.randn(B, H, K, V, device=device, requires_grad=True)
            state = dict(initial_state=h0, output_final_state=True)
            o, ht = kda_gated(*xs, decay=decay, **state) if impl == "ours" else run_fla(*xs, decay, **state)
            rows += [(impl, case, *row) for row in _errors(xs, h0, o, ht, decay)]
    return rows


def _errors(xs, h0, o, ht, decay):
    """(tensor, relative error, limit, ok) of o, ht and every gradient of a bf16 call on the
    make_inputs leaves xs and initial state h0, against the float64 recurrence on the same (rounded)
    inputs. Limits: fla's own test thresholds."""
    from kernels.kda import gated_inputs, kda_recurrent

    rows = []
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    leaves = list(xs) + [h0]
    # allow_unused: an implementation that gives some input no gradient shows as NaN, not a crash
    got = [o, ht] + list(torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves, allow_unused=True))
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    q, k, v, z, bl, A_log, dt_bias = ref_leaves[:7]
    q, k, g, beta = gated_inputs(q, k, z, bl, A_log, dt_bias, decay)
    ro, rht = kda_recurrent(q, k, v, g, beta, initial_state=ref_leaves[-1], output_final_state=True)
    ref = [ro, rht] + list(torch.autograd.grad((ro * do.double()).sum() + (rht * dht.double()).sum(),
                                               ref_leaves))
    names = ["o", "final_state", "dq", "dk", "dv", "dz", "dbeta_logits", "dA_log", "ddt_bias", "dh0"]
    limits = {"o": 5e-3, "final_state": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3}
    for n, x, y in zip(names, got, ref):
        err = float("nan") if x is None else rel_err(x, y)
        lim = limits.get(n, 2e-2)
        rows.append((n, err, lim, err < lim))
    return rows


def bench_kda(args):
    from k3lab.rundir import git_revision

    device = "cuda"
    have_fla = True
    try:
        import fla  # noqa: F401
    except ImportError:
        have_fla = False
    lines = []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    import triton

    env = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
           + (f", fla-core {__import__('fla').__version__}" if have_fla else ", fla-core not installed"))
    lines += ["# KDA kernel benchmark", "", f"Measured {stamp} on {env}, commit {git_revision() or 'unknown'}.", "",
              f"Command: `{' '.join(['python -m benchmarks.kda_bench'] + sys.argv[1:])}`", ""]
    shown = 0

    def flush():
        nonlocal shown
        print("\n".join(lines[shown:]), flush=True)
        shown = len(lines)

    flush()
    lines += ["## Time (bf16, gate + q/k L2 norm + beta sigmoid in the call; median ms and IQR, do_bench)", ""]
    cells = []  # the time table's rows (each measurement prints a line as it lands)
    impls = [(f"ours (triton{'' if mode == 'all' else ', keeps ' + mode})",
              functools.partial(run_ours, saving=mode)) for mode in args.saving]
    impls += [("fla chunk_kda", run_fla)] if have_fla and args.fla else []
    impls += [("torch chunkwise", run_torch), ("causal SDPA", run_sdpa)]
    for shape in args.shapes:
        B, T, H, K, V = shape
        for case in args.cases:
            decay = CASES[case]
            sets = [make_inputs(B, T, H, K, V, case, device, seed=s) for s in range(3)]
            res = {}
            for name, fn in impls:
                if name == "causal SDPA" and decay == "softplus":
                    continue
                if name == "torch chunkwise" and not args.torch_path:
                    continue
                def call(*xs, fn=fn):
                    return fn(*xs, decay)
                try:
                    f = time_sets(call, sets, False, args.reps)
                    fb = time_sets(call, sets, True, args.reps)
                    mb = saved_bytes(lambda: call(*sets[0]), exclude=sets[0])[0] / 2**20
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    f = fb = Timing(*[float("nan")] * 3, 0)
                    mb = float("nan")
                res[name] = (f, fb, mb)
                print(f"  measured {name}, {case}, {shape}: fwd {f.median:.2f} ms, fwd+bwd {fb.median:.2f} ms, "
                      f"saved {mb:.0f} MB", flush=True)
            ref = res.get("fla chunk_kda")
            for name, (f, fb, mb) in res.items():
                with_ref = ref and name.startswith("ours")
                cells.append({"shape B,T,H,K,V": f"{B},{T},{H},{K},{V}", "gate": case if name != "causal SDPA" else "-",
                              "impl": name, "fwd ms": f"{f.median:.2f}", "fwd IQR": f.iqr(2),
                              "fwd+bwd ms": f"{fb.median:.2f}", "fwd+bwd IQR": fb.iqr(2),
                              "fwd+bwd Mtok/s": f"{B * T / fb.median / 1e3:.1f}", "saved MB": f"{mb:.0f}",
                              "ours/fla fwd": f"{f.median / ref[0].median:.2f}" if with_ref else "",
                              "ours/fla fwd+bwd": f"{fb.median / ref[1].median:.2f}" if with_ref else ""})
            torch.cuda.empty_cache()
    lines += [markdown(cells), ""]
    flush()
    if args.check:
        rows = check_accuracy(device, impls=("ours", "fla") if have_fla and args.fla else ("ours",))
        lines += ["## Accuracy: bf16 kernel vs float64 recurrent reference (B=1, T=1000, H=16, K=V=128)", "",
                  markdown([{"impl": i, "gate": d, "tensor": n, "relative error": f"{e:.2e}", "limit": f"{lim:.0e}",
                             "ok": "yes" if ok else "NO"} for i, d, n, e, lim, ok in rows]), ""]
        flush()
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    flush()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda_bench", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="bf16 accuracy against the float64 reference (after the timing)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, metavar="PATH", help="also write the markdown tables to PATH")
    p.add_argument("--profile", action="store_true",
                   help="print a per-kernel CUDA time breakdown of forward+backward at the first shape "
                        "(ours, and fla's unless --no-fla)")
    p.add_argument("--no-fla", dest="fla", action="store_false", help="skip fla's chunk_kda (its autotuning takes minutes)")
    p.add_argument("--no-torch-path", dest="torch_path", action="store_false",
                   help="skip timing the plain PyTorch chunkwise path")
    p.add_argument("--shape", dest="shapes", action="append", type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="B,T,H,K,V (repeatable); default: 4,4096,16,128,128 and 1,16384,16,128,128")
    p.add_argument("--saving", action="append", choices=list(SAVING),
                   help="what our forward keeps for the backward (repeatable, one row each; default all): "
                        "states = recompute_states, chunks = recompute_chunks, chunks+intra = with keep_intra")
    p.add_argument("--decay", dest="cases", action="append", choices=list(CASES),
                   help="gate case to time (repeatable); default: all (softplus-fast: see CASES)")
    args = p.parse_args(argv)
    args.shapes = args.shapes or SHAPES
    args.cases = args.cases or list(CASES)
    args.saving = args.saving or ["all"]
    if not torch.cuda.is_available():
        raise SystemExit("the kda benchmark needs a CUDA device")
    print(f"python {platform.python_version()}", file=sys.stderr)
    bench_kda(args)
    if args.profile:
        profile_kernels(args.shapes[0], args.fla and importlib.util.find_spec("fla") is not None, args.saving[0])
        print_registers()


def profile_kernels(shape, with_fla, saving="all"):
    """Per-kernel CUDA time of one forward+backward of kda_gated (keeping what ``saving`` says) and of fla's
    chunk_kda when with_fla, for every gate case (torch profiler), so stages can be compared kernel by
    kernel; then the total GPU kernel time of each and their ratio."""
    B, T, H, K, V = shape
    impls = [("ours", functools.partial(run_ours, saving=saving))] + ([("fla", run_fla)] if with_fla else [])
    for case, decay in CASES.items():
        xs = make_inputs(B, T, H, K, V, case, "cuda")
        gpu_ms = {}
        for name, fn in impls:
            for _ in range(2):
                fn(*xs, decay).sum().backward()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn(*xs, decay).sum().backward()
                torch.cuda.synchronize()
            print(f"## per-kernel CUDA time, {name}, {case}, shape {shape}", flush=True)
            try:
                table = prof.key_averages().table(sort_by="device_time_total", row_limit=16)
            except (AttributeError, KeyError):
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=16)
            print(table, flush=True)
            gpu_ms[name] = kernel_ms(prof)
        if with_fla:  # wall-clock time also counts the host's gaps between kernels; this ratio does not
            print(f"GPU kernel time of one forward+backward, {case}: ours {gpu_ms['ours']:.2f} ms, "
                  f"fla {gpu_ms['fla']:.2f} ms, ours / fla {gpu_ms['ours'] / gpu_ms['fla']:.2f}\n", flush=True)


def print_registers():
    """Registers per thread and spilled registers of every compiled variant of our KDA kernels (one line
    per variant, as Triton compiled it in this process)."""
    import triton

    from kernels.kda import triton_bwd, triton_fwd

    rows = []
    for module in (triton_fwd, triton_bwd):
        for name, fn in sorted(vars(module).items()):
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                continue
            for cache in getattr(fn, "device_caches", {}).values():
                for compiled in cache[0].values():
                    compiled._init_handles()
                    meta = compiled.metadata
                    rows.append({"kernel": name, "registers": compiled.n_regs, "spills": compiled.n_spills,
                                 "warps": meta.num_warps, "stages": meta.num_stages, "shared bytes": meta.shared})
    columns = ["kernel", "registers", "spills", "warps", "stages", "shared bytes"]
    print(f"## registers of our compiled kernels\n\n{markdown(rows, columns)}\n", flush=True)


def kernel_ms(prof) -> float:
    """Total self time of the device kernels a torch profiler recorded, in ms."""
    events = prof.key_averages()
    return sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
               for e in events) / 1e3


if __name__ == "__main__":
    main()
