"""One registry of switches (k3lab/switches.py): every other place that names switches or options agrees.

Adding a switch or an option means touching k3lab/switches.py, analysis/switches.py, a file in
conf/<switch>/, the defaults list of conf/config.yaml and the README's table; each test here fails when
one of them is left out.
"""
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import analysis.switches
from k3lab.config import SWITCH_SCHEMAS, ModelConfig, model_config, typed
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


def test_config_defaults_list_names_every_switch_with_its_k3_default_and_options():
    lines = (ROOT / "conf" / "config.yaml").read_text().splitlines()
    for switch, spec in SWITCHES.items():
        line = next((ln for ln in lines if re.match(rf"\s*- {switch}: ", ln)), None)
        assert line is not None, f"conf/config.yaml defaults list has no entry for {switch}"
        default, _, comment = line.split(":", 1)[1].partition("#")
        assert default.strip() == spec.options[0]
        assert [o.strip() for o in comment.split("|")] == list(spec.options)


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
    if switch == "optim":
        model = K3Model(ModelConfig(vocab_size=64, n_layers=2, d_model=64, head_dim=32))
        build_optimizer(model, typed(SWITCH_SCHEMAS["optim"], cfg.optim), total_steps=2)
        return
    model = K3Model(model_config(OmegaConf.merge(cfg, {"model": {"n_layers": 2, "d_model": 64}}), 64))
    assert getattr(model.cfg, switch).name == option


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_model_files_state_every_model_setting(path):
    """No hidden model setting: each conf/model file names every scalar ModelConfig field (the switch
    groups and the kernels have groups of their own; the vocabulary comes from the data)."""
    from dataclasses import fields

    scalars = {f.name for f in fields(ModelConfig) if f.name not in SWITCHES and f.name not in ("kernels", "vocab_size")}
    assert set(OmegaConf.load(path)) == scalars
