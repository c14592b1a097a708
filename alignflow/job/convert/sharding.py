"""Where Megatron-Core tensors live across ranks: vocab padding and pipeline stage ends, and the
HF tensors of one full Megatron tensor (`param_to_hf`, used by the streaming exporter).

Vocab: zero rows pad it to a multiple of `make_vocab_size_divisible_by * TP` (Megatron-LM's
rule, so the padded size depends on TP); `param_to_hf` drops them. Pipeline parallel: the
embedding lives on the first stage, the final norm and output layer on the last.
Checkpoints hold global tensors (torch_dist), so nothing here slices by TP rank; the
in-memory reference converter the tests check against is `tests/reference_convert.py`.
"""

from typing import Optional

from torch import Tensor

from alignflow.job.convert.layout import unfuse
from alignflow.job.convert.families import ModelShape, Param, Slot

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron-LM's default
VOCAB_PARAMS = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> int:
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def stage_ends(pp_rank: int, pp_size: int, vp_stage: Optional[int] = None, vp_size: Optional[int] = None) -> tuple[bool, bool]:
    """(pre_process, post_process): whether this stage / chunk holds the embedding, the output layer."""
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage  # megatron costs a job ~110 MB of RSS

    return (
        pp_rank == 0 and is_vp_first_stage(vp_stage, vp_size),
        pp_rank == pp_size - 1 and is_vp_last_stage(vp_stage, vp_size),
    )


def param_to_hf(param: Param, slot: Slot, full: Tensor, shape: ModelShape) -> dict[str, Tensor]:
    """HF tensors from one full Megatron tensor at (layer, expert) `slot`; each owns its memory, as safetensors requires."""
    if param.megatron in VOCAB_PARAMS:
        full = full[: shape.vocab_size]
    return {name: t.clone() for name, t in zip(param.hf_names(*slot), unfuse(param.fuse, full, shape))}
