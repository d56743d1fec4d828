"""A non-finite loss on one data-parallel rank stops every rank (2 CPU processes, gloo): a rank that
stopped alone would leave the other waiting in its next collective."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3lab.lit import NonFiniteLossError, check_finite


def all_reduce(t: torch.Tensor, reduce_op: str) -> torch.Tensor:
    assert reduce_op == "sum"
    dist.all_reduce(t)
    return t


def _worker(rank: int, world: int, port: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        outcome = []
        for nan_rank in (None, 1):   # step 0: finite everywhere; step 1: NaN on rank 1 only
            loss = torch.tensor(float("nan") if rank == nan_rank else 2.5)
            try:
                check_finite(loss, step=len(outcome), reduce=all_reduce)
                outcome.append("ok")
            except NonFiniteLossError as err:
                outcome.append(str(err))
        torch.save(outcome, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_nan_on_one_rank_stops_both(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        ok, stopped = torch.load(tmp_path / f"rank{rank}.pt")
        assert ok == "ok"
        assert "at step 1 (not finite on 1 rank(s))" in stopped, stopped


def test_single_process_reduce_is_the_identity():
    def identity(t, reduce_op):
        return t

    check_finite(torch.tensor(1.0), 0, reduce=identity)
    with pytest.raises(NonFiniteLossError, match="at step 7"):
        check_finite(torch.tensor(float("inf")), 7, reduce=identity)


def identity(t, reduce_op):
    return t


def test_a_window_of_steps_names_its_first_non_finite_step():
    """losses [W] of the steps ending at `step`: the first non-finite one is named, whichever comes after it."""
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 7 \(not finite on 1 rank"):
        check_finite(torch.tensor([2.5, float("nan"), float("inf"), 3.0]), 9, reduce=identity)
    sums, norms = check_finite(torch.tensor([2.5, 3.0]), 9, reduce=identity, grad_norm=torch.tensor([0.5, 0.25]))
    assert sums == [2.5, 3.0] and norms == [0.5, 0.25]


def test_a_non_finite_gradient_norm_stops_with_a_finite_loss():
    with pytest.raises(NonFiniteLossError, match="gradient norm is inf at step 5"):
        check_finite(torch.tensor([2.5, 3.0]), 5, reduce=identity, grad_norm=torch.tensor([0.5, float("inf")]))
