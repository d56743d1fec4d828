"""Muon / AdamW optimizers, the parameter split and the LR schedule (k3lab.optim)."""
import copy
import math
from pathlib import Path

import lightning as L

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omegaconf import OmegaConf

from k3lab.config import OptimConfig
from k3lab.model.tags import tag
from k3lab.optim import (Muon, build_optimizer, lightning_optimizers, lr_lambda, newton_schulz,
                         orthogonal_update, param_groups, split_params)
from k3lab.optim import muon as muon_module
from k3lab.switches import SWITCHES

RMS = 0.2  # Moonlight's target update RMS: the Muon update is 0.2*sqrt(max(rows, cols)) * NS(u)
# Between the batched Newton-Schulz of a bucket and newton_schulz on one of its matrices, the bf16 iterations
# may round apart (the bucket's Frobenius norms come from its first Gram matrix): up to about 0.005 on these
# updates of entries up to about 0.6, against a difference of about a third of the norm for a wrong grouping.
BF16_ROUNDING = 1e-2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: one thread is 10-30x faster than two on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- a toy model


class ToyLM(nn.Module):
    """Every kind of tensor the real model has: embedding, Q/K/V with head_blocks, a biased output
    projection, a 1-D norm gain, a depthwise conv, a 3-D expert stack and an LM head."""

    def __init__(self, vocab=32, d=32, heads=4, experts=3, tie=False):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, 4, groups=d, padding=3, bias=False)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            tag(proj, "weight", head_blocks=heads)
        self.o_proj = nn.Linear(d, d, bias=True)
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.experts = nn.Parameter(torch.randn(experts, d, d) / math.sqrt(d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        x = x + self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2)
        h = F.rms_norm(x, (x.shape[-1],), self.norm_weight)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o_proj(a)
        x = x + torch.einsum("btd,eod->bto", x, self.experts) / self.experts.shape[0]
        return self.lm_head(x)


def seeded_toy(**kw):
    torch.manual_seed(0)
    return ToyLM(**kw)


def toy_batch(seed=0, vocab=32, B=8, T=16):
    """Sequences where token t+1 = (3 * token t + 1) mod vocab: learnable from the previous token."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (B, 1), generator=g)
    seq = [start]
    for _ in range(T):
        seq.append((3 * seq[-1] + 1) % vocab)
    seq = torch.cat(seq, 1)
    return seq[:, :-1], seq[:, 1:]


def loss_of(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def one_step_delta(p0, grad, head_blocks=0, **group):
    """Parameter change after one optimizer step on a single parameter with the given grad."""
    p = nn.Parameter(p0.clone())
    opt = Muon([dict(params=[p], use_muon=True, head_blocks=[head_blocks], **group)])
    p.grad = grad.clone()
    opt.step()
    return (p.detach() - p0).clone()


# --------------------------------------------------------------------------- Newton-Schulz

@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (36, 100), (100, 36), (4, 16, 48), (3, 48, 16)])
def test_newton_schulz_singular_values_in_band(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    o = newton_schulz(g)
    assert o.shape == g.shape and o.dtype == torch.bfloat16
    s = torch.linalg.svdvals(o.float())
    assert s.min() > 0.65 and s.max() < 1.2, (s.min().item(), s.max().item())
    # same singular vectors as the exact polar factor U V^T
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = F.cosine_similarity(o.float().flatten(), (u @ vh).flatten(), dim=0)
    assert cos > 0.97


def test_newton_schulz_square_bulk_in_band():
    # square Gaussian matrices have near-zero singular values that 5 steps cannot lift; the bulk lands
    s = torch.linalg.svdvals(newton_schulz(torch.randn(96, 96)).float())
    inside = ((s > 0.65) & (s < 1.25)).float().mean()
    assert inside > 0.9 and s.max() < 1.25


def newton_schulz_formula(g, steps=5, eps=1e-7, dtype=torch.float32):
    """The iteration as first written, X <- aX + (bA + cA@A) @ X with A = X X^T, eight kernels a step."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)).to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (5, 24, 40), (5, 40, 24), (2, 3, 16, 20), (48, 48)])
def test_newton_schulz_baddbmm_equals_the_formula(shape):
    """Folding the sums into baddbmm and the Frobenius norms into the first Gram matrix changes only fp32
    rounding (bf16 rounds fewer intermediates now)."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    got = newton_schulz(g, dtype=torch.float32)
    assert got.shape == g.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, newton_schulz_formula(g), rtol=0, atol=5e-6)  # measured <= 1.2e-6


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_tall_batch_iterates_in_its_own_layout(steps):
    """A tall batch runs the iteration on its transpose written in its own layout (Gram x^T x, update
    x + x P): fp32 equals the wide batch's result transposed to rounding, comes out contiguous without a
    transposed copy, and in bf16 is as close to the fp64 result as the wide batch's."""
    g = torch.randn(3, 24, 72, generator=torch.Generator().manual_seed(4))
    tall = g.mT.contiguous()
    got = muon_module.newton_schulz_iterations(tall.clone(), steps)
    assert got.shape == tall.shape and got.is_contiguous()
    torch.testing.assert_close(got, muon_module.newton_schulz_iterations(g.clone(), steps).mT, rtol=0, atol=2e-6)
    exact = newton_schulz(g.double(), steps, dtype=torch.float64)
    wide_err = (newton_schulz(g, steps).double() - exact).norm()
    tall_err = (newton_schulz(tall, steps).double() - exact.mT).norm()
    assert tall_err < 1.1 * wide_err, (tall_err.item(), wide_err.item())


@pytest.mark.parametrize("scale", [1e-3, 1e4])
def test_newton_schulz_normalises_each_matrix_of_a_batch(scale):
    """The norms taken from the first Gram matrix normalise every matrix on its own: one matrix of a batch
    scaled by 1e-3 or 1e4 (norms far above the eps of 1e-7) gives the same result as unscaled, the others
    unchanged; 0 iterations return the normalised batch itself."""
    g = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(3))
    scaled = g.clone()
    scaled[1] *= scale
    torch.testing.assert_close(newton_schulz(scaled, dtype=torch.float32), newton_schulz(g, dtype=torch.float32),
                               rtol=0, atol=1e-5)
    unit = g / torch.linalg.matrix_norm(g, keepdim=True)
    torch.testing.assert_close(newton_schulz(scaled, steps=0, dtype=torch.float32), unit, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the Muon update

@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (64, 64)])
def test_update_scale_rule_and_rms(shape):
    g = torch.randn(*shape)
    delta = one_step_delta(torch.zeros(shape), g, lr=1.0, weight_decay=0.0, momentum=0.95, nesterov=True)
    expected = -RMS * math.sqrt(max(shape)) * newton_schulz(g.add(g, alpha=0.95)).float()
    torch.testing.assert_close(delta, expected, rtol=0, atol=1e-6)
    rms = delta.pow(2).mean().sqrt()
    assert 0.14 < rms < 0.22, rms  # about 0.2 whatever the shape: AdamW-like update RMS (Moonlight)


