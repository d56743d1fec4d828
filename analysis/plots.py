"""Figures (matplotlib, Agg backend; each saved as PNG and SVG by `save`).

    plot_curves            a metric against step, tokens and FLOPs, one colour per option of a switch
    plot_loss_vs_compute   final loss against FLOPs per variant, fitted L(C) curves and the frontier
    plot_isoflop           approach 2: parabolas per FLOP budget, and N_opt against C
    plot_ablation          delta against the baseline with 95% CIs, one panel per switch
    plot_maxvio            MoE MaxVio against step, one colour per option
    plot_optimal           approach 3: N_opt(C) and D_opt/N_opt with bootstrap bands, per fit
    plot_approach1         approach 1: loss against compute per size, its fitted line and the envelope's crossovers
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from matplotlib.ticker import LogFormatterSciNotation, LogLocator, NullFormatter, ScalarFormatter  # noqa: E402

PALETTE = plt.rcParams["axes.prop_cycle"].by_key()["color"]
# the figure formats `save` writes: the ones matplotlib's default canvas writes
FORMATS = sorted(matplotlib.backend_bases.FigureCanvasBase.get_supported_filetypes())


def _plain_log(axis) -> None:
    """Log axis over a short range (loss, D/N): ticks at 1, 2, 3, 5 x 10^k with plain labels. Ranges wider
    than two decades keep matplotlib's 10^k labels."""
    axis.axes.autoscale_view()
    lo, hi = axis.get_view_interval()
    if lo > 0 and hi / lo > 100:
        return
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def _decade_labels(axis) -> None:
    """Log axis of large numbers (tokens, FLOPs) over 3x to 100x: ticks at 1, 2, 5 x 10^k labelled in
    powers of ten, the minor ticks unlabelled (matplotlib labels them under about two decades, and the
    labels overlap). Narrower and wider ranges keep matplotlib's ticks."""
    axis.axes.autoscale_view()
    lo, hi = axis.get_view_interval()
    if not 3 * lo < hi < 100 * lo:
        return
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False))
    axis.set_minor_formatter(NullFormatter())


X_LABELS = {"step": "optimizer step", "tokens": "training tokens", "flops": "training FLOPs"}


