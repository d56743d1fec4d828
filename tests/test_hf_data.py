"""data=hf (k3lab/data/hf.py): a dataset and a tokenizer in one command, offline, tokenised once into the cache."""
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from k3lab.config import DataConfig, check_config
from k3lab.data import hf, prepare, tokens
from k3lab.data.datamodule import K3DataModule
from k3lab.errors import ConfigError, DataError
from test_train import FAST, ROOT, run_inprocess

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def documents(n: int = 40, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, 120)) for _ in range(n)]


def tokenizer_json(path: Path, special: list[str]) -> Path:
    """A byte-level BPE tokenizer.json of 300 tokens with the given special tokens (ids 0, 1, ...)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(documents(), trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture
def local(tmp_path) -> tuple[Path, Path]:
    """(a dataset folder of two .jsonl files, a Hugging Face-style tokenizer folder whose tokenizer_config.json
    names eos </s>)."""
    ds = tmp_path / "ds"
    ds.mkdir()
    docs = documents()
    for name, part in (("a.jsonl", docs[:20]), ("b.jsonl", docs[20:])):
        (ds / name).write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(part)))
    tok = tmp_path / "tok"
    tokenizer_json(tok / "tokenizer.json", ["<s>", "</s>", "<pad>"])
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return ds, tok


def data_cfg(tmp_path: Path, dataset, tokenizer, **kw) -> DataConfig:
    return DataConfig(name="hf", dataset=str(dataset), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache"),
                      seq_len=32, val_fraction=0.1, **kw)


def test_run_from_a_local_folder_and_tokenizer(local, tmp_path, monkeypatch):
    """One command trains; the shards hold every document once, tokenised by the given tokenizer with its eos
    after each; a second run reads the cache without preparing anything."""
    ds, tok = local
    monkeypatch.setenv("K3LAB_CACHE", str(tmp_path / "cache"))
    args = ["data=hf", f"data.dataset={ds}", f"data.tokenizer={tok}", f"out_dir={tmp_path / 'runs'}", *FAST,
            "train.max_steps=2"]
    summary = run_inprocess([*args, "run_name=first"])
    assert summary["status"] == "completed" and summary["tokenizer"]["eod_token"] == "</s>"
    (entry,) = (tmp_path / "cache" / "hf").glob("*/meta.json")
    meta = json.loads(entry.read_text())
    assert meta["eod_id"] == 1 and meta["documents"] == 40 and meta["vocab_size"] == 300
    stream = np.concatenate([tokens.open_split(entry.parent, meta, s) for s in ("train", "val")])
    expected = Tokenizer.from_file(str(tok / "tokenizer.json"))
    assert sorted(stream.tolist()) == sorted(i for t in documents() for i in expected.encode(t).ids + [1])

    def no_second_prepare(*a, **k):
        raise AssertionError("the cache was prepared again")

    monkeypatch.setattr(prepare, "prepare", no_second_prepare)
    assert run_inprocess([*args, "run_name=second"])["loss_val_final"] == summary["loss_val_final"]


def test_key_follows_identity(local, tmp_path):
    """A change of tokenizer, split fraction, document cap or any dataset file makes a new entry; the same
    settings find the old one."""
    ds, tok = local
    first = hf.prepare_hf(data_cfg(tmp_path, ds, tok))
    assert hf.prepare_hf(data_cfg(tmp_path, ds, tok)) == first
    others = [hf.prepare_hf(data_cfg(tmp_path, ds, tok, max_docs=30)), hf.prepare_hf(data_cfg(tmp_path, ds, "bpe",
                                                                                             vocab_size=280))]
    (ds / "a.jsonl").write_text((ds / "a.jsonl").read_text() + json.dumps({"text": "alpha beta", "n": 99}) + "\n")
    others.append(hf.prepare_hf(data_cfg(tmp_path, ds, tok)))
    assert len({first, *others}) == 4
    assert json.loads((others[-1] / tokens.META).read_text())["documents"] == 41
    assert json.loads((others[1] / tokens.META).read_text())["tokenizer"]["kind"] == "bpe"


def test_offline_from_the_hugging_face_cache(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1: a dataset id and a tokenizer id are found in the Hugging Face cache (a dataset as its
    repository's files: parquet shards named by split), nothing is downloaded, and a name that is not cached
    is one clear line."""
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    for repo, files in (("datasets--acme--corpus", {"data/train-00000-of-00001.parquet": None,
                                                     "data/test-00000-of-00001.parquet": None}),
                        ("models--acme--tok", {"tokenizer.json": None, "special_tokens_map.json": None})):
        (hub / repo / "refs").mkdir(parents=True)
        (hub / repo / "refs" / "main").write_text("a" * 40)
        snapshot = hub / repo / "snapshots" / ("a" * 40)
        for name in files:
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
    snap = hub / "datasets--acme--corpus" / "snapshots" / ("a" * 40) / "data"
    pq.write_table(pa.table({"content": documents(30)}), snap / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"content": documents(5, seed=1)}), snap / "test-00000-of-00001.parquet")
    tok = hub / "models--acme--tok" / "snapshots" / ("a" * 40)
    tokenizer_json(tok / "tokenizer.json", ["<|bos|>", "<|eos|>"])
    (tok / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))

    entry = hf.prepare_hf(data_cfg(tmp_path, "acme/corpus", "acme/tok", text_column="content"))
    meta = json.loads((entry / tokens.META).read_text())
    assert meta["documents"] == 30 and meta["tokenizer"]["eod_token"] == "<|eos|>" and meta["eod_id"] == 1
    test_split = hf.prepare_hf(data_cfg(tmp_path, "acme/corpus", "acme/tok", text_column="content", hf_split="test"))
    assert json.loads((test_split / tokens.META).read_text())["documents"] == 5
    for dataset, tokenizer, says in (("acme/missing", "acme/tok", "data.dataset='acme/missing'"),
                                     ("acme/corpus", "acme/nope", "data.tokenizer='acme/nope'")):
        with pytest.raises(FileNotFoundError, match=f"{says} is not a local path, and the Hugging Face cache"):
            hf.prepare_hf(data_cfg(tmp_path, dataset, tokenizer, text_column="content"))


