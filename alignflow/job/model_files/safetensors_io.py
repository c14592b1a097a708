"""Streaming HF safetensors checkpoints on any fsspec URI, one tensor at a time.

Reading parses each file's header once and then reads a tensor's byte range into a fresh
tensor (`readinto`, no mmap), so resident memory stays near the largest tensor in flight
rather than the checkpoint, on local disks and on object stores (range requests) alike.
Writing computes every shard's header from the tensor specs up front, then appends the
bytes as tensors are produced, so an exporter never holds a whole shard.
"""

import json
import math
import struct
from dataclasses import dataclass
from typing import Iterator

import fsspec
import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype, device="cpu").element_size()


@dataclass(frozen=True)
class _Location:
    file: str
    start: int  # absolute byte offset in the file
    spec: TensorSpec


class SafetensorsReader:
    """The tensors of an HF checkpoint directory: `model.safetensors` or shards + index."""

    def __init__(self, uri: str, **storage_options):
        self.fs, self.root = fsspec.core.url_to_fs(uri, **storage_options)
        self.root = self.root.rstrip("/")
        self._where: dict[str, _Location] = {}
        for file in self._files():
            self._where.update(self._read_header(file))

    def _files(self) -> list[str]:
        index = f"{self.root}/{INDEX}"
        if self.fs.exists(index):
            weight_map = json.loads(self.fs.cat_file(index))["weight_map"]
            return sorted({f"{self.root}/{name}" for name in weight_map.values()})
        if self.fs.exists(f"{self.root}/{SINGLE}"):
            return [f"{self.root}/{SINGLE}"]
        raise FileNotFoundError(f"{self.root}: neither {INDEX} nor {SINGLE}")

    def _read_header(self, file: str) -> dict[str, _Location]:
        with self.fs.open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        base = 8 + size
        return {
            name: _Location(file, base + meta["data_offsets"][0], TensorSpec(name, _DTYPES[meta["dtype"]], tuple(meta["shape"])))
            for name, meta in header.items()
        }

    def keys(self) -> list[str]:
        return list(self._where)

    def spec(self, name: str) -> TensorSpec:
        return self._where[name].spec

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only its rows [start, stop) along dim 0 (a contiguous byte range)."""
        where = self._where[name]
        shape = where.spec.shape
        start, stop = rows or (0, shape[0] if shape else 1)
        out = torch.empty((stop - start, *shape[1:]) if shape else (), dtype=where.spec.dtype, device="cpu")
        row_bytes = out.element_size() * math.prod(shape[1:])
        want = out.numel() * out.element_size()
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if want else memoryview(b"")
        with self.fs.open(where.file, "rb") as f:
            f.seek(where.start + start * row_bytes)
            got = f.readinto(view) if want else 0
        if got != want:
            raise OSError(f"{where.file}: short read of {name} ({got} of {want} bytes)")
        return out


def write_sharded(uri: str, specs: list[TensorSpec], tensors: Iterator[torch.Tensor], max_shard_bytes: int, **storage_options) -> list[str]:
    """Write `tensors` (produced in `specs` order) as HF shards + index under `uri`."""
    fs, root = fsspec.core.url_to_fs(uri, **storage_options)
    root = root.rstrip("/")
    fs.makedirs(root, exist_ok=True)
    shards = _plan_shards(specs, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    produced = iter(tensors)
    for name, shard in zip(names, shards):
        with fs.open(f"{root}/{name}", "wb") as f:
            f.write(_header(shard))
            for spec in shard:
                tensor = next(produced)
                if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                    raise ValueError(f"{spec.name}: produced {tuple(tensor.shape)} {tensor.dtype}, expected {spec.shape} {spec.dtype}")
                f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs)},
            "weight_map": {spec.name: name for name, shard in zip(names, shards) for spec in shard},
        }
        fs.pipe(f"{root}/{INDEX}", json.dumps(index, indent=2).encode())
    return names


def _plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(shard: list[TensorSpec]) -> bytes:
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        meta[spec.name] = {"dtype": _NAMES[spec.dtype], "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    body = json.dumps(meta, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(body)) + body
