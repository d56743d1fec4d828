"""The switches and their options as analysis sees them, read from conf/, their one source.

A switch's options are the files of conf/<switch>/, its K3 default the group's entry in the defaults list
of conf/config.yaml; the options are ordered with the K3 default first and the others by name. analysis/
never imports k3lab, so it reads conf/ itself; tests/test_registry.py checks that this equals
k3lab.switches.SWITCHES.
"""
from __future__ import annotations

from pathlib import Path

import yaml

CONF = Path(__file__).resolve().parents[1] / "conf"
SWITCHES: tuple[str, ...] = ("decay", "glu", "balance", "optim", "residual", "moe", "mixer")


def _options() -> dict[str, tuple[str, ...]]:
    entries = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    default = {k: v for e in entries if isinstance(e, dict) for k, v in e.items()}
    return {s: tuple(sorted((f.stem for f in (CONF / s).glob("*.yaml")), key=lambda o: (o != default[s], o)))
            for s in SWITCHES}


SWITCH_OPTIONS: dict[str, tuple[str, ...]] = _options()
K3_DEFAULT: dict[str, str] = {switch: options[0] for switch, options in SWITCH_OPTIONS.items()}
