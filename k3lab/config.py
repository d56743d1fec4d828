"""The run's configuration: one typed schema holding every default, typed once at entry.

Every default is written here, once. `RunConfig` is stored in Hydra's ConfigStore as `k3lab_schema`, the
first entry of conf/config.yaml's defaults list, so every key exists with its default before any file of
conf/ is merged; a file under conf/<group>/ holds only what its option changes (tests/test_registry.py
fails on a file that repeats a default). Hydra checks the type of each command-line value as it composes.
`check_config(cfg)` then types the whole composed config once (`run_config`: OmegaConf.to_object, which
also refuses keys added with `+`) and checks what types cannot say: ranges, settings that would do
nothing with the options they are combined with, paths and optional packages. A bad setting fails with
one line that names the key (`k3lab.errors.ConfigError`) before anything is written; `k3lab.train.train`
and the parts it builds receive the typed sections of the returned `RunConfig`.

Each field's valid range and, for a switch group, the options that read it, sit beside its default
(`setting`). The model is built from `ModelConfig` alone, so tests and notebooks can build one without
Hydra. Each switch group (k3lab/switches.py lists them) has a `name` field: the option the user typed,
which is also what the results table shows; a schema's default `name` is the switch's K3 default.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import operator
import os
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

from k3lab.errors import ConfigError, not_a_key, not_an_option, reading_data
from k3lab.switches import K3_DEFAULT, SWITCHES

KERNEL_BACKENDS = ("auto", "torch", "triton", "fla")
DATASETS = ("sotu", "text", "mqar", "tokens", "hf")
TOKENIZERS = ("bpe", "byte")
WANDB_MODES = ("offline", "online", "disabled")
NS_METHODS = ("standard", "gram")  # optim.ns_method (k3lab/optim/muon.py)
NS_DTYPES = ("bf16", "fp32")       # optim.ns_dtype
SCHEDULES = ("cosine", "wsd")      # optim.schedule (k3lab/optim/build.py lr_lambda)
DECAY_SHAPES = ("sqrt", "linear")  # optim.decay_shape under wsd
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead")  # train.compile_mode: torch.compile's modes the harness runs
MUON_OPTIONS = ("muon_per_head", "muon")
LATENT_MOE = ("latent_norm", "latent")
ROUTED_MOE = ("latent_norm", "latent", "standard")
ATTNRES = ("block_attnres", "full_attnres")  # the residual options with pseudo-queries
SCHEMA_NAME = "k3lab_schema"  # the ConfigStore entry conf/config.yaml starts from
PROBE_OPTIONS = ("none", "recall")  # probes.name (k3lab/probes.py)
CPU_PROBE_LENGTHS = (256, 1024)
GPU_PROBE_LENGTHS = (512, 2048, 8192)


def setting(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, only: tuple[str, ...] | None = None) -> Any:
    """A schema field: its default, its valid range (ge/gt/le/lt) and, in a switch group, the options that
    read it (`only`; None: every option). `check_fields` enforces both."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le, "lt": lt, "only": only})


BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def check_choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    """Raise one clear line when `value` of config key `key` is not one of `valid`."""
    if value not in valid:
        raise ConfigError(not_an_option(key, value, valid))


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(_show, value)) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_fields(group: str, obj: object, typed_keys: frozenset[str] = frozenset()) -> None:
    """Every field of the dataclass `obj` (config group `group`, "" for the top level) against its `setting`
    metadata: a number outside its range is refused; a field that the group's chosen option (obj.name) does
    not read is refused when `typed_keys` (the dotted keys set on the command line) names it."""
    option = getattr(obj, "name", None)
    for f in dataclasses.fields(obj):
        meta, value = f.metadata, getattr(obj, f.name)
        key = f"{group}.{f.name}" if group else f.name
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            for bound, (holds, word) in BOUNDS.items():
                if meta.get(bound) is not None and not holds(v, meta[bound]):
                    raise ConfigError(f"{key}={_show(value)} must be {word} {meta[bound]:g}")
        only = meta.get("only")
        if only and option not in only and key in typed_keys:
            raise ConfigError(f"{key}={_show(value)} acts with {group}={'/'.join(only)} only: {group}={option} does "
                              f"not read it; drop it")


@dataclass
class DecayConfig:
    """KDA log-decay map. sigmoid: g = g_min*sigmoid(exp(A_h)*(z + dt_bias)) (K3 eq. 5, A_h initialised to
    0, fla's safe_gate lower-bound gate: g_min keeps every 16-token sub-tile's cumulative decay within the
    tensor cores' range); softplus: g = -exp(A_h)*softplus(z + dt_bias) (Kimi Linear, arXiv:2510.26692,
    A_h = log U(a_init_min, a_init_max)). dt_bias starts at softplus^-1 of log-uniform[dt_min, dt_max] in both."""
    name: str = K3_DEFAULT["decay"]
    g_min: float = setting(-5.0, lt=0, only=("sigmoid",))  # lower bound of the per-token log-decay
    a_init_min: float = setting(1.0, gt=0, only=("softplus",))
    a_init_max: float = setting(16.0, gt=0, only=("softplus",))
    dt_min: float = setting(1e-3, gt=0)
    dt_max: float = setting(1e-1, gt=0)

    def check(self, typed_keys: frozenset[str] = frozenset()) -> None:
        check_fields("decay", self, typed_keys)
        for low, high in (("a_init_min", "a_init_max"), ("dt_min", "dt_max")):
            if getattr(self, low) > getattr(self, high):
                raise ConfigError(f"decay.{low}={getattr(self, low)} must be <= decay.{high}={getattr(self, high)}")


