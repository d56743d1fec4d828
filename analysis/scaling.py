"""Scaling-law fits: Chinchilla approaches 3 and 2, loss against compute per variant, compute multipliers.

Approach 3 (Hoffmann et al. 2022, arXiv:2203.15556, §3.3; protocol of the Epoch replication,
Besiroglu et al. 2024, arXiv:2404.10102):

    L(N, D) = E + A / N^alpha + B / D^beta,   A, B, E = exp(a, b, e)
    log L_hat_i = LSE(a - alpha log N_i,  b - beta log D_i,  e)
    objective(theta) = sum_i Huber_delta(log L_hat_i - log L_i),   delta = 1e-3   (the sum, not the mean)

minimised with L-BFGS-B from Chinchilla's grid of 4,500 starts. Uncertainty from a non-parametric
bootstrap over runs, each replicate refitted from one start (the best point, or Hoffmann's values).
The compute-optimal allocation under C = kappa N D (kappa = 6 for the 6ND count; for the project's
FLOPs, kappa = median over the runs of C / (N D), see `flops_per_param_token`) is
    N_opt(C) = G (C/kappa)^(beta/(alpha+beta)),  D_opt(C) = G^-1 (C/kappa)^(alpha/(alpha+beta)),
    G = (alpha A / (beta B))^(1/(alpha+beta)).

Approach 2: per FLOP budget a parabola of L in log N; its vertex is N_opt(C); then log N_opt = k + a log C
and D_opt = C / (kappa N_opt).

Loss against compute per variant: L(C) = L_inf + A (C/C0)^-alpha (fitted in log space). The compute
multiplier of a variant against the baseline is how much more compute the baseline needs for the
variant's loss: separately fitted curves give C_base(L_var(C)) / C at each budget C; with L_inf and
alpha shared the multiplier is budget-invariant, (A_base / A_var)^(1/alpha).
"""
from __future__ import annotations

import argparse
import itertools
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
import multiprocessing as mp
from typing import Optional, Sequence

import numpy as np
import pandas as pd
from scipy.optimize import least_squares, minimize

from analysis._blas import single_thread_blas

THETA_NAMES = ("a", "b", "e", "alpha", "beta")
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")
# Hoffmann et al.'s unrounded estimate (a, b, e, alpha, beta) as given by the Epoch replication.
HOFFMANN_THETA = np.array([6.0073404, 6.0179186, 0.5267228, 0.33917084, 0.2849083])

# L-BFGS-B options. Grid starts use scipy's defaults (ftol 2.2e-9 is absolute here since the objective
# is < 1); the best few end points are then polished with tight tolerances.
LBFGS_GRID = {"maxiter": 2000}
LBFGS_TIGHT = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 10_000, "maxfun": 20_000}
GRAD_TOL = 1e-5  # a fit counts as converged when max |d objective / d theta| is below this


# --------------------------------------------------------------------------------------------------
# Approach 3
# --------------------------------------------------------------------------------------------------

def huber_lse_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                        delta: float = 1e-3) -> tuple[float, np.ndarray]:
    """Summed Huber loss of the LSE-form prediction of log L and its analytic gradient.

    theta = (a, b, e, alpha, beta); log_n, log_d, log_l: (n,). Returns (objective, grad (5,)).
    With w_k the softmax weights of the three LSE terms and g_i = clip(r_i, -delta, delta):
    d/da = sum g w_1, d/db = sum g w_2, d/de = sum g w_3, d/dalpha = -sum g w_1 log N, d/dbeta = -sum g w_2 log D.
    """
    a, b, e, alpha, beta = theta
    t1 = a - alpha * log_n
    t2 = b - beta * log_d
    m = np.maximum(np.maximum(t1, t2), e)
    e1, e2, e3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(e - m)
    s = e1 + e2 + e3
    r = m + np.log(s) - log_l
    g = np.clip(r, -delta, delta)
    f = float(np.dot(g, r - 0.5 * g))  # 0.5 r^2 inside [-delta, delta], delta (|r| - delta/2) outside
    gs = g / s
    g1, g2 = gs * e1, gs * e2
    grad = np.array([g1.sum(), g2.sum(), np.dot(gs, e3), -np.dot(g1, log_n), -np.dot(g2, log_d)])
    return f, grad


