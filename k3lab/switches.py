"""The switches: what each switch changes and where its code lives; conf/ holds their options.

A switch is a Hydra config group (`conf/<switch>/<option>.yaml`) whose option names are what a user
types and what the results table shows. conf/ is the one source of the options: a group's options are
its files, and its K3 default is the group's entry in the defaults list of conf/config.yaml
(`conf_options`, read with a YAML parser); the options are listed with the K3 default first and the
others by name. This module adds what conf/ cannot say: one line on what the options change and where
the code lives. Everything that lists switches or options reads SWITCHES: the config schemas
(k3lab/config.py), the run header, the `switches` field of summary.json, `python run.py --help`;
analysis/switches.py reads conf/ the same way (analysis never imports k3lab), and
tests/test_registry.py checks that both, the schemas and the README's table agree. `GROUPS` says what
each other config group is for.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import yaml

from k3lab.errors import ConfigError, not_an_option

CONF = Path(__file__).resolve().parents[1] / "conf"


def conf_defaults(conf: Path = CONF) -> dict[str, str | None]:
    """{group: default option or None} from the defaults list of conf/config.yaml (Hydra's own entries,
    the schema and `_self_` left out)."""
    defaults = {}
    for entry in yaml.safe_load((conf / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            defaults.update({k: v for k, v in entry.items() if not k.startswith("override ")})
    return defaults


def conf_options(group: str, conf: Path = CONF) -> tuple[str, ...]:
    """The options of a config group: the files of conf/<group>/, its default first, the others by name."""
    default = conf_defaults(conf).get(group)
    return tuple(sorted((f.stem for f in (conf / group).glob("*.yaml")), key=lambda o: (o != default, o)))


class Switch(NamedTuple):
    options: tuple[str, ...]  # from conf/<switch>/; the first is the K3 default
    what: str                 # one line: what the options change
    code: str                 # where the code that the switch changes lives


SWITCHES: dict[str, Switch] = {
    "decay": Switch(conf_options("decay"),
                    "KDA log-decay map: K3's bounded sigmoid (eq. 5) vs Kimi Linear's softplus",
                    "k3lab/model/kda.py (KDA.log_decay)"),
    "glu": Switch(conf_options("glu"),
                  "FFN/expert activation: SiTU x softcap vs SwiGLU",
                  "k3lab/model/ffn.py (glu_combine)"),
    "balance": Switch(conf_options("balance"),
                      "MoE router-bias balancing: Quantile Balancing vs sign update vs aux loss vs none",
                      "k3lab/model/router.py (build_balancer)"),
    "optim": Switch(conf_options("optim"),
                    "optimizer: Muon with per-head Newton-Schulz on Q/K/V vs whole-matrix Muon vs AdamW",
                    "k3lab/optim/build.py, k3lab/optim/muon.py"),
    "residual": Switch(conf_options("residual"),
                       "residual stream: Attention Residuals over blocks / every sublayer vs PreNorm",
                       "k3lab/model/attnres.py, k3lab/model/residual.py"),
    "moe": Switch(conf_options("moe"),
                  "FFN: K3's normalised LatentMoE vs LatentMoE vs full-width MoE vs one dense FFN vs a dense FFN "
                  "with latent_norm's active parameters",
                  "k3lab/model/moe.py, k3lab/model/k3.py (build_ffn)"),
    "mixer": Switch(conf_options("mixer"),
                    "sequence-mixer layout: 3 KDA : 1 gated MLA vs all MLA vs all KDA",
                    "k3lab/config.py (ModelConfig.layer_kinds), k3lab/model/kda.py, k3lab/model/mla.py"),
}

K3_DEFAULT: dict[str, str] = {name: s.options[0] for name, s in SWITCHES.items()}

# The other config groups of conf/: they set up a run (its size, data, machine, mirrors) rather than
# choose an innovation. Their options are the files of conf/<group>/ and their defaults are in the
# defaults list of conf/config.yaml; `python run.py --help` lists both (k3lab/help.py).
GROUPS: dict[str, str] = {
    "model": "model size (ladder: one depth dial, width = model.aspect x model.n_layers); the other model settings "
             "keep their defaults (k3lab/config.py, ModelShape)",
    "data": "what the model reads: State of the Union text (no download), your text (data=text data.path=<file or "
            "folder>), MQAR recall, token shards (data=tokens data.path=<folder from python -m k3lab.data.prepare>), or "
            "any dataset and tokenizer (data=hf data.dataset=<name or path> data.tokenizer=<name or path>)",
    "trainer": "where it trains: the CPU, one GPU, or every GPU of the node (DDP, or FSDP2 sharding)",
    "logger": "mirrors of metrics.jsonl: none, Weights & Biases (offline unless logged in) or TensorBoard; "
              'pip install -e ".[wandb]" or ".[tensorboard]"; both: logger=[wandb,tensorboard]',
    "probes": "long-context recall measured at every validation: none, or MQAR and passkey retrieval at several "
              "lengths (docs/evals.md)",
    "experiment": "presets of several groups and settings (a task with its training length)",
    "sweep": "multirun definitions of sweeps/: python run.py -m sweep=<name>",
    "debug": "checks of a set-up: a few steps of everything, or overfitting one batch",
}


def check_option(switch: str, value: str) -> None:
    """Raise one clear line when `value` is not an option of `switch`."""
    options = SWITCHES[switch].options
    if value not in options:
        raise ConfigError(not_an_option(f"{switch}.name", value, options))
