"""`K3DataModule`: every dataset behind one LightningDataModule, batches `(x, y)` of int64 `[B, T]`.

`y` is the target for each position of `x` (for text: `x` shifted by one), -100 where no loss is
taken. The trainer computes cross-entropy with `ignore_index=-100` and accuracy on `y != -100`.

Training batches are a pure function of `(seed, step, rank)`: batch `s` of rank `r` takes samples
`(s * world + r) * B ... + B - 1` of an endless seeded sequence. For sotu / text windows and MQAR
examples that sequence visits every item once per epoch in a fresh seeded permutation
(`EpochPermutation`); for token shards (`tokens`) it is uniformly random window starts
(`RandomWindows`). Nothing about the sampler is saved: a resumed run calls `set_start_step(s)` (or
lets the datamodule read `trainer.global_step` from the checkpoint) and sees exactly the batches an
uninterrupted run would have seen from step `s` on.

Text corpora (`sotu`, `text`) are prepared once and cached under `cache_dir/lm/<key>/`: the
tokenizer (`tokenizer.json`, BPE only), the packed train and validation token streams (`.npy`) and
`meta.json`, written last, which marks the entry complete. `key` hashes the corpus fingerprint, the
split, the tokenizer kind, its vocabulary size and the BPE recipe. Every file is written to a
temporary name and moved into place (`k3lab.fileio.atomic_write`), so concurrent writers (DDP ranks,
parallel runs) never leave a torn file; Lightning calls `prepare_data` on local rank 0 only and the other
ranks load the finished cache in `setup`. An entry that cannot be read back (a file truncated or
damaged after it was written) is built again, with a line that says so; building prints a line before
and after, with the time it took.

Token shards (`tokens`, made by `python -m k3lab.data.prepare`, format in `k3lab.data.tokens`) are
memory-mapped from `data.path` as they are; the vocabulary comes from their meta.json. `hf` builds such
shards once from a dataset and a tokenizer into the cache (`k3lab.data.hf`) and reads them the same way.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ..config import DATASETS, TOKENIZERS, DataConfig, check_choice
from ..fileio import atomic_write, atomic_write_bytes, remove_stale_temps
from . import corpus, mqar, tokens
from .tokenizer import BPE_SETTINGS, BPETokenizer, ByteTokenizer, pack

IGNORE_INDEX = -100
CACHE_FORMAT = 1


_OC_ENV = re.compile(r"^\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,\s*(.*))?\}$")


def resolve_cache_dir(cache_dir: str) -> Path:
    """`cache_dir` as a path. An unresolved `${oc.env:VAR,default}` (a config that did not go
    through Hydra) is resolved here: $VAR if set, else the default (quotes optional)."""
    m = _OC_ENV.match(str(cache_dir))
    if m:
        default = (m.group(2) or "").strip().strip("'\"")
        cache_dir = os.environ.get(m.group(1)) or default
        if not cache_dir:
            raise ValueError(f"data.cache_dir: ${{{m.group(1)}}} is not set and there is no default")
    return Path(cache_dir).expanduser()


# ---------------------------------------------------------------------------------------------
# text corpora: tokenise once, cache


@dataclass
class LMData:
    train: np.ndarray          # packed train stream, eod after every document
    val: np.ndarray            # packed validation stream
    tokenizer: ByteTokenizer | BPETokenizer
    meta: dict                 # vocab_size, eod_id, document and token counts, ...
    cache_hit: bool            # True when everything came from the cache (or the token shards)
    train_counts: np.ndarray | None = None  # int64 [vocab_size] id counts of `train`, when stored


def lm_cache_key(cfg: DataConfig) -> str:
    spec = {
        "format": CACHE_FORMAT,
        "corpus": cfg.name,
        "fingerprint": corpus.corpus_fingerprint(cfg.name, cfg.path),
        "val_fraction": cfg.val_fraction,
        "tokenizer": cfg.tokenizer,
        "vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else ByteTokenizer.vocab_size,
        "settings": BPE_SETTINGS if cfg.tokenizer == "bpe" else "utf-8 bytes + eod 256",
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def _save_npy(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, array))


def prepare_lm(cfg: DataConfig) -> LMData:
    """Load the cached tokenizer and token streams for `cfg`, building them first if missing or unreadable."""
    check_choice("data.tokenizer", cfg.tokenizer, TOKENIZERS)
    entry = resolve_cache_dir(cfg.cache_dir) / "lm" / lm_cache_key(cfg)
    cached, _ = _load_lm(cfg, entry)
    if cached is not None:
        return cached
    entry.mkdir(parents=True, exist_ok=True)
    with _exclusive(entry / ".lock"):  # one process builds, concurrent ones wait, then load
        cached, problem = _load_lm(cfg, entry)
        if cached is not None:
            return cached
        if problem:
            print(f"tokenizer cache {entry} cannot be read ({problem}); building it again", flush=True)
        (entry / "meta.json").unlink(missing_ok=True)
        remove_stale_temps(entry)
        return _build_lm(cfg, entry)


def _load_lm(cfg: DataConfig, entry: Path) -> tuple[LMData | None, str | None]:
    """The cache entry, or (None, why not): why is None when there is no finished entry, else what
    could not be read (a truncated or damaged file)."""
    if not (entry / "meta.json").exists():
        return None, None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        tok = BPETokenizer.load(entry / "tokenizer.json") if cfg.tokenizer == "bpe" else ByteTokenizer()
        train = np.load(entry / "train.npy", mmap_mode="r")
        val = np.load(entry / "val.npy", mmap_mode="r")
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a damaged tokenizer.json
        return None, " ".join(f"{type(err).__name__}: {err}".split())[:300]
    sizes = {"vocab_size": tok.vocab_size, "train_tokens": train.size, "val_tokens": val.size}
    wrong = [f"{key} {value} where meta.json says {meta.get(key)}" for key, value in sizes.items()
             if meta.get(key) != value]
    if wrong:
        return None, "; ".join(wrong)
    return LMData(train, val, tok, meta, cache_hit=True), None


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An advisory inter-process lock (fcntl.flock; a no-op where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:  # Windows: atomic writes alone keep the cache consistent
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_lm(cfg: DataConfig, entry: Path) -> LMData:
    """Split, train the tokenizer on the train split, encode both splits, write the cache entry."""
    meta_path = entry / "meta.json"
    t0 = time.perf_counter()
    docs = corpus.load_documents(cfg.name, cfg.path)
    train_docs, val_docs = corpus.split_documents(docs, cfg.val_fraction)
    t_load = time.perf_counter()
    chars = sum(len(t) for _, t in train_docs)
    docs_desc = f"{len(train_docs):,} training documents of {cfg.name} ({chars / 1e6:.2f}M characters)"
    what = (f"training a byte-level BPE of {cfg.vocab_size:,} tokens on {docs_desc}" if cfg.tokenizer == "bpe"
            else f"encoding {docs_desc} as bytes")
    print(f"tokenizer: {what}, once: later runs read it from {entry}", flush=True)
    if cfg.tokenizer == "bpe":
        tok = BPETokenizer.train((text for _, text in train_docs), cfg.vocab_size, show_progress=sys.stderr.isatty())
    else:
        tok = ByteTokenizer()
    t_train = time.perf_counter()
    train = pack(tok, [text for _, text in train_docs])
    val = pack(tok, [text for _, text in val_docs])
    t_pack = time.perf_counter()
    trained = f"trained in {t_train - t_load:.1f} s, " if cfg.tokenizer == "bpe" else ""
    print(f"tokenizer: {trained}{train.size + val.size:,} tokens encoded in {t_pack - t_train:.1f} s", flush=True)

    if cfg.tokenizer == "bpe":
        tok.save(entry / "tokenizer.json")
    _save_npy(entry / "train.npy", train)
    _save_npy(entry / "val.npy", val)
    meta = {
        "corpus": cfg.name,
        "path": cfg.path,
        "tokenizer": cfg.tokenizer,
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod_id,
        "train_docs": len(train_docs),
        "val_docs": len(val_docs),
        "val_doc_ids": [d for d, _ in val_docs],
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "train_chars": chars,
        "seconds": {"load": t_load - t0, "tokenizer": t_train - t_load, "encode": t_pack - t_train},
    }
    atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
    return LMData(train, val, tok, meta, cache_hit=False)


def load_tokens(cfg: DataConfig) -> LMData:
    """The token shards at `data.path` (`k3lab.data.tokens`), memory-mapped; nothing is built."""
    if not cfg.path:
        raise ValueError("data=tokens needs data.path (a folder made by python -m k3lab.data.prepare)")
    return load_shards(Path(cfg.path).expanduser())


def load_shards(folder: Path) -> LMData:
    """A folder of token shards (`k3lab.data.tokens`), memory-mapped."""
    meta = tokens.read_meta(folder)
    tok = BPETokenizer.load(folder / tokens.TOKENIZER, eod_token=meta["tokenizer"]["eod_token"])
    return LMData(tokens.open_split(folder, meta, "train"), tokens.open_split(folder, meta, "val"), tok, meta,
                  cache_hit=True, train_counts=np.load(folder / tokens.TRAIN_COUNTS))


def token_counts(stream: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    """int64 `[vocab_size]`: occurrences of every id in `stream` `[n]`, counted `chunk` tokens at a
    time so a memory-mapped stream is never copied whole."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(stream), chunk):
        counts += np.bincount(np.asarray(stream[start:start + chunk]), minlength=vocab_size)[:vocab_size]
    return counts


