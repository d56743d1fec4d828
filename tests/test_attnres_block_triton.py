"""Fused Triton two-phase Block AttnRes (kernels/attnres_block.py, arXiv:2603.15031 section 3.2) against the
float64 torch reference: phase 1 (`_BlockSoftmaxMix`: o, lse, alpha and the gradients of the values, inv_rms
and queries) and the merge (`_MergePartial` on r = inv_rms(p): h, w and the gradients of o, lse, p (through r
too) and query); and the bytes a two-phase AttnRes stack keeps for backward against the one-phase one's.

CPU: the kernels run under TRITON_INTERPRET=1 in one fresh subprocess (this file run as a script, see
tests/interpreted.py) and the tests assert on the relative errors it reports.
CUDA (``pytest -m gpu``): bf16 and fp32 up to D = 8192, 16 sources and 16 queries, and under torch.compile.
"""
import json
from contextlib import contextmanager
from functools import partial

import pytest
import torch

from interpreted import run_interpreted
from k3lab.model import attnres as attnres_module
from k3lab.model.attnres import _BlockSoftmaxMix, _MergePartial, block_softmax_mix, inv_rms, merge_partial
from test_attnres_triton import DTYPES, LIMIT, LIMIT_G_INV_RMS, errors

BLOCK_NAMES = ["o", "lse", "alpha", "g_values", "g_inv_rms", "g_queries"]
MERGE_NAMES = ["h", "w", "g_o", "g_lse", "g_p", "g_query"]
# The merge keeps delta = p - o for backward in p's dtype (and h in the promoted one), so the gradients that go
# through g_z = w (1 - w) <g_h, delta> and the rebuilt p = h + (1 - w) delta carry its rounding: their limit is
# p's dtype's, even where they are fp32 (g_p's own dtype is p's).
MERGE_THROUGH_DELTA = ("g_lse", "g_query")
EPS = 1e-6

# name: (B, T, D, value dtypes, Q). D = 96 pads to 128; 20-26 rows give the interpreter's 16 backward
# programs a second row on some of them. Q = 3 pads to 4 (masked query rows).
BLOCK_CASES = {
    "Q1_S1": (1, 20, 96, ["fp32"], 1),
    "Q2_S2": (1, 20, 96, ["fp32"] * 2, 2),
    "Q3_S5": (2, 13, 96, ["fp32"] * 5, 3),
    "Q4_S3_fp32_embedding_bf16_blocks": (1, 20, 40, ["fp32", "bf16", "bf16"], 4),
    # logits of std 8 (query 0.5 randn over D = 256): most rows put nearly all of a query's weight on one
    # source, where g_alpha_ji - c_j cancels most digits (taken in fp64)
    "Q2_S5_peaked_softmax": (1, 16, 256, ["bf16"] * 5, 2),
}
# name: (B, T, D, o dtype, p dtype, query scale). Query scale 2 over D = 256: z of std ~30, w within 1e-6 of
# 0 or 1 on most rows, where 1 - w must not be taken as 1 - sigmoid(z).
MERGE_CASES = {
    "fp32": (1, 20, 96, "fp32", "fp32", 0.5),
    "bf16": (1, 20, 96, "bf16", "bf16", 0.5),
    "fp32_o_bf16_p": (2, 10, 40, "fp32", "bf16", 0.5),
    "fp32_peaked": (1, 16, 256, "fp32", "fp32", 2.0),
}
PROMOTED = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_block_inputs(B, T, D, dtypes, Q, device="cpu", seed=0):
    """values (each its own scale, rounded to its dtype), their 1/rms (fp32), queries [Q, D] fp32 and the
    cotangents g_o (Q x [B, T, D] in o's dtype, the values' promoted one) and g_lse (fp32, nonzero: the merge
    uses lse)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    values = [(torch.randn(B, T, D, generator=gen, device=device) * (1 + i)).to(DTYPES[d])
              for i, d in enumerate(dtypes)]
    scales = [inv_rms(v, EPS) for v in values]
    queries = torch.randn(Q, D, generator=gen, device=device) * 0.5
    o_dtype = torch.float32 if "fp32" in dtypes else torch.bfloat16
    g_o = list(torch.randn(Q, B, T, D, generator=gen, device=device).to(o_dtype).unbind(0))
    g_lse = torch.randn(Q, B, T, generator=gen, device=device)
    return values, scales, queries, g_o, g_lse


def block_results(fn, values, scales, queries, g_o, g_lse, dtype=None):
    """[o, lse, alpha, g_values, g_inv_rms, g_queries] of fn (a phase 1); dtype casts every input first."""
    cast = (lambda x: x.to(dtype)) if dtype else (lambda x: x)
    vs = [cast(v).detach().requires_grad_() for v in values]
    rs = [cast(r).detach().requires_grad_() for r in scales]
    qs = cast(queries).detach().requires_grad_()
    o, lse, alpha = fn(vs, rs, qs)
    loss = sum((o_j * g.to(o_j.dtype)).sum() for o_j, g in zip(o, g_o)) + (lse * g_lse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, vs + rs + [qs])
    n = len(vs)
    return [tuple(o), lse, alpha, grads[:n], grads[n:2 * n], grads[-1]]


def make_merge_inputs(B, T, D, o_dtype, p_dtype, query_scale, device="cpu", seed=0):
    """o, lse [B, T] fp32, p (twice o's scale), query [D] fp32 and the cotangent g_h (h's dtype)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    o = torch.randn(B, T, D, generator=gen, device=device).to(DTYPES[o_dtype])
    lse = torch.randn(B, T, generator=gen, device=device)
    p = (2 * torch.randn(B, T, D, generator=gen, device=device)).to(DTYPES[p_dtype])
    query = torch.randn(D, generator=gen, device=device) * query_scale
    g_h = torch.randn(B, T, D, generator=gen, device=device).to(torch.promote_types(o.dtype, p.dtype))
    return o, lse, p, query, g_h


