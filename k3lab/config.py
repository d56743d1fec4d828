"""Typed schemas for every config group.

Hydra composes `conf/`; `k3lab.train.check_config` merges each group onto its dataclass here before a
run directory is created, so a misspelt key, a wrong type or a value out of range fails at start-up
with one line that names the key (`k3lab.errors.ConfigError`). The model is built from `ModelConfig`
alone, so tests and notebooks can build one without Hydra.

Each switch group (k3lab/switches.py lists them) has a `name` field: the option the user typed, which
is also what the results table shows. A schema's default `name` is the switch's K3 default.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

from k3lab.errors import ConfigError, not_a_key, not_an_option, reading_data
from k3lab.switches import K3_DEFAULT, check_option

KERNEL_BACKENDS = ("auto", "torch", "triton", "fla")
DATASETS = ("sotu", "text", "mqar", "tokens")
TOKENIZERS = ("bpe", "byte")
WANDB_MODES = ("offline", "online", "disabled")
NS_METHODS = ("standard", "gram")  # optim.ns_method (k3lab/optim/muon.py)
SCHEDULES = ("cosine", "wsd")      # optim.schedule (k3lab/optim/build.py lr_lambda)
DECAY_SHAPES = ("sqrt", "linear")  # optim.decay_shape under wsd


def check_choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    """Raise one clear line when `value` of config key `key` is not one of `valid`."""
    if value not in valid:
        raise ConfigError(not_an_option(key, value, valid))


def check_at_least(group: str, obj: object, minimum: int, *keys: str) -> None:
    """Raise one clear line when a field of `obj` (the typed config of `group`) is below `minimum`."""
    for key in keys:
        value = getattr(obj, key)
        if value < minimum:
            raise ConfigError(f"{group}.{key}={value} must be >= {minimum}")


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

    def sublayers_per_block(self, n_sublayers: int) -> int:
        """Sublayers summed into one AttnRes block: 1 under full_attnres, else block_size, or
        ceil(n_sublayers / n_blocks) when n_blocks > 0."""
        if self.name == "full_attnres":
            return 1
        return math.ceil(n_sublayers / self.n_blocks) if self.n_blocks > 0 else self.block_size


@dataclass
class MixerConfig:
    """Sequence-mixer layout: `hybrid` repeats (kda_per_mla x KDA, then 1 x MLA); `mla` / `kda` use one kind."""
    name: str = K3_DEFAULT["mixer"]
    kda_per_mla: int = 3


@dataclass
class KernelsConfig:
    backend: str = "auto"        # auto | torch | triton | fla
    recompute_states: bool = False  # triton: recompute KDA chunk states in the backward (less memory)
    recompute_chunks: bool = False  # triton: keep only KDA's inputs and Tinv, rerun its chunk kernels (implies states)
    keep_intra: bool = False        # triton, with recompute_chunks: keep At and P too, so the rerun skips the intra kernel
    checkpoint_kda: bool = False    # any backend: rerun the short convs and KDA call in the backward, keep their inputs
    checkpoint_experts: bool = False  # rerun the routed experts' GLUs in the backward, keep only their input
    keep_experts: int = 0           # with checkpoint_experts: the last N MoE layers keep their experts' activations
    recompute_glu: bool = False     # dense GLU FFNs: rebuild W3's input in the backward, keep only W1 x and W2 x
    attnres_two_phase: bool = False  # block_attnres: each block's ops mix their completed sources in one pass, then merge their partial sums
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
        check_at_least("model", self, 1, "n_layers", "head_dim")
        if self.kernels.ce_chunk < 0:
            raise ConfigError(f"kernels.ce_chunk={self.kernels.ce_chunk} must be >= 0 (0: 2**26 // vocab tokens)")
        if self.kernels.attnres_two_phase and self.residual.name != "block_attnres":
            raise ConfigError(f"kernels.attnres_two_phase=true acts with residual=block_attnres only "
                              f"(residual={self.residual.name}: no block holds more than one op): set it false")
        if self.kernels.keep_experts < 0:
            raise ConfigError(f"kernels.keep_experts={self.kernels.keep_experts} must be >= 0 (MoE layers, counted "
                              f"from the last, whose experts are not checkpointed)")
        if self.kernels.keep_experts and not self.kernels.checkpoint_experts:
            raise ConfigError("kernels.keep_experts acts with kernels.checkpoint_experts=true only (without it no "
                              "layer checkpoints its experts): set both, or neither")
        if self.kernels.keep_intra and not self.kernels.recompute_chunks:
            raise ConfigError("kernels.keep_intra=true acts with kernels.recompute_chunks=true only (without it the "
                              "forward keeps At and P anyway): set both, or neither")
        if self.width % self.head_dim:
            raise ConfigError(f"model width {self.width} is not a multiple of model.head_dim={self.head_dim}")
        return self


@dataclass
class OptimConfig:
    """Muon (Newton-Schulz, arXiv:2502.16982) on hidden matrices, AdamW on the rest; or AdamW alone."""
    name: str = K3_DEFAULT["optim"]
    lr: float = 6e-3             # Muon lr (update RMS matched to AdamW, so of adam_lr's order)
    adam_lr: float = 1e-2        # AdamW lr for embeddings, head, norms, gains, 1-D params (all params under adamw)
    lr_scale: float = 1.0        # multiplies lr and adam_lr: a one-dimensional rate grid that keeps their ratio
    embed_lr_scale: float = 1.0  # multiplies the input embedding's AdamW rate (a group of its own when not 1)
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "bf16"       # Newton-Schulz precision: bf16 (Muon, Moonlight) or fp32 (exact comparisons)
    ns_method: str = "gram"  # gram: iterate on the Gram matrix; standard: on the matrix itself (same polynomial)
    weight_decay: float = 0.1
    eps: float = 1e-8
    warmup_steps: int = 50
    warmup_frac: Optional[float] = None  # set: the warm-up is this fraction of the run's steps (replaces warmup_steps)
    min_lr_ratio: float = 0.1    # the schedule ends at this fraction of the peak (cosine and wsd alike)
    schedule: str = "cosine"     # cosine | wsd: warm-up, stable at the peak, decay over the last decay_frac
    decay_frac: float = 0.2      # wsd: the share of the run's steps over which the rate decays
    decay_shape: str = "sqrt"    # wsd: sqrt (1 - sqrt(p), arXiv:2405.18392) | linear (1 - p)
    grad_clip: float = 1.0

    def check(self) -> "OptimConfig":
        check_option("optim", self.name)
        check_choice("optim.ns_method", self.ns_method, NS_METHODS)
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_choice("optim.decay_shape", self.decay_shape, DECAY_SHAPES)
        if not self.lr_scale > 0:
            raise ConfigError(f"optim.lr_scale={self.lr_scale} must be > 0 (it multiplies optim.lr and optim.adam_lr)")
        if not self.embed_lr_scale > 0:
            raise ConfigError(f"optim.embed_lr_scale={self.embed_lr_scale} must be > 0 (it multiplies the input "
                              "embedding's AdamW rate)")
        if not 0 < self.decay_frac < 1:
            raise ConfigError(f"optim.decay_frac={self.decay_frac} must be in (0, 1): the share of the run the "
                              "WSD decay takes")
        default = OptimConfig()
        if self.schedule != "wsd":
            for key in ("decay_frac", "decay_shape"):
                if getattr(self, key) != getattr(default, key):
                    raise ConfigError(f"optim.{key}={getattr(self, key)} acts with optim.schedule=wsd only "
                                      f"(optim.schedule={self.schedule}): set optim.schedule=wsd, or drop it")
        return self


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

    def check(self) -> "DataConfig":
        """The settings, and that data.path exists where the corpus needs one (its files are read later)."""
        check_choice("data.name", self.name, DATASETS)
        check_choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        check_at_least("data", self, 1, "seq_len", "batch_size")
        if self.name in ("sotu", "text") and self.tokenizer == "bpe" and self.vocab_size <= 257:
            raise ConfigError(f"data.vocab_size={self.vocab_size} is too small for byte-level BPE (needs > 257); "
                              "use data.tokenizer=byte for plain bytes")
        if self.name in ("text", "tokens"):
            if not self.path:
                raise ConfigError(f"data={self.name} needs data.path=<{'file or folder' if self.name == 'text' else 'folder'}>")
            if not Path(self.path).expanduser().exists():
                raise ConfigError(f"data.path {self.path!r} does not exist")
        return self


@dataclass
class RunConfig:
    """The top-level keys of conf/config.yaml: which run this is and where its directory goes."""
    seed: int = 0
    out_dir: str = "runs"
    group: str = "default"
    run_name: Optional[str] = None   # null: built from the command-line overrides
    resume: Optional[str] = None     # a run directory, or `last`
    overwrite: bool = False


@dataclass
class TrainConfig:
    """How long a run trains (k3lab/budget.py: at most one of max_steps, tokens_per_param and flop_budget;
    none: default_steps) and how often it validates, logs and checkpoints, in optimizer steps."""
    max_steps: Optional[int] = None
    tokens_per_param: Optional[float] = None
    flop_budget: Optional[float] = None
    default_steps: int = 200
    val_every: int = 50          # validate every N steps (and at step 0 and the end)
    val_batches: int = 0         # 0: the whole validation set
    log_every: int = 10
    ckpt_every: int = 50         # 0: only the checkpoint at the end
    compile: Optional[bool] = None   # null: on for GPUs, off for the CPU
    compile_backend: str = "inductor"
    activation_memory_budget: float = 1.0  # compiled models: the fraction of activation memory the backward may keep
    overfit_batches: int = 0     # >0: train (and validate) on that many fixed batches (debug=overfit)
    preempt_signal: Optional[str] = "USR2"  # save at the next logging step and stop (k3lab/preempt.py)
    branches: Optional[list[float]] = None  # a WSD trunk: the budgets of its cooldown branches (k3lab/branches.py)
    trunk: Optional[str] = None  # a cooldown branch: its trunk's run name, a sibling directory of this run's

    def check(self) -> "TrainConfig":
        check_at_least("train", self, 1, "val_every", "log_every")
        check_at_least("train", self, 0, "ckpt_every", "val_batches", "overfit_batches")
        if self.branches is not None:
            if not self.branches or any(not b > 0 for b in self.branches):
                raise ConfigError(f"train.branches={list(self.branches)} must list positive budgets, in the unit of "
                                  "the run-length key (tokens per parameter, FLOPs or steps), e.g. [5,10,20]")
            if self.trunk is not None:
                raise ConfigError(f"train.branches and train.trunk={self.trunk} are both set: a run is a trunk (its "
                                  "branches listed) or a branch (its trunk named), not both")
        if not 0 < self.activation_memory_budget <= 1:
            raise ConfigError(f"train.activation_memory_budget={self.activation_memory_budget} must be in (0, 1]: "
                              "1 keeps what the compiler would, smaller recomputes more in the backward")
        return self


@dataclass
class TrainerConfig:
    """Lightning's Trainer: where a run trains and in which precision (conf/trainer/)."""
    accelerator: str = "cpu"     # cpu | gpu | auto
    devices: int = 1             # -1: every visible GPU
    strategy: str = "auto"       # auto | ddp | any Lightning strategy name
    precision: str = "32-true"   # 32-true | bf16-mixed | 16-mixed | ...
    num_nodes: int = 1
    deterministic: Any = None    # null: on for the CPU, off on GPUs | true | false | warn

    def check(self) -> "TrainerConfig":
        if self.deterministic not in (None, True, False, "warn"):
            raise ConfigError(f"trainer.deterministic={self.deterministic!r} is not an option; "
                              "valid options: null, true, false, warn")
        check_at_least("trainer", self, 1, "num_nodes")
        if self.devices == 0 or self.devices < -1:
            raise ConfigError(f"trainer.devices={self.devices} must be >= 1, or -1 for every visible GPU")
        if self.accelerator in ("gpu", "cuda") and not _cuda_available():
            raise ConfigError(f"trainer.accelerator={self.accelerator} but torch sees no CUDA device; use trainer=cpu "
                              "(or install the torch build that matches the machine's CUDA)")
        return self


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class WandbConfig:
    """Weights & Biases, a mirror of metrics.jsonl (logger=wandb; pip install -e ".[wandb]")."""
    project: str = "k3lab"
    mode: str = "offline"        # offline (files in <run_dir>/wandb, `wandb sync` uploads them) | online | disabled


