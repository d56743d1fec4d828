"""Fixtures shared by the test files that train through run.py in subprocesses."""
from pathlib import Path

import pytest

from test_train import small_corpus


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A tokenizer cache of this test's own ($K3LAB_CACHE), inherited by the runs it starts."""
    monkeypatch.setenv("K3LAB_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def corpus(tmp_path) -> Path:
    """This test's own small text corpus (test_train.small_corpus)."""
    return small_corpus(tmp_path / "corpus")
