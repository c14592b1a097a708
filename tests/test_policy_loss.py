"""GRPO's advantages and policy loss against their references, values and gradients:
- NeMo-RL v0.7.0 (github.com/NVIDIA-NeMo/RL, tag v0.7.0, tests at 7ea279a): the numbers of its unit
  tests `tests/unit/algorithms/test_utils.py` (calculate_baseline_and_std_per_prompt) and
  `tests/unit/algorithms/test_loss_functions.py` (calculate_kl, ClippedPGLossFn), carried over;
- TRL 1.16 (installed): `GRPOTrainer._compute_loss` and `get_soft_overlong_punishment` run on
  the same tensors as ours."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ranks import run_ranks

from alignflow.orchestrator.config.schema import GRPOLossConfig
from alignflow.job.generation import Sampling
from alignflow.job.losses.policy import group_advantages, group_baseline_and_std, kl_penalty, policy_loss
from alignflow.job.stages.grpo import grpo_objective, overlong_penalty

NO_KL = dict(ref_policy_kl_penalty=0.0)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


# ----------------------------------------------------------------------------- NeMo-RL's numbers


@pytest.mark.parametrize(
    "rewards, valid, baseline, std",
    [
        # test_calculate_baseline_and_std_per_prompt_basic (leave-one-out, the default)
        ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], None, [2.5, 2.0, 1.5, 5.5, 5.0, 4.5], [0.707107, 1.414214, 0.707107] * 2),
        # ..._single_generation_per_prompt: baseline = reward, std 0
        ([[2.5], [4.0]], None, [2.5, 4.0], [0.0, 0.0]),
        # ..._identical_rewards
        ([[3.0, 3.0, 3.0], [7.0, 7.0, 7.0]], None, [3.0, 3.0, 3.0, 7.0, 7.0, 7.0], [0.0] * 6),
        # ..._nan_handling: the second sample is invalid (its 999 never enters a statistic)
        ([[1.0, 999.0, 3.0], [4.0, 5.0, 6.0]], [[1, 0, 1], [1, 1, 1]], [3.0, 4.0, 1.0, 5.5, 5.0, 4.5], [0.0, 0.0, 0.0, 0.707107, 1.414214, 0.707107]),
    ],
)
def test_baseline_and_std_are_nemo_rls(rewards, valid, baseline, std):
    got_baseline, got_std = group_baseline_and_std(torch.tensor(rewards), True, None if valid is None else torch.tensor(valid))
    assert got_baseline.flatten().tolist() == pytest.approx(baseline, rel=1e-5)
    assert got_std.flatten().tolist() == pytest.approx(std, rel=1e-5, abs=1e-7)


def test_advantages_use_the_sample_std_plus_epsilon():
    """The issue's worked example: today's NeMo-RL gives [1, -0.577, -0.577, -0.577] for rewards
    [1, 0, 0, 0] with its defaults (leave-one-out, normalised); NeMo-RL v0.3 gave -0.707."""
    got = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64), True, True)[0].tolist()
    assert got == pytest.approx([1.0, -0.5773483, -0.5773483, -0.5773483], abs=1e-6)
    assert got[1] == pytest.approx(-(1 / 3) / (1 / math.sqrt(3) + 1e-6), abs=1e-12)  # std + 1e-6, not std


def test_samples_that_agree_have_no_spread_however_their_rewards_round():
    """NeMo-RL's definition evaluated exactly (`statistics`: exact sums): seven samples that agree
    on an exact-match reward plus a reward model's score (no round number) and one that differs.
    Their leave-one-out std is 0, so the one that differs keeps its difference; E[x^2] - E[x]^2 in
    floating point left a residue there, and advantages of 1.9e6 (2.9e6 for other such rewards)."""
    import statistics

    agree, differs = 1.6561265468597413, -0.33372972011566165  # 1 + 0.2 x a float32 score; 0.2 x another
    for rewards in ([agree] * 7 + [differs], [differs] + [agree] * 7, [0.1 * k + 0.7 for k in range(8)]):
        expected = []
        for i, r in enumerate(rewards):
            others = rewards[:i] + rewards[i + 1 :]
            baseline, std = statistics.fmean(others), statistics.stdev(others)
            expected.append((r - baseline) / (std + 1e-6) if std > 0 else r - baseline)
        got = group_advantages(torch.tensor([rewards], dtype=torch.float64), True, True)[0].tolist()
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    "kl_type, unclamped, clamped",
    [  # test_calculate_kl
        ("k1", [-1.0, 14.0, 29.0], [-1.0, 10.0, 10.0]),
        ("k2", [0.5, 98.0, 420.5], [0.5, 10.0, 10.0]),
        ("k3", [0.7183, 13.0, 28.0], [0.7183, 10.0, 10.0]),
    ],
)
def test_kl_estimators_and_clamps_are_nemo_rls(kl_type, unclamped, clamped):
    logp, ref = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-0.0, -15.0, -30.0]])
    free = GRPOLossConfig(kl_type=kl_type, kl_input_clamp_value=None, kl_output_clamp_value=None)
    assert kl_penalty(free, logp, ref).flatten().tolist() == pytest.approx(unclamped, rel=1e-3)
    assert kl_penalty(GRPOLossConfig(kl_type=kl_type), logp, ref).flatten().tolist() == pytest.approx(clamped, rel=1e-3)  # defaults 20 / 10


def test_input_clamp_detaches_the_kl_weight():
    """test_calculate_kl_detaches_importance_sampling_when_input_clamped: input clamp 2."""
    logp = torch.tensor([[-3.0, -1.0]], requires_grad=True)
    kl = kl_penalty(GRPOLossConfig(kl_input_clamp_value=2.0, kl_output_clamp_value=None), logp, torch.zeros(1, 2))
    assert kl.detach().flatten().tolist() == pytest.approx([4.389056, 0.7182818], rel=1e-6)
    kl.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -1.0], abs=1e-6)


def test_output_clamp_applies_after_the_weight_and_blocks_its_gradient():
    """test_calculate_kl_output_clamp_includes_importance_sampling_weight: a weight of 100 (here
    exp(logp - generation_logp)), output clamp 1 -> KL 1, gradient 0."""
    logp = torch.tensor([[-1.0]], requires_grad=True)
    cfg = GRPOLossConfig(use_on_policy_kl_approximation=True, kl_input_clamp_value=None, kl_output_clamp_value=1.0)
    kl = kl_penalty(cfg, logp, torch.zeros(1, 1), generation_logp=torch.tensor([[-1.0 - math.log(100.0)]]))
    assert kl.item() == pytest.approx(1.0)
    kl.sum().backward()
    assert logp.grad.item() == 0.0


def nemo_batch(curr, prev, advantages, ref=None, gen=None):
    """One sample of NeMo-RL's test tensors (the masked positions), all tokens trained."""
    t = lambda values: torch.tensor([values], dtype=torch.float64)  # noqa: E731
    return dict(
        logp=t(curr).requires_grad_(True),
        old_logp=t(prev),
        ref_logp=t(ref if ref is not None else prev),
        advantages=t(advantages),
        mask=torch.ones(1, len(curr)),
        generation_logp=None if gen is None else t(gen),
    )


