"""RMSNorm (k3lab/model/norm.py): y = x / sqrt(mean(x^2) + eps) * weight, in x's dtype."""
import contextlib
import warnings

import torch
import torch.nn.functional as F

from k3lab.config import ModelConfig
from k3lab.model.k3 import K3Model
from k3lab.model.norm import RMSNorm

MISMATCH = "Mismatch dtype between input and weight"


@contextlib.contextmanager
def mismatch_warnings():
    """Collect the dtype-mismatch warnings of F.rms_norm's fallback (a warn-once warning in C++: made to warn
    every time here, so that an earlier test cannot hide it)."""
    caught, always = [], torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.set_warn_always(always)
    caught += [w for w in record if MISMATCH in str(w.message)]


def norm_and_input(D=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(D, generator=gen))
    return norm, 3 * torch.randn(4, 37, D, generator=gen)


def test_fp32_is_bitwise_rms_norm_with_the_fp32_weight():
    """fp32 output and gradients (input and weight) are exactly those of F.rms_norm with the weight as is."""
    norm, x = norm_and_input()
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    xa = x.clone().requires_grad_()
    ya = norm(xa)
    (ya * cot).sum().backward()
    w = norm.weight.detach().clone().requires_grad_()
    xb = x.clone().requires_grad_()
    yb = F.rms_norm(xb, (x.shape[-1],), w, 1e-6)
    (yb * cot).sum().backward()
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad) and torch.equal(norm.weight.grad, w.grad)


def test_bf16_autocast_runs_in_bf16_without_the_fallback():
    """Under bf16 autocast (x bf16 from a Linear, weight fp32) no dtype-mismatch fallback warning; the output
    is bf16 and within bf16 rounding of the float64 norm of the same input; the weight gradient stays fp32
    and within 1e-2 of the float64 one."""
    norm, x = norm_and_input()
    lin = torch.nn.Linear(x.shape[-1], x.shape[-1])
    with mismatch_warnings() as caught:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = lin(x)
            y = norm(h)
        y.float().square().sum().backward()
    assert not caught
    assert h.dtype == y.dtype == torch.bfloat16
    hd, wd = h.detach().double(), norm.weight.detach().double().requires_grad_()
    ref = hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + 1e-6) * wd
    ref.square().sum().backward()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 4e-3
    assert norm.weight.grad.dtype == torch.float32
    assert ((norm.weight.grad.double() - wd.grad).norm() / wd.grad.norm()).item() < 1e-2


def test_model_under_bf16_autocast_never_falls_back():
    """A forward+backward of the default tiny model (KDA, MLA, MoE with its latent norm, AttnRes) under CPU bf16
    autocast emits no dtype-mismatch warning from any of its norms."""
    torch.manual_seed(0)
    model = K3Model(ModelConfig(n_layers=4, d_model=64, head_dim=32, vocab_size=97))
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with mismatch_warnings() as caught:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        logits.square().mean().backward()
    assert not caught
