"""How long a run trains: a number of optimizer steps, or a budget in tokens per parameter or in FLOPs.

Three keys of `train` can set the length; at most one of them may be given (two is an error, raised
before the run directory is made), and with none the run takes `train.default_steps`:

    train.max_steps=N          N optimizer steps
    train.tokens_per_param=R   max_steps = ceil(R * N_params / tokens_per_step),
                               N_params = active non-embedding parameters (`params_active_non_embedding`)
    train.flop_budget=C        max_steps = ceil(C / (flops_per_token * tokens_per_step)),
                               flops_per_token from k3lab.flops (the project's C, LM head and mixing terms in)

Both budgets round up: the run spends at least the budget and less than one step more. tokens_per_step is
the global batch (batch_size * seq_len * devices * nodes), so a budget means the same under DDP. The LR
schedule (warm-up, then cosine to the end) follows the resolved length (k3lab.optim.build.warmup_steps).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

from k3lab.config import TrainConfig
from k3lab.errors import ConfigError

LENGTH_KEYS = ("max_steps", "tokens_per_param", "flop_budget")


class RunLength(NamedTuple):
    """The resolved length and the key that decided it ("default_steps" when none of LENGTH_KEYS was set)."""
    max_steps: int
    set_by: str


def length_key(train: TrainConfig) -> str:
    """Which key decides the run length; raises one ConfigError naming the keys when more than one is set
    or a value is not positive."""
    given = [k for k in LENGTH_KEYS if getattr(train, k) is not None]
    if len(given) > 1:
        values = " ".join(f"train.{k}={getattr(train, k)}" for k in given)
        raise ConfigError(f"{values}: the run length is set by at most one of train.max_steps, "
                         f"train.tokens_per_param and train.flop_budget (a preset such as debug=fast_dev_run "
                         f"sets train.max_steps); drop all but one")
    key = given[0] if given else "default_steps"
    value = getattr(train, key)
    integer = key in ("max_steps", "default_steps")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)) \
            or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ConfigError(f"train.{key}={value!r} must be {kind}")
    return key


def run_length(train: TrainConfig, params_active_non_embedding: int, flops_per_token: float,
               tokens_per_step: int) -> RunLength:
    """The number of optimizer steps the run trains (module docstring), from the model's counts."""
    key = length_key(train)
    if key == "tokens_per_param":
        tokens = Fraction(str(train.tokens_per_param)) * params_active_non_embedding
        steps = math.ceil(tokens / tokens_per_step)
    elif key == "flop_budget":
        steps = math.ceil(Fraction(str(train.flop_budget)) / (Fraction(flops_per_token) * tokens_per_step))
    else:
        steps = int(getattr(train, key))
    return RunLength(steps, key)
