"""Bring a rank into Megatron-Core: process group, model-parallel groups, seeds, matmul
precision; and tear it down.

`init_parallel` reads the torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK) exported by `alignflow.job.worker` or torchrun
(`alignflow.job.device.init_process_group`, which also binds the rank's GPU); the default process
group is reused if the job entry point already created it: gloo on CPU (with `cpu_shim`
applied), nccl on GPU.

Simplified: `use_distributed_optimizer` is not read here (it concerns the optimizer), and the
data-parallel random init of Megatron-LM is not offered: all data-parallel replicas start equal.
"""

import random
from dataclasses import asdict, is_dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from alignflow.job.device import init_process_group
from alignflow.job.model import cpu_shim


def parallel_sizes(parallel_cfg: Any) -> dict[str, Any]:
    """A parallel config (mapping, DictConfig or dataclass) as a plain dict."""
    return asdict(parallel_cfg) if is_dataclass(parallel_cfg) else dict(parallel_cfg)


def init_parallel(parallel_cfg: Any, *, seed: int = 1234) -> None:
    """Process group, then Megatron's TP/PP/VP/CP/EP groups, then every RNG this rank uses."""
    cfg = parallel_sizes(parallel_cfg)
    cpu_shim.apply()
    fast_fp32_matmuls()
    if not dist.is_initialized():
        init_process_group()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg["tensor_model_parallel_size"],
        pipeline_model_parallel_size=cfg["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=cfg["virtual_pipeline_model_parallel_size"],
        context_parallel_size=cfg["context_parallel_size"],
        expert_model_parallel_size=cfg["expert_model_parallel_size"],
    )
    seed_all(seed)


def fast_fp32_matmuls() -> None:
    """TF32 for fp32 matmuls on CUDA: tensor cores at several times the fp32 rate, products
    rounded to a 10-bit mantissa and summed in fp32. Not on the CPU, where the same switch
    would let oneDNN round fp32 matmuls too (the CPU tests hold fp32 logits to HF's within 1e-5)."""
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")


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
    """Destroy Megatron's groups and the default process group."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
