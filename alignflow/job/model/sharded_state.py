"""Megatron models, and their optimizers' states, to and from `torch_dist` checkpoints, at any layout.

A torch_dist checkpoint stores global tensors, so the layout that loads it need not be the
one that saved it: Megatron-Core's `dist_checkpointing` reshards on read. Model chunks
(virtual pipeline stages) sit under `model0`, `model1`, ... as in Megatron-LM. An optimizer's
state (fp32 main weights, Adam moments, step) is mapped onto the weights' global tensors by
Megatron's `sharded_state_dict`, the distributed optimizer's in its `fully_reshardable`
format, so it reshards over TP, PP and DP alike.

Loading never runs code from the checkpoint (`alignflow.job.model_files.untrusted`).

Simplified: Transformer Engine's `_extra_state` objects (FP8 scaling state) are neither
saved nor loaded; a converted checkpoint has none and bf16/fp32 training needs none.
"""

import contextlib
import os
import pickle
import queue
from typing import Sequence

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer

from alignflow.job.model_files.untrusted import refuse_code, weights_only_refusal
from alignflow.job.model import cpu_shim
from alignflow.job.model.lora import is_adapter_key

EXTRA_STATE = "_extra_state"
# The distributed optimizer's state in the format that reshards over TP, PP and DP; to save,
# Megatron gathers it through DP rank 0's CPU memory (gloo), not all ranks' GPU memory.
OPTIMIZER_FORMAT = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}


# Which tensors a checkpoint holds: all, the base weights, or LoRA adapters only
# (`alignflow.job.model.lora`: a LoRA run's checkpoints, whose base is its frozen input model);
# the trunk: all but a reward model's scalar head (`ScoreModel`), what a causal LM gives one.
SELECT = {
    "all": lambda key: True,
    "base": lambda key: not is_adapter_key(key),
    "adapters": is_adapter_key,
    "trunk": lambda key: not key.startswith("rm_head."),
}


def sharded_state_dict(chunks: Sequence[GPTModel], select: str = "all") -> dict:
    """The chunks' weights as Megatron ShardedTensors (what dist_checkpointing saves and loads;
    Megatron's optimizers map their states onto it), those `select` names."""
    sharded, keep = {}, SELECT[select]
    for i, chunk in enumerate(chunks):
        state = chunk.sharded_state_dict()
        sharded[_chunk_key(i, len(chunks))] = {
            k: v for k, v in state.items() if keep(k) and not (isinstance(v, ShardedObject) and k.endswith(EXTRA_STATE))
        }
    return sharded


def _chunk_key(i: int, n: int) -> str:
    return f"model{i}" if n > 1 else "model"


def save(chunks: Sequence[GPTModel], uri: str, select: str = "all") -> None:
    """Write the model's weights (those `select` names) as a torch_dist checkpoint (every rank calls this)."""
    cpu_shim.apply()
    os.makedirs(uri, exist_ok=True)  # Megatron's writer wants the directory to exist
    _results_in_process()
    dist_checkpointing.save(sharded_state_dict(chunks, select), uri)


def _results_in_process() -> None:
    """Megatron's torch_dist writer passes its write results through a queue served by a
    manager process it *spawns* (for async saves, whose writer runs in another process): that
    process re-imports the job's main module, torch and Megatron, some 5 s of a core per rank,
    once per job. Our saves are synchronous: the queue's writer and reader are this process,
    so an in-process queue carries the same results without the spawn."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load(chunks: Sequence[GPTModel], uri: str, select: str = "all") -> None:
    """Load weights saved at any TP/PP layout into this rank's chunks; every parameter `select`
    names must be found."""
    cpu_shim.apply()
    loaded = _read(sharded_state_dict(chunks, select), uri)
    keep = SELECT[select]
    for i, chunk in enumerate(chunks):
        result = chunk.load_state_dict(loaded[_chunk_key(i, len(chunks))], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE) and keep(k)]
        if missing or result.unexpected_keys:
            raise KeyError(f"{uri}: missing {missing}, unexpected {result.unexpected_keys}")


def save_optimizer(optimizer: MegatronOptimizer, chunks: Sequence[GPTModel], uri: str, select: str = "all") -> None:
    """Write the state of Megatron's optimizer over `chunks` as a torch_dist checkpoint (every
    rank); `select` names the weights it trains."""
    os.makedirs(uri, exist_ok=True)
    _results_in_process()
    dist_checkpointing.save(optimizer.sharded_state_dict(sharded_state_dict(chunks, select), metadata=OPTIMIZER_FORMAT), uri)


def load_optimizer(optimizer: MegatronOptimizer, chunks: Sequence[GPTModel], uri: str, select: str = "all") -> None:
    """Load an optimizer state saved at any layout. Call it before loading the weights: with
    torch's Adam it may step the optimizer once (see `_torch_adam_states`)."""
    with _torch_adam_states(optimizer):
        sharded = optimizer.sharded_state_dict(sharded_state_dict(chunks, select), is_loading=True, metadata=OPTIMIZER_FORMAT)
        optimizer.load_state_dict(_read(sharded, uri))


def _read(sharded: dict, uri: str) -> dict:
    """`dist_checkpointing.load`, running no code from the checkpoint."""
    refuse_code()
    try:
        return dist_checkpointing.load(sharded, uri)
    except pickle.UnpicklingError as err:  # torch's refusal of common.pt (DCP wraps the errors of its own files)
        raise weights_only_refusal(f"{uri}/common.pt", err) from err


@contextlib.contextmanager
def _torch_adam_states(optimizer: MegatronOptimizer):
    """Loading the distributed optimizer's state with torch's Adam (Megatron's fallback without
    Transformer Engine or Apex, so always on CPU). Megatron's load is written for their fused
    Adam, which keeps the step per param group; torch's keeps it in each parameter's state:
    - the load describes what to read by the existing states, which torch's Adam creates at its
      first step: Megatron's own step on zero gradients creates them (it may move the weights
      by weight decay; the checkpoint overwrites states and weights);
    - it copies each state from the checkpoint, which has no per-parameter step (KeyError
      'step'): a state the checkpoint lacks keeps its value, the step just set from the groups;
    - it gives all parameters one step tensor, which torch's Adam would then advance once per
      parameter and step: each gets its own copy."""
    distributed = [inner for inner in optimizer.chained_optimizers if isinstance(inner, DistributedOptimizer)]
    for inner in distributed:
        if not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def keeping_step(self, model_param, tensors):
        set_states(self, model_param, {**self._get_main_param_and_optimizer_states(model_param), **tensors})

    DistributedOptimizer._set_main_param_and_optimizer_states = keeping_step
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    for inner in distributed:
        for state in inner.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()
