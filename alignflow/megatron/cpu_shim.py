"""Run Megatron-Core 0.16.1 on CPU (gloo), for laptops and CI: patches for where it hard-codes CUDA.

`apply()` installs them once, and only when CUDA is absent: on a GPU nothing changes.
Each patch keeps Megatron's own code path and only moves what it pins to CUDA onto the CPU:

- RNG tracker (`tensor_parallel/random.py`): the model-parallel RNG states are CUDA generator
  states; on CPU they are states of the CPU generator (`CpuRNGStatesTracker`).
- `torch.cuda.current_device()`: Megatron allocates buffers with it everywhere (rotary
  `get_emb`, pipeline p2p receive buffers, TP gathers); on a CPU-only torch it raises, so
  it answers the CPU device. Nothing else calls it where CUDA is absent.
- Tensors created on "cuda" by name: the default and sliding-window causal masks
  (`transformer/utils.py`) and the tied embedding's `.cuda()` when the output layer lives on
  another pipeline stage run under `_CudaOnCpu`, which places them on the CPU. The pipeline
  schedules' token counter (`torch.zeros(..., device="cuda")`) is the only CUDA use in
  `schedules.py`, which therefore sees `_TorchOnCpu` as its `torch`: a TorchFunctionMode
  around a whole schedule would tax every op of the model's forward and backward.

- `torch.cuda.synchronize()`: a no-op, as there is no device queue to wait for (Megatron's
  checkpoint writer calls it before saving; the model is built with `batch_p2p_sync=False`).

Not covered: activation recompute, Megatron's optimizer wrapper,
fused kernels, and Transformer Engine (absent on CPU anyway).
"""

import contextlib
import functools
import logging
import types

import torch
from megatron.core.fusions import fused_softmax
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer import utils as transformer_utils
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_applied = False


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Megatron's named RNG states ('model-parallel-rng', ...) as states of the CPU generator.

    `fork(name)` swaps the CPU generator to that state and back, so TP ranks draw different
    dropout masks in TP regions and identical ones elsewhere, as on GPU."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _CudaOnCpu(TorchFunctionMode):
    """Tensors a wrapped Megatron function creates with device="cuda" (or `.cuda()`) land on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _on_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaOnCpu():
            return fn(*args, **kwargs)

    return wrapper


# (owner, attribute) of each function that creates tensors on "cuda" by name.
CUDA_BY_NAME = (
    (transformer_utils, "get_default_causal_mask"),
    (transformer_utils, "get_sliding_window_causal_mask"),
    (fused_softmax, "get_default_causal_mask"),  # imported by name there
    (fused_softmax, "get_sliding_window_causal_mask"),
    (LanguageModule, "setup_embeddings_and_output_layer"),
)


class _TorchOnCpu(types.ModuleType):
    """`torch` as `pipeline_parallel/schedules.py` sees it: zeros asked for on "cuda" land on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        on_cuda = device is not None and torch.device(device).type == "cuda"
        return torch.zeros(*args, device="cpu" if on_cuda else device, **kwargs)


def apply() -> None:
    """Install the patches once; a no-op where CUDA is available."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # what initialize_rng_tracker instantiates
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    schedules.torch = _TorchOnCpu("torch")
    for owner, name in CUDA_BY_NAME:
        setattr(owner, name, _on_cpu(getattr(owner, name)))
    _applied = True
    log.info("CUDA absent: Megatron-Core runs on CPU with alignflow.megatron.cpu_shim")
