"""The DPO-family losses equal a direct computation of their formulas on random log-probs."""

import math
import random

import pytest
import torch

from alignflow.config.schema import DPOLossConfig
from alignflow.losses.preference import preference_loss, sequence_logps


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def direct(cfg: DPOLossConfig, pc, pr, rc, rr, nll) -> dict:
    """The formulas, pair by pair, in plain Python floats."""
    losses, rewards = [], []
    for a, b, c, d in zip(pc, pr, rc, rr):
        h = (a - b) - (c - d)
        if cfg.loss_type == "sigmoid":
            losses.append(-(1 - cfg.label_smoothing) * log_sigmoid(cfg.beta * h) - cfg.label_smoothing * log_sigmoid(-cfg.beta * h))
        else:
            losses.append((h - 1 / (2 * cfg.beta)) ** 2)
        rewards.append((cfg.beta * (a - c), cfg.beta * (b - d)))
    n = len(losses)
    preference, sft = sum(losses) / n, sum(nll) / n
    return {
        "loss": cfg.preference_loss_weight * preference + cfg.sft_loss_weight * sft,
        "preference_loss": preference,
        "sft_loss": sft,
        "reward_accuracy": sum(c > r for c, r in rewards) / n,
        "chosen_reward": sum(c for c, _ in rewards) / n,
        "rejected_reward": sum(r for _, r in rewards) / n,
        "reward_margin": sum(c - r for c, r in rewards) / n,
    }


@pytest.mark.parametrize(
    "cfg",
    [
        DPOLossConfig(loss_type="sigmoid", beta=0.1),
        DPOLossConfig(loss_type="sigmoid", beta=0.5, label_smoothing=0.2),
        DPOLossConfig(loss_type="ipo", beta=0.3),
        DPOLossConfig(loss_type="sigmoid", beta=0.2, sft_loss_weight=0.7, preference_loss_weight=0.5),
        DPOLossConfig(loss_type="ipo", beta=1.0, sft_loss_weight=1.0),
    ],
    ids=["dpo", "cdpo", "ipo", "dpo+sft", "ipo+sft"],
)
def test_losses_and_metrics_equal_direct_formulas(cfg):
    rng = random.Random(0)
    values = [[rng.uniform(-60, -5) for _ in range(16)] for _ in range(4)]
    nll = [rng.uniform(0.5, 40) for _ in range(16)]
    tensors = [torch.tensor(v, dtype=torch.float64) for v in values]
    got = preference_loss(cfg, *tensors, chosen_nll=torch.tensor(nll, dtype=torch.float64)).metrics()
    expected = direct(cfg, *values, nll)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_gradient_pushes_chosen_up_and_rejected_down():
    pc, pr = torch.tensor([-10.0], requires_grad=True), torch.tensor([-9.0], requires_grad=True)
    preference_loss(DPOLossConfig(), pc, pr, torch.tensor([-10.0]), torch.tensor([-9.0])).loss.backward()
    assert pc.grad.item() < 0 < pr.grad.item()


def test_sequence_logps_sum_or_average_over_masked_tokens():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert sequence_logps(logps, mask, average=False).tolist() == [-5.0, -4.0]
    assert sequence_logps(logps, mask, average=True).tolist() == [-2.5, -4.0]


def test_unknown_loss_type_names_the_key():
    with pytest.raises(ValueError, match="dpo.loss.loss_type"):
        preference_loss(DPOLossConfig(loss_type="hinge"), *[torch.zeros(2)] * 4)