def init_grid(kind: str | np.ndarray = "full") -> np.ndarray:
    """Starting points (k, 5) in theta order (a, b, e, alpha, beta).

    full: Chinchilla's grid, alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1}, a, b in {0, 5, ..., 25}
    (4,500 starts). coarse: a, b in {0, 10, 20}, e in {-1, 0, 1}, alpha, beta in {0.5, 1} (108 starts).
    An array is returned as is (checked for shape).
    """
    if isinstance(kind, np.ndarray):
        if kind.ndim != 2 or kind.shape[1] != 5:
            raise ValueError(f"an init grid must have shape (k, 5) in order {THETA_NAMES}, got {kind.shape}")
        return kind.astype(float)
    if kind == "full":
        ab, e, ex = np.arange(0, 30, 5.0), np.arange(-1, 1.5, 0.5), np.arange(0, 2.5, 0.5)
    elif kind == "coarse":
        ab, e, ex = np.array([0.0, 10.0, 20.0]), np.array([-1.0, 0.0, 1.0]), np.array([0.5, 1.0])
    else:
        raise ValueError(f"grid must be 'full', 'coarse' or a (k, 5) array, got {kind!r}")
    return np.array(list(itertools.product(ab, ab, e, ex, ex)))


def _lbfgs(theta0, data, options):
    return minimize(huber_lse_objective, theta0, args=data, jac=True, method="L-BFGS-B", options=options)


def _run_starts(starts: np.ndarray, data: tuple, options: dict) -> tuple[np.ndarray, np.ndarray]:
    xs, fs = np.empty_like(starts), np.empty(len(starts))
    with single_thread_blas():
        for i, x0 in enumerate(starts):
            res = _lbfgs(x0, data, options)
            xs[i], fs[i] = res.x, res.fun if np.isfinite(res.fun) else np.inf
    return xs, fs


def _default_jobs() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _is_converged(res, data) -> bool:
    if not np.all(np.isfinite(res.x)) or not np.isfinite(res.fun):
        return False
    _, grad = huber_lse_objective(res.x, *data)
    return bool(np.max(np.abs(grad)) < GRAD_TOL)


@dataclass
class ChinchillaFit:
    """Result of an approach-3 fit. theta = (a, b, e, alpha, beta)."""
    theta: np.ndarray
    objective: float
    converged: bool
    n_points: int
    n_starts: int
    n_near_best: int  # starts whose end point is within 0.01% of the best objective
    delta: float = 1e-3
    kappa: float = 6.0  # FLOPs per parameter per token of the allocation: C = kappa N D

    E = property(lambda self: float(np.exp(self.theta[2])))
    A = property(lambda self: float(np.exp(self.theta[0])))
    B = property(lambda self: float(np.exp(self.theta[1])))
    alpha = property(lambda self: float(self.theta[3]))
    beta = property(lambda self: float(self.theta[4]))

    @property
    def a_exp(self) -> float:
        """Exponent of N_opt ∝ C^a: beta / (alpha + beta)."""
        return self.beta / (self.alpha + self.beta)

    def params(self) -> dict:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta,
                "a=beta/(alpha+beta)": self.a_exp, "objective": self.objective}

    def predict(self, n, d) -> np.ndarray:
        n, d = np.asarray(n, float), np.asarray(d, float)
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    def optimal(self, c) -> tuple[np.ndarray, np.ndarray]:
        """(N_opt, D_opt) minimising L under C = kappa N D; c: FLOPs, scalar or array."""
        return optimal_allocation(self.theta, c, self.kappa)


def optimal_allocation(theta: np.ndarray, c, kappa: float = 6.0) -> tuple[np.ndarray, np.ndarray]:
    """N_opt = G (C/kappa)^(beta/(alpha+beta)), D_opt = C / (kappa N_opt) for theta (..., 5) (broadcast
    against c)."""
    theta = np.asarray(theta, float)
    a, b, alpha, beta = theta[..., 0], theta[..., 1], theta[..., 3], theta[..., 4]
    s = alpha + beta
    log_g = (np.log(alpha) + a - np.log(beta) - b) / s
    log_ck = np.log(np.asarray(c, float) / kappa)
    n_opt = np.exp(log_g + beta / s * log_ck)
    return n_opt, np.asarray(c, float) / (kappa * n_opt)


