"""Sigmoid top-k router with a selection bias, and the rules that balance expert load.

Routing (K3 eq. 11, arXiv:2607.24653; DeepSeek-V3 arXiv:2412.19437):
    s_i = sigmoid(W_r x_i)                      x_i [D] full width, in fp32;  s_i [n]
    E_i = top-k_j (s_ij + b_j)                   the bias b [n] only selects experts
    p_ij = s_ij / sum_{j' in E_i} s_ij'          gating weights from the unbiased scores

Balancing rules (`balance` switch), one class each, all driven the same way:
    observe(routing)   after every training forward (several micro-batches per step possible)
    update(bias)       once per optimizer step -> the new bias, pooled over data-parallel ranks
    loss(routing)      a differentiable term for the training loss (only `aux` returns non-zero)

qb    Quantile Balancing (K3 eqs. 13-14). alpha_i = the (k+1)-th largest biased score of token i;
      margins r_ij = s_ij - alpha_i (expert j is chosen by token i iff r_ij > -b_j);
      b_j <- -quantile_{1-k/n}(r_{:,j}) over all tokens of the step, then b <- b - mean(b).
      Exact (k-th order statistic) or from a histogram with B bins whose counts are all-reduced.
      iters > 1 (exact only) repeats the update on the step's scores, the cutoffs recomputed under
      each new bias, towards the bias that balances that batch exactly; 1 is K3's rule.
sign  b_j <- b_j + gamma * sign(mean_load - load_j)  (Wang et al. arXiv:2408.15664; DeepSeek-V3).
aux   Switch-style load loss: coef * n * sum_j f_j P_j, f_j = share of the k*m assignments routed to
      j, P_j = mean_i s_ij / sum_j' s_ij' (Switch Transformer arXiv:2101.03961 with sigmoid scores
      normalised as in DeepSeek-V3's sequence-wise loss).
none  nothing.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import nn

from k3lab.config import BalanceConfig
from k3lab.distributed import all_gather_rows, all_reduce_sum, is_distributed
from k3lab.model.matmul import router_logits
from k3lab.switches import check_option
from k3lab.model.tags import tag


# --- routing ------------------------------------------------------------------------------------
class Routing(NamedTuple):
    idx: torch.Tensor      # [m, k] int64 chosen experts, by decreasing biased score
    weight: torch.Tensor   # [m, k] fp32 gating weights p_ij (sum to 1 over k)
    scores: torch.Tensor   # [m, n] fp32 sigmoid scores s (differentiable)
    cutoff: torch.Tensor   # [m] fp32 alpha_i = (k+1)-th largest biased score (detached)


def route(scores: torch.Tensor, bias: torch.Tensor, k: int) -> Routing:
    """scores [m, n] fp32, bias [n] -> Routing. Top-k on s + b, weights from s renormalised over k."""
    n = scores.shape[-1]
    if not 0 < k < n:
        raise ValueError(f"top_k={k} must be in [1, n_experts - 1] (n_experts={n})")
    biased = scores.detach() + bias
    top = torch.topk(biased, k + 1, dim=-1)
    idx = top.indices[:, :k]
    chosen = scores.gather(1, idx)
    weight = chosen / chosen.sum(-1, keepdim=True)
    return Routing(idx, weight, scores, top.values[:, k])


def normal_init(p: torch.Tensor, gen: torch.Generator, std: float) -> torch.Tensor:
    return torch.randn(p.shape, generator=gen) * std


class Router(nn.Module):
    """x [m, D] -> Routing. weight [n, D] (a parameter; its `init` tag draws N(0, init_std) for the
    model's initialiser); bias [n] (a buffer: saved, not optimised, fp32 whatever the module's dtype)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, init_std: float = 0.02):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.weight = nn.Parameter(torch.empty(n_experts, d_model).normal_(0.0, init_std))
        tag(self, "weight", init=functools.partial(normal_init, std=init_std))
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        """Module conversions (.to(bf16), Lightning's bf16-true) move the bias but leave it fp32: bf16's
        spacing at 0.5 is 0.004, so a sign update's 1e-3 steps would round away."""
        super()._apply(fn, recurse)
        self.bias = self.bias.float()
        return self

    def forward(self, x: torch.Tensor) -> Routing:
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = torch.sigmoid(router_logits(x, self.weight))
        return route(scores, self.bias, self.top_k)


