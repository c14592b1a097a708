"""DPO from precomputed reference log-probs: equal to an online reference, learns, and
matches across TP/PP layouts."""

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from alignflow.orchestrator.config.schema import DPOLossConfig
from alignflow.job.data.packing import pack_bfd
from alignflow.job.device import to_device
from alignflow.job.forward.objectives import sft_forward
from alignflow.job.model import runtime
from alignflow.job.stages import dpo, eval as eval_stage, prep, ref_logprobs, sft
from alignflow.job.data.prepared import Prepared
from alignflow.job.train.datasets import PreferencePairs, sequence_sums
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import assert_same_steps, convert_demo, metrics_lines, prep_demo, stage_cfg, on_ranks  # noqa: E402


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    """Demo SFT and preference data, the demo model after a short SFT as policy and reference,
    and its reference log-probs (DPO from a random model has nothing to sharpen)."""
    root = tmp_path_factory.mktemp("dpo")
    prep_demo(demo_dir, root / "prep", preference=True)
    base = convert_demo(demo_dir, root / "base")
    sft_cfg = stage_cfg(
        "sft",
        demo_dir,
        micro_batch_size=4,
        global_batch_size=16,
        trainer={"max_steps": 120, "val_check_interval": 120},
        optim={"lr": 3e-3, "warmup_steps": 10},
    )
    sft.run(typed(sft_cfg), {"data": str(root / "prep"), "model": str(base)}, str(root / "model"))
    model = root / "model"
    ref_logprobs.run(
        typed(
            {
                "ref_logprobs": {"micro_batch_size": 8, "parallel": eval_stage.SINGLE_RANK, "precision": "fp32"},
                "model": {"make_vocab_size_divisible_by": 128},
            }
        ),  # fp32 as the tests' online references (auto: bf16 on CUDA)
        {"data": str(root / "prep"), "model": str(model)},
        str(root / "ref"),
    )
    return {"data": str(root / "prep"), "model": str(model), "ref_logprobs": str(root / "ref")}


def dpo_cfg(demo_dir, tp=1, pp=1, **section) -> dict:
    return stage_cfg("dpo", demo_dir, tp, pp, **{"micro_batch_size": 2, "global_batch_size": 8, "loss": {"beta": 0.1}, **section})


@pytest.mark.parametrize(
    "loss_cfg",
    [DPOLossConfig(), DPOLossConfig(loss_type=["ipo"], preference_average_log_probs=True, sft_loss_weight=0.5, sft_average_log_probs=True)],
    ids=["sigmoid", "ipo-averaged+sft"],
)
def test_precomputed_reference_equals_an_online_reference(inputs, loss_cfg):
    pairs = PreferencePairs(Prepared(inputs["data"]), "val", inputs["ref_logprobs"])
    runtime.init_parallel(eval_stage.SINGLE_RANK)
    try:
        policy, _ = eval_stage.load_model(inputs["model"], 128)
        reference, _ = eval_stage.load_model(inputs["model"], 128)
        with torch.no_grad():
            for param in policy.parameters():  # a policy that has moved away from the reference
                param.add_(torch.randn_like(param) * 0.01)
            batch = to_device(pairs.collate(range(6)))
            per_token = sft_forward(policy, batch)
            precomputed = dpo.pair_loss(loss_cfg, per_token, batch)
            ref_tokens = sft_forward(reference, batch)
            sums = sequence_sums(-ref_tokens.double() * batch["loss_mask"], batch)
            counts = sequence_sums(batch["loss_mask"].double(), batch).to(torch.int32)
            online = dict(batch, ref_chosen_logp=sums[:6], ref_rejected_logp=sums[6:], ref_chosen_tokens=counts[:6], ref_rejected_tokens=counts[6:])
            direct = dpo.pair_loss(loss_cfg, per_token, online)
    finally:
        runtime.teardown()
    assert precomputed.metrics() == pytest.approx(direct.metrics(), abs=1e-5)
    assert abs(precomputed.chosen_reward.item()) > 1e-3  # the policy really differs from the reference


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dpo_fits_its_pairs(demo_dir, inputs, tmp_path, precision):
    """On 16 training pairs (one global batch), DPO drives the loss down and the reward accuracy up,
    in fp32 and in bf16 (whose policy starts from the reference rounded to bf16: log 2 to 1e-2)."""
    table = pq.read_table(Path(inputs["data"]) / "preference" / "train-00000.parquet").slice(0, 16)
    data = tmp_path / "data"
    (data / "preference").mkdir(parents=True)
    (data / "metadata.json").write_text((Path(inputs["data"]) / "metadata.json").read_text())
    pq.write_table(table, data / "preference" / "train-00000.parquet")
    cfg = dpo_cfg(
        demo_dir,
        precision=precision,
        global_batch_size=16,
        micro_batch_size=4,
        trainer={"max_steps": 25, "log_every_n_steps": 1},
        optim={"lr": 3e-3, "warmup_steps": 2},
    )
    metrics = dpo.run(typed(cfg), {**inputs, "data": str(data)}, str(tmp_path / "out"))
    lines = metrics_lines(tmp_path / "out")
    assert metrics["steps"] == 25 and (tmp_path / "out" / "model" / ".metadata").exists()
    print(f"{precision} DPO: loss {lines[0]['loss']:.4f} -> {lines[-1]['loss']:.4f}, accuracy {lines[-1]['reward_accuracy']:.2f}")
    assert lines[0]["loss"] == pytest.approx(0.6931, abs=1e-3 if precision == "fp32" else 1e-2)  # policy == reference at step 1
    assert lines[-1]["loss"] < 0.4 and lines[-1]["reward_accuracy"] > 0.9 and lines[-1]["reward_margin"] > 0