def test_nesterov_and_heavy_ball_directions():
    torch.manual_seed(0)
    g1, g2 = torch.randn(16, 24), torch.randn(16, 24)
    for nesterov in (True, False):
        p = nn.Parameter(torch.zeros(16, 24))
        opt = Muon([dict(params=[p], use_muon=True, lr=1.0, weight_decay=0.0, momentum=0.9, nesterov=nesterov)])
        p.grad = g1.clone()
        opt.step()
        before = p.detach().clone()
        p.grad = g2.clone()
        opt.step()
        m = 0.9 * g1 + g2
        u = g2 + 0.9 * m if nesterov else m
        torch.testing.assert_close(p.detach() - before, -orthogonal_update(u, None, 5), rtol=0, atol=1e-6)


def test_decoupled_weight_decay():
    p0 = torch.randn(8, 12)
    delta = one_step_delta(p0, torch.zeros(8, 12), lr=0.5, weight_decay=0.1)
    torch.testing.assert_close(delta, -0.05 * p0)


def test_per_head_equals_blockwise_ns_and_differs_from_whole():
    H, dh, D = 4, 16, 32  # block [16, 32] -> scale sqrt(32); whole [64, 32] -> scale sqrt(64)
    w = torch.zeros(H * dh, D)
    g = torch.randn(H * dh, D, generator=torch.Generator().manual_seed(5))
    per_head = one_step_delta(w, g, head_blocks=H, lr=1.0, weight_decay=0.0, momentum=0.0, per_head=True)
    blocks = [-RMS * math.sqrt(max(dh, D)) * newton_schulz(b).float() for b in g.split(dh, dim=0)]
    torch.testing.assert_close(per_head, torch.cat(blocks), rtol=0, atol=BF16_ROUNDING)
    whole = -RMS * math.sqrt(H * dh) * newton_schulz(g).float()
    assert (per_head - whole).norm() > 0.3 * whole.norm()


def test_muon_ignores_head_blocks():
    w = torch.zeros(64, 32)
    g = torch.randn(64, 32)
    delta = one_step_delta(w, g, head_blocks=4, lr=1.0, weight_decay=0.0, momentum=0.0, per_head=False)
    torch.testing.assert_close(delta, -RMS * math.sqrt(64) * newton_schulz(g).float(), rtol=0, atol=1e-6)


def test_expert_stack_is_orthogonalised_per_slice():
    E, out, inp = 3, 16, 40
    g = torch.randn(E, out, inp, generator=torch.Generator().manual_seed(4))
    delta = one_step_delta(torch.zeros(E, out, inp), g, lr=1.0, weight_decay=0.0, momentum=0.0)
    for e in range(E):
        expected = -RMS * math.sqrt(max(out, inp)) * newton_schulz(g[e]).float()
        torch.testing.assert_close(delta[e], expected, rtol=0, atol=BF16_ROUNDING)
    whole = -RMS * math.sqrt(E * out) * newton_schulz(g.reshape(E * out, inp)).float().reshape(E, out, inp)
    assert (delta - whole).norm() > 0.3 * whole.norm()


