"""The reward_model stage: a reward model trained on preference pairs (NeMo-Aligner's reward
model training, TRL 1.16's RewardTrainer).

The model is the input model's trunk (any family of `alignflow.job.convert.families`; an SFT
output, or a reward model to train on) ending in a scalar head
(`alignflow.job.model.gpt.ScoreModel`: `rm_head`, hidden -> 1, no bias, a new one drawn
normal(0, initializer_range) with `trainer.seed`); the loss is Bradley-Terry on its scores of
each pair's chosen and rejected sequence (`alignflow.job.losses.reward`: TRL's loss with a margin
and `center_rewards_coefficient`). A sequence's score is the head's output at its last token
that is not the pad token (`alignflow.job.forward.objectives.sequence_scores`, HF's rule). The
pairs are packed as DPO's (`alignflow.job.train.datasets.PreferencePairs`), trained by the
supervised loop on the engine of `alignflow.job.train` (TP/PP/DP, checkpoints and exact resume,
as SFT). Metrics per step (and per validation): loss, reward_accuracy (r_chosen > r_rejected),
reward_margin (mean r_chosen - r_rejected, the reward gap), chosen_reward, rejected_reward.

Output: a `reward_model` output, the `alignflow.job.model_files` layout of a model with the head
under `rm_head.weight` and hf/config.json the model's ...ForSequenceClassification with one
label and the data's pad token (`alignflow.job.convert.families.score_config`), so the export
stage writes an HF checkpoint that `AutoModelForSequenceClassification` loads, scoring as here.

Not here: LoRA (the new head would stay frozen), per-pair margins from the data, MoE
load-balancing loss (refused with output_router_logits), sequence-level regression rewards.
"""

from functools import partial

import torch

from alignflow.orchestrator.config.schema import RewardModelLossConfig
from alignflow.job.convert.families import score_config
from alignflow.job.data.prepared import Prepared
from alignflow.job.forward.objectives import logits_forward, sequence_scores
from alignflow.job.forward.passes import LossTerms, Objective
from alignflow.job.losses.reward import METRICS, bradley_terry
from alignflow.job.train.datasets import PreferencePairs, optional
from alignflow.job.train.engine import finish, training
from alignflow.job.train.loop import Supervised, supervised


def reward_objective(cfg: RewardModelLossConfig, pad_id: int) -> Objective:
    """Bradley-Terry over the pairs of a micro batch; its count is its pairs."""

    def loss(scores: torch.Tensor, batch: dict) -> LossTerms:
        n = batch["pairs"]
        rewards = sequence_scores(scores.float(), batch, pad_id)
        total, sums = bradley_terry(cfg, rewards[:n], rewards[n:])
        return LossTerms(total=total, count=torch.tensor(n, dtype=torch.int64, device=scores.device), metrics=sums)

    return Objective(forward=logits_forward, loss=loss, metric_names=METRICS)


def run(cfg, inputs: dict, out: str) -> dict:
    section = cfg.reward_model
    if section.finetuning_type != "all_weights":
        raise NotImplementedError(
            f"reward_model.finetuning_type: {section.finetuning_type} is not supported (the new scalar head would stay frozen); use all_weights"
        )
    data = Prepared(inputs["data"])
    train = PreferencePairs(data, "train")
    pairs = Supervised(train=train, val=optional(PreferencePairs, data, "val"), seq_length=train.row_length)
    with training(
        "reward_model", cfg, inputs, out, len(train), section.global_batch_size, model_config=partial(score_config, pad_token_id=data.pad_id)
    ) as run:
        result = supervised(run, pairs, reward_objective(section.loss, data.pad_id))
    return finish(run, result)
