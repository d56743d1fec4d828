"""Every sweep definition composes, its sweep parameters name real options, and every job it launches
composes and types (a key set on an option whose config lacks it fails here, as it would at launch)."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from analysis.ablate import TUNE_SEED_MIN
from k3lab.config import SWITCH_SCHEMAS, model_config, typed

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
    for switch, schema in SWITCH_SCHEMAS.items():
        typed(schema, cfg[switch])
    model_config(cfg, 64)
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
    tuned = [k for k in ("optim.lr", "optim.adam_lr", "balance.gamma", "balance.aux_coef")
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
    assert {c.optim.adam_lr for c in adamw} == {0.005, 0.01, 0.02} and all("lr" not in c.optim for c in adamw)
    assert {c.group for c in muon + adamw} == {"tune_optim"}
    moe = [compose_job(j) for j in sweep_jobs("tune_moe")]
    assert {c.moe.name for c in moe} == {"latent_norm", "latent", "standard", "dense", "dense_matched"}
    for option in {c.moe.name for c in moe}:
        assert len({(c.optim.lr, c.optim.adam_lr) for c in moe if c.moe.name == option}) == 9, option


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
        assert typed(SWITCH_SCHEMAS["residual"], cfg.residual).n_blocks == 8
