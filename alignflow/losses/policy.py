"""GRPO: group advantages and the clipped policy loss, as pure functions (NeMo-RL's knobs).

Advantages, per prompt group of `num_generations_per_prompt` rewards:
- baseline = the group mean, or with `use_rloo` the mean of the *other* members;
- advantage = reward - baseline; with `normalize_rewards` divided by the group's standard
  deviation (unbiased), except in zero-std groups, which keep their (zero-spread) advantages;
- with `overlong_filtering`, truncated samples still count in their group's baseline but get
  no gradient: `sample_mask` drops them from the loss.

Loss per token t of a sample with advantage A, r = exp(logp - old_logp):
  clip = max(-A r, -A clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max)), and with `ratio_clip_c`
  (dual clip, > 1) min(clip, -c A) where A < 0;
  kl = ref_policy_kl_penalty * k3, k3 = exp(ref - logp) - (ref - logp) - 1, weighted by the
  detached r with `use_on_policy_kl_approximation`;
  with `use_importance_sampling_correction`, (clip + kl) is weighted by the detached
  exp(old_logp - generation_logp) (training vs generation backend mismatch).
Averaging: `token_level_loss` averages over all unmasked tokens of the batch; otherwise each
sample's tokens are averaged first, then the samples.
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


def group_advantages(rewards: torch.Tensor, use_rloo: bool, normalize_rewards: bool) -> torch.Tensor:
    """[prompts, generations] rewards -> advantages of the same shape."""
    g = rewards.shape[-1]
    total = rewards.sum(-1, keepdim=True)
    baseline = (total - rewards) / (g - 1) if use_rloo else total / g
    advantages = rewards - baseline
    if normalize_rewards:
        std = rewards.std(-1, keepdim=True)
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
    """Token tensors are [samples, tokens]; `advantages` is [samples]; `mask` marks the
    response tokens that train (already zero for filtered samples)."""
    a = advantages[:, None]
    ratio = torch.exp(logp - old_logp)
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
    per_token = torch.maximum(unclipped, clipped)
    if cfg.ratio_clip_c is not None:
        per_token = torch.where(a < 0, torch.minimum(per_token, -cfg.ratio_clip_c * a), per_token)
    log_ratio_ref = ref_logp - logp
    k3 = torch.exp(log_ratio_ref) - log_ratio_ref - 1
    if cfg.use_on_policy_kl_approximation:
        k3 = ratio.detach() * k3
    per_token = per_token + cfg.ref_policy_kl_penalty * k3
    if cfg.use_importance_sampling_correction:
        if generation_logp is None:
            raise ValueError("grpo.use_importance_sampling_correction needs the generation log-probs")
        per_token = torch.exp(old_logp - generation_logp).detach() * per_token
    mask = mask.to(per_token.dtype)
    return PolicyLoss(
        loss=_average(per_token, mask, cfg.token_level_loss),
        kl=_average(k3.detach(), mask, True),
        clip_fraction=_average((clipped > unclipped).to(mask.dtype), mask, True),
        ratio=_average(ratio.detach(), mask, True),
    )


def _average(values: torch.Tensor, mask: torch.Tensor, token_level: bool) -> torch.Tensor:
    if token_level:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    per_sample = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    live = (mask.sum(-1) > 0).to(values.dtype)
    return (per_sample * live).sum() / live.sum().clamp(min=1)