def save(fig, stem: str | os.PathLike, dpi: int = 80, formats: Sequence[str] = ("png", "svg")) -> list[Path]:
    """Write `stem`.png (always) and `stem`.svg (when in formats), close the figure, return the paths. The
    same figure gives the same bytes (no date in the metadata, fixed SVG ids), so a committed report's
    figures change in git only when what they show does."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix("." + f) for f in dict.fromkeys(("png", *formats))]
    for p in paths:
        with plt.rc_context({"svg.hashsalt": stem.name}):
            fig.savefig(p, dpi=dpi, metadata={"Date": None} if p.suffix == ".svg" else None)
    plt.close(fig)
    return paths


def _colors(options: Sequence) -> dict:
    return {o: PALETTE[i % len(PALETTE)] for i, o in enumerate(options)}


def plot_curves(curves: pd.DataFrame, runs: pd.DataFrame, by: str, metric: str = "loss/val",
                xs: Sequence[str] = ("step", "tokens", "flops"), order: Optional[Sequence] = None,
                title: Optional[str] = None):
    """One panel per x axis; each run a line coloured by its value of column `by` (e.g. a switch or
    'variant'). Panels against tokens and FLOPs are log-scaled and leave out the step-0 point; runs with
    few points get markers. curves: long table from collect; runs: the runs table (run_id and `by`)."""
    c = curves[curves["metric"] == metric].merge(runs[["run_id", by]], on="run_id")
    if c.empty:
        raise ValueError(f"no {metric!r} points for these runs")
    options = list(order) if order is not None else sorted(c[by].unique(), key=str)
    colors = _colors(options)
    fig, axes = plt.subplots(1, len(xs), figsize=(4.2 * len(xs), 3.3), squeeze=False)
    for ax, x in zip(axes[0], xs):
        for rid, g in c.groupby("run_id"):
            g = g.sort_values(x)
            g = g[g[x] > 0] if x != "step" else g  # a log axis has no place for step 0 (0 tokens, 0 FLOPs)
            if g.empty:  # a run that logged no value of this x
                continue
            few = len(g) <= 12  # a short run: markers, so that one or two points still show
            ax.plot(g[x], g["value"], color=colors[g[by].iloc[0]], lw=1.1, alpha=0.75,
                    marker="o" if few else None, ms=3)
        if x != "step":
            ax.set_xscale("log")
            _decade_labels(ax.xaxis)
        ax.set_xlabel(X_LABELS.get(x, x))
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[o], lw=2, label=str(o)) for o in options]
    axes[0][-1].legend(handles=handles, title=by, fontsize=8, title_fontsize=8)
    fig.suptitle(title or f"{metric} by {by}")
    fig.tight_layout()
    return fig


def _loss_against_flops(fig, ax, title: str):
    """Log-log axes of loss against training FLOPs, with their labels, grid, legend and title: the figure."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log(ax.yaxis)
    _decade_labels(ax.xaxis)
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_loss_vs_compute(points: pd.DataFrame, fits: Optional[dict] = None, frontier: bool = True,
                         color_by: str = "variant", extra_curves: Optional[dict] = None,
                         c_col: str = "C", loss_col: str = "loss", title: str = "Loss against compute"):
    """Log-log scatter of loss against FLOPs. fits: {label: object with .predict(C)} drawn over the
    label's range (label = value of `color_by`); extra_curves: {label: callable(C) -> loss} drawn dashed
    over the whole range (e.g. approach 3's compute-optimal frontier). frontier: the Pareto frontier of
    the points as a step line."""
    from analysis.power_law import pareto_frontier

    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    cmin, cmax = points[c_col].min(), points[c_col].max()
    grid = np.geomspace(cmin, cmax, 200)
    if color_by in points and points[color_by].nunique() <= 10:
        options = list(dict.fromkeys(points[color_by]))
        colors = _colors(options)
        for o in options:
            g = points[points[color_by] == o]
            ax.scatter(g[c_col], g[loss_col], s=14, color=colors[o], label=str(o), alpha=0.8)
            if fits and o in fits:
                cg = np.geomspace(g[c_col].min(), g[c_col].max(), 100)
                ax.plot(cg, fits[o].predict(cg), color=colors[o], lw=1.5)
    else:
        sc = ax.scatter(points[c_col], points[loss_col], s=10, c=np.log10(points[color_by]), cmap="viridis",
                        alpha=0.85)
        fig.colorbar(sc, ax=ax, label=f"log10 {color_by}")
    if frontier:
        m = pareto_frontier(points[c_col], points[loss_col])
        f = points[m].sort_values(c_col)
        ax.step(f[c_col], f[loss_col], where="post", color="k", lw=1, alpha=0.6, label="frontier (data)")
    for i, (lab, fn) in enumerate((extra_curves or {}).items()):
        ax.plot(grid, fn(grid), ls="--", lw=1.5, color=PALETTE[(i + 3) % len(PALETTE)], label=lab)
    return _loss_against_flops(fig, ax, title)


