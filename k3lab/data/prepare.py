"""`python -m k3lab.data.prepare`: tokenise a corpus once into token shards for `data=tokens`.

    python -m k3lab.data.prepare --source sotu --out data/sotu-bpe1024 --vocab-size 1024
    python -m k3lab.data.prepare --source python-code --out data/pycode-32k --vocab-size 32768 --workers 16
    python -m k3lab.data.prepare --source ~/corpus --out data/mine --tokenizer gpt2/tokenizer.json
    python -m k3lab.data.prepare --source hf:HuggingFaceFW/fineweb-edu --hf-config sample-10BT \\
        --max-docs 1000000 --out data/fwe-1m --vocab-size 32768 --workers 16

`--source` is one of
  sotu          the State of the Union addresses of the `sotu` package (what `data=sotu` reads)
  python-code   every .py file of the running interpreter's site-packages and standard library
                (`corpus.python_code_files`), sorted, one document each: a corpus on any machine
  PATH          a local file or folder: each .txt file one document, each .jsonl line and each
                .parquet row another (`--text-column`); `data=text data.path=PATH` reads the same
                .txt / .jsonl documents under the same ids
  hf:NAME       a Hugging Face dataset, streamed with `datasets.load_dataset(NAME, streaming=True)`; NAME may
                be a local folder laid out as a dataset repository, or a file, which `datasets` reads as
                the Hub would (`hf_rows`)

The steps: the documents go into a local Arrow table (`datasets.Dataset.from_generator`, in a
temporary folder inside `--out`, removed at the end); the split is by document, with the ids and
rule of `data=sotu` / `data=text` (`corpus.split_ids`), so those sources get the same validation
documents; a byte-level BPE is trained on the training documents (`BPETokenizer.train`, the
recipe of the cached corpora) or a given tokenizer.json is loaded; `Dataset.map(num_proc=--workers)`
encodes every document and appends the end-of-document id; one pass writes train.bin and val.bin in
document order (`numpy.memmap`), then the id counts, the tokenizer and, last, meta.json
(`k3lab.data.tokens` describes the format). At the end it prints documents, tokens and the
unigram entropy of the validation split.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import itertools
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..fileio import atomic_write_bytes
from . import corpus, tokens
from .datamodule import counts_cross_entropy
from .tokenizer import BPE_SETTINGS, EOD_TOKEN, BPETokenizer, token_dtype

PROG = "python -m k3lab.data.prepare"
NAMED_SOURCES = ("sotu", "python-code")
HF_PREFIX = "hf:"
DEFAULT_VOCAB = 1024
BATCH = 1000  # documents per `Dataset.map` call and per write


class UsageError(ValueError):
    """A bad command-line value: `argument --flag: 'value' ...`, printed as one line."""

    def __init__(self, flag: str, value: object, problem: str):
        super().__init__(f"argument {flag}: {str(value)!r} {problem}")


@dataclass(frozen=True)
class Source:
    """What to read. `kind` is sotu | python-code | path | hf; `name` is --source as typed."""
    kind: str
    name: str
    text_column: str = "text"
    hf_config: str | None = None
    hf_split: str = "train"
    max_docs: int | None = None
    roots: tuple[tuple[str, str], ...] = ()   # python-code: (label, folder) read
    files: tuple[tuple[str, Path], ...] = ()  # python-code: (doc_id, file), already capped at max_docs


def iter_documents(source: Source) -> Iterator[corpus.Document]:
    """`(doc_id, text)` of `source`, in source order, at most `source.max_docs` of them."""
    if source.kind == "sotu":
        docs: Iterator[corpus.Document] = iter(corpus.sotu_documents())
    elif source.kind == "python-code":
        docs = corpus.python_code_documents(source.files)
    elif source.kind == "path":
        docs = corpus.iter_text_documents(source.name, source.text_column, corpus.LOCAL_SUFFIXES, "--source")
    else:
        rows = hf_rows(source.name[len(HF_PREFIX):], source.hf_config, source.hf_split)
        docs = corpus.stream_documents(rows, source.hf_split, source.text_column, source.name)
    return itertools.islice(docs, source.max_docs)


# the `datasets` builder of a single local file, by its suffix
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
                 ".arrow": "arrow"}


def hf_rows(name: str, config: str | None, split: str):
    """The rows of one split of a dataset, streamed by `datasets`: NAME a Hugging Face dataset id, a local
    folder (its format and splits read from its file names, as for a dataset repository on the Hub) or a
    local file (its builder from its suffix, FILE_BUILDERS; all of it is the split)."""
    import datasets

    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise ValueError(f"{name}: not a file `datasets` reads; suffixes: {', '.join(FILE_BUILDERS)}")
        return datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files={split: str(path)}, split=split,
                                     streaming=True)
    return datasets.load_dataset(str(path) if path.is_dir() else name, config, split=split, streaming=True)


def _records(source: Source) -> Iterator[dict]:
    """The generator `datasets.Dataset.from_generator` materialises: one {"id", "text"} per document."""
    for doc_id, text in iter_documents(source):
        yield {"id": doc_id, "text": text}


def _encode(batch: dict, tokenizer, eod_id: int) -> dict:
    """`Dataset.map` function over a batch of documents: ids (+ eod), their count, UTF-8 bytes and
    sha256(id NUL text), the per-document part of the corpus identity."""
    encodings = tokenizer.encode_batch(batch["text"], add_special_tokens=False)
    ids = [e.ids + [eod_id] for e in encodings]
    raw = [t.encode("utf-8") for t in batch["text"]]
    digests = [hashlib.sha256(d.encode("utf-8") + b"\0" + r).digest() for d, r in zip(batch["id"], raw)]
    return {"ids": ids, "n_tokens": [len(i) for i in ids], "n_bytes": [len(r) for r in raw], "sha256": digests}


# ---------------------------------------------------------------------------------------------
# command line


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {low}")
        return value
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number strictly between 0 and 1")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line on stderr, no usage block: the flag, the value, what is valid."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Tokenise a corpus into token shards for data=tokens (docs/data.md).")
    p.add_argument("--source", required=True,
                   help="sotu | python-code | a local .txt/.jsonl/.parquet file or folder | hf:<dataset name>")
    p.add_argument("--out", required=True, help="the shard folder to write (data.path of data=tokens)")
    p.add_argument("--tokenizer", default="bpe",
                   help="bpe: train a byte-level BPE on the training documents; or a tokenizer.json to load")
    p.add_argument("--vocab-size", type=_int_at_least(258), default=None,
                   help=f"BPE vocabulary, special token included (default {DEFAULT_VOCAB}; only with --tokenizer bpe)")
    p.add_argument("--eod-token", default=None,
                   help=f"end-of-document token of a loaded tokenizer.json (default {EOD_TOKEN})")
    p.add_argument("--val-fraction", type=_fraction, default=0.05, help="share of documents held out (default 0.05)")
    p.add_argument("--text-column", default=None,
                   help="field of .jsonl records / column of .parquet files and hf datasets (default text)")
    p.add_argument("--hf-config", default=None, help="configuration of an hf: dataset")
    p.add_argument("--hf-split", default=None, help="split of an hf: dataset (default train)")
    p.add_argument("--roots", nargs="+", default=None,
                   help="python-code: read these folders instead of site-packages and the standard library")
    p.add_argument("--max-docs", type=_int_at_least(2), default=None,
                   help="keep the first N documents in source order (python-code: the first N files)")
    p.add_argument("--workers", type=_int_at_least(1), default=default_workers(),
                   help="processes that encode (Dataset.map num_proc; default: the CPUs this process may use)")
    p.add_argument("--overwrite", action="store_true", help="replace the shards already in --out")
    return p


def resolve_source(args: argparse.Namespace) -> Source:
    """--source and the flags that belong to it -> a `Source`; a UsageError names a bad one."""
    spec = args.source
    if spec in NAMED_SOURCES:
        kind = spec
    elif spec.startswith(HF_PREFIX):
        if not spec[len(HF_PREFIX):]:
            raise UsageError("--source", spec, "names no dataset; write hf:<owner>/<name>")
        kind = "hf"
    elif Path(spec).expanduser().exists():
        kind = "path"
    else:
        raise UsageError("--source", spec, "is not sotu, python-code, hf:<dataset name>, or an existing "
                                           "file or folder of .txt / .jsonl / .parquet")
    for flag, value, kinds in (("--text-column", args.text_column, ("path", "hf")),
                               ("--hf-config", args.hf_config, ("hf",)), ("--hf-split", args.hf_split, ("hf",)),
                               ("--roots", args.roots, ("python-code",))):
        if value is not None and kind not in kinds:
            valid = " or ".join({"path": "a local path", "hf": "hf:<name>"}.get(k, k) for k in kinds)
            raise UsageError(flag, value if not isinstance(value, list) else " ".join(value),
                             f"applies only to --source {valid}, not to --source {spec}")
    roots: list[tuple[str, Path]] = []
    files: list[tuple[str, Path]] = []
    if kind == "python-code":
        for root in args.roots or []:
            if not Path(root).is_dir():
                raise UsageError("--roots", root, "is not a folder")
        roots = [(root, Path(root)) for root in dict.fromkeys(args.roots)] if args.roots else corpus.python_code_roots()
        files = corpus.python_code_files(roots, args.max_docs)
        if not files:
            raise UsageError("--roots" if args.roots else "--source", " ".join(args.roots or [spec]),
                             "holds no .py files")
    elif kind == "path":
        corpus.text_files(Path(spec).expanduser(), corpus.LOCAL_SUFFIXES, "--source")  # a clear error if none
    return Source(kind=kind, name=spec, text_column=args.text_column or "text", hf_config=args.hf_config,
                  hf_split=args.hf_split or "train", max_docs=args.max_docs,
                  roots=tuple((label, str(folder)) for label, folder in roots), files=tuple(files))


def resolve_tokenizer(args: argparse.Namespace) -> BPETokenizer | None:
    """The loaded tokenizer for --tokenizer <file>, None for bpe (trained later, on the train split)."""
    if args.tokenizer == "bpe":
        if args.eod_token is not None:
            raise UsageError("--eod-token", args.eod_token, "applies only to a loaded tokenizer.json; "
                             f"a trained BPE ends documents with {EOD_TOKEN}")
        return None
    if args.vocab_size is not None:
        raise UsageError("--vocab-size", args.vocab_size, f"applies only to --tokenizer bpe; {args.tokenizer} "
                         "brings its own vocabulary")
    path = Path(args.tokenizer).expanduser()
    if not path.is_file():
        raise UsageError("--tokenizer", args.tokenizer, "is neither bpe nor an existing tokenizer.json file")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        raise UsageError("--tokenizer", args.tokenizer, f"is not a tokenizers tokenizer.json ({err})") from err
    eod = args.eod_token or EOD_TOKEN
    if tok.token_to_id(eod) is None:
        raise UsageError("--eod-token", eod, f"is not a token of {args.tokenizer}; name its end-of-document "
                         "token with --eod-token")
    return BPETokenizer(tok, eod)


def check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError("--out", out, "is a file, not a folder")
    if (out / tokens.META).exists() and not overwrite:
        raise UsageError("--out", out, f"already holds token shards ({tokens.META}); pass --overwrite to replace them")


# ---------------------------------------------------------------------------------------------
# the pipeline


def prepare(args: argparse.Namespace, command: str) -> dict:
    """Read, split, tokenise and write `args.out`; returns meta.json's contents."""
    loaded = resolve_tokenizer(args)
    out = Path(args.out).expanduser()
    check_out(out, args.overwrite)
    source = resolve_source(args)  # last: python-code walks every installed package
    out.mkdir(parents=True, exist_ok=True)
    (out / tokens.META).unlink(missing_ok=True)  # the folder is incomplete until the new meta.json lands
    scratch = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out))
    try:
        return _prepare(args, source, loaded, out, scratch, command)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _prepare(args, source: Source, loaded: BPETokenizer | None, out: Path, scratch: Path, command: str) -> dict:
    import datasets

    t0 = time.perf_counter()
    docs = datasets.Dataset.from_generator(_records, gen_kwargs={"source": source}, cache_dir=str(scratch),
                                           fingerprint="documents")
    is_val = corpus.split_ids(list(docs["id"]), args.val_fraction, what="argument --val-fraction")
    t_read = time.perf_counter()
    vocab_size = args.vocab_size or DEFAULT_VOCAB
    if loaded is None:
        print(f"training a byte-level BPE of {vocab_size} tokens on {int((~is_val).sum()):,} training documents",
              flush=True)
        train_docs = docs.select(np.flatnonzero(~is_val))
        texts = (text for batch in train_docs.iter(batch_size=BATCH) for text in batch["text"])
        tok = BPETokenizer.train(texts, vocab_size, show_progress=sys.stderr.isatty())
    else:
        tok = loaded
    t_tok = time.perf_counter()
    dtype = token_dtype(tok.vocab_size)
    if args.workers > 1:  # each worker encodes its own shard; rayon threads inside each would oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    features = datasets.Features({
        "id": datasets.Value("string"), "val": datasets.Value("bool"), "ids": datasets.List(datasets.Value(dtype.name)),
        "n_tokens": datasets.Value("int64"), "n_bytes": datasets.Value("int64"), "sha256": datasets.Value("binary")})
    encoded = docs.add_column("val", is_val).map(
        _encode, batched=True, batch_size=BATCH, remove_columns=["text"], features=features,
        num_proc=args.workers if args.workers > 1 else None, fn_kwargs={"tokenizer": tok.tok, "eod_id": tok.eod_id},
        new_fingerprint="encoded", desc="encode")
    t_enc = time.perf_counter()
    splits, counts, digest = write_splits(encoded, out, scratch, dtype, tok.vocab_size)
    t_write = time.perf_counter()

    np.save(out / tokens.TRAIN_COUNTS, counts["train"])
    if loaded is None:
        tok.save(out / tokens.TOKENIZER)
        tok_meta = {"kind": "bpe", "trained_on": "train split", "vocab_size_requested": vocab_size,
                    "settings": BPE_SETTINGS}
    else:  # the file as given, byte for byte
        shutil.copyfile(Path(args.tokenizer).expanduser(), out / tokens.TOKENIZER)
        tok_meta = {"kind": "loaded", "from": str(Path(args.tokenizer).expanduser().resolve())}
    meta = {
        "format": tokens.FORMAT, "version": tokens.VERSION, "dtype": dtype.name,
        "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
        "tokenizer": {"file": tokens.TOKENIZER, "eod_token": tok.eod_token,
                      "sha256": hashlib.sha256((out / tokens.TOKENIZER).read_bytes()).hexdigest(), **tok_meta},
        "splits": splits,
        "documents": len(is_val), "tokens": sum(s["tokens"] for s in splits.values()),
        "val_fraction": args.val_fraction,
        "source": source_identity(source, len(is_val), int(np.asarray(encoded["n_bytes"]).sum()), digest),
        "unigram_entropy_val": counts_cross_entropy(counts["train"], counts["val"]),
        "command": command,
        "created_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {name: importlib.metadata.version(name) for name in ("datasets", "tokenizers", "numpy")},
        "seconds": {"read": round(t_read - t0, 2), "tokenizer": round(t_tok - t_read, 2),
                    "encode": round(t_enc - t_tok, 2), "write": round(t_write - t_enc, 2)},
    }
    atomic_write_bytes(out / tokens.META, (json.dumps(meta, indent=1) + "\n").encode())
    return meta


