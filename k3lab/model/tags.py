"""Parameter tags: what a layer tells the initialiser and the optimizer about one of its parameters.

| tag | value | set on | read by |
|---|---|---|---|
| `head_blocks` | int H | the Q/K/V projection weights [H*dh, D] of KDA and gated MLA | per-head Muon (k3lab/optim/build.py): Newton-Schulz on each head's row block (K3 §2.5) |
| `output_proj` | True | weights that write into the residual stream (mixer and FFN outputs, expert `w3`, the latent `up`) | `K3Model.init_weights`: std scaled by 1/sqrt(2 n_layers) (GPT-2) |
| `init` | fn(param, generator) -> tensor | KDA's `A_log` and `dt_bias`, the router weight | `K3Model.init_weights`: draws the value instead of the default rule |
| `no_muon` | True | nothing in K3 (an escape hatch for a new layer) | k3lab/optim/build.py: AdamW even for a 2-D matrix |
| `adamw_group` | AdamWGroup(name, lr_scale, weight_decay) | AttnRes pseudo-queries and key-norm gains (`residual.query_lr_scale`, `residual.query_weight_decay`) | k3lab/optim/build.py: an AdamW group of that name, rate optim.adam_lr * optim.lr_scale * lr_scale, that weight decay, under every `optim` |

Tags live on the module that owns the parameter, in a dict keyed by the parameter's local name, not
as attributes of the tensor: `copy.deepcopy`, `load_state_dict`, `.to()` and FSDP2's `fully_shard`
replace or wrap parameter tensors but keep their modules, so the tags survive all of them.

    tag(self.q_proj, "weight", head_blocks=H)      # in a layer's __init__
    named_tags(model)["sublayers.0.fn.q_proj.weight"] == {"head_blocks": H}
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

TAGS = ("head_blocks", "output_proj", "init", "no_muon", "adamw_group")


@dataclass(frozen=True)
class AdamWGroup:
    """The value of the `adamw_group` tag: the parameter trains in the AdamW group `name`, at the run's AdamW
    rate (optim.adam_lr * optim.lr_scale) times `lr_scale`, with decoupled weight decay `weight_decay`."""
    name: str
    lr_scale: float
    weight_decay: float


def tag(module: nn.Module, param_name: str, **tags) -> None:
    """Attach `tags` to `module`'s own parameter `param_name` (unknown tag names raise)."""
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise ValueError(f"unknown parameter tag(s) {unknown}; valid tags: {', '.join(TAGS)}")
    if param_name not in dict(module.named_parameters(recurse=False)):
        raise ValueError(f"{type(module).__name__} has no parameter {param_name!r} to tag")
    vars(module).setdefault("_param_tags", {}).setdefault(param_name, {}).update(tags)


def named_tags(model: nn.Module) -> dict[str, dict]:
    """Fully qualified parameter name -> its tags, for every tagged parameter of `model`."""
    out = {}
    for mod_name, mod in model.named_modules():
        for param_name, tags in vars(mod).get("_param_tags", {}).items():
            out[f"{mod_name}.{param_name}" if mod_name else param_name] = tags
    return out


def tags_by_param(model: nn.Module) -> dict[int, dict]:
    """id(parameter) -> its tags: for code that walks `model.parameters()` (optimizer groups, init)."""
    return {id(mod.get_parameter(name)): tags
            for mod in model.modules() for name, tags in vars(mod).get("_param_tags", {}).items()}