def flops_per_param_token(n, d, c) -> tuple[float, float, float]:
    """kappa = median_i C_i / (N_i D_i), the FLOPs per parameter per token that link the compute C to
    (N, D) in the allocations, with its min and max over the runs. It is 6 when C = 6ND; with the
    project's FLOPs (6 x active matmul weights, LM head included, plus the sequence-mixing terms,
    k3lab/flops.py) and N = active non-embedding parameters it is a little above 6 and varies with
    the model's shape, which the min and max show."""
    k = np.asarray(c, float) / (np.asarray(n, float) * np.asarray(d, float))
    k = k[np.isfinite(k) & (k > 0)]
    if not len(k):
        raise ValueError("no row has a positive, finite C / (N D)")
    return float(np.median(k)), float(k.min()), float(k.max())


def _prepare(n, d, loss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, d, loss = (np.asarray(x, float).ravel() for x in (n, d, loss))
    if not (len(n) == len(d) == len(loss)):
        raise ValueError(f"N, D and loss must have the same length, got {len(n)}, {len(d)}, {len(loss)}")
    bad = ~(np.isfinite(n) & np.isfinite(d) & np.isfinite(loss)) | (n <= 0) | (d <= 0) | (loss <= 0)
    if bad.any():
        raise ValueError(f"{bad.sum()} rows have a non-positive or missing N, D or loss; drop them first")
    if len(n) < 6:
        raise ValueError(f"approach 3 has 5 parameters; {len(n)} points are too few")
    return np.log(n), np.log(d), np.log(loss)


def fit_chinchilla(n, d, loss, grid: str | np.ndarray = "full", delta: float = 1e-3,
                   n_jobs: Optional[int] = None, polish_top: int = 5, kappa: float = 6.0) -> ChinchillaFit:
    """Approach 3: L-BFGS-B from every start of `grid`, then the `polish_top` best distinct end points
    polished with tight tolerances; the lowest objective wins. n, d, loss: (k,) arrays; kappa: the
    allocation's C = kappa N D (the fit itself does not use C)."""
    data = (*_prepare(n, d, loss), delta)
    starts = init_grid(grid)
    jobs = _default_jobs() if n_jobs is None else n_jobs
    if jobs > 1 and len(starts) >= 200 and "fork" in mp.get_all_start_methods():
        chunks = np.array_split(starts, jobs)
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
            out = list(pool.map(_run_starts, chunks, [data] * jobs, [LBFGS_GRID] * jobs))
        xs, fs = np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])
    else:
        xs, fs = _run_starts(starts, data, LBFGS_GRID)
    order = np.argsort(fs)
    picked: list[np.ndarray] = []
    for i in order:
        if len(picked) == polish_top:
            break
        if all(np.max(np.abs(xs[i] - p)) > 1e-6 for p in picked):
            picked.append(xs[i])
    with single_thread_blas():
        polished = [_lbfgs(x, data, LBFGS_TIGHT) for x in picked]
    best = min(polished, key=lambda r: r.fun)
    near = int(np.sum(fs <= best.fun * (1 + 1e-4)))
    return ChinchillaFit(theta=best.x.copy(), objective=float(best.fun), converged=_is_converged(best, data),
                         n_points=len(data[0]), n_starts=len(starts), n_near_best=near, delta=delta,
                         kappa=kappa)


