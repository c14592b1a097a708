"""LoRA adapters on Megatron-Core's tensor-parallel linear layers, correct at any TP and PP.

Each adapted HF projection (`alignflow.job.convert.lora`: q, k, v of `linear_qkv`, gate and up of
`linear_fc1`, `linear_proj`, `linear_fc2`) gets its own A [r, in], B [out, r] and dropout mask,
and the layer adds (alpha / r) B A dropout(x) to its output, as HF PEFT does; the parts' outputs are fused
in the module's layout (per query group for qkv, [gate; up] for fc1), so the adapter is a
PEFT adapter exactly, matrix for matrix. Under TP:
- column-parallel (`linear_qkv`, `linear_fc1`: output dim sharded): A is replicated, B sharded
  on its output dim like the weight (each part on its own, so a rank's rows are its query
  groups / its slices of gate and up). The input is replicated, so A x is computed whole on
  every rank; Megatron's `copy_to_tensor_model_parallel_region` on it all-reduces its
  gradient, which each rank only has from its own rows of B.
- row-parallel (`linear_proj`, `linear_fc2`: input dim sharded): A is sharded on its input dim,
  B replicated. Each rank has a partial A x from its input shard; it is all-reduced over TP
  (`reduce_from_tensor_model_parallel_region`, r values per token: r / hidden of the layer's own
  reduction) before B. Adding B A x to the layer's partial output before the layer's own
  all-reduce would save that reduction, but needs a hook inside RowParallelLinear's forward,
  which Megatron does not expose.
Sharded parameters carry Megatron's tensor-parallel attributes, so the gradient norm counts
the replicated ones once. B starts at zero, A as PEFT's (kaiming uniform, a = sqrt(5)) drawn
whole from a generator seeded by (seed, layer, module, part) and then sliced: TP1 and TP2 (and
any PP) start from the same adapter.

How: `attach` freezes every base weight and turns each selected linear into its LoRA subclass
in place (the same object under the same name, so base weight keys, Megatron's layer offsets
and the DDP wrapping are untouched; a wrapper module would rename the weights in
`state_dict`). The subclass adds the adapter's output in `forward` and its tensors to
`sharded_state_dict`, one checkpoint key per layer (`alignflow.job.convert.lora.adapter_key`:
wildcards may adapt some layers only, which a stacked key could not hold). `merge` folds the
adapters into the weights and restores the plain classes; `disabled` runs the frozen base;
`effective_weight` is what the KV-cached decoder reads.

Not supported: Transformer Engine's fused norm + linear layers (the adapter would need the
normalized input), sequence parallelism, and full activation recompute (refused at compose).
"""

import math
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint
from torch import Tensor, nn

from alignflow.job.convert import lora as targets
from alignflow.job.convert.layout import merge_qkv
from alignflow.job.device import device

ADAPTER = "adapter"  # the child module of an adapted linear layer


