"""The eval stage on the demo base model, and Megatron greedy decoding against HF's."""

import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from alignflow.job.data.prepared import Prepared
from alignflow.job.generation import Sampling, generate
from alignflow.job.model import runtime
from alignflow.job.rewards import extract_answer, gold_answer
from alignflow.job.stages import convert, eval as eval_stage, prep
from alignflow.job.train.datasets import PreferencePairs
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import assert_hardware_use, briefly_tuned, convert_demo, prep_demo  # noqa: E402


TIMINGS = ("compute_s", "generation_s")  # how long its passes took, not what they computed


def without(metrics: dict, keys) -> dict:
    return {k: v for k, v in metrics.items() if k not in keys}


def prep_cfg(demo_dir):
    data = {
        kind: {
            "train": str(demo_dir / "data" / f"{kind}_train.jsonl"),
            "val": str(demo_dir / "data" / f"{kind}_val.jsonl"),
            "val_fraction": 0.0,
            "format": "auto",
            "dev_choose_samples": None,
            "answer_key": "answer",
        }
        for kind in ("sft", "preference", "prompts")
    }
    return typed(
        {
            "prep": {},
            "data": {"seq_length": 128, "max_prompt_length": 64, "truncation": "keep_start", "packing": True, "seed": 0, **data},
            "model": {
                "source": str(demo_dir / "tiny-llama"),
                "hf_config": None,
                "tokenizer": str(demo_dir / "tokenizer"),
                "chat_template": None,
                "make_vocab_size_divisible_by": 128,
            },
            "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}},
            "eval": {"limit_batches": 2, "num_generation_samples": 24, "max_new_tokens": 6, "num_examples_shown": 2, "micro_batch_size": 8},
        }
    )


