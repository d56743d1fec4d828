"""Token shards: the on-disk format behind `data=tokens`, written by `python -m k3lab.data.prepare`.

One folder per prepared corpus:

    train.bin          flat little-endian token ids, no header (nanoGPT's `train.bin` / `val.bin`
    val.bin            layout): each document's tokens, then one end-of-document token, documents
                       back to back. uint16 when the vocabulary has at most 65,536 entries, else
                       uint32; `np.memmap(path, dtype=meta["dtype"], mode="r")` reads them.
    tokenizer.json     the `tokenizers` tokenizer that produced the ids
    train_counts.npy   int64 [vocab_size]: occurrences of every id in train.bin, so the unigram loss
                       floor needs no pass over the training tokens
    meta.json          written last, so its presence marks a complete folder

The validation split is by document, decided when the folder is made (`corpus.split_ids`), and
stored as its own array. meta.json holds `format` and `version`, `dtype`, `vocab_size`, `eod_id`,
`tokenizer` (file, kind, end-of-document token, sha256), `splits` (tokens and documents of each),
`documents` and `tokens` (both splits), `val_fraction`, `source` (what was read and its identity:
a sha256 over every document's id and text in order, plus the file-list hash for file sources),
`unigram_entropy_val`, `command` (the command line that made the folder), `created_at` and
`versions`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FORMAT = "k3lab-tokens"
VERSION = 1
SPLITS = ("train", "val")
DTYPES = ("uint16", "uint32")
META = "meta.json"
TOKENIZER = "tokenizer.json"
TRAIN_COUNTS = "train_counts.npy"


def split_path(folder: Path, split: str) -> Path:
    return Path(folder) / f"{split}.bin"


def file_dtype(name: str) -> np.dtype:
    """The on-disk dtype for a meta.json `dtype` name: always little-endian."""
    return np.dtype(name).newbyteorder("<")


def read_meta(folder: str | Path, what: str = "data.path") -> dict:
    """meta.json of a shard folder, checked for the format; `what` names the setting in errors."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} {str(folder)!r} is not a folder of token shards "
                                "(make one with python -m k3lab.data.prepare)")
    if not (folder / META).exists():
        raise FileNotFoundError(f"{what} {str(folder)!r} has no {META}: not a finished shard folder "
                                "(python -m k3lab.data.prepare writes it last)")
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{what} {str(folder)!r}: {META} is format {meta.get('format')!r} version "
                         f"{meta.get('version')!r}, expected {FORMAT!r} version {VERSION}")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{what} {str(folder)!r}: dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    return meta


def open_split(folder: str | Path, meta: dict, split: str) -> np.memmap:
    """The `[tokens]` array of one split, memory-mapped read-only; its size must match meta.json."""
    path = split_path(Path(folder).expanduser(), split)
    n = int(meta["splits"][split]["tokens"])
    dtype = file_dtype(meta["dtype"])
    size = path.stat().st_size if path.exists() else None
    if size != n * dtype.itemsize:
        raise ValueError(f"{path}: {size} bytes, but {META} says {n} tokens of {meta['dtype']} "
                         f"({n * dtype.itemsize} bytes)")
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))
