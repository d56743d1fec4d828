"""The fused grouped GLU of the routed experts (kernels/grouped_glu.py) against the per-expert reference.

CPU: the Triton kernels run under TRITON_INTERPRET=1 in one fresh subprocess (this file run as a script)
and the tests assert on the relative errors it reports against a float64 per-expert loop (y, dx, dw1, dw2,
dw3): ragged segments (an empty expert, segments shorter than a tile, tiles cut by a segment's end), width
and hidden tails past the tile, SiTU and SwiGLU; the MoE layer with kernels.backend=triton and
checkpoint_experts on it; opcheck and torch.compile(fullgraph=True) of the op. The tile schedule runs in-process.
CUDA (``pytest -m gpu``): bf16 and fp32 at the K3 default's expert shape against the float64 loop (both dh
sources), and under Inductor.
"""
import json

import pytest
import torch

from interpreted import compile_against_eager, opcheck_pair, run_interpreted
from k3lab.config import GLUConfig
from k3lab.model.ffn import glu_combine

NAMES = ["y", "dx", "dw1", "dw2", "dw3"]
LIMIT = {"torch.float32": 1e-5, "torch.bfloat16": 2e-2}
TILE16 = dict(BM=16, BN=16, BK=16, num_warps=1, num_stages=1, dh="kernel")
# name: (counts, width W, hidden H, GLU, dtype, launch or None for LAUNCH). Counts: expert 1 gets nothing,
# 5 rows fill part of one tile, 17 spill one row into a second, 40 end inside their third; W = H = 40
# leave a tail of 8 past tiles of 16 in the K loop and the hidden units. dh: where the backward's dy W3[e]
# comes from (kernels.grouped_glu.glu_bwd).
CASES = {
    "situ_fp32_tile16": ([5, 0, 17, 40], 40, 40, "situ", "float32", TILE16),
    "swiglu_fp32_tile16": ([5, 0, 17, 40], 40, 40, "swiglu", "float32", TILE16),
    "situ_fp32_default_launch": ([3, 30, 0, 9], 32, 48, "situ", "float32", None),
    "situ_bf16_tile16": ([5, 0, 17, 40], 32, 48, "situ", "bfloat16", TILE16),
    "situ_fp32_tile16_dh_by_grouped_mm": ([5, 0, 17, 40], 40, 40, "situ", "float32", dict(TILE16, dh="grouped_mm")),
    "swiglu_bf16_tile16_dh_by_grouped_mm": ([5, 0, 17, 40], 32, 48, "swiglu", "bfloat16",
                                            dict(TILE16, dh="grouped_mm")),
}