# --- statistics ---------------------------------------------------------------------------------
def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """ids [...] in [0, n) -> occurrences of each id [n] (int64). A scatter-add rather than torch.bincount,
    whose output length depends on the data: dynamo breaks the graph at bincount, not here."""
    flat = ids.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def expert_load(idx: torch.Tensor, n: int) -> torch.Tensor:
    """idx [m, k] -> tokens per expert [n] (int64): the column sums of the one-hot comparison
    idx == arange(n), which Inductor fuses into one reduction: on the H200, compiled, 0.047 ms for 262,144
    pairs over 64 experts, where `count_ids`' scatter-add, whose atomics all land on n counters, takes
    0.089 ms (eager the comparison takes 0.235 ms against 0.065: GPU training compiles by default)."""
    return (idx.reshape(-1, 1) == torch.arange(n, device=idx.device)).sum(0)


def max_violation_tensor(load: torch.Tensor) -> torch.Tensor:
    """MaxVio = max_j load_j / mean_j load_j - 1 (Wang et al. arXiv:2408.15664): 0-dim fp64, on load's device."""
    load = load.double()
    return load.max() / load.mean().clamp_min(1e-12) - 1.0


def max_violation(load: torch.Tensor) -> float:
    """`max_violation_tensor` read to the host."""
    return float(max_violation_tensor(load))


def score_entropy(scores: torch.Tensor) -> torch.Tensor:
    """scores [m, n] -> per-token entropy [m] (nats) of the scores normalised to a distribution."""
    p = scores / scores.sum(-1, keepdim=True)
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


# --- Quantile Balancing (K3 eqs. 13-14) ---------------------------------------------------------
def qb_margins(routing: Routing) -> torch.Tensor:
    """r_ij = s_ij - alpha_i [m, n]: token i picks expert j iff r_ij > -b_j."""
    return routing.scores.detach() - routing.cutoff[:, None]


def qb_target_rank(m: int, n: int, k: int) -> int:
    """c = ceil(m k / n): the quantile_{1-k/n} is the c-th largest margin of an expert's column."""
    return max(1, math.ceil(m * k / n - 1e-9))


def qb_quantile_exact(margins: torch.Tensor, k: int, m: int | None = None) -> torch.Tensor:
    """margins [M, n] (rows beyond the m real tokens may be -inf padding) -> q [n], the c-th largest
    margin of each column, c = ceil(m k / n). With b_j = -q_j exactly
    #{i: r_ij > -b_j} <= m k / n <= #{i: r_ij >= -b_j}."""
    n = margins.shape[1]
    m = margins.shape[0] if m is None else m
    c = qb_target_rank(m, n, k)
    # the smallest of each column's c largest, counted from the top so the -inf padding never enters, and
    # selected along contiguous rows of the transpose: on the H200 at [32,768, 64] fp32 and c = 4,096, two
    # calls timed it at 0.12 and 0.17 ms, kthvalue on the transpose at 0.16 and 0.15, kthvalue down the
    # strided columns at 0.31 and 0.29 (benchmarks/RESULTS.md)
    return torch.topk(margins.t().contiguous(), c, dim=1, sorted=False).values.amin(dim=1)


def qb_hist_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Margins are bounded: s in (0, 1) and alpha_i in [min b, 1 + max b], so
    r in [-1 - max b, 1 - min b]. Fixed by the bias, hence equal on all ranks and micro-batches.
    0-d float64 tensors on the bias's device, so that the forward never waits for the host."""
    return -1.0 - bias.max().double(), 1.0 - bias.min().double()


