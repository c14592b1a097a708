"""Bring a rank into Megatron-Core: process group, model-parallel groups, seeds; and tear it down.

`init_parallel` assumes the torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK) is exported, as `alignflow.worker` or torchrun do; with none it runs
as a single rank on a free local port. The default process group is reused if the job entry
point already created it: gloo on CPU (with `cpu_shim` applied), nccl on GPU.

Simplified: `use_distributed_optimizer` is not read here (it concerns the optimizer), and the
data-parallel random init of Megatron-LM is not offered: all data-parallel replicas start equal.
"""

import os
import random
import socket
from dataclasses import asdict, is_dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from alignflow.megatron import cpu_shim

_exported_here: list[str] = []


def parallel_sizes(parallel_cfg: Any) -> dict[str, Any]:
    """A parallel config (mapping, DictConfig or dataclass) as a plain dict."""
    return asdict(parallel_cfg) if is_dataclass(parallel_cfg) else dict(parallel_cfg)


def init_parallel(parallel_cfg: Any, *, seed: int = 1234) -> None:
    """Process group, then Megatron's TP/PP/VP/CP groups, then every RNG this rank uses."""
    cfg = parallel_sizes(parallel_cfg)
    cpu_shim.apply()
    if not dist.is_initialized():
        _export_single_rank_env()
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg["tensor_model_parallel_size"],
        pipeline_model_parallel_size=cfg["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=cfg["virtual_pipeline_model_parallel_size"],
        context_parallel_size=cfg["context_parallel_size"],
    )
    seed_all(seed)


def seed_all(seed: int) -> None:
    """Python, numpy, torch and Megatron's model-parallel RNG tracker.

    As in Megatron-LM, pipeline stages are offset (seed + 100 * pp_rank) so their layers
    initialise differently, while TP ranks share the default seed (with CPU init they build
    identical full weights) and get distinct 'model-parallel-rng' states for TP regions."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed, force_reset_rng=True)


def teardown() -> None:
    """Destroy Megatron's groups and the default process group; forget env set for a single rank."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    while _exported_here:
        os.environ.pop(_exported_here.pop(), None)


def _export_single_rank_env() -> None:
    """With no torch.distributed environment, run as rank 0 of 1 on a free local port."""
    if "WORLD_SIZE" in os.environ:
        return
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for key, value in env.items():
        if key not in os.environ:
            os.environ[key] = value
            _exported_here.append(key)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
