"""Chinchilla approach 3: a parametric fit of L(N, D) (Hoffmann et al. 2022, arXiv:2203.15556, §3.3;
protocol of the Epoch replication, Besiroglu et al. 2024, arXiv:2404.10102):

    L(N, D) = E + A / N^alpha + B / D^beta,   A, B, E = exp(a, b, e)
    log L_hat_i = LSE(a - alpha log N_i,  b - beta log D_i,  e)
    objective(theta) = sum_i Huber_delta(log L_hat_i - log L_i),   delta = 1e-3   (the sum, not the mean)

minimised with L-BFGS-B from Chinchilla's grid of 4,500 starts. Uncertainty from a non-parametric
bootstrap over runs, each replicate refitted from one start (the best point, or Hoffmann's values).
The compute-optimal allocation under C = kappa N D (kappa = 6 for the 6ND count; for the project's
FLOPs, kappa = median over the runs of C / (N D), see `flops_per_param_token`) is
    N_opt(C) = G (C/kappa)^(beta/(alpha+beta)),  D_opt(C) = G^-1 (C/kappa)^(alpha/(alpha+beta)),
    G = (alpha A / (beta B))^(1/(alpha+beta)).
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import pandas as pd
from scipy.optimize import minimize

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
    units: int = 0  # the resampling units drawn (the points' count where each is its own)

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
                         description: str = "bootstrap (approach 3)", kappa: float = 6.0,
                         units: Optional[Sequence] = None) -> ChinchillaBootstrap:
    """Non-parametric bootstrap over points (runs): resample with replacement, refit from `init` (the
    full-data best point; default Hoffmann's values), check each replicate's convergence (optimizer
    success and max |gradient| < GRAD_TOL). method: 'L-BFGS-B' or 'BFGS' (Epoch's choice). kappa: the
    allocations' C = kappa N D. units: one label per point; the points of one label are drawn together (a
    cluster bootstrap: the cooldown branches of one trunk, analysis.trunks.resampling_units); default each
    point alone."""
    from rich.progress import track

    log_n, log_d, log_l = _prepare(n, d, loss)
    init = HOFFMANN_THETA if init is None else np.asarray(init, float)
    rng = np.random.default_rng(seed)
    members = unit_members(len(log_n), units)
    k = len(members)
    rows = np.empty((n_boot, 5))
    fun, ok = np.empty(n_boot), np.empty(n_boot, bool)
    opts = LBFGS_TIGHT if method == "L-BFGS-B" else {"gtol": 1e-10, "maxiter": 10_000}
    with single_thread_blas():
        for i in track(range(n_boot), description=description, disable=not progress, transient=True):
            draw = rng.integers(0, k, k)
            idx = draw if k == len(log_n) else np.concatenate([members[u] for u in draw])
            data = (log_n[idx], log_d[idx], log_l[idx], delta)
            res = minimize(huber_lse_objective, init, args=data, jac=True, method=method, options=opts)
            rows[i], fun[i] = res.x, res.fun
            ok[i] = _is_converged(res, data) and res.x[3] > 0 and res.x[4] > 0
    df = pd.DataFrame(_theta_frame(rows))
    df["objective"], df["converged"] = fun, ok
    return ChinchillaBootstrap(replicates=df, seed=seed, init=init, kappa=kappa, units=k)


def unit_members(n_points: int, units: Optional[Sequence] = None) -> list[np.ndarray]:
    """The point indices of each resampling unit, in order of first appearance; each point alone without units."""
    if units is None:
        return [np.array([i]) for i in range(n_points)]
    labels = pd.Series(list(units))
    if len(labels) != n_points:
        raise ValueError(f"units has {len(labels)} labels for {n_points} points")
    return [np.asarray(ix) for ix in labels.groupby(labels, sort=False).indices.values()]


def size_groups(n: np.ndarray, sig: int = 3) -> np.ndarray:
    """Model-size label per row: N rounded to `sig` significant digits (digitised data jitter)."""
    n = np.asarray(n, float)
    mag = 10.0 ** (np.floor(np.log10(n)) - sig + 1)
    return np.round(n / mag) * mag


MIN_POINTS, MIN_SIZES = 6, 3


def why_not(n, d) -> Optional[str]:
    """Why approach 3 cannot be fitted to these points, in words, or None when it can: fewer than MIN_POINTS
    points (it has 5 parameters) or MIN_SIZES sizes, or one tokens-per-parameter ratio (D/N within a factor 2
    everywhere), at which N's term cannot be told from D's and each FLOP budget holds one size."""
    n, d = np.asarray(n, float), np.asarray(d, float)
    sizes = len(np.unique(size_groups(n))) if len(n) else 0
    if len(n) < MIN_POINTS or sizes < MIN_SIZES:
        return (f"{len(n)} point{'s' if len(n) != 1 else ''} over {sizes} size{'s' if sizes != 1 else ''} "
                f"(approach 3 needs >= {MIN_POINTS} points over >= {MIN_SIZES} sizes)")
    ratio = d / n
    if ratio.max() < 2 * ratio.min():
        return (f"every run has D/N between {ratio.min():.3g} and {ratio.max():.3g} (one tokens-per-parameter ratio), "
                "so N's term cannot be told from D's, and each FLOP budget holds one size")
    return None


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
