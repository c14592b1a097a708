"""DPO-family losses on per-sequence log-probs, with their metrics.

Each loss type is TRL 1.16's formula (trl/trainer/dpo_trainer.py `_compute_loss`; the
reference-free `cpo` and `simpo` from trl/experimental/cpo/cpo_trainer.py `cpo_loss`, `orpo`'s
odds-ratio term from trl/experimental/orpo/orpo_trainer.py `odds_ratio_loss`), plus `cdpo`,
conservative DPO (Mitchell, "A note on DPO with noisy preferences"):
-(1-eps) log s(beta h) - eps log s(-beta h), which TRL 1.16 no longer offers (its `sigmoid`
ignores label_smoothing). With c, r the chosen and rejected log-ratios (policy - reference;
the policy's log-probs for the reference-free types), h = c - r. Log-probs are sums over the
response tokens, or per-token means where TRL takes them (ipo, sigmoid_norm, simpo, orpo) or
where `preference_average_log_probs` says so for every type. `sft` is the chosen tokens'
mean negative log-likelihood over the batch (TRL's `sft`, CPO's NLL term). Preference =
sum of loss_weights x the types' means over pairs; total = preference_loss_weight x
preference + sft_loss_weight x NeMo-RL's SFT term (chosen NLL per sequence, or per token
with `sft_average_log_probs`). Rewards are beta x the summed log-ratios; accuracy counts
pairs whose chosen reward beats the rejected one. `aot` and `aot_unpaired` sort over the
pairs of one micro batch.
"""

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from alignflow.orchestrator.config.schema import DPO_REFERENCE_FREE, DPOLoss, DPOLossConfig


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


