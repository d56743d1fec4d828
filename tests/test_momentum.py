"""Muon's fused momentum and direction (kernels/momentum.py) against its torch form.

CPU: the Triton kernel runs under TRITON_INTERPRET=1 in one fresh subprocess (this file run as a script) on
a ragged size (three blocks, the last one part full), every pair of parameter and direction dtypes the
optimizer writes, Nesterov and heavy ball, with and without a gradient scale; the tests assert on the
largest differences it reports from the torch form, in ulps (of the parameter dtype for m; for u of the
coarser of the two dtypes it is rounded to). The torch form and the argument checks run in-process.
CUDA (``pytest -m gpu``): the same comparison at an expert stack's size, and one Muon step of bf16 weights
with the kernel against the torch form.
"""
import json

import pytest
import torch

from interpreted import run_interpreted
from kernels.momentum import LAUNCH, momentum_direction

N = 2 * LAUNCH["BLOCK"] + 37  # three programs, the last holding 37 elements
# name: (parameter dtype, direction dtype, Nesterov)
CASES = {f"{p}_{u}_{'nesterov' if n else 'heavy_ball'}": (p, u, n)
         for p, u in [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                      ("bfloat16", "float32")] for n in (True, False)}
SCALE = 0.37  # the gradient's factor in the scaled cases (gradient clipping's, `scale=`)
LIMIT = 2  # ulps: the torch form may round g + beta*m as one fused multiply-add, and u follows m


def make_inputs(n, param_dtype, direction_dtype, device="cpu", seed=0):
    """g, m [n] (N(0, 1), in the parameter dtype) and an empty direction u [n]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    g = torch.randn(n, generator=gen, device=device).to(getattr(torch, param_dtype))
    m = torch.randn(n, generator=gen, device=device).to(getattr(torch, param_dtype))
    return g, m, torch.empty(n, dtype=getattr(torch, direction_dtype), device=device)


def differences(g, m, u, nesterov, beta=0.95, scale=None) -> dict:
    """Run both forms from the same (g, m) (and scale, a float or None): the largest |difference| of m and of u
    in ulps at each element's magnitude (at least 1), of m's dtype for m and of the coarser of m's and u's for
    u, and whether the kernel changed m at all."""
    s = None if scale is None else torch.tensor(scale, dtype=torch.float32, device=g.device)
    m_torch, u_torch = m.clone(), torch.empty_like(u)
    # the kernel keeps s g in fp32: its torch form is the unscaled one on that fp32 product
    momentum_direction(g if s is None else g.float() * s, m_torch, u_torch, beta, nesterov, backend="torch")
    m_kernel = m.clone()
    momentum_direction(g, m_kernel, u, beta, nesterov, backend="triton", scale=s)

    def ulps(a, b):
        eps = max(torch.finfo(m.dtype).eps, torch.finfo(a.dtype).eps)
        return ((a.double() - b.double()).abs() / (eps * b.double().abs().clamp(min=1))).max().item()

    return {"m": ulps(m_kernel, m_torch), "u": ulps(u, u_torch), "moved": not torch.equal(m_kernel, m)}


def _run_checks() -> dict:
    return {f"{name}{suffix}": differences(*make_inputs(N, p, u), nesterov, scale=scale)
            for name, (p, u, nesterov) in CASES.items() for suffix, scale in (("", None), ("_scaled", SCALE))}


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__)


@pytest.mark.parametrize("scaled", ["", "_scaled"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_torch_form(interpreted, case, scaled):
    got = interpreted[case + scaled]
    assert got["moved"] and got["m"] <= LIMIT and got["u"] <= LIMIT, got


def test_scale_multiplies_the_gradient_first():
    """scale s: the torch form is the unscaled one on g * s (what clipping's in-place multiply leaves in g)."""
    g, m, u = make_inputs(1000, "bfloat16", "bfloat16")
    m_scaled, u_scaled = m.clone(), torch.empty_like(u)
    momentum_direction(g, m_scaled, u_scaled, 0.9, True, backend="torch", scale=torch.tensor(SCALE))
    momentum_direction(g * torch.tensor(SCALE), m, u, 0.9, True, backend="torch")
    assert torch.equal(m_scaled, m) and torch.equal(u_scaled, u)


@pytest.mark.parametrize("nesterov", [True, False])
def test_torch_form_is_the_formula(nesterov):
    """fp32 m, bf16 u: m <- g + beta m rounded once to fp32; u <- g + beta m (or m) rounded to fp32, then to
    bf16 (against float64 arithmetic with beta as the fp32 number both forms use)."""
    g, m, u = make_inputs(1000, "float32", "bfloat16")
    beta = torch.tensor(0.9, dtype=torch.float32).double()
    m0 = m.clone()
    momentum_direction(g, m, u, 0.9, nesterov, backend="torch")
    assert torch.equal(m, (g.double() + beta * m0.double()).float())
    want_u = (g.double() + beta * m.double()).float() if nesterov else m
    assert torch.equal(u, want_u.bfloat16())


def test_bad_arguments_say_what_is_valid():
    g, m, u = make_inputs(10, "float32", "float32")
    with pytest.raises(ValueError, match="valid backends: auto, torch, triton, fla"):
        momentum_direction(g, m, u, 0.9, True, backend="cuda")
    with pytest.raises(ValueError, match="one size, got 10, 10, 9"):
        momentum_direction(g, m, u[:9], 0.9, True)
    strided = torch.zeros(20)[::2]
    with pytest.raises(ValueError, match="contiguous g, m and u"):
        momentum_direction(g, m, strided, 0.9, True, backend="triton")
    momentum_direction(g, m, strided, 0.9, True)  # auto: the torch form takes any layout
    assert torch.equal(strided, torch.add(g, m, alpha=0.9))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scale", [None, SCALE])
def test_cuda_kernel_equals_the_torch_form(case, scale):
    param_dtype, direction_dtype, nesterov = CASES[case]
    got = differences(*make_inputs(64 * 1408 * 256 + 5, param_dtype, direction_dtype, device="cuda"), nesterov,
                      scale=scale)
    assert got["moved"] and got["m"] <= LIMIT and got["u"] <= LIMIT, got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_muon_step_with_the_kernel_equals_the_torch_form(monkeypatch):
    """bf16 weights, bf16 Newton-Schulz (the fused update into the weights): the step with the kernel and with
    the torch form agree to a bf16 rounding of the weights."""
    import k3lab.optim.muon as muon_module
    from k3lab.optim import Muon

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(64, 1408, 256), (1024, 1024), (1024, 2816)]
    start = [torch.randn(s, generator=gen, device="cuda").bfloat16() for s in shapes]
    grads = [torch.randn(s, generator=gen, device="cuda").bfloat16() for s in shapes]
    results = []
    for backend in ("triton", "torch"):
        monkeypatch.setattr(muon_module, "momentum_direction",
                            lambda *a, backend_=backend, **kw: momentum_direction(*a, backend=backend_, **kw))
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = Muon([dict(params=params, use_muon=True, lr=0.02, weight_decay=0.1)])
        for _ in range(2):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        results.append(params)
    for a, b, p0 in zip(*results, start):
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-3)
        assert (a.float() - p0.float()).abs().max() > 1e-2  # the step moved the weights beyond that tolerance


if __name__ == "__main__":
    print(json.dumps(_run_checks()))