def test_end_of_document_token(tmp_path):
    """eos, else bos, else sep of tokenizer_config.json (then special_tokens_map.json); else the only special
    token of tokenizer.json; else a line that says how to name one."""
    file = tokenizer_json(tmp_path / "t" / "tokenizer.json", ["[CLS]", "[SEP]", "<s>"])
    for config, eod in (({"bos_token": "<s>", "sep_token": "[SEP]"}, "<s>"), ({"sep_token": "[SEP]"}, "[SEP]"),
                        ({"eos_token": None, "sep_token": {"content": "[SEP]"}}, "[SEP]")):
        (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(config))
        assert hf.end_of_document(tmp_path / "t", file) == eod
    (tmp_path / "t" / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="defines no end-of-document token .* data.eod_token=<token>"):
        hf.end_of_document(tmp_path / "t", file)
    one = tokenizer_json(tmp_path / "one" / "tokenizer.json", ["<|endoftext|>"])
    assert hf.resolve_tokenizer(data_cfg(tmp_path, tmp_path, one)).eod_token == "<|endoftext|>"
    assert hf.resolve_tokenizer(data_cfg(tmp_path, tmp_path, file, eod_token="[CLS]")).eod_token == "[CLS]"
    with pytest.raises(ValueError, match="data.eod_token 'nope' is not a token of"):
        hf.resolve_tokenizer(data_cfg(tmp_path, tmp_path, file, eod_token="nope"))


def _first_use(cfg: DataConfig, out: Path) -> None:
    """prepare_hf in a forked process: writes the entry it got and whether it built it."""
    import contextlib
    import io

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        entry = hf.prepare_hf(cfg)
    out.write_text(json.dumps({"entry": str(entry), "built": "data=hf: tokenising" in said.getvalue()}))


