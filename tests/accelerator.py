"""A stand-in accelerator for CPU tests: device `accel:0`, whose tensors are CPU tensors inside.

Tensors on `accel` (`OnAccel`, a wrapper subclass on torch's PrivateUse1 backend) report that
device, go through autograd as a GPU's do, and run every op on the CPU tensor they hold. An op
that mixes them with plain CPU tensors raises `DeviceMismatch` naming the op, as CUDA would
refuse it, with CUDA's exceptions: copies between devices, and 0-dim CPU tensors as operands of
elementwise ops. Stricter than CUDA in one place: CPU index tensors (CUDA copies them to the GPU
and waits, at every call) are a mismatch too. A draw for accel tensors from a CPU generator
fails, as on CUDA (the Python backend has no generators of its own, so draws from a device
generator cannot run here). Counts what reaches the host from accel (`host_reads`): each is a
GPU sync.

Factories that name the device (`torch.zeros(n, device=accel)`) reach the PrivateUse1 kernels
registered below; everything else reaches `OnAccel.__torch_dispatch__`.
"""

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

NAME = "accel"
_setup_privateuseone_for_python_backend(NAME)  # once per process
ACCEL = torch.device(NAME, 0)
aten = torch.ops.aten

# Ops that move data between devices on purpose (a copy's source may be anywhere).
TRANSFERS = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}
# Ops where CUDA takes a 0-dim CPU tensor as an operand (TensorIterator's CPU scalars), besides the pointwise ones.
CPU_SCALAR_OPS = {
    aten.where.self,
    aten.masked_fill.Tensor,
    aten.masked_fill_.Tensor,
    aten.clamp.Tensor,
    aten.clamp_min.Tensor,
    aten.clamp_max.Tensor,
    aten.lerp.Tensor,
    aten.lerp_.Tensor,
}
# What brings a value from accel to the host (a GPU sync).
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}

host_reads = 0  # since the process started; tests read differences


class DeviceMismatch(RuntimeError):
    pass


class OnAccel(torch.Tensor):
    """A tensor on `accel`: the CPU tensor `elem` under it."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=ACCEL,
            requires_grad=elem.requires_grad,
        )

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    def __repr__(self) -> str:
        return f"OnAccel({self.elem!r})"

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:  # torch swaps the metadata (Megatron's viewless tensors), this the CPU tensor
        torch.Tensor.data.__set__(self, value)
        self.elem = value.elem

    def tolist(self) -> list:  # torch refuses it on subclasses; a GPU tensor's copies to the host
        global host_reads
        host_reads += 1
        return self.elem.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _run(func, args: tuple, kwargs: dict):
    global host_reads
    on_accel = kwargs.get("device") is not None and torch.device(kwargs["device"]).type == NAME
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    wrapped = [t for t in tensors if isinstance(t, OnAccel)]
    if wrapped:
        _check(func, wrapped, [t for t in tensors if not isinstance(t, OnAccel)], kwargs.get("generator"))
    if func in HOST_READS or (func in TRANSFERS and wrapped and _lands_on_cpu(func, args, kwargs)):
        host_reads += 1
    elems = {id(t.elem): t for t in wrapped}
    unwrapped_args, unwrapped_kwargs = tree_map(_unwrap, (args, kwargs))
    if on_accel:
        unwrapped_kwargs["device"] = torch.device("cpu")
    out = func(*unwrapped_args, **unwrapped_kwargs)
    if not (wrapped or on_accel) or (func in TRANSFERS and _lands_on_cpu(func, args, kwargs)):
        return out
    return tree_map(lambda t: _rewrap(t, elems), out)


def _rewrap(value, elems: dict):
    """An op's CPU tensor result on accel: the accel tensor it was given (in-place and `out=`
    ops, whose shape follows a resize: torch.arange's), else a new one."""
    if not isinstance(value, torch.Tensor) or isinstance(value, OnAccel):
        return value
    given = elems.get(id(value))
    if given is None:
        return OnAccel(value)
    if given.shape != value.shape or given.stride() != value.stride():
        given.data = OnAccel(value)
    return given


def _check(func, wrapped: list, plain: list, generator) -> None:
    """CUDA's rule for an op with tensors on accel: every other tensor there too, but copies
    and 0-dim CPU operands of elementwise ops."""
    if func in TRANSFERS:
        return
    scalars_ok = torch.Tag.pointwise in func.tags or func in CPU_SCALAR_OPS
    stray = [t for t in plain if not (scalars_ok and t.dim() == 0 and t.device.type == "cpu")]
    if stray:
        shapes = ", ".join(f"{t.device} {list(t.shape)}" for t in stray)
        raise DeviceMismatch(f"device mismatch: {func} got tensors on {ACCEL} and on {shapes}")
    if generator is not None:
        raise DeviceMismatch(f"device mismatch: {func} draws for {ACCEL} tensors from a {generator.device} generator")


def _lands_on_cpu(func, args: tuple, kwargs: dict) -> bool:
    if func is aten._to_copy.default:
        target = kwargs.get("device")
        return target is not None and torch.device(target).type == "cpu"
    destination = args[1] if func in (aten._copy_from.default, aten._copy_from_and_resize.default) else args[0]
    return not isinstance(destination, OnAccel)


def _unwrap(value):
    if isinstance(value, OnAccel):
        return value.elem
    if isinstance(value, torch.device) and value.type == NAME:
        return torch.device("cpu")
    return value


# Factories that name the device: the rest (zeros, full, arange, tensor, ...) fill what these make.
_lib = torch.library.Library("aten", "IMPL")


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return OnAccel(torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return OnAccel(torch.empty_strided(size, stride, dtype=dtype, layout=layout))


def _copy_from(source, destination, non_blocking=False):
    global host_reads
    host_reads += isinstance(source, OnAccel) and not isinstance(destination, OnAccel)
    _unwrap(destination).copy_(_unwrap(source))
    return destination


def _local_scalar_dense(tensor):  # torch.tensor([accel scalars]) reads them below the Python key
    global host_reads
    host_reads += 1
    return _unwrap(tensor).item()


_lib.impl("empty.memory_format", _empty, "PrivateUse1")
_lib.impl("empty_strided", _empty_strided, "PrivateUse1")
_lib.impl("_copy_from", _copy_from, "PrivateUse1")
_lib.impl("_local_scalar_dense", _local_scalar_dense, "PrivateUse1")
