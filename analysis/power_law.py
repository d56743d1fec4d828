"""Loss against compute per variant: L(C) = L_inf + A (C/C0)^-alpha (fitted in log space), alone or with
L_inf and alpha shared by several variants; the compute-efficient frontier (pareto_frontier) selects a
variant's points."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy.optimize import least_squares


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
