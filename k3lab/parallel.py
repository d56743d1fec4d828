"""Scale-out on Lightning's engines: `trainer=ddp` (DDPStrategy) and `trainer=fsdp` (FSDP2 through
Lightning's ModelParallelStrategy), plus what a Hydra multirun needs from the processes Lightning starts.

FSDP2 (`torch.distributed.fsdp.fully_shard`) is applied from outside the model, as in torchtitan: K3Model
stays plain PyTorch, and `K3LitModule.configure_model` calls `shard_model` once the strategy has built the
device mesh. Every parameter then lives as a DTensor sharded on dim 0 over the data-parallel ranks (rows
of a matrix, experts of a 3-D stack); gradients are reduce-scattered to the same shards and the optimizer
state is created on them. Lightning's FSDPStrategy (FSDP1, flat parameters) is not used: its flattened
shards cut matrices at arbitrary element offsets, while Muon needs each matrix (or head block) whole,
which a dim-0 DTensor gives back with one `full_tensor()` (k3lab/optim/muon.py).

Units (one all-gather and one reduce-scatter each), bottom-up:

    per sublayer   the matmul modules (nn.Linear, GroupedExperts)       bf16 params on GPU, fp32 reduction
                   the rest of the sublayer (norms, router, KDA A_log/dt_bias, short convs)     fp32
    root           embedding, AttnRes queries and norms, final norm,   fp32
                   lm_head (the loss reads its weight directly, k3lab/model/loss.py, so it must be
                   unsharded whenever the root's forward runs)

Precision. trainer.precision=bf16-mixed keeps Lightning's bf16 autocast, so every op runs in the dtype it
runs in under trainer=gpu, and adds FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on
the matmul units only: autocast would cast those weights to bf16 for their matmuls anyway (the same
round-to-nearest), so all-gathering them in bf16 halves the traffic without changing a matmul, while
the parameters K3 keeps in fp32 (the router, K3 eq. 11; the decay parameters; norm gains) are gathered
in fp32. trainer.precision=32-true (the CPU) runs all units in fp32. Master weights, gradients and
optimizer state are fp32 in both.

Checkpoints are sharded: DCP (torch.distributed.checkpoint) writes each rank's shards into a directory,
published atomically as checkpoints/last.ckpt (k3lab.rundir.publish_checkpoint; docs/run_directory.md).
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from k3lab.model.k3 import K3Model
from k3lab.model.moe import GroupedExperts
from k3lab.rundir import checkpoint_version, publish_checkpoint

MATMUL_MODULES = (nn.Linear, GroupedExperts)  # modules whose parameters only ever feed matmuls


def matmul_modules(module: nn.Module) -> list[nn.Module]:
    """The nn.Linear and GroupedExperts modules under `module`: under bf16 autocast their weights enter bf16
    matmuls only (Linear by autocast, GroupedExperts by casting to the autocast dtype), so a bf16 copy
    of them computes exactly what the fp32 weight does."""
    return [m for m in module.modules() if isinstance(m, MATMUL_MODULES)]


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def shard_model(model: K3Model, mesh: DeviceMesh, bf16: bool) -> None:
    """Apply FSDP2 to `model` in place over the 1-D data-parallel `mesh`, with the units and precision of
    the module docstring (bf16=True: the matmul units gather bf16 parameters and reduce in fp32). Every
    parameter becomes a DTensor sharded on dim 0 ([rows, cols] -> [rows/world, cols] per rank, uneven
    rows allowed; [E, rows, cols] -> [E/world, rows, cols]); module classes, names and tags are kept."""
    if mesh.ndim != 1:
        raise ValueError(f"shard_model takes a 1-D data-parallel mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}")
    matmul = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)  # autocast casts the activations, as without FSDP
    fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for sublayer in model.sublayers:
        fully_shard(matmul_modules(sublayer), mesh=mesh, mp_policy=matmul)
        fully_shard(sublayer, mesh=mesh, mp_policy=fp32)
    fully_shard(model, mesh=mesh, mp_policy=fp32)


class ShardedStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy as pure FSDP2: every process is a data-parallel rank (a 1-D mesh
    of `data_parallel_size` = devices x nodes, no tensor parallelism), checkpoints are sharded (DCP).

    ModelParallelStrategy writes a checkpoint's shards into the given path itself, so a process killed
    mid-write would tear the only checkpoint. Here each save goes to a new directory beside it
    (`last.ckpt.<step>-<n>`) and, once every rank has finished writing, rank 0 points the `last.ckpt`
    symlink at it and removes the older directories (k3lab.rundir.publish_checkpoint): at any moment
    `last.ckpt` is a complete checkpoint. Loading is Lightning's (DCP reads the shards through the link).
    """

    def __init__(self, data_parallel_size: int, **kwargs: Any):
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=True, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        link = Path(self.broadcast(str(filepath)))
        target = link.with_name(self.broadcast(
            checkpoint_version(link, checkpoint["global_step"]) if self.global_rank == 0 else ""))
        super().save_checkpoint(checkpoint, target, storage_options)
        self.barrier("k3lab.save_checkpoint")  # every rank's shards are on disk
        if self.global_rank == 0:
            publish_checkpoint(link, target)
        self.barrier("k3lab.publish_checkpoint")


