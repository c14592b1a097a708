"""SFT and DPO on the families beyond Llama: a few steps at TP2 (a MoE: EP2) give TP1's losses within 1e-5
(fp32), where the q/k norms are replicated (per head) or split with their sum of squares
all-reduced (OLMo 2's, over the whole projection), the biases split (fc1's) or added after the
reduction (the attention output's, fc2's), and Gemma's post norms follow the reduction."""

import json
import sys
from pathlib import Path

import pytest

from transformers import Gemma2Config, Gemma3TextConfig

from alignflow.job.stages import dpo, prep, ref_logprobs, sft
from alignflow.job.stages import eval as eval_stage
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import assert_same_steps, convert_case, convert_demo, stage_cfg, on_ranks  # noqa: E402

pytestmark = pytest.mark.slow
TOLERANCE = 1e-5
# case -> (demo folder, HF config changes): each family's own tensors, split over TP
CASES = {
    "qwen3-biased": ("tiny-qwen3", {"attention_bias": True}),  # q/k norms, qkv and attention output biases, tied
    "llama-biased": ("tiny-llama", {"attention_bias": True, "mlp_bias": True}),  # every bias, fc1's gated
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
}
# Random Gemmas of the demo model's shape: (HF config class, config beyond that shape). A 4-token
# window on sliding layers (documents are longer), soft-caps that bend the scores and logits.
GEMMA = {
    "gemma2": (
        Gemma2Config,
        {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 4, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    ),
    "gemma3": (
        Gemma3TextConfig,
        {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}
DEMO_SHAPE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
# case -> (`megatron_ranks.CASES` entry, config changes), for the families the demo has no model of
RANKS_CASES = {
    "olmo2-biased": ("olmo2_tied_bias", {}),  # post-norm, whole-projection q/k norms, attention biases, tied
    # fused qkv_proj / gate_up_proj, longrope on 3/4 of each head (its attention factor on those dims), tied;
    # the data's 64-token rows within the original positions
    "phi4-mini": ("phi4_mini_longrope", {"original_max_position_embeddings": 64}),
    "phi3-window": ("phi3_window", {}),  # Phi-3: fused projections, full rotary, a 4-token window
    "llama3-rope": ("llama3_rope_other", {}),  # Llama-3 rope scaling with constants Megatron-Core's own cannot take
    "mixtral": ("mixtral", {}),  # experts split over EP2 (Megatron-Core trains MoE at TP > 1 only with sequence parallelism)
}
MOE = {"mixtral"}


@pytest.fixture(scope="module")
def data(demo_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("families") / "prep"
    files = demo_dir / "data"
    spec = {
        kind: {
            "train": str(files / f"{kind}_train.jsonl"),
            "val": str(files / f"{kind}_val.jsonl"),
            "val_fraction": 0.0,
            "format": "auto",
            "dev_choose_samples": None,
            "answer_key": "answer",
        }
        for kind in ("sft", "preference")
    }
    prep.run(
        typed(
            {
                "prep": {"skip_bad_rows": False, "rows_per_shard": 10000},
                "data": {**spec, "prompts": None, "seq_length": 64, "max_prompt_length": 32, "truncation": "keep_start", "packing": True, "seed": 0},
                "model": {"tokenizer": str(demo_dir / "tokenizer"), "chat_template": None},
            }
        ),
        {},
        str(out),
    )
    return str(out)


def inputs_of(case: str, stage: str, demo_dir: Path, data: str, root: Path) -> dict:
    """The case's model converted (and, for DPO, its reference log-probs on the data)."""
    if case in RANKS_CASES:
        model = convert_case(demo_dir, root / "model", RANKS_CASES[case][0], **RANKS_CASES[case][1])
    else:
        folder, changes = CASES[case]
        if folder in GEMMA:
            folder = gemma_source(demo_dir, root / folder, *GEMMA[folder])
        model = convert_demo(demo_dir, root / "model", folder, **changes)
    inputs = {"data": data, "model": str(model)}
    if stage == "dpo":
        ref_logprobs.run(
            typed({"ref_logprobs": {"micro_batch_size": 8, "parallel": eval_stage.SINGLE_RANK}, "model": {"make_vocab_size_divisible_by": 128}}),
            inputs,
            str(root / "ref"),
        )
        inputs["ref_logprobs"] = str(root / "ref")
    return inputs


def gemma_source(demo_dir: Path, out: Path, config_cls: type, changes: dict) -> Path:
    """A random Gemma of the demo model's shape, norms random too, saved as HF saves it."""
    import torch
    from transformers import AutoModelForCausalLM

    demo = json.loads((demo_dir / "tiny-llama" / "config.json").read_text())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**{key: demo[key] for key in DEMO_SHAPE}, **changes))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)  # Gemma scales by 1 + w
    model.save_pretrained(out)
    return out


# Every family's tensors under SFT and under DPO (the same forward, another loss; plain Llama's
# TP2 DPO is tests/test_dpo.py's, the MoE's EP2 DPO too).
@pytest.mark.parametrize("case,stage", [(case, stage) for case in sorted(CASES | RANKS_CASES) for stage in ("sft", "dpo")])
def test_two_tensor_parallel_ranks_give_one_ranks_losses(demo_dir, data, tmp_path, case, stage):
    inputs = inputs_of(case, stage, demo_dir, data, tmp_path)
    section = {"trainer": {"val_check_interval": 5}, **({"loss": {"beta": 0.1}} if stage == "dpo" else {})}
    run = {"sft": sft.run, "dpo": dpo.run}[stage]
    run(typed(stage_cfg(stage, demo_dir, **section)), inputs, str(tmp_path / "tp1"))
    extra = ["--stage", "dpo", "--ref-logprobs", inputs["ref_logprobs"]] if stage == "dpo" else []
    split = {"parallel": {"expert_model_parallel_size": 2}, "resources": {"tasks_per_node": 2}} if case in MOE else {"tp": 2}
    on_ranks(2, stage_cfg(stage, demo_dir, **split, **section), inputs, tmp_path / "tp2", *extra)
    keys = ("loss", "reward_margin", "chosen_reward", "val_loss") if stage == "dpo" else ("loss", "grad_norm", "val_loss")
    assert_same_steps(tmp_path / "tp1", tmp_path / "tp2", TOLERANCE, keys=keys)