@dataclass
class ChinchillaBootstrap:
    """Bootstrap replicates of approach 3. `replicates`: one row per replicate with theta, the
    derived parameters, the objective and `converged`; intervals use the converged ones only."""
    replicates: pd.DataFrame
    seed: int
    init: np.ndarray
    kappa: float = 6.0  # the allocation's C = kappa N D

    @property
    def n_requested(self) -> int:
        return len(self.replicates)

    @property
    def n_converged(self) -> int:
        return int(self.replicates["converged"].sum())

    @property
    def good(self) -> pd.DataFrame:
        return self.replicates[self.replicates["converged"]]

    def ci(self, level: float = 0.95, columns: Sequence[str] = (*PARAM_NAMES, "a_exp")) -> pd.DataFrame:
        """Percentile intervals and bootstrap standard errors, one row per parameter."""
        q = (1 - level) / 2
        g = self.good
        return pd.DataFrame({"lo": g[list(columns)].quantile(q), "hi": g[list(columns)].quantile(1 - q),
                             "se": g[list(columns)].std(ddof=1)})

    def optimal_ci(self, budgets: Sequence[float], level: float = 0.95) -> pd.DataFrame:
        """N_opt(C), D_opt(C) percentile intervals at each budget (C = kappa N D)."""
        th = self.good[list(THETA_NAMES)].to_numpy()
        q = (1 - level) / 2
        rows = []
        for c in budgets:
            n_opt, d_opt = optimal_allocation(th, c, self.kappa)
            rows.append({"C": c, "N_lo": np.quantile(n_opt, q), "N_hi": np.quantile(n_opt, 1 - q),
                         "D_lo": np.quantile(d_opt, q), "D_hi": np.quantile(d_opt, 1 - q),
                         "D/N_lo": np.quantile(d_opt / n_opt, q), "D/N_hi": np.quantile(d_opt / n_opt, 1 - q)})
        return pd.DataFrame(rows)


def _theta_frame(th: np.ndarray) -> dict:
    th = np.atleast_2d(th)
    return {"a": th[:, 0], "b": th[:, 1], "e": th[:, 2], "alpha": th[:, 3], "beta": th[:, 4],
            "E": np.exp(th[:, 2]), "A": np.exp(th[:, 0]), "B": np.exp(th[:, 1]),
            "a_exp": th[:, 4] / (th[:, 3] + th[:, 4])}


def bootstrap_chinchilla(n, d, loss, n_boot: int = 4000, seed: int = 42, init: Optional[np.ndarray] = None,
                         delta: float = 1e-3, method: str = "L-BFGS-B", progress: bool = False,
                         description: str = "bootstrap (approach 3)", kappa: float = 6.0) -> ChinchillaBootstrap:
    """Non-parametric bootstrap over points (runs): resample with replacement, refit from `init` (the
    full-data best point; default Hoffmann's values), check each replicate's convergence (optimizer
    success and max |gradient| < GRAD_TOL). method: 'L-BFGS-B' or 'BFGS' (Epoch's choice). kappa: the
    allocations' C = kappa N D."""
    from rich.progress import track

    log_n, log_d, log_l = _prepare(n, d, loss)
    init = HOFFMANN_THETA if init is None else np.asarray(init, float)
    rng = np.random.default_rng(seed)
    k = len(log_n)
    rows = np.empty((n_boot, 5))
    fun, ok = np.empty(n_boot), np.empty(n_boot, bool)
    opts = LBFGS_TIGHT if method == "L-BFGS-B" else {"gtol": 1e-10, "maxiter": 10_000}
    with single_thread_blas():
        for i in track(range(n_boot), description=description, disable=not progress, transient=True):
            idx = rng.integers(0, k, k)
            data = (log_n[idx], log_d[idx], log_l[idx], delta)
            res = minimize(huber_lse_objective, init, args=data, jac=True, method=method, options=opts)
            rows[i], fun[i] = res.x, res.fun
            ok[i] = _is_converged(res, data) and res.x[3] > 0 and res.x[4] > 0
    df = pd.DataFrame(_theta_frame(rows))
    df["objective"], df["converged"] = fun, ok
    return ChinchillaBootstrap(replicates=df, seed=seed, init=init, kappa=kappa)


def size_groups(n: np.ndarray, sig: int = 3) -> np.ndarray:
    """Model-size label per row: N rounded to `sig` significant digits (digitised data jitter)."""
    n = np.asarray(n, float)
    mag = 10.0 ** (np.floor(np.log10(n)) - sig + 1)
    return np.round(n / mag) * mag


