"""The forwards whose outputs stages keep: per-token NLL (`sft_forward`, SFT's objective `SFT`,
which eval's val loss and DPO/GRPO's log-probs share), logits (`logits_forward`, the teacher's
top-k), and per-pair log-prob sums of preference pairs (`pair_logprobs`: the reference DPO
reads, eval's preference accuracy); a reward model's score of each sequence of preference pairs
(`sequence_scores`, from `logits_forward`'s [b, s, 1]). With THD attention a micro batch runs as one flat sequence
of documents [1, b * s] (`alignflow.job.model.gpt.packed_thd`)."""

import functools

import numpy as np
import torch
from megatron.core import parallel_state

from alignflow.job.data.prepared import SIDES
from alignflow.job.forward.passes import LossTerms, Objective, schedule
from alignflow.job.model.gpt import document_params, packed_thd, token_nll
from alignflow.job.train.datasets import PreferencePairs, sequence_sums


def sft_forward(model, batch: dict) -> torch.Tensor:
    """Per-token cross entropy [b, s] on the last stage (hidden states elsewhere). With THD
    attention the micro batch is one flat sequence of documents [1, b * s] (see the top)."""
    tokens, labels, documents = batch["tokens"], batch["labels"], document_params(batch)
    if not packed_thd():
        return token_nll(model, tokens, batch["position_ids"], None, labels, packed_seq_params=documents)
    out = token_nll(model, tokens.view(1, -1), batch["position_ids"].view(1, -1), None, labels.view(1, -1), packed_seq_params=documents)
    return out.view(tokens.shape) if out.dim() == 2 else out


def sft_loss(per_token: torch.Tensor, batch: dict) -> LossTerms:
    mask = batch["loss_mask"]
    return LossTerms(total=(per_token.float() * mask).sum(), count=mask.sum().to(torch.int64))


SFT = Objective(forward=sft_forward, loss=sft_loss)


def logits_forward(model, batch: dict) -> torch.Tensor:
    """Logits [b, s, V / TP] on the last pipeline stage (hidden states elsewhere); with THD
    attention the micro batch runs as one flat sequence of documents (as `sft_forward`)."""
    tokens, documents = batch["tokens"], document_params(batch)
    if not packed_thd():
        return model(tokens, batch["position_ids"], None, packed_seq_params=documents)
    out = model(tokens.view(1, -1), batch["position_ids"].view(1, -1), None, packed_seq_params=documents)
    return out.view(*tokens.shape, -1) if getattr(model, "module", model).post_process else out


def sequence_scores(scores: torch.Tensor, batch: dict, pad_id: int) -> torch.Tensor:
    """Each sequence's score [2 * pairs] (chosen, then rejected) of a micro batch of packed
    pairs, from a reward model's scores at every position [b, s, 1] (`ScoreModel`): at the
    sequence's last token that is not `pad_id`, or its first where all are (HF's
    ...ForSequenceClassification rule, so an exported reward model scores as here)."""
    sequence = batch["sequence"].to(scores.device).flatten()
    positions = torch.arange(sequence.numel(), device=scores.device)
    inside = sequence >= 0
    kept = inside & (batch["tokens"].to(scores.device).flatten() != pad_id)
    first = positions.new_full((2 * batch["pairs"],), sequence.numel()).scatter_reduce(0, sequence[inside], positions[inside], "amin")
    return scores.flatten()[first.scatter_reduce(0, sequence[kept], positions[kept], "amax")]


def pair_logprobs(chunks: list, pairs: PreferencePairs, micro_batch_size: int) -> dict | None:
    """This DP rank's share of the pairs through the model, packed into micro batches of at most
    `micro_batch_size` rows (pipeline stages exchange each one's shape); the columns, in the
    share's order, on the rank that writes them."""
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    share = np.array_split(np.arange(len(pairs)), dp_size)[dp_rank]
    micro = pairs.micro_batches(share, micro_batch_size)
    batches = [pairs.collate(m) for m in micro]
    with torch.no_grad():
        outputs = schedule(chunks, _forward_step, batches, pairs.row_length, micro_batch_size, forward_only=True)
    writes = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    if not writes:
        return None
    sums = torch.cat([out["sums"] for out in outputs], dim=-1).cpu() if outputs else torch.zeros(2, len(SIDES), 0, device="cpu")  # one host read
    logps, tokens = sums[..., torch.from_numpy(np.argsort(np.concatenate(micro or [share])))].tolist()  # in share's (sorted) order
    columns = {"sample_id": pairs.sample_ids[share].tolist()}
    for k, side in enumerate(SIDES):
        columns[f"{side}_logp"], columns[f"{side}_tokens"] = logps[k], [int(t) for t in tokens[k]]
    return columns


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    return sft_forward(model, batch), functools.partial(_sequence_sums, batch)


def _sequence_sums(batch: dict, per_token: torch.Tensor):
    """A micro batch's log-prob sums and loss-token counts [2, sides, pairs], on the rank's device."""
    mask = batch["loss_mask"]
    sums = torch.stack([sequence_sums(-per_token.double() * mask, batch), sequence_sums(mask.double(), batch)])
    return per_token.new_zeros(()), torch.tensor(1, device=per_token.device), {"sums": sums.view(2, len(SIDES), batch["pairs"])}
