"""The ref_logprobs stage: the reference model's log-probs of every preference pair, once.

NeMo-RL and NeMo-Aligner run the reference model beside the policy at every DPO step; here
it runs forward only, once per (reference model, data) fingerprint, and the DPO stage reads
the result instead of holding a second model. Supported: any model in the
`alignflow.checkpoint` layout at the configured TP/PP/DP (`ref_logprobs.parallel`,
`ref_logprobs.resources`); pairs are packed into rows as DPO packs them, no padding to the
data set's longest, and the chosen and rejected sequences of a pair share a row.

Output: the format of `alignflow.data.logprobs`, one shard per DP rank, for the train and
val splits of prep's preference data (sums over response tokens, fp32 forward, and the token
counts, so a consumer can average). Metrics: pairs and mean chosen log-prob per split, and
the passes' tokens/s, TFLOP/s, MFU and peak memory (`alignflow.train.engine.hardware_use`).
"""

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
    """This DP rank's share of the pairs through the model, `micro_batch_size` pairs per packed
    micro batch (the last may hold fewer: pipeline stages exchange each one's shape); the
    columns on the rank that writes them."""
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    share = np.array_split(np.arange(len(pairs)), dp_size)[dp_rank]
    micro = [share[i : i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]
    batches = [pairs.collate(m) for m in micro]
    with torch.no_grad():
        outputs = schedule(chunks, _forward_step, batches, pairs.row_length, micro_batch_size, forward_only=True)
    writes = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    if not writes:
        return None
    columns: dict[str, list] = {"sample_id": [], **{f"{s}_{k}": [] for s in SIDES for k in ("logp", "tokens")}}
    for m, batch, per_token in zip(micro, batches, outputs):
        logps = sequence_sums(-per_token.double() * batch["loss_mask"], batch)
        tokens = sequence_sums(batch["loss_mask"].double(), batch).to(torch.int32)
        n = len(m)
        columns["sample_id"] += pairs.sample_ids[m].tolist()
        for k, side in enumerate(SIDES):
            columns[f"{side}_logp"] += logps[k * n : (k + 1) * n].tolist()
            columns[f"{side}_tokens"] += tokens[k * n : (k + 1) * n].tolist()
    return columns


def _forward_step(data_iterator, model):
    """Per-token negative log-likelihood [b, s] on the last stage; no loss function, so the
    schedule hands the outputs back as they are."""
    return sft_forward(model, next(data_iterator)), None
