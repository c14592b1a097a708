"""Run Megatron-Core 0.16.1 without CUDA (gloo), for laptops and CI: patches for where it hard-codes CUDA.

`apply()` installs them once, and only when CUDA is absent: on a GPU nothing changes.
Each patch keeps Megatron's own code path (model, schedules, DistributedDataParallel, the
mixed-precision and distributed optimizers, recompute) and only moves what it pins to CUDA
onto the rank's device (`alignflow.job.device.device()`: the CPU, or the stand-in accelerator of
tests/test_device.py):

- RNG tracker (`tensor_parallel/random.py`): the model-parallel RNG states are CUDA generator
  states; on CPU they are states of the CPU generator (`CpuRNGStatesTracker`). Activation
  recompute also saves and restores "the CUDA RNG state" around each recomputed chunk
  (`_get_cuda_rng_state` / `_set_cuda_rng_state`, i.e. `torch.cuda.random.get_rng_state` /
  `set_rng_state`): there is no CUDA generator, so these keep an empty state; the CPU
  generator and the tracker, which do draw the dropout masks, are restored by recompute itself.
- `torch.cuda.current_device()`: Megatron allocates buffers with it everywhere (rotary
  `get_emb`, pipeline p2p receive buffers, TP gathers, DDP's gradient buffers); on a CPU-only
  torch it raises, so it answers the rank's device. Nothing else calls it where CUDA is absent.
- Tensors created on "cuda" by name: the causal and sliding-window masks
  (`transformer/utils.py`) run under `_CudaOnRankDevice`, which places them on the rank's
  device. Modules whose step code does it (the schedules' token counter, the optimizers' unit
  scale, the grad-norm and clipping buffers of `optimizer/clip_grads.py` and `utils.py`) see
  `_TorchOnRankDevice` as their `torch`: a TorchFunctionMode around a whole step would tax
  every op of the model.
- `Tensor.cuda()` returns the tensor itself (the tied embedding's copy on the last pipeline
  stage, optimizer state moves), and `Tensor.type()` without arguments answers the
  `torch.cuda.*` name of the type of a tensor on the rank's device, which is what the
  mixed-precision and distributed optimizers and the gradient clipping compare parameters and
  grads against.
  Both only on a CPU-only torch, where neither could answer otherwise.
- `torch.cuda.synchronize()`: a no-op, as there is no device queue to wait for (Megatron's
  checkpoint writer calls it before saving; the model is built with `batch_p2p_sync=False`).
- The MoE alltoall token dispatcher (`transformer/moe/token_dispatcher.py`) copies its token
  counts to the host on a side CUDA stream: it sees `torch.cuda` streams as `_HostStream`s,
  which have no queue to order (the counts are on the host already), and its copies of the
  counts (`maybe_move_tensor_to_cpu`) become numpy arrays where it asks, as a device tensor's
  do (all_to_all_single takes split sizes as a sequence of ints, not a tensor).

Not covered: fused kernels, CUDA streams (DDP's overlapped reduction uses async gloo work
instead), and Transformer Engine (absent on CPU anyway).
"""

import contextlib
import functools
import logging
import types

import torch
from megatron.core import utils as mcore_utils
from megatron.core.fusions import fused_softmax
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer import utils as transformer_utils
from megatron.core.transformer.moe import token_dispatcher
from torch.overrides import TorchFunctionMode

from alignflow.job.device import device

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
        self.states_[name] = torch.Generator(device="cpu").manual_seed(seed).get_state()

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


def _on_rank_device(where):
    return device() if where is not None and torch.device(where).type == "cuda" else where


class _CudaOnRankDevice(TorchFunctionMode):
    """Tensors a wrapped Megatron function creates with device="cuda" land on the rank's device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _on_rank_device(kwargs["device"])}
        return func(*args, **kwargs)


def _on_rank_device_fn(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaOnRankDevice():
            return fn(*args, **kwargs)

    return wrapper


# (owner, attribute) of each function that creates tensors on "cuda" by name, once per call.
CUDA_BY_NAME = (
    (transformer_utils, "get_default_causal_mask"),
    (transformer_utils, "get_sliding_window_causal_mask"),
    (fused_softmax, "get_default_causal_mask"),  # imported by name there
    (fused_softmax, "get_sliding_window_causal_mask"),
)


class _TorchOnRankDevice(types.ModuleType):
    """`torch` as the modules in `TORCH_BY_NAME` see it: factories asked for "cuda" build on the rank's device."""

    FACTORIES = ("tensor", "zeros", "ones", "empty", "full")

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        if name not in self.FACTORIES:
            return value

        @functools.wraps(value)
        def factory(*args, device=None, **kwargs):
            return value(*args, device=_on_rank_device(device), **kwargs)

        setattr(self, name, factory)
        return factory


# Modules whose `torch` is `_TorchOnRankDevice`: each creates tensors on "cuda" by name at every step.
TORCH_BY_NAME = (schedules, mcore_optimizer, clip_grads, mcore_utils)


class _HostStream:
    """A CUDA stream where there is no device: nothing is queued, so there is nothing to wait for."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self) -> "_HostStream":
        return self  # an event that has happened: `synchronize` returns at once

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


class _CudaHostStreams(types.ModuleType):
    """`torch.cuda` with host streams, as `_TorchWithHostStreams` gives it."""

    Stream = _HostStream

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_stream(device=None) -> _HostStream:
        return _HOST_STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class _TorchWithHostStreams(types.ModuleType):
    """`torch` as the MoE token dispatcher sees it: its `cuda` streams are `_HostStream`s."""

    cuda = _CudaHostStreams("torch.cuda")

    def __getattr__(self, name: str):
        return getattr(torch, name)


_CPU_TYPE = torch.Tensor.type


def _cuda_type_name(tensor: torch.Tensor, dtype=None, non_blocking: bool = False, **kwargs):
    """`Tensor.type()`: a tensor on the rank's device answers its `torch.cuda.*` name; with a
    dtype it converts as usual."""
    if dtype is not None or kwargs:
        return _CPU_TYPE(tensor, dtype, non_blocking, **kwargs)
    name = _CPU_TYPE(tensor)
    if tensor.device.type != device().type or tensor.is_sparse:
        return name
    return f"torch.cuda.{name.rsplit('.', 1)[-1]}"


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device="cpu")


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """`moe_utils.maybe_move_tensor_to_cpu` for a tensor already on the host: numpy where asked."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def apply() -> None:
    """Install the patches once; a no-op where CUDA is available."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # what initialize_rng_tracker instantiates
    mcore_random._get_cuda_rng_state = _no_cuda_rng_state
    mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None
    torch.cuda.current_device = device
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _cuda_type_name
    for module in TORCH_BY_NAME:
        module.torch = _TorchOnRankDevice("torch")
    for owner, name in CUDA_BY_NAME:
        setattr(owner, name, _on_rank_device_fn(getattr(owner, name)))
    token_dispatcher.torch = _TorchWithHostStreams("torch")
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    _applied = True
    log.debug("CUDA absent: Megatron-Core runs on CPU with alignflow.job.model.cpu_shim")