def test_concurrent_first_uses_build_once(local, tmp_path):
    """Two processes that want the same shards at once: one builds, the other waits and reads the same folder;
    a temporary folder that a killed build left is removed, and nothing but the entry and its lock remains."""
    import multiprocessing

    ds, tok = local
    cfg = data_cfg(tmp_path, ds, tok)
    key = hf.cache_key(cfg, hf.resolve_dataset(cfg)[1], hf.resolve_tokenizer(cfg))
    (tmp_path / "cache" / "hf" / f".{key}.tmp99999" / "junk").mkdir(parents=True)
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_first_use, args=(cfg, tmp_path / f"out{i}.json")) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    outs = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert {o["entry"] for o in outs} == {str(tmp_path / "cache" / "hf" / key)}
    assert sorted(o["built"] for o in outs) == [False, True]
    assert sorted(p.name for p in (tmp_path / "cache" / "hf").iterdir()) == [key, f"{key}.lock"]


def test_config_refuses_what_does_nothing(local, tmp_path):
    ds, tok = local
    cases = [(["data=hf", f"data.dataset={ds}", "data.tokenizer=byte"], "data.tokenizer='byte' is not an option"),
             (["data=hf", f"data.dataset={ds}", "data.tokenizer=bpe", "data.path=/x"],
              "data.path=/x acts with data=text/tokens only: data=hf does not read it"),
             (["data=hf", f"data.dataset={ds}", "data.tokenizer=bpe", "data.eod_token=x"], "applies to a pretrained"),
             (["data=hf", f"data.dataset={ds}", f"data.tokenizer={tok}", "data.max_docs=1"], "data.max_docs=1 must be"),
             (["data=sotu", "data.dataset=x"], "data.dataset=x acts with data=hf only: data=sotu does not read it"),
             (["data=text", f"data.path={ds}", f"data.tokenizer={tok}"], "data.tokenizer="),
             (["data=hf", f"data.dataset={ds}", f"data.tokenizer={tmp_path / 'none.json'}"], "data.tokenizer")]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        check_config(compose("config", overrides=["data=hf", f"data.dataset={ds}", f"data.tokenizer={tok}"]))
        for overrides, says in cases:
            with pytest.raises((ConfigError, DataError), match=says.replace("(", r"\(").replace(")", r"\)")):
                check_config(compose("config", overrides=overrides), overrides)


def test_datamodule_samples_the_shards(local, tmp_path):
    """data=hf trains like data=tokens: random windows of the shards, the validation windows from val.bin."""
    ds, tok = local
    dm = K3DataModule(data_cfg(tmp_path, ds, tok, batch_size=4), seed=0)
    dm.prepare_data()
    dm.setup("fit")
    x, y = dm.train_batch(0)
    assert x.shape == (4, 32) and (x[:, 1:] == y[:, :-1]).all() and dm.vocab_size == 300
    assert dm.info["splits"]["val"]["documents"] == 4


def test_folder_without_tokenizer_json(tmp_path, monkeypatch):
    """A tokenizer folder with no tokenizer.json goes through transformers' AutoTokenizer (here a stand-in that
    returns a known `tokenizers` tokenizer) into a tokenizer.json beside its files; without transformers, one
    line says what to install."""
    import types

    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    known = Tokenizer.from_file(str(tokenizer_json(tmp_path / "known" / "tokenizer.json", ["<s>", "</s>"])))
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json; pip install transformers"):
        hf.resolve_tokenizer(data_cfg(tmp_path, tmp_path, folder))
    loaded = []
    auto = types.SimpleNamespace(from_pretrained=lambda path, use_fast: loaded.append((path, use_fast)) or
                                 types.SimpleNamespace(backend_tokenizer=known))
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=auto))
    tok = hf.resolve_tokenizer(data_cfg(tmp_path, tmp_path, folder))
    assert loaded == [(str(folder), True)] and tok.file == folder / "tokenizer.json" and tok.eod_token == "</s>"
    assert Tokenizer.from_file(str(tok.file)).to_str() == known.to_str()
