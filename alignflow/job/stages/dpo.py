"""The dpo stage: DPO-family training from precomputed reference log-probs.

Supported: the losses of `alignflow.job.losses.preference` (TRL 1.16's DPO `loss_type` list with
`loss_weights`, conservative DPO `cdpo`, the reference-free cpo, simpo and orpo), NeMo-RL's
`sft_loss_weight`, `preference_loss_weight`, `preference_average_log_probs` and
`sft_average_log_probs`, on the training engine of
`alignflow.job.train` (TP/PP/DP, checkpoints and exact resume, as SFT). The reference model never
runs here: `inputs["ref_logprobs"]` holds its per-pair log-prob sums and token counts,
computed once by the ref_logprobs stage and joined on sample_id. With LoRA (`finetuning_type`
lora / lora_merged) the policy is the input model's frozen base plus adapters; reference
log-probs computed on that same input model are the base's, so no second copy is needed.
The reference-free losses still take the ref_logprobs input (read, then unused).
The chosen and rejected
sequences of a pair share a packed row (`alignflow.job.train.datasets.PreferencePairs`: pairs
packed into rows, no padding to the data set's longest), so a pair's loss is computed where
both are.
Metrics per step (and per validation): loss, reward_accuracy, chosen_reward,
rejected_reward, reward_margin, preference_loss, sft_loss. A mixture-of-experts model whose
config sets output_router_logits adds router_aux_loss_coef x HF's load-balancing loss of each
micro batch (its pairs' chosen and rejected tokens), as TRL's DPOTrainer does, weighted by the
micro batch's pairs, and `aux_loss` (`alignflow.job.train.objectives.with_load_balancing`).

Output: the final policy in the `alignflow.job.model_files` layout, and metrics.jsonl.
"""

import torch

from alignflow.orchestrator.config.schema import DPOLossConfig
from alignflow.job.data.prepared import SIDES, Prepared
from alignflow.job.losses.preference import PairLogps, PreferenceLoss, preference_loss
from alignflow.job.forward.objectives import sft_forward
from alignflow.job.forward.passes import LossTerms, Objective
from alignflow.job.train.datasets import PreferencePairs, optional, sequence_sums
from alignflow.job.train.engine import finish, training
from alignflow.job.train.loop import Supervised, supervised
from alignflow.job.train.objectives import with_load_balancing

METRICS = tuple(name for name in PreferenceLoss.__dataclass_fields__ if name != "loss")


def dpo_objective(cfg: DPOLossConfig) -> Objective:
    def loss(per_token: torch.Tensor, batch: dict) -> LossTerms:
        out = pair_loss(cfg, per_token, batch)
        n = batch["pairs"]
        sums = {name: getattr(out, name) * n for name in METRICS}
        return LossTerms(total=out.loss * n, count=torch.tensor(n, dtype=torch.int64, device=per_token.device), metrics=sums)

    return Objective(forward=sft_forward, loss=loss, metric_names=METRICS)


def pair_loss(cfg: DPOLossConfig, per_token: torch.Tensor, batch: dict) -> PreferenceLoss:
    """The preference loss of a micro batch of packed pairs from per-token NLL."""
    n = batch["pairs"]
    sums = sequence_sums(-per_token.float() * batch["loss_mask"], batch)  # chosen, then rejected
    tokens = sequence_sums(batch["loss_mask"].float(), batch)
    ref = {side: batch[f"ref_{side}_logp"].to(sums.dtype) for side in SIDES}
    logps = PairLogps(
        policy_chosen=sums[:n],
        policy_rejected=sums[n:],
        ref_chosen=ref["chosen"],
        ref_rejected=ref["rejected"],
        chosen_tokens=tokens[:n],
        rejected_tokens=tokens[n:],
    )
    return preference_loss(cfg, logps)


def load_data(data: Prepared, reference_uri: str) -> Supervised:
    train, val = PreferencePairs(data, "train", reference_uri), optional(PreferencePairs, data, "val", reference_uri)
    return Supervised(train=train, val=val, seq_length=train.row_length)  # nominal: each micro batch has its own shape


def run(cfg, inputs: dict, out: str) -> dict:
    data = load_data(Prepared(inputs["data"]), inputs["ref_logprobs"])
    with training("dpo", cfg, inputs, out, len(data.train), cfg.dpo.global_batch_size) as run:
        result = supervised(run, data, with_load_balancing(dpo_objective(cfg.dpo.loss), run.init.hf_config))
    return finish(run, result)