def merge_results(fn, o, lse, p, query, g_h, dtype=None):
    """[h, w, g_o, g_lse, g_p, g_query] of fn (a merge (o, lse, p, query) -> (h, w)); dtype casts every input
    first."""
    cast = (lambda x: x.to(dtype)) if dtype else (lambda x: x)
    inputs = [cast(x).detach().requires_grad_() for x in (o, lse, p, query)]
    h, w = fn(*inputs)
    return [h, w, *torch.autograd.grad((h * g_h.to(h.dtype)).sum(), inputs)]


def merge_reference(o, lse, p, query):
    """`_MergePartial` on r = inv_rms(p) taken by autograd, so p's gradient has both paths."""
    return _MergePartial.apply(o, lse, p, inv_rms(p, EPS), query)


block_reference = partial(block_softmax_mix, impl="torch")
fused_block_mix = partial(block_softmax_mix, impl="triton")
fused_merge = partial(merge_partial, eps=EPS, impl="triton")


def launched(block_inputs, merge_inputs, programs=None) -> tuple[list, list]:
    """Phase 1's and the merge's results and gradients straight from the launch helpers, with `programs`
    programs in their grid-stride kernels."""
    from kernels.attnres_block import block_mix_backward, block_mix_forward, merge_backward, merge_forward

    values, scales, queries, g_o, g_lse = block_inputs
    o, lse, logits = block_mix_forward(values, scales, queries)
    g_values, g_r, g_q = block_mix_backward(values, scales, queries, logits, g_o, g_lse, programs=programs)
    block = [tuple(o), lse, torch.exp(logits - lse.unsqueeze(1)), tuple(g_values), tuple(g_r), g_q]
    o, lse, p, query, g_h = merge_inputs
    h, w, delta, z, r = merge_forward(o, lse, p, query, EPS)
    merge = [h, w, *merge_backward(h, delta, z, r, query, g_h, o.dtype, p.dtype, programs=programs)]
    return block, merge