def leave_largest_out(n, d, loss, n_sizes: int = 1, grid: str | np.ndarray = "coarse",
                      delta: float = 1e-3, kappa: float = 6.0) -> tuple[ChinchillaFit, pd.DataFrame]:
    """Fit approach 3 without the `n_sizes` largest model sizes and predict the held-out runs.
    Returns (fit on the rest, table N, D, loss, pred, rel_err = pred/loss - 1)."""
    n, d, loss = (np.asarray(x, float) for x in (n, d, loss))
    sizes = np.unique(size_groups(n))
    if len(sizes) <= n_sizes + 1:
        raise ValueError(f"{len(sizes)} distinct model sizes: too few to leave {n_sizes} out")
    held = size_groups(n) >= sizes[-n_sizes]
    fit = fit_chinchilla(n[~held], d[~held], loss[~held], grid=grid, delta=delta, kappa=kappa)
    pred = fit.predict(n[held], d[held])
    table = pd.DataFrame({"N": n[held], "D": d[held], "loss": loss[held], "pred": pred,
                          "rel_err": pred / loss[held] - 1})
    return fit, table.sort_values(["N", "D"]).reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# Approach 2: isoFLOP parabolas
# --------------------------------------------------------------------------------------------------

def flop_budgets(c, tol_dex: float = 0.05) -> np.ndarray:
    """Group runs into FLOP budgets: sorted log10 C split wherever consecutive values differ by more
    than `tol_dex`; each group is labelled by its geometric mean. c: (k,) -> labels (k,)."""
    logc = np.log10(np.asarray(c, float))
    order = np.argsort(logc)
    labels = np.empty(len(logc))
    start = 0
    for j in range(1, len(order) + 1):
        if j == len(order) or logc[order[j]] - logc[order[j - 1]] > tol_dex:
            grp = order[start:j]
            labels[grp] = 10 ** logc[grp].mean()
            start = j
    return labels


@dataclass
class IsoFlopFit:
    """Approach 2. `parabolas`: one row per budget (C, n_runs, p2, p1, p0, N_opt, L_opt, valid, why).
    N_opt = k C^a, D_opt = k' C^b over the valid budgets."""
    parabolas: pd.DataFrame
    a: float
    log_k: float
    b: float
    log_kd: float
    boot: Optional[pd.DataFrame] = None  # bootstrap replicates of (a, b)

    def n_opt(self, c) -> np.ndarray:
        return np.exp(self.log_k + self.a * np.log(np.asarray(c, float)))

    def ci(self, level: float = 0.95) -> pd.DataFrame:
        if self.boot is None or self.boot.empty:
            return pd.DataFrame(columns=["lo", "hi"])
        q = (1 - level) / 2
        return pd.DataFrame({"lo": self.boot.quantile(q), "hi": self.boot.quantile(1 - q)})


def _parabolas(log_n, loss, budget) -> pd.DataFrame:
    rows = []
    for c in np.unique(budget):
        m = budget == c
        x, y = log_n[m], loss[m]
        row = {"C": c, "n_runs": int(m.sum()), "p2": np.nan, "p1": np.nan, "p0": np.nan,
               "N_opt": np.nan, "L_opt": np.nan, "valid": False, "why": ""}
        if len(np.unique(x)) < 3:
            row["why"] = "fewer than 3 sizes"
        else:
            p2, p1, p0 = np.polyfit(x, y, 2)
            row.update(p2=p2, p1=p1, p0=p0)
            if p2 <= 0:
                row["why"] = "not convex"
            else:
                xv = -p1 / (2 * p2)
                with np.errstate(over="ignore"):  # a far-away vertex is flagged below, not an error
                    row.update(N_opt=np.exp(xv), L_opt=p0 - p1 * p1 / (4 * p2))
                if xv < x.min() or xv > x.max():
                    row["why"] = "vertex outside the sampled sizes"
                else:
                    row["valid"] = True
        rows.append(row)
    return pd.DataFrame(rows)


def _powerlaw_from_parabolas(par: pd.DataFrame, kappa: float = 6.0) -> tuple[float, float, float, float]:
    v = par[par["valid"]]
    if len(v) < 2:
        raise ValueError(f"approach 2 needs >= 2 budgets with a valid parabola, got {len(v)}:\n"
                         f"{par[['C', 'n_runs', 'why']].to_string(index=False)}")
    lc, ln = np.log(v["C"].to_numpy()), np.log(v["N_opt"].to_numpy())
    a, log_k = np.polyfit(lc, ln, 1)
    b, log_kd = np.polyfit(lc, lc - np.log(kappa) - ln, 1)
    return a, log_k, b, log_kd


