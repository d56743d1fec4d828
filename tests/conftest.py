"""Fixtures shared by the test files that train through run.py in subprocesses, and the CPU threads of a test
process."""
import os
from pathlib import Path

import pytest

from test_train import small_corpus


def pytest_configure(config):
    """Several test processes side by side (pytest-xdist, one worker per core) share the cores: each gets its
    share of threads. Two workers of two threads each on two cores would stall on each other's OpenMP
    barriers, ops then taking 100x their time (docs/default_run.md has the measurement on a busy machine).
    The runs a test starts choose their own threads from the machine's load (k3lab.rundir.cpu_threads)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A tokenizer cache of this test's own ($K3LAB_CACHE), inherited by the runs it starts."""
    monkeypatch.setenv("K3LAB_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def corpus(tmp_path) -> Path:
    """This test's own small text corpus (test_train.small_corpus)."""
    return small_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """The run directory of 6 steps of a small model on small_corpus with a BPE of 300 tokens and recall probes
    at lengths 64 and 128, trained in this process with a tokenizer cache of its own: for the tests that read a
    run (sampling, evaluation, probes)."""
    import os

    from test_train import FAST, run_inprocess

    base = tmp_path_factory.mktemp("trained_run")
    before = os.environ.get("K3LAB_CACHE")
    os.environ["K3LAB_CACHE"] = str(base / "cache")
    try:
        run_inprocess(["data=text", f"data.path={small_corpus(base / 'corpus')}", f"out_dir={base / 'runs'}", *FAST,
                       "train.max_steps=6", "run_name=r", "probes=recall", "probes.lengths=[64,128]",
                       "probes.examples=8"])
    finally:
        if before is None:
            os.environ.pop("K3LAB_CACHE")
        else:
            os.environ["K3LAB_CACHE"] = before
    return base / "runs" / "default" / "r"