@dataclass(frozen=True)
class PairLogps:
    """A batch of pairs ([pairs] tensors): log-prob sums of each response under the policy and the
    reference, and each response's token count."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    @property
    def chosen(self) -> torch.Tensor:
        return self.policy_chosen - self.ref_chosen

    @property
    def rejected(self) -> torch.Tensor:
        return self.policy_rejected - self.ref_rejected

    def averaged(self) -> "PairLogps":
        c, r = self.chosen_tokens.clamp(min=1), self.rejected_tokens.clamp(min=1)
        return replace(
            self,
            policy_chosen=self.policy_chosen / c,
            policy_rejected=self.policy_rejected / r,
            ref_chosen=self.ref_chosen / c,
            ref_rejected=self.ref_rejected / r,
        )

    def reference_free(self) -> "PairLogps":
        zero = torch.zeros_like(self.ref_chosen)
        return replace(self, ref_chosen=zero, ref_rejected=zero)


def _smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


def _exo_pair(x: PairLogps, cfg: DPOLossConfig) -> torch.Tensor:
    z, eps = cfg.beta * (x.chosen - x.rejected), torch.tensor(cfg.label_smoothing, dtype=x.chosen.dtype, device=x.chosen.device)
    return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps)) + torch.sigmoid(-z) * (F.logsigmoid(-z) - torch.log(eps))


def _robust(x: PairLogps, cfg: DPOLossConfig) -> torch.Tensor:
    z, eps = cfg.beta * (x.chosen - x.rejected), cfg.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def _aot(x: PairLogps, cfg: DPOLossConfig) -> torch.Tensor:
    policy, ref = torch.sort(x.policy_chosen - x.policy_rejected).values, torch.sort(x.ref_chosen - x.ref_rejected).values
    return _smoothed(cfg.beta * (policy - ref), cfg.label_smoothing)


def _aot_unpaired(x: PairLogps, cfg: DPOLossConfig) -> torch.Tensor:
    return _smoothed(cfg.beta * (torch.sort(x.chosen).values - torch.sort(x.rejected).values), cfg.label_smoothing)


def _discopop(x: PairLogps, cfg: DPOLossConfig) -> torch.Tensor:
    z = cfg.beta * (x.chosen - x.rejected)
    mix = torch.sigmoid(z / cfg.discopop_tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _orpo(x: PairLogps, cfg: DPOLossConfig) -> torch.Tensor:
    log_odds = (x.chosen - x.rejected) - (_log1mexp(x.chosen) - _log1mexp(x.rejected))
    return -cfg.beta * F.logsigmoid(log_odds)


def _sft(x: PairLogps, cfg: DPOLossConfig) -> torch.Tensor:
    return (-x.policy_chosen.sum() / x.chosen_tokens.sum().clamp(min=1)).expand_as(x.policy_chosen)


class LossType(NamedTuple):
    per_pair: Callable[[PairLogps, DPOLossConfig], torch.Tensor]
    average: bool | None  # TRL's choice: per-token means (True) or sums; None: not a log-ratio loss (sft)


def _margin(fn: Callable[[torch.Tensor, DPOLossConfig], torch.Tensor]) -> Callable[[PairLogps, DPOLossConfig], torch.Tensor]:
    """A loss of h = c - r alone."""
    return lambda x, cfg: fn(x.chosen - x.rejected, cfg)


_sigmoid = _margin(lambda h, cfg: -F.logsigmoid(cfg.beta * h))
_ipo = _margin(lambda h, cfg: (h - 1 / (2 * cfg.beta)) ** 2)
_hinge = _margin(lambda h, cfg: torch.relu(1 - cfg.beta * h))
_cdpo = _margin(lambda h, cfg: _smoothed(cfg.beta * h, cfg.label_smoothing))
_simpo = _margin(lambda h, cfg: _smoothed(cfg.beta * (h - cfg.simpo_gamma / cfg.beta), cfg.label_smoothing))

LOSS_TYPES: dict[DPOLoss, LossType] = {
    DPOLoss.sigmoid: LossType(_sigmoid, average=False),
    DPOLoss.sigmoid_norm: LossType(_sigmoid, average=True),
    DPOLoss.hinge: LossType(_hinge, average=False),
    DPOLoss.ipo: LossType(_ipo, average=True),
    DPOLoss.exo_pair: LossType(_exo_pair, average=False),
    DPOLoss.nca_pair: LossType(
        lambda x, cfg: -F.logsigmoid(cfg.beta * x.chosen) - 0.5 * F.logsigmoid(-cfg.beta * x.chosen) - 0.5 * F.logsigmoid(-cfg.beta * x.rejected),
        average=False,
    ),
    DPOLoss.robust: LossType(_robust, average=False),
    DPOLoss.bco_pair: LossType(lambda x, cfg: -F.logsigmoid(cfg.beta * x.chosen) - F.logsigmoid(-cfg.beta * x.rejected), average=False),
    DPOLoss.sppo_hard: LossType(lambda x, cfg: (x.chosen - 0.5 / cfg.beta) ** 2 + (x.rejected + 0.5 / cfg.beta) ** 2, average=False),
    DPOLoss.aot: LossType(_aot, average=False),
    DPOLoss.aot_unpaired: LossType(_aot_unpaired, average=False),
    DPOLoss.apo_zero: LossType(lambda x, cfg: 1 - torch.sigmoid(cfg.beta * x.chosen) + torch.sigmoid(cfg.beta * x.rejected), average=False),
    DPOLoss.apo_down: LossType(
        lambda x, cfg: torch.sigmoid(cfg.beta * x.chosen) + 1 - torch.sigmoid(cfg.beta * (x.chosen - x.rejected)), average=False
    ),
    DPOLoss.discopop: LossType(_discopop, average=False),
    DPOLoss.sft: LossType(_sft, average=None),
    DPOLoss.cdpo: LossType(_cdpo, average=False),
    DPOLoss.cpo: LossType(_cdpo, average=False),
    DPOLoss.simpo: LossType(_simpo, average=True),
    DPOLoss.orpo: LossType(_orpo, average=True),
}


def _per_pair(name: DPOLoss, cfg: DPOLossConfig, logps: PairLogps) -> torch.Tensor:
    kind = LOSS_TYPES[name]
    x = logps.reference_free() if name in DPO_REFERENCE_FREE else logps
    average = kind.average if cfg.preference_average_log_probs is None or kind.average is None else cfg.preference_average_log_probs
    return kind.per_pair(x.averaged() if average else x, cfg)


def preference_loss(cfg: DPOLossConfig, logps: PairLogps) -> PreferenceLoss:
    """The loss and metrics of a batch of pairs."""
    weights = cfg.loss_weights or [1.0] * len(cfg.loss_type)
    preference = sum(w * _per_pair(DPOLoss(name), cfg, logps).mean() for name, w in zip(cfg.loss_type, weights, strict=True))
    chosen_nll = -(logps.policy_chosen / logps.chosen_tokens.clamp(min=1) if cfg.sft_average_log_probs else logps.policy_chosen)
    sft = chosen_nll.mean()
    x = logps.reference_free() if DPO_REFERENCE_FREE.intersection(map(DPOLoss, cfg.loss_type)) else logps
    chosen_reward, rejected_reward = cfg.beta * x.chosen.detach(), cfg.beta * x.rejected.detach()
    return PreferenceLoss(
        loss=cfg.preference_loss_weight * preference + cfg.sft_loss_weight * sft,
        preference_loss=preference.detach(),
        sft_loss=sft.detach(),
        reward_accuracy=(chosen_reward > rejected_reward).float().mean(),
        chosen_reward=chosen_reward.mean(),
        rejected_reward=rejected_reward.mean(),
        reward_margin=(chosen_reward - rejected_reward).mean(),
    )