def fit_isoflop(n, c, loss, budget=None, tol_dex: float = 0.05, n_boot: int = 1000, seed: int = 0,
                kappa: float = 6.0) -> IsoFlopFit:
    """Approach 2: per budget a parabola L = p2 x^2 + p1 x + p0 in x = log N (>= 3 sizes, convex, vertex
    inside the sampled sizes), then log N_opt = log k + a log C by least squares over budgets; D_opt =
    C / (kappa N_opt). Bootstrap: runs resampled within each budget."""
    n, c, loss = (np.asarray(x, float) for x in (n, c, loss))
    budget = flop_budgets(c, tol_dex) if budget is None else np.asarray(budget, float)
    log_n = np.log(n)
    par = _parabolas(log_n, loss, budget)
    a, log_k, b, log_kd = _powerlaw_from_parabolas(par, kappa)
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(budget == cb) for cb in np.unique(budget)]
    boots = []
    with single_thread_blas():
        for _ in range(n_boot):
            idx = np.concatenate([rng.choice(g, len(g)) for g in groups])
            try:
                ab = _powerlaw_from_parabolas(_parabolas(log_n[idx], loss[idx], budget[idx]), kappa)
            except ValueError:
                continue
            boots.append((ab[0], ab[2]))
    boot = pd.DataFrame(boots, columns=["a", "b"])
    return IsoFlopFit(parabolas=par, a=float(a), log_k=float(log_k), b=float(b), log_kd=float(log_kd), boot=boot)


# --------------------------------------------------------------------------------------------------
# Loss against compute, compute multipliers
# --------------------------------------------------------------------------------------------------

def pareto_frontier(c, loss) -> np.ndarray:
    """Boolean mask of the points no cheaper-or-equal point beats (the compute-efficient frontier)."""
    c, loss = np.asarray(c, float), np.asarray(loss, float)
    order = np.lexsort((loss, c))
    mask = np.zeros(len(c), bool)
    best = np.inf
    for i in order:
        if loss[i] < best:
            mask[i], best = True, loss[i]
    return mask


@dataclass
class PowerLawFit:
    """L(C) = L_inf + A (C / C0)^-alpha."""
    L_inf: float
    A: float
    alpha: float
    C0: float
    success: bool

    def predict(self, c) -> np.ndarray:
        return self.L_inf + self.A * (np.asarray(c, float) / self.C0) ** -self.alpha

    def compute_for_loss(self, loss) -> np.ndarray:
        """C at which the curve reaches `loss` (inf where loss <= L_inf)."""
        gap = np.asarray(loss, float) - self.L_inf
        with np.errstate(divide="ignore", invalid="ignore"):
            out = self.C0 * (gap / self.A) ** (-1.0 / self.alpha)
        return np.where(gap > 0, out, np.inf)


def _log_residual(log_c_rel, log_l, l_inf, log_a, alpha):
    return np.log(l_inf + np.exp(log_a - alpha * log_c_rel)) - log_l


def _starts(lmin: float, medians: list[float], init: Optional[np.ndarray]) -> list[list[float]]:
    """Starting points (L_inf, alpha, log A_1..k): `init` alone, else a small grid."""
    if init is not None:
        return [list(init)]
    out = []
    for frac, alpha0 in itertools.product((0.0, 0.5, 0.9), (0.05, 0.2, 0.5)):
        l0 = frac * lmin
        out.append([l0, alpha0] + [np.log(max(m - l0, 1e-6)) for m in medians])
    return out


def fit_loss_vs_compute(c, loss, c0: Optional[float] = None, init: Optional[Sequence[float]] = None) -> PowerLawFit:
    """Least squares in log L of L_inf + A (C/C0)^-alpha (scipy.optimize.least_squares). C0 defaults to
    the geometric mean of C (conditioning). L_inf in [0, min L), alpha in [1e-3, 3]. init: one start
    (L_inf, alpha, log A) instead of the 9-point grid (bootstrap replicates start from the point fit)."""
    c, loss = np.asarray(c, float), np.asarray(loss, float)
    if len(c) < 4:
        raise ValueError(f"L(C) has 3 parameters; {len(c)} points are too few")
    shared = fit_loss_vs_compute_shared({0: (c, loss)}, c0=c0, init=init)
    return shared.curve(0)


