"""GRPO: group advantages and the clipped policy loss, as pure functions, exactly as NeMo-RL
defines them (`calculate_baseline_and_std_per_prompt`, `ClippedPGLossFn`).

Advantages, per prompt group of `num_generations_per_prompt` rewards, over its valid samples:
- baseline = the group mean, or with `use_rloo` the mean of the *other* samples;
- std = the population std of the same samples (the others' with `use_rloo`);
- advantage = reward - baseline, divided by std with `normalize_rewards` where std > 0 (a
  group whose samples agree keeps its zero-spread advantages); a group with at most one valid
  sample gets advantage 0. With rewards [1, 0, 0, 0] and the defaults: [1, -0.707, -0.707, -0.707].

Loss of a token with advantage A, r = exp(logp - old_logp):
  actor = max(-A r, -A clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max)), and with
  `ratio_clip_c` (dual clip, > 1) min(actor, -c A) where A < 0; with
  `use_importance_sampling_correction` actor is weighted by exp(old_logp - generation_logp)
  (the training vs generation mismatch; the actor term only);
  kl = k3 = exp(ref - logp) - (ref - logp) - 1, weighted by exp(logp - generation_logp) with
  `use_on_policy_kl_approximation`;
  loss = mean(actor) + ref_policy_kl_penalty * mean(kl).
Averaging (`token_level_loss`): over all unmasked tokens of the batch, or each sample's tokens
first, then the samples; the metrics (kl, clip_fraction, ratio) average the same way.
"""

from dataclasses import dataclass

import torch

from alignflow.config.schema import GRPOLossConfig


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    ratio: torch.Tensor


def group_advantages(rewards: torch.Tensor, use_rloo: bool, normalize_rewards: bool, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[prompts, generations] rewards -> advantages of the same shape, as NeMo-RL's
    `calculate_baseline_and_std_per_prompt` and its normalisation define them: only `valid`
    samples enter a group's statistics; the baseline is the mean of the group's (other, with
    `use_rloo`) samples; the std is the population std of those same samples; a group with at
    most one valid sample gets baseline = reward (advantage 0); normalisation divides where std > 0."""
    v = torch.ones_like(rewards) if valid is None else valid.to(rewards.dtype)
    count = v.sum(-1, keepdim=True)
    sums, squares = (rewards * v).sum(-1, keepdim=True), (rewards.square() * v).sum(-1, keepdim=True)
    if use_rloo:  # leave each sample out of its own baseline and std
        sums, squares, count = sums - rewards * v, squares - rewards.square() * v, count - 1
    lonely = v.sum(-1, keepdim=True) <= 1
    baseline = torch.where(lonely, rewards, sums / count.clamp(min=1))
    mean_square = torch.where(lonely, torch.zeros_like(rewards), squares / count.clamp(min=1))
    std = (mean_square - baseline.square()).clamp(min=0).sqrt()
    advantages = rewards - baseline
    if normalize_rewards:
        advantages = torch.where(std > 0, advantages / std.clamp(min=1e-12), advantages)
    return advantages


def policy_loss(
    cfg: GRPOLossConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    generation_logp: torch.Tensor | None = None,
) -> PolicyLoss:
    """NeMo-RL's ClippedPGLossFn. Token tensors are [samples, tokens]; `advantages` is
    [samples]; `mask` marks the response tokens that train (already zero for filtered
    samples). The loss and the metrics average the same way: over every token of the batch
    (`token_level_loss`) or per sample, then over samples."""
    a = advantages[:, None]
    ratio = torch.exp(logp - old_logp)
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
    actor = torch.maximum(unclipped, clipped)
    if cfg.ratio_clip_c is not None:
        actor = torch.where(a < 0, torch.minimum(actor, -cfg.ratio_clip_c * a), actor)
    if cfg.use_importance_sampling_correction or cfg.use_on_policy_kl_approximation:
        if generation_logp is None:
            raise ValueError("grpo.loss.use_importance_sampling_correction / use_on_policy_kl_approximation need the generation log-probs")
    if cfg.use_importance_sampling_correction:  # the actor loss only, as NeMo-RL
        actor = torch.nan_to_num(torch.exp(old_logp - generation_logp).detach(), nan=0.0, posinf=0.0, neginf=0.0) * actor
    log_ratio_ref = ref_logp - logp
    k3 = torch.exp(log_ratio_ref) - log_ratio_ref - 1
    kl_weight = torch.ones_like(k3)
    if cfg.use_on_policy_kl_approximation:  # k3 under the sampling policy, reweighted to the current one
        kl_weight = torch.nan_to_num(torch.exp(logp - generation_logp).detach(), nan=0.0, posinf=0.0, neginf=0.0)
    mask, token_level = mask.to(actor.dtype), cfg.token_level_loss
    loss = _average(actor, mask, token_level) + cfg.ref_policy_kl_penalty * _average(kl_weight * k3, mask, token_level)
    return PolicyLoss(
        loss=loss,
        kl=_average(k3.detach(), mask, token_level),
        clip_fraction=_average((clipped > unclipped).to(mask.dtype), mask, token_level),
        ratio=_average(ratio.detach(), mask, token_level),
    )


def _average(values: torch.Tensor, mask: torch.Tensor, token_level: bool) -> torch.Tensor:
    """Over every masked token, or per sample and then over the samples with any token."""
    if token_level:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    per_sample = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    live = (mask.sum(-1) > 0).to(values.dtype)
    return (per_sample * live).sum() / live.sum().clamp(min=1)
