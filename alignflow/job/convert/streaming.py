"""Streaming conversion between HF safetensors and Megatron torch_dist checkpoints.

HF -> Megatron: every table entry becomes one checkpoint key (per-layer parameters stacked
on a leading layer axis, experts on the next, as Megatron-Core stores them) whose chunks are loaders of a bounded
number of bytes of rows (CHUNK_BYTES_RANGE): plain rows, rows of gate then of up for fc1, whole query groups for
qkv (from HF's q, k, v, or from row ranges of Phi-3's fused qkv_proj). `dist_io.save_lazy`
calls them a few at a time, so memory stays near a few chunks whatever the model size.
Megatron -> HF reads one layer's (one expert's) slice of a key at
a time and yields the HF tensors in the order of their precomputed specs, for
`safetensors_io.write_sharded`. A torch_dist source (Megatron-LM or NeMo 2, whose keys carry
a `module.` prefix) is re-keyed chunk by chunk.

The stored layout is the global one whatever the TP/PP that later loads it; only the vocab
padding depends on TP (Megatron loads embeddings with a padded-size mismatch allowed).
"""

from functools import partial
from typing import Callable, Iterator

import torch

from alignflow.job.model_files.dist_io import Chunk, DistCheckpointReader, Entry
from alignflow.job.model_files.safetensors_io import SafetensorsReader, TensorSpec
from alignflow.job.convert.layout import fuse, merge_qkv, unfuse
from alignflow.job.convert.families import ModelShape, Param, Slot, params_for, slots
from alignflow.job.convert.sharding import VOCAB_PARAMS, param_to_hf

LAYER_PLACEHOLDER = "decoder.layers.{layer}."
STACKED_PREFIX = "decoder.layers."
# SequentialMLP's `local_experts.{expert}.`; Megatron-Core 0.16.1's SequentialMLP and TEGroupedMLP
# both store an expert's tensors under `{their prefix}experts.`, so the key reads `mlp.experts.experts.`.
EXPERT_PLACEHOLDER, STACKED_EXPERTS = "local_experts.{expert}.", "experts."
NEMO_PREFIX = "module."
# Bytes of rows per stored chunk: 1/128 of the checkpoint, within these bounds. Writer memory
# is a few chunks per thread; small models stay far below their size, big ones get ~128+ files.
CHUNK_BYTES_RANGE = (16 << 20, 256 << 20)
CHUNKS_PER_CHECKPOINT = 128


def checkpoint_key(param: Param) -> str:
    """The key Megatron-Core stores a parameter under: per-layer (per-expert) ones share one stacked key."""
    return param.megatron.replace(LAYER_PLACEHOLDER, STACKED_PREFIX).replace(EXPERT_PLACEHOLDER, STACKED_EXPERTS)


def _axes(slot: Slot) -> tuple[int, ...]:
    """The leading stacked-axis indices of a slot: (), (layer,) or (layer, expert)."""
    return tuple(i for i in slot if i is not None)


