"""The in-memory HF <-> Megatron converter, as a reference for the tests: TP slicing by
parameter (`TP_SPLIT`), pipeline placement by Megatron-Core's own rule, and whole-state
conversions (`hf_to_megatron`, `megatron_to_hf`). The stages convert by streaming
(`alignflow.job.convert.streaming`) into global torch_dist tensors and never slice by rank.

Tensor parallel (`TP_SPLIT`, by parameter name within a layer):
- column (dim 0): qkv weight and bias (whole query groups, see `alignflow.job.convert.layout`), and
  the vocab-parallel embedding and output layer (rows of the padded vocab);
- row (dim 1): attention output projection, fc2 (their biases are added after the reduction: replicated);
- gated (dim 0 of gate and of up separately): fc1 and its bias, so each rank computes silu(gate_r) * up_r;
- anything else (the norms, per-head q/k norms, the MoE router) is replicated; OLMo 2's q/k
  norms over the whole projection are column-split like the heads they normalize (`whole_qk_norms`).
Expert parallel: EP rank r holds experts [r * E / EP, (r + 1) * E / EP), numbered locally from 0;
within an expert, TP splits fc1 (gated) and fc2 (row) as the dense MLP's (expert TP = TP).
"""

import re
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from alignflow.job.convert.layout import fuse
from alignflow.job.convert.families import TIED_OUTPUT_COPY, ModelShape, Param, Slot, model_shape, params_for
from alignflow.job.convert.sharding import MAKE_VOCAB_SIZE_DIVISIBLE_BY, VOCAB_PARAMS, padded_vocab_size, param_to_hf, stage_ends

COLUMN, ROW, GATED = "column", "row", "gated"
SPLIT_DIM = {COLUMN: 0, ROW: 1, GATED: 0}
TP_SPLIT: dict[str, str] = {
    "embedding.word_embeddings.weight": COLUMN,
    "output_layer.weight": COLUMN,
    "self_attention.linear_qkv.weight": COLUMN,
    "self_attention.linear_qkv.bias": COLUMN,
    "self_attention.linear_proj.weight": ROW,
    "mlp.linear_fc1.weight": GATED,
    "mlp.linear_fc1.bias": GATED,
    "mlp.linear_fc2.weight": ROW,
    "mlp.experts.linear_fc1.weight": GATED,
    "mlp.experts.linear_fc2.weight": ROW,
}

WHOLE_QK_NORMS = {"self_attention.q_layernorm.weight": COLUMN, "self_attention.k_layernorm.weight": COLUMN}

# Non-layer parameters -> the pipeline end that holds them.
PIPELINE_END = {
    "embedding.word_embeddings.weight": "first",
    "decoder.final_layernorm.weight": "last",
    "output_layer.weight": "last",
}

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+|\{layer\})\.")  # a number or the table's placeholder
_EXPERT = re.compile(r"local_experts\.(\d+|\{expert\})\.")

# (param, HF (layer, expert), Megatron (local layer, local expert)); None where the param has no such axis.
Placed = tuple[Param, Slot, Slot]


def tp_split(name: str, whole_qk_norms: bool = False) -> Optional[str]:
    """How TP splits a Megatron parameter (COLUMN, ROW, GATED), or None if replicated."""
    within = _EXPERT.sub("", _LAYER_PREFIX.sub("", name))
    return WHOLE_QK_NORMS.get(within) if whole_qk_norms and within in WHOLE_QK_NORMS else TP_SPLIT.get(within)


def shard(name: str, full: Tensor, tp_rank: int, tp_size: int, whole_qk_norms: bool = False) -> Tensor:
    """TP rank `tp_rank`'s slice of a full tensor; a slice is a copy, so saving it never writes the whole."""
    split = tp_split(name, whole_qk_norms)
    if split is None or tp_size == 1:
        return full
    if split == GATED:
        return torch.cat([_slice(half, 0, tp_rank, tp_size, name) for half in torch.chunk(full, 2, dim=0)])
    return _slice(full, SPLIT_DIM[split], tp_rank, tp_size, name).clone()


def unshard(name: str, shards: Sequence[Tensor], whole_qk_norms: bool = False) -> Tensor:
    """The full tensor from all TP ranks' slices, in rank order (inverse of `shard`)."""
    split = tp_split(name, whole_qk_norms)
    if split is None:
        return shards[0]
    if split == GATED:
        gates, ups = zip(*(torch.chunk(s, 2, dim=0) for s in shards))
        return torch.cat([*gates, *ups])
    return torch.cat(list(shards), dim=SPLIT_DIM[split])


def check_tp(shape: ModelShape, tp_size: int) -> None:
    """TP must split heads and query groups whole: a row count that merely divides could cut a group."""
    for field in ("num_attention_heads", "num_query_groups"):
        if getattr(shape, field) % tp_size:
            raise ValueError(f"{field}={getattr(shape, field)} does not split over TP={tp_size}")


