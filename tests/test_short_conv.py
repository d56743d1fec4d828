"""The KDA layer's short conv (kernels/short_conv.py): y = silu(causal depthwise conv over time) on x [B, T, C].

CPU: the Triton kernels run under TRITON_INTERPRET=1 in one fresh subprocess (this file run as a script;
Triton reads the variable when first imported) and the tests assert on the relative errors it reports
against the float64 torch reference (`short_conv_reference`): y, dx and dw. The torch path, the model's
ShortConv on it and the benchmark run in-process.
CUDA (``pytest -m gpu``): bf16 and fp32 at B=2, T=4096, C=1024, and under torch.compile(fullgraph=True).
"""
import json

import pytest
import torch
import torch.nn.functional as F

from interpreted import compile_against_eager, opcheck_pair, run_interpreted
from kernels.short_conv import short_conv, short_conv_reference

NAMES = ["y", "dx", "dw"]
LIMIT = {"torch.float32": 1e-5, "torch.bfloat16": 1e-2}  # relative error of a result, by its dtype
TILE16, TILE32 = dict(BT=16, BC=16, num_warps=1), dict(BT=32, BC=32, num_warps=1)
# name: (B, T, C, W, x dtype, w dtype, launch config or None for the default, backward time programs or None).
# T = 37 is ragged for tiles of 16 and 32 rows, C = 40 leaves a channel tail of 8 in tiles of 16 (and is all
# tail in the default 128); with 2 time programs the backward's first program walks tiles 0 and 2.
CASES = {
    "fp32_W4_T37_C40_tile16_2programs": (2, 37, 40, 4, "float32", "float32", TILE16, 2),
    "fp32_W2_T37_C40_tile32": (1, 37, 40, 2, "float32", "float32", TILE32, None),
    "fp32_W3_T5_tile2_3programs": (1, 5, 8, 3, "float32", "float32", dict(BT=2, BC=8, num_warps=1), 3),
    "fp32_W1": (1, 9, 24, 1, "float32", "float32", None, None),
    "fp32_W4_T2": (2, 2, 8, 4, "float32", "float32", None, None),  # fewer rows than the W-1 halo
    "bf16_W4_T37_C40_fp32_weight_tile16": (2, 37, 40, 4, "bfloat16", "float32", TILE16, 2),
    "bf16_W4_T37_C40_bf16_weight": (1, 37, 40, 4, "bfloat16", "bfloat16", None, None),
}
OP_CASES = ("fp32_W4_T37_C40_tile16_2programs", "bf16_W4_T37_C40_fp32_weight_tile16")  # also through autograd


def make_inputs(B, T, C, W, x_dtype, w_dtype, device="cpu", seed=0):
    """x [B, T, C], w [C, W] (scaled as the conv's init, U(+-1/sqrt(W))-sized) and the cotangent dy in x's dtype."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen, device=device).to(getattr(torch, x_dtype))
    w = (torch.randn(C, W, generator=gen, device=device) / W ** 0.5).to(getattr(torch, w_dtype))
    dy = torch.randn(B, T, C, generator=gen, device=device).to(x.dtype)
    return x, w, dy


def reference(x, w, dy) -> list[torch.Tensor]:
    """[y, dx, dw] of the torch reference in float64."""
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    y = short_conv_reference(x, w)
    y.backward(dy.double())
    return [y.detach(), x.grad, w.grad]


def through_autograd(fn, x, w, dy) -> list[torch.Tensor]:
    """[y, dx, dw] of fn(x, w) by autograd."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return [y.detach(), x.grad, w.grad]


def errors(got, ref) -> dict:
    """name -> (relative error, dtype name)."""
    return {n: (((a.double() - b).norm() / b.norm()).item(), str(a.dtype)) for n, a, b in zip(NAMES, got, ref)}


def compiled_fn(x, w):
    """A small seam around the op, for torch.compile."""
    return short_conv(x * 2, w, backend="triton").square()