def plot_isoflop(table: pd.DataFrame, fit, budget: np.ndarray, n_col: str = "N", loss_col: str = "loss"):
    """Left: loss against N per budget with the fitted parabolas and vertices. Right: N_opt against C
    with the power-law fit. fit: analysis.scaling.IsoFlopFit; budget: budget label per row of table."""
    par = fit.parabolas
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(par)))
    for (_, p), col in zip(par.iterrows(), colors):
        m = budget == p["C"]
        if p["n_runs"] < 3:
            continue
        ax.scatter(table.loc[m, n_col], table.loc[m, loss_col], s=12, color=col)
        if np.isfinite(p["p2"]):
            x = np.linspace(np.log(table.loc[m, n_col].min()), np.log(table.loc[m, n_col].max()), 60)
            ax.plot(np.exp(x), np.polyval([p["p2"], p["p1"], p["p0"]], x), color=col, lw=1,
                    ls="-" if p["valid"] else ":", label=f"{p['C']:.2g}")
        if p["valid"]:
            ax.plot(p["N_opt"], p["L_opt"], "x", color=col, ms=7)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("parameters N")
    ax.set_ylabel("loss")
    ax.set_title("isoFLOP profiles (dotted: not used)", fontsize=10)
    ax.legend(title="C", fontsize=6, title_fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    v = par[par["valid"]]
    bx.scatter(v["C"], v["N_opt"], color="C0", zorder=3)
    cg = np.geomspace(v["C"].min(), v["C"].max(), 50)
    ci = fit.ci()
    interval = f" [{ci.loc['a', 'lo']:.3f}, {ci.loc['a', 'hi']:.3f}]" if np.isfinite(ci.loc["a", "lo"]) else ""
    lab = f"N_opt ∝ C^{fit.a:.3f}" + interval
    bx.plot(cg, fit.n_opt(cg), color="C0", label=lab)
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.yaxis.set_minor_formatter(NullFormatter())
    bx.set_xlabel("training FLOPs C")
    bx.set_ylabel("N_opt")
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


VERDICT_COLORS = {"worse": "C3", "better": "C2"}


def plot_ablation(table: pd.DataFrame):
    """Point plot of delta (option - baseline) with 95% CI, one panel per switch, one row per (option,
    cell, setting). Colour by the table's verdict: red worse, green better (Holm-adjusted p < alpha), grey
    not significant or untested; a legend says so. table: analysis.ablate.ablation_table output."""
    from analysis.tables import fmt

    t = table[table["test"] != "baseline"]
    if t.empty:
        raise ValueError("the ablation table has no non-baseline options")
    switches = list(dict.fromkeys(t["switch"]))
    keys = [*table.columns[3:table.columns.get_loc("cell")], "cell", "rate", "setting"]
    labels = {}
    for s in switches:  # each row named by what tells it apart from the other rows of its switch
        g = t[t["switch"] == s]
        vary = [c for c in keys if c in g and g[c].astype(str).nunique() > 1]
        if "tokens" in vary and "tokens_per_step" in vary:
            vary.remove("tokens_per_step")
        for i, r in g.iterrows():
            where = ", ".join(f"{c}={fmt(r[c])}" if c not in ("cell", "rate", "setting") else str(r[c])
                              for c in vary if fmt(r[c]))
            labels[i] = f"{r['option']}" + (f" ({where})" if where else "") + f"  n={r['n']}"
    heights = [max(1, (t["switch"] == s).sum()) for s in switches]
    width = 4.0 + 0.06 * max(len(v) for v in labels.values())
    fig, axes = plt.subplots(len(switches), 1, figsize=(width, 1.2 + 0.42 * sum(heights) + 0.5 * len(switches)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False, sharex=True, layout="constrained")
    for ax, s in zip(axes[:, 0], switches):
        g = t[t["switch"] == s]
        y = np.arange(len(g))[::-1]
        lo = (g["delta"] - g["delta_lo"]).fillna(0).clip(lower=0)
        hi = (g["delta_hi"] - g["delta"]).fillna(0).clip(lower=0)
        colors = [VERDICT_COLORS.get(v, "C7") for v in g["verdict"]]
        for yi, d, l, h, c in zip(y, g["delta"], lo, hi, colors):
            if np.isfinite(d):
                ax.errorbar([d], [yi], xerr=[[l], [h]], fmt="o", color=c, capsize=3)
        ax.set_yticks(y, [labels[i] for i in g.index], fontsize=8)
        ax.set_ylim(-0.6, len(g) - 0.4)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(f"{s} (baseline {g['baseline'].iloc[0]})", fontsize=9, loc="left")
        ax.grid(alpha=0.3, axis="x")
    n_cmp = table.attrs.get("n_comparisons", len(t))
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=lab) for c, lab in (
        ("C3", "worse (Holm p < 0.05)"), ("C2", "better (Holm p < 0.05)"),
        ("C7", "not significant after Holm, or no test (n < 2)"))]
    # one entry a line: three side by side are wider than a figure of short labels and would be cut off
    fig.legend(handles=handles, loc="outside lower center", ncol=1, fontsize=7, frameon=False,
               title=f"colour: Holm-Bonferroni over {n_cmp} comparisons", title_fontsize=7)
    axes[-1, 0].set_xlabel(f"Δ {table.attrs.get('metric', 'metric')} vs baseline (95% CI)")
    return fig


def plot_maxvio(curves: pd.DataFrame, runs: pd.DataFrame, by: str = "balance", metric: str = "moe/maxvio",
                order: Optional[Sequence] = None):
    """MoE MaxVio (max_j load_j / mean load - 1, averaged over MoE layers) against step, coloured by `by`.
    Returns None when no run logged `metric`."""
    c = curves[curves["metric"] == metric]
    if c.empty:
        return None
    fig = plot_curves(curves, runs, by, metric=metric, xs=("step",), order=order, title=f"{metric} by {by}")
    fig.axes[0].set_yscale("log")
    _plain_log(fig.axes[0].yaxis)
    fig.set_size_inches(5.0, 3.4)
    fig.tight_layout()
    return fig