@pytest.mark.slow
def test_dpo_losses_of_a_moe_at_ep2_match_ep1(demo_dir, inputs, tmp_path):
    """A random Qwen3-MoE of the demo's shape with output_router_logits on, as policy (its own
    reference log-probs): EP2 gives EP1's DPO losses (HF's load-balancing term included), aux
    losses and rewards within 1e-5 (both on 2 ranks, DP2)."""
    model = convert_demo(demo_dir, tmp_path / "moe", "tiny-qwen3-moe", output_router_logits=True, router_aux_loss_coef=0.5)
    ref_logprobs.run(
        typed({"ref_logprobs": {"micro_batch_size": 8, "parallel": eval_stage.SINGLE_RANK}, "model": {"make_vocab_size_divisible_by": 128}}),
        {"data": inputs["data"], "model": str(model)},
        str(tmp_path / "ref"),
    )
    moe = {"data": inputs["data"], "model": str(model), "ref_logprobs": str(tmp_path / "ref")}
    runs = {}
    for ep in (1, 2):
        runs[ep] = tmp_path / f"ep{ep}"
        cfg = dpo_cfg(demo_dir, resources={"tasks_per_node": 2}, trainer={"val_check_interval": 5}, parallel={"expert_model_parallel_size": ep})
        on_ranks(2, cfg, moe, runs[ep], "--stage", "dpo", "--ref-logprobs", moe["ref_logprobs"])
    assert_same_steps(runs[1], runs[2], 1e-5, keys=("loss", "aux_loss", "reward_margin", "chosen_reward", "val_loss", "val_aux_loss"))
    assert all("aux_loss" in line for line in metrics_lines(runs[1]))


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_dpo_losses_at_tp2_and_pp2_match_tp1(demo_dir, inputs, tmp_path, tp, pp):
    reference = tmp_path / "tp1"
    dpo.run(typed(dpo_cfg(demo_dir, trainer={"val_check_interval": 5})), inputs, str(reference))
    parallel = tmp_path / f"tp{tp}pp{pp}"
    on_ranks(
        2, dpo_cfg(demo_dir, tp, pp, trainer={"val_check_interval": 5}), inputs, parallel, "--stage", "dpo", "--ref-logprobs", inputs["ref_logprobs"]
    )
    # reward accuracy counts near-ties: not continuous, so not compared
    assert_same_steps(reference, parallel, 1e-4, keys=("loss", "reward_margin", "chosen_reward", "val_loss"))


def test_a_steps_pairs_pack_into_few_full_rows(demo_dir, tmp_path):
    """A step's pairs go into micro batches of at most micro_batch_size rows, each pair once,
    each sequence's loss tokens where it is, and on a long-tailed length mix nearly every
    position computed is a real token (padding 3 pairs to their longest pair, as micro batches
    of pairs did, computes a fifth or more padding on such a mix)."""
    rng = np.random.default_rng(0)
    words = lambda: " ".join(["seven"] * int(min(rng.lognormal(3.0, 0.8), 200)))  # noqa: E731
    rows = [{"prompt": f"Say {i}", "chosen": words(), "rejected": words()} for i in range(96)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {
        "train": str(tmp_path / "pairs.jsonl"),
        "val": None,
        "val_fraction": 0.0,
        "format": "auto",
        "dev_choose_samples": None,
        "answer_key": "answer",
    }
    prep.run(
        typed(
            {
                "prep": {"skip_bad_rows": False, "rows_per_shard": 10000},
                "data": {
                    "sft": None,
                    "preference": spec,
                    "prompts": None,
                    "seq_length": 256,
                    "max_prompt_length": 16,
                    "truncation": "keep_start",
                    "packing": True,
                    "seed": 0,
                },
                "model": {"tokenizer": str(demo_dir / "tokenizer"), "chat_template": None},
            }
        ),
        {},
        str(tmp_path / "prep"),
    )
    pairs = PreferencePairs(Prepared(str(tmp_path / "prep")), "train")
    share = np.sort(rng.permutation(len(pairs))[:64])
    micro = pairs.micro_batches(share, 3)
    assert sorted(np.concatenate(micro).tolist()) == share.tolist()
    computed = 0
    for m in micro:
        batch = pairs.collate(m)
        assert batch["tokens"].shape[0] <= 3 and batch["tokens"].shape[1] <= pairs.row_length and batch["pairs"] == len(m)
        counts = sequence_sums(batch["loss_mask"].double(), batch)
        assert counts.tolist() == [int(pairs.sequence(side, i)[1][1:].sum()) for side in ("chosen", "rejected") for i in m]
        computed += batch["tokens"].numel()
    three_pairs = [pairs.lengths[share[k : k + 3]] for k in range(0, len(share), 3)]
    padded_to_longest = sum(len(pack_bfd(n, max(n))) * -(-max(n) // 8) * 8 for n in three_pairs)
    assert pairs.num_tokens(share) / computed > 0.93 > 1.1 * pairs.num_tokens(share) / padded_to_longest