def test_bad_inputs_fail_loudly():
    with pytest.raises(ValueError, match="2-D or 3-D"):
        Muon([dict(params=[nn.Parameter(torch.ones(4))], use_muon=True)])
    with pytest.raises(ValueError, match="use_muon"):
        Muon([dict(params=[nn.Parameter(torch.ones(4, 4))])])
    w = torch.zeros(10, 8)
    with pytest.raises(ValueError, match="does not divide"):
        one_step_delta(w, torch.randn(10, 8), head_blocks=3, per_head=True)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def matrix_batch(shape, spectrum="gaussian", seed=0):
    """A float64 batch [n, rows, cols]: Gaussian, or with singular values spread from 1 to 1e-6 (log-spaced,
    the ill-conditioned case where a drifting Gram iteration shows)."""
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    if spectrum == "gaussian":
        return x
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ torch.diag_embed(torch.logspace(0, -6, s.shape[-1], dtype=torch.float64).expand_as(s)) @ vh


@pytest.mark.parametrize("shape", [(3, 16, 56), (3, 56, 16), (2, 24, 160)])
def test_gram_newton_schulz_is_the_standard_polynomial(shape):
    """In float64 the Gram form gives the standard iteration's result at 1-8 steps (restarts included), up to
    the fp32 rounding of the first scale 1/||x||^2, which the Gram form carries in R (relative 1e-6)."""
    x = matrix_batch(shape)
    for steps in range(1, 9):
        got = muon_module.polar_product(*muon_module.gram_newton_schulz(x.clone(), steps))
        assert rel_error(got, muon_module.newton_schulz_iterations(x.clone(), steps)) < 1e-6, steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("shape", [(8, 64, 352), (8, 352, 64), (4, 256, 1408)])  # (4, 256, 1408): a K3 expert
@pytest.mark.parametrize("spectrum", ["gaussian", "ill_conditioned"])
def test_gram_newton_schulz_in_bf16_is_as_accurate_as_the_standard(shape, spectrum, device, monkeypatch):
    """bf16, 5 steps, against the float64 result. On Gaussian inputs the Gram form's rounding error is 0.97-1.15x
    the standard's on the CPU over three seeds (asserted: within 1.25x) and 1.16-1.55x on the H200 (within
    1.6x), where the standard's own error is half the CPU's (0.014-0.017 against 0.022-0.038: its bf16 GEMMs
    round once from fp32 accumulators); on the ill-conditioned ones the Gram form's is lower on both
    (0.82-0.86x). Without its restarts the product of five bf16 polynomials drifts from the x it stands for:
    there the error is 20 to 3,000 times the standard's (asserted: over 10x)."""
    x = matrix_batch(shape, spectrum)
    want = muon_module.newton_schulz_iterations(x.clone(), 5)
    x = x.to(device)
    standard = rel_error(muon_module.newton_schulz_iterations(x.bfloat16(), 5).cpu(), want)
    gram = rel_error(muon_module.polar_product(*muon_module.gram_newton_schulz(x.bfloat16(), 5)).cpu(), want)
    gaussian_limit = 1.6 if device == "cuda" else 1.25
    assert gram < (gaussian_limit if spectrum == "gaussian" else 1.0) * standard
    if spectrum == "ill_conditioned":
        monkeypatch.setattr(muon_module, "GRAM_RESTART_EVERY", 10)
        drifted = muon_module.polar_product(*muon_module.gram_newton_schulz(x.bfloat16(), 5))
        assert rel_error(drifted.cpu(), want) > 10 * standard


