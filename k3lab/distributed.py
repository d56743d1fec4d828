"""Collectives over data-parallel ranks for statistics the model pools (router load, QB quantiles).

Each is the identity in a single process, so the model code that calls them runs unchanged on one
device, under DDP or FSDP, or in a test. torch.distributed only: the tensors are small (per-expert
counts, one batch of router margins), so no strategy-level API is needed.

They use the default (world) process group, which is the data-parallel group: under trainer=ddp every
process is a data-parallel rank, and under trainer=fsdp the mesh is 1-D over every process
(k3lab.parallel.ShardedStrategy; K3LitModule.configure_model refuses a mesh that leaves any out), so
a QB quantile is taken over the tokens of every rank's batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (no-op without torch.distributed)."""
    if is_distributed():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_rows(t: torch.Tensor, pad_value: float) -> torch.Tensor:
    """t [m_r, n] on each rank -> [sum_r m_r', n] with every rank's rows (shorter ranks padded with
    pad_value up to the longest, so pick a value that cannot change the statistic)."""
    if not is_distributed():
        return t
    sizes = [torch.zeros(1, dtype=torch.int64, device=t.device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.full((longest, t.shape[1]), pad_value, dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat(parts)


def broadcast_from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Every rank ends with rank 0's copy (guards against any non-determinism between ranks)."""
    if is_distributed():
        dist.broadcast(t, src=0)
    return t