@dataclass(frozen=True)
class LoRASettings:
    """What shapes and scales the adapters (the `lora` section, or an output's lora.json)."""

    adapter_dim: int
    alpha: float
    adapter_dropout: float
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, section: Any) -> "LoRASettings":
        return cls(int(section.adapter_dim), float(section.alpha), float(section.adapter_dropout), tuple(section.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.adapter_dim


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key (module or checkpoint name) is an adapter matrix."""
    return f".{ADAPTER}.lora_" in key


class Adapter(nn.Module):
    """The A and B of each adapted projection of one linear layer (this rank's shards)."""

    def __init__(self, linear: nn.Module, module: targets.Module, layer: int, parts: Sequence[str], settings: LoRASettings, seed: int):
        super().__init__()
        self.spec, self.layer, self.scaling, self.enabled, self.config = module, layer, settings.scaling, True, linear.config
        self.tp_size, self.tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        column = module.parallel == "column"
        self.rows = {part: size // (self.tp_size if column else 1) for part, size in part_sizes(linear.config, module).items()}
        self.cols = linear.input_size // (1 if column else self.tp_size)  # this rank's input features
        self.dropout = nn.Dropout(settings.adapter_dropout) if settings.adapter_dropout > 0 else nn.Identity()
        weight, r = linear.weight, settings.adapter_dim
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        for part in parts:
            a = initial_a(r, linear.input_size, seed, layer, module.path, part)
            a = a if column else a.chunk(self.tp_size, dim=1)[self.tp_rank]
            self.lora_A[part] = nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
            self.lora_B[part] = nn.Parameter(torch.zeros(self.rows[part], r, device=weight.device, dtype=weight.dtype))
            sharded, dim = (self.lora_B[part], 0) if column else (self.lora_A[part], 1)
            set_tensor_model_parallel_attributes(sharded, True, dim, 1)

    def tp_axis(self, matrix: str) -> int | None:
        """The dim a matrix is sharded on over TP (None: replicated)."""
        return {("column", "lora_B"): 0, ("row", "lora_A"): 1}.get((self.spec.parallel, matrix))

    def forward(self, x: Tensor) -> Tensor:
        """(alpha / r) B A dropout(x) of every part, fused in the layer's output layout (this rank's
        columns). Each part draws its own dropout mask, in the order of its HF projections (q, k, v;
        gate, up), as PEFT's separate layers do. A row-parallel layer's input is this rank's shard:
        its dropout draws from Megatron's model-parallel RNG (distinct per TP rank); a replicated
        input's from the default one, the same on every TP rank, so the ranks' A x agree."""
        outs = []
        for part in self.spec.parts:
            if part not in self.lora_A:  # e.g. only q_proj of linear_qkv is targeted
                outs.append(x.new_zeros(*x.shape[:-1], self.rows[part]))
                continue
            h = F.linear(self._dropped(x), self.lora_A[part])
            h = copy_to_tensor_model_parallel_region(h) if self.spec.parallel == "column" else reduce_from_tensor_model_parallel_region(h)
            outs.append(F.linear(h, self.lora_B[part]) * self.scaling)
        return fuse_last_dim(self.spec, outs, self.config)

    def _dropped(self, x: Tensor) -> Tensor:
        """x through a fresh dropout mask, drawn from the RNG `forward` says."""
        if self.spec.parallel == "row" and isinstance(self.dropout, nn.Dropout):
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    def delta_weight(self) -> Tensor:
        """The update of this rank's shard of the weight, (alpha / r) B A, in the weight's layout (fp32)."""
        parts = [
            (self.lora_B[p].float() @ self.lora_A[p].float()) * self.scaling
            if p in self.lora_A
            else torch.zeros(self.rows[p], self.cols, device=self.lora_B[next(iter(self.lora_B))].device)
            for p in self.spec.parts
        ]
        return fuse_rows(self.spec, parts, self.config)


def part_sizes(config: Any, module: targets.Module) -> dict[str, int]:
    """Global output rows of each HF projection of a module."""
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    sizes = {
        "q_proj": heads * dim,
        "k_proj": groups * dim,
        "v_proj": groups * dim,
        "o_proj": config.hidden_size,
        "gate_proj": config.ffn_hidden_size,
        "up_proj": config.ffn_hidden_size,
        "down_proj": config.hidden_size,
    }
    return {part: sizes[part] for part in module.parts}


def fuse_rows(module: targets.Module, parts: list[Tensor], config: Any) -> Tensor:
    """This rank's parts (dim 0) in the module's fused layout: per local query group for qkv."""
    if module.fuse == "qkv":
        tp = parallel_state.get_tensor_model_parallel_world_size()
        return merge_qkv(*parts, config.num_attention_heads // tp, config.num_query_groups // tp, config.kv_channels)
    return torch.cat(parts, dim=0)


def fuse_last_dim(module: targets.Module, parts: list[Tensor], config: Any) -> Tensor:
    """As `fuse_rows`, on the last dim of activations [s, b, rows]."""
    if module.fuse is None:
        return parts[0]
    return fuse_rows(module, [p.movedim(-1, 0) for p in parts], config).movedim(0, -1)


def initial_a(r: int, fan_in: int, seed: int, layer: int, path: str, part: str) -> Tensor:
    """PEFT's A (kaiming uniform, a = sqrt(5)), whole, from a generator of its own."""
    generator = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{layer}:{path}:{part}".encode()))
    a = torch.empty(r, fan_in, device="cpu")
    return nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)


class _LoRALinear:
    """What the LoRA subclasses add to Megatron's linear layers (see the top)."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        adapter = getattr(self, ADAPTER)
        if adapter.enabled:
            output = output + adapter(input_).to(output.dtype)
        return output, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Megatron's, with the adapter's tensors under one key per (global) layer. Megatron's
        TransformerBlock replaces the layer's prefix `decoder.layers.{local}.` with
        `decoder.layers.` in every key: a key written as `decoder.layers.{local}.{global}.…`
        comes out as `decoder.layers.{global}.…` (`alignflow.job.convert.lora.adapter_key`)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        adapter = getattr(self, ADAPTER)
        layer_prefix = prefix[: len(prefix) - len(adapter.spec.path) - 1]
        groups = {"tp_group": self.tp_group, "dp_cp_group": metadata["dp_cp_group"]}
        for name, param in adapter.named_parameters():
            matrix, part = name.split(".")
            key = layer_prefix + targets.adapter_key(adapter.layer, adapter.spec.path, matrix, part).removeprefix("decoder.layers.")
            axis = adapter.tp_axis(matrix)
            sharded[f"{prefix}{ADAPTER}.{name}"] = (
                make_sharded_tensor_for_checkpoint(param, key, **groups)
                if axis is None
                else make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=axis, **groups)
            )
        return sharded


class LoRAColumnParallelLinear(_LoRALinear, ColumnParallelLinear):
    pass


class LoRARowParallelLinear(_LoRALinear, RowParallelLinear):
    pass


LORA_CLASSES = {ColumnParallelLinear: LoRAColumnParallelLinear, RowParallelLinear: LoRARowParallelLinear}
BASE_CLASSES = {lora: base for base, lora in LORA_CLASSES.items()}


def layers(chunks: Sequence[nn.Module]) -> Iterator[tuple[int, nn.Module]]:
    """(global layer number from 0, TransformerLayer) of this rank's chunks."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            yield layer.layer_number - 1, layer


def attach(chunks: Sequence[nn.Module], settings: LoRASettings, seed: int, freeze: bool = True) -> int:
    """Adapt the selected linear layers (and freeze every other weight); the number adapted."""
    if freeze:
        for chunk in chunks:
            chunk.requires_grad_(False)
    num_layers = chunks[0].config.num_layers
    chosen, count = targets.select(settings.target_modules, num_layers), 0
    for layer_number, layer in layers(chunks):
        for module in targets.MODULES:
            parts = chosen.get((layer_number, module.path))
            if parts:
                _adapt(layer.get_submodule(module.path), module, layer_number, parts, settings, seed)
                count += 1
    return count


def _adapt(linear: nn.Module, module: targets.Module, layer: int, parts: Sequence[str], settings: LoRASettings, seed: int) -> None:
    if type(linear) not in LORA_CLASSES:
        raise NotImplementedError(
            f"LoRA on {type(linear).__name__} ({module.path}) is not supported: only Megatron's local "
            "ColumnParallelLinear / RowParallelLinear (Transformer Engine's fused norm + linear needs the normed input)"
        )
    if linear.config.sequence_parallel:
        raise NotImplementedError("LoRA with sequence_parallel is not supported")
    adapter = Adapter(linear, module, layer, parts, settings, seed)
    linear.__class__ = LORA_CLASSES[type(linear)]
    linear.add_module(ADAPTER, adapter)


def adapted(chunks: Sequence[nn.Module]) -> list[nn.Module]:
    """The chunks' adapted linear layers."""
    return [m for chunk in chunks for m in chunk.modules() if type(m) in BASE_CLASSES]


@torch.no_grad()
def merge(chunks: Sequence[nn.Module]) -> None:
    """Fold every adapter into its layer's weight (W + (alpha / r) B A) and drop it: plain
    Megatron layers again, whose weights are the merged model."""
    for linear in adapted(chunks):
        adapter = getattr(linear, ADAPTER)
        linear.weight.add_(adapter.delta_weight().to(linear.weight.dtype))
        delattr(linear, ADAPTER)
        linear.__class__ = BASE_CLASSES[type(linear)]


@contextmanager
def disabled(chunks: Sequence[nn.Module]) -> Iterator[None]:
    """The frozen base model for the block (a no-op on chunks without adapters)."""
    adapters = [getattr(m, ADAPTER) for m in adapted(chunks)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def effective_weight(linear: nn.Module) -> Tensor:
    """This rank's weight of a layer as its forward applies it: merged with its adapter if it has one."""
    adapter = getattr(linear, ADAPTER, None)
    if adapter is None or not adapter.enabled:
        return linear.weight
    return linear.weight + adapter.delta_weight().to(linear.weight.dtype)


def trainable_params(chunks: Sequence[nn.Module]) -> int:
    """Trainable parameters of the whole model: this rank's, TP-replicated ones counted on TP
    rank 0 only, summed over the TP and PP ranks."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    local = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0))
    total = torch.tensor(local, dtype=torch.int64, device=device())
    for group in (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_pipeline_model_parallel_group()):
        torch.distributed.all_reduce(total, group=group)
    return int(total.item())


def load_output(chunks: Sequence[nn.Module], output: Any, fetch: Callable[[str], Any], load: Callable) -> None:
    """The weights of a model stage output into plain chunks: its torch_dist weights, or for a
    LoRA output its base's (recursively: a LoRA DPO on a LoRA SFT) with its adapter merged in.
    `fetch(uri)` gives a local `ModelOutput`; `load(chunks, uri, select)` is
    `alignflow.job.model.sharded_state.load`."""
    spec = output.lora
    if spec is None:
        load(chunks, output.weights, "all")
        return
    load_output(chunks, fetch(spec["base"]), fetch, load)
    attach(chunks, LoRASettings(**{k: spec[k] for k in LoRASettings.__dataclass_fields__}), seed=0, freeze=False)
    load(chunks, output.adapter, "adapters")
    merge(chunks)