def test_gram_method_runs_on_long_matrices_only():
    """ns_method="gram" takes batches at least GRAM_MIN_ASPECT times longer than wide and leaves the others to the
    standard iteration, bit for bit; an unknown method is refused with the valid ones."""
    long, square = matrix_batch((2, 16, 32)).float(), matrix_batch((2, 24, 40)).float()
    iterate = muon_module.newton_schulz_iterations
    assert torch.equal(iterate(square, 5, method="gram"), iterate(square, 5))
    gram = muon_module.polar_product(*muon_module.gram_newton_schulz(long, 5))
    assert torch.equal(iterate(long, 5, method="gram"), gram)
    assert not torch.equal(iterate(long, 5, method="gram"), iterate(long, 5))
    with pytest.raises(ValueError, match="valid options: standard, gram"):
        iterate(long, 5, method="polar")
    with pytest.raises(ValueError, match="ns_method='polar'"):
        Muon([dict(params=[nn.Parameter(torch.ones(4, 4))], use_muon=True, ns_method="polar")])


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(6, 5))
    b = nn.Parameter(a.detach().clone())
    ours = Muon([dict(params=[a], use_muon=False, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)])
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(5):
        g = torch.randn(6, 5)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def mixed_muon_params(seed=0):
    """Wide and tall 2-D weights, 3-D expert stacks, head-blocked projections: some share a bucket
    ([16, 48]: a 2-D weight, 2 experts, 2 heads of a [32, 48] projection), some are alone."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [((16, 48), 0), ((48, 16), 0), ((2, 16, 48), 0), ((32, 48), 2), ((3, 24, 10), 0), ((24, 10), 0),
              ((64, 16), 4), ((16, 48), 0), ((40, 24), 0)]
    return [(nn.Parameter(torch.randn(*shape, generator=gen)), heads) for shape, heads in shapes]


def reference_muon_step(params, heads, bufs, lr, wd, beta, nesterov, ns_dtype=torch.float32, ns_method="standard"):
    """The per-parameter loop: momentum (g + beta m, rounded once), Nesterov, `orthogonal_update`, decay, update,
    one tensor at a time."""
    with torch.no_grad():
        for p, h, m in zip(params, heads, bufs):
            g = p.grad
            m.copy_(g.add(m, alpha=beta))
            u = g.add(m, alpha=beta) if nesterov else m
            update = orthogonal_update(u, h, 5, ns_dtype, ns_method)
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("bucket_numel", [muon_module.BUCKET_NUMEL, 2000])  # 2000: buckets split
@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("ns_method", ["standard", "gram"])  # gram: the long shapes; [16, 16] heads and [40, 24] not
def test_batched_step_equals_the_per_parameter_loop(nesterov, bucket_numel, ns_dtype, ns_method, monkeypatch):
    """fp32 parameters; with bf16 Newton-Schulz the directions are rounded to bf16 in the batch as the loop's
    own stack rounds them, and the update scale rides in the add: the loop's result up to fp32 rounding. The
    Gram form in bf16 is the exception: the CPU's bf16 bmm rounds an entry of its small products differently in
    a bucket of six matrices than alone (one bf16 ulp of NS(u), seen in a [16, 48] weight), so there the bound
    is that ulp times the step, lr * 0.2 * sqrt(48) * 2^-8 ~ 3e-4. Otherwise the batched and the per-matrix
    products sum in different orders: each of the ns_steps iterations' products over an inner dimension of at
    most 48 is exact to about 48 fp32 ulps of its O(1) entries, so the update differs by at most
    ns_steps * 48 * eps32 times its scale lr * 0.2 * sqrt(48), per step, over 3 steps (about 6e-6)."""
    monkeypatch.setattr(muon_module, "BUCKET_NUMEL", bucket_numel)
    pairs = mixed_muon_params()
    params, heads = [p for p, _ in pairs], [h for _, h in pairs]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    opt = Muon([dict(params=params, use_muon=True, head_blocks=heads, per_head=True, ns_dtype=ns_dtype, lr=0.05,
                     weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_method=ns_method)])
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p, q in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        reference_muon_step(ref, heads, bufs, 0.05, 0.1, 0.9, nesterov, muon_module.NS_DTYPES[ns_dtype], ns_method)
    fp32_bound = 3 * 0.05 * 0.2 * math.sqrt(48) * 5 * 48 * torch.finfo(torch.float32).eps
    atol = 5e-4 if (ns_method, ns_dtype) == ("gram", "bf16") else fp32_bound
    for p, q, m in zip(params, ref, bufs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=atol)
        assert set(opt.state[p]) == {"momentum_buffer"}  # no state beyond the momentum
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], m, rtol=0, atol=0)


@pytest.mark.parametrize("param_dtype,ns_dtype", [(torch.float32, "bf16"), (torch.bfloat16, "bf16"),
                                                    (torch.bfloat16, "fp32")])
@pytest.mark.parametrize("nesterov", [True, False])
def test_bucket_directions_update_the_momentum_and_stack_the_directions(param_dtype, ns_dtype, nesterov):
    """Each bucket's parameters' momentum becomes g + beta m, rounded once to the parameter dtype, and the
    bucket's batch holds their directions, g + beta m (Nesterov) or m, computed in the parameter dtype and
    rounded once to the Newton-Schulz dtype: bitwise what the separate torch ops and a stack give."""
    pairs = mixed_muon_params()
    params = [nn.Parameter(p.detach().to(param_dtype)) for p, _ in pairs]
    heads = [h for _, h in pairs]
    opt = Muon([dict(params=params, use_muon=True, head_blocks=heads, per_head=True, ns_dtype=ns_dtype,
                     momentum=0.9, nesterov=nesterov)])
    group = opt.param_groups[0]
    gen = torch.Generator().manual_seed(5)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(param_dtype)
        opt.state[p]["momentum_buffer"] = torch.randn(p.shape, generator=gen).to(param_dtype)
    ms = [p.grad.add(opt.state[p]["momentum_buffer"], alpha=0.9) for p in params]
    us = [p.grad.add(m, alpha=0.9) if nesterov else m for p, m in zip(params, ms)]
    for bucket in muon_module.buckets(params, heads):
        got = opt.bucket_directions(group, params, bucket)
        want = muon_module.stack([muon_module.as_matrices(us[i], heads[i]) for i, _ in bucket],
                                 muon_module.NS_DTYPES[ns_dtype])
        assert got.dtype == want.dtype and torch.equal(got, want)
    for p, m in zip(params, ms):
        assert torch.equal(opt.state[p]["momentum_buffer"], m)


@pytest.mark.parametrize("ns_method", ["standard", "gram"])
def test_weights_in_the_newton_schulz_dtype_take_the_update_in_one_rounding(ns_method):
    """bf16 weights with bf16 Newton-Schulz: the last product goes into the weights in place, the decay and
    the step in one GEMM. The step equals its parts composed by hand (each bucket's directions, Newton-Schulz
    up to its last product) with (1 - lr wd) p - lr scale q y taken in float64 and rounded once to bf16: to
    one bf16 ulp, and exactly in almost every element (the GEMM's fp32 sums round rarely differently)."""
    pairs = mixed_muon_params()
    heads = [h for _, h in pairs]
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=gen).bfloat16() for p, _ in pairs]
    stepped, by_hand = ([nn.Parameter(p.detach().bfloat16()) for p, _ in pairs] for _ in range(2))
    opts = [Muon([dict(params=params, use_muon=True, head_blocks=heads, per_head=True, ns_dtype="bf16", lr=0.2,
                       weight_decay=0.1, momentum=0.9, ns_method=ns_method)]) for params in (stepped, by_hand)]
    for params in (stepped, by_hand):
        for p, g in zip(params, grads):
            p.grad = g.clone()
    opts[0].step()
    group, want = opts[1].param_groups[0], {}
    for p in by_hand:
        opts[1].state[p]["momentum_buffer"] = torch.zeros_like(p)
    for bucket in muon_module.buckets(by_hand, heads):
        q, y = muon_module.newton_schulz_factors(opts[1].bucket_directions(group, by_hand, bucket), 5, method=ns_method)
        exact = muon_module.polar_product(q.double(), y.double()).split([m.size(0) for _, m in bucket])
        for (i, mats), o in zip(bucket, exact):
            step = 0.2 * muon_module.update_scale(y)
            want[i] = ((1 - 0.2 * 0.1) * mats.double() - step * o).to(torch.bfloat16).view(by_hand[i].shape)
    for i, p in enumerate(stepped):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.detach().float(), want[i].float(), rtol=2 ** -7, atol=0)
        assert (p.detach() == want[i]).float().mean() > 0.97
        assert (p.detach().float() - by_hand[i].detach().float()).abs().mean() > 5 * 2 ** -8  # the step moved p


