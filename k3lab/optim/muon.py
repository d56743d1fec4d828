"""Muon with an AdamW companion, in one torch.optim.Optimizer.

Muon (Jordan et al., github.com/KellerJordan/Muon; at scale: Moonlight, arXiv:2502.16982) for hidden
matrices, per param group with ``use_muon=True``:

    m <- beta*m + g                          (momentum buffer)
    u <- g + beta*m  (Nesterov)  or  m       (heavy ball)
    O <- NS5(u)                              (Newton-Schulz quintic, bf16 by default, see `newton_schulz`;
                                              ns_method "gram": the same polynomial on the Gram matrix)
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

Groups with ``use_muon=False`` are stepped with AdamW (decoupled weight decay p *= 1 - lr*wd, bias
correction): torch.optim.AdamW's own code, through its functional form (`_adamw_step`), so one optimizer
and one LR scheduler drive the whole model.

Batching: for plain tensors the Muon step loops over buckets of same-shaped matrices, not over parameters.
The matrices to orthogonalise (each 2-D weight, expert slice or head block) are bucketed by (rows, cols,
dtype). Per bucket: each parameter's momentum is updated and its direction written straight into its slice
of one batch in the Newton-Schulz dtype (`kernels.momentum`: one read of g and m, one write of m and of the
slice); one batched Newton-Schulz runs on the batch (at most BUCKET_NUMEL elements; the Frobenius norms come
from its first Gram matrix, so nothing else reads the batch) up to its last product; and that product is
taken into the parameters (`Muon.apply_updates`): where they are in the Newton-Schulz dtype (bf16 weights),
one GEMM per parameter computes (1 - lr*wd) p - lr*scale*O in place, so O is never stored and p is read
and written once; otherwise O is formed and added after the decay by foreach ops.

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
data-parallel shards, orthogonalise it whole, keep the local partition): where the parameters are not in the
Newton-Schulz dtype (FSDP's fp32 master weights) the update is bit for bit the one-device update of the same
momentum, at the price of one all-gather per Muon matrix per step and of
every rank computing every Newton-Schulz. The gathered directions are orthogonalised in the same
buckets as plain tensors, one group of same-shaped parameters (`shard_chunks`) gathered at a time.
The AdamW groups are elementwise and run on the shards unchanged.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adamw import adamw

from k3lab.config import NS_METHODS
from kernels.momentum import momentum_direction

NS_COEFFS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2  # Moonlight's update-RMS target
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GRAM_RESTART_EVERY = 2  # the Gram form applies its polynomial to x and starts afresh every 2 iterations
GRAM_MIN_ASPECT = 2.0   # ... and runs only where max(rows, cols) >= 2 min(rows, cols); see `gram_newton_schulz`
BUCKET_NUMEL = 2**28  # elements per batched Newton-Schulz (512 MiB in bf16): bounds the step's transient memory


@torch.no_grad()
def newton_schulz(g: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16,
                  method: str = "standard") -> Tensor:
    """Approximate the orthogonal polar factor U V^T of g = U S V^T, batched over leading dims.

    Quintic iteration X <- aX + (bA + cA^2)X with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315),
    run in `dtype` (bf16, as in Muon and Moonlight; fp32 for exact comparisons, where bf16's rounding
    would turn a last-bit difference of g into an update difference of ~1e-3) on g divided by its
    Frobenius norm (+ eps), so that every singular value starts <= 1. The coefficients trade exactness
    for speed: singular values land in a band around 1 (about [0.7, 1.2]) rather than exactly on it.
    method: "standard" iterates on x, "gram" on its Gram matrix (`gram_newton_schulz`).
    Returns a contiguous tensor of g's shape in `dtype`.
    """
    if g.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    x = stack([g.reshape(-1, *g.shape[-2:])], dtype)  # one batch dim, for bmm
    return newton_schulz_iterations(x, steps, eps, method).reshape(g.shape)


def stack(mats: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The batches `mats` ([n_i, rows, cols] each, one shape) copied into one [sum n_i, rows, cols] in
    `dtype`: one read of each batch, no normalisation (`newton_schulz_iterations` takes the norms from
    its first Gram matrix)."""
    out = torch.empty((sum(m.size(0) for m in mats), *mats[0].shape[1:]), dtype=dtype, device=mats[0].device)
    start = 0
    for m in mats:
        out[start:start + m.size(0)].copy_(m)
        start += m.size(0)
    return out


