"""The DPO family against TRL 1.16's own code on the same pairs and models: every loss type's
value and the gradient it sends into the policy's weights (TRL's DPOTrainer.compute_loss runs the
models; ours gets the same models' sequence log-probs), cDPO against TRL's aot on single pairs
(where aot's sort is the identity), and the reference-free losses against CPOTrainer.cpo_loss and
ORPOTrainer.odds_ratio_loss on the same log-prob tensors."""

import json
from types import SimpleNamespace

import pytest
import torch

from alignflow.orchestrator.config.schema import DPOLossConfig
from alignflow.job.losses.preference import PairLogps, preference_loss


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

    def trainer(loss_type: list[str], beta: float, **args) -> DPOTrainer:
        args = DPOConfig(
            output_dir=str(tmp_path_factory.mktemp("trl")),
            beta=beta,
            loss_type=loss_type,
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=8,
            bf16=False,
            precompute_ref_log_probs=False,
            **args,
        )
        return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)

    batch = next(iter(trainer(["sigmoid"], 0.1).get_train_dataloader()))
    return trainer, policy, reference, batch


def pair_logps(policy, reference, batch) -> PairLogps:
    """Our loss's input from HF's forward: each completion's summed log-probs (the policy's in the
    autograd graph), chosen rows first, then rejected, as TRL's collator stacks them."""

    def sums(model):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        per_token = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        return (per_token * mask).sum(-1)

    mask = batch["completion_mask"][:, 1:].to(torch.float64)
    with torch.no_grad():
        ref = sums(reference)
    policy_sums, tokens, n = sums(policy), mask.sum(-1), len(mask) // 2
    return PairLogps(policy_sums[:n], policy_sums[n:], ref[:n], ref[n:], tokens[:n], tokens[n:])


def policy_gradient(policy, loss: torch.Tensor) -> torch.Tensor:
    policy.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])


def assert_same_loss_and_gradient(trl_batch, ours_cfg: DPOLossConfig, trl_loss_type: list[str], beta: float, rows=None, **trl_args):
    trainer, policy, reference, batch = trl_batch
    if rows is not None:
        batch = {key: value[rows] for key, value in batch.items()}
    theirs = trainer(trl_loss_type, beta, **trl_args).compute_loss(policy, batch)
    their_grad = policy_gradient(policy, theirs)
    ours = preference_loss(ours_cfg, pair_logps(policy, reference, batch)).loss
    our_grad = policy_gradient(policy, ours)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-9)  # TRL's fused LM head computes in float32
    assert torch.linalg.vector_norm(our_grad - their_grad) <= 1e-5 * torch.linalg.vector_norm(their_grad)
    assert torch.linalg.vector_norm(their_grad) > 1e-6  # a loss that really moves the policy
    return ours.item()


SMOOTHING = {"robust": 0.2, "exo_pair": 1e-3, "aot": 0.1, "aot_unpaired": 0.1}
TRL_TYPES = [
    "sigmoid",
    "sigmoid_norm",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
]


@pytest.mark.parametrize("loss_type", TRL_TYPES)
def test_every_trl_dpo_loss_type_equals_trls_value_and_gradient(trl_batch, loss_type):
    """Each TRL 1.16 DPOTrainer loss type, our defaults against TRL's: IPO averages per token
    (preference_average_log_probs left null), as TRL always does."""
    eps = SMOOTHING.get(loss_type, 0.0)
    cfg = DPOLossConfig(loss_type=[loss_type], beta=0.3, label_smoothing=eps)
    assert_same_loss_and_gradient(trl_batch, cfg, [loss_type], 0.3, label_smoothing=eps)


def test_a_weighted_combination_equals_trls(trl_batch):
    """TRL's MPO recipe: loss_type [sigmoid, bco_pair, sft], loss_weights [0.8, 0.2, 1.0]."""
    types, weights = ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]
    assert_same_loss_and_gradient(trl_batch, DPOLossConfig(loss_type=types, loss_weights=weights, beta=0.2), types, 0.2, loss_weights=weights)


def test_ipo_with_sums_is_still_there_when_asked(trl_batch):
    """preference_average_log_probs: false gives IPO on summed log-probs (NeMo-RL's default), no longer TRL's."""
    _, policy, reference, batch = trl_batch
    logps = pair_logps(policy, reference, batch)
    summed = preference_loss(DPOLossConfig(loss_type=["ipo"], beta=0.3, preference_average_log_probs=False), logps).loss.item()
    averaged = preference_loss(DPOLossConfig(loss_type=["ipo"], beta=0.3), logps).loss.item()
    assert abs(summed - averaged) > 0.1 * averaged


