"""The ref_logprobs stage: the reference model's log-probs of every preference pair, once.

NeMo-RL and NeMo-Aligner run the reference model beside the policy at every DPO step; here
it runs forward only, once per (reference model, data) fingerprint, and the DPO stage reads
the result instead of holding a second model. Supported: any model in the
`alignflow.checkpoint` layout at the configured TP/PP/DP (`ref_logprobs.parallel`,
`ref_logprobs.resources`); pairs are packed into rows as DPO packs them, no padding to the
data set's longest, and the chosen and rejected sequences of a pair share a row.

Output: the format of `alignflow.data.logprobs`, one shard per DP rank, for the train and
val splits of prep's preference data (sums over response tokens, the forward in
`ref_logprobs.precision`, and the token counts, so a consumer can average). Metrics: pairs and
mean chosen log-prob per split, and the passes' tokens/s, TFLOP/s, MFU and peak memory
(`alignflow.train.engine.hardware_use`).
"""

import functools
import logging

import numpy as np
import torch
from megatron.core import parallel_state

from alignflow.data import logprobs
from alignflow.data.prepared import SIDES, Prepared
from alignflow.stages.sft import sft_forward
from alignflow.train.datasets import PreferencePairs, sequence_sums
from alignflow.train.engine import forward_only_splits, schedule

log = logging.getLogger("alignflow.ref_logprobs")


def run(cfg, inputs: dict, out: str) -> dict:
    section = cfg.ref_logprobs

    def each(model, chunks: list, pairs: PreferencePairs, split: str) -> dict:
        result = pair_logprobs(chunks, pairs, section.micro_batch_size)
        if result is None:
            return {}
        logprobs.write(result, out, split, parallel_state.get_data_parallel_rank())
        return {f"{split}.pairs": len(result["sample_id"]), f"{split}.mean_chosen_logp": float(np.mean(result["chosen_logp"]))}

    return forward_only_splits(cfg, section, inputs["model"], PreferencePairs, Prepared(inputs["data"]), each)


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
    sums = torch.cat([out["sums"] for out in outputs], dim=-1).cpu() if outputs else torch.zeros(2, len(SIDES), 0)  # one host read
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