def newton_schulz_iterations(x: Tensor, steps: int, eps: float = 1e-7, method: str = "standard") -> Tensor:
    """The quintic iterations of `newton_schulz` on a batch x [n, rows, cols] (contiguous): the product of
    `newton_schulz_factors`. Returns [n, rows, cols], contiguous."""
    return polar_product(*newton_schulz_factors(x, steps, eps, method))


def newton_schulz_factors(x: Tensor, steps: int, eps: float = 1e-7, method: str = "standard") -> tuple[Tensor, Tensor]:
    """`newton_schulz`'s quintic iterations on a batch x [n, rows, cols] (contiguous) but the last product:
    (q, y) with NS(x) = `polar_product`(q, y), q the small [n, s, s] matrix (s = min(rows, cols)) that the last
    iteration applies to y [n, rows, cols]. Leaving the product to the caller lets Muon write it straight into
    the parameters (`Muon.apply_updates`).

    The iterations use the smaller Gram matrix: A = x x^T for a wide batch (rows <= cols), where an iteration
    is x <- a x + (b A + c A^2) x, and A = x^T x for a tall one, where it is x <- a x + x (b A + c A^2), the
    same iteration on the transpose, written so that x keeps its own layout (no strided copy). Each iteration
    is three batched GEMMs: A, bA + cA^2 (baddbmm), then x times a I + bA + cA^2 with a added to the small
    matrix's diagonal (a baddbmm with beta=a on x would first copy x into its output: on the H200 that was
    144 device-to-device copies, 5 ms, of the K3 default's step).

    x need not be normalised: the first iteration divides by the Frobenius norms s = ||x||_F + eps
    without a pass over x. With ||x||_F^2 = trace(A), and for x' = x / s (wide; tall by symmetry)

        x1 = a x' + (b A' + c A'^2) x' = ((a I + b A' + c A'^2) / s) x,   A' = A / s^2,

    so only the small Gram matrices are scaled (the batch needs the entries of A finite in x's dtype:
    Frobenius norms below about 1e19 in bf16, far beyond clipped gradients' momentum).
    method "gram" hands a batch at least GRAM_MIN_ASPECT times longer than wide to `gram_newton_schulz`."""
    if method not in NS_METHODS:
        raise ValueError(f"ns_method={method!r} is not an option; valid options: {', '.join(NS_METHODS)}")
    rows, cols = x.shape[-2:]
    if method == "gram" and steps > 0 and max(rows, cols) >= GRAM_MIN_ASPECT * min(rows, cols):
        return gram_newton_schulz(x, steps, eps)
    gram, inv = _scaled_gram(gram_of(x), eps)
    if steps == 0:
        return torch.eye(gram.size(-1), dtype=x.dtype, device=x.device) * inv.to(x.dtype), x
    poly = quintic(gram).mul_(inv.to(x.dtype))
    for _ in range(steps - 1):
        x = polar_product(poly, x)
        poly = quintic(gram_of(x))
    return poly, x


def gram_of(x: Tensor) -> Tensor:
    """The smaller Gram matrix of each matrix of a batch x [n, rows, cols]: x x^T wide, x^T x tall."""
    return torch.bmm(x.mT, x) if x.size(-2) > x.size(-1) else torch.bmm(x, x.mT)


def quintic(gram: Tensor) -> Tensor:
    """a I + b A + c A^2 for a batch of Gram matrices A [n, s, s] (NS_COEFFS), a new tensor: one baddbmm and
    an add to the diagonal."""
    a, b, c = NS_COEFFS
    poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    poly.diagonal(dim1=-2, dim2=-1).add_(a)
    return poly


def polar_product(q: Tensor, y: Tensor, into: Tensor | None = None, beta: float = 0.0,
                  alpha: float = 1.0) -> Tensor:
    """A small matrix q [n, s, s] applied to a batch y [n, rows, cols] on the side that keeps y's layout (the
    side `gram_of` took): q y for a wide batch, y q for a tall one. With `into` (a contiguous [n, rows, cols]
    of y's dtype), into <- beta into + alpha (product) in one GEMM (baddbmm_: the sum in fp32, rounded once),
    the product never stored. Returns the product, or `into`."""
    left, right = (y, q) if y.size(-2) > y.size(-1) else (q, y)
    if into is None:
        return torch.bmm(left, right)
    return into.baddbmm_(left, right, beta=beta, alpha=alpha)


