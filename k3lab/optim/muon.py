"""Muon with an AdamW companion, in one torch.optim.Optimizer.

Muon (Jordan et al., github.com/KellerJordan/Muon; at scale: Moonlight, arXiv:2502.16982) for hidden
matrices, per param group with ``use_muon=True``:

    m <- beta*m + g                          (momentum buffer)
    u <- g + beta*m  (Nesterov)  or  m       (heavy ball)
    O <- NS5(u)                              (Newton-Schulz quintic, bf16 by default, see `newton_schulz`)
    p <- p*(1 - lr*wd) - lr * 0.2*sqrt(max(rows, cols)) * O

The factor 0.2*sqrt(max(rows, cols)) gives the update an RMS of about 0.2, the RMS of a typical AdamW
update, so Muon can share AdamW's learning rate and weight decay (Moonlight §2.2).

Which matrix is orthogonalised:
- a 2-D weight [rows, cols]: the whole matrix;
- a 3-D weight [E, rows, cols] (stacked MoE experts): each expert slice, batched;
- a 2-D weight whose ``head_blocks`` entry in its group is H (the model tags its Q/K/V projections,
  shape [H*dh, D]; k3lab/model/tags.py) in a group with ``per_head=True``: each head's row block
  [dh, D], batched, with the scale taken from
  the block's shape. This is the per-head Muon of Kimi K3 §2.5 (arXiv:2607.24653): each head's
  projection gets its own orthogonal update instead of sharing one spectrum with the other heads.
  With ``per_head=False`` the entry is ignored.

Groups with ``use_muon=False`` are stepped with AdamW (decoupled weight decay, bias correction; the
same arithmetic as torch.optim.AdamW), so one optimizer and one LR scheduler drive the whole model.

Distributed data parallel (DDP): no collective. DDP has already averaged the gradients, so every rank
starts the step from identical parameters, state and gradients, and every operation here (Newton-Schulz
included) is a deterministic function of them: all ranks compute the same update.

Sharded parameters (FSDP2, k3lab/parallel.py): a parameter, its gradient and its optimizer state are
DTensors sharded on dim 0, each rank holding a block of rows (of experts, for a 3-D stack). The momentum
and Nesterov steps are elementwise, so they run on the local shards. Newton-Schulz is not: it must see the
whole matrix (or each whole head block, or each whole expert). So for every Muon parameter the Nesterov
direction u is all-gathered (`DTensor.full_tensor`), every rank computes the full update from the full
u, as one device would, and applies the rows of its own shard (a Replicate -> Shard redistribute, which
is local slicing). This is Moonlight's Distributed Muon (arXiv:2502.16982: gather each matrix from its
data-parallel shards, orthogonalise it whole, keep the local partition): the update is bit for bit the
one-device update of the same momentum, at the price of one all-gather per Muon matrix per step and of
every rank computing every Newton-Schulz. The AdamW groups are elementwise and run on the shards unchanged.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

NS_COEFFS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2  # Moonlight's update-RMS target
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@torch.no_grad()
def newton_schulz(g: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximate the orthogonal polar factor U V^T of g = U S V^T, batched over leading dims.

    Quintic iteration X <- aX + (bA + cA^2)X with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315),
    run in `dtype` (bf16, as in Muon and Moonlight; fp32 for exact comparisons, where bf16's rounding
    would turn a last-bit difference of g into an update difference of ~1e-3) after dividing by the
    Frobenius norm (so every singular value starts <= 1), on the wide orientation (rows <= cols, so A is
    the smaller Gram matrix). The coefficients trade exactness for speed: singular values land in a band
    around 1 (about [0.7, 1.2]) rather than exactly on it. Returns a tensor of g's shape in `dtype`.
    """
    if g.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFS
    x = g.float()
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    x = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def orthogonal_update(u: Tensor, head_blocks: int | None, steps: int, ns_dtype: torch.dtype = torch.bfloat16
                      ) -> Tensor:
    """The scaled Muon direction 0.2*sqrt(max(rows, cols)) * NS(u) for one parameter's momentum.

    u: [rows, cols], or [E, rows, cols] (per expert slice); a whole tensor, never a shard (see
    `sharded_orthogonal_update`). head_blocks=H splits a 2-D u into H row blocks [rows/H, cols] that are
    orthogonalised (and scaled) each on its own. Returns u.dtype.
    """
    if u.ndim == 3:
        if head_blocks:
            raise ValueError("head_blocks applies to 2-D projection weights, not to 3-D expert stacks")
        mats = u
    elif u.ndim == 2 and head_blocks:
        rows, cols = u.shape
        if rows % head_blocks:
            raise ValueError(f"head_blocks={head_blocks} does not divide the {rows} rows of a [{rows}, {cols}] weight")
        mats = u.reshape(head_blocks, rows // head_blocks, cols)
    elif u.ndim == 2:
        mats = u
    else:
        raise ValueError(f"Muon takes 2-D or 3-D parameters, got shape {tuple(u.shape)}")
    scale = RMS_MATCH * math.sqrt(max(mats.size(-2), mats.size(-1)))
    return (newton_schulz(mats, steps, dtype=ns_dtype).to(u.dtype) * scale).reshape(u.shape)


def sharded_orthogonal_update(u: DTensor, head_blocks: int | None, steps: int,
                              ns_dtype: torch.dtype = torch.bfloat16) -> DTensor:
    """`orthogonal_update` of a sharded u (a DTensor, e.g. an FSDP2 shard of [rows, cols] or [E, rows, cols]):
    the whole u is all-gathered, the update computed from it on every rank, and returned with u's
    placements, each rank keeping its own rows. Equal to `orthogonal_update(u.full_tensor(), ...)`
    sharded like u."""
    full = orthogonal_update(u.full_tensor(), head_blocks, steps, ns_dtype)
    replicated = DTensor.from_local(full, u.device_mesh, [Replicate()] * u.device_mesh.ndim, run_check=False)
    return replicated.redistribute(u.device_mesh, u.placements)


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices, AdamW for the rest (see the module docstring for the maths).

    Each param group must say ``use_muon``. Muon groups read lr, weight_decay, momentum, nesterov,
    ns_steps, ns_dtype ("bf16" or "fp32"), per_head, and head_blocks (one int per parameter, 0 = none,
    the default; the model's `head_blocks` tags, k3lab/model/tags.py, filled in by k3lab/optim/build.py);
    AdamW groups read lr, weight_decay, betas, eps. Defaults fill missing keys. Parameters may be plain
    tensors or dim-0 DTensor shards (FSDP2; see the module docstring).
    Gradient clipping is not done here: K3LitModule.configure_gradient_clipping clips to
    ``optim.grad_clip`` before each step.
    """

    def __init__(self, param_groups, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_dtype: str = "bf16", per_head: bool = True,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_dtype=ns_dtype, per_head=per_head, betas=tuple(betas), eps=eps)
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if "use_muon" not in group:
                raise ValueError("every Muon param group needs a 'use_muon' key (True: Muon, False: AdamW)")
            if group["use_muon"]:
                if group["ns_dtype"] not in NS_DTYPES:
                    raise ValueError(f"ns_dtype={group['ns_dtype']!r} is not an option; valid options: "
                                     f"{', '.join(NS_DTYPES)}")
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(f"Muon group holds a parameter of shape {tuple(p.shape)}; "
                                         "only 2-D or 3-D (stacked expert) weights belong in Muon groups")
                group.setdefault("head_blocks", [0] * len(group["params"]))
                if len(group["head_blocks"]) != len(group["params"]):
                    raise ValueError(f"head_blocks has {len(group['head_blocks'])} entries for "
                                     f"{len(group['params'])} parameters in a Muon group")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        for p, heads in zip(group["params"], group["head_blocks"]):
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            m = state["momentum_buffer"]
            m.mul_(beta).add_(g)
            u = g.add(m, alpha=beta) if group["nesterov"] else m
            ortho = sharded_orthogonal_update if isinstance(u, DTensor) else orthogonal_update
            update = ortho(u, heads if group["per_head"] else None, group["ns_steps"], NS_DTYPES[group["ns_dtype"]])
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)

    def _adamw_step(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = state["step"].item()
            m, v = state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias1 = 1 - beta1 ** t
            bias2 = 1 - beta2 ** t
            denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bias1)
