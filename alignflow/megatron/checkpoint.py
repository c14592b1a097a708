"""Megatron models to and from `torch_dist` checkpoints, at any TP/PP layout.

A torch_dist checkpoint stores global tensors, so the layout that loads it need not be the
one that saved it: Megatron-Core's `dist_checkpointing` reshards on read. Model chunks
(virtual pipeline stages) sit under `model0`, `model1`, ... as in Megatron-LM.

Simplified: Transformer Engine's `_extra_state` objects (FP8 scaling state) are neither
saved nor loaded; a converted checkpoint has none and bf16/fp32 training needs none.
"""

import os
from typing import Sequence

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.models.gpt import GPTModel

from alignflow.megatron import cpu_shim

EXTRA_STATE = "_extra_state"


def sharded_state_dict(chunks: Sequence[GPTModel]) -> dict:
    """The chunks' weights as Megatron ShardedTensors (what dist_checkpointing saves and loads;
    Megatron's optimizers map their states onto it)."""
    sharded = {}
    for i, chunk in enumerate(chunks):
        state = chunk.sharded_state_dict()
        sharded[_chunk_key(i, len(chunks))] = {
            k: v for k, v in state.items() if not (isinstance(v, ShardedObject) and k.endswith(EXTRA_STATE))
        }
    return sharded


def _chunk_key(i: int, n: int) -> str:
    return f"model{i}" if n > 1 else "model"


def save(chunks: Sequence[GPTModel], uri: str) -> None:
    """Write the model's weights as a torch_dist checkpoint (every rank calls this)."""
    cpu_shim.apply()
    os.makedirs(uri, exist_ok=True)  # Megatron's writer wants the directory to exist
    dist_checkpointing.save(sharded_state_dict(chunks), uri)


def load(chunks: Sequence[GPTModel], uri: str) -> None:
    """Load weights saved at any TP/PP layout into this rank's chunks; every parameter must be found."""
    cpu_shim.apply()
    loaded = dist_checkpointing.load(sharded_state_dict(chunks), uri)
    for i, chunk in enumerate(chunks):
        result = chunk.load_state_dict(loaded[_chunk_key(i, len(chunks))], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE)]
        if missing or result.unexpected_keys:
            raise KeyError(f"{uri}: missing {missing}, unexpected {result.unexpected_keys}")