def make_inputs(counts, W, H, dtype, device="cpu", seed=0):
    """xs [M, W], w1 and w2 [n, H, W], w3 [n, W, H] (init-sized) and the cotangent dy [M, W], in dtype."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n, M = len(counts), sum(counts)
    dt = getattr(torch, dtype)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dt)
    return (rand(M, W), rand(n, H, W, scale=W ** -0.5), rand(n, H, W, scale=W ** -0.5), rand(n, W, H, scale=H ** -0.5),
            rand(M, W), torch.tensor(counts, device=device))


def reference(xs, w1, w2, w3, dy, counts, glu: str) -> list[torch.Tensor]:
    """[y, dx, dw1, dw2, dw3] of a per-expert loop in float64."""
    leaves = [t.double().requires_grad_() for t in (xs, w1, w2, w3)]
    x, a, b, c = leaves
    cfg, out, s = GLUConfig(name=glu), [], 0
    for e, m in enumerate(counts.tolist()):
        out.append(glu_combine(x[s:s + m] @ a[e].T, x[s:s + m] @ b[e].T, cfg) @ c[e].T)
        s += m
    y = torch.cat(out)
    y.backward(dy.double())
    return [y.detach()] + [t.grad for t in leaves]


def errors(got, ref) -> dict:
    """name -> (relative error, dtype name)."""
    return {n: (((a.double() - b).norm() / b.norm()).item(), str(a.dtype)) for n, a, b in zip(NAMES, got, ref)}


def through_op(xs, w1, w2, w3, dy, counts, glu: str) -> list[torch.Tensor]:
    from kernels.grouped_glu import grouped_glu

    leaves = [t.detach().requires_grad_() for t in (xs, w1, w2, w3)]
    y = grouped_glu(leaves[0], counts, *leaves[1:], situ=glu == "situ")
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def compiled_fn(xs, counts, w1, w2, w3):
    """A small seam around the op, for torch.compile."""
    from kernels.grouped_glu import grouped_glu

    return grouped_glu(xs * 2, counts, w1, w2, w3, situ=True).square()


def moe_against_loop(backend: str) -> dict:
    """The MoE layer (latent_norm, 8 experts top-2, width 16, hidden 24) with checkpoint_experts on
    `backend` against the same layer on the loop dispatch: relative errors of y, dx and every parameter's
    gradient, and whether the fused op ran."""
    from k3lab.config import BalanceConfig, MoEConfig
    from k3lab.model import moe as moe_module

    torch.manual_seed(0)
    cfg = MoEConfig(name="latent_norm", n_experts=8, top_k=2, expert_hidden=24, latent_ratio=2)
    moe = moe_module.MoE(32, cfg, GLUConfig(name="situ"), BalanceConfig(name="qb"), checkpoint_experts=True,
                         backend=backend)
    x = torch.randn(2, 19, 32)
    calls, real = [], moe_module.grouped_glu
    moe_module.grouped_glu = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        results = {}
        for dispatch in ("auto", "loop"):
            moe.dispatch = dispatch
            moe.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_()
            y = moe(xx)
            (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
            results[dispatch] = [y.detach(), xx.grad] + [p.grad for p in moe.parameters()]
    finally:
        moe_module.grouped_glu = real
    errs = [((a - b).norm() / b.norm()).item() for a, b in zip(results["auto"], results["loop"])]
    return {"max_error": max(errs), "fused_calls": len(calls)}


def _run_checks() -> dict:
    import kernels.grouped_glu as gg

    out = {}
    for name, (counts, W, H, glu, dtype, block) in CASES.items():
        xs, w1, w2, w3, dy, cnt = make_inputs(counts, W, H, dtype)
        ref = reference(xs, w1, w2, w3, dy, cnt, glu)
        situ = glu == "situ"
        launched = [gg.glu_fwd(xs, cnt, w1, w2, w3, 4.0, 25.0, situ, block),
                    *gg.glu_bwd(xs, dy, cnt, w1, w2, w3, 4.0, 25.0, situ, block)]
        out[name] = errors(launched, ref)
        out[f"op_{name}"] = errors(through_op(xs, w1, w2, w3, dy, cnt, glu), ref)

    xs, w1, w2, w3, dy, cnt = make_inputs([5, 0, 11], 16, 16, "float32")
    args = (xs.requires_grad_(), cnt, w1.requires_grad_(), w2.requires_grad_(), w3.requires_grad_(), 4.0, 25.0, True)
    out["opcheck"] = opcheck_pair(gg.grouped_glu_fwd_op, args, gg.grouped_glu_bwd_op,
                                  (xs.detach(), dy, cnt, w1.detach(), w2.detach(), w3.detach(), 4.0, 25.0, True))

    def run(fn):
        leaves = [t.detach().requires_grad_() for t in (xs, w1, w2, w3)]
        y = fn(leaves[0], cnt, *leaves[1:])
        y.sum().backward()
        return [y.detach()] + [t.grad for t in leaves]
    out["compile"] = compile_against_eager(compiled_fn, run, "k3lab.grouped_glu_fwd", NAMES)
    out["moe_triton"] = moe_against_loop("triton")

    from benchmarks import moe_bench

    rows = moe_bench.main(["--device", "cpu", "--small", "--tune", "--iters", "1", "--warmup", "0"])
    out["tune"] = [{k: r[k] for k in ("kernel", "launch", "max_rel_error")} for r in rows]
    rows = moe_bench.main(["--device", "cpu", "--small", "--tune", "--tune-kernels", "bwd", "--iters", "1",
                           "--warmup", "0"])
    out["tune_bwd"] = sorted({r["kernel"] for r in rows})
    return out


@pytest.fixture(scope="module")
def results():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", list(CASES) + [f"op_{c}" for c in CASES])
def test_interpreter_matches_float64_reference(results, case):
    """y and every gradient in the inputs' dtype, within 1e-5 (fp32) or 2e-2 (bf16) of the float64 per-expert
    loop, relative; from the launchers with the case's tiles, and (op_*) through autograd on the custom ops
    with the default launch."""
    errs = results[case]
    dtype = CASES[case.removeprefix("op_")][4]
    assert {dt for _, dt in errs.values()} == {f"torch.{dtype}"}, errs
    assert not {n: e for n, (e, dt) in errs.items() if not e < LIMIT[dt]}, errs


def test_custom_ops_pass_opcheck(results):
    """torch.library.opcheck of k3lab::grouped_glu_fwd (requires_grad inputs) and k3lab::grouped_glu_bwd:
    schema, fake tensors against the real results, the autograd registration, AOT dispatch (dynamic too)."""
    checks = results["opcheck"]
    assert {"test_schema", "test_faketensor", "test_aot_dispatch_dynamic"} <= set(checks), checks
    assert set(checks.values()) == {"SUCCESS"}, checks


def test_interpreter_torch_compile_fullgraph(results):
    """torch.compile(fullgraph=True, aot_eager) of a seam around the op: one frame, the op in its graph,
    eager's output and gradients."""
    assert results["compile"] == {"frames": 1, "ops_in_graph": True, "mismatches": []}