def test_one_newton_schulz_per_bucket(monkeypatch):
    """The step batches across parameters: one Newton-Schulz per (rows, cols) of matrix, whatever the
    parameters they come from; a parameter without a gradient is left out, as by the loop."""
    calls = []
    factors = muon_module.newton_schulz_factors

    def counted(x, *args, **kw):
        calls.append(tuple(x.shape))
        return factors(x, *args, **kw)

    monkeypatch.setattr(muon_module, "newton_schulz_factors", counted)
    pairs = mixed_muon_params()
    params = [p for p, _ in pairs]
    opt = Muon([dict(params=params, use_muon=True, head_blocks=[h for _, h in pairs], per_head=True)])
    for p in params:
        p.grad = torch.randn_like(p)
    params[-1].grad = None  # skipped, as in the loop
    opt.step()
    assert sorted(calls) == sorted([(6, 16, 48), (1, 48, 16), (4, 24, 10), (4, 16, 16)])
    assert params[-1] not in opt.state


def test_toy_model_step_equals_the_per_parameter_loop():
    """The real grouping (param_groups, head_blocks tags) on the toy model, Muon and AdamW groups, fp32 NS:
    equal to the per-parameter Muon loop beside torch.optim.AdamW."""
    model, ref = seeded_toy(), seeded_toy()
    cfg = OptimConfig(ns_dtype="fp32")
    opt = Muon(param_groups(model, cfg))
    muon = next(g for g in opt.param_groups if g["use_muon"])
    assert sum(h > 0 for h in muon["head_blocks"]) == 3 and any(p.ndim == 3 for p in muon["params"])
    ref_groups = param_groups(ref, cfg)
    ref_muon = next(g for g in ref_groups if g["use_muon"])
    bufs = [torch.zeros_like(p) for p in ref_muon["params"]]
    ref_adam = torch.optim.AdamW([dict(params=g["params"], lr=g["lr"], weight_decay=g["weight_decay"])
                                  for g in ref_groups if not g["use_muon"]], betas=cfg.betas, eps=cfg.eps)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, toy_batch(seed=step)).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        opt.step()
        ref_adam.step()
        reference_muon_step(ref_muon["params"], ref_muon["head_blocks"], bufs, muon["lr"], muon["weight_decay"],
                            muon["momentum"], muon["nesterov"])
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)