def write_splits(encoded, out: Path, scratch: Path, dtype: np.dtype, vocab_size: int) -> tuple[dict, dict, str]:
    """One pass over the encoded documents in order: each goes to train.bin or val.bin (written in
    `scratch`, then moved into `out`). Returns ({split: {file, tokens, documents}}, {split:
    int64 [vocab_size] id counts}, the corpus sha256 over every document's sha256 in order)."""
    import pyarrow.compute as pc
    from rich.progress import track

    n_tokens = np.asarray(encoded["n_tokens"], dtype=np.int64)
    is_val = np.asarray(encoded["val"], dtype=bool)
    masks = {"train": ~is_val, "val": is_val}
    sizes = {split: int(n_tokens[m].sum()) for split, m in masks.items()}
    tmp = {split: tokens.split_path(scratch, split) for split in tokens.SPLITS}
    arrays = {split: np.memmap(tmp[split], dtype=tokens.file_dtype(dtype.name), mode="w+", shape=(sizes[split],))
              for split in tokens.SPLITS}
    filled = {split: 0 for split in tokens.SPLITS}
    counts = {split: np.zeros(vocab_size, dtype=np.int64) for split in tokens.SPLITS}
    digest = hashlib.sha256()
    batches = encoded.with_format("arrow").iter(batch_size=BATCH)
    for table in track(batches, total=-(-len(encoded) // BATCH), description="write"):
        val = table.column("val")
        for split, mask in (("train", pc.invert(val)), ("val", val)):
            flat = pc.list_flatten(table.column("ids").filter(mask)).to_numpy()
            arrays[split][filled[split]:filled[split] + len(flat)] = flat
            filled[split] += len(flat)
            counts[split] += np.bincount(flat, minlength=vocab_size)[:vocab_size]
        digest.update(b"".join(table.column("sha256").to_pylist()))
    for split in tokens.SPLITS:
        arrays[split].flush()
        del arrays[split]
        os.replace(tmp[split], tokens.split_path(out, split))
    splits = {split: {"file": tokens.split_path(out, split).name, "tokens": sizes[split],
                      "documents": int(masks[split].sum())} for split in tokens.SPLITS}
    return splits, counts, digest.hexdigest()


def source_identity(source: Source, documents: int, n_bytes: int, digest: str) -> dict:
    """What was read and how to recognise it again: the documents' sha256 (ids and texts in order)
    for every source, plus what names the source (package version, path, interpreter and the
    file-list hash of python-code, dataset name)."""
    ident = {"source": source.name, "kind": source.kind, "documents": documents, "bytes": n_bytes,
             "sha256": digest, "max_docs": source.max_docs}
    if source.kind == "sotu":
        ident["package"] = f"sotu {importlib.metadata.version('sotu')}"
    elif source.kind == "path":
        ident.update(path=str(Path(source.name).expanduser().resolve()), text_column=source.text_column)
    elif source.kind == "python-code":
        file_sha, file_bytes = corpus.file_list_sha256(source.files)
        ident.update(interpreter=corpus.interpreter_label(), roots=dict(source.roots), files=len(source.files),
                     file_list_sha256=file_sha, file_bytes=file_bytes)
    else:
        ident.update(dataset=source.name[len(HF_PREFIX):], config=source.hf_config, split=source.hf_split,
                     text_column=source.text_column)
    return ident


def report(meta: dict, out: Path) -> str:
    """The lines printed at the end: documents, tokens, vocabulary, the validation unigram entropy."""
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    return "\n".join([
        f"wrote {out}",
        f"documents  {meta['documents']:,} (train {tr['documents']:,}, val {va['documents']:,})",
        f"tokens     {meta['tokens']:,} (train {tr['tokens']:,}, val {va['tokens']:,}), "
        f"{meta['source']['bytes'] / meta['tokens']:.2f} bytes of text per token",
        f"vocabulary {meta['vocab_size']:,} ({meta['dtype']}), end of document = id {meta['eod_id']}",
        f"unigram entropy of the validation split: {meta['unigram_entropy_val']:.4f} nats/token "
        "(its tokens under the train split's add-one unigram)",
    ])


def _root_cause(err: BaseException) -> BaseException:
    """`datasets` wraps an error raised while generating in DatasetGenerationError; unwrap it."""
    while type(err).__name__ == "DatasetGenerationError" and err.__cause__ is not None:
        err = err.__cause__
    return err


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        meta = prepare(args, command=f"{PROG} {shlex.join(argv)}")
    except Exception as err:  # noqa: BLE001 - user errors become one line; anything else keeps its traceback
        cause = _root_cause(err)
        if isinstance(cause, corpus.MissingTextField):
            cause = UsageError("--text-column", cause.field, f"is not a field of {cause.where}; "
                               f"its fields: {', '.join(cause.fields) or 'none'}")
        if not isinstance(cause, (ValueError, OSError)):
            raise
        print(f"{PROG}: error: {' '.join(str(cause).split())}", file=sys.stderr)
        return 2
    print(report(meta, Path(args.out).expanduser()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
