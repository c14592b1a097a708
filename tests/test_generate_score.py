"""The generate and score kinds and prep's `generated` input (alignflow.job.stages.generate,
.score, .prep): generate's greedy completions are HF transformers' on the same weights, its
samples are fixed by the seed; score's choices on a worked example; prep builds the next
round's data from them; and the two shipped pipelines built on them (rejection_sampling,
online_dpo) run, re-run as cache hits, and re-run only score and what follows when the scorer
changes."""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from alignflow.job.data.prepared import Prepared
from alignflow.job.stages import export, generate, prep, score
from alignflow.job.train.datasets import PackedSFT, Prompts
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import briefly_tuned, convert_demo, prep_demo  # noqa: E402


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    """Prep with prompts, and the demo model fine-tuned briefly (it answers with numbers, some right)."""
    root = tmp_path_factory.mktemp("generate-inputs")
    data, base = str(prep_demo(demo_dir, root / "data", prompts=True)), str(convert_demo(demo_dir, root / "base"))
    return {"data": data, "model": briefly_tuned(demo_dir, data, base, root / "sft" / "s1")}


def generate_cfg(demo_dir, **section) -> dict:
    return {
        "generate": {"num_prompts": 12, "num_generations_per_prompt": 3, "max_new_tokens": 6, "micro_batch_size": 8, **section},
        "model": {"source": str(demo_dir / "tiny-llama"), "tokenizer": str(demo_dir / "tokenizer")},
    }


def completions(out: Path) -> list[dict]:
    return pq.read_table(out / generate.FILE).to_pylist()


def test_greedy_generation_is_hf_transformers_greedy_decoding(demo_dir, inputs, tmp_path):
    metrics = generate.run(typed(generate_cfg(demo_dir, temperature=0.0, num_generations_per_prompt=1), "generate"), inputs, str(tmp_path / "out"))
    rows = completions(tmp_path / "out")
    assert metrics["completions"] == len(rows) == 12 and [row["prompt_index"] for row in rows] == list(range(12))
    export.run(OmegaConf.create({"export": {"dtype": "float32", "max_shard_size": "2GB", "destination": None}}), inputs, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    prompts = Prompts(Prepared(inputs["data"]), "train")
    eos = Prepared(inputs["data"]).tokenizer["eos_token_id"]
    for row in rows:
        ids = torch.tensor([prompts.tokens(row["prompt_index"])])
        with torch.no_grad():
            theirs = hf.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=eos, pad_token_id=eos)[0, ids.shape[1] :].tolist()
        assert row["tokens"] == theirs and row["prompt_tokens"] == ids[0].tolist(), row
        assert row["prompt"] == prompts.text[row["prompt_index"]] and row["truncated"] == (len(theirs) == 6 and theirs[-1] != eos)


def test_samples_are_fixed_by_the_seed(demo_dir, inputs, tmp_path):
    runs = {
        name: generate.run(typed(generate_cfg(demo_dir, seed=seed), "generate"), inputs, str(tmp_path / name))
        for name, seed in (("a", 0), ("b", 0), ("c", 1))
    }
    a, b, c = (completions(tmp_path / name) for name in runs)
    assert a == b and a != c and len(a) == 36
    assert len({tuple(row["tokens"]) for row in a}) > 12  # 3 samples of a prompt at temperature 1 differ
    assert all(row["logp"] < 0 and len(row["tokens"]) <= 6 for row in a)


def write_completions(folder: Path, rows: list[dict]) -> str:
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / generate.FILE)
    return str(folder)


def test_score_keeps_each_prompts_best_and_pairs_it_with_its_worst(tmp_path):
    """A worked example, math-verify deciding: "", "5", "six", "5.0" and "x" for 2+3 reward 0, 1,
    0, 1, 0: the best is the first right one, the worst the first wrong one that is not empty;
    7 * 6 with every answer wrong gives no SFT row at min_reward 1 and no pair (no margin)."""
    texts = {0: ("What is 2+3?", "5", ["", "5", "six", "5.0", "x"]), 1: ("What is 7*6?", "42", ["41", "40", "7", "6"])}
    rows = [
        {
            "prompt_index": i,
            "sample": j,
            "prompt": p,
            "answer": a,
            "prompt_tokens": [1],
            "completion": c,
            "tokens": [5],
            "logp": -1.0,
            "truncated": False,
        }
        for i, (p, a, cs) in texts.items()
        for j, c in enumerate(cs)
    ]
    cfg = typed({"score": {"environment": [{"name": "exact_match"}], "min_reward": 1.0}}, "score")
    metrics = score.run(cfg, {"completions": write_completions(tmp_path / "gen", rows)}, str(tmp_path / "out"))
    assert metrics == {"reward_mean": 2 / 9, "best_reward_mean": 0.5, "sft_rows": 1, "preference_pairs": 1}
    read = lambda name: [json.loads(line) for line in (tmp_path / "out" / name).read_text().splitlines()]  # noqa: E731
    assert read("sft.jsonl") == [{"messages": [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]}]
    assert read("preference.jsonl") == [{"prompt": "What is 2+3?", "chosen": "5", "rejected": "six"}]
    assert [row["reward"] for row in pq.read_table(tmp_path / "out" / "scored.parquet").to_pylist()] == [0.0, 1.0, 0.0, 1.0, 0.0] + [0.0] * 4


