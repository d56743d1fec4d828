"""Tokenizers: byte-level BPE trained locally with `tokenizers`, or raw UTF-8 bytes.

Both end every document with one end-of-document token (`eod_id`) when documents are packed into
one stream, and both round-trip exactly: `decode(encode(text)) == text` for any string.

- `BPETokenizer`: byte-level BPE (GPT-2 style byte alphabet, GPT-2 regex pre-splitting, no
  normalisation, no added prefix space). The special token `<|endoftext|>` has id 0 and counts
  towards `vocab_size`. `BPETokenizer.load` also takes any other `tokenizers` tokenizer.json,
  given the name of its end-of-document token.
- `ByteTokenizer`: ids 0..255 are the UTF-8 bytes and 256 is the end-of-document token, so its
  vocabulary has 257 entries.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..fileio import atomic_write_bytes

EOD_TOKEN = "<|endoftext|>"
BPE_MIN_FREQUENCY = 2
# What the BPE cache key hashes besides corpus and vocab size: change it when the recipe changes.
BPE_SETTINGS = {
    "model": "bpe",
    "pre_tokenizer": "byte_level(add_prefix_space=False, use_regex=True)",
    "normalizer": None,
    "special": [EOD_TOKEN],
    "min_frequency": BPE_MIN_FREQUENCY,
    "recipe": 1,
}

train_calls = 0  # how many BPE trainings this process ran (tests use it to prove cache hits)


class ByteTokenizer:
    """Raw UTF-8 bytes; id 256 marks the end of a document."""

    kind = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i != self.eod_id).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` package."""

    kind = "bpe"

    def __init__(self, tok, eod_token: str = EOD_TOKEN):
        eod_id = tok.token_to_id(eod_token)
        if eod_id is None:
            raise ValueError(f"the tokenizer has no token {eod_token!r} to end documents with")
        self.tok, self.eod_token, self.eod_id = tok, eod_token, eod_id
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> "BPETokenizer":
        """Learn merges on `texts` (pass the training split only)."""
        global train_calls
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size <= 257:
            raise ValueError(f"data.vocab_size={vocab_size} is too small for byte-level BPE (needs > 257); "
                             "use data.tokenizer=byte for plain bytes")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=BPE_MIN_FREQUENCY,
            special_tokens=[EOD_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        train_calls += 1
        return cls(tok)

    @classmethod
    def load(cls, path: str | os.PathLike, eod_token: str = EOD_TOKEN) -> "BPETokenizer":
        """A `tokenizers` tokenizer.json (any model, not only ours) that knows `eod_token`."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), eod_token)

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_bytes(Path(path), self.tok.to_str().encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids if int(i) != self.eod_id], skip_special_tokens=False)


Tokenizer = ByteTokenizer | BPETokenizer

RUN_FILE = "tokenizer.json"  # a run directory's copy of its BPE tokenizer (docs/run_directory.md)


def save_to_run(tokenizer: Tokenizer, run_dir: str | os.PathLike) -> dict:
    """Keep the tokenizer a run trained with in its directory, so that sampling and evaluation need nothing
    else: a BPE tokenizer as `<run_dir>/tokenizer.json`. Returns summary.json's `tokenizer` entry (kind,
    vocab_size, eod_id, eod_token), which `load_from_run` reads back."""
    entry = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id}
    if isinstance(tokenizer, BPETokenizer):
        tokenizer.save(Path(run_dir) / RUN_FILE)
        entry.update(file=RUN_FILE, eod_token=tokenizer.eod_token)
    return entry


def load_from_run(run_dir: str | os.PathLike, entry: dict) -> Tokenizer:
    """The tokenizer that `save_to_run` kept in `run_dir`, from its summary.json entry."""
    if entry["kind"] == ByteTokenizer.kind:
        return ByteTokenizer()
    return BPETokenizer.load(Path(run_dir) / entry["file"], eod_token=entry["eod_token"])


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds ids 0 .. vocab_size - 1: uint16 up to 65536 entries, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def pack(tokenizer: Tokenizer, texts: Sequence[str], batch: int = 64) -> np.ndarray:
    """Encode `texts` into one stream, `eod_id` after every document (uint16 when it fits)."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts = []
    eod = np.array([tokenizer.eod_id], dtype=dtype)
    for start in range(0, len(texts), batch):
        for ids in tokenizer.encode_batch(texts[start:start + batch]):
            parts.append(np.asarray(ids, dtype=dtype))
            parts.append(eod)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
