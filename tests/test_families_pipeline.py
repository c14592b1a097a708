"""The demo pipeline on the other families' tiny models: prep -> convert -> sft -> ref_logprobs
-> dpo -> eval -> export end to end, and HF loads what it exports."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flows.align import align

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]
FAST = [
    "sft.trainer.max_steps=2",
    "sft.optim.warmup_steps=1",
    "sft.trainer.val_check_interval=1",
    "sft.trainer.limit_val_batches=1",
    "dpo.trainer.max_steps=2",
    "dpo.optim.warmup_steps=1",
    "dpo.trainer.val_check_interval=1",
    "dpo.trainer.limit_val_batches=1",
    "eval.num_generation_samples=4",
    "eval.limit_batches=1",
    "data.preference.dev_choose_samples=64",
]
# conf/model preset -> (its demo folder, HF architecture, a weight only that family has: it must have trained)
PRESETS = {
    "tiny_qwen3": ("tiny-qwen3", "Qwen3ForCausalLM", "model.layers.1.self_attn.k_norm.weight"),
    "tiny_qwen3_moe": ("tiny-qwen3-moe", "Qwen3MoeForCausalLM", "model.layers.1.mlp.gate.weight"),  # the router; eval generates through experts
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_sft_dpo_runs_end_to_end_and_exports_what_hf_loads(preset, base_overrides, demo_dir):
    folder, architecture, family_weight = PRESETS[preset]
    results = align(pipeline="sft_dpo", overrides=[*base_overrides, f"model={preset}", *FAST])
    assert list(results) == ["prep", "convert", "sft", "ref_logprobs", "dpo", "eval", "export"]
    for model in ("convert", "sft", "dpo"):
        assert {f"{model}.accuracy", f"{model}.preference_accuracy", f"{model}.val_loss"} <= set(results["eval"].metrics), model
    exported = Path(results["export"].uri)
    assert json.loads((exported / "config.json").read_text())["architectures"] == [architecture]
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert type(model).__name__ == architecture and not any(info.values()), info
    source = AutoModelForCausalLM.from_pretrained(demo_dir / folder)
    assert not torch.equal(model.state_dict()[family_weight], source.state_dict()[family_weight])  # trained, and exported back


def test_a_qwen3_teacher_distills_into_a_llama_student_on_the_same_tokenizer(base_overrides):
    student = "pipeline.stages.sft_student"
    fast = [
        *(o for o in FAST if not o.startswith(("dpo.", "data.preference."))),
        "teacher_logprobs.topk_logits_k=8",
        *(
            f"{stage}.{key}"
            for stage in (student, "distillation")
            for key in ("trainer.max_steps=2", "optim.warmup_steps=1", "trainer.val_check_interval=1", "trainer.limit_val_batches=1")
        ),
    ]
    results = align(pipeline="distill", overrides=[*base_overrides, "model=tiny_qwen3", *fast])
    assert results["convert"].metrics["architecture"] == "Qwen3ForCausalLM"
    assert results["convert_student"].metrics["architecture"] == "LlamaForCausalLM"
    assert results["distillation"].metrics["steps"] == 2 and "distillation.val_loss" in results["eval"].metrics
