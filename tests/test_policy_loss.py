"""GRPO advantages and the clipped policy loss on worked examples of NeMo-RL's definitions
(`calculate_baseline_and_std_per_prompt` with its normalisation, `ClippedPGLossFn`); every
expected number is worked out by hand in the comment beside it."""

import math

import pytest
import torch

from alignflow.config.schema import GRPOLossConfig
from alignflow.losses.policy import group_advantages, policy_loss
from alignflow.stages.grpo import grpo_objective

SQRT_HALF = math.sqrt(0.5)


@pytest.mark.parametrize("rewards, use_rloo, normalize, expected", [
    # leave-one-out: sample 0's others are [0, 0, 0] (baseline 0, std 0: not divided) -> 1;
    # sample 1's others are [1, 0, 0]: baseline 1/3, std sqrt(1/3 - 1/9) = sqrt(2)/3 -> (-1/3) / (sqrt(2)/3) = -1/sqrt(2)
    ([1.0, 0.0, 0.0, 0.0], True, True, [1.0, -SQRT_HALF, -SQRT_HALF, -SQRT_HALF]),
    # whole group: mean 1/4, population std sqrt(1/4 - 1/16) = sqrt(3)/4 -> 3/4 / (sqrt(3)/4) = sqrt(3), -1/sqrt(3)
    ([1.0, 0.0, 0.0, 0.0], False, True, [math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]),
    # leave-one-out without normalisation: baselines 0, 1/3, 1/3, 1/3
    ([1.0, 0.0, 0.0, 0.0], True, False, [1.0, -1 / 3, -1 / 3, -1 / 3]),
    # rewards 2, 4, 6: mean 4, population std sqrt((4 + 0 + 4) / 3) = sqrt(8/3)
    ([2.0, 4.0, 6.0], False, True, [-2 / math.sqrt(8 / 3), 0.0, 2 / math.sqrt(8 / 3)]),
    # others of 2 are [4, 6]: baseline 5, std 1 -> -3; of 4: [2, 6]: 4, std 2 -> 0; of 6: [2, 4]: 3, std 1 -> 3
    ([2.0, 4.0, 6.0], True, True, [-3.0, 0.0, 3.0]),
    # a group that agrees teaches nothing and divides by nothing
    ([1.0, 1.0, 1.0, 1.0], True, True, [0.0, 0.0, 0.0, 0.0]),
])
def test_advantages_are_nemo_rls(rewards, use_rloo, normalize, expected):
    got = group_advantages(torch.tensor([rewards], dtype=torch.float64), use_rloo, normalize)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-12)


def test_invalid_samples_stay_out_of_their_groups_statistics():
    # valid [1, 1, 0, 0], leave-one-out: sample 0's only valid other is sample 1 (reward 0): baseline 0, std 0 -> 1;
    # sample 1's is sample 0 (reward 1) -> -1; the invalid samples 2 and 3 see both valid ones over one: baseline 1 -> 0, -1
    got = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), True, True, valid=torch.tensor([[1, 1, 0, 0]]))
    assert got[0].tolist() == pytest.approx([1.0, -1.0, 0.0, -1.0])
    # a group with one valid sample: baseline = reward, so no advantage at all
    assert group_advantages(torch.tensor([[1.0, 0.0]]), True, True, valid=torch.tensor([[1, 0]]))[0].tolist() == [0.0, 0.0]


def loss_of(cfg, logp, old, ref, advantage, gen=None, mask=None):
    t = lambda values: torch.log(torch.tensor([values], dtype=torch.float64))  # noqa: E731  probabilities -> log-probs
    return policy_loss(cfg, t(logp), t(old), t(ref), torch.tensor([advantage], dtype=torch.float64),
                       torch.ones(1, len(logp)) if mask is None else mask, None if gen is None else t(gen))


