"""The reward_model stage: TRL's RewardTrainer loss and metrics on the same pairs and weights,
HF's ...ForSequenceClassification scores of its export, equal losses across TP/PP layouts, and
what it learns on the demo's preference pairs."""

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from alignflow.orchestrator.config.schema import RewardModelLossConfig
from alignflow.job.data.prepared import Prepared
from alignflow.job.device import to_device
from alignflow.job.forward.models import frozen_chunks, local_model
from alignflow.job.forward.objectives import logits_forward, sequence_scores
from alignflow.job.forward.scores import model_scores
from alignflow.job.model import runtime
from alignflow.job.model.decoder import LeanForward
from alignflow.job.stages import eval as eval_stage, export, grpo, reward_model
from alignflow.job.train.datasets import PreferencePairs, Prompts
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import assert_hardware_use, assert_same_steps, convert_demo, metrics_lines, prep_demo, stage_cfg, on_ranks, weights  # noqa: E402


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    """The demo's SFT, preference and prompt data and the demo Llama as converted."""
    root = tmp_path_factory.mktemp("rm")
    prep_demo(demo_dir, root / "prep", preference=True, prompts=True)
    return {"data": str(root / "prep"), "model": str(convert_demo(demo_dir, root / "base"))}


def rm_cfg(demo_dir, tp=1, pp=1, **section) -> dict:
    return stage_cfg("reward_model", demo_dir, tp, pp, **{"micro_batch_size": 2, "global_batch_size": 8, **section})


@pytest.fixture(scope="module")
def trained(demo_dir, inputs, tmp_path_factory):
    """A reward model after a few steps (its head and trunk moved off their start) and its HF export."""
    root = tmp_path_factory.mktemp("rm-trained")
    reward_model.run(typed(rm_cfg(demo_dir, trainer={"max_steps": 4}, optim={"lr": 3e-3})), inputs, str(root / "rm"))
    export_cfg = OmegaConf.create({"export": {"dtype": "float32", "max_shard_size": "2GB", "destination": None}})
    export.run(export_cfg, {"model": str(root / "rm")}, str(root / "hf"))
    return root


def our_output(uri: str, batch: dict, lean: bool = False) -> torch.Tensor:
    """Every position's score [b, s, 1] of a collated micro batch under the model at `uri` (one
    rank, fp32): through Megatron's modules, or the lean forward."""
    runtime.init_parallel(eval_stage.SINGLE_RANK)
    try:
        (chunk,) = frozen_chunks(local_model(uri, Path("/tmp")), OmegaConf.create(eval_stage.SINGLE_RANK), 128, Path("/tmp"), torch.float32)
        model = LeanForward.of([chunk], batch["tokens"].shape[1]) if lean else chunk
        assert model is not None
        with torch.no_grad():
            return logits_forward(model, to_device(batch))
    finally:
        runtime.teardown()


def hf_batch(pairs: PreferencePairs, indices: list[int], pad_id: int) -> dict:
    """TRL's DataCollatorForPreference batch of the same pairs: chosen then rejected, right-padded."""
    from trl.trainer.reward_trainer import DataCollatorForPreference

    return DataCollatorForPreference(pad_token_id=pad_id)(
        [{f"{side}_ids": pairs.sequence(side, i)[0].tolist() for side in ("chosen", "rejected")} for i in indices]
    )


