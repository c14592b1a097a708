"""One rank of test_policy_loss's two-process test (torchrun, gloo): rank r holds micro batches
of the samples 2r and 2r + 1 (6 + 5 and 4 + 3 tokens); the engine's contract (sum loss x units
over micro batches, all-reduce the gradients and the units, divide) must give TRL's gradient
of the one big batch of 4 samples (bnpo: the mean of TRL's micro batch losses, as TRL's
gradient accumulation over 2 processes computes it)."""

import sys

import torch
import torch.distributed as dist

from alignflow.orchestrator.config.schema import GRPOLossConfig
from alignflow.job.losses.policy import policy_loss
from test_policy_loss import random_batch, trl_loss


def check(loss_type: str, rank: int) -> None:
    logp, old, ref, advantages, mask = random_batch(2)
    cfg = GRPOLossConfig(loss_type=loss_type, ref_policy_kl_penalty=0.04, ratio_clip_max=0.28)
    weights = logp.clone().requires_grad_(True)  # stands for the parameters: each sample's log-probs
    total, units = 0.0, torch.zeros((), dtype=torch.float64)
    for i in (2 * rank, 2 * rank + 1):  # this rank's micro batches, one sample each
        rows = slice(i, i + 1)
        out = policy_loss(cfg, weights[rows], old[rows], ref[rows], advantages[rows], mask[rows], max_completion_length=8)
        total, units = total + out.loss * out.units, units + out.units
    total.backward()
    dist.all_reduce(weights.grad)
    dist.all_reduce(units)
    grad = weights.grad / units

    big = logp.clone().requires_grad_(True)
    if loss_type == "bnpo":  # TRL normalises bnpo per micro batch, then averages the micro batches
        reference = (
            sum(
                trl_loss("bnpo", big[i : i + 1], old[i : i + 1], ref[i : i + 1], advantages[i : i + 1], mask[i : i + 1], beta=0.04, epsilon_high=0.28)
                for i in range(4)
            )
            / 4
        )
    else:
        reference = trl_loss(loss_type, big, old, ref, advantages, mask, beta=0.04, epsilon_high=0.28)
    reference.backward()
    k3 = (ref - logp).exp() - (ref - logp) - 1  # NeMo-RL's KL score term, which TRL's gradient lacks: added back
    norm = {"dapo": mask.sum(), "dr_grpo": 4 * 8, "grpo": 4 * mask.sum(-1, keepdim=True), "bnpo": 4 * mask.sum(-1, keepdim=True)}[loss_type]
    expected = big.grad + 0.04 * k3 * mask / norm
    assert torch.allclose(grad, expected, atol=1e-12), (grad, expected)
    print(f"rank {rank} {loss_type} equal", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for name in sys.argv[1:]:
        check(name, dist.get_rank())
    dist.destroy_process_group()
