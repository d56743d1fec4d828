"""One source for each fact: conf/ holds the switches' options, k3lab/config.py every default; every
other place that names switches, options or defaults agrees with them.

Adding an option means adding a file in conf/<switch>/ (and a row of the README's table); adding a
switch also a group in the defaults list of conf/config.yaml, an entry in k3lab/switches.py and a schema
in k3lab/config.py; each test here fails when one of them is left out, or when a file of conf/ repeats a
default of the schema.
"""
import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import analysis.switches
from k3lab.config import SWITCH_SCHEMAS, ModelConfig, RunConfig, run_config
from k3lab.model import K3Model
from k3lab.optim import build_optimizer
from k3lab.switches import K3_DEFAULT, SWITCHES

ROOT = Path(__file__).resolve().parents[1]


def test_analysis_copy_equals_the_registry():
    assert analysis.switches.SWITCH_OPTIONS == {name: s.options for name, s in SWITCHES.items()}
    assert analysis.switches.K3_DEFAULT == K3_DEFAULT


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_conf_group_files_are_the_options(switch):
    files = {f.stem: f for f in (ROOT / "conf" / switch).glob("*.yaml")}
    assert set(files) == set(SWITCHES[switch].options)
    for option, f in files.items():
        assert OmegaConf.load(f).name == option, f"{f}: name must be the file's option name"


def test_the_k3_default_is_the_defaults_list_entry_and_comes_first():
    defaults = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["defaults"]
    entries = {k: v for e in defaults if isinstance(e, dict) for k, v in e.items()}
    for switch, spec in SWITCHES.items():
        assert entries[switch] == spec.options[0] == K3_DEFAULT[switch]
        assert sorted(spec.options[1:]) == list(spec.options[1:])


def test_schemas_cover_every_switch_and_default_to_k3():
    assert list(SWITCH_SCHEMAS) == list(SWITCHES)
    for switch, schema in SWITCH_SCHEMAS.items():
        assert schema().name == K3_DEFAULT[switch]


def test_readme_switch_table_lists_every_option_in_order():
    readme = (ROOT / "README.md").read_text()
    for switch, spec in SWITCHES.items():
        row = re.search(rf"^\| `{switch}` \| (.+?) \|", readme, re.M)
        assert row, f"README's switch table has no row for {switch}"
        assert re.findall(r"`([^`]+)`", row.group(1)) == list(spec.options)


def test_registry_points_at_code_that_exists():
    for switch, spec in SWITCHES.items():
        for path in re.findall(r"[\w/]+\.py", spec.code):
            assert (ROOT / path).exists(), (switch, path)


@pytest.mark.parametrize("switch,option", [(s, o) for s, spec in SWITCHES.items() for o in spec.options])
def test_every_option_composes_and_builds(switch, option):
    """Each option composes from conf/, types through its schema and builds the tiny model (or its
    optimizer): an option registered but not implemented fails here."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"{switch}={option}"])
    assert cfg[switch].name == option
    run = run_config(OmegaConf.merge(cfg, {"model": {"n_layers": 2, "d_model": 64}}))
    if switch == "optim":
        model = K3Model(ModelConfig(vocab_size=64, n_layers=2, d_model=64, head_dim=32))
        build_optimizer(model, run.optim, total_steps=2)
        return
    model = K3Model(run.model_config(64))
    assert getattr(model.cfg, switch).name == option


GROUP_FILES = sorted((ROOT / "conf").glob("*/*.yaml"))


def _flat(node, prefix=""):
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def _baseline(data: dict, is_global: bool, group: str) -> dict:
    """What the file's keys are compared with: for a group's file, its section of the schema; for a global
    preset (experiment, debug, sweep), the config composed with the group choices of its own defaults list."""
    if not is_global:
        return {f"{group}.{k}" if k else group: v for k, v in
                _flat(OmegaConf.to_container(OmegaConf.structured(RunConfig))[group]).items()}
    choices = [f"{k.removeprefix('override /')}={v}" for e in data.get("defaults", []) if isinstance(e, dict)
               for k, v in e.items()]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return _flat(OmegaConf.to_container(compose("config", overrides=choices)))


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_file_of_conf_repeats_a_default(path):
    """Every default is written once, in k3lab/config.py: a group's file sets only what its option changes
    (its `name` aside), and a preset only what differs from the config its defaults list composes."""
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    is_global = "@package _global_" in text
    baseline = _baseline(data, is_global, path.parent.name)
    data.pop("defaults", None)
    data.pop("hydra", None)
    prefix = "" if is_global else f"{path.parent.name}."
    repeated = [key for key, value in _flat(data).items() if key.rsplit(".", 1)[-1] != "name"
                and baseline.get(prefix + key, object()) == value]
    assert not repeated, f"{path.relative_to(ROOT)} repeats the defaults of {repeated}"