@pytest.mark.parametrize("pair", [0, 3])
def test_cdpo_equals_trls_aot_on_one_pair(trl_batch, pair):
    """Conservative DPO: TRL 1.16 dropped it from `sigmoid`; its `aot` computes the same smoothed
    sigmoid after sorting the batch's margins, the identity on a batch of one pair."""
    rows = torch.tensor([pair, pair + 8])
    assert_same_loss_and_gradient(
        trl_batch, DPOLossConfig(loss_type=["cdpo"], beta=0.3, label_smoothing=0.2), ["aot"], 0.3, rows=rows, label_smoothing=0.2
    )


def test_trls_sigmoid_ignores_label_smoothing(trl_batch):
    """Why alignflow refuses label_smoothing with sigmoid (tests/test_bad_input.py): TRL 1.16 ignores it."""
    trainer, policy, _, batch = trl_batch
    with torch.no_grad():
        plain = trainer(["sigmoid"], 0.3).compute_loss(policy, batch).item()
        smoothed = trainer(["sigmoid"], 0.3, label_smoothing=0.2).compute_loss(policy, batch).item()
    assert plain == smoothed


def _trl_self(beta: float, **args) -> SimpleNamespace:
    return SimpleNamespace(**{"beta": beta, "label_smoothing": 0.0, "alpha": 0.0, "accelerator": SimpleNamespace(device=torch.device("cpu")), **args})


@pytest.mark.parametrize(
    "loss_type, trl_type, args",
    [
        ("cpo", "sigmoid", {"label_smoothing": 0.1}),
        ("simpo", "simpo", {"simpo_gamma": 0.7}),
        ("simpo", "simpo", {"simpo_gamma": 0.5, "label_smoothing": 0.1}),
    ],
)
def test_reference_free_losses_equal_trls_cpo_loss(trl_batch, loss_type, trl_type, args):
    """CPO (sigmoid on summed log-probs) and SimPO (means, margin gamma) against CPOTrainer.cpo_loss on the same tensors."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    _, policy, reference, batch = trl_batch
    logps = pair_logps(policy, reference, batch)
    seen = logps.averaged() if loss_type == "simpo" else logps  # CPOTrainer averages for simpo (and ipo)
    theirs = CPOTrainer.cpo_loss(_trl_self(2.0, loss_type=trl_type, **args), seen.policy_chosen, seen.policy_rejected)[0].mean()
    their_grad = policy_gradient(policy, theirs)
    ours = preference_loss(DPOLossConfig(loss_type=[loss_type], beta=2.0, **args), pair_logps(policy, reference, batch)).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    assert torch.allclose(policy_gradient(policy, ours), their_grad, rtol=1e-10, atol=1e-14)


def test_orpo_equals_trls_odds_ratio_term(trl_batch):
    """ORPO's odds-ratio term on per-token means against ORPOTrainer.odds_ratio_loss (TRL's loss = NLL - its mean)."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    _, policy, reference, batch = trl_batch
    seen = pair_logps(policy, reference, batch).averaged()
    theirs = -ORPOTrainer.odds_ratio_loss(_trl_self(0.25), seen.policy_chosen, seen.policy_rejected)[0].mean()
    their_grad = policy_gradient(policy, theirs)
    ours = preference_loss(DPOLossConfig(loss_type=["orpo"], beta=0.25), pair_logps(policy, reference, batch)).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)  # TRL's odds ratio runs in float32
    assert torch.linalg.vector_norm(policy_gradient(policy, ours) - their_grad) <= 1e-5 * torch.linalg.vector_norm(their_grad)


def test_nemo_rl_sft_term_equals_trls_sft_on_one_pair(trl_batch):
    """NeMo-RL's SFT term per token (sft_average_log_probs) is TRL's `sft` on a batch of one pair:
    preference_loss_weight 0.5 x sigmoid + sft_loss_weight 2 x SFT against TRL's weights [0.5, 2]."""
    cfg = DPOLossConfig(beta=0.3, preference_loss_weight=0.5, sft_loss_weight=2.0, sft_average_log_probs=True)
    assert_same_loss_and_gradient(trl_batch, cfg, ["sigmoid", "sft"], 0.3, rows=torch.tensor([2, 10]), loss_weights=[0.5, 2.0])