@dataclass
class SharedPowerLawFit:
    """L_v(C) = L_inf + A_v (C/C0)^-alpha with L_inf and alpha shared by all variants."""
    L_inf: float
    alpha: float
    A: dict
    C0: float
    success: bool

    def curve(self, variant) -> PowerLawFit:
        return PowerLawFit(self.L_inf, self.A[variant], self.alpha, self.C0, self.success)


def fit_loss_vs_compute_shared(data: dict, c0: Optional[float] = None,
                               init: Optional[Sequence[float]] = None) -> SharedPowerLawFit:
    """Joint fit with L_inf and alpha shared, one A per variant; data: {variant: (C array, loss array)}.
    init: one start (L_inf, alpha, log A_1, ..., log A_k) instead of the 9-point grid."""
    names = list(data)
    cs = [np.asarray(data[v][0], float) for v in names]
    ls = [np.asarray(data[v][1], float) for v in names]
    c0 = float(np.exp(np.log(np.concatenate(cs)).mean())) if c0 is None else c0
    xs, ys = [np.log(c / c0) for c in cs], [np.log(l) for l in ls]
    lmin = min(l.min() for l in ls)
    k = len(names)
    lower, upper = [0.0, 1e-3] + [-50.0] * k, [lmin * (1 - 1e-9), 3.0] + [50.0] * k

    def resid(p):
        return np.concatenate([_log_residual(x, y, p[0], p[2 + i], p[1]) for i, (x, y) in enumerate(zip(xs, ys))])

    best = None
    for p0 in _starts(lmin, [float(np.median(l)) for l in ls], init):
        p0 = np.clip(p0, np.array(lower) + 1e-12, np.array(upper) - 1e-12)
        res = least_squares(resid, p0, bounds=(lower, upper), method="trf", x_scale="jac",
                            ftol=1e-12, xtol=1e-12, gtol=1e-12)
        if best is None or res.cost < best.cost:
            best = res
    return SharedPowerLawFit(L_inf=float(best.x[0]), alpha=float(best.x[1]),
                             A={v: float(np.exp(best.x[2 + i])) for i, v in enumerate(names)}, C0=c0,
                             success=bool(best.success))


def compute_multiplier_separate(base: PowerLawFit, var: PowerLawFit, budgets) -> np.ndarray:
    """C_base(L_var(C)) / C at each budget C: >1 means the variant reaches the loss with less compute.
    inf where the variant's loss is below the baseline's asymptote."""
    budgets = np.asarray(budgets, float)
    return base.compute_for_loss(var.predict(budgets)) / budgets


def compute_multiplier_shared(fit: SharedPowerLawFit, baseline, variant) -> float:
    """Budget-invariant multiplier (A_base / A_var)^(1/alpha) under shared L_inf and alpha."""
    return float((fit.A[baseline] / fit.A[variant]) ** (1.0 / fit.alpha))