@pytest.mark.parametrize(
    "cfg, curr, prev, advantages, expected",
    [
        # test_clipped_pg_loss_ppo_clipping: ratios 0.5, 1, 1.5 -> max losses -0.5, 1, -2.4
        (GRPOLossConfig(**NO_KL), [math.log(0.5) - 1, -1.0, math.log(1.5) - 1], [-1.0] * 3, [1.0, -1.0, 2.0], -0.6333),
        # test_clipped_pg_loss_dual_clip: ratios 0.5, 1, 10, c = 3 -> -0.5, 1, 12
        (GRPOLossConfig(ratio_clip_c=3.0, **NO_KL), [math.log(0.5) - 1, -1.0, math.log(10.0) - 3], [-1.0, -1.0, -3.0], [1.0, -1.0, -4.0], 4.1667),
        # test_clipped_pg_loss_gspo: one ratio, exp(mean log-ratio) = 0.9086, sequence-level loss
        (
            GRPOLossConfig(importance_sampling_level="sequence", loss_type="grpo", **NO_KL),
            [-1.69315, -1.0, -0.59453],
            [-1.0] * 3,
            [1.0, -1.0, 2.0],
            -0.6057,
        ),
    ],
)
def test_clipped_loss_is_nemo_rls(cfg, curr, prev, advantages, expected):
    b = nemo_batch(curr, prev, advantages)
    assert policy_loss(cfg, **b).loss.item() == pytest.approx(expected, rel=1e-3)


def test_kl_penalty_loss_is_nemo_rls():
    """test_clipped_pg_loss_kl_penalty: advantages 0, beta 0.1 -> 0.1 x mean k3 = 0.0362."""
    b = nemo_batch([0.0, -1.0, -2.0], [0.0, 0.0, 0.0], [0.0] * 3, ref=[-1.0, -1.0, -1.0])
    assert policy_loss(GRPOLossConfig(ref_policy_kl_penalty=0.1), **b).loss.item() == pytest.approx(0.0362, rel=1e-3)


