"""The ref_logprobs stage: the reference model's log-probs of every preference pair, once.

NeMo-RL and NeMo-Aligner run the reference model beside the policy at every DPO step; here
it runs forward only, once per (reference model, data) fingerprint, and the DPO stage reads
the result instead of holding a second model. Supported: any model in the
`alignflow.job.model_files` layout at the configured TP/PP/DP (`ref_logprobs.parallel`,
`ref_logprobs.resources`); pairs are packed into rows as DPO packs them, no padding to the
data set's longest, and the chosen and rejected sequences of a pair share a row.

Output: the format of `alignflow.job.data.logprobs`, one shard per DP rank, for the train and
val splits of prep's preference data (sums over response tokens, the forward in
`ref_logprobs.precision`, and the token counts, so a consumer can average). Metrics: pairs and
mean chosen log-prob per split, and the passes' tokens/s, TFLOP/s, MFU and peak memory
(`alignflow.job.forward.passes.hardware_use`).
"""

import logging

import numpy as np
from megatron.core import parallel_state

from alignflow.job.data import logprobs
from alignflow.job.data.prepared import Prepared
from alignflow.job.forward.objectives import pair_logprobs
from alignflow.job.forward.passes import forward_only_splits
from alignflow.job.train.datasets import PreferencePairs

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