def test_an_hf_reward_model_converts_and_exports_back_bit_identical(demo_dir, tmp_path):
    """An HF LlamaForSequenceClassification (one label; tied embeddings, which its classifier does
    not use) -> convert -> export: every tensor, `score.weight` among them, comes back exactly."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from alignflow.job.stages import convert

    config = AutoConfig.from_pretrained(demo_dir / "tiny-qwen3", num_labels=1, pad_token_id=0, architectures=["Qwen3ForSequenceClassification"])
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "hf")
    cfg = OmegaConf.create(
        {
            "model": {
                "source": str(tmp_path / "hf"),
                "hf_config": None,
                "tokenizer": str(demo_dir / "tokenizer"),
                "make_vocab_size_divisible_by": 128,
            },
            "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}},
            "export": {"dtype": "float32", "max_shard_size": "2GB", "destination": None},
        }
    )
    convert.run(cfg, {}, str(tmp_path / "ckpt"))
    assert weights(tmp_path / "ckpt" / "model")["rm_head.weight"].shape == (1, 64)
    export.run(cfg, {"model": str(tmp_path / "ckpt")}, str(tmp_path / "back"))
    source, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert source.keys() == back.keys() and "score.weight" in back and all(torch.equal(source[k], back[k]) for k in source)


def test_the_export_loads_as_hf_sequence_classification_with_our_scores(inputs, trained):
    """transformers loads the export (num_labels 1, pad_token_id set, `score.weight`); its logits at
    the last non-pad token equal our scores, through Megatron's modules and the lean forward, to 1e-5."""
    pairs, pad_id = PreferencePairs(Prepared(inputs["data"]), "val"), Prepared(inputs["data"]).pad_id
    hf = AutoModelForSequenceClassification.from_pretrained(trained / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1 and hf.config.pad_token_id == pad_id
    indices = list(range(12))
    batch = pairs.collate(indices)
    with torch.no_grad():
        theirs = hf(**hf_batch(pairs, indices, pad_id)).logits[:, 0]
    for lean in (False, True):
        ours = sequence_scores(our_output(str(trained / "rm"), batch, lean), batch, pad_id)
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (lean, (ours - theirs).abs().max())
    assert theirs.std() > 1e-3  # scores that differ from pair to pair


@pytest.mark.parametrize(
    "loss_cfg", [RewardModelLossConfig(), RewardModelLossConfig(margin=0.5, center_rewards_coefficient=0.01)], ids=["plain", "margin+centered"]
)
def test_loss_and_metrics_equal_trls_reward_trainer(inputs, trained, tmp_path, loss_cfg):
    """TRL 1.16's RewardTrainer.compute_loss on the same pairs (one micro batch) with the same
    weights in HF's LlamaForSequenceClassification: loss, accuracy and margin (reward gap) to 1e-5."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    data = Prepared(inputs["data"])
    pairs, pad_id = PreferencePairs(data, "val"), data.pad_id
    indices = list(range(10))
    hf = AutoModelForSequenceClassification.from_pretrained(trained / "hf", dtype=torch.float32)
    batch = hf_batch(pairs, indices, pad_id)
    if loss_cfg.margin:
        batch["margin"] = torch.full((len(indices),), loss_cfg.margin)
    rows = Dataset.from_list([{f"{side}_ids": pairs.sequence(side, i)[0].tolist() for side in ("chosen", "rejected")} for i in indices])
    args = RewardConfig(output_dir=str(tmp_path), report_to=[], center_rewards_coefficient=loss_cfg.center_rewards_coefficient, use_cpu=True)
    trainer = RewardTrainer(model=hf, args=args, train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(trained / "hf"))
    trainer.model.train()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, batch).item()
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    collated = pairs.collate(indices)
    terms = reward_model.reward_objective(loss_cfg, pad_id).loss(our_output(str(trained / "rm"), collated), collated)
    n = terms.count.item()
    assert terms.total.item() / n == pytest.approx(trl_loss, abs=1e-5)
    assert terms.metrics["reward_accuracy"].item() / n == pytest.approx(trl_metrics["accuracy"], abs=1e-6)
    assert terms.metrics["reward_margin"].item() / n == pytest.approx(trl_metrics["margin"], abs=1e-5)
    assert 0 < trl_metrics["accuracy"] < 1  # the pairs are not all on one side


def test_reward_model_fits_its_pairs(demo_dir, inputs, tmp_path):
    """On 16 training pairs (one global batch) from the demo Llama, the loss falls from log 2 (a
    new head scores near 0) and every pair ends up ranked right; the output is a reward model."""
    table = pq.read_table(Path(inputs["data"]) / "preference" / "train-00000.parquet").slice(0, 16)
    data = tmp_path / "data"
    (data / "preference").mkdir(parents=True)
    (data / "metadata.json").write_text((Path(inputs["data"]) / "metadata.json").read_text())
    pq.write_table(table, data / "preference" / "train-00000.parquet")
    cfg = rm_cfg(demo_dir, global_batch_size=16, micro_batch_size=4, trainer={"max_steps": 15}, optim={"lr": 3e-3})
    metrics = reward_model.run(typed(cfg), {**inputs, "data": str(data)}, str(tmp_path / "out"))
    lines = metrics_lines(tmp_path / "out")
    print(f"reward model: loss {lines[0]['loss']:.4f} -> {lines[-1]['loss']:.4f}, accuracy {lines[-1]['reward_accuracy']:.2f}")
    assert metrics["steps"] == 15 and lines[0]["loss"] == pytest.approx(0.6931, abs=0.01)
    assert lines[-1]["loss"] < 0.05 and lines[-1]["reward_accuracy"] == 1.0 and lines[-1]["reward_margin"] > 2
    config = json.loads((tmp_path / "out" / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["pad_token_id"] == Prepared(inputs["data"]).pad_id
    assert set(weights(tmp_path / "out" / "model")) >= {"rm_head.weight"} and "output_layer.weight" not in weights(tmp_path / "out" / "model")
    assert_hardware_use(metrics, tmp_path / "out", PreferencePairs(Prepared(str(data)), "train").row_length, passes=3)  # no vocab head counted


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_reward_model_losses_at_tp2_and_pp2_match_tp1(demo_dir, inputs, tmp_path, tp, pp):
    """5 steps and a validation from the demo Llama: TP2 (the head replicated, Megatron's modules)
    and PP2 (the head on the last stage) give TP1's (the lean forward) losses and rewards to 1e-5."""
    reference = tmp_path / "tp1"
    reward_model.run(typed(rm_cfg(demo_dir, optim={"lr": 3e-3})), inputs, str(reference))
    parallel = tmp_path / f"tp{tp}pp{pp}"
    on_ranks(2, rm_cfg(demo_dir, tp, pp, optim={"lr": 3e-3}), inputs, parallel, "--stage", "reward_model")
    assert_same_steps(reference, parallel, 1e-5, keys=("loss", "reward_margin", "chosen_reward", "rejected_reward", "val_loss"))
    assert abs(metrics_lines(reference)[-1]["reward_margin"]) > 1e-3  # the rewards moved


@pytest.mark.slow
def test_a_pipeline_trains_and_exports_a_reward_model_in_real_jobs(base_overrides):
    """prep -> convert -> reward_model -> export as local jobs through the runner: the job gets the
    sections its kind declares, its output commits as a reward_model output (its headline
    val_reward_accuracy among its metrics), and the export takes it."""
    from alignflow.orchestrator.config.compose import build
    from alignflow.orchestrator.runner import run_stage

    pipeline = build(
        "convert",
        [
            *base_overrides,
            "pipeline.stages.prep={}",
            "pipeline.stages.rm={kind: reward_model, inputs: {data: prep, model: convert}}",
            "pipeline.stages.export.inputs.model=rm",
            "reward_model.trainer.max_steps=2",
            "reward_model.trainer.val_check_interval=2",
            "reward_model.micro_batch_size=4",
            "reward_model.global_batch_size=8",
        ],
    )
    results = {}
    for stage in pipeline:
        results[stage.name] = run_stage(stage, {up: results[up] for up in stage.upstream()}, log=print)
    rm, exported = Path(results["rm"].uri), Path(results["export"].uri)
    assert results["rm"].metrics["steps"] == 2 and "val_reward_accuracy" in results["rm"].metrics
    hf = AutoModelForSequenceClassification.from_pretrained(exported)
    assert hf.config.num_labels == 1 and (rm / "model" / ".metadata").exists() and not (rm / "checkpoints").exists()


def test_grpos_score_reward_equals_hf_sequence_classification_of_prompt_and_completion(inputs, trained):
    """GRPO's `score` reward (`model_scores`, micro batches of rows of mixed lengths, one ending in
    pad tokens) equals HF's LlamaForSequenceClassification logit of each row alone, to 1e-5."""
    data = Prepared(inputs["data"])
    pairs, prompts = PreferencePairs(data, "val"), Prompts(data, "val")
    rows = [prompts.tokens(i) + pairs.sequence("chosen", i)[0].tolist()[-n:] for i, n in enumerate((3, 5, 1, 4, 2))]
    rows[1] = rows[1] + [data.pad_id] * 2  # HF scores its last token that is not the pad token
    hf = AutoModelForSequenceClassification.from_pretrained(trained / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.tensor([hf(input_ids=torch.tensor([row])).logits[0, 0].item() for row in rows], dtype=torch.float64)
    runtime.init_parallel(eval_stage.SINGLE_RANK)
    try:
        chunks = frozen_chunks(
            local_model(str(trained / "rm"), Path("/tmp")), OmegaConf.create(eval_stage.SINGLE_RANK), 128, Path("/tmp"), torch.float32
        )
        ours = model_scores(chunks, rows, data.pad_id, micro_batch_size=2)
    finally:
        runtime.teardown()
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    assert theirs.std() > 1e-3


def constant(prompt: str, completion: str, answer: str, **_) -> float:
    return 1.0


def test_grpo_sums_a_reward_model_and_rule_rewards_by_weight_as_trl(demo_dir, inputs, trained, tmp_path):
    """grpo with a reward_model input: step 1 (the same policy, the same seeded samples) with
    `score` x 3 + constant 1.0 x 0.5 rewards each sample 3 x its score + 0.5, TRL's
    `(rewards_per_func * reward_weights).nansum(dim=1)` (grpo_trainer.py, 1.16): the mean reward moves
    from the score-only run's r to exactly 3r + 0.5."""
    cfg = stage_cfg(
        "grpo",
        demo_dir,
        num_prompts_per_step=4,
        num_generations_per_prompt=4,
        micro_batch_size=8,
        generation_batch_size=16,
        max_new_tokens=4,
        trainer={"max_steps": 1},
        optim={"lr": 1e-3, "warmup_steps": 0},
    )
    grpo_inputs = {**inputs, "ref_model": inputs["model"], "reward_model": str(trained / "rm")}
    means = {}
    for name, environment in {
        "score": [{"name": "score"}],
        "mixed": [{"name": "score", "weight": 3.0}, {"name": "test_reward_model:constant", "weight": 0.5}],
    }.items():
        grpo.run(typed({**cfg, "grpo": {**cfg["grpo"], "environment": environment}}), grpo_inputs, str(tmp_path / name))
        means[name] = metrics_lines(tmp_path / name)[0]["reward_mean"]
    assert means["score"] != 0 and means["mixed"] == pytest.approx(3 * means["score"] + 0.5, abs=1e-9), means


def test_eval_reports_reward_model_scores_and_win_rates_against_the_first_baseline(demo_dir, inputs, trained, tmp_path):
    """eval with a reward_model input: a model's `rm_score` is the mean of HF's
    ...ForSequenceClassification scores of prompt + HF's greedy completion, and against a copy of
    itself as the baseline (every prompt a tie) its `rm_win_rate` is one half."""
    from transformers import AutoModelForCausalLM

    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "x").symlink_to(inputs["model"])
    n, new_tokens = 6, 5
    cfg = typed(
        {
            "model": {"make_vocab_size_divisible_by": 128},
            "eval": {"limit_batches": 1, "num_generation_samples": n, "max_new_tokens": new_tokens, "num_examples_shown": 1, "micro_batch_size": 4},
        }
    )
    metrics = eval_stage.run(
        cfg,
        {"data": inputs["data"], "model": inputs["model"], "baselines": [str(tmp_path / "twin" / "x")], "reward_model": str(trained / "rm")},
        str(tmp_path / "out"),
    )
    model = eval_stage._stage_name(inputs["model"])
    assert metrics[f"{model}.rm_win_rate"] == 0.5 and "twin.rm_win_rate" not in metrics
    data = Prepared(inputs["data"])
    prompts, policy = Prompts(data, "val"), AutoModelForCausalLM.from_pretrained(demo_dir / "tiny-llama", dtype=torch.float32).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(trained / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [
            policy.generate(
                torch.tensor([prompts.tokens(i)]),
                do_sample=False,
                max_new_tokens=new_tokens,
                eos_token_id=data.tokenizer["eos_token_id"],
                pad_token_id=data.pad_id,
            )[0]
            for i in range(n)
        ]
        theirs = [rm(input_ids=row[None]).logits[0, 0].item() for row in rows]
    assert metrics[f"{model}.rm_score"] == pytest.approx(sum(theirs) / n, abs=1e-5) and metrics["twin.rm_score"] == metrics[f"{model}.rm_score"]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_the_sft_rm_grpo_demo_learns_a_reward_model_and_grpo_with_it_beats_sft(base_overrides):
    """The demo pipeline as shipped (conf/pipeline/sft_rm_grpo.yaml): the reward model prefers the
    chosen answer of more than 0.8 of the held-out pairs (192 of 200: whole micro batches of 32), and GRPO scored by it (mixed with
    exact match) answers more held-out problems greedily than the SFT model it starts from."""
    from flows.align import align

    results = align(pipeline="sft_rm_grpo", overrides=base_overrides)
    assert list(results) == ["prep", "convert", "sft", "reward_model", "grpo", "eval", "export"]
    rm, evaluated = results["reward_model"].metrics, results["eval"].metrics
    print({k: rm[k] for k in ("val_reward_accuracy", "val_reward_margin")}, {k: v for k, v in evaluated.items() if "accuracy" in k or "rm_" in k})
    assert rm["val_reward_accuracy"] > 0.8
    assert evaluated["grpo.accuracy"] > evaluated["sft.accuracy"]
    assert {"grpo.rm_score", "grpo.rm_win_rate", "sft.rm_score", "convert.rm_win_rate"} <= set(evaluated)