def qb_histogram(margins: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """margins [m, n] -> counts [n, bins] (float64) of each expert's margins in `bins` equal bins of [lo, hi]."""
    m, n = margins.shape
    width = (hi - lo) / bins
    b = ((margins.double() - lo) / width).floor().clamp_(0, bins - 1).long()
    flat = (torch.arange(n, device=margins.device) * bins + b).reshape(-1)
    return count_ids(flat, n * bins).reshape(n, bins).double()


def qb_quantile_hist(counts: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int, m: int) -> torch.Tensor:
    """counts [n, bins] -> q [n]: the c-th largest margin (c = ceil(m k / n)), located in its bin and
    interpolated assuming the bin's values are evenly spread. Error <= one bin width (hi - lo) / bins."""
    n, bins = counts.shape
    c = qb_target_rank(m, n, k)
    width = (hi - lo) / bins
    above = counts.flip(1).cumsum(1).flip(1)          # above[j, b] = #margins in bins >= b
    # the bin holding the c-th largest: the highest b with above[j, b] >= c
    hit = (above >= c).double()
    b = (hit * torch.arange(bins, device=counts.device, dtype=torch.float64)).amax(1).long()
    in_bin = counts.gather(1, b[:, None])[:, 0].clamp_min(1.0)
    above_bin = above.gather(1, b[:, None])[:, 0] - counts.gather(1, b[:, None])[:, 0]
    rank_in_bin = c - above_bin                        # 1 = the bin's largest value
    top_edge = lo + (b.double() + 1) * width
    return (top_edge - (rank_in_bin - 0.5) / in_bin * width).float()


def centre(bias: torch.Tensor) -> torch.Tensor:
    """Subtract the mean: top-k on s + b is unchanged by a common shift."""
    return bias - bias.mean()


class QuantileBalance:
    """b_j <- -quantile_{1-k/n}(s_:j - alpha), mean-centred (K3 eqs. 13-14); exact or histogram (bins > 0).
    iters: updates per step on the step's scores, each with the cutoffs of the previous one's bias; the
    first takes the cutoffs the forward routed with (kept beside the scores: no second top-k)."""

    def __init__(self, n: int, k: int, bins: int = 0, iters: int = 1):
        if iters < 1 or (bins and iters > 1):
            raise ValueError(f"balance.iters={iters} must be >= 1, and 1 with hist_bins > 0 (the histogram "
                             f"keeps no scores to recompute the cutoffs from)")
        self.n, self.k, self.bins, self.iters = n, k, bins, iters
        self.reset()

    def reset(self) -> None:
        self.rows: list[torch.Tensor] = []  # per micro-batch [m, n + 1]: the scores, then the cutoff
        self.counts: torch.Tensor | None = None
        self.range: tuple[float, float] | None = None
        self.m = 0

    def observe(self, routing: Routing, bias: torch.Tensor) -> None:
        self.m += routing.scores.shape[0]
        if self.bins == 0:  # the scores with the cutoff alpha as one more column: one gather across ranks
            self.rows.append(torch.cat([routing.scores.detach(), routing.cutoff[:, None]], 1))
            return
        if self.range is None:
            self.range = qb_hist_range(bias)
        h = qb_histogram(qb_margins(routing), *self.range, self.bins)
        self.counts = h if self.counts is None else self.counts + h

    def update(self, bias: torch.Tensor) -> torch.Tensor | None:
        device = bias.device
        # the row count is known here; only ranks that pool need to agree on it (a collective and a sync)
        m = int(all_reduce_sum(torch.tensor([self.m], dtype=torch.int64, device=device)).item()) \
            if is_distributed() else self.m
        if m == 0:
            return None
        if self.bins == 0:
            local = torch.cat(self.rows) if self.rows else torch.empty(0, self.n + 1, device=device)
            pooled = all_gather_rows(local.float(), pad_value=-math.inf)
            if is_distributed():
                # drop the padding rows of shorter ranks (a boolean index: a host sync, as the row count above
                # already is; on one process there is no padding and no sync); rows of non-finite scores stay,
                # so a NaN step gives a NaN bias (found at the training module's next read), not an empty quantile
                pooled = pooled[pooled[:, 0] != -math.inf]
            scores, cutoff = pooled[:, :-1], pooled[:, -1]
            margins = scores - cutoff[:, None]  # qb_margins of the forward's routing
            b = bias.float()
            for i in range(self.iters):
                if i:
                    margins = qb_margins(route(scores, b, self.k))
                b = centre(-qb_quantile_exact(margins, self.k))
            return b.to(bias.dtype)
        counts = self.counts
        if counts is None:  # this rank saw no tokens; join the all-reduce with zeros
            counts = torch.zeros(self.n, self.bins, dtype=torch.float64, device=device)
            self.range = qb_hist_range(bias)
        q = qb_quantile_hist(all_reduce_sum(counts), *self.range, self.k, m)
        return centre(-q.to(bias.dtype))

    def loss(self, routing: Routing) -> torch.Tensor | None:
        return None


# --- sign update (DeepSeek-V3; Wang et al. 2408.15664) -----------------------------------------
def sign_update(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """b_j + gamma * sign(mean_load - load_j): overloaded experts get less attractive."""
    load = load.to(bias.dtype)
    return bias + gamma * torch.sign(load.mean() - load)


class SignBalance:
    def __init__(self, n: int, gamma: float):
        self.n, self.gamma = n, gamma
        self.reset()

    def reset(self) -> None:
        self.load: torch.Tensor | None = None

    def observe(self, routing: Routing, bias: torch.Tensor) -> None:
        load = expert_load(routing.idx, self.n)
        self.load = load if self.load is None else self.load + load

    def update(self, bias: torch.Tensor) -> torch.Tensor | None:
        local = self.load if self.load is not None else torch.zeros(self.n, dtype=torch.int64, device=bias.device)
        # no tokens seen: every load is 0, so sign(mean - load) = 0 and the bias stays (no host sync to check)
        return sign_update(bias, all_reduce_sum(local), self.gamma)

    def loss(self, routing: Routing) -> torch.Tensor | None:
        return None


# --- Switch-style auxiliary loss ----------------------------------------------------------------
def switch_aux_loss(scores: torch.Tensor, idx: torch.Tensor, coef: float) -> torch.Tensor:
    """coef * n * sum_j f_j P_j; scores [m, n], idx [m, k]. Equals coef at perfect balance.
    f_j = load_j / (m k) carries no gradient; P_j = mean_i s_ij / sum_j' s_ij' does."""
    m, n = scores.shape
    f = expert_load(idx, n).to(scores.dtype) / idx.numel()
    P = (scores / scores.sum(-1, keepdim=True)).mean(0)
    return coef * n * (f * P).sum()


class AuxLossBalance:
    def __init__(self, coef: float):
        self.coef = coef

    def reset(self) -> None:
        pass

    def observe(self, routing: Routing, bias: torch.Tensor) -> None:
        pass

    def update(self, bias: torch.Tensor) -> torch.Tensor | None:
        return None

    def loss(self, routing: Routing) -> torch.Tensor | None:
        return switch_aux_loss(routing.scores, routing.idx, self.coef)


class NoBalance(AuxLossBalance):
    def __init__(self):
        super().__init__(0.0)

    def loss(self, routing: Routing) -> torch.Tensor | None:
        return None


def build_balancer(cfg: BalanceConfig, n: int, k: int):
    """The balancing rule of option `cfg.name` for n experts with top-k routing."""
    check_option("balance", cfg.name)
    return {"qb": lambda: QuantileBalance(n, k, cfg.hist_bins, cfg.iters),
            "sign": lambda: SignBalance(n, cfg.gamma),
            "aux": lambda: AuxLossBalance(cfg.aux_coef),
            "none": NoBalance}[cfg.name]()