def _run_checks() -> dict:
    from kernels.short_conv import conv_bwd, conv_fwd, short_conv_bwd_op, short_conv_fwd_op

    out = {}
    for name, (B, T, C, W, xd, wd, block, programs) in CASES.items():
        x, w, dy = make_inputs(B, T, C, W, xd, wd)
        ref = reference(x, w, dy)
        out[name] = errors([conv_fwd(x, w, block), *conv_bwd(x, w, dy, block, programs)], ref)
        if name in OP_CASES:
            out[f"op_{name}"] = errors(through_autograd(lambda x, w: short_conv(x, w, "triton"), x, w, dy), ref)

    # _conv_bwd_g launched apart from _conv_bwd_dx (block_g), and the launch sweep of benchmarks.conv_bench
    x, w, dy = make_inputs(2, 37, 40, 4, "float32", "float32")
    out["g_tile16_dx_tile32"] = errors([conv_fwd(x, w), *conv_bwd(x, w, dy, TILE32, 2, block_g=TILE16)],
                                       reference(x, w, dy))
    from benchmarks import conv_bench

    conv_bench.SWEEP_BWD = dict(BT=(8, 16), BC=(16,), num_warps=(1,), programs_per_sm=(1, 3))
    out["sweep"] = conv_bench.sweep_bwd(x, w, dy, reps=1, warmup=0)

    x, w, dy = make_inputs(2, 20, 24, 4, "float32", "float32")
    out["opcheck"] = opcheck_pair(short_conv_fwd_op, (x.requires_grad_(), w.requires_grad_()), short_conv_bwd_op,
                                  (x.detach(), w.detach(), dy))
    out["compile"] = compile_against_eager(compiled_fn, lambda fn: through_autograd(fn, x, w, dy),
                                           "k3lab.short_conv_fwd", NAMES)
    return out


@pytest.fixture(scope="module")
def results():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", list(CASES) + [f"op_{c}" for c in OP_CASES])
def test_interpreter_matches_float64_reference(results, case):
    """y and dx (x's dtype) and dw (w's dtype) within 1e-5 (fp32) or 1e-2 (bf16) of the float64 reference,
    relative; from the launchers with the case's tile and backward programs, and (op_*) through autograd on
    the custom ops with the default launch."""
    errs = results[case]
    _, _, _, _, xd, wd, _, _ = CASES[case.removeprefix("op_")]
    assert [errs[n][1] for n in NAMES] == [f"torch.{xd}", f"torch.{xd}", f"torch.{wd}"], errs
    bad = {n: e for n, (e, dt) in errs.items() if not e < LIMIT[dt]}
    assert not bad, errs


def test_weight_gradient_kernel_takes_its_own_launch(results):
    """conv_bwd(block=32 x 32, block_g=16 x 16): _conv_bwd_g on its own tiles, dx and dw still within 1e-5."""
    assert all(e < LIMIT[dt] for e, dt in results["g_tile16_dx_tile32"].values()), results["g_tile16_dx_tile32"]


def test_launch_sweep_times_every_config_and_checks_it_against_the_default(results):
    """benchmarks.conv_bench --sweep-bwd on a grid of 4: the default's row and the four, each one's dx and dw
    the default's."""
    lines = results["sweep"]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("| ")]
    header, rows = rows[0], rows[1:]
    assert header[0] == "BT x BC" and header[-1] == "same dx, dw", lines
    assert len(rows) == 5 and "(default)" in rows[0][0] and all(r[-1] == "yes" for r in rows), lines
    assert sorted(f"{r[0]}/{r[2]}" for r in rows[1:]) == ["16 x 16/1", "16 x 16/3", "8 x 16/1", "8 x 16/3"]


def test_custom_ops_pass_opcheck(results):
    """torch.library.opcheck of k3lab::short_conv_fwd (with requires_grad inputs) and k3lab::short_conv_bwd:
    schema, fake tensors against the real results, the autograd registration, AOT dispatch (dynamic too)."""
    checks = results["opcheck"]
    assert {"test_schema", "test_faketensor", "test_aot_dispatch_dynamic"} <= set(checks), checks
    assert set(checks.values()) == {"SUCCESS"}, checks