def test_moe_with_checkpointed_experts_runs_the_fused_op_on_backend_triton(results):
    """MoE(checkpoint_experts=True, backend="triton"): dispatch auto runs the fused op (once per forward) and
    gives the loop dispatch's output and gradients: fp32, within 1e-4 relative (the output within 1e-5; the
    gradients that pass the latent RMSNorm's backward differ by up to 4e-5)."""
    assert results["moe_triton"]["fused_calls"] == 1
    assert results["moe_triton"]["max_error"] < 1e-4, results["moe_triton"]


def test_launch_sweep_runs_every_configuration_and_checks_it(results):
    """benchmarks.moe_bench --tune --small: the forward at each of its 2 launch configurations, the backward at
    4 (two tile widths, dh from the kernel or from torch._grouped_mm), each within fp32 rounding of the launch
    table's result."""
    rows = results["tune"]
    assert sorted((r["kernel"], r["launch"]["BN"], r["launch"].get("dh")) for r in rows) == [
        ("bwd", 16, "grouped_mm"), ("bwd", 16, "kernel"), ("bwd", 32, "grouped_mm"), ("bwd", 32, "kernel"),
        ("fwd", 16, None), ("fwd", 32, None)]
    assert all(r["max_rel_error"] < 1e-5 for r in rows), rows
    assert results["tune_bwd"] == ["bwd"]  # --tune-kernels bwd: the backward's grid alone


def test_unknown_dh_source_is_refused():
    from kernels.grouped_glu import LAUNCH, glu_bwd

    x = torch.zeros(4, 8)
    w = torch.zeros(2, 8, 8)
    with pytest.raises(ValueError, match="launch dh='gemm'; valid: kernel, grouped_mm"):
        glu_bwd(x, x, torch.tensor([1, 3]), w, w, w, 4.0, 25.0, True, dict(LAUNCH["bwd"], dh="gemm"))


@pytest.mark.parametrize("backend,checkpoint,want", [("auto", True, "loop"), ("torch", True, "loop"),
                                                     ("triton", True, "fused"), ("triton", False, "loop")])
def test_dispatch_on_cpu(backend, checkpoint, want):
    """GroupedExperts.resolve on CPU fp32 tensors: fused only for checkpointed experts on backend triton
    (auto fuses on CUDA bf16 alone, where torch._grouped_mm runs)."""
    from k3lab.model.moe import GroupedExperts

    experts = GroupedExperts(4, 16, 24, GLUConfig(), backend=backend)
    assert experts.resolve(torch.zeros(3, 16), "auto", checkpoint) == want


