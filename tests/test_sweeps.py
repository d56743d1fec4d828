"""Every sweep definition composes, its sweep parameters name real options, every job it launches
composes and types (a key set on an option whose config lacks it fails here, as it would at launch), and
the budget ladders resolve to the runs they promise without training: each run's model is built from its
composed config and its length resolved from the model's parameter counts and FLOPs
(k3lab.budget.run_length)."""
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
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from analysis.isoflop import fit_isoflop, flop_budgets
from analysis.tuning import TUNE_SEED_MIN
from k3lab.budget import run_length
from k3lab.config import OptimConfig, ResidualConfig, run_config
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


def sweep_jobs(name: str, *command_line: str) -> list[list[str]]:
    """The overrides of each job `python run.py -m sweep=<name> <command_line>` launches: the sweep's
    parameters, then the command line, expanded by Hydra's basic sweeper (a key given on the command line
    replaces the sweep's parameter of that key)."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"sweep={name}"], return_hydra_config=True)
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    overrides = OverridesParser.create().parse_overrides([*params, f"sweep={name}", *command_line])
    return BasicSweeper.split_arguments(overrides, None)[0]


def compose_job(job: list[str]):
    """A job's config, composed and typed as run.py types it (switch groups, model, optimizer)."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=job)
    run_config(cfg).model_config(64)
    return cfg


@pytest.mark.parametrize("name", SWEEPS)
def test_every_job_of_a_sweep_composes(name):
    jobs = sweep_jobs(name, "train.max_steps=7")
    assert jobs
    for job in jobs:
        cfg = compose_job(job)
        assert cfg.train.max_steps == 7


TUNING = [n for n in SWEEPS if n.startswith("tune_")]


@pytest.mark.parametrize("name", TUNING)
def test_tuning_sweeps_run_a_grid_per_option_on_tuning_seeds(name):
    """A tuning sweep varies a rate or the option's own step (never averaged: one run each), on seeds that
    analysis treats as tuning seeds, never the reported ones."""
    jobs = sweep_jobs(name)
    cfgs = [compose_job(job) for job in jobs]
    assert all(c.seed >= TUNE_SEED_MIN for c in cfgs)
    tuned = [k for k in ("optim.lr", "optim.adam_lr", "optim.lr_scale", "balance.gamma", "balance.aux_coef",
                         "residual.query_lr_scale")
             if len({str(OmegaConf.select(c, k)) for c in cfgs}) >= 3]
    assert tuned, f"{name} varies no learning rate or balancing step over >= 3 values"
    assert len({tuple(sorted(job)) for job in jobs}) == len(jobs)


def test_optim_grids_give_every_optimizer_its_own_rates():
    """Muon variants get the lr x adam_lr grid; AdamW, which has no Muon lr, gets the adam_lr grid alone."""
    muon = [compose_job(j) for j in sweep_jobs("tune_optim")]
    adamw = [compose_job(j) for j in sweep_jobs("tune_optim_adamw")]
    assert {c.optim.name for c in muon} == {"muon_per_head", "muon"} and {c.optim.name for c in adamw} == {"adamw"}
    for name in ("muon_per_head", "muon"):
        grid = {(c.optim.lr, c.optim.adam_lr) for c in muon if c.optim.name == name}
        assert len(grid) == 9 and 0.006 in {g[0] for g in grid} and 0.01 in {g[1] for g in grid}
    muon_lr = OptimConfig().lr  # AdamW has no Muon rate: its jobs leave it at the default
    assert {c.optim.adam_lr for c in adamw} == {0.005, 0.01, 0.02} and all(c.optim.lr == muon_lr for c in adamw)
    assert {c.group for c in muon + adamw} == {"tune_optim"}
    moe = [compose_job(j) for j in sweep_jobs("tune_moe")]
    assert {c.moe.name for c in moe} == {"latent_norm", "latent", "standard", "dense", "dense_matched"}
    for option in {c.moe.name for c in moe}:
        assert len({(c.optim.lr, c.optim.adam_lr) for c in moe if c.moe.name == option}) == 9, option


def test_residual_grids_give_attnres_its_query_rate_and_the_standard_residual_its_rate():
    """AttnRes (block and full) gets the pseudo-query rate grid, 0 (frozen) to 1, at the run's rate; the
    standard residual, which has no queries, the optim.lr_scale grid; one folder for both."""
    attnres = [compose_job(j) for j in sweep_jobs("tune_residual")]
    standard = [compose_job(j) for j in sweep_jobs("tune_residual_standard")]
    for name in ("block_attnres", "full_attnres"):
        assert sorted(c.residual.query_lr_scale for c in attnres if c.residual.name == name) == [0, 0.03, 0.1, 0.3, 1]
    assert {c.optim.lr_scale for c in attnres} == {1.0}
    assert {c.residual.name for c in standard} == {"standard"}
    unread = (ResidualConfig().query_lr_scale, ResidualConfig().query_weight_decay)
    assert {(c.residual.query_lr_scale, c.residual.query_weight_decay) for c in standard} == {unread}
    assert sorted(c.optim.lr_scale for c in standard) == [0.5, 1, 2]
    assert {c.group for c in attnres + standard} == {"tune_residual"}


def test_reported_seeds_at_the_chosen_rate_are_three_jobs():
    """The command the tuned report prints for the second step (a tuning run's overrides with seed=0,1,2)
    runs exactly the reported seeds at that one setting: its keys replace the sweep's grid."""
    jobs = sweep_jobs("tune_moe", "moe=dense_matched", "optim.lr=0.012", "optim.adam_lr=0.01", "seed=0,1,2")
    cfgs = [compose_job(j) for j in jobs]
    assert sorted(c.seed for c in cfgs) == [0, 1, 2]
    assert {(c.moe.name, c.optim.lr, c.optim.adam_lr, c.group) for c in cfgs} == {("dense_matched", 0.012, 0.01,
                                                                                   "tune_moe")}


@pytest.mark.parametrize("name", [n for n in SWEEPS if "ladder" in n])
def test_ladders_keep_about_eight_attnres_blocks(name):
    for job in sweep_jobs(name):
        cfg = compose_job(job)
        assert cfg.residual.n_blocks == 8
        assert run_config(cfg).residual.n_blocks == 8


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
    model = K3Model(run_config(cfg).model_config(cfg.data.vocab_size))
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
        steps = run_length(run_config(cfg).train, n, fpt, tokens_per_step).max_steps
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


def test_pycode_study_preset_gives_the_planned_runs():
    """conf/experiment/pycode_study.yaml at the depths of results/pycode_study/PLAN.md: every depth has an
    MLA layer (the 3:1 hybrid), 5 tokens per active non-embedding parameter in whole steps of 16 x 2,048,
    and the longest run stays within about 4 epochs of the corpus's 110.5M training tokens."""
    planned = {4: (6_590_476, 1006), 5: (11_595_316, 1770), 6: (18_564_350, 2833), 7: (28_044_778, 4280)}
    for depth, (n_planned, steps_planned) in planned.items():
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["experiment=pycode_study", "data.path=/unused",
                                               f"model.n_layers={depth}"])
        mc = run_config(cfg).model_config(8192)
        model = K3Model(mc)
        n = model.param_counts()["params_active_non_embedding"]
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        steps = run_length(run_config(cfg).train, n, flops_per_token(model, cfg.data.seq_len), tokens_per_step).max_steps
        assert "mla" in mc.layer_kinds() and (n, steps) == (n_planned, steps_planned)
        assert steps * tokens_per_step / 110.5e6 < 4.1