def plot_optimal(fits: dict, budgets: np.ndarray, boots: Optional[dict] = None, level: float = 0.95):
    """Approach 3's compute-optimal allocation per fit: N_opt(C) (left) and D_opt/N_opt (right), with
    bootstrap percentile bands. fits: {label: ChinchillaFit}; boots: {label: ChinchillaBootstrap}."""
    from analysis.approach3 import THETA_NAMES, optimal_allocation

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    q = (1 - level) / 2
    base_labels = list(dict.fromkeys(lab.split(" (largest")[0] for lab in fits))
    for lab, fit in fits.items():
        base = lab.split(" (largest")[0]
        col = PALETTE[base_labels.index(base) % len(PALETTE)]
        ls = "--" if base != lab else "-"  # leave-largest-out refits dashed, in their fit's colour
        n_opt, d_opt = fit.optimal(budgets)
        ax.plot(budgets, n_opt, color=col, ls=ls, label=lab)
        bx.plot(budgets, d_opt / n_opt, color=col, ls=ls, label=lab)
        if boots and lab in boots and boots[lab].n_converged:
            th = boots[lab].good[list(THETA_NAMES)].to_numpy()
            nb, db = optimal_allocation(th[:, None, :], budgets[None, :], boots[lab].kappa)
            ax.fill_between(budgets, np.quantile(nb, q, 0), np.quantile(nb, 1 - q, 0), color=col, alpha=0.2)
            bx.fill_between(budgets, np.quantile(db / nb, q, 0), np.quantile(db / nb, 1 - q, 0), color=col, alpha=0.2)
    for a, lab in ((ax, "N_opt"), (bx, "D_opt / N_opt")):
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("training FLOPs C")
        a.set_ylabel(lab)
        if lab != "N_opt":
            _plain_log(a.yaxis)
        a.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.suptitle(f"Approach 3 compute-optimal allocation ({int(level * 100)}% bootstrap bands)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_approach1(points: pd.DataFrame, fit):
    """Approach 1 (analysis.approach1): each size's point means against compute with +-1 seed sd of the
    mean, its fitted line over its own points (solid) and beyond them across the data (dotted), and the
    crossovers of the envelope (x: extrapolated, o: within both sizes' compute)."""
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    grid = np.geomspace(points["C"].min(), points["C"].max(), 200)
    sizes = list(fit.fits["N"])
    colors = _colors(sizes)
    sd = fit.noise.sd if fit.noise.known else 0.0
    for n in sizes:
        g = points[points["N"] == n].sort_values("C")
        ax.errorbar(g["C"], g["loss"], yerr=sd / np.sqrt(g["n"]), fmt="o", ms=3.5, color=colors[n], capsize=2,
                    label=f"N = {n:,.0f}")
        own = np.geomspace(g["C"].min(), g["C"].max(), 50)
        ax.plot(grid, fit.predict(n, grid), color=colors[n], lw=0.9, ls=":")
        ax.plot(own, fit.predict(n, own), color=colors[n], lw=1.6)
    for _, c in fit.crossovers.iterrows():
        ax.plot(c["C"], c["loss"], marker="o" if c["in data range"] == "yes" else "x", color="k", ms=7, ls="")
    return _loss_against_flops(fig, ax, f"Approach 1: L(D) per size, {fit.variant}")


def plot_multipliers(mult):
    """Compute multipliers against the baseline per variant: each size's multiplier with its seed-noise
    interval against C (open markers where the baseline's curve is extended beyond its points), and the
    shared fit's multiplier as a band only where that fit is adequate. mult: analysis.multipliers.Multipliers."""
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for i, (v, g) in enumerate(mult.per_size.groupby("variant", sort=False)):
        col = PALETTE[i % len(PALETTE)]
        g = g.sort_values("C")
        err = [(g["multiplier"] - g["lo"]).clip(lower=0).fillna(0), (g["hi"] - g["multiplier"]).clip(lower=0).fillna(0)]
        ax.errorbar(g["C"], g["multiplier"], yerr=err, color=col, capsize=3, lw=1, label=f"{v} per size")
        ext = g["extrapolated"].astype(bool).to_numpy()
        ax.scatter(g["C"][~ext], g["multiplier"][~ext], color=col, zorder=3)
        ax.scatter(g["C"][ext], g["multiplier"][ext], facecolors="white", edgecolors=col, zorder=3)
        fit = mult.fits[(mult.fits["kind"] == "shared") & (mult.fits["variant"] == v)]
        if len(fit) and fit["verdict"].iloc[0] == "adequate":
            f = fit.iloc[0]
            ax.axhline(f["multiplier"], color=col, ls="--", lw=1, label=f"{v} shared fit: {f['multiplier']:.3g}")
            if np.isfinite(f["lo"]):
                ax.axhspan(f["lo"], f["hi"], color=col, alpha=0.12)
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log(ax.yaxis)
    _decade_labels(ax.xaxis)
    ax.set_xlabel("training FLOPs C of the variant's point")
    ax.set_ylabel("compute multiplier vs baseline")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig
