"""DPO-family losses on per-sequence log-probs, with their metrics.

Inputs are per pair: the policy's and the reference's log-prob of the chosen and of the
rejected response (sums over response tokens, or means when
`preference_average_log_probs`; see `sequence_logps`). With h = (pi_c - pi_r) - (ref_c - ref_r):
- sigmoid (DPO, Rafailov et al.): -(1-eps) log s(beta h) - eps log s(-beta h); eps = label
  smoothing gives conservative DPO (cDPO);
- ipo (Azar et al.): (h - 1/(2 beta))^2.
The SFT term is the chosen response's negative log-likelihood (per token when
`sft_average_log_probs`, else per sequence). Total = preference_loss_weight * preference +
sft_loss_weight * sft. Rewards are beta * (pi - ref); accuracy counts pairs whose chosen
reward beats the rejected one.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from alignflow.config.schema import DPOLoss, DPOLossConfig


@dataclass(frozen=True)
class PreferenceLoss:
    loss: torch.Tensor  # scalar, mean over pairs
    preference_loss: torch.Tensor
    sft_loss: torch.Tensor
    reward_accuracy: torch.Tensor
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor
    reward_margin: torch.Tensor

    def metrics(self) -> dict[str, float]:
        return {name: getattr(self, name).item() for name in self.__dataclass_fields__}


def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-sequence log-prob over masked tokens: [batch, seq] -> [batch]."""
    total = (token_logps * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def preference_loss(
    cfg: DPOLossConfig,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_nll: torch.Tensor | None = None,
) -> PreferenceLoss:
    """The loss and metrics for a batch of pairs ([pairs] tensors); `chosen_nll` is the
    chosen responses' negative log-likelihood ([pairs], reduced per `sft_average_log_probs`)."""
    if cfg.loss_type not in tuple(DPOLoss):
        raise ValueError(f"dpo.loss.loss_type: {cfg.loss_type!r} is not one of {[t.value for t in DPOLoss]}")
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if cfg.loss_type == DPOLoss.sigmoid:
        per_pair = -(1 - cfg.label_smoothing) * F.logsigmoid(cfg.beta * h) - cfg.label_smoothing * F.logsigmoid(-cfg.beta * h)
    else:
        per_pair = (h - 1 / (2 * cfg.beta)) ** 2
    preference = per_pair.mean()
    sft = chosen_nll.mean() if chosen_nll is not None else h.new_zeros(())
    chosen_reward = cfg.beta * (policy_chosen - ref_chosen).detach()
    rejected_reward = cfg.beta * (policy_rejected - ref_rejected).detach()
    return PreferenceLoss(
        loss=cfg.preference_loss_weight * preference + cfg.sft_loss_weight * sft,
        preference_loss=preference.detach(),
        sft_loss=sft.detach(),
        reward_accuracy=(chosen_reward > rejected_reward).float().mean(),
        chosen_reward=chosen_reward.mean(),
        rejected_reward=rejected_reward.mean(),
        reward_margin=(chosen_reward - rejected_reward).mean(),
    )
