"""LoRA outputs to HF: the base's weights with adapters merged, and the adapter as HF PEFT's.

- `model_reader`: the global tensors of a model output's weights as `DistCheckpointReader`
  serves them, a LoRA output's being its base's (recursively) plus (alpha / r) B A of each
  adapted projection, fused in Megatron's layout (`alignflow.job.convert.layout`), so the
  streaming exporter (`alignflow.job.convert.streaming.dist_to_hf`) writes merged HF weights.
- `write_adapter`: `adapter_config.json` + `adapter_model.safetensors` with PEFT's names
  (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), which
  `peft.PeftModel.from_pretrained(base, folder)` loads onto the exported base: each projection
  has its own A and B (`alignflow.job.model.lora`), so the matrices go over as they are. Where
  HF fuses projections into one module (Phi-3's qkv_proj, gate_up_proj) PEFT adapts the fused
  module with one A and one B: the n adapted projections' adapters stacked, A = [A_1; ...; A_n]
  and B block-diagonal (B_i on projection i's rows of the fused output, zeros elsewhere), rank
  n r and alpha n alpha (`rank_pattern`, `alpha_pattern`), which is their sum exactly.
"""

import json
import re
from typing import Callable

import fsspec
import torch
from safetensors.torch import save as save_safetensors

from alignflow.job.model_files import ModelOutput
from alignflow.job.model_files.dist_io import DistCheckpointReader
from alignflow.job.convert import lora as targets
from alignflow.job.convert.layout import fuse
from alignflow.job.convert.families import ModelShape

ADAPTER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.+)\.adapter\.(lora_[AB])\.(\w+)")
STACKED = re.compile(r"decoder\.layers\.(.+)\.weight")


class MergedReader:
    """A base reader's tensors with a LoRA adapter's updates added (the reader API `dist_to_hf` uses)."""

    def __init__(self, base, adapter: DistCheckpointReader, spec: dict, shape: ModelShape):
        self.base, self.adapter, self.shape_of, self.scaling = base, adapter, shape, spec["alpha"] / spec["adapter_dim"]
        self.matrices = {tuple(m.groups()): key for key in adapter.keys() if (m := ADAPTER_KEY.fullmatch(key))}

    def keys(self) -> list[str]:
        return self.base.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self.base.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.base.dtype(key)

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        tensor = self.base.read(key, index)
        match = STACKED.fullmatch(key)
        module = targets.BY_PATH.get(match.group(1)) if match else None
        if module is None or index is None or not any((str(index), module.path, "lora_A", p) in self.matrices for p in module.parts):
            return tensor
        return (tensor.float() + self.delta(index, module, tensor.shape[-1])).to(tensor.dtype)

    def delta(self, layer: int, module: targets.Module, in_features: int) -> torch.Tensor:
        """(alpha / r) B A of each projection of `module` in `layer` (zeros where not adapted), fused."""
        parts = []
        for part in module.parts:
            a, b = (self.matrices.get((str(layer), module.path, m, part)) for m in ("lora_A", "lora_B"))
            if a is None:
                parts.append(torch.zeros(part_rows(self.shape_of, part), in_features, device="cpu"))
            else:
                parts.append(self.adapter.read(b).float() @ self.adapter.read(a).float() * self.scaling)
        return fuse(module.fuse, parts, self.shape_of)


def part_rows(s: ModelShape, part: str) -> int:
    """Output features of an HF projection."""
    return {
        "q_proj": s.num_attention_heads * s.head_dim,
        "k_proj": s.num_query_groups * s.head_dim,
        "v_proj": s.num_query_groups * s.head_dim,
        "gate_proj": s.ffn_hidden_size,
        "up_proj": s.ffn_hidden_size,
        "o_proj": s.hidden_size,
        "down_proj": s.hidden_size,
    }[part]


def model_reader(output: ModelOutput, shape: ModelShape, fetch: Callable[[str], ModelOutput] = ModelOutput):
    """A reader of a model output's full weights: its own, or its base's with its adapter merged."""
    if output.lora is None:
        return DistCheckpointReader(output.weights)
    return MergedReader(model_reader(fetch(output.lora["base"]), shape, fetch), DistCheckpointReader(output.adapter), output.lora, shape)


