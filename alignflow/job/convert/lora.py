"""LoRA targets between NeMo Customizer's names, Megatron's modules and HF PEFT's, as data.

A target is one HF projection (PEFT adapts `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`
separately), held by a Megatron module that may fuse several of them (`linear_qkv` =
per query group [q; k; v], `linear_fc1` = [gate; up]): each projection gets its own A and B, so
the adapter exports to PEFT exactly. `target_modules` entries, as the Customizer writes them:

- a name without a dot matches a module's last name: `linear_qkv`, `linear_proj`,
  `linear_fc1`, `linear_fc2` (all its projections), or one HF projection (`q_proj`, ...); a
  wildcard is fnmatch over Megatron's names, so `*_proj` is `linear_proj` (the Customizer's
  "projecting the output of self-attention");
- a dotted pattern is fnmatch over the module's path, Megatron's
  (`decoder.layers.0.self_attention.linear_qkv`, e.g. `*.layers.0.*.linear_qkv`), or HF's
  (`model.layers.0.self_attn.q_proj`) when its last name is an HF projection.

Layers are numbered globally (as HF does), whatever the pipeline stage holds them.
Imports no torch, so config validation can resolve targets.
"""

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable


@dataclass(frozen=True)
class Module:
    """A Megatron linear layer of a transformer layer and the HF projections it holds."""

    path: str  # relative to the layer
    parts: tuple[str, ...]  # HF projections, in the order the module fuses them
    hf_parent: str  # the HF submodule holding the projections
    parallel: str  # "column" (output dim sharded over TP) or "row" (input dim sharded)
    fuse: str | None  # `alignflow.job.convert.layout.FUSED` kind

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]


MODULES: tuple[Module, ...] = (
    Module("self_attention.linear_qkv", ("q_proj", "k_proj", "v_proj"), "self_attn", "column", "qkv"),
    Module("self_attention.linear_proj", ("o_proj",), "self_attn", "row", None),
    Module("mlp.linear_fc1", ("gate_proj", "up_proj"), "mlp", "column", "fc1"),
    Module("mlp.linear_fc2", ("down_proj",), "mlp", "row", None),
)
BY_PATH = {m.path: m for m in MODULES}
HF_PARTS = frozenset(part for m in MODULES for part in m.parts)
KNOWN_NAMES = tuple(m.name for m in MODULES) + tuple(part for m in MODULES for part in m.parts)
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def megatron_path(layer: int, module: Module) -> str:
    return f"decoder.layers.{layer}.{module.path}"


def hf_path(layer: int, module: Module, part: str) -> str:
    return f"model.layers.{layer}.{module.hf_parent}.{part}"


def matches(pattern: str, layer: int, module: Module, part: str) -> bool:
    """Whether a target_modules entry selects projection `part` of `module` in `layer` (see top)."""
    last = pattern.rsplit(".", 1)[-1]
    if "." not in pattern:
        return fnmatchcase(part, pattern) if pattern in HF_PARTS else fnmatchcase(module.name, pattern)
    if last in HF_PARTS:
        return fnmatchcase(hf_path(layer, module, part), pattern)
    return fnmatchcase(megatron_path(layer, module), pattern)


Selection = dict[tuple[int, str], tuple[str, ...]]  # (global layer, module path) -> its adapted projections


def select(patterns: Iterable[str], num_layers: int) -> Selection:
    """Every adapted projection of a model of `num_layers` layers, per (layer, module)."""
    patterns = list(patterns)
    chosen: Selection = {}
    for layer in range(num_layers):
        for module in MODULES:
            parts = tuple(p for p in module.parts if any(matches(pat, layer, module, p) for pat in patterns))
            if parts:
                chosen[(layer, module.path)] = parts
    return chosen


def target_problems(key: str, patterns: list[str], num_layers: int | None) -> list[str]:
    """Entries that select nothing, named by their key (`sft.lora.target_modules[1]`)."""
    if not patterns:
        return [f"{key}: empty; name at least one of {', '.join(KNOWN_NAMES)} (or a pattern over them)"]
    if num_layers is None:
        return []
    return [
        f"{key}[{i}]: {pattern!r} matches no adaptable module of the model's {num_layers} layers; known names: "
        f"{', '.join(KNOWN_NAMES)}, or fnmatch patterns over paths such as 'decoder.layers.0.self_attention.linear_qkv'"
        for i, pattern in enumerate(patterns)
        if not select([pattern], num_layers)
    ]


def stage_problems(key: str, patterns: list[str], num_layers: int, pp: int, vp: int | None) -> list[str]:
    """Every pipeline rank must hold an adapter: Megatron's schedule backpropagates through each
    stage's output, which needs a trainable parameter upstream of it, and each rank builds an optimizer."""
    chosen = {layer for layer, _ in select(patterns, num_layers)}
    blocks, per_block = pp * (vp or 1), num_layers // (pp * (vp or 1))
    problems = []
    for rank in range(pp):
        layers = {b * per_block + i for b in range(rank, blocks, pp) for i in range(per_block)}
        if not layers & chosen:
            problems.append(f"{key}: selects no module on pipeline stage {rank} (layers {sorted(layers)}); every stage needs at least one adapter")
    return problems


def adapter_key(layer: int, module_path: str, matrix: str, part: str) -> str:
    """The checkpoint key of one adapter matrix ("lora_A" or "lora_B"), one key per layer."""
    return f"decoder.layers.{layer}.{module_path}.adapter.{matrix}.{part}"


# HF modules that hold a Megatron module's projections fused (Phi-3's), by the Megatron module.
HF_FUSED = {"self_attention.linear_qkv": "qkv_proj", "mlp.linear_fc1": "gate_up_proj"}


def hf_fused(module: Module, shape) -> str | None:
    """The HF module that holds `module`'s projections as one (PEFT adapts it whole), or None."""
    return HF_FUSED.get(module.path) if shape.fused_projections else None