def test_tile_schedule_covers_each_segment_once_without_spanning_experts():
    """tile_schedule on random counts (zeros included): the busy tiles, in order, are each expert's rows cut
    in blocks of block_m, contiguous and ending at the segment's end; every other tile is empty."""
    from kernels.grouped_glu import tile_schedule

    gen = torch.Generator().manual_seed(0)
    for block_m in (1, 4, 16):
        counts = torch.randint(0, 40, (9,), generator=gen) * (torch.rand(9, generator=gen) > 0.3)
        expert, start, end = tile_schedule(counts, block_m, int(counts.sum()))
        assert expert.dtype == start.dtype == end.dtype == torch.int32
        assert expert.numel() == -(-int(counts.sum()) // block_m) + 9
        busy = start < end
        want, seg_start = [], 0
        for e, c in enumerate(counts.tolist()):
            want += [(e, r, seg_start + c) for r in range(seg_start, seg_start + c, block_m)]
            seg_start += c
        got = list(zip(expert[busy].tolist(), start[busy].tolist(), end[busy].tolist()))
        assert got == want
        assert busy[:len(want)].all() and not busy[len(want):].any()


def test_tune_grid_leaves_out_oversized_tiles_and_idle_stages():
    """moe_bench's --tune grid at the K3 width: every combination with tiles of at most 128 x 128 and no more
    stages than the K loop has steps; the backward only with dh from torch._grouped_mm."""
    from benchmarks.moe_bench import K3_WIDTH, TUNE_SPACE, tune_launches

    fwd, bwd = (tune_launches(kernel, TUNE_SPACE, K3_WIDTH) for kernel in ("fwd", "bwd"))
    assert len(fwd) == len(bwd) == 56 and {b["dh"] for b in bwd} == {"grouped_mm"}
    assert all(c["BM"] * c["BN"] <= 128 * 128 and c["num_stages"] * c["BK"] <= K3_WIDTH for c in fwd + bwd)
    assert {(c["BK"], c["num_stages"]) for c in fwd} == {(32, 2), (32, 3), (32, 4), (64, 2), (64, 3), (64, 4),
                                                         (128, 2)}


def test_kernel_resources_of_the_launch_table(tmp_path):
    """benchmarks.kernel_resources (the kernels compiled for sm_90 here, without a GPU): every kernel of the
    launch table runs its products on wgmma with pipelined loads and spills no registers; the backward that
    computes dh itself needs more shared memory than the one that reads it (three operand tiles a K step
    against two); programs per SM follow from the shared memory and the registers; the table goes to --out."""
    pytest.importorskip("triton.backends.nvidia")
    from benchmarks.kernel_resources import SM_REGISTERS, SM_SHARED_KIB, main

    rows = main(["--out", str(tmp_path / "resources.md")])
    assert [(r["kernel"], r["launch"].get("dh")) for r in rows] == [("fwd", None), ("bwd", "kernel"),
                                                                      ("bwd", "grouped_mm")]
    assert all(r["pipelined"] and r["wgmma"] and r["spilled_bytes"] == 0 for r in rows), rows
    assert rows[1]["shared_kib"] > rows[2]["shared_kib"] > 0
    assert all(0 < r["registers"] <= 255 for r in rows), rows
    by_registers = [SM_REGISTERS // (-(-r["registers"] // 8) * 8 * 32 * r["launch"]["num_warps"]) for r in rows]
    assert [r["programs_per_sm"] for r in rows] == [min(int(SM_SHARED_KIB // r["shared_kib"]), n)
                                                   for r, n in zip(rows, by_registers)]
    table = [[c.strip() for c in line.split("|")[1:-1]] for line in (tmp_path / "resources.md").read_text().splitlines()]
    assert table[0][-2:] == ["pipelined", "wgmma"] and [r[-2:] for r in table[2:]] == [["yes", "yes"]] * 3


# --- CUDA ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("glu,dtype,dh", [("situ", "bfloat16", "kernel"), ("swiglu", "bfloat16", "kernel"),
                                          ("situ", "bfloat16", "grouped_mm"), ("situ", "float32", "kernel"),
                                          ("swiglu", "float32", "grouped_mm")])
def test_cuda_matches_the_float64_reference(glu, dtype, dh, monkeypatch):
    """64 experts, width 256, hidden 1,408 (the K3 default's), 8,192 pairs routed unevenly (one expert
    empty): y and every gradient within LIMIT of the float64 loop, relative (fp32 operands multiply in
    IEEE fp32, not TF32), with dh = dy W3 from either source."""
    from kernels import grouped_glu as gg

    monkeypatch.setitem(gg.LAUNCH, "bwd", dict(gg.LAUNCH["bwd"], dh=dh))
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.rand(64, generator=gen) + 0.2, 8192, replacement=True, generator=gen)
    counts = torch.bincount(counts, minlength=64)
    counts[3] = 0
    xs, w1, w2, w3, dy, cnt = make_inputs(counts.tolist(), 256, 1408, dtype, device="cuda")
    errs = errors(through_op(xs, w1, w2, w3, dy, cnt, glu), reference(xs, w1, w2, w3, dy, cnt, glu))
    assert not {n: e for n, (e, dt) in errs.items() if not e < LIMIT[dt]}, errs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) with Inductor of a seam around the op: one frame, the op in the graph,
    eager's output and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    xs, w1, w2, w3, _, cnt = make_inputs([100, 0, 300, 624], 256, 512, "bfloat16", device="cuda")
    counter = CompileCounterWithBackend("inductor")

    def run(fn):
        leaves = [t.detach().requires_grad_() for t in (xs, w1, w2, w3)]
        y = fn(leaves[0], cnt, *leaves[1:])
        y.float().sum().backward()
        return [y.detach()] + [t.grad for t in leaves]
    eager = run(compiled_fn)
    compiled = run(torch.compile(compiled_fn, backend=counter, fullgraph=True))
    assert counter.frame_count == 1 and all("k3lab.grouped_glu_fwd" in g.code for g in counter.graphs)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_moe_auto_fuses_only_checkpointed_experts():
    """On CUDA bf16 with backend auto, resolve picks fused for checkpointed experts and grouped otherwise."""
    from k3lab.model.moe import GroupedExperts

    experts = GroupedExperts(4, 256, 512, GLUConfig()).cuda().bfloat16()
    xs = torch.zeros(8, 256, device="cuda", dtype=torch.bfloat16)
    assert [experts.resolve(xs, "auto", r) for r in (True, False)] == ["fused", "grouped"]


if __name__ == "__main__":
    print(json.dumps(_run_checks()))
