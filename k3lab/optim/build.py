"""Parameter grouping, the optimizer for each `optim` option, and the LR schedule.

One optimizer (`Muon`, whose AdamW groups cover the non-matrix tensors) and one LambdaLR scheduler
per run, so the LightningModule keeps automatic optimisation:

    def configure_optimizers(self):
        return lightning_optimizers(self.model, self.cfg.optim, total_steps=self.max_steps)

Options (`optim.name`):
- muon_per_head: Muon on hidden matrices, Newton-Schulz per head on weights tagged `head_blocks`
  (K3 §2.5, arXiv:2607.24653); AdamW on the rest.
- muon: the same, whole-matrix Newton-Schulz everywhere (`head_blocks` ignored).
- adamw: AdamW on everything at `adam_lr` (hidden matrices join the decayed AdamW group).
All three use the same AdamW arithmetic for the tensors `split_params` sends to AdamW, so an option
changes only how the hidden matrices are updated. A layer may give some of its parameters an AdamW group
of their own (the `adamw_group` tag: AttnRes's pseudo-queries and key-norm gains, with
`residual.query_lr_scale` and `residual.query_weight_decay`); it is the same under every option.

The schedule (`optim.schedule`, lr_lambda): a linear warm-up, then either a cosine to `min_lr_ratio` at the
run's last step (cosine), or warm-up, stable and decay (wsd: the peak rate held until the last `decay_frac`
of the run, then a linear or 1-sqrt decay to `min_lr_ratio`; Hu et al. MiniCPM, arXiv:2404.06395; Hagele
et al., arXiv:2405.18392; Wen et al., arXiv:2410.05192). Both end at the same floor, so a comparison of the
two differs in the shape alone; `optim.min_lr_ratio=0` gives the decay to zero of Hagele et al.

Gradient clipping (`optim.grad_clip`) is the LightningModule's: K3LitModule.configure_gradient_clipping
takes the norm of the DDP-averaged gradients before `step` and hands the factor to `Muon.scale_grads`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from k3lab.config import OptimConfig
from k3lab.switches import check_option
from k3lab.model.tags import AdamWGroup, tags_by_param
from k3lab.optim.muon import Muon

ADAMW_MODULE_NAMES = ("embed", "lm_head")


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split trainable parameters into (muon_params, adamw_params). The rule, in order:

    AdamW takes a parameter if
      1. it has fewer than 2 dims (norm weights, gains, biases, per-head scalars such as A_log), or
      2. it belongs to an nn.Embedding, or to a module whose attribute name is `embed` or `lm_head`
         (at any depth, so a wrapper such as a LightningModule holding `model` is fine), or
      3. it belongs to a convolution (the short depthwise convs: [C, 1, k] kernels are per-channel
         filters, not matrices), or
      4. it is tagged `no_muon` (k3lab/model/tags.py: an escape hatch a layer can set on any tensor), or
         `adamw_group` (an AdamW group of its own, see `param_groups`).
    Muon takes every other parameter: 2-D hidden weights and 3-D stacked expert weights [E, out, in].

    Tied weights are listed once (under their first name). Frozen parameters are left out. The two
    lists partition the trainable parameters: nothing lost, nothing duplicated.
    """
    owner: dict[int, nn.Module] = {}
    owner_name: dict[int, str] = {}
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), mod)
            owner_name.setdefault(id(p), mod_name)
    tags = tags_by_param(model)
    muon, adamw = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        mod, mod_name = owner[id(p)], owner_name[id(p)]
        to_adamw = (
            p.ndim < 2
            or isinstance(mod, nn.Embedding)
            or mod_name.rsplit(".", 1)[-1] in ADAMW_MODULE_NAMES
            or isinstance(mod, nn.modules.conv._ConvNd)
            or tags.get(id(p), {}).get("no_muon", False)
            or "adamw_group" in tags.get(id(p), {})
        )
        (adamw if to_adamw else muon).append(p)
    return muon, adamw


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Param groups for `Muon`: a Muon group (absent under adamw), AdamW with weight decay for
    tensors of >= 2 dims (embedding, head; plus all hidden matrices under adamw), AdamW without
    weight decay for 1-D tensors, and one AdamW group per `adamw_group` tag (k3lab/model/tags.py:
    the AttnRes parameters), named by the tag, at the AdamW rate times its lr_scale and with its weight
    decay. With `embed_lr_scale` other than 1 the input embedding (every nn.Embedding's table) leaves the
    AdamW group for one of its own, `embed`, at that multiple of the AdamW rate, decayed as before. Empty
    groups are dropped; each group has a `name` for logging (`optim/lr_<name>`)."""
    check_option("optim", cfg.name)
    muon, adamw = split_params(model)
    if cfg.name == "adamw":
        muon, adamw = [], muon + adamw
    tags = tags_by_param(model)
    adam_lr = cfg.adam_lr * cfg.lr_scale
    common_adam = dict(use_muon=False, betas=tuple(cfg.betas), eps=cfg.eps)
    own: dict[str, AdamWGroup] = {}  # name -> the tag of the parameters of that group
    for p in adamw:
        spec = tags.get(id(p), {}).get("adamw_group")
        if spec is not None and own.setdefault(spec.name, spec) != spec:
            raise ValueError(f"two adamw_group tags named {spec.name!r} differ: {own[spec.name]} and {spec}")
    embed = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()} \
        if cfg.embed_lr_scale != 1 else set()
    grouped = {id(p) for p in adamw if "adamw_group" in tags.get(id(p), {})}
    plain = [p for p in adamw if id(p) not in grouped and id(p) not in embed]
    groups = [
        dict(name="muon", params=muon, use_muon=True, lr=cfg.lr * cfg.lr_scale, weight_decay=cfg.weight_decay,
             momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps, ns_dtype=cfg.ns_dtype,
             ns_method=cfg.ns_method, per_head=cfg.name == "muon_per_head",
             head_blocks=[tags.get(id(p), {}).get("head_blocks", 0) for p in muon]),
        dict(name="adamw", params=[p for p in plain if p.ndim >= 2], lr=adam_lr, weight_decay=cfg.weight_decay,
             **common_adam),
        dict(name="embed", params=[p for p in adamw if id(p) in embed], lr=adam_lr * cfg.embed_lr_scale,
             weight_decay=cfg.weight_decay, **common_adam),
        dict(name="adamw_no_decay", params=[p for p in plain if p.ndim < 2], lr=adam_lr, weight_decay=0.0,
             **common_adam),
        *(dict(name=name, params=[p for p in adamw if tags.get(id(p), {}).get("adamw_group") == spec],
               lr=adam_lr * spec.lr_scale, weight_decay=spec.weight_decay, **common_adam)
          for name, spec in own.items()),
    ]
    return [g for g in groups if g["params"]]


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """The run's warm-up in steps: `warmup_frac` of total_steps rounded to the nearest step (at least 1)
    when it is set, else `warmup_steps`. A budget-sized run (k3lab.budget) thus warms up over the same
    share of its length at every size."""
    if cfg.warmup_frac is None:
        return cfg.warmup_steps
    if not 0 <= cfg.warmup_frac < 1:
        raise ValueError(f"optim.warmup_frac={cfg.warmup_frac} must be in [0, 1)")
    steps = round(cfg.warmup_frac * total_steps)
    return max(steps, 1) if cfg.warmup_frac > 0 else 0


def decay_steps(cfg: OptimConfig, total_steps: int) -> int:
    """The steps of the final decay under optim.schedule=wsd: `decay_frac` of total_steps rounded to the
    nearest step (0 under cosine, whose decay spans the whole run after the warm-up)."""
    return round(cfg.decay_frac * total_steps) if cfg.schedule == "wsd" else 0


def lr_lambda(warmup_steps: int, total_steps: int, min_lr_ratio: float, schedule: str = "cosine",
              decay_steps: int = 0, decay_shape: str = "sqrt"):
    """Multiplier of the peak LR for optimizer step s (0-based); the same linear warm-up (s+1)/warmup,
    reaching 1 at s = warmup-1, under both schedules, then:

    cosine  from 1 at s = warmup down to min_lr_ratio at s = total_steps;
    wsd     1 (the stable phase) until the decay starts at b = total_steps - decay_steps, then from 1 at
            s = b down to min_lr_ratio at s = total_steps along p = (s - b) / decay_steps:
            linear 1 - p, or sqrt 1 - sqrt(p) (the "1-sqrt" cooldown of Hagele et al., arXiv:2405.18392,
            which ends lower than linear at the same length); decay_steps = 0 is the stable phase alone
            (the trunk of cooldown branches, k3lab/branches.py).

    Flat at the end value after total_steps. Runs too short for the warm-up (debug runs) warm up over half
    of their steps instead; a WSD decay that would start inside the warm-up starts at its end."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be positive")
    warmup_steps = min(warmup_steps, total_steps // 2)
    decay_start = max(total_steps - decay_steps, warmup_steps)
    shapes = {"linear": lambda p: 1 - p, "sqrt": lambda p: 1 - math.sqrt(p)}
    shape = shapes[decay_shape]

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if step < decay_start or decay_start == total_steps:
            return 1.0
        return min_lr_ratio + (1 - min_lr_ratio) * shape(min(1.0, (step - decay_start) / (total_steps - decay_start)))

    return factor


def build_optimizer(model: nn.Module, cfg: OptimConfig, total_steps: int
                    ) -> tuple[Muon, torch.optim.lr_scheduler.LambdaLR]:
    """The run's optimizer and its per-step scheduler (call `scheduler.step()` after each `opt.step()`)."""
    opt = Muon(param_groups(model, cfg))
    factor = lr_lambda(warmup_steps(cfg, total_steps), total_steps, cfg.min_lr_ratio, cfg.schedule,
                       decay_steps(cfg, total_steps), cfg.decay_shape)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def lightning_optimizers(model: nn.Module, cfg: OptimConfig, total_steps: int) -> dict:
    """What LightningModule.configure_optimizers returns: one optimizer, scheduler stepped every step."""
    opt, sched = build_optimizer(model, cfg, total_steps)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}
