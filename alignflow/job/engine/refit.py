"""The live Megatron policy's weights in HF names, for an engine refit, at any TP/PP/EP layout.

Every rank lists the main replicas of its weights' shards (Megatron's `sharded_state_dict`:
the same global tensors a torch_dist checkpoint stores, so TP slices, PP stages and EP experts
are all described by key and offset, and SwiGLU's interleaved fc1 shards by their factories).
Then, one Megatron tensor (one layer's, one expert's) at a time, global rank 0 receives the
shards it lacks from their holders and cuts the full tensor into HF tensors with the export
mapping (`alignflow.job.convert.sharding.param_to_hf`): rank 0 holds one full tensor at a time
(plus the engine's bucket), never a second copy of the model.
"""

from collections.abc import Iterator
from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

from alignflow.job.convert.families import ModelShape, params_for, slots
from alignflow.job.convert.sharding import param_to_hf
from alignflow.job.convert.streaming import checkpoint_key
from alignflow.job.device import device
from alignflow.job.model.lora import is_adapter_key

Shard = tuple[int, tuple[int, ...], tuple[int, ...]]  # (holder rank, global offset, local shape)


def local_shards(chunks: Sequence[torch.nn.Module]) -> dict[tuple[str, tuple[int, ...]], ShardedTensor]:
    """This rank's main-replica shards of the model's weights by (key, global offset)."""
    found = {}
    for chunk in chunks:
        state = {k: v for k, v in chunk.sharded_state_dict().items() if not is_adapter_key(k) and not k.endswith("_extra_state")}
        apply_factories(state)
        for tensor in nested_values(state):
            if isinstance(tensor, ShardedTensor) and is_main_replica(tensor.replica_id):
                found[(tensor.key, tuple(tensor.global_offset))] = tensor
    return found


def hf_weights(chunks: Sequence[torch.nn.Module], shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) on global rank 0, in the export's order; every rank must run it to
    the end (the others yield nothing, sending their shards as rank 0 reaches them)."""
    mine = local_shards(chunks)
    rank = dist.get_rank()
    listed: list = [None] * dist.get_world_size()
    ours = [(key, offset, tuple(t.local_shape), tuple(t.global_shape), t.prepend_axis_num, t.dtype) for (key, offset), t in mine.items()]
    dist.all_gather_object(listed, ours)
    holders: dict[str, list[tuple]] = {}  # key -> [(holder, offset, local shape, global shape, prepended axes, dtype)]
    for holder, entries in enumerate(listed):
        for key, *rest in entries:
            holders.setdefault(key, []).append((holder, *rest))
    for param in params_for(shape):
        key = checkpoint_key(param)
        if key not in holders:
            raise KeyError(f"refit: the policy has no weight {key!r} (it has e.g. {sorted(holders)[:5]})")
        for slot in slots(param, shape):
            axes = tuple(i for i in slot if i is not None)
            pieces = sorted((h for h in holders[key] if h[1][: h[4]] == axes), key=lambda h: (h[0], h[1]))
            full = _gather(key, pieces, mine, rank)
            if rank == 0:
                yield from param_to_hf(param, slot, full, shape).items()


def _gather(key: str, pieces: list, mine: dict, rank: int) -> torch.Tensor | None:
    """One full tensor on rank 0 from its shards, received in holder order."""
    if not pieces:
        raise KeyError(f"refit: no rank holds a main replica of {key!r} at this layer / expert")
    _, _, _, global_shape, prepended, dtype = pieces[0]
    full = torch.empty(global_shape[prepended:], dtype=dtype, device="cpu") if rank == 0 else None
    for holder, offset, local, *_ in pieces:
        if holder != rank and rank != 0:
            continue
        where = tuple(slice(o, o + n) for o, n in zip(offset[prepended:], local))
        if holder == rank:
            data = mine[(key, offset)].data.detach()
            if rank == 0:
                full[where] = data.to("cpu")
            else:
                dist.send(data.contiguous().to(device()), dst=0)
        else:
            buffer = torch.empty(local, dtype=dtype, device=device())
            dist.recv(buffer, src=holder)
            full[where] = buffer.to("cpu")
    return full
