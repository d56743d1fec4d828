"""Attention Residuals (arXiv:2603.15031): the residual seam driven by a toy stack of sublayers.

Each toy sublayer is f_i(x) = W_i tanh(RMSNorm_i(x)) (its own PreNorm, like the real ones), so the
tests need nothing but the seam: begin / read / write / end.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k3lab.config import ResidualConfig
from k3lab.lit import depth_metrics
from k3lab.model import attnres as attnres_module
from k3lab.model.attnres import (AttnResidual, block_softmax_mix, depth_softmax_mix, depth_softmax_mix_autograd,
                                 inv_rms, merge_partial)
from k3lab.model.norm import RMSNorm
from k3lab.model.residual import LOW_ENTROPY, SATURATED_WEIGHT, StandardResidual, attnres_saturation, build_residual
from k3lab.plots import depth_diagnostics_of, plot_depth_diagnostics
from k3lab.plots import main as plots_main

D, EPS = 16, 1e-6


class ToySublayer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = RMSNorm(d, EPS)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.proj(torch.tanh(self.norm(x)))


def toy_stack(n_sublayers: int, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList([ToySublayer(D) for _ in range(n_sublayers)])


def run(residual, stack, emb, perturb: dict | None = None):
    """Drive the seam as the model does. perturb {j: tensor} is added to sublayer j's output.
    Returns (inputs read by each sublayer, outputs written, final h)."""
    reads, outs = [], []
    state = residual.begin(emb)
    for i, f in enumerate(stack):
        x = residual.read(state, i)
        y = f(x)
        if perturb and i in perturb:
            y = y + perturb[i]
        reads.append(x)
        outs.append(y)
        state = residual.write(state, i, y)
    return reads, outs, residual.end(state)


def make(name: str, n_sublayers: int, block_size: int = 2, randomise: bool = False, seed: int = 1,
         two_phase: bool = False):
    res = build_residual(ResidualConfig(name=name, block_size=block_size), n_sublayers, D, EPS, two_phase).double()
    if randomise:  # trained-looking queries and norm gains, so the softmax is far from uniform
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name_, p in res.named_parameters():
                noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
                p.copy_(noise * 1.5 if name_.startswith("queries.") else 1.0 + 0.3 * noise)
    return res


# --- an independent reference, written from the paper's equations ------------------------------
def paper_sources(emb, outs, op, block_size):
    """Sources of op `op` (paper §3.2): the embedding, the sums of the completed blocks of
    `block_size` sublayers, and the sum of the outputs already produced in op's own block."""
    n_done = op // block_size
    srcs = [emb] + [sum(outs[n * block_size:(n + 1) * block_size]) for n in range(n_done)]
    if op % block_size:
        srcs.append(sum(outs[n_done * block_size:op]))
    return srcs


def reference_mix(sources, w, g, eps=EPS):
    """h = sum_i softmax_i(w . RMSNorm(v_i)) v_i, with RMSNorm(v) = v / sqrt(mean(v^2) + eps) * g."""
    V = torch.stack(sources)                                           # [S, B, T, D]
    K = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + eps) * g      # [S, B, T, D]
    logits = torch.einsum("d,sbtd->sbt", w, K)
    return torch.einsum("sbt,sbtd->btd", logits.softmax(0), V)


def reference_run(stack, emb, queries, gains, block_size, n_sublayers):
    outs, reads = [], []
    for i, f in enumerate(stack):
        x = reference_mix(paper_sources(emb, outs, i, block_size), queries[i], gains[i])
        reads.append(x)
        outs.append(f(x))
    h = reference_mix(paper_sources(emb, outs, n_sublayers, block_size), queries[-1], gains[-1])
    return reads, h


def emb_input(seed=0, B=2, T=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64)


# --- must-show tests ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,block_size", [("full_attnres", 1), ("block_attnres", 2), ("block_attnres", 3)])
def test_uniform_weights_at_init(name, block_size):
    """Zero pseudo-queries: every op's input is the plain mean of its sources, token by token."""
    n = 8
    res, stack, emb = make(name, n, block_size), toy_stack(n).double(), emb_input()
    res.record = True
    reads, outs, h = run(res, stack, emb)
    bs = res.block_size
    for i in range(n + 1):
        srcs = paper_sources(emb, outs, i, bs)
        got = reads[i] if i < n else h
        torch.testing.assert_close(got, torch.stack(srcs).mean(0), rtol=1e-12, atol=1e-12)
    diag = res.diagnostics()
    for op, row in enumerate(diag["depth_weights"]):
        seen = [w for w in row if not math.isnan(w)]
        assert seen == pytest.approx([1 / len(seen)] * len(seen), abs=1e-7), op