def two_phase_seam(values, scales, queries, p):
    """Phase 1 of two queries (o[0] taken as it is) and the merge of p into the second (lse[1] used), for
    torch.compile: -> (o[0]^2, h^2, alpha, w). (A sum of the two would be rounded differently by inductor's fused
    multiply-add, and the query gradients' cancellations would show it.)"""
    o, lse, alpha = fused_block_mix([v * 1.5 for v in values], scales, queries * 2)
    h, w = fused_merge(o[1], lse[1], p, queries[1])
    return o[0].float().square(), h.float().square(), alpha, w


def compile_mismatches(device="cpu") -> list[str]:
    """Names of the results of `two_phase_seam` (outputs, gradients of the values, inv_rms, queries and p) that
    differ between eager and torch.compile(fullgraph=True)."""
    values, scales, queries, _, _ = make_block_inputs(2, 16, 32, ["fp32", "bf16", "bf16"], 2, device)
    p = torch.randn(2, 16, 32, device=device, generator=torch.Generator(device).manual_seed(3)).to(torch.bfloat16)

    def run(fn):
        vs = [v.detach().requires_grad_() for v in values]
        rs = [r.detach().requires_grad_() for r in scales]
        qs, pp = queries.detach().requires_grad_(), p.detach().requires_grad_()
        o_0, h, alpha, w = fn(vs, rs, qs, pp)
        grads = torch.autograd.grad(o_0.sum() + h.sum(), vs + rs + [qs, pp])
        return {"o_0": o_0, "h": h, "alpha": alpha, "w": w, **{f"grad{i}": g for i, g in enumerate(grads)}}

    eager = run(two_phase_seam)
    compiled = run(torch.compile(two_phase_seam, fullgraph=True))
    return [n for n in eager if not torch.allclose(compiled[n].float(), eager[n].float(), rtol=1e-5, atol=1e-6)]


def unused_outputs_mismatches() -> list[str]:
    """Gradients of the values and queries of phase 1 (Q = 3) when only o_1 is used (no cotangent for o_0, o_2 and
    lse) that differ from the torch reference's, eager and under torch.compile(backend="aot_eager", fullgraph=True):
    -> names of the runs that differ."""
    values, scales, queries, _, _ = make_block_inputs(1, 4, 16, ["fp32"] * 2, 3)

    def middle_only(mix):
        def loss(vs, qs):
            o, _, _ = mix(vs, scales, qs)
            return o[1].float().square().sum()
        return loss

    def grads(loss):
        vs, qs = [v.detach().requires_grad_() for v in values], queries.detach().requires_grad_()
        return torch.autograd.grad(loss(vs, qs), vs + [qs])

    want = grads(middle_only(block_reference))

    def worst_error(loss):
        return max(((a - b).norm() / b.norm()).item() for a, b in zip(grads(loss), want))

    runs = {"eager": middle_only(fused_block_mix),
            "compiled": torch.compile(middle_only(fused_block_mix), backend="aot_eager", fullgraph=True)}
    return [name for name, loss in runs.items() if not worst_error(loss) < LIMIT[torch.float32]]