def compute_multipliers(df: pd.DataFrame, baseline, variant_col: str = "variant", c_col: str = "C",
                        loss_col: str = "loss", budgets: Optional[Sequence[float]] = None, n_boot: int = 500,
                        seed: int = 0, level: float = 0.95, progress: bool = False) -> pd.DataFrame:
    """Compute multiplier of every variant against `baseline`, with bootstrap percentile intervals
    (runs resampled within each variant, all curves refitted per replicate).

    Returns one row per (variant, kind, C): kind 'shared' (C = NaN) or 'separate' at each budget;
    columns multiplier, lo, hi, n_boot_ok. Budgets default to 3 log-spaced points over the
    baseline's compute range."""
    from rich.progress import track

    groups = {v: g for v, g in df.groupby(variant_col, sort=False)}
    if baseline not in groups:
        raise ValueError(f"baseline variant {baseline!r} not among {sorted(map(str, groups))}")
    variants = [v for v in groups if v != baseline]
    if not variants:
        raise ValueError("compute multipliers need at least one variant besides the baseline")
    cb = groups[baseline][c_col].to_numpy(float)
    budgets = np.geomspace(cb.min(), cb.max(), 3) if budgets is None else np.asarray(budgets, float)

    def estimate(gs: dict, start: Optional[dict] = None) -> tuple[dict, dict]:
        data = {v: (g[c_col].to_numpy(float), g[loss_col].to_numpy(float)) for v, g in gs.items()}
        st = start or {}
        sep = {v: fit_loss_vs_compute(*data[v], c0=c0[v], init=st.get(v)) for v in data}
        shared = fit_loss_vs_compute_shared(data, c0=c0["shared"], init=st.get("shared"))
        out = {}
        for v in variants:
            out[(v, "shared", np.nan)] = compute_multiplier_shared(shared, baseline, v)
            for c, m in zip(budgets, compute_multiplier_separate(sep[baseline], sep[v], budgets)):
                out[(v, "separate", c)] = m
        inits = {v: [f.L_inf, f.alpha, np.log(f.A)] for v, f in sep.items()}
        inits["shared"] = [shared.L_inf, shared.alpha] + [np.log(shared.A[v]) for v in data]
        return out, inits

    c0 = {v: float(np.exp(np.log(g[c_col].to_numpy(float)).mean())) for v, g in groups.items()}
    c0["shared"] = float(np.exp(np.log(df[c_col].to_numpy(float)).mean()))
    rng = np.random.default_rng(seed)
    reps = []
    with single_thread_blas():
        point, inits = estimate(groups)
        for _ in track(range(n_boot), description="bootstrap (compute multipliers)", disable=not progress,
                       transient=True):
            gs = {v: g.iloc[rng.integers(0, len(g), len(g))] for v, g in groups.items()}
            try:
                reps.append(estimate(gs, inits)[0])
            except ValueError:
                continue
    q = (1 - level) / 2
    rows = []
    for key, m in point.items():
        vals = np.array([r[key] for r in reps if np.isfinite(r[key])])
        rows.append({"variant": key[0], "kind": key[1], "C": key[2], "multiplier": m,
                     "lo": np.quantile(vals, q) if len(vals) else np.nan,
                     "hi": np.quantile(vals, 1 - q) if len(vals) else np.nan,
                     "n_boot_ok": len(vals), "n_boot": n_boot})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> None:
    from analysis.collect import add_source_args, scaling_table_from_args

    p = argparse.ArgumentParser(prog="python -m analysis.scaling",
                                description="Chinchilla approach-3 fit (+ bootstrap, leave-largest-out) and "
                                            "approach 2 on run directories or an external CSV.")
    add_source_args(p)
    p.add_argument("--grid", default="full", choices=["full", "coarse"], help="approach-3 init grid")
    p.add_argument("--n-boot", type=int, default=200, help="bootstrap replicates (0 = none)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--budgets", default="1e18,1e20,1e22", help="FLOP budgets for N_opt, D_opt (comma list)")
    args = p.parse_args(argv)
    table = scaling_table_from_args(args)
    kappa, k_lo, k_hi = flops_per_param_token(table["N"], table["D"], table["C"])
    fit = fit_chinchilla(table["N"], table["D"], table["loss"], grid=args.grid, kappa=kappa)
    print(f"approach 3 on {fit.n_points} points, {fit.n_starts} starts ({fit.n_near_best} reach the best), "
          f"converged={fit.converged}; allocations under C = kappa N D, kappa = {kappa:.4g} "
          f"(median C/(ND); {k_lo:.4g} to {k_hi:.4g})")
    for k, v in fit.params().items():
        print(f"  {k:>20s} = {v:.6g}")
    budgets = [float(x) for x in args.budgets.split(",")]
    if args.n_boot:
        boot = bootstrap_chinchilla(table["N"], table["D"], table["loss"], n_boot=args.n_boot, seed=args.seed,
                                    init=fit.theta, progress=True, kappa=kappa)
        print(f"bootstrap: {boot.n_converged}/{boot.n_requested} replicates converged")
        print(boot.ci().to_string(float_format=lambda v: f"{v:.4g}"))
        print(boot.optimal_ci(budgets).to_string(float_format=lambda v: f"{v:.4g}"))
    n_opt, d_opt = fit.optimal(np.array(budgets))
    for c, nn, dd in zip(budgets, n_opt, d_opt):
        print(f"  C={c:.3g}: N_opt={nn:.4g}, D_opt={dd:.4g}, D/N={dd / nn:.3g}")


if __name__ == "__main__":
    main()