def counts_cross_entropy(train_counts: np.ndarray, target_counts: np.ndarray) -> float:
    """Cross-entropy (nats/token) of targets with id counts `target_counts` `[V]` under the
    add-one-smoothed unigram distribution of `train_counts` `[V]`: p(v) = (count(v) + 1) / (sum(count) + V)."""
    counts = np.asarray(train_counts, dtype=np.float64)
    log_p = np.log(counts + 1.0) - math.log(counts.sum() + len(counts))
    return float(-(np.asarray(target_counts, dtype=np.float64) * log_p).sum() / np.sum(target_counts))


def unigram_cross_entropy(train: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of `targets` under the add-one-smoothed unigram distribution of
    `train`: p(v) = (count_train(v) + 1) / (len(train) + vocab_size)."""
    return counts_cross_entropy(token_counts(train, vocab_size), token_counts(targets, vocab_size))


# ---------------------------------------------------------------------------------------------
# deterministic, resumable sampling


class SeededBlocks:
    """Sample `i` of an endless stream: element `i % K` of block `i // K`, each block of K values drawn
    by `draw(default_rng([seed, block]))`. A pure function of `(seed, i)`, so a resume needs only the
    step; the last few blocks are cached."""

    def __init__(self, n: int, seed: int, block: int, draw):
        if n < 1:
            raise ValueError("nothing to sample from")
        self.n, self.seed, self.block, self.draw = n, seed, block, draw
        self._blocks: dict[int, np.ndarray] = {}

    def _values(self, b: int) -> np.ndarray:
        if b not in self._blocks:
            if len(self._blocks) > 2:
                self._blocks.pop(min(self._blocks))
            self._blocks[b] = self.draw(np.random.default_rng([self.seed, b]))
        return self._blocks[b]

    def __call__(self, sample_ids: np.ndarray) -> np.ndarray:
        blocks, pos = np.divmod(sample_ids, self.block)
        out = np.empty_like(sample_ids)
        for b in np.unique(blocks):
            mask = blocks == b
            out[mask] = self._values(int(b))[pos[mask]]
        return out


class EpochPermutation(SeededBlocks):
    """Items `0 .. n - 1`, each epoch (block of n) a permutation seeded by `(seed, epoch)`: every epoch
    visits every item once."""

    def __init__(self, n: int, seed: int):
        super().__init__(n, seed, n, lambda rng: rng.permutation(n))


class RandomWindows(SeededBlocks):
    """Window starts uniform on `0 .. n - 1` with replacement (nanoGPT's `get_batch`), in blocks of
    `block` draws: the blocks replace a permutation of every start, which would not fit in memory for a
    corpus of billions of tokens."""

    def __init__(self, n: int, seed: int, block: int = 1 << 16):
        super().__init__(n, seed, block, lambda rng: rng.integers(0, n, block))


def window_batch(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of `seq_len + 1` tokens: x = the first seq_len, y = the last seq_len."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = torch.from_numpy(np.asarray(stream[idx], dtype=np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class TrainBatches(IterableDataset):
    """Endless training batches from `start_step` on, each a function of (step, rank) only.
    With several DataLoader workers, worker w produces steps w, w + workers, ... which the
    DataLoader interleaves back into step order."""

    def __init__(self, batch_fn, start_step: int):
        self.batch_fn, self.start_step = batch_fn, start_step

    def __iter__(self):
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        step = self.start_step + worker
        while True:
            yield self.batch_fn(step)
            step += n_workers


class FixedBatches(Dataset):
    """Precomputed validation batches; item i is batch i."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int):
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[s], self.y[s]


# ---------------------------------------------------------------------------------------------


class K3DataModule(L.LightningDataModule):
    """sotu / text / mqar / tokens / hf, chosen by `cfg.name`. Call `setup()` (Lightning does) before
    reading `vocab_size`, `train_tokens` or `unigram_entropy()`."""

    def __init__(self, cfg: DataConfig, seed: int = 0):
        super().__init__()
        check_choice("data.name", cfg.name, DATASETS)
        self.cfg, self.seed = cfg, seed
        self._start_step: int | None = None
        self._ready = False
        self.vocab_size: int | None = None
        self.lm: LMData | None = None
        self.info: dict = {}

    # -- Lightning hooks ---------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Build the text cache or the shards of data=hf (runs on local rank 0 only under DDP); MQAR and token
        shards need nothing."""
        if self.cfg.name in ("sotu", "text"):
            self.lm = prepare_lm(self.cfg)
        elif self.cfg.name == "hf":
            from .hf import prepare_hf

            self.lm = load_shards(prepare_hf(self.cfg))

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        cfg = self.cfg
        if cfg.seq_len < 1 or cfg.batch_size < 1:
            raise ValueError(f"data.seq_len and data.batch_size must be >= 1, got {cfg.seq_len}, {cfg.batch_size}")
        if cfg.name == "mqar":
            self._setup_mqar()
        else:
            self._setup_lm()
        self._ready = True

    def train_dataloader(self) -> DataLoader:
        """The training batches in step order, in pinned host memory where CUDA is available: Lightning copies
        each batch to the GPU with non_blocking=True, which from pageable memory is not an asynchronous DMA
        (the driver stages the batch and may wait for the stream, the previous step's kernels included)."""
        return DataLoader(TrainBatches(self.train_batch, self.start_step()), batch_size=None,
                          num_workers=self.cfg.num_workers, persistent_workers=False,
                          pin_memory=torch.cuda.is_available())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(FixedBatches(self.val_x, self.val_y, self.cfg.batch_size), batch_size=None,
                          shuffle=False, num_workers=self.cfg.num_workers, pin_memory=torch.cuda.is_available())

    @property
    def train_tokens(self) -> int:
        """Tokens in the training split (MQAR: examples x seq_len); tokens seen / this = epochs."""
        if self.cfg.name == "mqar":
            return self.cfg.n_train_examples * self.cfg.seq_len
        return len(self.lm.train)

    @property
    def n_val_batches(self) -> int:
        """Number of validation batches (the whole fixed validation set)."""
        return math.ceil(len(self.val_x) / self.cfg.batch_size)

    # -- resumable sampling ----------------------------------------------------------------

    def set_start_step(self, step: int) -> None:
        """The next `train_dataloader()` starts at global step `step` (the batches a fresh run
        would see from that step on)."""
        if step < 0:
            raise ValueError(f"start step must be >= 0, got {step}")
        self._start_step = int(step)

    def start_step(self) -> int:
        """`set_start_step`'s value if set, else the attached trainer's global step, else 0."""
        if self._start_step is not None:
            return self._start_step
        trainer = self.trainer
        return int(trainer.global_step) if trainer is not None else 0

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return int(trainer.global_rank), int(trainer.world_size)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The training batch of global step `step` for this rank."""
        rank, world = self._rank_world()
        B = self.cfg.batch_size
        ids = (step * world + rank) * B + np.arange(B, dtype=np.int64)
        items = self._sampler(ids)
        if self.cfg.name == "mqar":
            return (torch.from_numpy(self.train_x[items].astype(np.int64)),
                    torch.from_numpy(self.train_y[items].astype(np.int64)))
        return window_batch(self.lm.train, items * self._stride, self.cfg.seq_len)

    # -- floors ----------------------------------------------------------------------------

    def unigram_entropy(self) -> float:
        """The loss floor of meaning, in nats per target token.

        sotu/text/tokens: cross-entropy of the validation targets (exactly the `y` tokens that
        validation scores) under the train split's unigram distribution with add-one (Laplace)
        smoothing over the whole vocabulary, i.e. the validation loss of a model that knows only
        train token frequencies (token shards store those counts). mqar: log of the number of
        values, the loss of a uniform guess over the value range at answer positions (the key and
        the pair layout already rule out every other token).
        """
        if not self._ready:
            raise RuntimeError("call setup() first")
        if self.cfg.name == "mqar":
            return mqar.answer_entropy(self.cfg.mqar_vocab)
        counts = self.lm.train_counts
        if counts is None:
            counts = token_counts(self.lm.train, self.vocab_size)
        return counts_cross_entropy(counts, token_counts(self.val_y.numpy().ravel(), self.vocab_size))

    # -- dataset-specific setup ------------------------------------------------------------

    def _setup_lm(self) -> None:
        cfg, T = self.cfg, self.cfg.seq_len
        if self.lm is None:  # other ranks, or prepare_data was not called: load (or build) the cache
            if cfg.name == "tokens":
                self.lm = load_tokens(cfg)
            else:
                self.prepare_data()
        self.vocab_size = int(self.lm.meta["vocab_size"])
        n_train = (len(self.lm.train) - 1) // T
        n_val_all = (len(self.lm.val) - 1) // T
        if n_train < 1:
            raise ValueError(f"train split has {len(self.lm.train)} tokens, fewer than seq_len + 1 = {T + 1}")
        if n_val_all < 1:
            raise ValueError(f"validation split has {len(self.lm.val)} tokens, fewer than seq_len + 1 = {T + 1}; "
                             "raise data.val_fraction or lower data.seq_len")
        n_val = min(n_val_all, max(1, cfg.val_tokens // T))
        # windows spread evenly over the validation stream; stride T, so no target is scored twice
        val_windows = np.unique(np.linspace(0, n_val_all - 1, n_val).round().astype(np.int64))
        self.val_x, self.val_y = window_batch(self.lm.val, val_windows * T, T)
        if cfg.name in ("tokens", "hf"):  # token shards: windows from any token on, drawn with replacement (nanoGPT)
            self._sampler, self._stride = RandomWindows(len(self.lm.train) - T, self.seed), 1
        else:  # the non-overlapping windows of the packed stream, each once per epoch
            self._sampler, self._stride = EpochPermutation(n_train, self.seed), T
        self.info = {**self.lm.meta, "cache_hit": self.lm.cache_hit, "train_windows": n_train,
                     "val_windows": len(val_windows), "val_targets": int(self.val_y.numel())}

    def _setup_mqar(self) -> None:
        cfg = self.cfg
        kw = dict(seq_len=cfg.seq_len, vocab_size=cfg.mqar_vocab, n_kv_pairs=cfg.n_kv_pairs,
                  power_a=cfg.mqar_power_a, random_non_queries=cfg.mqar_random_non_queries)
        self.train_x, self.train_y = mqar.make_mqar(cfg.n_train_examples, seed=[self.seed, 1], **kw)
        vx, vy = mqar.make_mqar(cfg.n_val_examples, seed=[self.seed, 2], **kw)
        self.val_x, self.val_y = torch.from_numpy(vx.astype(np.int64)), torch.from_numpy(vy.astype(np.int64))
        self.vocab_size = cfg.mqar_vocab
        self._sampler = EpochPermutation(cfg.n_train_examples, self.seed)
        self.info = {"corpus": "mqar", "vocab_size": self.vocab_size, **kw,
                     "train_examples": cfg.n_train_examples, "val_examples": cfg.n_val_examples}