def test_adamw_groups_match_torch_adamw_over_groups_and_steps():
    """Several tensors in two groups (one without decay), a gradient missing at one step: equal to
    torch.optim.AdamW, parameters and state (step, exp_avg, exp_avg_sq)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (7,), (3, 4, 2), (1,)]
    ours_p = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref_p = [nn.Parameter(p.detach().clone()) for p in ours_p]
    groups = lambda ps: [dict(params=ps[:2], weight_decay=0.1), dict(params=ps[2:], weight_decay=0.0)]  # noqa: E731
    ours = Muon([dict(g, use_muon=False, lr=1e-2, betas=(0.9, 0.95), eps=1e-8) for g in groups(ours_p)])
    ref = torch.optim.AdamW(groups(ref_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(6):
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            g = None if (step == 2 and i == 1) else torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g, None if g is None else g.clone()
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[a][key], ref.state[b][key], rtol=1e-6, atol=1e-7)
    assert ours.state[ours_p[1]]["step"] == 5 and ours.state[ours_p[0]]["step"] == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's fused AdamW)")
def test_cuda_adamw_is_torch_fused_and_resumes_from_a_cpu_step():
    """Plain CUDA tensors take torch's fused AdamW (step on the device); a state dict whose step tensors
    lie on the CPU (written before the fused path) resumes the same run."""
    gen = torch.Generator().manual_seed(0)
    p0 = [torch.randn(s, generator=gen) for s in [(64, 32), (32,)]]
    grads = [[torch.randn(p.shape, generator=gen).cuda() for p in p0] for _ in range(5)]

    def make(ps):
        return Muon([dict(params=ps, use_muon=False, lr=1e-2, weight_decay=0.1)])

    ours_p, ref_p = [nn.Parameter(p.cuda()) for p in p0], [nn.Parameter(p.cuda()) for p in p0]
    ours, ref = make(ours_p), torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    for gs in grads[:3]:
        for a, b, g in zip(ours_p, ref_p, gs):
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert all(ours.state[p]["step"].is_cuda for p in ours_p)
    saved = copy.deepcopy(ours.state_dict())
    for st in saved["state"].values():
        st["step"] = st["step"].cpu()
    resumed_p = [nn.Parameter(p.detach().clone()) for p in ours_p]
    resumed = make(resumed_p)
    resumed.load_state_dict(saved)
    for gs in grads[3:]:
        for a, b, c, g in zip(ours_p, ref_p, resumed_p, gs):
            a.grad, b.grad, c.grad = g.clone(), g.clone(), g.clone()
        ours.step()
        ref.step()
        resumed.step()
    for a, b, c in zip(ours_p, ref_p, resumed_p):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batched_step_equals_the_per_parameter_loop():
    pairs = mixed_muon_params()
    params = [nn.Parameter(p.detach().cuda()) for p, _ in pairs]
    heads = [h for _, h in pairs]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    opt = Muon([dict(params=params, use_muon=True, head_blocks=heads, per_head=True, ns_dtype="fp32", lr=0.05,
                     weight_decay=0.1, momentum=0.9)])
    for _ in range(2):
        for p, q in zip(params, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        reference_muon_step(ref, heads, bufs, 0.05, 0.1, 0.9, True)
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- the parameter split

def test_split_params_rule():
    model = ToyLM()
    muon, adamw = split_params(model)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    expect_muon = {model.q_proj.weight, model.k_proj.weight, model.v_proj.weight, model.o_proj.weight,
                   model.experts}
    expect_adamw = {model.embed.weight, model.lm_head.weight, model.norm_weight, model.o_proj.bias,
                    model.conv.weight}
    assert ids(muon) == ids(expect_muon)
    assert ids(adamw) == ids(expect_adamw)
    assert len(muon) + len(adamw) == len(list(model.parameters()))
    assert ids(muon) | ids(adamw) == ids(model.parameters()) and not ids(muon) & ids(adamw)


def test_split_params_tied_and_wrapped():
    model = ToyLM(tie=True)
    muon, adamw = split_params(model)
    assert sum(p is model.embed.weight for p in adamw) == 1  # tied table listed once
    assert len(muon) + len(adamw) == len(list(model.parameters()))

    class Wrapper(nn.Module):  # e.g. a LightningModule holding the model
        def __init__(self, m):
            super().__init__()
            self.model = m

    wm, wa = split_params(Wrapper(model))
    assert [id(p) for p in wm] == [id(p) for p in muon] and [id(p) for p in wa] == [id(p) for p in adamw]


def test_param_groups_per_option():
    model = ToyLM()
    cfg = OptimConfig()
    n_params = len(list(model.parameters()))
    by_name = lambda name: {g["name"]: g for g in param_groups(model, OptimConfig(name=name))}  # noqa: E731

    g = by_name("muon_per_head")
    assert g["muon"]["per_head"] is True and g["muon"]["lr"] == cfg.lr
    assert g["adamw"]["lr"] == cfg.adam_lr and g["adamw_no_decay"]["weight_decay"] == 0.0
    assert sum(len(x["params"]) for x in g.values()) == n_params
    assert by_name("muon")["muon"]["per_head"] is False

    g = by_name("adamw")
    assert "muon" not in g and all(not x["use_muon"] for x in g.values())
    assert all(x["lr"] == cfg.adam_lr for x in g.values())
    assert sum(len(x["params"]) for x in g.values()) == n_params
    with pytest.raises(ValueError, match="valid options"):
        param_groups(model, OptimConfig(name="sgd"))


def test_lr_scale_multiplies_both_rates_and_changes_nothing_else():
    """optim.lr_scale=s gives the groups of lr=s*lr, adam_lr=s*adam_lr exactly, for every option; a
    non-positive scale is refused with one line naming the key."""
    from k3lab.config import check_config
    from k3lab.errors import ConfigError
    from benchmarks.step import compose_config as compose

    model = ToyLM()
    for name in ("muon_per_head", "muon", "adamw"):
        scaled = param_groups(model, OptimConfig(name=name, lr_scale=2.5))
        direct = param_groups(model, OptimConfig(name=name, lr=2.5 * OptimConfig.lr, adam_lr=2.5 * OptimConfig.adam_lr))
        assert len(scaled) == len(direct)
        for a, b in zip(scaled, direct):
            assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
            assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
    with pytest.raises(ConfigError, match=r"optim.lr_scale=0.0 must be > 0"):
        check_config(compose(["optim.lr_scale=0"]))


# --------------------------------------------------------------------------- schedule

def test_lr_schedule_warmup_peak_cosine_end():
    cfg = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    opt, sched = build_optimizer(ToyLM(), cfg, total_steps=110)
    lrs = {g["name"]: [] for g in opt.param_groups}
    for _ in range(115):
        for g in opt.param_groups:
            lrs[g["name"]].append(g["lr"])
        opt.step()
        sched.step()
    for name, peak in (("muon", cfg.lr), ("adamw", cfg.adam_lr)):
        lr = lrs[name]
        assert lr[0] == pytest.approx(peak / 10)
        assert lr[9] == pytest.approx(peak) and lr[10] == pytest.approx(peak)
        assert max(lr) == pytest.approx(peak)
        assert lr[60] == pytest.approx(peak * 0.55)  # cosine half-way: (1 + 0.1) / 2
        assert lr[110] == pytest.approx(peak * 0.1) and lr[114] == pytest.approx(peak * 0.1)
        assert all(a >= b for a, b in zip(lr[10:], lr[11:]))


def test_short_run_shortens_warmup():
    f = lr_lambda(warmup_steps=50, total_steps=10, min_lr_ratio=0.1)  # a debug run
    assert f(0) == pytest.approx(0.2) and f(4) == pytest.approx(1.0) and f(10) == pytest.approx(0.1)
    assert lr_lambda(0, 1, 0.1)(0) == pytest.approx(1.0)


def test_lightning_config_shape():
    conf = lightning_optimizers(ToyLM(), OptimConfig(), total_steps=100)
    assert isinstance(conf["optimizer"], Muon)
    assert conf["lr_scheduler"]["interval"] == "step"
    assert conf["lr_scheduler"]["scheduler"].optimizer is conf["optimizer"]


def test_yaml_options_load_and_build():
    conf_dir = Path(__file__).resolve().parents[1] / "conf" / "optim"
    assert {f.stem for f in conf_dir.glob("*.yaml")} == set(SWITCHES["optim"].options)
    for name in SWITCHES["optim"].options:
        node = OmegaConf.merge(OmegaConf.structured(OptimConfig), OmegaConf.load(conf_dir / f"{name}.yaml"))
        cfg = OmegaConf.to_object(node)
        assert cfg.name == name
        opt, _ = build_optimizer(ToyLM(), cfg, total_steps=100)
        assert any(g["use_muon"] for g in opt.param_groups) == (name != "adamw")


class ToyLit(L.LightningModule):
    def __init__(self, total_steps):
        super().__init__()
        self.model, self.total_steps = seeded_toy(), total_steps

    def training_step(self, batch, _):
        return loss_of(self.model, batch)

    def configure_optimizers(self):
        return lightning_optimizers(self.model, OptimConfig(warmup_steps=2), total_steps=self.total_steps)


def test_lightning_automatic_optimisation_with_clipping(tmp_path):
    lit = ToyLit(total_steps=20)
    data = [toy_batch(seed=i) for i in range(4)]
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(lit, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    opt = trainer.optimizers[0]
    assert trainer.global_step == 4 and isinstance(opt, Muon)
    expected = OptimConfig().lr * lr_lambda(2, 20, OptimConfig().min_lr_ratio)(4)  # stepped once per step
    assert opt.param_groups[0]["name"] == "muon" and opt.param_groups[0]["lr"] == pytest.approx(expected)


# --------------------------------------------------------------------------- training, determinism, resume

@pytest.mark.parametrize("name", ["muon_per_head", "muon", "adamw"])
def test_toy_model_trains(name):
    model = seeded_toy()
    opt, sched = build_optimizer(model, OptimConfig(name=name, warmup_steps=3), total_steps=25)
    batch = toy_batch()
    first = loss_of(model, batch).item()
    for step in range(25):
        opt.zero_grad()
        loss = loss_of(model, toy_batch(seed=step))
        loss.backward()
        opt.step()
        sched.step()
    last = loss_of(model, batch).item()
    assert last < 0.55 * first, (first, last)  # about 0.4 with each option; 1.0 if nothing moved


def twin_toys(device: str = "cpu"):
    """Two identical toy models on `device` and their optimizers: (a, b, a's optimizer, b's)."""
    a, b = seeded_toy().to(device), seeded_toy().to(device)
    return (a, b, *(build_optimizer(m, OptimConfig(warmup_steps=2), total_steps=10)[0] for m in (a, b)))


def same_gradients(a, b, step: int) -> None:
    """a's gradients on toy batch `step`, and a copy of them in b."""
    loss_of(a, [t.to(next(a.parameters()).device) for t in toy_batch(seed=step)]).backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        pb.grad = pa.grad.clone()


