"""Loss against compute per variant: L(C) = L_inf + A (C/C0)^-alpha (fitted in log space), alone or with
L_inf and alpha shared by several variants; the compute-efficient frontier (pareto_frontier) selects a
variant's points."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


def pareto_frontier(c, loss, rtol: float = 1e-4) -> np.ndarray:
    """Boolean mask of the compute-efficient frontier: the points that no point of at most the same compute
    beats. Computes within `rtol` of each other count as the same (an isoFLOP grid's C = 6 N D, with N an
    integer, differs from its budget in the sixth digit), so a budget keeps its best point alone."""
    c, loss = np.asarray(c, float), np.asarray(loss, float)
    beaten = (c[None, :] <= c[:, None] * (1 + rtol)) & (loss[None, :] < loss[:, None])  # [i, j]: j beats i
    return ~beaten.any(1)


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


def _starts(lmin: float, medians: list[float], init: Optional[np.ndarray]) -> list[list[float]]:
    """Starting points (L_inf, alpha, log A_1..k): `init` alone, else a small grid."""
    if init is not None:
        return [list(init)]
    out = []
    for frac, alpha0 in itertools.product((0.0, 0.5, 0.9), (0.05, 0.2, 0.5)):
        l0 = frac * lmin
        out.append([l0, alpha0] + [np.log(max(m - l0, 1e-6)) for m in medians])
    return out


def fit_loss_vs_compute(c, loss, n_seeds=None, c0: Optional[float] = None,
                        init: Optional[Sequence[float]] = None) -> PowerLawFit:
    """L_inf + A (C/C0)^-alpha on one variant's points (fit_loss_vs_compute_shared with one variant).
    n_seeds: the seeds behind each point's loss (weights; default 1 each)."""
    c, loss = np.asarray(c, float), np.asarray(loss, float)
    if len(c) < 4:
        raise ValueError(f"L(C) has 3 parameters; {len(c)} points are too few")
    n = np.ones(len(c)) if n_seeds is None else np.asarray(n_seeds, float)
    shared = fit_loss_vs_compute_shared({0: (c, loss, n)}, c0=c0, init=init)
    return shared.curve(0)


@dataclass
class SharedPowerLawFit:
    """L_v(C) = L_inf + A_v (C/C0)^-alpha with L_inf and alpha shared by all variants; theta = (L_inf,
    alpha, log A_1, ..., log A_k) in the order of `A`."""
    L_inf: float
    alpha: float
    A: dict
    C0: float
    success: bool

    def curve(self, variant) -> PowerLawFit:
        return PowerLawFit(self.L_inf, self.A[variant], self.alpha, self.C0, self.success)

    @property
    def theta(self) -> np.ndarray:
        return np.array([self.L_inf, self.alpha, *np.log(list(self.A.values()))])

    @property
    def n_params(self) -> int:
        return 2 + len(self.A)