@dataclass
class TensorBoardConfig:
    """TensorBoard, a mirror of metrics.jsonl (logger=tensorboard; pip install -e ".[tensorboard]")."""
    dir: str = "tensorboard"     # event files go to <run_dir>/<dir>


@dataclass
class LoggerConfig:
    """The mirrors of metrics.jsonl (always written, the source): none, wandb, tensorboard, or both."""
    wandb: Optional[WandbConfig] = None
    tensorboard: Optional[TensorBoardConfig] = None

    def check(self) -> "LoggerConfig":
        if self.wandb is not None:
            check_choice("logger.wandb.mode", self.wandb.mode, WANDB_MODES)
        return self


# --- composed Hydra config -> typed schemas ------------------------------------------------------
# The schema of each switch's config group (tests/test_registry.py: the keys are k3lab.switches.SWITCHES).
SWITCH_SCHEMAS = {"decay": DecayConfig, "glu": GLUConfig, "balance": BalanceConfig, "optim": OptimConfig,
                  "residual": ResidualConfig, "moe": MoEConfig, "mixer": MixerConfig}


def _kind(hint: Any) -> str:
    """What a value of type `hint` is, in words: 'an integer', 'a number or null', ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return f"{_kind(args[0])} or null"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return words.get(hint, f"a {getattr(hint, '__name__', hint)}")


def typed(schema, node) -> object:
    """OmegaConf node -> dataclass instance. An unknown key, a missing value or a wrong type raises
    ConfigError naming the key as the command line spells it (`train.max_steps='abc' is not an integer`)."""
    where = node._get_full_key(None) if isinstance(node, DictConfig) else ""
    def full(key) -> str:
        return f"{where}.{key}" if where else str(key)

    if not isinstance(node, (DictConfig, dict)) and not dataclasses.is_dataclass(node):
        raise ConfigError(f"{getattr(schema, '__name__', schema)} needs a group of key: value settings, not {node!r}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except ConfigKeyError as err:
        raise ConfigError(not_a_key(full(err.full_key), [full(f.name) for f in dataclasses.fields(schema)])) from None
    except MissingMandatoryValue as err:
        raise ConfigError(f"{full(err.full_key)} is not set: add {full(err.full_key)}=<value> to the command") from None
    except ValidationError as err:
        field_name = str(err.full_key).split(".")[-1]
        hint = typing.get_type_hints(schema).get(field_name)
        if hint is None:
            raise ConfigError(f"{full(err.full_key)}: {str(err).splitlines()[0]}") from None
        raise ConfigError(f"{full(err.full_key)}={err.value!r} is not {_kind(hint)}") from None


def model_config(cfg: DictConfig, vocab_size: int) -> ModelConfig:
    """The composed run config -> the ModelConfig the model is built from (every switch group typed)."""
    groups = {name: typed(schema, cfg[name]) for name, schema in SWITCH_SCHEMAS.items() if name != "optim"}
    mc: ModelConfig = typed(ModelConfig, cfg.model)
    for name, value in groups.items():
        setattr(mc, name, value)
    mc.kernels = typed(KernelsConfig, cfg.kernels)
    mc.vocab_size = vocab_size
    return mc.validate()


def check_config(cfg: DictConfig) -> None:
    """Every group of a composed run config through its schema above, data.path (for data=tokens its
    meta.json), and the packages the loggers need. A bad setting raises a UserError, one line naming the
    key; run.py and k3lab.train.train call this before any run directory exists. Cheap: torch is imported
    only to check a GPU accelerator, wandb only when it is asked for."""
    typed(RunConfig, OmegaConf.masked_copy(cfg, [f.name for f in dataclasses.fields(RunConfig)]))
    from k3lab.budget import length_key

    length_key(cfg.train)  # first: it names the run-length keys' rule
    typed(TrainConfig, cfg.train).check()
    data = typed(DataConfig, cfg.data).check()
    if data.name == "tokens":
        from k3lab.data import tokens

        with reading_data():
            tokens.read_meta(data.path)
    model_config(cfg, vocab_size=1)  # every switch, the kernels backend and the model's shape
    optim = typed(OptimConfig, cfg.optim).check()
    train = typed(TrainConfig, cfg.train)
    if (train.branches is not None or train.trunk is not None) and optim.schedule != "wsd":
        key = f"train.branches={list(train.branches)}" if train.branches is not None else f"train.trunk={train.trunk}"
        raise ConfigError(f"{key} needs optim.schedule=wsd (cooldown branches decay from a stable trunk), not "
                          f"optim.schedule={optim.schedule}")
    typed(TrainerConfig, cfg.trainer).check()
    compile_mode(cfg)
    logger = typed(LoggerConfig, cfg.logger).check()
    if logger.wandb is not None:
        require_package("logger=wandb", "wandb", extra="wandb")
    if logger.tensorboard is not None:
        require_package("logger=tensorboard", "tensorboard", "tensorboardX", extra="tensorboard")


def compile_mode(cfg: DictConfig) -> bool:
    """Whether the model is compiled, from train.compile: null means on for GPUs and off for the CPU (where
    compiling a small model costs more than it saves); true and false are passed through. The model is
    compiled with nn.Module.compile (backend train.compile_backend), which compiles its __call__ in place:
    parameter names, state dicts and checkpoints are those of the eager model. A train.activation_memory_budget
    below 1 needs a compiled model (k3lab.train.compile_model)."""
    mode = cfg.train.get("compile")
    if mode not in (None, True, False):
        raise ConfigError(f"train.compile={mode!r} is not an option; valid options: null, true, false")
    compiled = cfg.trainer.accelerator != "cpu" if mode is None else mode
    budget = cfg.train.get("activation_memory_budget", 1.0)
    if budget != 1.0 and not compiled:
        raise ConfigError(f"train.activation_memory_budget={budget} acts on compiled models only, and train.compile="
                          f"{mode} does not compile on trainer.accelerator={cfg.trainer.accelerator} "
                          "(set train.compile=true)")
    return compiled


def require_package(what: str, *modules: str, extra: str) -> None:
    """ConfigError naming the pip extra when none of `modules` can be imported."""
    for module in modules:
        try:
            importlib.import_module(module)
            return
        except ImportError:
            continue
    raise ConfigError(f'{what} needs the {modules[0]} package: pip install -e ".[{extra}]" (or pip install {modules[0]})')
