"""The reward model's loss on per-pair scores: Bradley-Terry, as TRL 1.16's RewardTrainer
(trl/trainer/reward_trainer.py `compute_loss`) and NeMo-Aligner's binary ranking.

Per pair, with c and r the chosen and the rejected sequence's scores:
-log sigmoid(c - r - margin), plus center_rewards_coefficient x (c + r)^2 where it is set (TRL's
`center_rewards_coefficient`: scores pushed towards mean zero). TRL takes the margin from a
`margin` column per pair; here it is one setting for every pair. Metrics per pair: whether c > r
(TRL's `accuracy`), c - r (TRL's `margin`, the reward gap), c and r. Sums over pairs, so a step's
means are over its pairs however they are grouped into micro batches.
"""

import torch
import torch.nn.functional as F

from alignflow.orchestrator.config.schema import RewardModelLossConfig

METRICS = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward")


def bradley_terry(cfg: RewardModelLossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed loss over the pairs of `chosen` and `rejected` scores [pairs], and the metrics' sums."""
    gap = chosen - rejected
    loss = -F.logsigmoid(gap - cfg.margin)
    if cfg.center_rewards_coefficient is not None:
        loss = loss + cfg.center_rewards_coefficient * (chosen + rejected) ** 2
    sums = {"reward_accuracy": (gap > 0).sum(), "reward_margin": gap.sum(), "chosen_reward": chosen.sum(), "rejected_reward": rejected.sum()}
    return loss.sum(), {name: value.detach().to(loss.dtype) for name, value in sums.items()}
