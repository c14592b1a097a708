"""The eval stage on the demo base model, and Megatron greedy decoding against HF's."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from alignflow.config.schema import PrepConfig
from alignflow.generation import Sampling, generate
from alignflow.megatron import runtime
from alignflow.stages import convert, eval as eval_stage, prep


def prep_cfg(demo_dir):
    data = {kind: {"train": str(demo_dir / "data" / f"{kind}_train.jsonl"), "val": str(demo_dir / "data" / f"{kind}_val.jsonl"),
                   "val_fraction": 0.0, "format": "auto", "dev_choose_samples": None, "answer_key": "answer"}
            for kind in ("sft", "preference", "prompts")}
    return OmegaConf.create({
        "prep": PrepConfig(),
        "data": {"seq_length": 128, "max_prompt_length": 64, "truncation": "keep_start", "packing": True, "seed": 0, **data},
        "model": {"source": str(demo_dir / "tiny-llama"), "hf_config": None, "tokenizer": str(demo_dir / "tokenizer"),
                  "chat_template": None, "make_vocab_size_divisible_by": 128},
        "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}},
        "eval": {"limit_batches": 2, "num_generation_samples": 24, "max_new_tokens": 6, "num_examples_shown": 2, "micro_batch_size": 8},
    })


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
    assert set(metrics) == {"convert.val_loss", "convert.perplexity", "convert.preference_accuracy", "convert.accuracy"}
    assert metrics["convert.perplexity"] == pytest.approx(torch.tensor(metrics["convert.val_loss"]).exp().item(), rel=1e-6)
    assert 0 <= metrics["convert.preference_accuracy"] <= 1 and metrics["convert.accuracy"] == 0.0  # random weights
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["metrics"] == metrics and len(saved["samples"]["convert"]) == 2


def test_megatron_greedy_equals_hf_greedy(outputs, demo_dir):
    cfg, root = outputs
    hf = AutoModelForCausalLM.from_pretrained(demo_dir / "tiny-llama", attn_implementation="eager").eval()
    prompt = torch.tensor([[1, 5, 9, 42, 7, 100, 3], [1, 8, 8, 300, 2, 11, 6]])
    expected = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)[:, prompt.shape[1]:]
    runtime.init_parallel(eval_stage.SINGLE_RANK)
    try:
        model, _ = eval_stage.load_model(str(root / "convert" / "c1"), 128)
        with torch.no_grad():
            got = generate(model, prompt.tolist(), Sampling(10, eos_id=-1, vocab_size=hf.config.vocab_size), batch_size=2)
    finally:
        runtime.teardown()
    assert [c.tokens for c in got] == expected.tolist()


def test_ref_logprobs_equal_eval_response_logps(outputs, tmp_path):
    """The stage's per-pair sums equal a direct forward of each response on the same model."""
    import pyarrow.parquet as pq

    from alignflow.stages import ref_logprobs
    from alignflow.train.data import read_split

    cfg, root = outputs
    cfg = OmegaConf.merge(cfg, {"ref_logprobs": {"micro_batch_size": 4, "parallel": eval_stage.SINGLE_RANK}})
    model = str(root / "convert" / "c1")
    metrics = ref_logprobs.run(cfg, {"data": str(root / "prep" / "p1"), "model": model}, str(tmp_path / "ref"))
    got = pq.read_table(tmp_path / "ref" / "val-00000.parquet").to_pydict()
    assert metrics["val.pairs"] == len(got["sample_id"]) == 200
    pairs = read_split(str(root / "prep" / "p1" / "preference"), "val")
    runtime.init_parallel(eval_stage.SINGLE_RANK)
    try:
        net, _ = eval_stage.load_model(model, 128)
        with torch.no_grad():
            direct = {side: eval_stage.response_logps(net, pairs, side, 128, 0, 16) for side in ("chosen", "rejected")}
    finally:
        runtime.teardown()
    assert got["sample_id"] == pairs.column("sample_id").to_pylist()
    for side in ("chosen", "rejected"):
        assert torch.tensor(got[f"{side}_logp"]) == pytest.approx(direct[side].double(), abs=1e-3)
        assert min(got[f"{side}_tokens"]) >= 1
