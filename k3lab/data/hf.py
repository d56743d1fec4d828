"""`data=hf`: any corpus and tokenizer in one command, tokenised once into cached token shards.

    python run.py data=hf data.dataset=HuggingFaceFW/fineweb-edu data.hf_config=sample-10BT data.max_docs=100000 \\
        data.tokenizer=gpt2
    python run.py data=hf data.dataset=~/corpus data.tokenizer=~/tokenizers/my/tokenizer.json
    python run.py data=hf data.dataset=~/corpus.jsonl data.tokenizer=bpe data.vocab_size=4096

`data.dataset` is a Hugging Face dataset id, or a local folder or file that `datasets` reads
(`k3lab.data.prepare.hf_rows`); `data.tokenizer` is `bpe` (a byte-level BPE of data.vocab_size trained on the
training documents) or a pretrained tokenizer: a tokenizer.json, a folder holding one (a Hugging Face tokenizer
folder), or a Hugging Face model id whose tokenizer files are fetched into (or, offline, found in) the Hugging
Face cache. A folder without tokenizer.json is converted by `transformers`' AutoTokenizer where it is installed.
The end-of-document token is the tokenizer's own: data.eod_token, else the first of eos, bos and sep that its
tokenizer_config.json or special_tokens_map.json defines, else the only special token of its tokenizer.json.

The first run with a given identity builds the shards with `python -m k3lab.data.prepare` (the same pipeline,
so the folder is the `data=tokens` format, docs/data.md) into `<data.cache_dir>/hf/<key>/`; later runs read it.
The key hashes what the tokens depend on: the dataset (its id, or the local path with every file's name,
size and modification time; offline, the cached revision), configuration, split, text column and document
cap, the tokenizer (its file's sha256 and end-of-document token, or the BPE recipe and vocabulary size) and
the validation fraction. One process builds while concurrent first uses wait on a lock; the folder is built
under a temporary name and renamed into place when complete, so a run killed while building leaves nothing
a later run would read.

Offline (`HF_HUB_OFFLINE=1`) nothing is downloaded: a dataset or tokenizer id must be in the Hugging Face
cache (a dataset as the cached files of its repository, read as a local folder); one line says when it is not.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import DataConfig
from . import tokens
from .datamodule import _exclusive, resolve_cache_dir
from .tokenizer import BPE_SETTINGS

CACHE_FORMAT = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOD_ROLES = ("eos_token", "bos_token", "sep_token")  # the end-of-document token, in this order of preference


def offline() -> bool:
    """Whether Hugging Face downloads are off (HF_HUB_OFFLINE=1)."""
    import huggingface_hub

    return huggingface_hub.is_offline_mode()


def hub_snapshot(repo_id: str, repo_type: str, key: str, patterns: tuple[str, ...] | None = None) -> Path:
    """The local folder of a Hugging Face repository (only `patterns` of it): fetched into the Hugging Face
    cache, or offline read from it. `key` names the setting in the one-line error."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, allow_patterns=list(patterns) if patterns else None,
                                      local_files_only=offline()))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"{key}={repo_id!r} is not a local path, and the Hugging Face cache holds no "
                                f"{repo_type} of that name (offline: HF_HUB_OFFLINE=1, nothing is downloaded)") from None
    except (RepositoryNotFoundError, HFValidationError):
        raise FileNotFoundError(f"{key}={repo_id!r} is neither a local path nor a Hugging Face {repo_type}") from None


@dataclass(frozen=True)
class PretrainedTokenizer:
    """A tokenizers file and its end-of-document token."""
    file: Path
    eod_token: str

    def identity(self) -> dict:
        return {"sha256": hashlib.sha256(self.file.read_bytes()).hexdigest(), "eod_token": self.eod_token}


def _special(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": string}."""
    return value.get("content") if isinstance(value, dict) else value


def end_of_document(folder: Path, file: Path) -> str:
    """The tokenizer's end-of-document token: eos, bos or sep of its configuration files (the first defined),
    else the only special token of its tokenizer.json."""
    for config in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / config).exists():
            settings = json.loads((folder / config).read_text())
            for role in EOD_ROLES:
                if _special(settings.get(role)):
                    return _special(settings[role])
    special = [t["content"] for t in json.loads(file.read_text()).get("added_tokens", []) if t.get("special")]
    if len(special) == 1:
        return special[0]
    raise ValueError(f"data.tokenizer {str(file)!r} defines no end-of-document token (no eos, bos or sep in a "
                     f"tokenizer_config.json or special_tokens_map.json beside it, and {len(special)} special tokens); "
                     "name one with data.eod_token=<token>")