def test_interpreter_torch_compile_fullgraph(results):
    """torch.compile(fullgraph=True, aot_eager) of a seam around the op: one frame, the custom op in its graph,
    eager's output and gradients."""
    assert results["compile"] == {"frames": 1, "ops_in_graph": True, "mismatches": []}


def old_short_conv(conv: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """ShortConv.forward before the Triton kernels: nn.Conv1d on the transposed input, slice, SiLU."""
    return F.silu(conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2))


@pytest.mark.parametrize("backend", ["auto", "torch", "fla"])
def test_model_short_conv_on_cpu_is_the_old_conv_bitwise(backend):
    """On CPU tensors (auto, torch, fla) the model's ShortConv is nn.Conv1d's computation: the output, the
    input's gradient and the weight's gradient equal the old forward's bit for bit (the CPU run's losses stay)."""
    from k3lab.model.kda import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(48, 4, backend)
    x, _, dy = make_inputs(2, 33, 48, 4, "float32", "float32")

    def run(fn):
        conv.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y.backward(dy)
        return [y.detach(), xx.grad, conv.conv.weight.grad]

    new, old = run(conv), run(lambda x: old_short_conv(conv.conv, x))
    assert all(torch.equal(a, b) for a, b in zip(new, old))
    assert [n for n, _ in conv.named_parameters()] == ["conv.weight"]


def test_bad_backend_is_refused():
    x, w, _ = make_inputs(1, 3, 4, 2, "float32", "float32")
    with pytest.raises(ValueError, match="unknown short conv backend 'cuda'; valid backends: auto, torch, triton, fla"):
        short_conv(x, w, backend="cuda")


def test_kernel_sizes_past_max_w_are_refused_before_any_launch():
    """The Triton path takes W <= MAX_W (one dw accumulator per tap); past it "triton" is refused."""
    from kernels.short_conv import MAX_W

    x, w, _ = make_inputs(1, 3, 4, MAX_W + 1, "float32", "float32")
    with pytest.raises(ValueError, match=f"kernel sizes 1..{MAX_W}, got {MAX_W + 1}"):
        short_conv(x, w, backend="triton")


def test_benchmark_runs_on_cpu(capsys, tmp_path):
    """`python -m benchmarks.conv_bench --device cpu`: the torch row of one tiny shape, the table to --out."""
    from benchmarks.conv_bench import main

    rows = main(["--device", "cpu", "--reps", "2", "--out", str(tmp_path / "conv.md")])
    assert [r["impl"] for r in rows] == ["torch"] and rows[0]["fwd_ratio"] == 1.0
    table = [[c.strip() for c in line.split("|")[1:3]] for line in (tmp_path / "conv.md").read_text().splitlines()
             if line.startswith("| 2x")]
    assert table == [["2x256x64", "torch"]] and "| 2x256x64 " in capsys.readouterr().out


# --- CUDA ------------------------------------------------------------------------------------------
GPU_SHAPE = (2, 4096, 1024, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float32", "float32")])
def test_cuda_matches_float64_reference(x_dtype, w_dtype):
    """backend="auto" (Triton on CUDA) against the float64 reference: y, dx, dw within LIMIT of their dtype."""
    x, w, dy = make_inputs(*GPU_SHAPE, x_dtype, w_dtype, device="cuda")
    errs = errors(through_autograd(short_conv, x, w, dy), reference(x, w, dy))
    assert not {n: e for n, (e, dt) in errs.items() if not e < LIMIT[dt]}, errs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) with Inductor of a seam around the op, bf16 x and fp32 w: one frame, the
    custom op in the graph, eager's output and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    x, w, dy = make_inputs(*GPU_SHAPE, "bfloat16", "float32", device="cuda")
    counter = CompileCounterWithBackend("inductor")
    eager = through_autograd(compiled_fn, x, w, dy)
    compiled = through_autograd(torch.compile(compiled_fn, backend=counter, fullgraph=True), x, w, dy)
    assert counter.frame_count == 1 and all("k3lab.short_conv_fwd" in g.code for g in counter.graphs)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)


if __name__ == "__main__":
    print(json.dumps(_run_checks()))