@pytest.mark.parametrize("cfg, probs, advantage, expected_loss, expected_clip", [
    # r = 0.6 / 0.5 = 1.2, inside [0.8, 1.2]: -A r = -1.2
    (GRPOLossConfig(ref_policy_kl_penalty=0.0), (0.6, 0.5, 0.6), 1.0, -1.2, 0.0),
    # r = 0.75 / 0.5 = 1.5 clamped to 1.2: max(-1.5, -1.2) = -1.2, clipped
    (GRPOLossConfig(ref_policy_kl_penalty=0.0), (0.75, 0.5, 0.75), 1.0, -1.2, 1.0),
    # A = -1, r = 0.5 clamped to 0.8: max(0.5, 0.8) = 0.8
    (GRPOLossConfig(ref_policy_kl_penalty=0.0), (0.25, 0.5, 0.25), -1.0, 0.8, 1.0),
    # A = -1, r = 5: max(5, 1.2) = 5; the dual clip c = 3 caps it: min(5, 3) = 3
    (GRPOLossConfig(ref_policy_kl_penalty=0.0, ratio_clip_c=3.0), (0.5, 0.1, 0.5), -1.0, 3.0, 0.0),
    # asymmetric clip 0.1 / 0.28: r = 1.5 clamped to 1.28 -> -1.28
    (GRPOLossConfig(ref_policy_kl_penalty=0.0, ratio_clip_min=0.1, ratio_clip_max=0.28), (0.75, 0.5, 0.75), 1.0, -1.28, 1.0),
    # KL: ref - logp = log(0.25 / 0.5) = -ln 2, k3 = 0.5 + ln 2 - 1 = 0.193147; r = 1 -> -1 + 0.1 * 0.193147
    (GRPOLossConfig(ref_policy_kl_penalty=0.1), (0.5, 0.5, 0.25), 1.0, -1 + 0.1 * (math.log(2) - 0.5), 0.0),
])
def test_clipped_loss_is_nemo_rls(cfg, probs, advantage, expected_loss, expected_clip):
    out = loss_of(cfg, [probs[0]], [probs[1]], [probs[2]], advantage)
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-9)
    assert out.clip_fraction.item() == expected_clip


def test_importance_sampling_weights_the_actor_term_only():
    # old / generation = 0.5 / 0.25 = 2 weights the actor (-1 at r = 1) to -2; the KL term (0.1 * 0.193147) is not weighted
    cfg = GRPOLossConfig(ref_policy_kl_penalty=0.1, use_importance_sampling_correction=True)
    out = loss_of(cfg, [0.5], [0.5], [0.25], 1.0, gen=[0.25])
    assert out.loss.item() == pytest.approx(-2 + 0.1 * (math.log(2) - 0.5), abs=1e-9)


def test_on_policy_kl_approximation_weights_the_kl_by_current_over_generation():
    # logp / generation = 0.5 / 0.25 = 2 weights k3 = 0.193147; the actor (-1 at r = 1) is not weighted
    cfg = GRPOLossConfig(ref_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True)
    out = loss_of(cfg, [0.5], [0.5], [0.25], 1.0, gen=[0.25])
    assert out.loss.item() == pytest.approx(-1 + 0.1 * 2 * (math.log(2) - 0.5), abs=1e-9)


def test_sequence_level_loss_and_metrics_average_per_sample_first():
    """Sample 0: one token at r = 1.2, A = 1 (actor -1.2); sample 1: three tokens at r = 1, A = 0 (actor 0).
    Token level: (-1.2 + 0) / 4 tokens = -0.3, ratio (1.2 + 3) / 4 = 1.05.
    Sample level: (-1.2 + 0) / 2 samples = -0.6, ratio (1.2 + 1) / 2 = 1.1."""
    logp = torch.log(torch.tensor([[0.6, 1.0, 1.0], [0.5, 0.5, 0.5]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.5, 1.0, 1.0], [0.5, 0.5, 0.5]], dtype=torch.float64))
    mask, advantages = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), torch.tensor([1.0, 0.0], dtype=torch.float64)
    for token_level, loss, ratio in ((True, -0.3, 1.05), (False, -0.6, 1.1)):
        out = policy_loss(GRPOLossConfig(ref_policy_kl_penalty=0.0, token_level_loss=token_level), logp, old, logp, advantages, mask)
        assert (out.loss.item(), out.ratio.item()) == pytest.approx((loss, ratio))


@pytest.mark.parametrize("token_level", [True, False])
def test_step_metrics_are_per_unit_of_the_loss(token_level):
    """The objective sums metrics over its units (tokens or samples) as it sums the loss, so a
    step's ratio at the sampling policy is 1, whatever the number of tokens per sample."""
    objective = grpo_objective(GRPOLossConfig(token_level_loss=token_level))
    nll = torch.full((2, 8), 0.7)
    batch = {"loss_mask": torch.ones(2, 8), "advantages": torch.tensor([1.0, -1.0]), "generation_logp": -nll,
             "old_logp": -nll, "ref_logp": -nll}
    terms = objective.loss(nll, batch)
    assert terms.count.item() == (16 if token_level else 2)
    assert (terms.metrics["ratio"] / terms.count).item() == pytest.approx(1.0)
    assert (terms.metrics["kl"] / terms.count).item() == pytest.approx(0.0)
