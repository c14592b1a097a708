"""Runs inside the vLLM server's own environment, never alignflow's (`vllm_server.py` names it as
the server's `--worker-extension-cls`): a weight-transfer engine over files.

vLLM's transfer engines (nccl, ipc, ...) all need CUDA. This one keeps vLLM's protocol (pause,
`/start_weight_update`, `/update_weights` per bucket, `/finish_weight_update` with a version,
resume) and carries each bucket as a safetensors file the trainer wrote in shared memory
(/dev/shm on one node): the worker reads it, loads the tensors by their HF names through the
model's own `load_weights` inside vLLM's layerwise reload (as its nccl and ipc engines do), and
deletes the file, so host memory holds at most one bucket twice. Importing this module registers
the engine as `alignflow_files` before the worker creates its engine.
"""

import os
from dataclasses import dataclass

from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "alignflow_files"


@dataclass
class FilesInit(WeightTransferInitInfo):
    folder: str  # where the trainer writes its buckets: a bucket outside it is refused


@dataclass
class FilesUpdate(WeightTransferUpdateInfo):
    file: str
    names: list[str]


class FilesEngine(WeightTransferEngine[FilesInit, FilesUpdate]):
    init_info_cls = FilesInit
    update_info_cls = FilesUpdate
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: FilesInit) -> None:
        self.folder = os.path.realpath(init_info.folder)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU copies are done on return: no device sync

    def receive_weights(self, update_info: FilesUpdate) -> None:
        path = os.path.realpath(update_info.file)
        if os.path.dirname(path) != self.folder:
            raise ValueError(f"bucket {update_info.file} is outside the transfer folder {self.folder}")
        tensors = load_file(path)
        os.unlink(path)
        if sorted(tensors) != sorted(update_info.names):
            raise ValueError(f"bucket {path} holds {sorted(tensors)[:4]}..., the update names {sorted(update_info.names)[:4]}...")
        self.model.load_weights([(name, tensors[name].to(self.device)) for name in update_info.names])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


class Extension:
    """The server's `--worker-extension-cls`: naming it makes each worker import this module,
    which registers the transport before the worker creates its engine. It adds no method."""


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, FilesEngine)
