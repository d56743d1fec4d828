"""The chunked linear cross-entropy (k3lab.model.loss) against F.cross_entropy on the full fp32 logits:
the loss, the argmax count and the gradients of the hidden states and the head weight, with ignored
targets and chunk sizes that do not divide the token count; and that no tensor of the full logits'
size is ever formed."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from k3lab.config import ModelConfig
from k3lab.model.k3 import K3Model
from k3lab.model.loss import default_chunk, linear_cross_entropy

N, D, V = 37, 16, 29


def inputs(seed: int = 0, n: int = N, d: int = D, v: int = V):
    """h [n, d], weight [v, d] (both requiring grad), targets [n] with about a quarter set to -100."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen, requires_grad=True)
    w = (0.5 * torch.randn(v, d, generator=gen)).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen)
    t[torch.rand(n, generator=gen) < 0.25] = -100
    return h, w, t


def reference(h, w, t):
    """Summed loss, argmax hits, count and the gradients of the mean loss, from the full fp32 logits."""
    logits = h @ w.T
    loss = F.cross_entropy(logits, t, ignore_index=-100, reduction="sum")
    valid = t != -100
    count = valid.sum()
    h.grad = w.grad = None
    (loss / count).backward()
    correct = (logits.argmax(-1)[valid] == t[valid]).sum()
    return loss.detach(), correct, count, h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("chunk", [1, 5, 8, 36, N, 64, 0])
def test_loss_and_gradients_equal_full_logits(chunk):
    h, w, t = inputs()
    assert (t == -100).any() and (t != -100).any()
    want_loss, want_correct, want_count, want_gh, want_gw = reference(h, w, t)
    h.grad = w.grad = None
    out = linear_cross_entropy(h, w, t, chunk=chunk)
    out.mean.backward()
    torch.testing.assert_close(out.sum, want_loss, rtol=1e-5, atol=1e-5)
    assert int(out.correct) == int(want_correct) and int(out.count) == int(want_count)
    torch.testing.assert_close(h.grad, want_gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, want_gw, rtol=1e-5, atol=1e-6)
    assert h.grad[t == -100].abs().max() == 0  # ignored tokens get no gradient


def test_without_grad_gives_the_same_loss():
    h, w, t = inputs(1)
    want_loss, want_correct, want_count, _, _ = reference(h, w, t)
    with torch.no_grad():
        out = linear_cross_entropy(h, w, t, chunk=6)
    assert not out.sum.requires_grad
    torch.testing.assert_close(out.sum, want_loss, rtol=1e-5, atol=1e-5)
    assert (int(out.correct), int(out.count)) == (int(want_correct), int(want_count))


def test_every_target_ignored_gives_zero_loss_and_gradient():
    h, w, t = inputs(2)
    t[:] = -100
    out = linear_cross_entropy(h, w, t, chunk=10)
    out.mean.backward()
    assert out.sum.item() == 0 and out.count.item() == 0 and out.mean.item() == 0
    assert h.grad.abs().max() == 0 and w.grad.abs().max() == 0


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_never_forms_the_full_logits():
    """Forward and backward with 64 tokens in chunks of 8: no op output reaches the full logits' 64 x 50
    elements (the largest are the gradients of h [64, 16] and of the weight [50, 16]); the reference
    path, which forms them, trips the same recorder."""
    n, d, v, chunk = 64, 16, 50, 8
    h, w, t = inputs(3, n, d, v)
    with LargestTensor() as rec:
        linear_cross_entropy(h, w, t, chunk=chunk).mean.backward()
    assert rec.largest <= max(n * d, v * d, chunk * v) < n * v
    with LargestTensor() as rec:
        F.cross_entropy(h @ w.T, t).backward()
    assert rec.largest >= n * v


def test_autocast_runs_the_matmuls_in_bf16_and_keeps_fp32_gradients():
    """Under CPU bf16 autocast the loss stays within bf16 rounding of the fp32 one and the gradients reach
    the fp32 h and weight in fp32."""
    h, w, t = inputs(4, 96, 32, 40)
    want_loss, _, _, want_gh, want_gw = reference(h, w, t)
    h.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, t, chunk=24)
    out.mean.backward()
    assert out.sum.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(out.sum, want_loss, rtol=2e-2, atol=0)
    torch.testing.assert_close(h.grad, want_gh, rtol=0, atol=3e-2 * want_gh.abs().max().item())
    torch.testing.assert_close(w.grad, want_gw, rtol=0, atol=3e-2 * want_gw.abs().max().item())


def test_default_chunk_bounds_the_logits_of_a_chunk():
    assert default_chunk(32768) == 2048 and default_chunk(1024) == 65536 and default_chunk(2**27) == 1


@pytest.mark.parametrize("ce_chunk", [0, 13])
def test_model_loss_equals_cross_entropy_of_its_logits(ce_chunk):
    """K3Model(tokens, targets) gives F.cross_entropy of K3Model(tokens)'s logits and the same gradient for
    every parameter (fp32), the LM head's weight included; kernels.ce_chunk sets the chunk."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, d_model=64, head_dim=32, vocab_size=97)
    cfg.kernels.ce_chunk = ce_chunk
    model = K3Model(cfg)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (3, 20), generator=gen)
    targets = torch.randint(0, 97, (3, 20), generator=gen)
    targets[:, :4] = -100

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    want = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=-100)
    want.backward()
    want_grads = grads()
    got = model(tokens, targets)
    got.mean.backward()
    got_grads = grads()
    torch.testing.assert_close(got.mean, want, rtol=1e-5, atol=1e-6)
    assert int(got.count) == 3 * 16
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_bf16_within_rounding_of_full_logits_and_never_holds_them():
    """The GPU path as the model trains it: bf16 autocast, torch.compile (Inductor fuses each chunk's
    elementwise work), 8,192 tokens against a 32,768 vocabulary in chunks of 1,024. Loss and gradients
    stay within bf16 rounding of F.cross_entropy on the fp32 logits of the same inputs, and the peak memory
    of forward + backward stays below the size of the fp32 logits alone (1 GiB)."""
    n, d, v, chunk = 8192, 256, 32768, 1024
    gen = torch.Generator("cuda").manual_seed(0)
    h = torch.randn(n, d, device="cuda", generator=gen, requires_grad=True)
    w = (0.05 * torch.randn(v, d, device="cuda", generator=gen)).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    t[torch.rand(n, device="cuda", generator=gen) < 0.1] = -100

    @torch.compile(fullgraph=True)
    def loss_of(h, w, t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return linear_cross_entropy(h, w, t, chunk=chunk).mean

    loss_of(h, w, t).backward()  # compile first: its workspace stays out of the measured peak
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = loss_of(h, w, t)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < n * v * 4, peak / 2**20  # the unchunked path holds the fp32 logits alone, 1 GiB
    got_gh, got_gw = h.grad.clone(), w.grad.clone()

    # the reference: the inputs rounded as the bf16 matmuls see them, fp32 logits
    hb, wb = (x.detach().bfloat16().float().requires_grad_() for x in (h, w))
    ref = F.cross_entropy(hb @ wb.T, t, ignore_index=-100)
    ref_gh, ref_gw = torch.autograd.grad(ref, (hb, wb))
    assert got_gh.dtype == got_gw.dtype == torch.float32
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=2e-3, atol=0)
    torch.testing.assert_close(got_gh, ref_gh, rtol=0, atol=2e-2 * ref_gh.abs().max().item())
    torch.testing.assert_close(got_gw, ref_gw, rtol=0, atol=2e-2 * ref_gw.abs().max().item())
    assert got_gh[t == -100].abs().max() == 0
