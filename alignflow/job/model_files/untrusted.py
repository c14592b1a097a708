"""The trust boundary for checkpoints: reading one (a model source, a store output, a training
checkpoint) never runs code from it.

A torch_dist checkpoint meets pickle twice, and `refuse_code()` makes both safe for this process:
- its `.metadata` is a plain pickle that torch and Megatron read with `pickle.load`
  (`FileSystemReader.read_metadata`, which `FsspecReader` and Megatron's cached reader
  inherit): it is read with `MetadataUnpickler` instead, which builds DCP's metadata classes
  (`METADATA_GLOBALS`) and refuses any other global, naming the file; and the data files it
  points at must lie in the checkpoint's own folder;
- `torch.load` (Megatron's `common.pt` and sharded objects; DCP's byte items, which torch loads
  with `weights_only=False`): TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 makes every call in the process
  use torch's weights-only unpickler (tensors and plain containers), whatever the call says;
  `load_plain` is our own such read, whose refusal names the file.

HF sources are read as safetensors only (no pickle); pickled `pytorch_model.bin` weights are
refused at compose (`alignflow.orchestrator.config.validate`).
"""

import os
import pickle
from pathlib import PurePosixPath

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP = "torch.distributed.checkpoint"
# Every global a DCP `.metadata` may name (torch's writer, and Megatron's, which adds its cached
# save plans as `all_local_plans`), besides torch's dtypes.
METADATA_GLOBALS = {
    f"{_DCP}.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    f"{_DCP}.filesystem": {"_StorageInfo"},
    f"{_DCP}.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # torch.strided, by name
}
REFUSED = "refused: a checkpoint may only hold tensors and plain data (see README: trust boundary)"


class MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that imports only `METADATA_GLOBALS` and torch's dtypes."""

    def __init__(self, file, name: str):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if name in METADATA_GLOBALS.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{self.name} wants to import {module}.{name}; {REFUSED}")


def _read_metadata(self: FileSystemReader, *args, **kwargs) -> Metadata:
    """torch's `FileSystemReader.read_metadata` with `MetadataUnpickler` for `pickle.load`."""
    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = MetadataUnpickler(stream, str(path)).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        relative = PurePosixPath(info.relative_path)
        if relative.is_absolute() or ".." in relative.parts:
            raise pickle.UnpicklingError(f"{path} points at {info.relative_path}, outside its checkpoint; {REFUSED}")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def load_plain(path: str):
    """`torch.load(path, weights_only=True)`: tensors and plain data; a refusal names the file."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        raise weights_only_refusal(path, err) from err


def weights_only_refusal(path: str, err: pickle.UnpicklingError) -> pickle.UnpicklingError:
    """torch's weights-only refusal of the torch.save file `path`, said in one line: the file and
    the globals it wants (found by torch's static scan, which runs nothing)."""
    try:
        wanted = ", ".join(sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path)))
    except ValueError:  # not a torch.save zip file: torch's own words
        wanted = ""
    return pickle.UnpicklingError(f"{path} wants to import {wanted}; {REFUSED}" if wanted else f"{path}: {err}")


def refuse_code() -> None:
    """Make every checkpoint read of this process code-free (see the top); call it before one."""
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "").lower() in ("1", "y", "yes", "true"):  # torch's reading of it
        raise RuntimeError(
            f"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD={os.environ['TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD']} would let checkpoints "
            "run code when loaded: unset it (see README: trust boundary)"
        )
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    FileSystemReader.read_metadata = _read_metadata