@dataclass
class GLUConfig:
    """FFN/expert activation. situ: SiTU(W1x; b1) * softcap(W2x; b2); swiglu: silu(W1x) * W2x."""
    name: str = K3_DEFAULT["glu"]
    b1: float = setting(4.0, gt=0, only=("situ",))
    b2: float = setting(25.0, gt=0, only=("situ",))


@dataclass
class MoEConfig:
    """Mixture-of-experts FFN (K3 eq. 11; LatentMoE arXiv:2601.18089). `dense` = one GLU FFN of width
    model.ffn_hidden; `dense_matched` = one GLU FFN with the active parameters of latent_norm at these
    settings (k3lab.model.moe.matched_dense_hidden)."""
    name: str = K3_DEFAULT["moe"]
    n_experts: int = setting(8, ge=1, only=(*ROUTED_MOE, "dense_matched"))  # routed experts before latent scaling
    top_k: int = setting(2, ge=1, only=(*ROUTED_MOE, "dense_matched"))      # experts per token before latent scaling
    n_shared: int = setting(1, ge=0, only=(*ROUTED_MOE, "dense_matched"))   # shared experts, full width
    expert_hidden: int = setting(0, ge=0, only=(*ROUTED_MOE, "dense_matched"))  # one expert's GLU width; 0 = ffn_hidden // top_k
    latent_ratio: int = setting(4, ge=1, only=(*LATENT_MOE, "dense_matched"))  # alpha: experts work in width d_model / alpha
    scale_with_latent: bool = setting(True, only=(*LATENT_MOE, "dense_matched"))  # LatentMoE "acc": n_experts, top_k x alpha
    first_dense: int = setting(1, ge=0, only=ROUTED_MOE)  # the first `first_dense` layers keep a dense FFN (K3 keeps one)
    router_init_std: float = setting(0.02, gt=0, only=ROUTED_MOE)

    def check(self, typed_keys: frozenset[str] = frozenset()) -> None:
        check_fields("moe", self, typed_keys)
        if self.top_k > self.n_experts:
            raise ConfigError(f"moe.top_k={self.top_k} must be <= moe.n_experts={self.n_experts}")


@dataclass
class BalanceConfig:
    """Router-bias balancing: Quantile Balancing (K3 eqs. 13-14), sign update (arXiv:2408.15664),
    Switch auxiliary loss, or none."""
    name: str = K3_DEFAULT["balance"]
    gamma: float = setting(1e-3, gt=0, only=("sign",))    # sign: bias step (DeepSeek-V3)
    aux_coef: float = setting(1e-2, gt=0, only=("aux",))  # aux: loss coefficient
    hist_bins: int = setting(0, ge=0, only=("qb",))       # qb: 0 = exact quantile; >0 = histogram estimator, that many bins
    iters: int = setting(1, ge=1, only=("qb",))           # qb: fixed-point updates per step on the step's scores (1 = K3's rule)


@dataclass
class ResidualConfig:
    """standard = PreNorm residual; full_attnres / block_attnres = Attention Residuals (arXiv:2603.15031).
    block_size counts sublayers (attention and FFN one each), as in the paper: K3's 12 decoder layers per
    block are block_size 24 here; the tiny default's 4 layers make 4 blocks of one layer at block_size 2.
    For a ladder set n_blocks instead (the paper recommends about 8): block_size = ceil(2 n_layers / n_blocks).
    query_lr_scale and query_weight_decay set the AdamW group of the AttnRes parameters, every op's
    pseudo-query and key-norm gain (docs/attnres.md); query_lr_scale 0 keeps them at their initial values
    (uniform mixes); docs/attnres.md says where the default comes from."""
    name: str = K3_DEFAULT["residual"]
    block_size: int = setting(2, ge=1, only=("block_attnres",))
    n_blocks: int = setting(0, ge=0, only=("block_attnres",))  # >0: block_size = ceil(n_sublayers / n_blocks)
    query_lr_scale: float = setting(0.1, ge=0, only=ATTNRES)  # their AdamW rate: optim.adam_lr * optim.lr_scale * this
    query_weight_decay: float = setting(0.0, ge=0, only=ATTNRES)  # their decoupled weight decay (p *= 1 - lr * wd)

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
    kda_per_mla: int = setting(3, ge=1, only=("hybrid",))


