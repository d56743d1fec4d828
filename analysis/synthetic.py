"""Synthetic run directories drawn from a known scaling law (for tests and example figures).

Loss of a run with N parameters after D tokens: L = E + A/N^alpha + B/D^beta + delta(option) + noise,
where delta is a fixed offset per switch option and noise is Gaussian per seed. A variant given a
compute multiplier m is trained as if it had sqrt(m) x the parameters and tokens, so along a ladder at a
fixed tokens-per-parameter ratio it reaches the baseline's loss at C / m (exactly, when alpha = beta).

    python -m analysis.synthetic OUT_DIR        # an ablation sweep + a scaling ladder + 3 broken runs
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from analysis.ablate import DEFAULT_BASELINE

TRUTH = {"E": 2.0, "A": 60.0, "B": 150.0, "alpha": 0.3, "beta": 0.3}  # optimum D/N ~ 21


def law(n, d, p: dict = TRUTH):
    return p["E"] + p["A"] / np.asarray(n, float) ** p["alpha"] + p["B"] / np.asarray(d, float) ** p["beta"]


def write_run(run_dir: Path, switches: dict, seed: int, n_params: float, tokens: float, final_offset: float,
              rng: np.random.Generator, model: str = "tiny", status: str = "completed", steps: int = 200,
              n_log: int = 20, truncate: bool = False, p: dict = TRUTH, maxvio: Optional[float] = None,
              scale: float = 1.0, noise: float = 0.0) -> dict:
    """Write config.yaml, overrides.yaml, metrics.jsonl and summary.json of one synthetic run.

    The validation curve is law(scale*N, scale*tokens_t) + final_offset + noise (noise fixed per run).
    maxvio: starting MoE MaxVio, decaying over training (omitted when None). Returns the summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tok_per_step = tokens / steps
    flops_per_token = 6.0 * n_params
    run_noise = rng.normal(0.0, noise) if noise else 0.0
    lines = []
    for step in np.linspace(steps / n_log, steps, n_log).round().astype(int):
        t = step * tok_per_step
        lv = float(law(scale * n_params, scale * t, p) + final_offset + run_noise)
        rec = {"step": int(step), "tokens": float(t), "flops": float(t * flops_per_token),
               "loss/train": lv + 0.02 + float(rng.normal(0, 0.005)), "loss/val": lv,
               "optim/lr": 0.02 * min(1.0, step / 20)}
        if maxvio is not None:
            rec["moe/maxvio"] = float(maxvio * np.exp(-3 * step / steps) + 0.05 + abs(rng.normal(0, 0.01)))
        lines.append(json.dumps(rec))
    text = "\n".join(lines) + "\n"
    if truncate:
        text = text[: len(text) - len(lines[-1]) // 2 - 1]  # killed mid-write: last line cut in half
    if status == "running":
        text = "\n".join(lines[: n_log // 2]) + "\n"
    (run_dir / "metrics.jsonl").write_text(text)
    final = json.loads(lines[-1])["loss/val"]
    summary = {
        "status": status, "error": "RuntimeError: loss is NaN at step 57" if status == "failed" else None,
        "run_name": run_dir.name, "group": run_dir.parent.name, "seed": seed, "switches": dict(switches),
        "model": model, "data": "synthetic", "kernels": "torch", "n_layers": 4, "d_model": 128,
        "params_total": int(n_params * 1.2), "params_active": int(n_params),
        "params_non_embedding": int(n_params * 0.9), "params_active_non_embedding": int(n_params * 0.9),
        "steps": steps, "tokens": float(tokens), "flops_per_token": flops_per_token,
        "flops": float(tokens * flops_per_token), "flops_6nd": float(6 * n_params * tokens),
        "loss_val_final": final if status == "completed" else None,
        "loss_val_best": final if status == "completed" else None,
        "loss_train_final": final + 0.02 if status == "completed" else None, "acc_val_final": None,
        "unigram_entropy": 7.0, "wall_time_s": 1.0, "git_rev": "synthetic",
        "versions": {"python": "3.11"}, "device": "synthetic",
        "started_at": "2026-11-30T08:00:00Z", "finished_at": "2026-11-30T08:01:00Z",
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    cfg = {"model": {"name": model, **{k: {"name": v} for k, v in switches.items() if k != "optim"}},
           "optim": {"name": switches.get("optim", "muon_per_head"), "lr": 0.02}, "seed": seed}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir / "overrides.yaml").write_text(yaml.safe_dump([f"{k}={v}" for k, v in switches.items()
                                                             if DEFAULT_BASELINE.get(k) != v]))
    return summary


# Known effects of the synthetic ablation sweep (added to the final validation loss).
ABLATION_DELTAS = {("glu", "swiglu"): 0.03, ("balance", "sign"): 0.01, ("balance", "aux"): 0.04,
                   ("residual", "standard"): 0.06, ("optim", "adamw"): 0.08}


def write_ablation_sweep(root: Path, seeds=(0, 1, 2), n_params: float = 2e6, tokens: float = 5e7,
                         seed_noise: float = 0.004, rng_seed: int = 0, broken: bool = True) -> dict:
    """Baseline + one run per (option in ABLATION_DELTAS, seed), each differing from the K3 default in one
    switch, with a per-seed noise shared by all options (so paired tests apply). broken: also a failed,
    a running and a truncated run. Returns {run_id: true final offset}."""
    rng = np.random.default_rng(rng_seed)
    seed_eff = {s: rng.normal(0, seed_noise) for s in seeds}
    truth = {}
    configs = [("baseline", dict(DEFAULT_BASELINE), 0.0)]
    for (sw, opt), d in ABLATION_DELTAS.items():
        configs.append((f"{sw}-{opt}", {**DEFAULT_BASELINE, sw: opt}, d))
    for name, sw, d in configs:
        for s in seeds:
            rid = f"{name}-s{s}"
            off = d + seed_eff[s] + rng.normal(0, seed_noise / 4)
            write_run(root / rid, sw, s, n_params, tokens, off, rng,
                      maxvio=(1.5 if sw["balance"] == "none" else 0.8 if sw["balance"] == "aux" else 0.5))
            truth[rid] = off
    if broken:
        write_run(root / "failed-s0", {**DEFAULT_BASELINE, "glu": "swiglu"}, 0, n_params, tokens, 0.0, rng,
                  status="failed")
        write_run(root / "running-s0", {**DEFAULT_BASELINE, "glu": "swiglu"}, 9, n_params, tokens, 0.0, rng,
                  status="running")
        write_run(root / "truncated-s0", dict(DEFAULT_BASELINE), 7, n_params, tokens, 0.0, rng, truncate=True)
    return truth


def write_scaling_ladder(root: Path, multiplier: float = 2.0, sizes=None, ratio: float = 20.0,
                         seeds=(0,), noise: float = 0.003, rng_seed: int = 1,
                         variant: tuple = ("glu", "swiglu")) -> None:
    """A size ladder at `ratio` tokens per parameter for the baseline and for one variant whose compute
    multiplier is `multiplier` (variant trained as if N and D were scaled by sqrt(multiplier))."""
    rng = np.random.default_rng(rng_seed)
    sizes = np.geomspace(1e5, 3e7, 7) if sizes is None else sizes
    for label, sw, scale in (("base", dict(DEFAULT_BASELINE), 1.0),
                             (f"{variant[0]}-{variant[1]}", {**DEFAULT_BASELINE, variant[0]: variant[1]},
                              np.sqrt(multiplier))):
        for n in sizes:
            for s in seeds:
                write_run(root / f"ladder-{label}-n{n:.2g}-s{s}", sw, s, n, ratio * n, 0.0, rng,
                          model=f"n{n:.2g}", scale=scale, noise=noise)


def write_isoflop_grid(root: Path, budgets=(1e14, 3e14, 1e15, 3e15), n_per_budget: int = 7,
                       noise: float = 0.002, rng_seed: int = 2) -> None:
    """Baseline runs on isoFLOP lines: per budget C, sizes spread around the optimum, D = C / (6N)."""
    rng = np.random.default_rng(rng_seed)
    p = TRUTH
    g = (p["alpha"] * p["A"] / (p["beta"] * p["B"])) ** (1 / (p["alpha"] + p["beta"]))
    for c in budgets:
        n_opt = g * (c / 6) ** (p["beta"] / (p["alpha"] + p["beta"]))
        for n in n_opt * np.geomspace(1 / 6, 6, n_per_budget):
            write_run(root / f"iso-c{c:.1g}-n{n:.3g}", dict(DEFAULT_BASELINE), 0, n, c / (6 * n), 0.0, rng,
                      model=f"n{n:.3g}", noise=noise)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m analysis.synthetic", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="folder to write the synthetic sweep into")
    ap.add_argument("--multiplier", type=float, default=2.0, help="true compute multiplier of the ladder variant")
    args = ap.parse_args(argv)
    root = Path(args.out)
    write_ablation_sweep(root / "ablation")
    write_scaling_ladder(root / "ladder", multiplier=args.multiplier)
    write_isoflop_grid(root / "isoflop")
    print(f"wrote synthetic runs under {root}")


if __name__ == "__main__":
    main()