@pytest.fixture(scope="module")
def outputs(demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    cfg = prep_cfg(demo_dir)
    prep.run(cfg, {}, str(root / "prep" / "p1"))
    convert.run(cfg, {}, str(root / "convert" / "c1"))
    return cfg, root


def test_eval_reports_each_model(outputs, tmp_path):
    cfg, root = outputs
    model = str(root / "convert" / "c1")
    metrics = eval_stage.run(cfg, {"data": str(root / "prep" / "p1"), "model": model, "baselines": []}, str(tmp_path / "out"))
    assert set(metrics) == {
        "convert.val_loss",
        "convert.perplexity",
        "convert.preference_accuracy",
        "convert.accuracy",
        "convert.preference_accuracy_stderr",
        "convert.accuracy_stderr",
        "flops",  # what the job cost: its passes' model FLOPs, tokens and seconds
        "tokens",
        "compute_s",
        "generation_s",
    }
    assert metrics["convert.perplexity"] == pytest.approx(torch.tensor(metrics["convert.val_loss"]).exp().item(), rel=1e-6)
    assert 0 <= metrics["convert.preference_accuracy"] <= 1 and metrics["convert.accuracy"] == 0.0  # random weights
    pairs = len(PreferencePairs(Prepared(str(root / "prep" / "p1")), "val"))  # each pair a 0/1 outcome: lm-eval's acc_stderr of them
    wins = round(metrics["convert.preference_accuracy"] * pairs)
    outcomes = [1.0] * wins + [0.0] * (pairs - wins)
    assert metrics["convert.preference_accuracy_stderr"] == pytest.approx(statistics.stdev(outcomes) / math.sqrt(pairs), rel=1e-12)
    assert metrics["convert.accuracy_stderr"] == 0.0  # every answer wrong: no spread
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["metrics"] == metrics and len(saved["samples"]["convert"]) == 2


def test_evaluation_saves_nothing_for_a_backward_pass(outputs):
    """Every pass of `evaluate` runs without autograd: no tensor is saved for a backward that
    never comes (the validation loss, the preference log-probs and generation)."""
    cfg, root = outputs
    saved = []
    runtime.init_parallel(eval_stage.SINGLE_RANK)
    try:
        model, decode = eval_stage.load_model(str(root / "convert" / "c1"), 128)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            results, *_ = eval_stage.evaluate([model], decode, Prepared(str(root / "prep" / "p1")), cfg.eval)
    finally:
        runtime.teardown()
    assert {"val_loss", "preference_accuracy", "accuracy"} <= results.keys() and saved == []


def test_prompt_scores_worked_example():
    """Gold 1/2; 8 answers, 4 of them 1/2 as math-verify reads them (0.5, 2/4, $1/2$, boxed 0.5).
    pass@k = 1 - C(4, k)/C(8, k): 1/2, 1 - 4/56, 1; maj@1: 1/3 (wrong); maj@3: 1/3 twice against
    0.5 (wrong); maj@8: 1/2 four times against 1/3 twice (right)."""
    texts = ["1/3", "0.5", "1/3", "\\frac{2}{4}", "7", "$\\frac{1}{2}$", "no idea", "\\boxed{0.5}"]
    scores = eval_stage.prompt_scores(gold_answer("\\frac{1}{2}"), [extract_answer(t) for t in texts], [1, 3, 8])
    assert scores == pytest.approx({"pass@1": 0.5, "pass@3": 1 - 4 / 56, "pass@8": 1.0, "maj@1": 0.0, "maj@3": 0.0, "maj@8": 1.0}, abs=1e-12)


@pytest.fixture(scope="module")
def tuned(demo_dir, tmp_path_factory):
    """The demo model fine-tuned briefly (tests/test_grpo.py's): it answers with numbers, some right."""
    root = tmp_path_factory.mktemp("eval-tuned")
    data = str(prep_demo(demo_dir, root / "data", prompts=True))
    return {"data": data, "model": briefly_tuned(demo_dir, data, str(convert_demo(demo_dir, root / "base")), root / "sft" / "s1"), "baselines": []}


def test_sampled_pass_at_k_rises_in_k_and_greedy_accuracy_stays(outputs, tuned, tmp_path):
    """8 samples at temperature 1 of 16 prompts: pass@k rises with k, maj@k is reported, and
    the greedy metrics equal a run without sampling."""
    cfg, _ = outputs
    greedy = {"eval": {"num_generation_samples": 16, "max_new_tokens": 4}}
    sampled = {"eval": {"sampling": {"k": [1, 4, 8], "n": 8, "temperature": 1.0}}}
    plain = eval_stage.run(typed(OmegaConf.merge(cfg, greedy)), tuned, str(tmp_path / "plain"))
    metrics = eval_stage.run(typed(OmegaConf.merge(cfg, greedy, sampled)), tuned, str(tmp_path / "sampled"))
    print({k: v for k, v in metrics.items() if "@" in k or "accuracy" in k})
    cost = ("flops", "tokens", *TIMINGS)  # sampling generates more: it costs more
    assert {k: v for k, v in metrics.items() if "@" not in k and k not in cost} == without(plain, cost)
    assert 0 < metrics["sft.pass@1"] < metrics["sft.pass@4"] < metrics["sft.pass@8"] <= 1
    assert {"sft.maj@1", "sft.maj@4", "sft.maj@8"} <= metrics.keys() and all(0 <= metrics[f"sft.maj@{k}"] <= 1 for k in (1, 4, 8))
    assert json.loads((tmp_path / "sampled" / "eval.json").read_text())["metrics"] == metrics


@pytest.mark.parametrize("precision", ["auto", "bf16"])
def test_forward_only_models_are_built_in_their_stages_precision(outputs, precision):
    """ref_logprobs and teacher_logprobs (`forward_only_splits`) build the frozen model in the
    stage's `precision` (they ran fp32 whatever it said); auto is fp32 without a GPU."""
    from alignflow.job.data.prepared import Prepared
    from alignflow.job.train.datasets import PreferencePairs
    from alignflow.job.forward.passes import forward_only_splits

    cfg, root = outputs
    section = OmegaConf.merge(cfg.ref_logprobs, {"precision": precision, "parallel": eval_stage.SINGLE_RANK})
    dtypes = forward_only_splits(
        cfg,
        section,
        str(root / "convert" / "c1"),
        PreferencePairs,
        Prepared(str(root / "prep" / "p1")),
        lambda model, chunks, rows, split: {split: {p.dtype for c in chunks for p in c.parameters()}},
    )
    expected = {torch.bfloat16 if precision == "bf16" else torch.float32}
    assert {split: dtypes[split] for split in ("train", "val")} == {"train": expected, "val": expected}


def test_megatron_greedy_equals_hf_greedy(outputs, demo_dir):
    cfg, root = outputs
    hf = AutoModelForCausalLM.from_pretrained(demo_dir / "tiny-llama", attn_implementation="eager").eval()
    prompt = torch.tensor([[1, 5, 9, 42, 7, 100, 3], [1, 8, 8, 300, 2, 11, 6]])
    expected = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)[:, prompt.shape[1] :]
    runtime.init_parallel(eval_stage.SINGLE_RANK)
    try:
        model, _ = eval_stage.load_model(str(root / "convert" / "c1"), 128)
        with torch.no_grad():
            got = generate([model], prompt.tolist(), Sampling(10, eos_id=-1, vocab_size=hf.config.vocab_size), batch_size=2)
    finally:
        runtime.teardown()
    assert [c.tokens for c in got] == expected.tolist()


