"""Log-probs from Megatron's vocab-parallel logits: each tensor-parallel rank holds the logits of
its slice of the (padded) vocab, [..., V / TP]; these functions give what a full-vocab
`log_softmax` would, without gathering the vocab on any rank.

- `logprobs_at(logits, ids, vocab_size)`: log p(id) at given token ids (differentiable: the
  student's log-probs at its labels and at the teacher's top-k);
- `topk_logprobs(logits, k, vocab_size)`: the k most likely tokens and their log-probs (the
  teacher's), best first.

The softmax runs over the model's `vocab_size` (its HF config's, as HF computes it): the rows
Megatron pads the output layer with (zeros, so logit 0) are masked out (`mask_padded`), here and
in every model's output layer (`alignflow.job.model.gpt.build_gpt`), so Megatron's
vocab-parallel cross entropy and torch's see the real vocabulary too, as generation samples it.
Logits are taken in fp32.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from torch import Tensor


def mask_padded(logits: Tensor, vocab_size: int, start: int = 0) -> Tensor:
    """Logits [..., width] of the vocab rows start.. with the padded ones (id >= vocab_size) at
    -inf: outside every softmax, with no gradient."""
    width = logits.shape[-1]
    if start + width <= vocab_size:
        return logits
    return logits.masked_fill(torch.arange(start, start + width, device=logits.device) >= vocab_size, float("-inf"))


def _local(logits: Tensor, vocab_size: int) -> tuple[Tensor, int]:
    """This rank's logits in fp32 with padded vocab rows at -inf, and the id of its first row."""
    start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    return mask_padded(logits.float(), vocab_size, start), start


def masking_hook(vocab_size: int):
    """A forward hook for a (column-parallel) output layer: its logits with the padded vocab rows
    masked, whether this rank's slice [..., V / TP] or gathered [..., V]."""

    def hook(layer, args, output: tuple[Tensor, Tensor | None]) -> tuple[Tensor, Tensor | None]:
        logits, bias = output
        width = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * width if width == layer.output_size_per_partition else 0
        return mask_padded(logits, vocab_size, start), bias

    return hook


def log_normalizer(logits: Tensor) -> Tensor:
    """log sum exp over the whole vocab [...] of this rank's masked fp32 logits [..., V / TP]:
    the max is shared (no gradient flows through it), the sums of exponentials all-reduced
    (gradient: each rank's own share, as Megatron's reduce region passes it back)."""
    peak = logits.detach().amax(-1)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    sum_exp = reduce_from_tensor_model_parallel_region((logits - peak[..., None]).exp().sum(-1).contiguous())
    return peak + sum_exp.log()


def logprobs_at(logits: Tensor, ids: Tensor, vocab_size: int) -> Tensor:
    """log p(ids) [..., m] under the full-vocab softmax, for global token ids [..., m] (each
    rank picks the ids in its slice, zeros elsewhere, and the picks are summed over TP)."""
    local, start = _local(logits, vocab_size)
    offset = ids.to(local.device) - start
    inside = (offset >= 0) & (offset < local.shape[-1])
    picked = local.gather(-1, offset.clamp(0, local.shape[-1] - 1))
    picked = reduce_from_tensor_model_parallel_region(torch.where(inside, picked, torch.zeros_like(picked)).contiguous())
    return picked - log_normalizer(local)[..., None]


@torch.no_grad()
def topk_logprobs(logits: Tensor, k: int, vocab_size: int) -> tuple[Tensor, Tensor]:
    """The top-k log-probs [..., k] (fp32, best first) and their token ids [..., k] (int64):
    each rank's own top-k, gathered over TP, and the top-k of those."""
    if not 0 < k <= vocab_size:
        raise ValueError(f"topk_logits_k must be in [1, vocab size {vocab_size}], got {k}")
    local, start = _local(logits, vocab_size)
    values, ids = local.topk(min(k, local.shape[-1]), dim=-1)
    ids = ids + start
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        values, ids = gather_from_tensor_model_parallel_region(values.contiguous()), gather_from_tensor_model_parallel_region(ids.contiguous())
        values, pick = values.topk(k, dim=-1)
        ids = ids.gather(-1, pick)
    return values - log_normalizer(local)[..., None], ids