@dataclass
class KernelsConfig:
    """How the layers compute (not what): kernel backend and what the backward keeps or recomputes."""
    backend: str = "auto"            # auto (Triton on CUDA when available, else torch) | torch | triton | fla
    recompute_states: bool = False   # triton: recompute the KDA chunk states in the backward instead of keeping them
    recompute_chunks: bool = False   # triton: keep only KDA's inputs and Tinv (as fla keeps its inverse); the backward
                                     # reruns the other chunk kernels and the states
    keep_intra: bool = False         # triton, with recompute_chunks: keep the intra-chunk products At and P too (fp32,
                                     # 2 x 64 per token and head), so the backward's rerun skips the intra-chunk kernel
    checkpoint_kda: bool = False     # any backend: rerun the short convs and the KDA call in the backward, keep their inputs
    checkpoint_experts: bool = False  # MoE: rerun the routed experts' GLUs in the backward, keeping only their gathered
                                     # input (fused Triton kernels on CUDA bf16, kernels/grouped_glu.py; else torch.utils.checkpoint)
    keep_experts: int = setting(0, ge=0)  # with checkpoint_experts: the last N MoE layers keep their experts' activations
    recompute_glu: bool = False      # dense GLU FFNs (dense moe, first_dense layers, shared experts): rebuild W3's input in
                                     # the backward (torch.utils.checkpoint), keeping only W1 x and W2 x
    attnres_two_phase: bool = False  # block_attnres: a block's ops mix its completed sources in one pass when the block
                                     # opens, then each merges its partial sum (arXiv:2603.15031 section 3.2)
    ce_chunk: int = setting(0, ge=0)  # tokens per chunk of the LM head's cross-entropy; 0 = 2**26 // vocab


@dataclass
class ModelShape:
    """The size of the model (conf/model/): explicit (d_model) or from the depth dial d_model = depth * aspect."""
    name: str = "tiny"
    n_layers: int = setting(4, ge=1)
    d_model: int = setting(0, ge=0)         # 0 = n_layers * aspect (the one-dial ladder)
    aspect: int = setting(64, ge=1)
    head_dim: int = setting(64, ge=1)       # KDA and MLA head dimension
    mla_kv_rank: int = setting(0, ge=0)     # MLA's compressed KV width; 0 = d_model // 2
    ffn_mult: float = setting(2.75, gt=0)   # dense FFN hidden = ffn_mult * d_model, rounded to 32 (experts derive from it)
    conv_size: int = setting(4, ge=1)       # KDA's causal short convolution
    vocab_size: int = setting(0, ge=0)      # 0 = taken from the data
    tie_embeddings: bool = False            # K3 unties: tying would put the LM head and embedding under one update rule
    init_std: float = setting(0.02, gt=0)
    norm_eps: float = setting(1e-6, gt=0)

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