@pytest.mark.parametrize("on_policy, expected", [(False, [-0.045, 0.06]), (True, [-0.06074364634, 0.04444909324])])
def test_kl_gradient_includes_the_sampling_term(on_policy, expected):
    """test_clipped_pg_loss_kl_gradient_includes_sampling_term (NeMo-RL v0.7.0, "fix: KL
    backward"): the KL part of the gradient, beta 0.3 over 2 tokens, its numbers evaluated."""

    def gradient(beta):
        b = nemo_batch([-1.2, -0.7], [-1.0, -0.8], [0.4, -0.2], ref=[-0.9, -1.1], gen=[-1.5, -0.4])
        cfg = GRPOLossConfig(ref_policy_kl_penalty=beta, use_on_policy_kl_approximation=on_policy)
        policy_loss(cfg, **b).loss.backward()
        return b["logp"].grad

    assert (gradient(0.3) - gradient(0.0)).flatten().tolist() == pytest.approx(expected, abs=1e-9)


def test_token_mult_prob_error_is_nemo_rls():
    """NeMo-RL's token_mult_prob_error (ClippedPGLossFn: masked_mean(exp(|generation - prev| *
    mask), mask) over the micro batch's tokens) on two samples of 2 and 1 tokens, the padding of
    the second masked out: (exp(0) + exp(0.5) + exp(0.2)) / 3, evaluated."""
    t = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    old, gen = t([[-1.0, -1.5], [-0.7, -3.0]]), t([[-1.0, -2.0], [-0.5, -9.0]])
    batch = dict(
        logp=old.clone(), old_logp=old, ref_logp=old, advantages=t([[1.0, 1.0], [-1.0, -1.0]]), mask=t([[1, 1], [1, 0]]), generation_logp=gen
    )
    for loss_type in ("grpo", "dapo"):  # a token mean whichever reduction the loss takes
        assert policy_loss(GRPOLossConfig(loss_type=loss_type), **batch).token_mult_prob_error.item() == pytest.approx(1.2900413430, abs=1e-9)


def test_truncated_importance_sampling_caps_the_weight():
    """NeMo-RL's truncated_importance_sampling_ratio (verl's TIS): the correction's weight
    exp(prev - generation) = 5 on a token, capped at 2, scales that token's loss by 2; a weight of
    0.5 under the cap is kept."""

    def loss(gen, cap):
        b = nemo_batch([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], gen=gen)
        cfg = GRPOLossConfig(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=cap, **NO_KL)
        return policy_loss(cfg, **b).loss.item()

    assert loss([-1.0 - math.log(5.0), -1.0 + math.log(2.0)], cap=2.0) == pytest.approx((-2.0 - 0.5) / 2)
    assert loss([-1.0 - math.log(5.0), -1.0 + math.log(2.0)], cap=None) == pytest.approx((-5.0 - 0.5) / 2)


def test_one_far_token_no_longer_blows_up_the_loss():
    """The issue's case: ref - logp = 25 on one token. NeMo-RL clamps the log-ratio to 20 and
    the KL to 10: the loss is the actor's -1 plus beta x 10."""
    b = nemo_batch([-26.0], [-26.0], [1.0], ref=[-1.0])
    assert policy_loss(GRPOLossConfig(), **b).loss.item() == pytest.approx(-1 + 0.01 * 10)


# ----------------------------------------------------------------------------- TRL's code