def _slice(t: Tensor, dim: int, rank: int, size: int, name: str) -> Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of size {t.shape[dim]} does not split over TP={size}")
    return torch.chunk(t, size, dim=dim)[rank]


def pad_vocab(t: Tensor, padded: int) -> Tensor:
    """Zero rows up to the padded vocab: padded logits stay constant and gain no gradient from data."""
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if padded > t.shape[0] else t


def stage_layers(shape: ModelShape, pp_rank: int, pp_size: int, vp_stage: Optional[int] = None, vp_size: Optional[int] = None) -> range:
    """The global layer numbers a pipeline stage (virtual chunk) holds, by Megatron-Core's rule.

    Megatron-Core is imported here, not at the top: the streaming converter uses this module
    without pipeline placement, and megatron-core's imports cost a job ~110 MB of RSS."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vp_size,
        pipeline_dtype=torch.float32,
    )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def stage_experts(shape: ModelShape, ep_rank: int, ep_size: int) -> range:
    """The global expert numbers an expert-parallel rank holds."""
    if shape.num_experts % ep_size:
        raise ValueError(f"num_experts={shape.num_experts} does not split over EP={ep_size}")
    per_rank = shape.num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def stage_params(
    shape: ModelShape,
    pp_rank: int = 0,
    pp_size: int = 1,
    vp_stage: Optional[int] = None,
    vp_size: Optional[int] = None,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> list[Placed]:
    """The table entries a pipeline stage (virtual chunk) and expert-parallel rank holds, with
    their global and local (layer, expert) numbers."""
    pre, post = stage_ends(pp_rank, pp_size, vp_stage, vp_size)
    holds = {"first": pre, "last": post}
    params = params_for(shape)
    none: Slot = (None, None)
    placed: list[Placed] = [(p, none, none) for p in params if not p.per_layer and holds[PIPELINE_END[p.megatron]]]
    if shape.tied_embeddings and post and not pre:
        placed.append((TIED_OUTPUT_COPY, none, none))
    experts = list(enumerate(stage_experts(shape, ep_rank, ep_size))) if shape.moe else []
    for local, layer in enumerate(stage_layers(shape, pp_rank, pp_size, vp_stage, vp_size)):
        for p in params:
            if p.per_expert:
                placed += [(p, (layer, expert), (local, local_expert)) for local_expert, expert in experts]
            elif p.per_layer:
                placed.append((p, (layer, None), (local, None)))
    return placed


def param_to_megatron(
    param: Param,
    slot: Slot,
    hf_state: Mapping[str, Tensor],
    shape: ModelShape,
    tp_rank: int,
    tp_size: int,
    divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY,
) -> Tensor:
    """One Megatron tensor (this TP rank's slice) from the HF tensors it is built from."""
    check_tp(shape, tp_size)
    full = fuse(param.fuse, [hf_state[name] for name in param.hf_names(*slot)], shape)
    if param.megatron in VOCAB_PARAMS:
        full = pad_vocab(full, padded_vocab_size(shape.vocab_size, tp_size, divisible_by))
    return shard(param.megatron, full, tp_rank, tp_size, shape.qk_norm_whole)


def hf_to_megatron(
    hf_state: Mapping[str, Tensor],
    hf_config: Mapping,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    *,
    vp_stage: Optional[int] = None,
    vp_size: Optional[int] = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    make_vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY,
) -> dict[str, Tensor]:
    """This rank's local Megatron state (checkpoint names, stage-local layer and EP-local expert numbers).

    With virtual pipeline parallelism, the state of one chunk (`vp_stage`)."""
    shape = model_shape(hf_config)
    return {
        param.megatron_name(*local): param_to_megatron(param, slot, hf_state, shape, tp_rank, tp_size, make_vocab_size_divisible_by)
        for param, slot, local in stage_params(shape, pp_rank, pp_size, vp_stage, vp_size, ep_rank, ep_size)
    }


def megatron_to_hf(full_megatron_state: Mapping[str, Tensor], hf_config: Mapping) -> dict[str, Tensor]:
    """HF state from full (TP-gathered, globally numbered) Megatron tensors.

    Raises on a Megatron tensor the table does not know, so nothing is dropped silently; the
    tied output copy a last pipeline stage keeps is the only one ignored."""
    shape = model_shape(hf_config)
    placed = stage_params(shape)
    known = {p.megatron_name(*local) for p, _, local in placed}
    ignored = {TIED_OUTPUT_COPY.megatron} if shape.tied_embeddings else set()
    unknown = set(full_megatron_state) - known - ignored
    if unknown:
        raise ValueError(f"Megatron tensors not in the {shape.architecture} table: {sorted(unknown)}")
    hf: dict[str, Tensor] = {}
    for param, slot, local in placed:
        hf.update(param_to_hf(param, slot, full_megatron_state[param.megatron_name(*local)], shape))
    return hf
