"""The DPO-family losses against TRL 1.16's on the same pairs and models, and worked examples."""

import json
import math

import pytest
import torch

from alignflow.config.schema import DPOLossConfig
from alignflow.losses.preference import preference_loss, sequence_logps


@pytest.fixture(scope="module")
def trl_batch(demo_dir, tmp_path_factory):
    """TRL 1.16's DPOTrainer on the demo pairs, a policy that has moved off its reference, and
    one of its training batches."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "tokenizer")
    reference = AutoModelForCausalLM.from_pretrained(demo_dir / "tiny-llama", dtype=torch.float64).eval()
    policy = AutoModelForCausalLM.from_pretrained(demo_dir / "tiny-llama", dtype=torch.float64).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    rows = [json.loads(line) for line in (demo_dir / "data" / "preference_train.jsonl").read_text().splitlines()[:8]]
    rows = [dict(row, chosen=row["chosen"] + " is the answer" * (i % 3)) for i, row in enumerate(rows)]  # unequal lengths

    def trainer(loss_type: str, beta: float) -> DPOTrainer:
        args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), beta=beta, loss_type=[loss_type], use_cpu=True, report_to=[],
                         per_device_train_batch_size=8, bf16=False, precompute_ref_log_probs=False)
        return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)

    batch = next(iter(trainer("sigmoid", 0.1).get_train_dataloader()))
    return trainer, policy, reference, batch


def sequence_log_probs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of the completion tokens' log-probs, and their counts, of every row (chosen rows, then rejected)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    per_token = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["completion_mask"][:, 1:].to(per_token.dtype)
    return (per_token * mask).sum(-1), mask.sum(-1)


@pytest.mark.parametrize("loss_type, beta, average", [("sigmoid", 0.1, False), ("sigmoid", 0.5, False), ("ipo", 0.3, True)])
def test_preference_losses_equal_trls(trl_batch, loss_type, beta, average):
    """Our DPO and IPO losses equal TRL 1.16's on the same pairs and models (TRL's IPO averages
    each sequence's log-probs over its tokens: ours with preference_average_log_probs)."""
    trainer, policy, reference, batch = trl_batch
    theirs = trainer(loss_type, beta).compute_loss(policy, batch).item()
    (policy_sums, tokens), (reference_sums, _) = sequence_log_probs(policy, batch), sequence_log_probs(reference, batch)
    n = len(tokens) // 2
    cfg = DPOLossConfig(loss_type=loss_type, beta=beta, preference_average_log_probs=average)
    pc, pr, rc, rr = policy_sums[:n], policy_sums[n:], reference_sums[:n], reference_sums[n:]
    if average:
        pc, pr, rc, rr = pc / tokens[:n], pr / tokens[n:], rc / tokens[:n], rr / tokens[n:]
    ours = preference_loss(cfg, pc, pr, rc, rr).preference_loss.item()
    assert ours == pytest.approx(theirs, rel=1e-6)  # TRL computes its loss in float32
    assert abs(ours - (math.log(2) if loss_type == "sigmoid" else 1 / (4 * beta * beta))) > 1e-4  # the policy really moved


def test_conservative_dpo_on_a_worked_example():
    """cDPO (Mitchell, "A note on DPO with noisy preferences"): (1 - e) * -log s(beta h) + e * -log s(-beta h).
    TRL 1.16 has no cDPO loss type (its label_smoothing serves robust/EXO/AOT), so: h = (-10 - -14) - (-12 - -13) = 3,
    beta h = 0.3, -log s(0.3) = 0.554355, -log s(-0.3) = 0.854355; e = 0.2: 0.8 * 0.554355 + 0.2 * 0.854355 = 0.614355."""
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    out = preference_loss(DPOLossConfig(beta=0.1, label_smoothing=0.2), t(-10.0), t(-14.0), t(-12.0), t(-13.0))
    assert out.preference_loss.item() == pytest.approx(0.8 * math.log1p(math.exp(-0.3)) + 0.2 * math.log1p(math.exp(0.3)), rel=1e-12)
    assert out.preference_loss.item() == pytest.approx(0.614355, abs=1e-6)


def test_sft_term_and_metrics_on_a_worked_example():
    """NeMo-RL's DPO: loss = preference_loss_weight * preference + sft_loss_weight * sft (the chosen NLL);
    rewards beta * (policy - reference): chosen 0.1 * 2 = 0.2, rejected 0.1 * -1 = -0.1, margin 0.3, accuracy 1."""
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    cfg = DPOLossConfig(beta=0.1, sft_loss_weight=0.5, preference_loss_weight=2.0)
    out = preference_loss(cfg, t(-10.0), t(-14.0), t(-12.0), t(-13.0), chosen_nll=t(10.0))
    assert out.metrics() == pytest.approx({"loss": 2 * math.log1p(math.exp(-0.3)) + 0.5 * 10.0, "preference_loss": math.log1p(math.exp(-0.3)),
                                           "sft_loss": 10.0, "reward_accuracy": 1.0, "chosen_reward": 0.2, "rejected_reward": -0.1,
                                           "reward_margin": 0.3})


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