def _weighted_residual(theta: np.ndarray, x: np.ndarray, which: np.ndarray, log_l: np.ndarray,
                       w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted log residuals w (log L_hat - log L) and their Jacobian, batched over replicates.

    theta: (B, 2 + k) = (L_inf, alpha, log A_1..k); x: (P,) log(C / C0); which: (P,) variant index of each
    point; log_l: (B, P); w: (P,). Returns r (B, P) and J (B, P, 2 + k), with e = A_v (C/C0)^-alpha:
    dr/dL_inf = w / L_hat, dr/dalpha = -w x e / L_hat, dr/dlog A_v = w e / L_hat."""
    e = np.exp(theta[:, 2:][:, which] - theta[:, 1:2] * x)
    pred = theta[:, :1] + e
    r = w * (np.log(pred) - log_l)
    jac = np.zeros((*r.shape, theta.shape[1]))
    jac[..., 0] = w / pred
    jac[..., 1] = -w * x * e / pred
    jac[:, np.arange(len(x)), 2 + which] = w * e / pred
    return r, jac


def fit_loss_vs_compute_shared(data: dict, c0: Optional[float] = None,
                               init: Optional[Sequence[float]] = None) -> SharedPowerLawFit:
    """Joint fit with L_inf and alpha shared, one A per variant; data: {variant: (C, loss)} or {variant: (C,
    loss, n_seeds)}: one entry per point, its loss the mean of n_seeds runs (default 1).

    Weighted least squares in log L: residual sqrt(n) L (log L_hat - log L) ~ sqrt(n) (L_hat - L), so that
    the cost is the chi-square of the point means against a seed noise that is the same for every run
    (analysis.noise.adequacy). C0 defaults to the geometric mean of C (conditioning); L_inf in [0, min L),
    alpha in [1e-3, 3]. Solved by levenberg_marquardt from the 9 starts of a small grid at once (init: one
    start, theta, instead); the lowest cost wins."""
    names = list(data)
    x, which, log_l, w, c0 = _stack(data, names, c0)
    lmin = float(np.exp(log_l.min()))
    medians = [float(np.median(np.exp(log_l[which == i]))) for i in range(len(names))]
    starts = np.array(_starts(lmin, medians, None if init is None else np.asarray(init, float)), float)
    theta, cost, ok = levenberg_marquardt(starts, x, which, np.tile(log_l, (len(starts), 1)), w)
    best = int(np.argmin(np.where(np.isfinite(cost), cost, np.inf)))
    return SharedPowerLawFit(L_inf=float(theta[best, 0]), alpha=float(theta[best, 1]),
                             A={v: float(np.exp(theta[best, 2 + i])) for i, v in enumerate(names)}, C0=c0,
                             success=bool(ok[best]))


def _stack(data: dict, names: list, c0: Optional[float]):
    """The points of `data` in one array each: x = log(C/C0), the variant index, log L, the weight sqrt(n) L,
    and C0 (the geometric mean of C unless given)."""
    cs = [np.asarray(data[v][0], float) for v in names]
    ls = [np.asarray(data[v][1], float) for v in names]
    ns = [np.asarray(data[v][2], float) if len(data[v]) > 2 else np.ones(len(cs[i])) for i, v in enumerate(names)]
    c = np.concatenate(cs)
    c0 = float(np.exp(np.log(c).mean())) if c0 is None else float(c0)
    which = np.concatenate([np.full(len(ci), i) for i, ci in enumerate(cs)])
    loss = np.concatenate(ls)
    return np.log(c / c0), which, np.log(loss), np.sqrt(np.concatenate(ns)) * loss, c0


def refit_shared(fit: SharedPowerLawFit, data: dict, losses: dict) -> tuple[np.ndarray, np.ndarray]:
    """The shared fit refitted to B replicates of the point losses at once, each from the fit's own theta.

    data: the fit's data ({variant: (C, loss, n_seeds)}: C, the weights and C0 come from it, so that every
    replicate has the data's weights); losses: {variant: (B, points)} replicate losses. Returns (theta
    (B, 2 + k), ok (B,)) of levenberg_marquardt."""
    names = list(fit.A)
    x, which, _, w, _ = _stack(data, names, fit.C0)
    log_l = np.log(np.concatenate([np.asarray(losses[v], float) for v in names], axis=1))
    theta, _, ok = levenberg_marquardt(np.tile(fit.theta, (len(log_l), 1)), x, which, log_l, w)
    return theta, ok


def levenberg_marquardt(theta: np.ndarray, x: np.ndarray, which: np.ndarray, log_l: np.ndarray, w: np.ndarray,
                        max_iter: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted least squares of the shared L(C) for B problems at once (starts, or bootstrap replicates).

    theta: (B, 2 + k) starts; x, which, w: (P,) as in _weighted_residual; log_l: (B, P). Levenberg-Marquardt
    with the damping scaled by the diagonal, batched in numpy: one (2 + k) linear solve per problem and
    iteration, where scipy.optimize.least_squares would take one Python-level solver call per problem (a
    bootstrap of 1,000 replicates runs in a fraction of a second instead of half a minute; a test checks that
    both reach the same optimum). Bounds L_inf in [0, min L (1 - 1e-9)] and alpha in [1e-3, 3] are kept by
    projection, a parameter at a bound held there while its gradient points out of the box. Returns (theta,
    cost (B,), ok (B,): finite, and converged: the cost no longer falling by 1e-13 of itself, or no step
    left that moves theta)."""
    theta = np.array(theta, float)
    b, k = theta.shape
    upper_linf = np.exp(log_l.min(1)) * (1 - 1e-9)

    def project_rows(t, rows):
        t[:, 0] = np.clip(t[:, 0], 0.0, upper_linf[rows])
        t[:, 1] = np.clip(t[:, 1], 1e-3, 3.0)
        return t

    def project(t):
        return project_rows(t, slice(None))

    theta = project(theta)
    r, jac = _weighted_residual(theta, x, which, log_l, w)
    cost = (r ** 2).sum(1)
    lam = np.full(b, 1e-3)
    settled = np.zeros(b, bool)
    eye = np.eye(k)
    for _ in range(max_iter):
        pending = np.flatnonzero(~settled)  # a settled problem stays settled: it is left alone
        if not len(pending):
            break
        th, rr, jj, lm = theta[pending], r[pending], jac[pending], lam[pending]
        g = (jj.transpose(0, 2, 1) @ rr[..., None])[..., 0]
        h = jj.transpose(0, 2, 1) @ jj
        active = np.zeros(th.shape, bool)  # at a bound, pushed outwards: held this step
        active[:, 0] = (th[:, 0] <= 0) & (g[:, 0] > 0) | (th[:, 0] >= upper_linf[pending]) & (g[:, 0] < 0)
        active[:, 1] = (th[:, 1] <= 1e-3) & (g[:, 1] > 0) | (th[:, 1] >= 3.0) & (g[:, 1] < 0)
        g = np.where(active, 0.0, g)
        h = np.where(active[:, :, None] | active[:, None, :], 0.0, h) + active[:, :, None] * eye
        step = np.linalg.solve(h + lm[:, None, None] * (h * eye + 1e-12 * eye), -g[..., None])[..., 0]
        trial = project_rows(th + step, pending)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            r_t, jac_t = _weighted_residual(trial, x, which, log_l[pending], w)
        cost_t = (r_t ** 2).sum(1)
        better = np.isfinite(cost_t) & (cost_t < cost[pending])
        gain = np.where(better, cost[pending] - cost_t, 0.0)
        tiny = np.abs(trial - th).max(1) <= 1e-12 * (1 + np.abs(th).max(1))
        settled[pending] = ~better & ((lm > 1e6) | tiny) | better & (gain <= 1e-13 * np.maximum(cost[pending], 1e-300))
        up = pending[better]
        theta[up], r[up], jac[up], cost[up] = trial[better], r_t[better], jac_t[better], cost_t[better]
        lam[pending] = np.clip(np.where(better, lm / 3, lm * 4), 1e-12, 1e12)
    return theta, cost, settled & np.isfinite(theta).all(1) & np.isfinite(cost)