def trl_loss(loss_type, logp, old, ref, advantages, mask, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, level="token", max_completion_length=8):
    """TRL 1.16's GRPOTrainer._compute_loss on these tensors: one process, one micro batch, no
    accumulation; `logp` stands for the model's per-token log-probs."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    one = SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x)
    vars(trainer).update(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        beta=beta,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        max_completion_length=max_completion_length,
        current_gradient_accumulation_steps=1,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        accelerator=one,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        model=SimpleNamespace(training=True),
        _metrics={"train": __import__("collections").defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
    )
    b, t = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return trainer._compute_loss(None, inputs)


def random_batch(seed=0, samples=4, tokens=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(samples, tokens, generator=g, dtype=torch.float64) * 2
    old = logp + 0.3 * torch.randn(samples, tokens, generator=g, dtype=torch.float64)  # ratios on both sides of the clip
    ref = logp + 0.5 * torch.randn(samples, tokens, generator=g, dtype=torch.float64)
    mask = torch.ones(samples, tokens)
    for i in range(samples):
        mask[i, tokens - i :] = 0  # unequal lengths: 6, 5, 4, 3 tokens
    return logp, old, ref, torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)[:samples], mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_types_and_asymmetric_clip_equal_trls_values_and_gradients(loss_type, level):
    logp, old, ref, advantages, mask = random_batch()
    cfg = GRPOLossConfig(loss_type=loss_type, importance_sampling_level=level, ratio_clip_min=0.2, ratio_clip_max=0.28, **NO_KL)
    ours_logp, trl_logp = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    ours = policy_loss(cfg, ours_logp, old, ref, advantages, mask, max_completion_length=8).loss
    theirs = trl_loss(loss_type, trl_logp, old, ref, advantages, mask, epsilon_low=0.2, epsilon_high=0.28, level=level)
    ours.backward(), theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    assert torch.allclose(ours_logp.grad, trl_logp.grad, atol=1e-12)


def test_kl_term_equals_trls_value_and_its_gradient_adds_nemo_rls_score_term():
    """TRL's k3 term (beta 0.04) has our value; its gradient lacks the score-function term
    NeMo-RL v0.7.0 added, beta x k3 / tokens per token (dapo: the batch's tokens)."""
    logp, old, ref, advantages, mask = random_batch(1)
    cfg = GRPOLossConfig(loss_type="dapo", ref_policy_kl_penalty=0.04, kl_input_clamp_value=None, kl_output_clamp_value=None)
    ours_logp, trl_logp = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    ours = policy_loss(cfg, ours_logp, old, ref, advantages, mask).loss
    theirs = trl_loss("dapo", trl_logp, old, ref, advantages, mask, beta=0.04)
    ours.backward(), theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    k3 = (ref - logp).exp() - (ref - logp) - 1
    assert torch.allclose(ours_logp.grad - trl_logp.grad, 0.04 * k3 * mask / mask.sum(), atol=1e-12)


@pytest.mark.parametrize("lengths", [[10, 80, 81, 90, 99, 100]])
def test_overlong_penalty_equals_trls_soft_punishment_and_nemo_rls_shaping(lengths):
    from trl.rewards import get_soft_overlong_punishment

    trl = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)([[1] * n for n in lengths])
    ours = overlong_penalty(torch.tensor(lengths, dtype=torch.float64), 100, 20, 1.0)
    assert ours.tolist() == pytest.approx(trl, abs=1e-12)
    assert trl[3] == -0.5  # TRL's docstring example: 90 tokens of 100 with a cache of 20
    # NeMo-RL's apply_reward_shaping scales by overlong_buffer_penalty: 0.5 halves it
    assert overlong_penalty(torch.tensor([90.0]), 100, 20, 0.5).item() == -0.25


# ----------------------------------------------------------------------------- the stage's objective


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_step_metrics_are_per_unit_of_the_loss(loss_type):
    """The objective sums metrics over its units as it sums the loss, so a step's ratio at the
    sampling policy is 1, whatever the number of tokens per sample."""
    objective = grpo_objective(GRPOLossConfig(loss_type=loss_type), Sampling(max_new_tokens=8, eos_id=0, vocab_size=100, temperature=1.0))
    nll = torch.full((2, 8), 0.7)
    batch = {"loss_mask": torch.ones(2, 8), "advantages": torch.tensor([1.0, -1.0]), "generation_logp": -nll, "old_logp": -nll, "ref_logp": -nll}
    terms = objective.loss(nll, batch)
    assert terms.count.item() == {"dapo": 16, "grpo": 2, "bnpo": 1, "dr_grpo": 16}[loss_type]
    assert (terms.metrics["ratio"] / terms.count).item() == pytest.approx(1.0)
    assert (terms.metrics["kl"] / terms.count).item() == pytest.approx(0.0)


@pytest.mark.slow
def test_two_processes_with_unequal_micro_batches_give_the_big_batchs_gradient():
    """Two gloo processes hold micro batches of 6 + 5 and 4 + 3 tokens; summing each
    micro batch's loss x units, all-reducing gradients and units and dividing (the engine's
    contract) gives TRL's gradient of the one big batch."""
    script = Path(__file__).with_name("policy_dp_ranks.py")
    out = run_ranks(2, script, *LOSS_TYPES)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert all(f"rank {r} {name} equal" in out.stdout for r in (0, 1) for name in LOSS_TYPES), out.stdout
