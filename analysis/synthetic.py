"""Synthetic run directories drawn from a known truth (for tests and example figures).

Loss of a run with N parameters (active, non-embedding) after D tokens: L = E + A/N^alpha + B/D^beta +
delta(option) + noise, where delta is a fixed offset per switch option and noise is Gaussian per seed. A
variant given a compute multiplier m is trained as if it had sqrt(m) x the parameters and tokens, so along a
ladder at a fixed tokens-per-parameter ratio it reaches the baseline's loss at C / m (exactly, when alpha =
beta). FLOPs per token are 6N (C = 6ND). An LR grid adds curvature * (log2(lr / lr_best))^2 per rate, with
its own best rate per option. Each run directory holds what training writes: config.yaml (the resolved
config, bookkeeping keys included), overrides.yaml, metrics.jsonl and summary.json.

    python -m analysis.synthetic OUT_DIR        # an ablation sweep + a scaling ladder + broken runs
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import yaml

from analysis.cells import DEFAULT_BASELINE

TRUTH = {"E": 2.0, "A": 60.0, "B": 150.0, "alpha": 0.3, "beta": 0.3}  # optimum D/N ~ 21
# The settings each option's config group holds, as in conf/ (an option's keys differ from another's).
GROUP_SETTINGS = {("balance", "qb"): {"hist_bins": 0, "iters": 1}, ("balance", "sign"): {"gamma": 1e-3},
                  ("balance", "aux"): {"aux_coef": 1e-2}, ("glu", "situ"): {"b1": 4.0, "b2": 25.0},
                  ("optim", "muon_per_head"): {"lr": 0.006, "adam_lr": 0.01, "weight_decay": 0.1},
                  ("optim", "muon"): {"lr": 0.006, "adam_lr": 0.01, "weight_decay": 0.1},
                  ("optim", "adamw"): {"adam_lr": 0.01, "weight_decay": 0.1},
                  ("moe", "latent_norm"): {"n_experts": 8, "top_k": 2, "latent_ratio": 4},
                  ("moe", "dense_matched"): {"n_experts": 8, "top_k": 2, "latent_ratio": 4}}


def law(n, d, p: dict = TRUTH):
    return p["E"] + p["A"] / np.asarray(n, float) ** p["alpha"] + p["B"] / np.asarray(d, float) ** p["beta"]


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def run_config(switches: dict, seed: int, model: str, run_name: str, group: str, steps: int,
               config: Optional[dict] = None) -> dict:
    """A resolved config like the one run.py writes: bookkeeping keys, the switch groups with their own
    settings, model, data, train and trainer; `config` merged on top (nested dict)."""
    cfg = {"seed": seed, "out_dir": "runs", "group": group, "run_name": run_name, "resume": None, "overwrite": False,
           "kernels": {"backend": "auto", "recompute_states": False, "checkpoint_kda": False},
           "train": {"max_steps": steps, "val_every": 50, "log_every": 10},
           "model": {"name": model, "n_layers": 4, "d_model": 128, "init_std": 0.02},
           **{sw: {"name": opt, **GROUP_SETTINGS.get((sw, opt), {})} for sw, opt in switches.items()},
           "data": {"name": "synthetic", "seq_len": 256, "batch_size": 16, "val_tokens": 65536},
           "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true", "deterministic": None},
           "logger": {"wandb": False}}
    return _merge(cfg, config or {})


def write_run(run_dir: Path, switches: dict, seed: int, n_params: float, tokens: float, final_offset: float,
              rng: np.random.Generator, model: str = "tiny", status: str = "completed", steps: int = 200,
              n_log: int = 20, truncate: bool = False, p: dict = TRUTH, maxvio: Optional[float] = None,
              scale: float = 1.0, noise: float = 0.0, config: Optional[dict] = None,
              overrides: Optional[Sequence[str]] = None, tokens_per_s: float = 1e4, mfu: float = 0.4) -> dict:
    """Write config.yaml, overrides.yaml, metrics.jsonl and summary.json of one synthetic run.

    n_params: N, the active non-embedding parameters (the other counts are derived from it). The
    validation curve is law(scale*N, scale*tokens_t) + final_offset + noise (noise fixed per run), logged
    at step 0 and n_log steps after. maxvio: starting MoE MaxVio, decaying over training (omitted when
    None). config: nested keys merged into config.yaml; overrides: overrides.yaml's list (then `seed=<seed>`),
    by default the switches that differ from the K3 default. tokens_per_s, mfu: the logged throughput and
    utilisation (speed/tokens_per_s, speed/mfu). truncate: the last metrics line cut in half (killed
    mid-write). Returns the summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    n_params = float(int(n_params))  # a parameter count is an integer: C = 6 N D exactly
    tok_per_step = tokens / steps
    flops_per_token = 6.0 * n_params
    run_noise = rng.normal(0.0, noise) if noise else 0.0
    lines = []
    for step in np.concatenate([[0], np.linspace(steps / n_log, steps, n_log).round()]).astype(int):
        t = step * tok_per_step
        lv = float(law(scale * n_params, scale * max(t, tok_per_step / 2), p) + final_offset + run_noise)
        rec = {"step": int(step), "tokens": float(t), "flops": float(t * flops_per_token), "loss/val": lv}
        if step:
            rec.update({"loss/train": lv + 0.02 + float(rng.normal(0, 0.005)), "optim/lr": 0.02 * min(1.0, step / 20),
                        "speed/tokens_per_s": tokens_per_s, "speed/mfu": mfu})
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
    done = status == "completed"
    summary = {
        "status": status, "error": "RuntimeError: loss is NaN at step 57" if status == "failed" else None,
        "run_name": run_dir.name, "group": run_dir.parent.name, "seed": seed, "switches": dict(switches),
        "model": model, "data": "synthetic", "kernels": "torch", "n_layers": 4, "d_model": 128,
        "params_total": int(n_params * 1.6), "params_active": int(n_params * 1.1),
        "params_non_embedding": int(n_params * 1.5), "params_active_non_embedding": int(n_params),
        "steps": steps, "tokens": float(tokens), "tokens_per_step": float(tok_per_step),
        "flops_per_token": flops_per_token, "flops": float(tokens * flops_per_token),
        "flops_6nd": float(6 * n_params * tokens), "tokens_per_s_median": tokens_per_s if done else None,
        "loss_val_final": final if done else None, "loss_val_best": final if done else None,
        "loss_train_final": final + 0.02 if done else None, "acc_val_final": None,
        "unigram_entropy": 7.0, "wall_time_s": 1.0, "git_rev": "synthetic",
        "versions": {"python": "3.11"}, "device": "synthetic",
        "started_at": "2026-11-30T08:00:00Z", "finished_at": "2026-11-30T08:01:00Z",
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    cfg = run_config(switches, seed, model, run_dir.name, run_dir.parent.name, steps, config)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    if overrides is None:
        overrides = [f"{k}={v}" for k, v in switches.items() if DEFAULT_BASELINE.get(k) != v]
    (run_dir / "overrides.yaml").write_text(yaml.safe_dump([*overrides, f"seed={seed}"]))
    return summary


# Known effects of the synthetic ablation sweep (added to the final validation loss).
ABLATION_DELTAS = {("glu", "swiglu"): 0.03, ("balance", "sign"): 0.01, ("balance", "aux"): 0.04,
                   ("residual", "standard"): 0.06, ("optim", "adamw"): 0.08}


def write_ablation_sweep(root: Path, seeds=(0, 1, 2), n_params: float = 2e6, tokens: float = 5e7,
                         seed_noise: float = 0.004, rng_seed: int = 0, broken: bool = True) -> dict:
    """Baseline + one run per (option in ABLATION_DELTAS, seed), each differing from the K3 default in one
    switch, with a per-seed noise shared by all options (so paired tests apply). broken: also a failed run,
    a running one, a directory that never wrote its summary.json ('nosummary-s0') and a truncated last
    metrics line in 'baseline-s2' (still used: its summary and good lines count). Returns {run_id: true
    final offset} of the completed runs."""
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
            write_run(root / rid, sw, s, n_params, tokens, off, rng, truncate=broken and rid == "baseline-s2",
                      maxvio=(1.5 if sw["balance"] == "none" else 0.8 if sw["balance"] == "aux" else 0.5))
            truth[rid] = off
    if broken:
        write_run(root / "failed-s0", {**DEFAULT_BASELINE, "glu": "swiglu"}, 0, n_params, tokens, 0.0, rng,
                  status="failed")
        write_run(root / "running-s0", {**DEFAULT_BASELINE, "glu": "swiglu"}, 9, n_params, tokens, 0.0, rng,
                  status="running")
        write_run(root / "nosummary-s0", dict(DEFAULT_BASELINE), 8, n_params, tokens, 0.0, rng)
        (root / "nosummary-s0" / "summary.json").unlink()
    return truth


def write_scaling_ladder(root: Path, multiplier: float = 2.0, sizes=None, ratio: float = 20.0,
                         seeds=(0,), noise: float = 0.003, rng_seed: int = 1,
                         variant: tuple = ("glu", "swiglu"), throughput: float = 1.0, growth: float = 0.0,
                         mfu: float = 0.4) -> dict:
    """A size ladder at `ratio` tokens per parameter for the baseline and for one variant whose compute
    multiplier at each size is m = multiplier x (C / C_smallest)^growth (C = 6 N D of the size: growth is the
    slope of log m against log C), the variant trained as if N and D were scaled by sqrt(m), and whose
    tokens/s are `throughput` x the baseline's (1e4) in every run, at utilisation `mfu`. Each run's loss gets
    its own N(0, noise). Returns {N: the true multiplier at that size}."""
    rng = np.random.default_rng(rng_seed)
    sizes = np.geomspace(1e5, 3e7, 7) if sizes is None else np.asarray(sizes, float)
    truth = {float(int(n)): multiplier * (n / sizes[0]) ** (2 * growth) for n in sizes}  # C = 6 ratio N^2
    option = {**DEFAULT_BASELINE, variant[0]: variant[1]}
    for label, sw, tps in (("base", dict(DEFAULT_BASELINE), 1e4), (f"{variant[0]}-{variant[1]}", option, 1e4 * throughput)):
        for n in sizes:
            scale = 1.0 if label == "base" else np.sqrt(truth[float(int(n))])
            for s in seeds:
                write_run(root / f"ladder-{label}-n{n:.2g}-s{s}", sw, s, n, ratio * n, 0.0, rng,
                          model=f"n{n:.2g}", scale=scale, noise=noise, tokens_per_s=tps, mfu=mfu)
    return truth


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


def lr_penalty(lr: float, adam_lr: float, best: tuple[float, float], curvature: float = 0.05) -> float:
    """Loss added at (lr, adam_lr) by a grid whose best point is `best`: curvature * (log2 ratio)^2 summed."""
    return curvature * (np.log2(lr / best[0]) ** 2 + np.log2(adam_lr / best[1]) ** 2)


def write_lr_grid(root: Path, switch: str, optima: dict, lrs=(0.003, 0.006, 0.012), adam_lrs=(0.005, 0.01, 0.02),
                  tune_seeds=(1000,), report_seeds=(0, 1, 2), report_all: bool = True, n_params: dict = None,
                  seed_noise: float = 0.003, rng_seed: int = 3) -> dict:
    """A per-variant learning-rate grid for `switch`: optima = {option: (best lr, best adam_lr, offset)};
    every option is run at every (lr, adam_lr) on the tuning seeds and, with report_all, on the reported
    seeds too (else the reported seeds are left to a second sweep). optim=adamw has no Muon lr: its grid
    is adam_lrs alone (its best lr is ignored). Loss = law + offset + lr_penalty + a per-seed noise shared
    by all runs + a per-run noise a quarter its size. n_params: {option: N} (default 2e6 each). Returns
    {run_id: true loss offset}."""
    rng = np.random.default_rng(rng_seed)
    seeds = tuple(tune_seeds) + (tuple(report_seeds) if report_all else ())
    seed_eff = {s: rng.normal(0, seed_noise) for s in seeds}
    truth = {}
    for opt, (lr_best, alr_best, offset) in optima.items():
        sw = {**DEFAULT_BASELINE, switch: opt}
        muon = not (switch == "optim" and opt == "adamw")
        for lr, alr, s in itertools.product(lrs if muon else (lr_best,), adam_lrs, seeds):
            rid = f"{switch}-{opt}-lr{lr:g}-alr{alr:g}-s{s}" if muon else f"{switch}-{opt}-alr{alr:g}-s{s}"
            off = offset + lr_penalty(lr, alr, (lr_best, alr_best)) + seed_eff[s] + rng.normal(0, seed_noise / 4)
            rates = {"lr": lr, "adam_lr": alr} if muon else {"adam_lr": alr}
            write_run(root / rid, sw, s, (n_params or {}).get(opt, 2e6), 5e7, off, rng, config={"optim": rates},
                      overrides=[f"{switch}={opt}", *(f"optim.{k}={v:g}" for k, v in rates.items()),
                                 f"sweep=tune_{switch}"])  # as a multirun records them: the swept keys, then the rest
            truth[rid] = off
    return truth


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
