"""Optimizers: Muon (whole-matrix or per-head Newton-Schulz) with AdamW for the rest, or AdamW alone."""
from k3lab.optim.build import (build_optimizer, decay_steps, lightning_optimizers, lr_lambda, param_groups,
                               split_params, warmup_steps)
from k3lab.optim.muon import Muon, newton_schulz, orthogonal_update

__all__ = ["Muon", "newton_schulz", "orthogonal_update", "split_params", "param_groups", "lr_lambda",
           "warmup_steps", "decay_steps", "build_optimizer", "lightning_optimizers"]
