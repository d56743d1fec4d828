"""Cross-entropy of a linear LM head, chunked over tokens so the logits [N, V] never exist at once.

    h [N, D] (final hidden states), weight [V, D] (the LM head), targets [N] (int64, ignore_index = no loss)
    -> TokenLoss(sum, correct, count)

Tokens are processed `chunk` at a time: a chunk's logits [chunk, V] are one matmul in the compute dtype
(the autocast dtype under autocast, else h's), the log-sum-exp and the loss are taken in fp32, and, when
gradients are needed, the chunk's softmax-minus-one-hot [chunk, V] is turned into its share of dL/dh and
dL/dW (fp32 accumulator; with 16-bit operands the GEMM adds its fp32 product into it, `addmm_fp32`) at once,
in the forward, before the next chunk is computed. The backward only
scales those two tensors by the incoming gradient. So the head's memory is one chunk's logits plus
dL/dh [N, D] and dL/dW [V, D], instead of fp32 logits and their gradient (8.6 GB at 32,768 tokens and a
32,768 vocabulary), and it costs the head's three matmuls (logits, dL/dh, dL/dW), none recomputed.
Without gradients (validation, torch.no_grad) the loop only computes the losses.

Why this and not a library: liger-kernel's fused linear cross-entropy and cut-cross-entropy launch their
own Triton kernels for CUDA tensors, so the CPU path (where the tests check the maths) would be a second
implementation; this one is plain PyTorch, runs the same on both, and under torch.compile its chunk loop
is traced like the rest of the model (Inductor fuses the elementwise work of each chunk on the GPU).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from k3lab.model.matmul import HALF_DTYPES, addmm_fp32

IGNORE_INDEX = -100
CHUNK_LOGITS = 2**26  # default chunk: at most this many logits (256 MB in fp32) per chunk


class TokenLoss(NamedTuple):
    """Summed cross-entropy over the counted targets (0-dim fp32, differentiable), the number of counted
    targets whose logit is the row's argmax (0-dim int64) and the number of counted targets, those !=
    ignore_index (0-dim int64). All on the input's device: reading them is the caller's choice of sync."""
    sum: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        """Mean cross-entropy over the counted targets (0 when there are none), 0-dim fp32."""
        return self.sum / self.count.clamp_min(1)


def default_chunk(vocab_size: int) -> int:
    """Tokens per chunk when none is given: CHUNK_LOGITS // vocab_size (2,048 at a 32,768 vocabulary)."""
    return max(1, CHUNK_LOGITS // vocab_size)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, chunk: int = 0) -> TokenLoss:
    """Cross-entropy of the logits h @ weight.T against targets, never holding more than `chunk` rows of them.

    h [N, D], weight [V, D], targets [N] (int64; `ignore_index` marks tokens without a loss); chunk: tokens
    per chunk, 0 = default_chunk(V). The matmuls run in the autocast dtype when autocast is on for h's
    device, else in h's dtype; the log-sum-exp, the loss and dL/dW's accumulator are fp32. Gradients flow
    to h and weight (in their own dtypes) when grad mode is on and either requires them.
    """
    if h.ndim != 2 or weight.ndim != 2 or targets.shape != h.shape[:1] or weight.shape[1] != h.shape[1]:
        raise ValueError(f"linear_cross_entropy: h [N, D], weight [V, D], targets [N]; got {tuple(h.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    chunk = chunk or default_chunk(weight.shape[0])
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return TokenLoss(*_LinearCrossEntropy.apply(h, weight, targets, ignore_index, chunk, dtype))
    with torch.no_grad():
        return TokenLoss(*_chunked(h, weight, targets, ignore_index, chunk, dtype, with_grad=False)[:3])


def _chunked(h, weight, targets, ignore_index, chunk, dtype, with_grad):
    """The chunk loop: (loss sum, correct, count) and, with_grad, dL_sum/dh [N, D] (h's dtype) and
    dL_sum/dW [V, D] (fp32), else None, None. Runs with autocast off: every dtype is explicit."""
    N = h.shape[0]
    with torch.autocast(h.device.type, enabled=False):
        x_all, w = h.to(dtype), weight.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros((), dtype=torch.int64, device=h.device)
        grad_h = torch.empty_like(h) if with_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if with_grad else None
        for start in range(0, N, chunk):
            x, t = x_all[start:start + chunk], targets[start:start + chunk]
            valid = t != ignore_index
            t_safe = torch.where(valid, t, 0)[:, None]                       # [c, 1]
            z = x @ w.T                                                       # [c, V] compute dtype
            zf = z.float()
            lse = zf.logsumexp(-1)                                            # [c] fp32
            nll = lse - zf.gather(1, t_safe).squeeze(1)
            loss = loss + torch.where(valid, nll, 0.0).sum()
            correct = correct + ((z.argmax(-1) == t) & valid).sum()
            if with_grad:
                # dL/dz = softmax - onehot, the softmax from the same log-sum-exp (no second max and sum)
                g = torch.exp(zf - lse[:, None])
                g.scatter_add_(1, t_safe, -valid[:, None].float())
                g = g.to(dtype)
                keep = valid[:, None].to(dtype)                               # rows without a target: no gradient
                grad_h[start:start + chunk] = ((g @ w) * keep).to(h.dtype)
                xk = x * keep
                grad_w = addmm_fp32(grad_w, g.T, xk) if dtype in HALF_DTYPES else grad_w + g.T @ xk
        count = (targets != ignore_index).sum()
    return loss, correct, count, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy with gradients: computed chunk by chunk in the forward, scaled in the backward."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk, dtype):
        loss, correct, count, grad_h, grad_w = _chunked(h, weight, targets, ignore_index, chunk, dtype, True)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(correct, count)
        return loss, correct, count

    @staticmethod
    def backward(ctx, grad_loss, grad_correct, grad_count):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None, None