@pytest.mark.parametrize("name,block_size", [("full_attnres", 1), ("block_attnres", 2), ("block_attnres", 3)])
def test_matches_plain_softmax_reference(name, block_size):
    """AttnResidual (factorised, cached 1/rms, list-based) == stacked softmax over the paper's sources,
    outputs and gradients, with random queries and norm gains (float64)."""
    n = 8
    res = make(name, n, block_size, randomise=True)
    stack = toy_stack(n).double()
    emb = emb_input().requires_grad_(True)
    reads, _, h = run(res, stack, emb)
    queries = [q for q in res.queries]
    gains = [m.weight for m in res.norms]
    ref_reads, ref_h = reference_run(stack, emb, queries, gains, res.block_size, n)
    for got, want in zip(reads + [h], ref_reads + [ref_h]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    probe = torch.randn_like(h)
    params = [emb] + list(res.parameters()) + list(stack.parameters())
    g1 = torch.autograd.grad((h * probe).sum(), params)
    g2 = torch.autograd.grad((ref_h * probe).sum(), params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    # the weights are far from uniform here, so a softmax that ignored the queries would be noticed
    uniform = reference_mix(paper_sources(emb, [f(x) for f, x in zip(stack, reads)], n, res.block_size),
                            torch.zeros(D, dtype=h.dtype), torch.ones(D, dtype=h.dtype))
    assert (h - uniform).abs().max() > 0.1


def test_block_size_one_equals_full():
    """block_attnres with block_size=1 and full_attnres, same weights: same outputs and gradients."""
    n = 6
    full = make("full_attnres", n, randomise=True, seed=3)
    block = make("block_attnres", n, block_size=1)
    block.load_state_dict(full.state_dict())
    stack = toy_stack(n).double()
    results = []
    for res in (full, block):
        emb = emb_input().requires_grad_(True)
        reads, _, h = run(res, stack, emb)
        loss = (h.sin() * torch.arange(D, dtype=h.dtype)).sum() + sum(r.square().mean() for r in reads)
        grads = torch.autograd.grad(loss, [emb] + list(res.parameters()) + list(stack.parameters()))
        results.append((reads, h, grads))
    (r1, h1, g1), (r2, h2, g2) = results
    torch.testing.assert_close(h1, h2, rtol=0, atol=0)
    for a, b in zip(r1 + list(g1), r2 + list(g2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # queries of ops with 2+ sources get gradients (op 0 sees the embedding alone: softmax of one = 1)
    assert g1[0].abs().sum() > 0 and all(g.abs().sum() > 0 for g in g1[2:n + 2])


def test_sources_are_the_papers():
    """8 sublayers in blocks of 3: blocks {0,1,2}, {3,4,5}, {6,7}. Column 0 = embedding, n = block n."""
    res = make("block_attnres", 8, block_size=3)
    expected = {
        0: [0],            # first sublayer: the embedding alone
        1: [0, 1],         # + partial sum of block 1 (output 0)
        2: [0, 1],         # + partial sum of block 1 (outputs 0, 1)
        3: [0, 1],         # block 1 complete, block 2 empty
        4: [0, 1, 2],
        5: [0, 1, 2],
        6: [0, 1, 2],
        7: [0, 1, 2, 3],
        8: [0, 1, 2, 3],   # final aggregation: the last, shorter block enters as a partial sum
    }
    assert {op: res.source_columns(op) for op in range(9)} == expected
    full = make("full_attnres", 8)
    assert all(full.source_columns(op) == list(range(op + 1)) for op in range(9))
    assert full.column_labels() == ["emb", "L0.mix", "L0.ffn", "L1.mix", "L1.ffn", "L2.mix", "L2.ffn",
                                    "L3.mix", "L3.ffn"]
    # the values behind the columns: what op 7 mixes is exactly [emb, b1, b2, partial(out 6)]
    stack, emb = toy_stack(8).double(), emb_input()
    res_r = make("block_attnres", 8, block_size=3, randomise=True)
    reads, outs, _ = run(res_r, stack, emb)
    want = reference_mix([emb, sum(outs[0:3]), sum(outs[3:6]), outs[6]], res_r.queries[7], res_r.norms[7].weight)
    torch.testing.assert_close(reads[7], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,block_size", [("full_attnres", 1), ("block_attnres", 2), ("block_attnres", 3)])
def test_causal_over_depth(name, block_size):
    """Changing sublayer j's output leaves the inputs of sublayers 0..j unchanged and moves every later
    input and the final mix; and d(input_i)/d(output_j) = 0 for j >= i."""
    n = 8
    res, stack, emb = make(name, n, block_size, randomise=True), toy_stack(n).double(), emb_input()
    base_reads, _, base_h = run(res, stack, emb)
    for j in range(n):
        reads, _, h = run(res, stack, emb, perturb={j: torch.randn_like(emb)})
        for i in range(n):
            if i <= j:
                assert torch.equal(reads[i], base_reads[i]), (j, i)
            else:
                assert (reads[i] - base_reads[i]).abs().max() > 1e-6, (j, i)
        assert (h - base_h).abs().max() > 1e-6
    # gradient form: zero perturbations with requires_grad
    deltas = {j: torch.zeros_like(emb, requires_grad=True) for j in range(n)}
    reads, _, _ = run(res, stack, emb, perturb=deltas)
    for i in range(n):
        grads = torch.autograd.grad(reads[i].sum(), list(deltas.values()), allow_unused=True, retain_graph=True)
        for j, g in enumerate(grads):
            if j >= i:
                assert g is None or torch.count_nonzero(g) == 0, (i, j)
            else:
                assert g is not None and g.abs().sum() > 0, (i, j)


def test_attnres_parameters_are_1d_and_owned():
    """Pseudo-queries (zeros) and AttnRes norm gains (ones): 2 x (n_sublayers + 1) vectors of size D,
    all 1-D, so the 'hidden 2-D matrices -> Muon, rest -> AdamW' rule sends them to AdamW."""
    for name in ("full_attnres", "block_attnres"):
        res = build_residual(ResidualConfig(name=name, block_size=4), 12, D, EPS)
        params = dict(res.named_parameters())
        assert len(params) == 2 * 13
        assert all(p.ndim == 1 and p.shape == (D,) for p in params.values())
        assert all(torch.count_nonzero(p) == 0 for k, p in params.items() if k.startswith("queries."))
        assert all(torch.all(p == 1) for k, p in params.items() if k.startswith("norms."))
    assert list(StandardResidual().parameters()) == []


@pytest.mark.parametrize("name", ["standard", "full_attnres", "block_attnres"])
def test_recording_changes_nothing_and_measures_rms(name):
    """record=True gives bit-identical outputs and the RMS it reports is the RMS of what was read/written."""
    n = 6
    res = make(name, n, block_size=2, randomise=name != "standard")
    stack, emb = toy_stack(n).double(), emb_input()
    reads0, outs0, h0 = run(res, stack, emb)
    res.record = True
    reads1, outs1, h1 = run(res, stack, emb)
    run(res, stack, emb * 2)
    res.record = False
    diag = res.diagnostics()
    assert torch.equal(h0, h1) and all(torch.equal(a, b) for a, b in zip(reads0, reads1))
    reads2, outs2, h2 = run(res, stack, emb * 2)
    rms = lambda x: x.square().mean().sqrt().item()  # noqa: E731
    assert diag["n_forwards"] == 2
    assert diag["output_rms"] == pytest.approx([(rms(a) + rms(b)) / 2 for a, b in zip(outs1, outs2)], rel=1e-6)
    assert diag["input_rms"] == pytest.approx([(rms(a) + rms(b)) / 2 for a, b in zip(reads1, reads2)], rel=1e-6)
    assert diag["final_rms"] == pytest.approx((rms(h1) + rms(h2)) / 2, rel=1e-6)
    assert res.diagnostics()["n_forwards"] == 0  # diagnostics() cleared the sums
    metrics = depth_metrics(diag)
    assert metrics["depth/output_rms/00"] == diag["output_rms"][0]
    assert len([k for k in metrics if "/output_rms/" in k]) == n


def test_standard_residual_math_unchanged():
    """StandardResidual is still h <- h + f(h): compare with the plain loop."""
    stack, emb = toy_stack(6).double(), emb_input()
    _, _, h = run(StandardResidual(), stack, emb)
    x = emb
    for f in stack:
        x = x + f(x)
    torch.testing.assert_close(h, x, rtol=0, atol=0)


def test_bf16_sources_keep_dtype_and_fp32_softmax():
    """bf16 sublayer outputs with an fp32 embedding: the mix is fp32 (type promotion, as the standard sum);
    all-bf16 sources give bf16; both stay close to the float64 reference."""
    n = 4
    res = make("full_attnres", n, randomise=True).float()
    stack = toy_stack(n).to(torch.bfloat16)
    emb = emb_input().float()
    for emb_dtype, want in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
        state = res.begin(emb.to(emb_dtype))
        for i, f in enumerate(stack):
            state = res.write(state, i, f(res.read(state, i).to(torch.bfloat16)))
        h = res.end(state)
        assert h.dtype == want
        srcs = [s.double() for s in state.sources]
        ref = reference_mix(srcs, res.queries[-1].double(), res.norms[-1].weight.double())
        torch.testing.assert_close(h.double(), ref, rtol=3e-2, atol=3e-2)


def test_n_blocks_sets_block_size():
    """residual.n_blocks > 0 keeps the block count fixed across depths: block_size = ceil(2L / n_blocks)."""
    for n_sub, n_blocks, want in ((8, 4, 2), (24, 8, 3), (48, 8, 6), (10, 4, 3)):
        res = build_residual(ResidualConfig(name="block_attnres", block_size=99, n_blocks=n_blocks), n_sub, D, EPS)
        assert res.block_size == want and res.n_blocks == math.ceil(n_sub / want)


def test_fused_backward_gradcheck():
    """The hand-written backward of the op passes torch.autograd.gradcheck (float64, 3 sources)."""
    g = torch.Generator().manual_seed(5)
    vs = [torch.randn(1, 2, 6, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    q = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)

    def op(q, *vs):
        return depth_softmax_mix(list(vs), [inv_rms(v, EPS) for v in vs], q)[0]

    assert torch.autograd.gradcheck(op, (q, *vs))


# --- two-phase Block AttnRes (paper §3.2) ---------------------------------------------------------
def random_sources(n: int, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(2, 3, D, generator=g, dtype=torch.float64)).requires_grad_() for _ in range(n)]


def test_block_mix_is_the_one_phase_mix_of_each_query():
    """Phase 1 over 4 sources with 3 queries: o[j] and alpha[j] are the one-phase mix of query j, lse[j] the
    log-sum-exp of its logits; the hand-written backward passes gradcheck (float64)."""
    vs = random_sources(4, 6)
    qs = (2 * torch.randn(3, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)).requires_grad_()
    scales = [inv_rms(v, EPS) for v in vs]
    o, lse, alpha = block_softmax_mix(vs, scales, qs)
    for j in range(3):
        h, a = depth_softmax_mix_autograd(vs, scales, qs[j])
        torch.testing.assert_close(o[j], h, rtol=0, atol=1e-12)
        torch.testing.assert_close(alpha[j], a, rtol=0, atol=1e-12)
        logits = torch.stack([(v @ qs[j]) * r.squeeze(-1) for v, r in zip(vs, scales)])
        torch.testing.assert_close(lse[j], torch.logsumexp(logits, 0), rtol=0, atol=1e-12)

    def op(qs, *vs):
        o, lse, _ = block_softmax_mix(list(vs), [inv_rms(v, EPS) for v in vs], qs)
        return *o, lse

    assert torch.autograd.gradcheck(op, (qs, *vs))


def test_merge_is_the_one_phase_mix_with_the_partial_appended():
    """Phase 2: merging the partial sum into phase 1's mix gives the one-phase mix over [sources, partial],
    w its weight on the partial; the hand-written backward passes gradcheck (float64), lse included."""
    vs, (p,) = random_sources(3, 8), random_sources(1, 9, scale=2.0)
    q = (2 * torch.randn(D, generator=torch.Generator().manual_seed(10), dtype=torch.float64)).requires_grad_()
    scales = [inv_rms(v, EPS) for v in vs]
    o, lse, _ = block_softmax_mix(vs, scales, q[None])
    h, w = merge_partial(o[0], lse[0], p, q, EPS)
    want, alpha = depth_softmax_mix_autograd(vs + [p], scales + [inv_rms(p, EPS)], q)
    torch.testing.assert_close(h, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(w, alpha[-1], rtol=0, atol=1e-12)
    o1, lse1 = o[0].detach().requires_grad_(), (lse[0].detach() + 0.3).requires_grad_()

    def op(o, lse, p, q):
        return merge_partial(o, lse, p, q, EPS)[0]

    assert torch.autograd.gradcheck(op, (o1, lse1, p, q))


@pytest.mark.parametrize("n_sublayers,block_size", [(8, 3), (8, 4), (6, 2), (5, 2)])
def test_two_phase_equals_one_phase(n_sublayers, block_size, monkeypatch):
    """Through the seam with trained-looking queries: the same sublayer inputs, final output and gradients
    (embedding, stack, AttnRes parameters) as the one-phase mix, to float64 rounding, with one phase-1 call
    per block and one for the final aggregation when it opens a block of its own (n_sublayers a multiple of
    block_size; otherwise it joins the last block's)."""
    calls = []
    phase1 = attnres_module.block_softmax_mix
    monkeypatch.setattr(attnres_module, "block_softmax_mix",
                        lambda vs, rs, qs: calls.append(len(qs)) or phase1(vs, rs, qs))
    results = []
    for two_phase in (False, True):
        stack, emb = toy_stack(n_sublayers).double(), emb_input().requires_grad_()
        res = make("block_attnres", n_sublayers, block_size, randomise=True, two_phase=two_phase)
        reads, _, h = run(res, stack, emb)
        h.square().sum().backward()
        results.append([*reads, h, emb.grad, *(p.grad for p in [*stack.parameters(), *res.parameters()])])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    blocks = math.ceil(n_sublayers / block_size)
    alone = n_sublayers % block_size == 0
    assert len(calls) == blocks + alone
    assert calls[-1] == (1 if alone else n_sublayers % block_size + 1)
    assert sum(calls) == n_sublayers + 1


def test_two_phase_records_with_the_one_phase_mix():
    """The depth recording (validation) takes the one-phase mix, which alone yields each op's weights: the
    diagnostics and the final output are those of the one-phase residual."""
    out = []
    for two_phase in (False, True):
        res = make("block_attnres", 8, 3, randomise=True, two_phase=two_phase)
        res.record = True
        _, _, h = run(res, toy_stack(8).double(), emb_input())
        out.append((h, res.diagnostics()))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)
    np.testing.assert_equal(out[0][1], out[1][1])  # nan (a source an op does not see) equal to nan


def test_inv_rms_backward():
    """inv_rms' one-pass backward passes gradcheck (float64) and, for bf16 v, matches autograd through the
    plain formula in float64 to bf16 rounding."""
    g = torch.Generator().manual_seed(6)
    v = torch.randn(2, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: inv_rms(x, EPS), (v,))
    vb = (torch.randn(4, 5, 64, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    g_r = torch.randn(4, 5, 1, generator=g)
    (got,) = torch.autograd.grad(inv_rms(vb, EPS), vb, g_r)
    v64 = vb.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(torch.rsqrt(v64.square().mean(-1, keepdim=True) + EPS), v64, g_r.double())
    assert got.dtype == torch.bfloat16
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_peaked_softmax_backward_keeps_its_digits():
    """Sources of growing scale put nearly all of a row's weight on one source. There the fp32 gradient of
    its 1/rms is a small difference of large numbers: the op's pairwise form stays within 1e-3 of float64,
    plain fp32 autograd (softmax backward: alpha * (g - sum alpha g)) does not."""
    g = torch.Generator().manual_seed(0)
    vs = [torch.randn(1, 20, 8192, generator=g) * (1 + i) for i in range(16)]
    q = torch.randn(8192, generator=g) * 0.5
    g_h = torch.randn(1, 20, 8192, generator=g)

    def g_inv_rms(mix, dtype):
        rs = [inv_rms(v.to(dtype), EPS).detach().requires_grad_() for v in vs]
        h, _ = mix([v.to(dtype) for v in vs], rs, q.to(dtype))
        return torch.stack(torch.autograd.grad((h * g_h.to(dtype)).sum(), rs)).double().flatten(1)  # [S, T]

    def worst_source_error(got, ref):
        return ((got - ref).norm(dim=1) / ref.norm(dim=1)).max().item()

    ref = g_inv_rms(depth_softmax_mix_autograd, torch.float64)
    assert worst_source_error(g_inv_rms(depth_softmax_mix, torch.float32), ref) < 1e-3
    assert worst_source_error(g_inv_rms(depth_softmax_mix_autograd, torch.float32), ref) > 1e-2


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.float32, torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16,) * 3])
def test_fused_matches_autograd_in_low_precision(dtypes):
    """Fused op == plain-autograd op for fp32, mixed fp32/bf16 and all-bf16 sources (values and grads)."""
    g = torch.Generator().manual_seed(6)
    base = [torch.randn(2, 7, 64, generator=g) * (1 + i) for i in range(len(dtypes))]
    q0 = torch.randn(64, generator=g)
    results = []
    for fn in (depth_softmax_mix, depth_softmax_mix_autograd):
        vs = [b.to(dt).requires_grad_(True) for b, dt in zip(base, dtypes)]
        q = q0.clone().requires_grad_(True)
        h, alpha = fn(vs, [inv_rms(v, EPS) for v in vs], q)
        probe = torch.linspace(-1, 1, h.numel()).reshape(h.shape).to(h.dtype)
        grads = torch.autograd.grad((h * probe).sum(), [q, *vs])
        results.append((h, alpha, grads))
    (h1, a1, g1), (h2, a2, g2) = results
    assert h1.dtype == h2.dtype and a1.dtype == torch.float32
    tol = 1e-5 if torch.bfloat16 not in dtypes else 2e-2
    torch.testing.assert_close(a1, a2, rtol=tol, atol=tol)
    torch.testing.assert_close(h1.float(), h2.float(), rtol=tol, atol=tol)
    for x, y in zip(g1, g2):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol * y.float().abs().max().item())


def test_config_errors():
    with pytest.raises(ValueError, match="block_size"):
        build_residual(ResidualConfig(name="block_attnres", block_size=0), 8, D, EPS)
    with pytest.raises(ValueError, match="does not implement"):
        AttnResidual(ResidualConfig(name="standard"), 8, D, EPS)
    from k3lab.config import ModelConfig
    from k3lab.errors import ConfigError

    for name in ("standard", "full_attnres"):
        cfg = ModelConfig(residual=ResidualConfig(name=name))
        cfg.kernels.attnres_two_phase = True
        with pytest.raises(ConfigError, match="kernels.attnres_two_phase=true acts with residual=block_attnres"):
            cfg.validate()


def test_plot_depth_diagnostics(tmp_path):
    n, stack, emb = 8, toy_stack(8).double(), emb_input()
    diags = {}
    for name in ("standard", "block_attnres", "full_attnres"):
        res = make(name, n, block_size=2, randomise=name != "standard")
        res.record = True
        run(res, stack, emb)
        diags[name] = {**res.diagnostics(), "step": 10}
    written = plot_depth_diagnostics(diags, tmp_path, tag="_step10")
    names = sorted(p.name for p in written)
    assert names == ["depth_diagnostics_step10.json", "depth_mix_step10.png", "depth_rms_step10.png",
                     "depth_weights_step10_block_attnres.png", "depth_weights_step10_full_attnres.png"]
    assert all(p.stat().st_size > 1000 for p in written if p.suffix == ".png")
    single = plot_depth_diagnostics(diags["block_attnres"], tmp_path / "one")
    assert sorted(p.name for p in single) == ["depth_diagnostics.json", "depth_mix.png", "depth_rms.png",
                                              "depth_weights.png"]
    alone = plot_depth_diagnostics(diags["standard"], tmp_path / "standard")  # no mixes: no mix figures
    assert sorted(p.name for p in alone) == ["depth_diagnostics.json", "depth_rms.png"]

    # several runs side by side, from what each wrote at its end (NaN where an op sees no source, round trip)
    for name in ("block_attnres", "full_attnres"):
        plot_depth_diagnostics(diags[name], tmp_path / name / "plots")
    back = depth_diagnostics_of(tmp_path / "full_attnres")
    np.testing.assert_array_equal(np.asarray(back["depth_shares"], float),
                                  np.asarray(diags["full_attnres"]["depth_shares"], float))
    assert math.isnan(back["entropy"][0]) and back["step"] == 10
    plots_main([str(tmp_path / "block_attnres"), str(tmp_path / "full_attnres"), "--labels", "block,full q/10",
                "--out", str(tmp_path / "both")])
    assert sorted(p.name for p in (tmp_path / "both").iterdir()) == [  # a label's '/' and ' ' not in a file name
        "depth_diagnostics.json", "depth_mix.png", "depth_rms.png", "depth_weights_block.png",
        "depth_weights_full_q_10.png"]
    with pytest.raises(SystemExit):
        plots_main([str(tmp_path / "standard_missing"), "--out", str(tmp_path / "none")])


@pytest.mark.parametrize("name,block_size", [("full_attnres", 1), ("block_attnres", 3)])
def test_recorded_mix_statistics_are_those_of_the_papers_mix(name, block_size):
    """Per op, the recorded weight, amplitude share, normalised entropy and largest weight are the token
    means of those of the stacked reference softmax over the paper's sources, over two forwards; the
    pseudo-query norms are the parameters'; depth_metrics and attnres_saturation report them."""
    n = 7
    res = make(name, n, block_size, randomise=True)
    stack = toy_stack(n).double()
    embs = [emb_input(seed) for seed in (0, 1)]
    res.record = True
    per_forward = []
    for emb in embs:
        reads, outs, _ = run(res, stack, emb)
        per_forward.append([paper_sources(emb, outs, op, res.block_size) for op in range(n + 1)])
    diag = res.diagnostics()
    for op in range(n + 1):
        q, g = res.queries[op], res.norms[op].weight
        stats = []
        for sources in (forward[op] for forward in per_forward):
            V = torch.stack(sources)                                                # [S, B, T, D]
            rms = torch.sqrt(V.pow(2).mean(-1) + EPS)                               # [S, B, T]
            alpha = torch.einsum("d,sbtd->sbt", q * g, V / rms.unsqueeze(-1)).softmax(0)
            amplitude = alpha * rms
            S = len(sources)
            entropy = -(alpha * alpha.log()).sum(0) / math.log(S) if S > 1 else torch.tensor(math.nan)
            stats.append((alpha.mean((1, 2)), (amplitude / amplitude.sum(0)).mean((1, 2)), entropy.mean(),
                          alpha.max(0).values.mean()))
        weight, share, entropy, max_weight = (sum(x) / 2 for x in zip(*stats))
        cols = res.source_columns(op)
        # float64 inputs, statistics accumulated in fp32 (the recorder's dtype): a few fp32 ulps
        assert [diag["depth_weights"][op][c] for c in cols] == pytest.approx(weight.tolist(), rel=1e-6, abs=1e-7)
        assert [diag["depth_shares"][op][c] for c in cols] == pytest.approx(share.tolist(), rel=1e-6, abs=1e-7)
        assert all(math.isnan(v) for c, v in enumerate(diag["depth_shares"][op]) if c not in cols)
        if len(cols) == 1:
            assert math.isnan(diag["entropy"][op]) and diag["max_weight"][op] == 1.0
        else:
            assert diag["entropy"][op] == pytest.approx(entropy.item(), rel=1e-6, abs=1e-7)
            assert diag["max_weight"][op] == pytest.approx(max_weight.item(), rel=1e-6)
        assert diag["query_norm"][op] == pytest.approx(q.norm().item(), rel=1e-6)
    # the weights are far from uniform, and the sources' RMS differ: share and weight are not the same thing
    w, a = np.asarray(diag["depth_weights"], float), np.asarray(diag["depth_shares"], float)
    assert np.nanmax(np.abs(w - a)) > 0.05 and np.nanmin(diag["entropy"]) < 0.9

    metrics = depth_metrics(diag)
    labels = diag["column_labels"]
    assert metrics["depth/weight/00/emb"] == 1.0 and "depth/entropy/00" not in metrics  # op 0: the embedding alone
    assert metrics[f"depth/share/{n:02d}/{labels[-1]}"] == diag["depth_shares"][n][-1]
    assert metrics["depth/query_norm/03"] == diag["query_norm"][3]
    assert metrics["depth/max_weight/01"] == diag["max_weight"][1]
    summary = attnres_saturation({**diag, "step": 7})
    mixing = [op for op in range(n + 1) if len(res.source_columns(op)) > 1]
    assert summary["ops"] == len(mixing) and summary["step"] == 7
    assert summary["entropy_mean"] == pytest.approx(np.mean([diag["entropy"][op] for op in mixing]))
    assert summary["saturated_ops"] == sum(diag["max_weight"][op] >= SATURATED_WEIGHT for op in mixing)
    assert summary["low_entropy_ops"] == sum(diag["entropy"][op] < LOW_ENTROPY for op in mixing)
    assert summary["query_norm_max"] == max(diag["query_norm"])


def test_saturation_summary_counts_one_hot_mixes():
    """Queries that put (nearly) all the weight on one source make an op saturated and low in entropy;
    zero queries (uniform mixes) make none; a standard residual has no summary."""
    n = 6
    res = make("block_attnres", n, block_size=2)
    stack, emb = toy_stack(n).double(), emb_input()
    res.record = True
    run(res, stack, emb)
    uniform = attnres_saturation(res.diagnostics())
    assert uniform["saturated_ops"] == 0 and uniform["low_entropy_ops"] == 0
    assert uniform["entropy_mean"] == pytest.approx(1.0) and uniform["query_norm_max"] == 0.0
    with torch.no_grad():  # op 3 sees [emb, b1, partial]: a query along the embedding's direction, scaled up
        res.queries[3].copy_(emb.mean((0, 1)) / emb.mean((0, 1)).norm() * 1e3)
    run(res, stack, emb)
    peaked = res.diagnostics()
    summary = attnres_saturation(peaked)
    assert peaked["max_weight"][3] > SATURATED_WEIGHT and peaked["entropy"][3] < LOW_ENTROPY
    assert summary["saturated_ops"] >= 1 and summary["low_entropy_ops"] >= 1
    res_std = make("standard", n)
    res_std.record = True
    run(res_std, stack, emb)
    assert attnres_saturation(res_std.diagnostics()) is None


def small_model(residual: str, dtype=torch.float32, **residual_keys):
    """A 2-layer K3Model (the K3 default's mixers and MoE) with this residual; parameters named as in any
    other residual's model (K3Model.init_weights seeds each by its name), so their values agree too."""
    from k3lab.config import ModelConfig
    from k3lab.model.k3 import K3Model

    cfg = ModelConfig(n_layers=2, d_model=64, head_dim=32, vocab_size=97, norm_eps=1e-30,
                      residual=ResidualConfig(name=residual, **residual_keys))
    return K3Model(cfg).to(dtype)


@pytest.mark.parametrize("optim", ["muon_per_head", "muon", "adamw"])
def test_attnres_params_get_their_own_adamw_group(optim):
    """Under every optim, residual.query_lr_scale and residual.query_weight_decay reach exactly the AttnRes
    parameters (every op's pseudo-query and key-norm gain), in an AdamW group of their own at
    adam_lr * lr_scale * query_lr_scale; every other parameter keeps the group, rate and decay it has in
    the standard residual's model."""
    from k3lab.config import OptimConfig
    from k3lab.optim.build import param_groups

    cfg = OptimConfig(name=optim, lr_scale=0.5)
    setting = lambda model: {name: (g["name"], g["lr"], g["weight_decay"], g["use_muon"])  # noqa: E731
                             for g in param_groups(model, cfg)
                             for name, p in model.named_parameters() if any(p is q for q in g["params"])}
    standard = setting(small_model("standard"))
    for name in ("block_attnres", "full_attnres"):
        model = small_model(name, query_lr_scale=0.3, query_weight_decay=0.05)
        got = setting(model)
        assert set(got) == set(dict(model.named_parameters()))  # every parameter in exactly one group
        attnres = {k for k in got if k.startswith("residual.")}
        assert len(attnres) == 2 * len(model.residual.queries)
        assert all(got[k] == ("attnres", cfg.adam_lr * 0.5 * 0.3, 0.05, False) for k in attnres)
        assert {k: v for k, v in got.items() if k not in attnres} == standard
        groups = param_groups(model, cfg)
        assert [g["name"] for g in groups if g["name"] == "attnres"] == ["attnres"]  # one group, only them
        assert {id(p) for g in groups if g["name"] == "attnres" for p in g["params"]} == \
            {id(p) for p in model.residual.parameters()}


@pytest.mark.parametrize("optim", ["muon_per_head", "adamw"])
def test_a_zero_query_rate_keeps_the_mixes_uniform(optim):
    """residual.query_lr_scale=0 freezes the AttnRes parameters exactly, weight decay included (AdamW at lr 0
    multiplies by 1 - 0 * wd = 1 and adds 0 * the update), through the warm-up and cosine schedule, while
    the other parameters train."""
    from k3lab.config import OptimConfig
    from k3lab.optim.build import build_optimizer

    torch.manual_seed(0)
    model = small_model("block_attnres", query_lr_scale=0.0, query_weight_decay=0.1)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt, sched = build_optimizer(model, OptimConfig(name=optim, warmup_steps=2), total_steps=5)
    assert [g["lr"] for g in opt.param_groups if g["name"] == "attnres"] == [0.0]
    for _ in range(5):
        tokens = torch.randint(0, 97, (2, 17))
        model(tokens[:, :-1], tokens[:, 1:]).mean.backward()
        assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in model.residual.queries[1:])
        opt.step()
        sched.step()
        opt.zero_grad()
    for k, p in model.named_parameters():
        if k.startswith("residual."):
            assert torch.equal(p, before[k]), k
    assert all(torch.count_nonzero(q) == 0 for q in model.residual.queries)
    assert not torch.equal(model.embed.weight, before["embed.weight"])


@pytest.mark.parametrize("name", ["block_attnres", "full_attnres"])
def test_zero_queries_give_the_standard_residuals_logits(name):
    """Zero pseudo-queries make every mix the mean of its sources, the standard residual's sum over the
    number of sources; every reader of the stream (each sublayer's PreNorm, the final norm) removes that
    scale, so the K3 model's logits are the standard residual's. float64 with the norms' eps at 1e-30, so
    that x and x / S normalise to the same values up to rounding: a few float64 ulps per sublayer; the
    logits come back in fp32 (K3Model.forward), so fp32 rounding bounds the comparison."""
    attnres, standard = small_model(name, torch.float64), small_model("standard", torch.float64)
    loaded = standard.load_state_dict(attnres.state_dict(), strict=False)
    assert not loaded.missing_keys and all(k.startswith("residual.") for k in loaded.unexpected_keys)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    want = standard(tokens)
    torch.testing.assert_close(attnres(tokens), want, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # learned queries: the logits move away from the standard residual's
        for q in attnres.residual.queries:
            q.normal_(0, 1, generator=torch.Generator().manual_seed(1))
    assert (attnres(tokens) - want).abs().max() > 1e-2


def test_query_keys_are_refused_where_they_do_nothing():
    """Under residual=standard (no pseudo-queries) query_lr_scale or query_weight_decay set on the command
    line fails with one ConfigError line naming the key, as does a negative value anywhere; under AttnRes
    both are read."""
    from k3lab.config import check_config
    from k3lab.errors import ConfigError
    from benchmarks.step import compose_config as compose

    def check(overrides):
        return check_config(compose(overrides), overrides)

    for key in ("query_lr_scale", "query_weight_decay"):
        with pytest.raises(ConfigError, match=rf"residual.{key}=0.5 acts with residual=block_attnres/full_attnres "
                                              rf"only: residual=standard does not read it; drop it"):
            check(["residual=standard", f"residual.{key}=0.5"])
        with pytest.raises(ConfigError, match=rf"residual.{key}=-1.0 must be >= 0"):
            check(["residual=full_attnres", f"residual.{key}=-1"])
    run = check(["residual=full_attnres", "residual.query_lr_scale=0", "residual.query_weight_decay=0.1"])
    assert (run.residual.query_lr_scale, run.residual.query_weight_decay) == (0, 0.1)


@pytest.mark.parametrize("name", ["block_attnres", "full_attnres"])
def test_k3model_with_attnres_trains(name):
    """The real model with AttnRes: init leaves the queries at zero (uniform mixes), a step is finite,
    and every pseudo-query of an op with 2+ sources receives a gradient."""
    from k3lab.config import ModelConfig
    from k3lab.model.k3 import K3Model

    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, d_model=64, head_dim=32, vocab_size=97,
                      residual=ResidualConfig(name=name, block_size=2))
    model = K3Model(cfg)
    assert isinstance(model.residual, AttnResidual)
    assert all(torch.count_nonzero(q) == 0 for q in model.residual.queries)
    tokens = torch.randint(0, 97, (2, 17))
    model.residual.record = True
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 97), tokens[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - math.log(97)) < 0.5
    diag = model.residual.diagnostics()
    assert len(diag["output_rms"]) == 4 and len(diag["depth_weights"]) == 5
    grads = [q.grad for q in model.residual.queries]
    assert grads[0] is None or torch.count_nonzero(grads[0]) == 0  # op 0 sees the embedding alone
    assert all(g is not None and g.abs().sum() > 0 for g in grads[1:])