def test_ref_logprobs_equal_hf_log_probs_of_each_response(outputs, demo_dir, tmp_path):
    """The stage's per-pair sums (pairs packed into rows) equal HF transformers' log-probs of
    each response run alone, on the same weights."""
    import pyarrow.parquet as pq

    from alignflow.job.data.prepared import Prepared
    from alignflow.job.stages import ref_logprobs
    from alignflow.job.train.datasets import PreferencePairs

    cfg, root = outputs
    cfg = OmegaConf.merge(
        cfg, {"ref_logprobs": {"micro_batch_size": 7, "parallel": eval_stage.SINGLE_RANK, "precision": "fp32"}}
    )  # HF's fp32; 200 pairs: an uneven last micro batch
    metrics = ref_logprobs.run(cfg, {"data": str(root / "prep" / "p1"), "model": str(root / "convert" / "c1")}, str(tmp_path / "ref"))
    got = pq.read_table(tmp_path / "ref" / "val-00000.parquet").to_pydict()
    assert metrics["val.pairs"] == len(got["sample_id"]) == 200
    pairs = PreferencePairs(Prepared(str(root / "prep" / "p1")), "val")
    assert pairs.document_lengths(range(len(pairs))).sum() == pairs.num_tokens(range(len(pairs)))
    longest_row = max(PreferencePairs(Prepared(str(root / "prep" / "p1")), split).row_length for split in ("train", "val"))
    assert_hardware_use(metrics, root / "convert" / "c1", longest_row, passes=1)
    assert got["sample_id"] == pairs.sample_ids.tolist()
    hf = AutoModelForCausalLM.from_pretrained(demo_dir / "tiny-llama", dtype=torch.float32).eval()
    for i in range(0, 200, 13):
        for side in ("chosen", "rejected"):
            ids, mask = (torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in pairs.sequence(side, i))
            with torch.no_grad():
                logp = hf(ids[None]).logits[0, :-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
            assert got[f"{side}_logp"][i] == pytest.approx(float((logp * mask[1:]).sum()), abs=1e-3)
            assert got[f"{side}_tokens"][i] == int(mask[1:].sum())


def val_logprobs(out) -> dict[str, list]:
    """A ref_logprobs output's val shards (one per DP rank) as columns, in shard order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(f) for f in sorted(out.glob("val-*.parquet"))]).to_pydict()


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_eval_and_ref_logprobs_on_two_ranks_equal_one_rank(outputs, tmp_path, tp, pp):
    """200 val pairs and 24 prompts in micro batches of 7: every layout has an uneven last micro
    batch (and DP2 uneven shares); the metrics and per-pair log-probs equal one rank's."""
    from alignflow.job.stages import ref_logprobs
    from train_ranks import on_ranks

    cfg, root = outputs
    parallel = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    layout = {"micro_batch_size": 7, "resources": {"tasks_per_node": 2}, "parallel": parallel}
    two = OmegaConf.to_container(OmegaConf.merge(cfg, {"eval": {**layout, "limit_batches": 5}, "ref_logprobs": layout}))
    one = typed(
        OmegaConf.merge(two, {stage: {"resources": {"tasks_per_node": 1}, "parallel": eval_stage.SINGLE_RANK} for stage in ("eval", "ref_logprobs")})
    )
    inputs = {"data": str(root / "prep" / "p1"), "model": str(root / "convert" / "c1")}

    expected = eval_stage.run(one, {**inputs, "baselines": []}, str(tmp_path / "eval-1"))
    on_ranks(2, two, inputs, tmp_path / "eval-2", "--stage", "eval")
    got = json.loads((tmp_path / "eval-2" / "result.json").read_text())
    assert got.keys() == expected.keys() and got["convert.accuracy"] == expected["convert.accuracy"]
    assert without(got, TIMINGS) == pytest.approx(without(expected, TIMINGS), rel=1e-6, abs=1e-4)  # perplexity is exp(loss): its error is relative

    ref_logprobs.run(one, inputs, str(tmp_path / "ref-1"))
    on_ranks(2, two, inputs, tmp_path / "ref-2", "--stage", "ref_logprobs")
    a, b = val_logprobs(tmp_path / "ref-1"), val_logprobs(tmp_path / "ref-2")
    assert a["sample_id"] == b["sample_id"]
    assert b["chosen_logp"] == pytest.approx(a["chosen_logp"], abs=1e-4) and b["rejected_logp"] == pytest.approx(a["rejected_logp"], abs=1e-4)


@pytest.mark.slow
def test_eval_of_a_moe_at_ep2_equals_one_rank(outputs, demo_dir, tmp_path):
    """The demo Qwen3-MoE's experts split over the 2 DP ranks (EP2), each scoring its own share
    of the rows, pairs and prompts (micro batches of 1: 2 and 1 validation micro batches, 5 and
    4 generation batches): the metrics of one rank, the task accuracy and the samples (greedy
    generation) exactly."""
    from train_ranks import convert_demo, on_ranks

    cfg, root = outputs
    inputs = {"data": str(root / "prep" / "p1"), "model": str(convert_demo(demo_dir, tmp_path / "moe" / "m1", "tiny-qwen3-moe"))}
    two = OmegaConf.to_container(
        OmegaConf.merge(
            cfg,
            {
                "eval": {
                    "micro_batch_size": 1,
                    "limit_batches": 3,
                    "num_generation_samples": 9,
                    "resources": {"tasks_per_node": 2},
                    "parallel": {"expert_model_parallel_size": 2},
                }
            },
        )
    )
    one = typed(OmegaConf.merge(two, {"eval": {"resources": {"tasks_per_node": 1}, "parallel": eval_stage.SINGLE_RANK}}))
    expected = eval_stage.run(one, {**inputs, "baselines": []}, str(tmp_path / "eval-1"))
    on_ranks(2, two, inputs, tmp_path / "eval-2", "--stage", "eval")
    got = json.loads((tmp_path / "eval-2" / "result.json").read_text())
    assert got.keys() == expected.keys() and got["moe.accuracy"] == expected["moe.accuracy"]
    assert without(got, TIMINGS) == pytest.approx(without(expected, TIMINGS), rel=1e-6, abs=1e-5)
    samples = lambda out: json.loads((out / "eval.json").read_text())["samples"]  # noqa: E731
    assert samples(tmp_path / "eval-2") == samples(tmp_path / "eval-1")