def hf_to_dist_entries(reader: SafetensorsReader, shape: ModelShape, padded_vocab: int) -> list[Entry]:
    """Checkpoint entries whose chunks (see CHUNK_BYTES_RANGE) read HF rows on demand."""
    total = sum(reader.spec(name).nbytes for name in reader.keys())
    low, high = CHUNK_BYTES_RANGE
    chunk_bytes = min(max(total // CHUNKS_PER_CHECKPOINT, low), high)
    entries = []
    for param in params_for(shape):
        full = _fused_shape(param, reader, shape)
        chunks = []
        for slot in slots(param, shape):
            pieces = ROW_PLANS[param.fuse](reader, param.hf_names(*slot), shape, chunk_bytes)
            if param.megatron in VOCAB_PARAMS and padded_vocab > full[0]:
                pieces.append(
                    (full[0], padded_vocab - full[0], partial(_zero_rows, padded_vocab - full[0], full[1:], reader.spec(param.hf_names(0)[0]).dtype))
                )
            chunks += [_chunk(_axes(slot), row, rows, full[1:], load) for row, rows, load in pieces]
        global_shape = ((padded_vocab,) if param.megatron in VOCAB_PARAMS else full[:1]) + full[1:]
        stacked = (shape.num_layers,) * param.per_layer + (shape.num_experts,) * param.per_expert
        entries.append(Entry(checkpoint_key(param), stacked + global_shape, reader.spec(param.hf_names(0, 0)[0]).dtype, tuple(chunks)))
    return entries


# A row piece of a fused tensor: (first row in the fused tensor, number of rows, loader).
Piece = tuple[int, int, Callable[[], torch.Tensor]]


def _chunk(axes: tuple[int, ...], row: int, rows: int, rest: tuple[int, ...], load: Callable) -> Chunk:
    """A chunk of rows at stacked-axis indices `axes` (layer, expert): size 1 along each."""
    ones = (1,) * len(axes)
    return Chunk(axes + (row,) + (0,) * len(rest), ones + (rows,) + rest, lambda: load().reshape(ones + (rows,) + rest))


def _row_ranges(rows: int, row_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    step = max(1, chunk_bytes // max(row_bytes, 1))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _row_bytes(spec) -> int:
    return spec.nbytes // spec.shape[0]


def _plain_rows(reader: SafetensorsReader, names: tuple[str, ...], shape: ModelShape, chunk_bytes: int) -> list[Piece]:
    (name,) = names
    spec = reader.spec(name)
    return [(a, b - a, partial(reader.read, name, (a, b))) for a, b in _row_ranges(spec.shape[0], _row_bytes(spec), chunk_bytes)]


def _fc1_rows(reader: SafetensorsReader, names: tuple[str, ...], shape: ModelShape, chunk_bytes: int) -> list[Piece]:
    """[gate; up]: rows of gate, then rows of up after all of gate's."""
    pieces = []
    for base, name in zip((0, reader.spec(names[0]).shape[0]), names):
        pieces += [(base + row, rows, load) for row, rows, load in _plain_rows(reader, (name,), shape, chunk_bytes)]
    return pieces


def _qkv_rows(reader: SafetensorsReader, names: tuple[str, ...], shape: ModelShape, chunk_bytes: int) -> list[Piece]:
    """Whole query groups at a time: group g's rows are [q_g; k_g; v_g] (see layout.merge_qkv),
    read from HF's q, k, v (`names`) or from the three row ranges of a fused qkv_proj (one name)."""
    per_group = shape.num_attention_heads // shape.num_query_groups
    group_rows = (per_group + 2) * shape.head_dim
    spec = reader.spec(names[-1])
    row_bytes = _row_bytes(spec) if spec.shape else 0
    return [
        (g0 * group_rows, (g1 - g0) * group_rows, partial(_qkv_groups, reader, names, g0, g1, shape))
        for g0, g1 in _row_ranges(shape.num_query_groups, group_rows * row_bytes, chunk_bytes)
    ]


def _qkv_groups(reader: SafetensorsReader, names: tuple[str, ...], g0: int, g1: int, shape: ModelShape) -> torch.Tensor:
    """Query groups g0..g1 in Megatron's layout: their q rows, then k and v rows, of each source."""
    per_group, d = shape.num_attention_heads // shape.num_query_groups, shape.head_dim
    q, k, v = names if len(names) == 3 else names * 3
    k_start = shape.num_attention_heads * d if len(names) == 1 else 0  # where k's rows begin in the source
    v_start = k_start + shape.num_query_groups * d if len(names) == 1 else 0
    parts = (
        reader.read(q, (g0 * per_group * d, g1 * per_group * d)),
        reader.read(k, (k_start + g0 * d, k_start + g1 * d)),
        reader.read(v, (v_start + g0 * d, v_start + g1 * d)),
    )
    return merge_qkv(*parts, (g1 - g0) * per_group, g1 - g0, d)


ROW_PLANS = {None: _plain_rows, "fc1": _fc1_rows, "qkv": _qkv_rows, "hf_qkv": _qkv_rows}


def _zero_rows(rows: int, rest: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((rows, *rest), dtype=dtype, device="cpu")  # vocab padding: zero rows, as Megatron pads


def _fused_shape(param: Param, reader: SafetensorsReader, shape: ModelShape) -> tuple[int, ...]:
    parts = [torch.empty(reader.spec(name).shape, device="meta") for name in param.hf_names(0, 0)]
    return tuple(fuse(param.fuse, parts, shape).shape)


def dist_to_dist_entries(reader: DistCheckpointReader, shape: ModelShape) -> list[Entry]:
    """The model's keys of a Megatron / NeMo 2 torch_dist checkpoint, without the `module.` prefix."""
    prefix = NEMO_PREFIX if any(k.startswith(NEMO_PREFIX) for k in reader.keys()) else ""
    entries = []
    for param in params_for(shape):
        key = prefix + checkpoint_key(param)
        if key not in reader.keys():
            raise KeyError(f"the source checkpoint has no {key!r} (found e.g. {sorted(reader.keys())[:5]})")
        stored = reader.metadata.state_dict_metadata[key]
        chunks = tuple(Chunk(tuple(c.offsets), tuple(c.sizes), partial(reader.read_chunk, key, c.offsets)) for c in stored.chunks)
        entries.append(Entry(checkpoint_key(param), reader.shape(key), reader.dtype(key), chunks))
    return entries


def dist_to_hf(reader: DistCheckpointReader, shape: ModelShape, dtype: torch.dtype) -> tuple[list[TensorSpec], Iterator[torch.Tensor]]:
    """The HF tensor specs of the model and a generator producing them, one layer at a time."""
    placed = [(p, slot) for p in params_for(shape) for slot in slots(p, shape)]
    specs = [spec for param, slot in placed for spec in _hf_specs(reader, param, slot, shape, dtype)]

    def tensors() -> Iterator[torch.Tensor]:
        for param, slot in placed:
            full = reader.read(checkpoint_key(param), _axes(slot))
            for tensor in param_to_hf(param, slot, full, shape).values():
                yield tensor.to(dtype)

    return specs, tensors()


def _hf_specs(reader: DistCheckpointReader, param: Param, slot: Slot, shape: ModelShape, dtype: torch.dtype) -> list[TensorSpec]:
    full = reader.shape(checkpoint_key(param))[len(_axes(slot)) :]
    if param.megatron in VOCAB_PARAMS:
        full = (shape.vocab_size,) + full[1:]
    parts = unfuse(param.fuse, torch.empty(full, device="meta"), shape)
    return [TensorSpec(name, dtype, tuple(t.shape)) for name, t in zip(param.hf_names(*slot), parts)]