def n_processes(tc) -> int:
    """Processes per node for trainer config `tc`: trainer.devices, or every visible GPU for -1."""
    return tc.devices if tc.devices != -1 else max(torch.cuda.device_count(), 1)


def build_strategy(tc) -> str | ShardedStrategy:
    """trainer.strategy -> what L.Trainer takes: `fsdp` builds ShardedStrategy over every process of
    every node; any other name (auto, ddp, ...) is Lightning's."""
    if tc.strategy == "fsdp":
        return ShardedStrategy(data_parallel_size=n_processes(tc) * tc.num_nodes)
    return tc.strategy


# --- the processes of one run, in a multirun -------------------------------------------------------
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


@contextmanager
def one_job_argv(task_overrides: list[str], multirun: bool) -> Iterator[None]:
    """While a Hydra job runs, make sys.argv the job's own command (`run.py <its overrides>`).

    Lightning starts the other ranks of a DDP or FSDP run by re-running this script with sys.argv
    (lightning/fabric/strategies/launchers/subprocess_script.py, `_hydra_subprocess_cmd`: sys.argv[1:]
    plus hydra.run.dir). In a multirun sys.argv still holds `-m` and the whole sweep, so every worker
    would run the sweep again (hydra#2070, lightning-hydra-template#393) and print its own sweep table,
    joining rank 0's jobs only because both walk the same list. With the job's overrides each worker
    runs exactly its job's config, once, and exits."""
    argv = sys.argv
    if multirun:
        sys.argv = [argv[0], *task_overrides]
    try:
        yield
    finally:
        sys.argv = argv


class JobProcesses:
    """The processes and process group of one run, ended with it: `end()` once the trainer is done.

    It waits for the worker processes Lightning started for this run (they end with the run; one that
    has not ended 60 s later is stuck in a collective and is killed), takes them off the list Lightning's
    child-process observer watches (it would otherwise kill this process when a worker of a failed run
    exits non-zero, in the middle of the sweep's next job), leaves the process group, and puts back the
    launch variables Lightning set (LOCAL_RANK etc.: left in place, the next job's trainer would take
    them for an external launch and wait for workers nobody starts). Nothing to do on one device.
    """

    def __init__(self) -> None:
        self.trainer = None  # set once built
        self._env = {key: os.environ.get(key) for key in LAUNCH_ENV}

    def end(self) -> None:
        launcher = getattr(getattr(self.trainer, "strategy", None), "launcher", None)
        procs = getattr(launcher, "procs", None) or []
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        procs.clear()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
