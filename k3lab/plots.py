"""Figures of one run, written into its run directory's plots/ folder (matplotlib, Agg backend).

    loss.png, maxvio.png        curves from metrics.jsonl
    depth_rms.png, depth_weights.png, depth_mix.png, depth_diagnostics.json
                                the residual stream's depth diagnostics (the model's
                                `residual.diagnostics()` at the last validation; AttnRes: the
                                mixes' weights, amplitude shares, entropy and query norms)

Comparisons across runs are analysis's job (analysis/plots.py); this module draws one run, and puts the
depth figures of a few runs side by side from what each wrote at its end:

    python -m k3lab.plots RUN_DIR [RUN_DIR ...] --labels A,B --out DIR
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from k3lab.model.residual import SATURATED_WEIGHT  # noqa: E402
from k3lab.rundir import file_name_part, read_metrics, read_summary  # noqa: E402
from k3lab.switches import K3_DEFAULT  # noqa: E402


def run_title(summary: dict) -> str:
    """What a run is, from its summary.json: the switches it sets apart from the K3 default (or "K3
    default"), then its model, data and seed: 'glu=swiglu, optim=adamw\nmodel tiny, data sotu, seed 0'."""
    switches = summary.get("switches") or {}
    differ = [f"{k}={v}" for k, v in switches.items() if K3_DEFAULT.get(k) != v]
    rest = [f"{k} {summary[k]}" for k in ("model", "data", "seed") if summary.get(k) is not None]
    return "\n".join([", ".join(differ) or "K3 default", ", ".join(rest)]).strip()


def write_run_plots(run_dir: Path) -> None:
    """Per-run figures in <run_dir>/plots: the loss curves with the unigram entropy (the loss of a model
    that knows only token frequencies; summary.json's unigram_entropy), and MoE MaxVio when the model
    routes; each titled with what the run is (run_title)."""
    rows = read_metrics(run_dir)
    summary = read_summary(run_dir)
    (run_dir / "plots").mkdir(exist_ok=True)
    panels = [("loss", ["loss/train", "loss/val"]), ("maxvio", ["moe/maxvio"])]
    for name, keys in panels:
        series = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
        if not any(series.values()):
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for k, pts in series.items():
            if pts:
                ax.plot(*zip(*pts), label=k, marker="." if k == "loss/val" else None)
        unigram = summary.get("unigram_entropy")
        if name == "loss" and unigram is not None:
            ax.axhline(unigram, color="0.5", ls="--", lw=1, label=f"unigram entropy {unigram:.3f}")
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        if name == "maxvio":
            ax.set_yscale("log")
        ax.set_title(run_title(summary) if summary else run_dir.name, fontsize=8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(run_dir / "plots" / f"{name}.png", dpi=110)
        plt.close(fig)


def plot_depth_diagnostics(diag: dict, out_dir: str | Path, tag: str = "") -> list[Path]:
    """Write the depth diagnostics as PNGs (matplotlib, Agg backend); returns the paths written.

    diag: one `residual.diagnostics()` dict, or {run label: diagnostics dict} to overlay several runs
    (e.g. standard vs block_attnres, or two query rates); a dict's "step" (set by the training module:
    the validation it comes from) goes into the titles. Files: depth_diagnostics{tag}.json (the numbers,
    NaN written as null), depth_rms{tag}.png (per-sublayer output and input RMS across depth: the
    PreNorm-dilution curve, paper Fig. 5) and, with AttnRes runs among them, depth_weights{tag}[_label].png
    per run (op x source heatmaps: the mean weight beside the amplitude share, weight x source RMS
    normalised over the op's sources) and depth_mix{tag}.png (per op, every AttnRes run overlaid: the
    normalised entropy and the largest weight of the mix, and the pseudo-query norm).
    """
    runs = {diag.get("name", "run"): diag} if "output_rms" in diag else dict(diag)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"depth_diagnostics{tag}.json"
    path.write_text(json.dumps(runs, indent=1).replace("NaN", "null"))
    written = [path]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, d in runs.items():
        for ax, key in zip(axes, ("output_rms", "input_rms")):
            y = d[key]
            ax.plot(range(len(y)), y, marker="o", ms=3, label=_with_step(label, d))
    n = len(next(iter(runs.values()))["output_rms"])
    for ax, title in zip(axes, ("sublayer output RMS  |f_i(x)|", "sublayer input RMS  |h_i| (before PreNorm)")):
        ax.set_title(title)
        ax.set_xlabel("sublayer (layer l: mixer 2l, FFN 2l+1)")
        ax.set_yscale("log")
        ax.set_xticks(range(0, n, max(1, n // 12)))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out_dir / f"depth_rms{tag}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    mixes = {label: d for label, d in runs.items() if d.get("depth_weights") is not None}
    for label, d in mixes.items():
        suffix = "" if len(runs) == 1 else f"_{file_name_part(label)}"
        path = out_dir / f"depth_weights{tag}{suffix}.png"
        _plot_weights_and_shares(d, _with_step(label, d), path)
        written.append(path)
    if mixes:
        path = out_dir / f"depth_mix{tag}.png"
        _plot_mix_statistics(mixes, path)
        written.append(path)
    return written


def _with_step(label: str, diag: dict) -> str:
    """`label`, and the step of the validation the diagnostics come from when it is known."""
    return label if diag.get("step") is None else f"{label}, validation at step {diag['step']}"


def _plot_weights_and_shares(diag: dict, title: str, path: Path) -> None:
    """Two op x source heatmaps side by side: the mean weight alpha and the amplitude share (each cell
    printed when the matrix is small enough to read)."""
    panels = [("mean weight  alpha", diag["depth_weights"]),
              ("amplitude share  alpha x RMS(source), normalised", diag["depth_shares"])]
    n_ops, n_cols = len(diag["op_labels"]), len(diag["column_labels"])
    annotate = n_cols <= 12
    fig, axes = plt.subplots(1, 2, figsize=(2.4 + 1.3 * n_cols, 1.6 + 0.36 * n_ops), sharey=True)
    for ax, (name, matrix) in zip(axes, panels):
        w = np.asarray(matrix, dtype=np.float32)
        im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(n_cols), diag["column_labels"], rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(n_ops), diag["op_labels"], fontsize=8)
        ax.set_xlabel("depth source")
        ax.set_title(name, fontsize=9)
        if annotate:
            for (i, j), v in np.ndenumerate(w):
                if np.isfinite(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if v > 0.6 else "white")
    axes[0].set_ylabel("AttnRes op (input of)")
    fig.colorbar(im, ax=axes, fraction=0.03, pad=0.02)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _plot_mix_statistics(runs: dict, path: Path) -> None:
    """Per op, one line per run: normalised entropy and largest weight (ops over >= 2 sources) and the
    pseudo-query norm."""
    panels = [("entropy", "normalised entropy of the mix\n(1: uniform, 0: one source)", (0, 1.02)),
              ("max_weight", "largest weight  max_s alpha_s\n(token mean)", (0, 1.02)),
              ("query_norm", "pseudo-query norm  ||w||", None)]
    labels = next(iter(runs.values()))["op_labels"]
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 0.55 * len(labels) * 3), 3.8))
    for label, d in runs.items():
        one_source = np.isnan(np.asarray(d["entropy"], dtype=float))  # op 0 reads the embedding alone
        for ax, (key, _, _) in zip(axes, panels):
            y = np.asarray(d[key], dtype=float)
            if key == "max_weight":
                y = np.where(one_source, np.nan, y)
            ax.plot(range(len(y)), y, marker="o", ms=4, label=_with_step(label, d))
    for ax, (key, title, ylim) in zip(axes, panels):
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_xlabel("AttnRes op (input of)")
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    axes[1].axhline(SATURATED_WEIGHT, color="grey", ls=":", lw=1)
    axes[1].annotate(f"saturated ({SATURATED_WEIGHT})", (0, SATURATED_WEIGHT), xytext=(2, -10),
                     textcoords="offset points", fontsize=7, color="grey")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def depth_diagnostics_of(run_dir: Path) -> dict:
    """The depth diagnostics a run wrote at its end (plots/depth_diagnostics.json: {name: diagnostics}),
    with the nulls that stand for NaN read back as NaN."""
    path = Path(run_dir) / "plots" / "depth_diagnostics.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (a run writes it when it completes)")

    def nan(value):
        if isinstance(value, list):
            return [nan(v) for v in value]
        return float("nan") if value is None else value

    (diag,) = json.loads(path.read_text()).values()
    return {key: value if key == "step" else nan(value) for key, value in diag.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m k3lab.plots",
                                     description="The depth figures of several runs side by side (overlaid where "
                                                 "they share axes), from each run's plots/depth_diagnostics.json.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories")
    parser.add_argument("--labels", help="comma-separated labels of the runs in the figures (default: their names)")
    parser.add_argument("--out", required=True, help="folder for the figures")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels names {len(labels)} runs, {len(args.runs)} are given")
    try:
        runs = {label: depth_diagnostics_of(Path(r)) for label, r in zip(labels, args.runs)}
    except FileNotFoundError as err:
        parser.error(str(err))
    for path in plot_depth_diagnostics(runs, args.out):
        print(path)


if __name__ == "__main__":
    main()