def test_same_grads_give_bitwise_same_update():
    """What DDP relies on: ranks holding equal params, state and (averaged) grads stay equal."""
    a, b, opt_a, opt_b = twin_toys()
    for step in range(4):
        same_gradients(a, b, step)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_scale_grads_moves_the_weights_as_clipping_the_gradients_first(device):
    """clip_grad_norm handing its factor to Muon.scale_grads moves the weights as clipping the gradients in
    place; the Muon gradients stay as they were, and the factor holds for one step only (the third step is
    not clipped: a factor left over would still scale it). CPU: bit for bit (the Muon groups' momentum in
    torch on g * s, AdamW's gradients multiplied at the step). CUDA: fused AdamW divides by 1 / s as it reads
    g, so its weights agree to fp32 rounding, within 1e-5 of how far each moved (an ignored factor moves them
    by a multiple of that); the momentum kernel keeps s g in fp32 (tests/test_momentum.py), where a rounding
    may flip a bf16 Newton-Schulz input: the Muon weights within 1e-2 of their movement."""
    from k3lab.lit import clip_grad_norm

    a, b, opt_a, opt_b = twin_toys(device)
    start = [p.detach().clone() for p in a.parameters()]
    in_muon = {id(p) for g in opt_a.param_groups if g["use_muon"] for p in g["params"]}
    for step in range(3):
        same_gradients(a, b, step)
        muon = [p for g in opt_a.param_groups if g["use_muon"] for p in g["params"]]
        muon_grads = [p.grad.clone() for p in muon]
        if step < 2:
            norm = clip_grad_norm(a.parameters(), 0.05, opt_a)
            assert torch.equal(norm, clip_grad_norm(b.parameters(), 0.05)) and norm > 0.05
            assert all(torch.equal(p.grad, g) for p, g in zip(muon, muon_grads))
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        for pa, pb, p0 in zip(a.parameters(), b.parameters(), start):
            if device == "cpu":
                assert torch.equal(pa, pb), step
            else:
                limit = 1e-2 if id(pa) in in_muon else 1e-5
                assert (pa - pb).abs().max() <= limit * (pb - p0).abs().max(), step