@dataclass
class ModelConfig(ModelShape):
    """Everything the model is built from: its shape plus every switch and the kernel settings."""
    decay: DecayConfig = field(default_factory=DecayConfig)
    glu: GLUConfig = field(default_factory=GLUConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    mixer: MixerConfig = field(default_factory=MixerConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)

    def layer_kinds(self) -> list[str]:
        """'kda' or 'mla' for each layer, e.g. hybrid 3:1 over 8 layers: kda kda kda mla kda kda kda mla."""
        if self.mixer.name == "mla":
            return ["mla"] * self.n_layers
        if self.mixer.name == "kda":
            return ["kda"] * self.n_layers
        period = self.mixer.kda_per_mla + 1
        return ["mla" if (i + 1) % period == 0 else "kda" for i in range(self.n_layers)]

    def validate(self) -> "ModelConfig":
        """The options, the shape and the kernel settings that only act with some options."""
        for switch in ("decay", "glu", "balance", "residual", "moe", "mixer"):
            check_choice(f"{switch}.name", getattr(self, switch).name, SWITCHES[switch].options)
        check_choice("kernels.backend", self.kernels.backend, KERNEL_BACKENDS)
        if self.width % self.head_dim:
            raise ConfigError(f"model width {self.width} is not a multiple of model.head_dim={self.head_dim}")
        k = self.kernels
        if k.attnres_two_phase and self.residual.name != "block_attnres":
            raise ConfigError(f"kernels.attnres_two_phase=true acts with residual=block_attnres only "
                              f"(residual={self.residual.name}: no block holds more than one op): set it false")
        if k.keep_experts and not k.checkpoint_experts:
            raise ConfigError("kernels.keep_experts acts with kernels.checkpoint_experts=true only (without it no "
                              "layer checkpoints its experts): set both, or neither")
        if k.keep_intra and not k.recompute_chunks:
            raise ConfigError("kernels.keep_intra=true acts with kernels.recompute_chunks=true only (without it the "
                              "forward keeps At and P anyway): set both, or neither")
        if self.moe.name not in ROUTED_MOE:
            if k.checkpoint_experts:
                raise ConfigError(f"kernels.checkpoint_experts=true acts on routed experts only: moe={self.moe.name} "
                                  f"has none; set it false")
            if self.balance.name != K3_DEFAULT["balance"]:
                raise ConfigError(f"balance={self.balance.name} balances a router, and moe={self.moe.name} has none: "
                                  f"drop balance= (or choose a routed moe: {', '.join(ROUTED_MOE)})")
        if "kda" not in self.layer_kinds() and (k.checkpoint_kda or k.recompute_states or k.recompute_chunks):
            raise ConfigError(f"the kernels.*kda / recompute settings act on KDA layers, and mixer={self.mixer.name} "
                              f"with {self.n_layers} layers has none: set them false")
        return self


@dataclass
class OptimConfig:
    """Muon (Newton-Schulz, arXiv:2502.16982) on hidden matrices, AdamW on the rest; or AdamW alone.
    The rates come from a sweep on model=tiny data=sotu, 600 steps of 16 x 256, seed 0 (final val loss):
    muon_per_head lr/adam_lr 0.006/0.01 3.81, 0.003/0.01 3.82, 0.01/0.01 3.85, 0.006/0.003 3.96,
    0.02/0.003 4.14, 0.04/0.003 4.14; adamw adam_lr 0.001 4.41, 0.003 4.15, 0.01 4.12, 0.03 4.14."""
    name: str = K3_DEFAULT["optim"]
    lr: float = setting(6e-3, gt=0, only=MUON_OPTIONS)  # Muon peak lr (update RMS matched to AdamW, so of adam_lr's order)
    adam_lr: float = setting(1e-2, gt=0)   # AdamW peak lr: embeddings, head, norms, gains, 1-D (every param under adamw)
    lr_scale: float = setting(1.0, gt=0)   # multiplies lr and adam_lr: a one-dimensional rate grid that keeps their ratio
    embed_lr_scale: float = setting(1.0, gt=0)  # multiplies the input embedding's AdamW rate (a group of its own when not 1)
    betas: tuple[float, float] = setting((0.9, 0.95), ge=0, lt=1)  # AdamW
    momentum: float = setting(0.95, ge=0, lt=1, only=MUON_OPTIONS)  # Muon, Nesterov
    nesterov: bool = setting(True, only=MUON_OPTIONS)
    ns_steps: int = setting(5, ge=1, only=MUON_OPTIONS)
    ns_dtype: str = setting("bf16", only=MUON_OPTIONS)  # bf16 (Muon, Moonlight) or fp32 (exact comparisons)
    ns_method: str = setting("gram", only=MUON_OPTIONS)  # gram: iterate on the Gram matrix; standard: on the matrix (muon.py)
    weight_decay: float = setting(0.1, ge=0)  # decoupled, p *= 1 - lr*wd (none on 1-D tensors)
    eps: float = setting(1e-8, gt=0)          # AdamW
    warmup_steps: int = setting(50, ge=0)     # linear warm-up, then the schedule
    warmup_frac: Optional[float] = setting(None, ge=0, lt=1)  # set: the warm-up is this share of the run (replaces warmup_steps)
    min_lr_ratio: float = setting(0.1, ge=0, le=1)  # the schedule ends at this fraction of the peak (cosine and wsd alike)
    schedule: str = "cosine"                  # cosine | wsd: warm-up, stable at the peak, decay over the last decay_frac
    decay_frac: float = setting(0.2, gt=0, lt=1)  # wsd: the share of the run's steps over which the rate decays
    decay_shape: str = "sqrt"                 # wsd: sqrt (1 - sqrt(p), arXiv:2405.18392) | linear (1 - p)
    grad_clip: float = setting(1.0, ge=0)     # global grad-norm clip (0: none): the trainer's factor, applied in the step

    def check(self, typed_keys: frozenset[str] = frozenset()) -> None:
        check_choice("optim.name", self.name, SWITCHES["optim"].options)
        check_choice("optim.ns_method", self.ns_method, NS_METHODS)
        check_choice("optim.ns_dtype", self.ns_dtype, NS_DTYPES)
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_choice("optim.decay_shape", self.decay_shape, DECAY_SHAPES)
        check_fields("optim", self, typed_keys)
        if self.schedule != "wsd":
            for key in ("decay_frac", "decay_shape"):
                if getattr(self, key) != OptimConfig.__dataclass_fields__[key].default:
                    raise ConfigError(f"optim.{key}={_show(getattr(self, key))} acts with optim.schedule=wsd only "
                                      f"(optim.schedule={self.schedule}): set optim.schedule=wsd, or drop it")


@dataclass
class DataConfig:
    """What the model reads: a document corpus tokenised and cached here (sotu, text), MQAR, token shards
    prepared once by `python -m k3lab.data.prepare` (tokens, docs/data.md), or any dataset and tokenizer,
    made into token shards at the first use (hf, k3lab/data/hf.py)."""
    name: str = "sotu"           # sotu | text | mqar | tokens | hf
    seq_len: int = setting(256, ge=1)
    batch_size: int = setting(16, ge=1)
    vocab_size: int = setting(1024, ge=1, only=("sotu", "text", "hf"))  # BPE vocabulary (token shards carry their own)
    # bpe | byte (sotu / text); hf: bpe or a pretrained tokenizer (a name, a tokenizer.json, a folder with one)
    tokenizer: str = setting("bpe", only=("sotu", "text", "hf"))
    path: Optional[str] = setting(None, only=("text", "tokens"))  # text: a file or folder of .txt / .jsonl; tokens: a folder
    val_fraction: float = setting(0.05, gt=0, lt=1, only=("sotu", "text", "hf"))  # share of documents held out
    cache_dir: str = "${oc.env:K3LAB_CACHE,'~/.cache/k3lab'}"  # sotu / text token cache; env K3LAB_CACHE overrides
    num_workers: int = setting(0, ge=0)
    # mqar (Zoology, arXiv:2312.04927)
    n_kv_pairs: int = setting(16, ge=1, only=("mqar",))
    mqar_vocab: int = setting(256, ge=8, only=("mqar",))
    n_train_examples: int = setting(100_000, ge=1, only=("mqar",))
    n_val_examples: int = setting(2_000, ge=1, only=("mqar",))
    mqar_power_a: float = setting(0.01, gt=0, only=("mqar",))  # query-gap power-law exponent (Zoology's default)
    mqar_random_non_queries: bool = setting(False, only=("mqar",))  # random filler tokens instead of 0
    # validation (sotu / text / tokens / hf): at most this many target tokens, in non-overlapping windows
    val_tokens: int = setting(65_536, ge=1, only=("sotu", "text", "tokens", "hf"))
    # hf (k3lab/data/hf.py)
    dataset: Optional[str] = setting(None, only=("hf",))      # a Hugging Face dataset name, or a local folder or file
    hf_config: Optional[str] = setting(None, only=("hf",))    # the dataset's configuration (subset)
    hf_split: Optional[str] = setting(None, only=("hf",))     # its split; null: train
    text_column: Optional[str] = setting(None, only=("hf",))  # the column that holds the text; null: text
    max_docs: Optional[int] = setting(None, ge=2, only=("hf",))  # the first N documents of the split only
    eod_token: Optional[str] = setting(None, only=("hf",))    # a pretrained tokenizer's end-of-document token;
                                                             # null: its eos, bos or sep

    def check(self, typed_keys: frozenset[str] = frozenset()) -> "DataConfig":
        """The settings, and that data.path exists where the corpus needs one (its files are read later)."""
        check_choice("data.name", self.name, DATASETS)
        if self.name != "hf":
            check_choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        check_fields("data", self, typed_keys)
        self._check_hf()
        if self.name in ("sotu", "text", "hf") and self.tokenizer == "bpe" and self.vocab_size <= 257:
            raise ConfigError(f"data.vocab_size={self.vocab_size} is too small for byte-level BPE (needs > 257); "
                              "use data.tokenizer=byte for plain bytes")
        if self.name in ("text", "tokens"):
            if not self.path:
                raise ConfigError(f"data={self.name} needs data.path=<{'file or folder' if self.name == 'text' else 'folder'}>")
            path = Path(self.path).expanduser()
            if not path.exists():
                raise ConfigError(f"data.path {self.path!r} does not exist")
            if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
                raise ConfigError(f"data.path {self.path!r} cannot be read (permissions)")
        return self

    def _check_hf(self) -> None:
        """The keys of data=hf: set there and only there, none of them doing nothing."""
        hf_keys = {"dataset": self.dataset, "hf_config": self.hf_config, "hf_split": self.hf_split,
                   "text_column": self.text_column, "max_docs": self.max_docs, "eod_token": self.eod_token}
        if self.name != "hf":
            for key, value in hf_keys.items():
                if value is not None:
                    raise ConfigError(f"data.{key}={value!r} applies to data=hf only (data={self.name})")
            return
        if not self.dataset:
            raise ConfigError("data=hf needs data.dataset=<a Hugging Face dataset name, or a local folder or file>")
        if self.path is not None:
            raise ConfigError(f"data.path={self.path!r} does not apply to data=hf: name the corpus with data.dataset")
        if self.tokenizer == "byte":
            raise ConfigError("data.tokenizer='byte' is not an option of data=hf; valid: bpe, or a pretrained "
                              "tokenizer (a Hugging Face name, a tokenizer.json, a folder with one)")
        if self.tokenizer == "bpe" and self.eod_token is not None:
            raise ConfigError(f"data.eod_token={self.eod_token!r} applies to a pretrained tokenizer; "
                              "data.tokenizer=bpe ends documents with its own <|endoftext|>")


@dataclass
class ProbesConfig:
    """Long-context recall probes at every validation (k3lab/probes.py): `none`, or `recall` (MQAR and a passkey
    retrieval at each of `lengths`)."""
    name: str = "none"                   # none | recall
    # sequence lengths; null: CPU_PROBE_LENGTHS on CPUs, GPU_PROBE_LENGTHS on GPUs
    lengths: Optional[list[int]] = setting(None, ge=1, only=("recall",))
    examples: int = setting(64, ge=1, only=("recall",))       # sequences per probe and length
    batch_size: int = setting(8, ge=1, only=("recall",))      # sequences per forward
    mqar_pairs: int = setting(16, ge=1, only=("recall",))     # MQAR key-value pairs (chance 1 / mqar_pairs)
    passkey_digits: int = setting(5, ge=1, only=("recall",))  # passkey length in digits (chance 1/10 per digit)

    def check(self, typed_keys: frozenset[str] = frozenset()) -> "ProbesConfig":
        check_choice("probes.name", self.name, PROBE_OPTIONS)
        check_fields("probes", self, typed_keys)
        shortest = max(4 * self.mqar_pairs, 2 * (self.passkey_digits + 2))
        for length in self.lengths or ():
            if length < shortest:
                raise ConfigError(f"probes.lengths: {length} is shorter than {shortest}, the least that holds "
                                  f"{self.mqar_pairs} MQAR pairs with their queries and two passkeys of "
                                  f"{self.passkey_digits} digits with their markers")
        return self

    def resolved_lengths(self, accelerator: str) -> list[int]:
        """`lengths`, or the default of the device the run trains on."""
        if self.lengths:
            return list(self.lengths)
        return list(CPU_PROBE_LENGTHS if accelerator == "cpu" else GPU_PROBE_LENGTHS)


@dataclass
class TrainConfig:
    """How long a run trains (k3lab/budget.py: at most one of max_steps, tokens_per_param and flop_budget;
    none: default_steps) and how often it validates, logs and checkpoints, in optimizer steps."""
    max_steps: Optional[int] = setting(None, ge=1)
    tokens_per_param: Optional[float] = setting(None, gt=0)  # D = tokens_per_param * N (active non-embedding); ~20 optimal
    flop_budget: Optional[float] = setting(None, gt=0)       # C in the FLOPs of k3lab/flops.py (summary.json's `flops`)
    default_steps: int = setting(200, ge=1)  # the length when none of the three is set
    val_every: int = setting(50, ge=1)       # validate every N optimizer steps (and at step 0 and the end)
    val_batches: int = setting(0, ge=0)      # 0: the whole validation set
    log_every: int = setting(10, ge=1)
    ckpt_every: int = setting(50, ge=0)      # 0: only the checkpoint at the end
    compile: Optional[bool] = None           # null: on for GPUs, off for the CPU; true: model.compile(); false: eager
    compile_backend: str = "inductor"        # inductor | aot_eager | eager (the last two trace without kernels: CPU tests)
    compile_mode: str = "default"            # default | reduce-overhead: the compiled forward and backward replayed as
                                             # CUDA graphs (one launch each instead of one per kernel; GPUs, inductor)
    activation_memory_budget: float = setting(1.0, gt=0, le=1)  # compiled: share of saved activations the backward keeps
    overfit_batches: int = setting(0, ge=0)  # >0: train (and validate) on that many fixed batches (debug=overfit)
    preempt_signal: Optional[str] = "${oc.env:SUBMITIT_PREEMPT_SIGNAL,USR2}"  # save at the next log step, stop (preempt.py)
    branches: Optional[list[float]] = setting(None, gt=0)  # a WSD trunk: its cooldown branches' budgets (k3lab/branches.py)
    trunk: Optional[str] = None  # a cooldown branch: its trunk's run name, a sibling directory of this run's

    def check(self, typed_keys: frozenset[str] = frozenset()) -> "TrainConfig":
        check_fields("train", self, typed_keys)
        check_choice("train.compile_backend", self.compile_backend, COMPILE_BACKENDS)
        check_choice("train.compile_mode", self.compile_mode, COMPILE_MODES)
        if self.branches is not None:
            if not self.branches:
                raise ConfigError("train.branches=[] must list positive budgets, in the unit of the run-length key "
                                  "(tokens per parameter, FLOPs or steps), e.g. [5,10,20]")
            if self.trunk is not None:
                raise ConfigError(f"train.branches and train.trunk={self.trunk} are both set: a run is a trunk (its "
                                  "branches listed) or a branch (its trunk named), not both")
        return self


@dataclass
class TrainerConfig:
    """Lightning's Trainer: where a run trains and in which precision (conf/trainer/)."""
    accelerator: str = "cpu"     # cpu | gpu | auto
    devices: int = 1             # -1: every visible GPU
    strategy: str = "auto"       # auto | ddp | fsdp | any Lightning strategy name
    precision: str = "32-true"   # 32-true | bf16-mixed | bf16-true | 16-mixed | ...
    num_nodes: int = setting(1, ge=1)
    threads: Optional[int] = setting(None, ge=1)  # CPU threads per process (torch.set_num_threads); null: cpu_threads()
    deterministic: Any = None    # null: on for the CPU, off on GPUs; true: GPU steps repeat bit for bit (slower);
                                 # warn: as true, but an op with no deterministic kernel warns instead of failing

    def check(self) -> "TrainerConfig":
        check_fields("trainer", self)
        if self.deterministic not in (None, True, False, "warn"):
            raise ConfigError(f"trainer.deterministic={self.deterministic!r} is not an option; "
                              "valid options: null, true, false, warn")
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
            require_package("logger=wandb", "wandb", extra="wandb")
        if self.tensorboard is not None:
            require_package("logger=tensorboard", "tensorboard", "tensorboardX", extra="tensorboard")
        return self


@dataclass
class RunConfig:
    """The whole composed config: which run this is, where its directory goes, and every group."""
    seed: int = setting(0, ge=0)
    out_dir: str = "runs"              # run directories go to <out_dir>/<group>/<run_name>
    group: str = "default"
    run_name: Optional[str] = None     # null: built from the command-line overrides ("k3" when none)
    resume: Optional[str] = None       # a run directory, or `last` (the most recent unfinished run under out_dir)
    overwrite: bool = False            # true: train again from scratch even if the run directory holds a run
    model: ModelShape = field(default_factory=ModelShape)
    decay: DecayConfig = field(default_factory=DecayConfig)
    glu: GLUConfig = field(default_factory=GLUConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mixer: MixerConfig = field(default_factory=MixerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    probes: ProbesConfig = field(default_factory=ProbesConfig)

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The ModelConfig the model is built from: this run's shape, switches and kernel settings."""
        shape = {f.name: getattr(self.model, f.name) for f in dataclasses.fields(ModelShape)}
        return ModelConfig(**{**shape, "vocab_size": vocab_size}, decay=self.decay, glu=self.glu, moe=self.moe,
                           balance=self.balance, residual=self.residual, mixer=self.mixer,
                           kernels=self.kernels).validate()

    def check(self, typed_keys: frozenset[str] = frozenset()) -> "RunConfig":
        """Everything types cannot say (module docstring); `typed_keys`: the dotted keys set on the command
        line, refused where the option they belong to does not read them."""
        check_fields("", self)
        from k3lab.budget import length_key

        length_key(self.train)  # first: it names the run-length keys' rule
        self.train.check(typed_keys)
        if (self.train.branches is not None or self.train.trunk is not None) and self.optim.schedule != "wsd":
            key = (f"train.branches={_show(self.train.branches)}" if self.train.branches is not None
                   else f"train.trunk={self.train.trunk}")
            raise ConfigError(f"{key} needs optim.schedule=wsd (cooldown branches decay from a stable trunk), not "
                              f"optim.schedule={self.optim.schedule}")
        self.data.check(typed_keys)
        if self.data.name == "tokens":
            from k3lab.data import tokens

            with reading_data():
                tokens.read_meta(self.data.path)
        if self.data.name == "hf":  # the tokenizer and a local dataset exist (a Hub dataset is read when building)
            from k3lab.data import hf

            with reading_data():
                hf.resolve_tokenizer(self.data)
                hf.resolve_dataset(self.data)
        check_fields("model", self.model)
        for switch in ("decay", "moe", "optim"):
            getattr(self, switch).check(typed_keys)
        for switch in ("glu", "balance", "residual", "mixer"):
            check_fields(switch, getattr(self, switch), typed_keys)
        check_fields("kernels", self.kernels)
        self.model_config(vocab_size=1)  # every switch, the kernels backend and the model's shape
        self.trainer.check()
        self.probes.check(typed_keys)
        self.check_kernels()
        compile_mode(self)
        self.logger.check()
        check_out_dir(self.out_dir)
        return self

    def check_kernels(self) -> None:
        """Kernel settings that act on one backend only, and the fla backend's package."""
        k = self.kernels
        triton = k.backend == "triton" or (k.backend == "auto" and self.trainer.accelerator != "cpu")
        for key in ("recompute_states", "recompute_chunks", "keep_intra"):
            if getattr(k, key) and not triton:
                where = (f"kernels.backend=auto runs torch on trainer.accelerator={self.trainer.accelerator}"
                         if k.backend == "auto" else f"kernels.backend={k.backend} ignores it")
                raise ConfigError(f"kernels.{key}=true acts on the Triton KDA kernels only ({where}): set "
                                  f"kernels.backend=triton, or drop it")
        if k.backend == "fla":
            require_package("kernels.backend=fla", "fla", extra="fla", pip_name="fla-core")


ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)

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


def _field_hint(schema: type, dotted: str) -> Any:
    """The type annotation of the field at dotted key `dotted` below the dataclass `schema`, or None."""
    hint: Any = schema
    for part in dotted.split("."):
        hints = typing.get_type_hints(hint) if dataclasses.is_dataclass(hint) else {}
        hint = hints.get(part)
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            hint = args[0]
        if hint is None:
            return None
    return hint


def wrong_value(key: str, value: Any, schema: type = None) -> str:
    """`train.max_steps='abc' is not an integer or null`: the one line for a value of the wrong type."""
    hint = _field_hint(schema or RunConfig, key)
    return f"{key}={value!r} is not {_kind(hint)}" if hint is not None else f"{key}={value!r} has the wrong type"


def typed(schema, node) -> object:
    """OmegaConf node -> dataclass instance. An unknown key, a missing value or a wrong type raises
    ConfigError naming the key as the command line spells it (`train.max_steps='abc' is not an integer`)."""
    where = node._get_full_key(None) if isinstance(node, DictConfig) else ""

    def full(key) -> str:
        return f"{where}.{key}" if where and key else str(key or where)

    if not isinstance(node, (DictConfig, dict)) and not dataclasses.is_dataclass(node):
        raise ConfigError(f"{getattr(schema, '__name__', schema)} needs a group of key: value settings, not {node!r}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except ConfigKeyError as err:
        keys = [full(k) for k in _dotted_fields(schema)]
        raise ConfigError(not_a_key(full(err.full_key), keys)) from None
    except MissingMandatoryValue as err:
        raise ConfigError(f"{full(err.full_key)} is not set: add {full(err.full_key)}=<value> to the command") from None
    except ValidationError as err:
        raise ConfigError(wrong_value(full(err.full_key), err.value, schema if not where else None)) from None


def _dotted_fields(schema: type, prefix: str = "") -> list[str]:
    """Every key of a dataclass schema as a dotted path, nested dataclasses included."""
    out = []
    for name, hint in typing.get_type_hints(schema).items():
        out.append(prefix + name)
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if dataclasses.is_dataclass(args[0]):
            out.extend(_dotted_fields(args[0], f"{prefix}{name}."))
    return out


def run_config(cfg: DictConfig) -> RunConfig:
    """The composed config typed once, against RunConfig (its `hydra` node, if any, left out). It is typed
    from a plain copy: Hydra composes onto the schema but lets `+key=value` add keys the schema lacks."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra", None)
    return typed(RunConfig, OmegaConf.create(plain))


def typed_keys(overrides: list[str] | tuple[str, ...]) -> frozenset[str]:
    """The dotted keys that command-line overrides set (`optim.lr=0.01` -> optim.lr; group choices left out)."""
    keys = set()
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" in o and "." in key and not key.startswith("hydra"):
            keys.add(key)
    return frozenset(keys)


def check_config(cfg: DictConfig, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The composed config typed (run_config) and checked (RunConfig.check), refusing the keys of `overrides`
    that the chosen options do not read. A bad setting raises a UserError, one line naming the key; run.py
    and k3lab.train.train call this before any run directory exists. Cheap: torch is imported only to check
    a GPU accelerator, wandb only when it is asked for."""
    return run_config(cfg).check(typed_keys(overrides))


def compile_mode(run: RunConfig) -> bool:
    """Whether the model is compiled, from train.compile: null means on for GPUs and off for the CPU (where
    compiling a small model costs more than it saves); true and false are passed through. The model is
    compiled with nn.Module.compile (backend train.compile_backend), which compiles its __call__ in place:
    parameter names, state dicts and checkpoints are those of the eager model. A train.activation_memory_budget
    below 1 needs a compiled model (k3lab.train.compile_model), and so does a train.compile_mode other than
    default, which also needs CUDA (reduce-overhead records CUDA graphs) and inductor (which makes the kernels
    they replay)."""
    mode, tc = run.train.compile, run.train
    compiled = run.trainer.accelerator != "cpu" if mode is None else mode
    where = f"train.compile={_show(mode)} does not compile on trainer.accelerator={run.trainer.accelerator}"
    if tc.activation_memory_budget != 1.0 and not compiled:
        raise ConfigError(f"train.activation_memory_budget={tc.activation_memory_budget} acts on compiled models only, "
                          f"and {where} (set train.compile=true)")
    if tc.compile_mode != "default":
        if run.trainer.accelerator == "cpu":
            raise ConfigError(f"train.compile_mode={tc.compile_mode} records CUDA graphs, and trainer.accelerator=cpu "
                              "runs none: drop it (or train on a GPU, trainer=gpu)")
        if not compiled:
            raise ConfigError(f"train.compile_mode={tc.compile_mode} acts on compiled models only, and {where} "
                              "(set train.compile=true)")
        if tc.compile_backend != "inductor":
            raise ConfigError(f"train.compile_mode={tc.compile_mode} replays inductor's kernels, and "
                              f"train.compile_backend={tc.compile_backend} makes none: drop one of them")
    return compiled


def check_out_dir(out_dir: str) -> None:
    """out_dir can hold run directories: its nearest existing folder lets a folder be made in it. Making one
    (and removing it again) is the only sure test (permissions, read-only and virtual file systems)."""
    path = Path(out_dir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"out_dir={out_dir}: {existing} is a file, not a folder")
    try:
        Path(tempfile.mkdtemp(prefix=".k3lab-check-", dir=existing)).rmdir()
    except OSError as err:
        raise ConfigError(f"out_dir={out_dir} cannot be made: {err.strerror} in {existing}") from None


def require_package(what: str, *modules: str, extra: str, pip_name: str | None = None) -> None:
    """ConfigError naming the pip extra when none of `modules` can be imported (`pip_name`: the package's
    name on PyPI when it is not the module's)."""
    for module in modules:
        try:
            importlib.import_module(module)
            return
        except ImportError:
            continue
    raise ConfigError(f'{what} needs the {pip_name or modules[0]} package: pip install -e ".[{extra}]" '
                      f'(or pip install {pip_name or modules[0]})')
