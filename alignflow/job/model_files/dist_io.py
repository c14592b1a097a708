"""Megatron `torch_dist` checkpoints written and read one chunk at a time.

A `torch_dist` checkpoint is a PyTorch DCP checkpoint (`.metadata` + `*.distcp`) plus
Megatron's `metadata.json` and `common.pt`. Each key holds one *global* tensor whatever
the TP/PP layout that wrote it: per-layer parameters are stacked on a leading layer axis
(`decoder.layers.<param>` of shape `[num_layers, ...]`), fused `linear_qkv` rows are grouped
per query group and `linear_fc1` is `[gate; up]`, so any TP/PP layout can load it
(`megatron.core.dist_checkpointing.load` reshards on read).

`save_lazy` writes such a checkpoint from chunk *loaders*: DCP's writer threads each ask for
one chunk at a time and each chunk goes to its own file, so peak memory stays near
WRITE_THREADS chunks, not the model. `DistCheckpointReader` reads any region of a key by
loading only the stored chunks that overlap it; it reads the pickled `.metadata` with
`alignflow.job.model_files.untrusted`'s restricted unpickler and never reads `common.pt`.
"""

import io
import json
from dataclasses import dataclass
from typing import Callable

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from alignflow.job.model_files.untrusted import refuse_code

WRITE_THREADS = 2  # one thread leaves the disk idle while a chunk is read and fused; two keep it busy
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    load: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Entry:
    """One checkpoint key: its global shape and dtype and the chunks that tile it."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


class _LazySavePlanner(DefaultSavePlanner):
    """A save plan built from `Entry`s; tensors are materialised only when DCP writes them."""

    def __init__(self, entries: list[Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries
        self.loaders = {(e.key, c.offsets): (c, e) for e in entries for c in e.chunks}

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(e.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=e.dtype),
                    size=torch.Size(e.global_shape),
                ),
            )
            for e in self.entries
            for c in e.chunks
        ]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        chunk, entry = self.loaders[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = chunk.load()
        if tuple(tensor.shape) != chunk.sizes or tensor.dtype != entry.dtype:
            raise ValueError(f"{entry.key}@{chunk.offsets}: loaded {tuple(tensor.shape)} {tensor.dtype}, expected {chunk.sizes} {entry.dtype}")
        return tensor.contiguous()


def save_lazy(uri: str, entries: list[Entry], common: dict | None = None) -> None:
    """Write a Megatron torch_dist checkpoint at `uri` (any fsspec URI) from chunk loaders."""
    fs, root = fsspec.core.url_to_fs(uri)
    fs.makedirs(root, exist_ok=True)
    writer = FsspecWriter(uri, single_file_per_rank=False, thread_count=WRITE_THREADS, sync_files=False)
    dcp.save({}, storage_writer=writer, planner=_LazySavePlanner(entries), no_dist=True)
    buffer = io.BytesIO()
    torch.save(common or {}, buffer)
    fs.pipe(f"{root.rstrip('/')}/common.pt", buffer.getvalue())
    fs.pipe(f"{root.rstrip('/')}/metadata.json", json.dumps(MEGATRON_METADATA).encode())


class DistCheckpointReader:
    """Regions of the global tensors of a torch_dist checkpoint, read chunk by chunk."""

    def __init__(self, uri: str):
        self.fs, root = fsspec.core.url_to_fs(uri)
        self.root = root.rstrip("/")
        backend = json.loads(self.fs.cat_file(f"{self.root}/metadata.json")).get("sharded_backend")
        if backend != "torch_dist":
            raise ValueError(f"{uri}: sharded_backend {backend!r} is not supported (torch_dist only)")
        refuse_code()
        self.metadata = FsspecReader(uri).read_metadata()

    def keys(self) -> list[str]:
        return list(self.metadata.state_dict_metadata)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.metadata.state_dict_metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[key].properties.dtype

    def read(self, key: str, index: int | tuple[int, ...] | None = None) -> torch.Tensor:
        """The whole global tensor of `key`, or its slice at `index` along the first axis (axes:
        a tuple indexes the leading ones, e.g. a layer and an expert)."""
        shape = self.shape(key)
        index = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        lo = list(index) + [0] * (len(shape) - len(index))
        hi = [i + 1 for i in index] + list(shape[len(index) :])
        out = torch.empty([h - low for low, h in zip(lo, hi)], dtype=self.dtype(key), device="cpu")
        for chunk in self.metadata.state_dict_metadata[key].chunks:
            c_lo = list(chunk.offsets)
            c_hi = [o + s for o, s in zip(chunk.offsets, chunk.sizes)]
            if any(ch <= low or cl >= h for cl, ch, low, h in zip(c_lo, c_hi, lo, hi)):
                continue
            data = self.read_chunk(key, chunk.offsets)
            src, dst = data, out
            for dim, (cl, ch, low, h) in enumerate(zip(c_lo, c_hi, lo, hi)):
                start, stop = max(cl, low), min(ch, h)
                src = src.narrow(dim, start - cl, stop - start)
                dst = dst.narrow(dim, start - low, stop - start)
            dst.copy_(src)
        return out.reshape(out.shape[len(index) :])

    def read_chunk(self, key: str, offsets) -> torch.Tensor:
        """One stored chunk of `key`, as written."""
        info = self.metadata.storage_data[MetadataIndex(key, offsets)]
        with self.fs.open(f"{self.root}/{info.relative_path}", "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        return torch.load(io.BytesIO(blob), weights_only=True)
