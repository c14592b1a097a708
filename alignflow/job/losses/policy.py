"""GRPO and its family (Dr. GRPO, DAPO, GSPO, BNPO): group advantages and the clipped policy
loss, as pure functions. The numerics are NeMo-RL v0.7.0's (`nemo_rl/algorithms/utils.py`:
`calculate_baseline_and_std_per_prompt`, `calculate_kl`; `nemo_rl/algorithms/loss/
loss_functions.py`: `ClippedPGLossFn`); `loss_type` and `importance_sampling_level` are TRL
1.16's (`GRPOTrainer._compute_loss`).

Advantages, per prompt group of rewards, over its valid samples:
- baseline = the group mean, or with `use_rloo` the mean of the *other* samples;
- std = the sample std (n - 1) of the same samples (NeMo-RL >= v0.5.0; the others' with `use_rloo`);
- advantage = reward - baseline, divided by std + 1e-6 with `normalize_rewards` where std > 0 (a
  group whose samples agree keeps its zero advantages); a group with at most one valid sample
  gets advantage 0. With rewards [1, 0, 0, 0] and the defaults: [1, -0.577, -0.577, -0.577].
  Samples that agree to the last bit have std 0 by test, not by arithmetic: NeMo-RL's
  E[x^2] - E[x]^2 of equal rewards that are not round numbers (exact match plus a reward
  model's score) leaves a rounding residue, a std of ~1e-8, and the one sample that differs
  from them would get an advantage of ~1e6 instead of its difference.

Loss of token t of a sample with advantage A:
  r = exp(logp - old_logp), or with `importance_sampling_level: sequence` (GSPO) one r per
  sample, exp(token mean of logp - old_logp);
  actor = max(-A r, -A clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max)), with `ratio_clip_c`
  (dual clip, > 1) min(actor, -c A) where A < 0, and with `use_importance_sampling_correction`
  weighted by exp(old_logp - generation_logp) (per sample: exp of the sum, at sequence level),
  capped at `truncated_importance_sampling_ratio` (TIS) when set;
  kl = w k(clamp(ref - logp, +-kl_input_clamp_value)), clamped to +-kl_output_clamp_value, k the
  `kl_type` estimator; w = exp(logp - sg(logp)) (value 1: its gradient adds k's score-function
  term, NeMo-RL v0.7.0 "fix: KL backward"), or exp(logp - generation_logp) with
  `use_on_policy_kl_approximation`; w is detached where the input clamp bites;
  loss = reduce(actor) + ref_policy_kl_penalty * reduce(kl).
With top_k / top_p sampling logp, old_logp and generation_logp are log-probs under the filtered,
renormalised distribution and the KL reads the unfiltered `logp_unfiltered` (the reference's
log-probs are unfiltered), as NeMo-RL v0.6.0.
`reduce` is the `loss_type`'s (see `PolicyLossType`); the metrics kl, clip_fraction and ratio
are token means (sample means under `grpo`); token_mult_prob_error, NeMo-RL's mean over the
micro batch's tokens of exp|old_logp - generation_logp|, says how far the sampler's log-probs
are from the trainer's (1 when they agree).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from alignflow.orchestrator.config.schema import GRPOLossConfig, ImportanceSamplingLevel, KLEstimator, PolicyLossType

STD_EPSILON = 1e-6
KL_ESTIMATORS = {  # of log r = ref - logp (Schulman, "Approximating KL divergence")
    KLEstimator.k1: lambda log_r: -log_r,
    KLEstimator.k2: lambda log_r: log_r.square() / 2,
    KLEstimator.k3: lambda log_r: log_r.exp() - 1 - log_r,
}


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor
    units: torch.Tensor  # the micro batch's weight in the step's mean: what `loss` was divided by
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    ratio: torch.Tensor
    token_mult_prob_error: torch.Tensor  # token mean of exp|old_logp - generation_logp|: 1 when trainer and sampler agree


def group_baseline_and_std(
    rewards: torch.Tensor, use_rloo: bool, valid: Optional[torch.Tensor] = None, std_rewards: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[prompts, generations] rewards -> each sample's baseline and std, as NeMo-RL's
    `calculate_baseline_and_std_per_prompt`: over the group's `valid` samples (the others, with
    `use_rloo`, counted as valid - 1 for every sample); the std is the sample std of
    `std_rewards` (default: the rewards); a group with at most one valid sample gets
    baseline = reward and std 0."""
    v = torch.ones_like(rewards) if valid is None else valid.to(rewards.dtype)

    def others_sum(values: torch.Tensor) -> torch.Tensor:
        total = (values * v).sum(-1, keepdim=True)
        return total - values * v if use_rloo else total.expand_as(values)

    count = v.sum(-1, keepdim=True) - int(use_rloo)
    lonely = v.sum(-1, keepdim=True) <= 1
    n = count.clamp(min=1)
    baseline = torch.where(lonely, rewards, others_sum(rewards) / n)
    spread = rewards if std_rewards is None else std_rewards
    variance = others_sum(spread.square()) / n - (others_sum(spread) / n).square()
    std = (variance.clamp(min=0) * n / (n - 1).clamp(min=1)).sqrt()
    return baseline, torch.where(lonely | (count <= 1) | _others_agree(spread, v, use_rloo), torch.zeros_like(std), std)


