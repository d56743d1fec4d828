"""The switches and their options, as analysis sees them: option order with the K3 default first.

analysis/ reads run directories only and never imports k3lab, so it keeps this copy of
k3lab/switches.py; tests/test_registry.py fails when the two differ.
"""
SWITCH_OPTIONS: dict[str, tuple[str, ...]] = {
    "decay": ("sigmoid", "softplus"),
    "glu": ("situ", "swiglu"),
    "balance": ("qb", "sign", "aux", "none"),
    "optim": ("muon_per_head", "muon", "adamw"),
    "residual": ("block_attnres", "full_attnres", "standard"),
    "moe": ("latent_norm", "latent", "standard", "dense", "dense_matched"),
    "mixer": ("hybrid", "mla", "kda"),
}
SWITCHES: tuple[str, ...] = tuple(SWITCH_OPTIONS)
K3_DEFAULT: dict[str, str] = {switch: options[0] for switch, options in SWITCH_OPTIONS.items()}
