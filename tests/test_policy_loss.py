"""GRPO advantages and the clipped policy loss equal direct computations of their formulas."""

import itertools
import math
import random
import statistics

import pytest
import torch

from alignflow.config.schema import GRPOLossConfig
from alignflow.losses.policy import group_advantages, policy_loss


def direct_advantages(rewards, use_rloo, normalize):
    out = []
    for group in rewards:
        g, row = len(group), []
        std = statistics.stdev(group)
        for i, r in enumerate(group):
            baseline = (sum(group) - r) / (g - 1) if use_rloo else sum(group) / g
            a = r - baseline
            row.append(a / std if normalize and std > 0 else a)
        out.append(row)
    return out


@pytest.mark.parametrize("use_rloo,normalize", list(itertools.product([False, True], repeat=2)))
def test_advantages(use_rloo, normalize):
    rng = random.Random(1)
    rewards = [[rng.choice([0.0, 1.0, 0.5]) for _ in range(4)] for _ in range(6)] + [[1.0] * 4]  # last: zero std
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), use_rloo, normalize)
    expected = direct_advantages(rewards, use_rloo, normalize)
    assert [v for row in got.tolist() for v in row] == pytest.approx([v for row in expected for v in row], abs=1e-12)
    assert got[-1].abs().sum() == 0  # a group that agrees teaches nothing, and divides by nothing


def direct_loss(cfg, logp, old, ref, adv, mask, gen):
    per_sample_losses, all_terms, kls, clips, ratios = [], [], [], [], []
    for i in range(len(logp)):
        terms = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            a, r = adv[i], math.exp(logp[i][t] - old[i][t])
            unclipped, clipped = -a * r, -a * min(max(r, 1 - cfg.ratio_clip_min), 1 + cfg.ratio_clip_max)
            value = max(unclipped, clipped)
            if cfg.ratio_clip_c is not None and a < 0:
                value = min(value, -cfg.ratio_clip_c * a)
            d = ref[i][t] - logp[i][t]
            k3 = math.exp(d) - d - 1
            if cfg.use_on_policy_kl_approximation:
                k3 *= r
            value += cfg.ref_policy_kl_penalty * k3
            if cfg.use_importance_sampling_correction:
                value *= math.exp(old[i][t] - gen[i][t])
            terms.append(value)
            kls.append(k3)
            clips.append(float(clipped > unclipped))
            ratios.append(r)
        all_terms += terms
        if terms:
            per_sample_losses.append(sum(terms) / len(terms))
    loss = sum(all_terms) / len(all_terms) if cfg.token_level_loss else sum(per_sample_losses) / len(per_sample_losses)
    return {"loss": loss, "kl": sum(kls) / len(kls), "clip_fraction": sum(clips) / len(clips), "ratio": sum(ratios) / len(ratios)}


CONFIGS = [
    GRPOLossConfig(),
    GRPOLossConfig(ratio_clip_min=0.1, ratio_clip_max=0.28, ratio_clip_c=3.0),
    GRPOLossConfig(token_level_loss=False, ref_policy_kl_penalty=0.1),
    GRPOLossConfig(use_on_policy_kl_approximation=True),
    GRPOLossConfig(use_importance_sampling_correction=True, ratio_clip_c=2.0, token_level_loss=False),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "asym+dual-clip", "sequence-level+kl", "on-policy-kl", "is-correction"])
def test_policy_loss(cfg):
    rng = random.Random(0)
    samples, tokens = 6, 5
    logp = [[rng.uniform(-3, -0.1) for _ in range(tokens)] for _ in range(samples)]
    old = [[v + rng.uniform(-0.5, 0.5) for v in row] for row in logp]
    ref = [[v + rng.uniform(-0.3, 0.3) for v in row] for row in logp]
    gen = [[v + rng.uniform(-0.05, 0.05) for v in row] for row in old]
    adv = [rng.uniform(-2, 2) for _ in range(samples)]
    mask = [[1 if t < rng.randint(1, tokens) else 0 for t in range(tokens)] for _ in range(samples)]
    mask[2] = [0] * tokens  # an overlong-filtered sample: no gradient, no say in the average
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    got = policy_loss(cfg, t(logp), t(old), t(ref), t(adv), t(mask), t(gen))
    expected = direct_loss(cfg, logp, old, ref, adv, mask, gen)
    assert {k: getattr(got, k).item() for k in expected} == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_gradient_raises_the_probability_of_a_positive_advantage():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    policy_loss(GRPOLossConfig(ref_policy_kl_penalty=0.0), logp, logp.detach(), logp.detach(), torch.tensor([1.0]), torch.ones(1, 2)).loss.backward()
    assert (logp.grad < 0).all()