def _scaled_gram(gram: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A batch's Gram matrices scaled in place to those of x / (||x||_F + eps), and 1 / (||x||_F + eps)
    [n, 1, 1] fp32, with ||x||_F^2 = trace(A)."""
    norm = gram.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.float32).sqrt()  # [n], ||x||_F
    inv = (1 / (norm + eps))[:, None, None]
    return gram.mul_(inv.square().to(gram.dtype)), inv


def gram_newton_schulz(x: Tensor, steps: int, eps: float = 1e-7) -> tuple[Tensor, Tensor]:
    """`newton_schulz_factors`' quintic on the Gram matrix (Gram Newton-Schulz: Zhang, Amsel, Chen and Dao,
    2026, github.com/Dao-AILab/gram-newton-schulz): the same polynomial in exact arithmetic, with fewer FLOPs
    where one side of x [n, rows, cols] is much longer than the other.

    For wide x (tall by symmetry) every iterate is Q x with Q a polynomial in R = x x^T, so the iteration can
    run on the small matrices alone. With P = a I + b R + c R^2:

        Q <- Q P,   R <- P R P   (R, P and Q commute: all are polynomials in the first R)

    and x is touched only to form R and to apply Q. Every GRAM_RESTART_EVERY iterations x <- Q x and R is
    formed afresh (Q <- I): in bf16 a long product of polynomials drifts from the x it stands for (the
    reference restarts once, in fp16); restarting every 2 keeps bf16 as close to the exact polar factor as
    the standard iteration (tests/test_optim.py), and Q's entries within a few times a^2. Per matrix,
    with s = min(rows, cols) and l = max(rows, cols), 5 iterations cost 12 s^2 l + 22 s^3 FLOPs against
    the standard 20 s^2 l + 10 s^3: fewer from l = 1.5 s, 27% fewer at l = 5.5 s (the K3 experts).
    `newton_schulz_factors` sends it batches from l = GRAM_MIN_ASPECT s = 2 s, a margin for the s x s
    products, which run further from a GPU's peak than the long ones.
    The normalisation is folded into the first Q, as the standard iteration folds it into its first
    polynomial. Returns (Q, x) of the last restart: NS(x) = `polar_product`(Q, x)."""
    r, inv = _scaled_gram(gram_of(x), eps)
    q = None
    for t in range(steps):
        if t and t % GRAM_RESTART_EVERY == 0:
            x, q = polar_product(q, x), None
            r = gram_of(x)
        poly = quintic(r)
        if q is None:
            q = poly * inv.to(x.dtype) if t == 0 else poly
        else:
            q = torch.bmm(q, poly)
        if t + 1 < steps and (t + 1) % GRAM_RESTART_EVERY:
            r = torch.bmm(poly, torch.bmm(r, poly))
    return q, x


def as_matrices(u: Tensor, head_blocks: int | None) -> Tensor:
    """The matrices Muon orthogonalises in u, as a batch [n, rows, cols] (a view of a contiguous u):
    a 2-D u is one matrix, or H row blocks [rows/H, cols] with head_blocks=H; a 3-D u [E, rows, cols]
    is E matrices."""
    if u.ndim == 3:
        if head_blocks:
            raise ValueError("head_blocks applies to 2-D projection weights, not to 3-D expert stacks")
        return u
    if u.ndim != 2:
        raise ValueError(f"Muon takes 2-D or 3-D parameters, got shape {tuple(u.shape)}")
    rows, cols = u.shape
    if head_blocks and rows % head_blocks:
        raise ValueError(f"head_blocks={head_blocks} does not divide the {rows} rows of a [{rows}, {cols}] weight")
    blocks = head_blocks or 1
    return u.reshape(blocks, rows // blocks, cols)


def update_scale(mats: Tensor) -> float:
    """0.2*sqrt(max(rows, cols)) for a batch of matrices [n, rows, cols]: the factor that gives the update the
    RMS of a typical AdamW update."""
    return RMS_MATCH * math.sqrt(max(mats.size(-2), mats.size(-1)))


def orthogonal_update(u: Tensor, head_blocks: int | None, steps: int, ns_dtype: torch.dtype = torch.bfloat16,
                      ns_method: str = "standard") -> Tensor:
    """The scaled Muon direction 0.2*sqrt(max(rows, cols)) * NS(u) for one parameter's momentum.

    u: [rows, cols], or [E, rows, cols] (per expert slice); a whole tensor, never a shard (see
    `Muon._sharded_muon_step`). head_blocks=H splits a 2-D u into H row blocks [rows/H, cols] that are
    orthogonalised (and scaled) each on its own. Returns u.dtype.
    """
    mats = as_matrices(u, head_blocks)
    return (newton_schulz(mats, steps, dtype=ns_dtype, method=ns_method).to(u.dtype).mul_(update_scale(mats))
            .reshape(u.shape))


def group_indices(keys: list, sizes: list[int]) -> list[list[int]]:
    """Indices 0..n-1 grouped by equal key, each group at most BUCKET_NUMEL elements by `sizes` (a group
    that would pass it is closed and a new one opened; a larger item stands alone): the closed groups in
    the order they closed, then the open ones in first-seen order."""
    open_, done = {}, []
    for i, (key, size) in enumerate(zip(keys, sizes)):
        group, numel = open_.get(key, ([], 0))
        if group and numel + size > BUCKET_NUMEL:
            done.append(group)
            group, numel = [], 0
        group.append(i)
        open_[key] = group, numel + size
    return done + [group for group, _ in open_.values()]


def buckets(us: list[Tensor], head_blocks: list[int]) -> list[list[tuple[int, Tensor]]]:
    """The matrices of every u (`as_matrices`), bucketed by (rows, cols, dtype, device) for one batched
    Newton-Schulz each: lists of (index into us, [n, rows, cols]); a bucket over BUCKET_NUMEL elements
    is split between whole tensors (`group_indices`)."""
    mats = [as_matrices(u, heads) for u, heads in zip(us, head_blocks)]
    keys = [(*m.shape[1:], m.dtype, m.device) for m in mats]
    return [[(i, mats[i]) for i in group] for group in group_indices(keys, [m.numel() for m in mats])]


def unstack(ortho: Tensor, bucket: list[tuple[int, Tensor]], like: list[Tensor]) -> list[Tensor]:
    """The slices of a bucket's Newton-Schulz result ortho [sum n_i, rows, cols], one per (index, matrices
    [n_i, rows, cols]) entry of `bucket`, shaped and typed like like[index] (views where the dtype agrees)."""
    pieces = ortho.split([m.size(0) for _, m in bucket])
    return [piece.view(like[i].shape).to(like[i].dtype) for (i, _), piece in zip(bucket, pieces)]


def bucket_updates(us: list[Tensor], head_blocks: list[int], steps: int, ns_dtype: torch.dtype,
                   ns_method: str = "standard") -> Iterator[tuple[list[int], list[Tensor], float]]:
    """The Muon updates NS(u) of whole tensors `us` (the sharded step's gathered directions), one bucket
    (`buckets`) at a time: (indices into us, NS(u) shaped like those u, in u's dtype, and the bucket's
    `update_scale`, which the caller folds into its add). One bucket's stack and Newton-Schulz
    intermediates live at a time."""
    for bucket in buckets(us, head_blocks):
        ortho = newton_schulz_iterations(stack([m for _, m in bucket], ns_dtype), steps, method=ns_method)
        yield [i for i, _ in bucket], unstack(ortho, bucket, us), update_scale(ortho)


def shard_chunks(us: list[DTensor], head_blocks: list[int]) -> list[list[int]]:
    """Indices of sharded directions `us` in groups of one global shape, head blocks and dtype, each at
    most BUCKET_NUMEL elements (`group_indices`): what one gather-and-orthogonalise round takes, so that
    the whole tensors of one group, never of every parameter, are gathered at a time."""
    keys = [(tuple(u.shape), heads, u.dtype) for u, heads in zip(us, head_blocks)]
    return group_indices(keys, [u.numel() for u in us])


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices, AdamW for the rest (see the module docstring for the maths).

    Each param group must say ``use_muon``. Muon groups read lr, weight_decay, momentum, nesterov,
    ns_steps, ns_dtype ("bf16" or "fp32"), ns_method ("standard" or "gram"), per_head, and head_blocks (one
    int per parameter, 0 = none, the default; the model's `head_blocks` tags, k3lab/model/tags.py, filled in
    by k3lab/optim/build.py);
    AdamW groups read lr, weight_decay, betas, eps. Defaults fill missing keys. Parameters may be plain
    tensors or dim-0 DTensor shards (FSDP2; see the module docstring).
    Gradient clipping is decided outside (K3LitModule.configure_gradient_clipping, `k3lab.lit.clip_grad_norm`),
    which hands its factor to `scale_grads` before each step.
    """

    def __init__(self, param_groups, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_dtype: str = "bf16", ns_method: str = "standard",
                 per_head: bool = True, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_dtype=ns_dtype, ns_method=ns_method, per_head=per_head, betas=tuple(betas), eps=eps)
        super().__init__(param_groups, defaults)
        self._grad_scale: Tensor | None = None  # `scale_grads`' factor, until the next step
        for group in self.param_groups:
            if "use_muon" not in group:
                raise ValueError("every Muon param group needs a 'use_muon' key (True: Muon, False: AdamW)")
            if group["use_muon"]:
                if group["ns_dtype"] not in NS_DTYPES:
                    raise ValueError(f"ns_dtype={group['ns_dtype']!r} is not an option; valid options: "
                                     f"{', '.join(NS_DTYPES)}")
                if group["ns_method"] not in NS_METHODS:
                    raise ValueError(f"ns_method={group['ns_method']!r} is not an option; valid options: "
                                     f"{', '.join(NS_METHODS)}")
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(f"Muon group holds a parameter of shape {tuple(p.shape)}; "
                                         "only 2-D or 3-D (stacked expert) weights belong in Muon groups")
                group.setdefault("head_blocks", [0] * len(group["params"]))
                if len(group["head_blocks"]) != len(group["params"]):
                    raise ValueError(f"head_blocks has {len(group['head_blocks'])} entries for "
                                     f"{len(group['params'])} parameters in a Muon group")

    @torch.no_grad()
    def scale_grads(self, factor: Tensor) -> None:
        """Every gradient times factor (a 0-dim fp32 tensor on the gradients' device: gradient clipping's) for
        the next step, without a pass of its own over the gradients: the Muon groups' momentum kernel reads g
        once anyway and multiplies it there (`kernels.momentum`), and fused AdamW divides by 1 / factor as it
        reads each gradient (its `grad_scale`, the one kernel for the group; on the H200 the foreach multiply
        it replaces was 145 small launches, 0.7 ms a step). Unfused AdamW (the CPU, DTensor shards) multiplies
        its gradients in place at the step."""
        self._grad_scale = factor

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # under Lightning the closure runs the backward and the clipping
            with torch.enable_grad():
                loss = closure()
        grad_scale, self._grad_scale = self._grad_scale, None
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group, grad_scale)
            else:
                self._adamw_step(group, grad_scale)
        return loss

    def _muon_step(self, group: dict, grad_scale: Tensor | None) -> None:
        plain, sharded = [], []
        for p, heads in zip(group["params"], group["head_blocks"]):
            if p.grad is None:
                continue
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            (sharded if isinstance(p, DTensor) else plain).append((p, heads if group["per_head"] else 0))
        if sharded:
            self._sharded_muon_step(group, sharded, grad_scale)
        if plain:
            self._batched_muon_step(group, plain, grad_scale)

    def _sharded_muon_step(self, group: dict, pairs: list[tuple[DTensor, int]], grad_scale: Tensor | None) -> None:
        """DTensor (parameter, head_blocks) pairs: momentum, direction and decay on the shards; then per
        `shard_chunks` group, the whole directions all-gathered (`DTensor.full_tensor`), orthogonalised by
        `bucket_updates` as on one device, and each rank adds the rows of its own shard (a Replicate ->
        Shard redistribute, which is local slicing)."""
        params, heads = [p for p, _ in pairs], [h for _, h in pairs]
        us = [self.sharded_direction(group, p, grad_scale) for p in params]
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        ns_dtype = NS_DTYPES[group["ns_dtype"]]
        for chunk in shard_chunks(us, heads):
            whole = [us[i].full_tensor() for i in chunk]
            for idx, updates, scale in bucket_updates(whole, [heads[i] for i in chunk], group["ns_steps"],
                                                      ns_dtype, group["ns_method"]):
                for j, update in zip(idx, updates):
                    p = params[chunk[j]]
                    replicated = DTensor.from_local(update, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                                    run_check=False)
                    p.add_(replicated.redistribute(p.device_mesh, p.placements), alpha=-group["lr"] * scale)

    def sharded_direction(self, group: dict, p: DTensor, grad_scale: Tensor | None = None) -> DTensor:
        """`momentum_direction` on a DTensor parameter's local shards (the gradient times grad_scale, if given): its
        momentum updated in place and its direction returned as a new DTensor sharded like p."""
        u = torch.empty_like(p.grad.to_local())
        momentum_direction(p.grad.to_local(), self.state[p]["momentum_buffer"].to_local(), u, group["momentum"],
                           group["nesterov"], scale=grad_scale)
        return DTensor.from_local(u, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    def _batched_muon_step(self, group: dict, pairs: list[tuple[Tensor, int]], grad_scale: Tensor | None) -> None:
        """Plain (parameter, head_blocks) pairs, per bucket of same-shaped matrices (`buckets` of the
        parameters): the momentum updated and the directions written into one batch (`bucket_directions`),
        one Newton-Schulz but its last product (`newton_schulz_factors`), and that product taken into the
        parameters with the decay (`apply_updates`). Transient memory: one bucket's batch with its
        Newton-Schulz intermediates at a time."""
        params, heads = [p for p, _ in pairs], [h for _, h in pairs]
        for bucket in buckets(params, heads):
            q, y = newton_schulz_factors(self.bucket_directions(group, params, bucket, grad_scale),
                                         group["ns_steps"], method=group["ns_method"])
            self.apply_updates(group, params, bucket, q, y)

    def bucket_directions(self, group: dict, params: list[Tensor], bucket: list[tuple[int, Tensor]],
                          grad_scale: Tensor | None = None) -> Tensor:
        """Each of one bucket's parameters' momentum updated, m <- s g + beta m (s = grad_scale, or 1), and its
        direction u = s g + beta m (Nesterov) or m computed in the parameter's dtype and written into its slice
        of one batch [sum n_i, rows, cols] in the Newton-Schulz dtype (`kernels.momentum.momentum_direction`:
        one read of g and m, one write of m and of the slice)."""
        out = torch.empty((sum(m.size(0) for _, m in bucket), *bucket[0][1].shape[1:]),
                          dtype=NS_DTYPES[group["ns_dtype"]], device=bucket[0][1].device)
        start = 0
        for i, mats in bucket:
            p, n = params[i], mats.size(0)
            momentum_direction(p.grad, self.state[p]["momentum_buffer"], out[start:start + n], group["momentum"],
                               group["nesterov"], scale=grad_scale)
            start += n
        return out

    def apply_updates(self, group: dict, params: list[Tensor], bucket: list[tuple[int, Tensor]], q: Tensor,
                      y: Tensor) -> None:
        """p <- (1 - lr wd) p - lr 0.2 sqrt(max(rows, cols)) NS(u) for one bucket's parameters, with
        NS(u) = `polar_product`(q, y) of the bucket's `newton_schulz_factors`. Where the parameters are in the
        Newton-Schulz dtype, one GEMM per parameter writes into its matrices in place, the decay in its beta
        and the step in its alpha (the sum in fp32, rounded once; NS(u) is never stored); otherwise the bucket's
        NS(u) is formed and added by foreach ops after the decay."""
        decay, alpha = 1 - group["lr"] * group["weight_decay"], -group["lr"] * update_scale(y)
        if bucket[0][1].dtype == y.dtype:
            sizes = [m.size(0) for _, m in bucket]
            for (_, mats), q_i, y_i in zip(bucket, q.split(sizes), y.split(sizes)):
                polar_product(q_i, y_i, into=mats, beta=decay, alpha=alpha)
            return
        targets = [params[i] for i, _ in bucket]
        torch._foreach_mul_(targets, decay)
        torch._foreach_add_(targets, unstack(polar_product(q, y), bucket, params), alpha=alpha)

    def _adamw_step(self, group: dict, grad_scale: Tensor | None) -> None:
        """AdamW by torch's own implementation (torch.optim.AdamW's functional form), not a loop of our own:
        it is maintained and tested upstream, and fused: with every parameter a plain CUDA tensor, one
        kernel for the whole group instead of ~8 per tensor; otherwise torch's default (foreach on CUDA
        DTensor shards, single-tensor on the CPU). State as AdamW's: step (a float32 scalar tensor, on the
        parameter's device for fused and on the CPU otherwise, moved there if a checkpoint put it elsewhere),
        exp_avg, exp_avg_sq. grad_scale: `scale_grads`' factor or None."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        fused = all(p.is_cuda and not isinstance(p, DTensor) for p in params)
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            step_device = p.device if fused else torch.device("cpu")
            if state["step"].device != step_device:
                state["step"] = state["step"].to(step_device, torch.float32)
        fused_scale = None  # fused AdamW divides each gradient by its grad_scale as it reads it
        if grad_scale is not None and fused:
            fused_scale = 1 / grad_scale
        elif grad_scale is not None:
            torch._foreach_mul_([p.grad for p in params], grad_scale)
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        adamw(
            params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [], [s["step"] for s in states], fused=True if fused else None, amsgrad=False,
            grad_scale=fused_scale,
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=False)