def _others_agree(values: torch.Tensor, v: torch.Tensor, use_rloo: bool) -> torch.Tensor:
    """Whether the valid samples each sample's std is taken over are all equal."""
    g = values.shape[-1]
    counts = v[..., None, :].bool().expand(*values.shape, g)  # [..., i, j]: j is among i's samples
    if use_rloo:
        counts = counts & ~torch.eye(g, dtype=torch.bool, device=values.device)
    x = values[..., None, :].expand_as(counts)
    return torch.where(counts, x, math.inf).amin(-1) == torch.where(counts, x, -math.inf).amax(-1)


def group_advantages(
    rewards: torch.Tensor, use_rloo: bool, normalize_rewards: bool, valid: Optional[torch.Tensor] = None, std_rewards: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """[prompts, generations] rewards -> advantages: reward - baseline, over std + 1e-6 where
    std > 0 with `normalize_rewards` (NeMo-RL's GRPOAdvantageEstimator)."""
    baseline, std = group_baseline_and_std(rewards, use_rloo, valid, std_rewards)
    advantages = rewards - baseline
    if normalize_rewards:
        advantages = torch.where(std > 0, advantages / (std + STD_EPSILON), advantages)
    return advantages


def kl_penalty(cfg: GRPOLossConfig, logp: torch.Tensor, ref_logp: torch.Tensor, generation_logp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token KL to the reference as NeMo-RL's `calculate_kl` with ClippedPGLossFn's weights."""
    weight = torch.exp(logp - (generation_logp if cfg.use_on_policy_kl_approximation else logp.detach()))
    weight = torch.nan_to_num(weight, nan=0.0, posinf=0.0, neginf=0.0)
    log_r = ref_logp - logp
    if cfg.kl_input_clamp_value is not None:
        clamped = log_r.clamp(-cfg.kl_input_clamp_value, cfg.kl_input_clamp_value)
        weight = torch.where(log_r == clamped, weight, weight.detach())
        log_r = clamped
    kl = weight * KL_ESTIMATORS[cfg.kl_type](log_r)
    if cfg.kl_output_clamp_value is not None:
        kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return kl


def policy_loss(
    cfg: GRPOLossConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    generation_logp: Optional[torch.Tensor] = None,
    logp_unfiltered: Optional[torch.Tensor] = None,
    max_completion_length: Optional[int] = None,
) -> PolicyLoss:
    """The clipped policy loss of a micro batch (see the module). Token tensors are [samples,
    tokens]; `advantages` is [samples] (or [samples, tokens]); `mask` marks the response
    tokens that train (already zero for filtered samples); `logp_unfiltered` (default `logp`)
    feeds the KL; `max_completion_length` is dr_grpo's constant."""
    needs_generation = cfg.use_importance_sampling_correction or (cfg.use_on_policy_kl_approximation and cfg.kl_type != KLEstimator.none)
    if needs_generation and generation_logp is None:
        raise ValueError("grpo.loss.use_importance_sampling_correction / use_on_policy_kl_approximation need the generation log-probs")
    mask = mask.to(logp.dtype)
    a = advantages[:, None] if advantages.dim() == 1 else advantages
    sequence_level = cfg.importance_sampling_level == ImportanceSamplingLevel.sequence
    log_ratio = logp - old_logp
    if sequence_level:
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio).expand_as(logp)
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
    actor = torch.maximum(unclipped, clipped)
    if cfg.ratio_clip_c is not None:
        actor = torch.where(a < 0, torch.minimum(actor, -cfg.ratio_clip_c * a), actor)
    if cfg.use_importance_sampling_correction:  # the actor term only, as NeMo-RL
        log_weight = old_logp - generation_logp
        if sequence_level:
            log_weight = (log_weight * mask).sum(-1, keepdim=True)
        weight = torch.exp(log_weight).detach()
        if cfg.truncated_importance_sampling_ratio is not None:
            weight = weight.clamp(max=cfg.truncated_importance_sampling_ratio)
        actor = torch.nan_to_num(weight, nan=0.0, posinf=0.0, neginf=0.0) * actor
    reduce = lambda values: _reduce(values, mask, cfg.loss_type, max_completion_length)  # noqa: E731
    per_sample = PolicyLossType.grpo if cfg.loss_type == PolicyLossType.grpo else PolicyLossType.dapo
    mean = lambda values: _reduce(values.detach(), mask, per_sample, None)  # noqa: E731  the metrics'
    loss, kl = reduce(actor), torch.zeros((), dtype=logp.dtype, device=logp.device)
    if cfg.kl_type != KLEstimator.none:
        per_token = kl_penalty(cfg, logp if logp_unfiltered is None else logp_unfiltered, ref_logp, generation_logp)
        loss, kl = loss + cfg.ref_policy_kl_penalty * reduce(per_token), mean(per_token)
    return PolicyLoss(
        loss=loss,
        units=loss_units(cfg.loss_type, mask, max_completion_length),
        kl=kl,
        clip_fraction=mean((clipped > unclipped).to(mask.dtype)),
        ratio=mean(ratio),
        token_mult_prob_error=torch.ones_like(kl)
        if generation_logp is None
        else _reduce(torch.exp((old_logp - generation_logp).abs() * mask), mask, PolicyLossType.dapo, None),  # a token mean, as NeMo-RL's
    )


def loss_units(loss_type: PolicyLossType, mask: torch.Tensor, max_completion_length: Optional[int]) -> torch.Tensor:
    """What a micro batch's loss is a mean over, so that summing loss x units over the micro
    batches of a step and dividing by the summed units gives TRL's reduction: its tokens (dapo),
    its samples with any token (grpo), 1 (bnpo: the mean of micro batch means), samples x
    max_completion_length (dr_grpo)."""
    if loss_type == PolicyLossType.dapo:
        return mask.sum().to(torch.int64)
    if loss_type == PolicyLossType.grpo:
        return (mask.sum(-1) > 0).sum()
    if loss_type == PolicyLossType.bnpo:
        return torch.ones((), dtype=torch.int64, device=mask.device)
    if max_completion_length is None:
        raise ValueError("grpo.loss.loss_type: dr_grpo needs max_completion_length (grpo.max_new_tokens)")
    return torch.tensor(mask.shape[0] * max_completion_length, device=mask.device)


def _reduce(values: torch.Tensor, mask: torch.Tensor, loss_type: PolicyLossType, max_completion_length: Optional[int]) -> torch.Tensor:
    """The micro batch's mean of per-token `values` under `loss_type` (see `loss_units`)."""
    if loss_type == PolicyLossType.grpo:
        return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / (mask.sum(-1) > 0).sum().clamp(min=1)
    if loss_type == PolicyLossType.dr_grpo:
        return (values * mask).sum() / loss_units(loss_type, mask, max_completion_length)
    return (values * mask).sum() / mask.sum().clamp(min=1)
