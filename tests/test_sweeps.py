"""Every sweep definition composes and its sweep parameters name real options; the budget ladders resolve
to the runs they promise without training: each run's model is built from its composed config and its
length resolved from the model's parameter counts and FLOPs (k3lab.budget.run_length)."""
import itertools
import math
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from analysis.scaling import fit_isoflop, flop_budgets
from k3lab.budget import run_length
from k3lab.config import model_config
from k3lab.flops import flops_per_token
from k3lab.model import K3Model

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = sorted(p.stem for p in (ROOT / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_composes_and_its_options_exist(name):
    out = subprocess.run([sys.executable, "run.py", f"sweep={name}", "--cfg", "hydra"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    params = yaml.safe_load(out.stdout)["hydra"]["sweeper"]["params"]
    assert params, name
    for key, values in params.items():
        if "." not in key and key != "seed":  # a config group: every option must be a file in conf/<group>
            for option in str(values).split(","):
                assert (ROOT / "conf" / key / f"{option}.yaml").exists(), (name, key, option)


class Run(NamedTuple):
    overrides: tuple[str, ...]
    n: int                # active non-embedding parameters
    flops_per_token: float
    tokens_per_step: int
    steps: int
    flop_budget: float | None


def compose_run(overrides: list[str]):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


@lru_cache(maxsize=None)
def model_counts(sweep: str, model_overrides: tuple[str, ...]) -> tuple[int, float]:
    """(N, FLOPs per token) of the sweep's model with these overrides; the vocabulary is data.vocab_size
    (the sweeps train on the default BPE data, whose tokenizer has exactly that many entries)."""
    cfg = compose_run([f"sweep={sweep}", *model_overrides])
    model = K3Model(model_config(cfg, cfg.data.vocab_size))
    return model.param_counts()["params_active_non_embedding"], flops_per_token(model, cfg.data.seq_len)


def sweep_runs(sweep: str) -> list[Run]:
    """Every run of a sweep (the product of its sweeper params, expanded by Hydra's own parser), resolved."""
    params = compose_run([f"sweep={sweep}"]).hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    runs = []
    for combo in itertools.product(*axes):
        cfg = compose_run([f"sweep={sweep}", *combo])
        n, fpt = model_counts(sweep, tuple(o for o in combo if o.startswith("model.")))
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * cfg.trainer.devices * cfg.trainer.num_nodes
        steps = run_length(cfg.train, n, fpt, tokens_per_step).max_steps
        runs.append(Run(combo, n, fpt, tokens_per_step, steps, cfg.train.flop_budget))
    return runs


def chinchilla_loss(n, d):
    """Hoffmann et al.'s fitted law (arXiv:2203.15556, approach 3): a stand-in for the losses of the runs."""
    return 1.69 + 406.4 / np.asarray(n, float) ** 0.34 + 410.7 / np.asarray(d, float) ** 0.28


@pytest.mark.parametrize("sweep, n_budgets, n_sizes", [("isoflop", 3, 5), ("cpu_isoflop", 3, 4)])
def test_isoflop_sweep_gives_every_budget_at_least_three_sizes(sweep, n_budgets, n_sizes):
    runs = sweep_runs(sweep)
    spent = np.array([r.steps * r.tokens_per_step * r.flops_per_token for r in runs])  # summary.json's `flops`
    for r, c in zip(runs, spent):
        assert r.steps > 0 and r.flop_budget <= c < r.flop_budget + r.tokens_per_step * r.flops_per_token, r
    labels = flop_budgets(spent)  # the grouping analysis.report applies to the runs' FLOPs
    assert len(set(labels)) == len({r.flop_budget for r in runs}) == n_budgets
    for label in set(labels):
        group = [r for r, lab in zip(runs, labels) if lab == label]
        assert len({r.flop_budget for r in group}) == 1
        assert len(group) == len({r.n for r in group}) == len({r.steps for r in group}) == n_sizes >= 3
    # sized so that, were the losses Chinchilla's, approach 2 would find every budget's optimum inside its sizes
    n = np.array([r.n for r in runs])
    d = np.array([r.steps * r.tokens_per_step for r in runs])
    fit = fit_isoflop(n, spent, chinchilla_loss(n, d), n_boot=0)
    assert fit.parabolas["valid"].all() and len(fit.parabolas) == n_budgets, fit.parabolas


@pytest.mark.parametrize("sweep, tokens_per_param", [("ladder_tpp", 20), ("cpu_ladder_tpp", 5)])
def test_tokens_per_param_ladder_gives_each_size_its_tokens(sweep, tokens_per_param):
    runs = sweep_runs(sweep)
    assert len(runs) == len({r.n for r in runs}) >= 4
    for r in runs:
        assert r.steps == math.ceil(tokens_per_param * r.n / r.tokens_per_step), r
        assert (r.steps - 1) * r.tokens_per_step < tokens_per_param * r.n <= r.steps * r.tokens_per_step