def test_prep_builds_the_next_rounds_sft_data_from_a_score_output(demo_dir, inputs, tmp_path):
    """generate -> score -> prep's `generated` input: prep's SFT train split is score's best
    completions (their count, their text in the rows), its val split the configured held-out set."""
    generate.run(typed(generate_cfg(demo_dir), "generate"), inputs, str(tmp_path / "gen"))
    score.run(typed({"score": {"environment": [{"name": "closeness"}]}}, "score"), {"completions": str(tmp_path / "gen")}, str(tmp_path / "score"))
    chosen = [json.loads(line) for line in (tmp_path / "score" / "sft.jsonl").read_text().splitlines()]
    assert len(chosen) == 12  # no min_reward: every prompt's best
    data = demo_dir / "data"
    spec = {"train": "unread.jsonl", "val": str(data / "sft_val.jsonl"), "val_fraction": 0.0, "format": "input_output"}
    cfg = {
        "prep": {},
        "data": {"sft": spec, "preference": None, "prompts": None, "seq_length": 64, "max_prompt_length": 32, "seed": 0, "packing": False},
        "model": {"tokenizer": str(demo_dir / "tokenizer"), "chat_template": None},
    }
    metrics = prep.run(typed(cfg, "prep"), {"generated": str(tmp_path / "score")}, str(tmp_path / "prep"))
    assert metrics["sft.train.rows"] == 12 and metrics["sft.val.rows"] == len((data / "sft_val.jsonl").read_text().splitlines())
    rows = PackedSFT(Prepared(str(tmp_path / "prep")), "train")
    assert len(rows) == 12


FAST = [  # each stage as short as shows the graph, its caching and its data flow
    "sft.trainer.max_steps=20",
    "sft.optim.warmup_steps=2",
    "sft.trainer.val_check_interval=20",
    "sft.trainer.limit_val_batches=1",
    "generate.num_prompts=32",
    "eval.num_generation_samples=16",
    "eval.limit_batches=1",
]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_rejection_sampling_reruns_from_cache_and_a_scorer_edit_reruns_score_onward(base_overrides):
    from flows.align import align

    sft_rs = ["trainer.max_steps=4", "optim.warmup_steps=1", "global_batch_size=1", "micro_batch_size=1"]  # its rows pack into a few
    overrides = [*base_overrides, *FAST, *(f"pipeline.stages.sft_rs.{o}" for o in sft_rs), "score.min_reward=0.0"]
    first = align(pipeline="rejection_sampling", overrides=overrides)
    assert list(first) == ["prep", "convert", "sft", "generate", "score", "prep_rs", "sft_rs", "eval", "export"]
    assert not any(r.cached for r in first.values())
    rows = first["score"].metrics["sft_rows"]  # each prompt's best non-empty completion
    assert first["generate"].metrics["completions"] == 32 * 4 and 0 < rows <= 32 and first["prep_rs"].metrics["sft.train.rows_in"] == rows
    assert {"sft_rs.accuracy", "sft.accuracy"} <= set(first["eval"].metrics)
    again = align(pipeline="rejection_sampling", overrides=overrides)
    assert all(r.cached for r in again.values())
    edited = align(pipeline="rejection_sampling", overrides=[*overrides, "score.environment=[{name: closeness}]"])
    assert [name for name, r in edited.items() if not r.cached] == ["score", "prep_rs", "sft_rs", "eval", "export"]
    assert edited["score"].metrics["reward_mean"] != first["score"].metrics["reward_mean"]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_online_dpo_runs_two_rounds_each_on_its_own_models_samples(base_overrides):
    from flows.align import align

    dpo_fast = ["dpo.trainer.max_steps=2", "dpo.optim.warmup_steps=1", "dpo.trainer.val_check_interval=1", "dpo.trainer.limit_val_batches=1"]
    dpo_fast += ["dpo.global_batch_size=4", "dpo.micro_batch_size=4"]  # a round's pairs: one per prompt whose best and worst differ
    overrides = [*base_overrides, *FAST, *dpo_fast, "data.preference.dev_choose_samples=64"]
    first = align(pipeline="online_dpo", overrides=overrides)
    assert [name for name in first if name.endswith("_r2")] == ["generate_r2", "score_r2", "prep_r2", "ref_r2", "dpo_r2"]
    assert first["generate_r1"].fingerprint != first["generate_r2"].fingerprint  # round 2 samples from round 1's model
    pairs = first["score_r1"].metrics["preference_pairs"]
    assert 0 < pairs <= 32 and first["prep_r1"].metrics["preference.train.rows_in"] == pairs
    assert {f"{m}.preference_accuracy" for m in ("sft", "dpo_r1", "dpo_r2")} <= set(first["eval"].metrics)
    again = align(pipeline="online_dpo", overrides=overrides)
    assert all(r.cached for r in again.values())
