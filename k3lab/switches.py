"""The switches: one place for every switch, its options and where its code lives.

A switch is a Hydra config group (`conf/<switch>/<option>.yaml`) whose option names are what a user
types and what the results table shows; the first option is the K3 default. Everything that lists
switches or options reads this table: the config schemas (k3lab/config.py), the run header, the
`switches` field of summary.json, `python run.py --help`. `analysis/` keeps its own copy
(analysis/switches.py: analysis never imports k3lab) and tests/test_registry.py checks that the copy,
this table, the files in conf/ and the defaults list of conf/config.yaml agree. `GROUPS` says what each
other config group is for.
"""
from __future__ import annotations

from typing import NamedTuple

from k3lab.errors import ConfigError, not_an_option


class Switch(NamedTuple):
    options: tuple[str, ...]  # the first is the K3 default
    what: str                 # one line: what the options change
    code: str                 # where the code that the switch changes lives


SWITCHES: dict[str, Switch] = {
    "decay": Switch(("sigmoid", "softplus"),
                    "KDA log-decay map: K3's bounded sigmoid (eq. 5) vs Kimi Linear's softplus",
                    "k3lab/model/kda.py (KDA.log_decay)"),
    "glu": Switch(("situ", "swiglu"),
                  "FFN/expert activation: SiTU x softcap vs SwiGLU",
                  "k3lab/model/ffn.py (glu_combine)"),
    "balance": Switch(("qb", "sign", "aux", "none"),
                      "MoE router-bias balancing: Quantile Balancing vs sign update vs aux loss vs none",
                      "k3lab/model/router.py (build_balancer)"),
    "optim": Switch(("muon_per_head", "muon", "adamw"),
                    "optimizer: Muon with per-head Newton-Schulz on Q/K/V vs whole-matrix Muon vs AdamW",
                    "k3lab/optim/build.py, k3lab/optim/muon.py"),
    "residual": Switch(("block_attnres", "full_attnres", "standard"),
                       "residual stream: Attention Residuals over blocks / every sublayer vs PreNorm",
                       "k3lab/model/attnres.py, k3lab/model/residual.py"),
    "moe": Switch(("latent_norm", "latent", "standard", "dense", "dense_matched"),
                  "FFN: K3's normalised LatentMoE vs LatentMoE vs full-width MoE vs one dense FFN vs a dense FFN "
                  "with latent_norm's active parameters",
                  "k3lab/model/moe.py, k3lab/model/k3.py (build_ffn)"),
    "mixer": Switch(("hybrid", "mla", "kda"),
                    "sequence-mixer layout: 3 KDA : 1 gated MLA vs all MLA vs all KDA",
                    "k3lab/config.py (ModelConfig.layer_kinds), k3lab/model/kda.py, k3lab/model/mla.py"),
}

K3_DEFAULT: dict[str, str] = {name: s.options[0] for name, s in SWITCHES.items()}

# The other config groups of conf/: they set up a run (its size, data, machine, mirrors) rather than
# choose an innovation. Their options are the files of conf/<group>/ and their defaults are in the
# defaults list of conf/config.yaml; `python run.py --help` lists both (k3lab/help.py).
GROUPS: dict[str, str] = {
    "model": "model size; each file states every model setting (ladder: one depth dial, width = 64 x model.n_layers)",
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