def write_adapter(folder: str, output: ModelOutput, shape: ModelShape, dtype: torch.dtype, base_name: str | None) -> dict:
    """A PEFT LoRA adapter folder of a LoRA output's adapter; its size and target count."""
    spec, reader = output.lora, DistCheckpointReader(output.adapter)
    adapted: dict[tuple[int, str], dict[str, dict[str, torch.Tensor]]] = {}  # (layer, Megatron path) -> part -> matrix -> tensor
    for key in reader.keys():
        layer, path, matrix, part = ADAPTER_KEY.fullmatch(key).groups()
        adapted.setdefault((int(layer), path), {}).setdefault(part, {})[matrix] = reader.read(key)
    tensors, ranks = {}, {}  # ranks: HF module (layer, name) -> how many projections its adapter stacks
    for (layer, path), parts in adapted.items():
        module = targets.BY_PATH[path]
        for name, (a, b, stacked) in _hf_adapters(module, parts, shape).items():
            prefix = f"base_model.model.model.layers.{layer}.{module.hf_parent}.{name}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a.to(dtype).contiguous(), b.to(dtype).contiguous()
            ranks[(layer, f"{module.hf_parent}.{name}")] = stacked
    config = peft_config(spec, ranks, shape.num_layers, base_name)
    fs, root = fsspec.core.url_to_fs(folder)
    fs.makedirs(root, exist_ok=True)
    fs.pipe(f"{root}/adapter_model.safetensors", save_safetensors(tensors, metadata={"format": "pt"}))
    fs.pipe(f"{root}/adapter_config.json", json.dumps(config, indent=2).encode())
    return {"adapter_params": sum(t.numel() for t in tensors.values()), "adapted_modules": sum(len(p) for p in adapted.values())}


def _hf_adapters(module: targets.Module, parts: dict, shape: ModelShape) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """HF module name -> (A, B, projections stacked) of one Megatron module's adapted projections."""
    fused = targets.hf_fused(module, shape)
    if fused is None:
        return {part: (m["lora_A"], m["lora_B"], 1) for part, m in parts.items()}
    chosen = [p for p in module.parts if p in parts]
    r = parts[chosen[0]]["lora_A"].shape[0]
    b = torch.zeros(sum(part_rows(shape, p) for p in module.parts), r * len(chosen), dtype=parts[chosen[0]]["lora_B"].dtype, device="cpu")
    row = 0
    for p in module.parts:  # HF's fused rows: the projections one after another, in this order
        if p in parts:
            i = chosen.index(p)
            b[row : row + part_rows(shape, p), i * r : (i + 1) * r] = parts[p]["lora_B"]
        row += part_rows(shape, p)
    return {fused: (torch.cat([parts[p]["lora_A"] for p in chosen]), b, len(chosen))}


def peft_config(spec: dict, ranks: dict[tuple[int, str], int], num_layers: int, base_name: str | None) -> dict:
    """PEFT's adapter_config.json: short target names when every layer adapts the same HF
    modules, else each module's full HF path (PEFT matches a name or a path suffix); a module
    whose adapter stacks n projections has rank n r and alpha n alpha (the same scaling)."""
    per_layer: dict[int, set[str]] = {}
    for layer, module in ranks:
        per_layer.setdefault(layer, set()).add(module.rsplit(".", 1)[-1])
    uniform = len({frozenset(p) for p in per_layer.values()}) == 1 and set(per_layer) == set(range(num_layers))
    names = (
        sorted({name for names in per_layer.values() for name in names})
        if uniform
        else sorted(f"model.layers.{layer}.{module}" for layer, module in ranks)
    )
    stacked = {re.escape(f"model.layers.{layer}.{module}"): n for (layer, module), n in ranks.items() if n > 1}
    r, alpha = spec["adapter_dim"], spec["alpha"]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "inference_mode": True,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": spec["adapter_dropout"],
        "target_modules": names,
        "rank_pattern": {key: n * r for key, n in stacked.items()},
        "alpha_pattern": {key: n * alpha for key, n in stacked.items()},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
    }