def converted(folder: Path) -> Path:
    """tokenizer.json of a tokenizer folder that has none, written into it by `transformers`' AutoTokenizer
    (a "slow" tokenizer converted to its `tokenizers` form)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise FileNotFoundError(f"data.tokenizer {str(folder)!r} has no tokenizer.json; pip install transformers "
                                "to convert its tokenizer") from None
    file = folder / "tokenizer.json"
    AutoTokenizer.from_pretrained(str(folder), use_fast=True).backend_tokenizer.save(str(file))
    return file


def resolve_tokenizer(cfg: DataConfig) -> PretrainedTokenizer | None:
    """data.tokenizer as a tokenizers file and end-of-document token; None for `bpe` (trained later)."""
    if cfg.tokenizer == "bpe":
        return None
    path = Path(cfg.tokenizer).expanduser()
    if path.is_file():
        folder, file = path.parent, path
    else:
        folder = path if path.is_dir() else hub_snapshot(cfg.tokenizer, "model", "data.tokenizer", TOKENIZER_FILES)
        file = folder / "tokenizer.json" if (folder / "tokenizer.json").exists() else converted(folder)
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"data.tokenizer {str(file)!r} is not a tokenizers tokenizer.json ({err})") from err
    eod = cfg.eod_token or end_of_document(folder, file)
    if tok.token_to_id(eod) is None:
        raise ValueError(f"data.eod_token {eod!r} is not a token of {str(file)!r}")
    return PretrainedTokenizer(file, eod)


def resolve_dataset(cfg: DataConfig) -> tuple[str, dict]:
    """(what `hf_rows` reads, its identity): a local path with its files' names, sizes and modification times;
    offline, a dataset id's cached repository folder and revision; online, the id (streamed)."""
    path = Path(cfg.dataset).expanduser()
    if not path.exists():
        if not offline():
            return cfg.dataset, {"dataset": cfg.dataset}
        path = hub_snapshot(cfg.dataset, "dataset", "data.dataset")
    path = path.resolve()
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    h = hashlib.sha256()
    for file in files:
        st = file.stat()
        h.update(f"{file.relative_to(path.parent)}|{st.st_size}|{st.st_mtime_ns}\0".encode())
    return str(path), {"path": str(path), "files": len(files), "files_sha256": h.hexdigest()}


def cache_key(cfg: DataConfig, dataset: dict, tokenizer: PretrainedTokenizer | None) -> str:
    spec = {
        "format": CACHE_FORMAT, "dataset": dataset, "config": cfg.hf_config, "split": cfg.hf_split or "train",
        "text_column": cfg.text_column or "text", "max_docs": cfg.max_docs, "val_fraction": cfg.val_fraction,
        "tokenizer": tokenizer.identity() if tokenizer else {"bpe": BPE_SETTINGS, "vocab_size": cfg.vocab_size},
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def prepare_argv(cfg: DataConfig, source: str, tokenizer: PretrainedTokenizer | None, out: Path) -> list[str]:
    """The `python -m k3lab.data.prepare` arguments that build the shards of `cfg` into `out`."""
    argv = ["--source", f"hf:{source}", "--out", str(out), "--val-fraction", str(cfg.val_fraction)]
    if tokenizer is None:
        argv += ["--vocab-size", str(cfg.vocab_size)]
    else:
        argv += ["--tokenizer", str(tokenizer.file), "--eod-token", tokenizer.eod_token]
    for flag, value in (("--hf-config", cfg.hf_config), ("--hf-split", cfg.hf_split),
                        ("--text-column", cfg.text_column), ("--max-docs", cfg.max_docs)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def prepare_hf(cfg: DataConfig) -> Path:
    """The shard folder of `cfg` (data=hf), built first when the cache has none."""
    from . import prepare

    tokenizer = resolve_tokenizer(cfg)
    source, dataset = resolve_dataset(cfg)
    root = resolve_cache_dir(cfg.cache_dir) / "hf"
    key = cache_key(cfg, dataset, tokenizer)
    entry = root / key
    if (entry / tokens.META).exists():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f"{key}.lock"):  # one process builds, concurrent ones wait, then read it
        if (entry / tokens.META).exists():
            return entry
        for stale in root.glob(f".{key}.tmp*"):  # left by a process killed while building
            shutil.rmtree(stale, ignore_errors=True)
        building = root / f".{key}.tmp{os.getpid()}"
        argv = prepare_argv(cfg, source, tokenizer, building)
        print(f"data=hf: tokenising {cfg.dataset} with {cfg.tokenizer}, once: later runs read it from {entry}",
              flush=True)
        t0 = time.perf_counter()
        try:
            meta = prepare.prepare(prepare.build_parser().parse_args(argv),
                                   command=shlex.join([prepare.PROG, *prepare_argv(cfg, source, tokenizer, entry)]))
        except Exception as err:  # noqa: BLE001 - `datasets` wraps what went wrong while reading the documents
            shutil.rmtree(building, ignore_errors=True)
            cause = prepare._root_cause(err)
            raise cause if cause is not err and isinstance(cause, (ValueError, OSError)) else err
        os.rename(building, entry)  # the complete folder appears at once
        print(prepare.report(meta, entry).replace("wrote ", "data=hf: wrote ", 1)
              + f"\n({time.perf_counter() - t0:.1f} s)", flush=True)
    return entry
