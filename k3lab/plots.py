"""Figures of one run, written into its run directory's plots/ folder (matplotlib, Agg backend).

    loss.png, maxvio.png        curves from metrics.jsonl
    depth_rms.png, depth_weights.png, depth_diagnostics.json
                                the residual stream's depth diagnostics (the model's
                                `residual.diagnostics()` at the last validation)

Comparisons across runs are analysis's job (analysis/plots.py); this module draws one run.
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from k3lab.rundir import read_metrics, read_summary  # noqa: E402
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
    (e.g. standard vs block_attnres) on one RMS plot. Files: depth_diagnostics{tag}.json (the numbers,
    NaN written as null), depth_rms{tag}.png (per-sublayer output
    and input RMS across depth: the PreNorm-dilution curve, paper Fig. 5) and, for each AttnRes run,
    depth_weights{tag}[_label].png (mean alpha, op x source heatmap).
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
            ax.plot(range(len(y)), y, marker="o", ms=3, label=label)
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

    for label, d in runs.items():
        if d.get("depth_weights") is None:
            continue
        w = np.asarray(d["depth_weights"], dtype=np.float32)
        fig, ax = plt.subplots(figsize=(1.2 + 0.45 * w.shape[1], 1.2 + 0.3 * w.shape[0]))
        im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(w.shape[1]), d["column_labels"], rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(w.shape[0]), d["op_labels"], fontsize=7)
        ax.set_xlabel("depth source")
        ax.set_ylabel("AttnRes op (input of)")
        ax.set_title(f"mean depth-attention weights: {label}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
        fig.tight_layout()
        suffix = "" if len(runs) == 1 else f"_{label}"
        path = out_dir / f"depth_weights{tag}{suffix}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