@contextmanager
def triton_phases():
    """AttnResidual's two phases on the Triton kernels (impl="triton") inside the block."""
    patches = {"block_softmax_mix": fused_block_mix, "merge_partial": partial(merge_partial, impl="triton")}
    originals = {name: getattr(attnres_module, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(attnres_module, name, fn)
        yield
    finally:
        for name, fn in originals.items():
            setattr(attnres_module, name, fn)


def residual_pair(block_size: int, n: int, D: int, device) -> dict:
    """{two_phase: AttnResidual} for False and True, block_attnres over n sublayers, the same random queries."""
    from k3lab.config import ResidualConfig
    from k3lab.model.attnres import AttnResidual

    residuals = {two_phase: AttnResidual(ResidualConfig(name="block_attnres", block_size=block_size), n, D, EPS,
                                         two_phase=two_phase).to(device) for two_phase in (False, True)}
    with torch.no_grad():
        for q in residuals[True].queries:  # zero queries mix uniformly; random ones make the softmax matter
            q.normal_()
    residuals[False].load_state_dict(residuals[True].state_dict())
    return residuals


def stack_of(res, sublayers):
    """emb [B, T, D] -> the residual stack's final aggregation [B, T, D], sublayer i fed by res.read(.., i)."""
    def stack(emb):
        state = res.begin(emb)
        for i, sublayer in enumerate(sublayers):
            state = res.write(state, i, sublayer(res.read(state, i)))
        return res.end(state)
    return stack


def stack_mismatches(block_size: int, device="cpu") -> dict:
    """A residual stack of 6 sublayers (tanh of a Linear) around the two-phase AttnResidual, its phases on the
    Triton kernels: {"frames": frames compiled by torch.compile(backend="aot_eager", fullgraph=True),
    "mismatches": results (output, input and parameter gradients) where compiled and eager differ,
    "one_phase_mismatches": those where eager differs from the one-phase residual beyond fp32 rounding}."""
    from torch import nn
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    D, n = 32, 6
    residuals = residual_pair(block_size, n, D, device)
    layers = nn.ModuleList(nn.Linear(D, D) for _ in range(n)).to(device)
    sublayers = [lambda x, layer=layer: torch.tanh(layer(x)) for layer in layers]
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(1)).to(device)

    def run(res, stack):
        params = dict(res.named_parameters()) | dict(layers.named_parameters())
        for p in params.values():
            p.grad = None
        emb = x.clone().requires_grad_()
        h = stack(emb)
        h.square().mean().backward()
        return {"h": h.detach(), "emb": emb.grad, **{n: p.grad for n, p in params.items()}}

    one_phase = run(residuals[False], stack_of(residuals[False], sublayers))
    with triton_phases():
        eager = run(residuals[True], stack_of(residuals[True], sublayers))
        counter = CompileCounterWithBackend("aot_eager")
        compiled = run(residuals[True], torch.compile(stack_of(residuals[True], sublayers), backend=counter,
                                                      fullgraph=True))
    return {"frames": counter.frame_count,
            "mismatches": [n for n in eager if not torch.allclose(compiled[n], eager[n], rtol=1e-5, atol=1e-7)],
            "one_phase_mismatches": [n for n in eager
                                     if not torch.allclose(eager[n], one_phase[n], rtol=1e-4, atol=1e-6)]}


def stack_saved_bytes(block_size: int, dtype: str, device="cpu") -> dict:
    """Bytes of the distinct storages autograd keeps for backward in one forward of an 8-sublayer block_attnres
    stack and a head (embedding and parameters left out), every tensor in `dtype` but the AttnRes queries and
    norms (fp32): {"two_phase": on the Triton phases, "one_phase": on the fused one-query mix
    (kernels/attnres.py)}. Each sublayer is an MLP, Linear -> tanh -> Linear, and the head a Linear: their first
    op keeps their input (as the model's RMSNorm does on CUDA; on CPU a bf16 RMSNorm keeps an fp32 copy instead),
    nothing keeps a sublayer's output (the partial sums are new tensors). dtype "mixed" is bf16 autocast's
    stream: the embedding and head fp32, each MLP bf16 behind an fp32 RMSNorm that keeps its input, so the
    sources mix fp32 and bf16 and the partial sums are bf16."""
    from torch import nn

    from benchmarks.kda_bench import saved_bytes
    from k3lab.model.attnres import depth_softmax_mix

    torch.manual_seed(0)
    D, n = 64, 8
    residuals = residual_pair(block_size, n, D, device)
    residuals[False].mix = partial(depth_softmax_mix, impl="triton")
    mixed = dtype == "mixed"
    stream, inner = (torch.float32, torch.bfloat16) if mixed else (DTYPES[dtype],) * 2

    class NormToInner(nn.Module):
        def forward(self, x):
            return nn.functional.rms_norm(x, (D,)).to(inner)

    sublayers = nn.ModuleList(nn.Sequential(*[NormToInner()] * mixed, nn.Linear(D, 2 * D), nn.Tanh(),
                                            nn.Linear(2 * D, D)) for _ in range(n))
    head = nn.Linear(D, D)
    sublayers, head = sublayers.to(device, inner), head.to(device, stream)
    emb = torch.randn(2, 9, D, device=device, dtype=stream, requires_grad=True)
    params = [*sublayers.parameters(), *head.parameters(), *residuals[True].parameters(),
              *residuals[False].parameters()]

    def forward(res):
        return head(stack_of(res, sublayers)(emb))

    with triton_phases():
        return {name: saved_bytes(partial(forward, residuals[two_phase]), exclude=[emb, *params])[0]
                for name, two_phase in (("two_phase", True), ("one_phase", False))}


def _run_checks() -> dict:
    from kernels.attnres_block import block_mix_backward_op, block_mix_op, merge_backward_op, merge_op

    out = {}
    for name, (B, T, D, dtypes, Q) in BLOCK_CASES.items():
        inputs = make_block_inputs(B, T, D, dtypes, Q)
        got = block_results(fused_block_mix, *inputs)
        out[f"block_{name}"] = errors(got, block_results(block_reference, *inputs, dtype=torch.float64), BLOCK_NAMES)
    for name, case in MERGE_CASES.items():
        inputs = make_merge_inputs(*case)
        got = merge_results(fused_merge, *inputs)
        ref = merge_results(merge_reference, *inputs, dtype=torch.float64)
        out[f"merge_{name}"] = errors(got, ref, MERGE_NAMES)
    block_inputs = make_block_inputs(1, 20, 40, ["fp32", "bf16", "bf16"], 3)
    merge_inputs = make_merge_inputs(2, 10, 40, "fp32", "bf16", 0.5)
    ref_block, ref_merge = launched(block_inputs, merge_inputs)
    got_block, got_merge = launched(block_inputs, merge_inputs, programs=3)
    out["launch_block"] = errors(got_block, ref_block, BLOCK_NAMES)
    out["launch_merge"] = errors(got_merge, ref_merge, MERGE_NAMES)

    values, scales, queries, g_o, g_lse = make_block_inputs(2, 8, 32, ["fp32", "bf16", "bf16"], 3)
    _, _, logits = block_mix_op(values, scales, queries)
    o_, lse_, p, query, g_h = make_merge_inputs(2, 8, 32, "fp32", "bf16", 0.5)
    h, _, delta, z, r = merge_op(o_, lse_, p, query, EPS)
    checks = {
        "block": torch.library.opcheck(block_mix_op, ([v.requires_grad_() for v in values], scales,
                                                      queries.requires_grad_())),
        "block_backward": torch.library.opcheck(block_mix_backward_op, ([v.detach() for v in values], scales,
                                                                        queries.detach(), logits, g_o, g_lse)),
        "merge": torch.library.opcheck(merge_op, (*(x.requires_grad_() for x in (o_, lse_, p, query)), EPS)),
        "merge_backward": torch.library.opcheck(merge_backward_op, (h, delta, z, r, query.detach(), g_h, o_.dtype,
                                                                    p.dtype)),
    }
    out["opcheck"] = {f"{op}_{test}": result for op, results in checks.items() for test, result in results.items()}
    out["compile_mismatches"] = compile_mismatches()
    out["unused_outputs_mismatches"] = unused_outputs_mismatches()
    for block_size in (2, 3):
        out[f"stack_block_size_{block_size}"] = stack_mismatches(block_size)
    for block_size in (2, 3):
        for dtype in ("bf16", "fp32", "mixed"):
            out[f"saved_bytes_block_size_{block_size}_{dtype}"] = stack_saved_bytes(block_size, dtype)
    return out


def assert_close(errs: dict, delta_dtype: torch.dtype | None = None):
    """Every error within LIMIT of its result's dtype (LIMIT_G_INV_RMS for phase 1's g_inv_rms); a merge's
    gradients through delta (MERGE_THROUGH_DELTA) within LIMIT of delta_dtype where that is looser."""
    def limit(name, dtype):
        if delta_dtype is None and name == "g_inv_rms":
            return LIMIT_G_INV_RMS
        own = LIMIT[getattr(torch, dtype.split(".")[1])]
        return max(own, LIMIT[delta_dtype]) if delta_dtype is not None and name in MERGE_THROUGH_DELTA else own

    bad = {n: e for n, es in errs.items() for e, dt in es if not e < limit(n, dt)}
    assert not bad, errs


@pytest.fixture(scope="module")
def results():
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_interpreter_block_mix_matches_float64_reference(results, case):
    """Phase 1: o, lse, alpha and every gradient within 1e-4 (fp32 results) or 1e-2 (bf16 results), relative,
    g_inv_rms within 1e-3, as the one-query kernels."""
    assert_close(results[f"block_{case}"])


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_interpreter_merge_matches_float64_reference(results, case):
    """The merge against `_MergePartial` on r = inv_rms(p): h, w and every gradient (g_p through r too) within
    1e-4 (fp32 results) or 1e-2 (bf16 results), relative; g_lse and g_query within the limit of p's dtype, which
    delta = p - o is kept in."""
    assert_close(results[f"merge_{case}"], PROMOTED[MERGE_CASES[case][4]])


@pytest.mark.parametrize("phase,g_query", [("block", "g_queries"), ("merge", "g_query")])
def test_interpreter_launch_config(results, phase, g_query):
    """3 programs in the grid-stride backward kernels (default here: 16) give the default's results bit for bit,
    but the query gradient, whose per-program partial sums split differently (within 1e-6)."""
    errs = results[f"launch_{phase}"]
    assert all(e == 0 for name, es in errs.items() if name != g_query for e, _ in es), errs
    assert errs[g_query][0][0] < 1e-6, errs


def test_custom_ops(results):
    """torch.library.opcheck of both phases and their backwards: schema, fake tensors, autograd registration."""
    assert set(results["opcheck"].values()) == {"SUCCESS"}, results["opcheck"]


def test_interpreter_torch_compile_fullgraph(results):
    """torch.compile(fullgraph=True, inductor) of a seam around both phases: no graph break, eager results."""
    assert results["compile_mismatches"] == []


def test_interpreter_unused_outputs(results):
    """Phase 1 with only o_1 used: the other cotangents arrive as zeros (autograd materialises them), eager and
    compiled, and the gradients are the torch reference's."""
    assert results["unused_outputs_mismatches"] == []


@pytest.mark.parametrize("block_size", [2, 3])
def test_interpreter_residual_stack_compiles_fullgraph(results, block_size):
    """torch.compile(fullgraph=True, aot_eager) of a 6-sublayer two-phase AttnRes stack on the Triton phases:
    one frame, output and every gradient those of eager, which are the one-phase residual's."""
    assert results[f"stack_block_size_{block_size}"] == {"frames": 1, "mismatches": [], "one_phase_mismatches": []}


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "mixed"])
@pytest.mark.parametrize("block_size", [2, 3])
def test_interpreter_two_phase_stack_keeps_no_more_than_one_phase(results, block_size, dtype):
    """An 8-sublayer AttnRes stack keeps no more bytes for backward with the two Triton phases than with the fused
    one-phase mix: phase 1's o_j are separate tensors (the block's first op, holding o_0, keeps no other alive)
    and the merge keeps delta = p - o, in p's dtype, where the one-phase mix keeps p (with fp32 sources and bf16
    partial sums, "mixed", delta in the promoted dtype would keep twice p's bytes)."""
    saved = results[f"saved_bytes_block_size_{block_size}_{dtype}"]
    assert saved["two_phase"] <= saved["one_phase"], saved


