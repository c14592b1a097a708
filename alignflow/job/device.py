"""Where this rank's tensors live: the one place that decides it.

`device()` is this rank's GPU where CUDA is (`init_process_group` binds it: LOCAL_RANK among
the GPUs the rank sees, so one GPU per rank and all of a node's GPUs per rank both work), else
the CPU. Every tensor the worker side creates is made there (`device=device()`, or `to_device`
for a collated micro batch), or says `device="cpu"` where it is host data on purpose: data
staging, numbers for the orchestrator. Megatron's own CUDA-by-name creations reach it through
`alignflow.job.model.cpu_shim` where CUDA is absent.

`use(device)` puts the rank on another device: tests/test_device.py runs every stage's step on
a stand-in accelerator backed by the CPU, where a tensor made anywhere else (a stray
`torch.zeros(n)` on the CPU) fails as it would on a GPU.
"""

import os

import torch
import torch.distributed as dist

_chosen: torch.device | None = None  # set by `use`


def device() -> torch.device:
    """This rank's device."""
    if _chosen is not None:
        return _chosen
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def use(chosen: torch.device | None) -> None:
    """Put this rank's tensors on `chosen` (None: back to its GPU or the CPU)."""
    global _chosen
    _chosen = chosen


def to_device(batch: dict) -> dict:
    """A collated micro batch's tensors on this rank's device (other values as they are)."""
    where = device()
    return {k: v.to(where, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def init_process_group() -> None:
    """The default process group from torch.distributed's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK): nccl on this rank's GPU, gloo on the CPU; a single
    rank uses an in-process store, so it never binds a port another process may hold."""
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    backend = "nccl" if on_gpu else "gloo"
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group(backend=backend)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
