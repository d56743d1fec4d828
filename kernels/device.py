"""Facts about the device the kernels run on, shared by the kernel launchers and the benchmarks."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter's grids stay small)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