def test_dispatch():
    """CPU inputs take the torch Functions under impl="auto"; what the kernels cannot take is refused under
    impl="triton" before any launch."""
    from kernels.attnres_block import MAX_QUERY_TILE

    values, scales, queries, _, _ = make_block_inputs(1, 3, 8, ["fp32"] * 2, 2)
    (o, lse, alpha), want = block_softmax_mix(values, scales, queries), _BlockSoftmaxMix.apply(queries, 2, *values,
                                                                                                *scales)
    assert all(torch.equal(a, b) for a, b in zip([*o, lse, alpha], want, strict=True))
    o, lse, p, query, _ = make_merge_inputs(1, 3, 8, "fp32", "fp32", 0.5)
    got, want = merge_partial(o, lse, p, query, EPS), merge_reference(o, lse, p, query)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="Triton block AttnRes mix"):
        block_softmax_mix([v.double() for v in values], [r.double() for r in scales], queries.double(), impl="triton")
    wide = [torch.zeros(1, 3, 1024)]
    with pytest.raises(ValueError, match="Triton block AttnRes mix"):
        block_softmax_mix(wide, [inv_rms(wide[0], EPS)], torch.zeros(MAX_QUERY_TILE // 1024 + 1, 1024), impl="triton")
    with pytest.raises(ValueError, match="Triton AttnRes merge"):
        merge_partial(o.double(), lse, p.double(), query, EPS, impl="triton")
    for fn, args in ((block_softmax_mix, (values, scales, queries)), (merge_partial, (o, lse, p, query, EPS))):
        with pytest.raises(ValueError, match="impl must be"):
            fn(*args, impl="cuda")


# --- CUDA ------------------------------------------------------------------------------------------
GPU_BLOCK_CASES = {
    "bf16_Q2_S3_D1024": (2, 300, 1024, ["bf16"] * 3, 2),
    "bf16_Q4_S5_D1024_fp32_embedding": (2, 300, 1024, ["fp32"] + ["bf16"] * 4, 4),
    "bf16_Q16_S2_D1024": (1, 200, 1024, ["bf16"] * 2, 16),
    "bf16_Q2_S16_D8192": (1, 77, 8192, ["bf16"] * 16, 2),
    "fp32_Q3_S5_D96": (2, 37, 96, ["fp32"] * 5, 3),
    "fp32_Q2_S3_D4000": (1, 50, 4000, ["fp32"] * 3, 2),
}
GPU_MERGE_CASES = {
    "bf16_D1024": (2, 300, 1024, "bf16", "bf16", 0.5),
    "fp32_o_bf16_p_D1024": (2, 300, 1024, "fp32", "bf16", 0.5),
    "bf16_D8192": (1, 77, 8192, "bf16", "bf16", 0.1),
    "fp32_D4000_peaked": (1, 50, 4000, "fp32", "fp32", 0.5),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(GPU_BLOCK_CASES))
def test_cuda_block_mix_matches_float64_reference(case):
    B, T, D, dtypes, Q = GPU_BLOCK_CASES[case]
    inputs = make_block_inputs(B, T, D, dtypes, Q, device="cuda")
    got = block_results(block_softmax_mix, *inputs)  # impl="auto": triton on CUDA
    assert_close(errors(got, block_results(block_reference, *inputs, dtype=torch.float64), BLOCK_NAMES))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(GPU_MERGE_CASES))
def test_cuda_merge_matches_float64_reference(case):
    B, T, D, o_dtype, p_dtype, query_scale = GPU_MERGE_CASES[case]
    inputs = make_merge_inputs(B, T, D, o_dtype, p_dtype, query_scale, device="cuda")
    got = merge_results(partial(merge_partial, eps=EPS), *inputs)  # impl="auto": triton on CUDA
    ref = merge_results(merge_reference, *inputs, dtype=torch.float64)
    assert_close(errors(got, ref, MERGE_NAMES), PROMOTED[p_dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_torch_compile_fullgraph():
    assert compile_mismatches("cuda") == []
    assert stack_mismatches(3, "cuda") == {"frames": 1, "mismatches": [], "one_phase_mismatches": []}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_two_phase_stack_keeps_no_more_than_one_phase():
    saved = stack_saved_bytes(3, "bf16", "cuda")
    assert saved["two_phase"] <= saved["one_phase"], saved


if __name__ == "__main__":
    print(json.dumps(_run_checks()))