@pytest.mark.parametrize("name", ["muon_per_head", "adamw"])
def test_state_dict_resume_is_exact(name):
    def run(steps, model, opt, sched, start=0):
        for step in range(start, start + steps):
            opt.zero_grad()
            loss_of(model, toy_batch(seed=step)).backward()
            opt.step()
            sched.step()

    ref, resumed = seeded_toy(), copy.deepcopy(seeded_toy())  # tags live on modules: a deep copy keeps them
    cfg = OptimConfig(name=name, warmup_steps=3)
    opt, sched = build_optimizer(ref, cfg, total_steps=20)
    run(10, ref, opt, sched)
    saved = (copy.deepcopy(ref.state_dict()), copy.deepcopy(opt.state_dict()), sched.state_dict())
    run(5, ref, opt, sched, start=10)

    opt2, sched2 = build_optimizer(resumed, cfg, total_steps=20)
    resumed.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    run(5, resumed, opt2, sched2, start=10)
    for pa, pb in zip(ref.parameters(), resumed.parameters()):
        assert torch.equal(pa, pb)


def test_muon_bench_counts_the_newton_schulz_work_and_splits_heads_only_per_head():
    """benchmarks.muon_bench on the CPU's tiny model: Newton-Schulz FLOPs by the formula (a batch of 2 matrices
    4 x 8, 5 iterations: 2 x 5 x (4*16*8 + 2*64)), one table row per variant, and per-head Muon orthogonalising
    more (smaller) matrices than global Muon, with AdamW running none. The parts' table has each part of each
    variant, every timed part's median inside its interquartile range."""
    from benchmarks.muon_bench import PARTS, main, ns_flops

    assert ns_flops([(2, 4, 8, 5)]) == ns_flops([(2, 8, 4, 5)]) == 2 * 5 * (4 * 16 * 8 + 2 * 64)
    text = main(["trainer=cpu", "--warmup", "0", "--steps", "3",
                 "--variants", "optim=muon_per_head,optim=muon,optim=adamw"])
    _, parts, rates = (
        [[c.strip() for c in line.split("|")[1:-1]] for line in block.splitlines()[2:]] for block in text.split("\n\n"))
    assert [(r[0], r[1]) for r in parts] == [(v, part) for v in ("optim=muon_per_head", "optim=muon", "optim=adamw")
                                             for part in PARTS], text
    for variant, part, ms, iqr in parts:
        if part != "rest":
            q1, q3 = map(float, iqr.split("-"))
            assert q1 <= float(ms) <= q3, (variant, part, ms, iqr)
    matrices = {r[0]: int(r[-1].split(" in ")[0]) for r in rates}
    assert matrices["optim=muon_per_head"] > matrices["optim=muon"] > 0 == matrices["optim=adamw"], text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_muon_bench_gives_each_parts_device_time():
    """On a GPU every part has its device time beside its wall time, the step's above zero."""
    from benchmarks.muon_bench import PARTS, main

    text = main(["trainer=gpu", "--warmup", "1", "--steps", "2"])
    parts = {r[1]: r for r in ([c.strip() for c in line.split("|")[1:-1]] for line in text.split("\n\n")[1].splitlines()[2:])}
    assert list(parts) == list(PARTS) and float(parts["step"][4]) > 0, text
