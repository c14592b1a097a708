"""Training on the families whose layers are alignflow's own or whose HF layout differs from
Llama's (OLMo 2: post-norm, q/k norms over the whole projection, all-reduced over TP; Phi-3:
fused qkv_proj / gate_up_proj, partial rotary): a few SFT and DPO steps at TP2 give TP1's
losses, grad norms and rewards within 1e-5 of their size (fp32: TP splits the matmuls' sums, and
Adam carries the roundings into the next steps: 2e-5 absolute on a grad norm of 7.4 at step 2);
Phi-3's LoRA exports as PEFT adapters on HF's fused modules."""

import json
import sys
from pathlib import Path

import pytest
import torch

from alignflow.stages import dpo, eval as eval_stage, prep, ref_logprobs, sft
from alignflow.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import SEQ_LENGTH, convert_case, metrics_lines, stage_cfg, torchrun  # noqa: E402

TOLERANCE = 1e-5  # relative
STEPS = {"trainer": {"max_steps": 3, "val_check_interval": 3}}


@pytest.fixture(scope="module")
def data(demo_dir, tmp_path_factory):
    """The demo's SFT and preference data, packed."""
    out = tmp_path_factory.mktemp("families") / "prep"
    files = demo_dir / "data"
    spec = {kind: {"train": str(files / f"{kind}_train.jsonl"), "val": str(files / f"{kind}_val.jsonl"), "val_fraction": 0.0,
                   "format": "auto", "dev_choose_samples": None, "answer_key": "answer"} for kind in ("sft", "preference")}
    prep.run(typed({
        "prep": {"skip_bad_rows": False, "rows_per_shard": 10000},
        "data": {**spec, "prompts": None, "seq_length": SEQ_LENGTH, "max_prompt_length": 32, "truncation": "keep_start",
                 "packing": True, "seed": 0},
        "model": {"tokenizer": str(demo_dir / "tokenizer"), "chat_template": None},
    }), {}, str(out))
    return str(out)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["olmo2_tied_bias", "phi4_partial_tied"])
def test_sft_and_dpo_steps_at_tp2_equal_tp1(demo_dir, data, tmp_path, case):
    inputs = {"data": data, "model": str(convert_case(demo_dir, tmp_path / "model", case))}
    sft_tp1, sft_tp2 = tmp_path / "sft-tp1", tmp_path / "sft-tp2"
    sft.run(typed(stage_cfg("sft", demo_dir, **STEPS)), inputs, str(sft_tp1))
    torchrun(2, stage_cfg("sft", demo_dir, tp=2, **STEPS), inputs, sft_tp2)
    assert_same_steps(sft_tp1, sft_tp2, ("loss", "grad_norm", "val_loss"))

    ref_logprobs.run(typed({"ref_logprobs": {"micro_batch_size": 8, "parallel": eval_stage.SINGLE_RANK},
                            "model": {"make_vocab_size_divisible_by": 128}}), inputs, str(tmp_path / "ref"))
    dpo_inputs = {**inputs, "ref_logprobs": str(tmp_path / "ref")}
    dpo_tp1, dpo_tp2 = tmp_path / "dpo-tp1", tmp_path / "dpo-tp2"
    dpo.run(typed(stage_cfg("dpo", demo_dir, loss={"beta": 0.1}, **STEPS)), dpo_inputs, str(dpo_tp1))
    torchrun(2, stage_cfg("dpo", demo_dir, tp=2, loss={"beta": 0.1}, **STEPS), dpo_inputs, dpo_tp2,
             "--stage", "dpo", "--ref-logprobs", dpo_inputs["ref_logprobs"])
    assert_same_steps(dpo_tp1, dpo_tp2, ("loss", "grad_norm", "reward_margin", "chosen_reward", "val_loss"))


def assert_same_steps(reference: Path, other: Path, keys: tuple[str, ...]) -> None:
    """`other`'s 3 metrics lines are `reference`'s on `keys`, within TOLERANCE of each value's size (at least 1)."""
    expected, got = metrics_lines(reference), metrics_lines(other)
    assert [line["step"] for line in got] == [1, 2, 3]
    for a, b in zip(expected, got):
        for key in (k for k in keys if k in a):
            print(f"{other.name} step {a['step']} {key}: |difference| {abs(b[key] - a[key]):.1e}")
            assert abs(b[key] - a[key]) <= TOLERANCE * max(1.0, abs(a[key])), (key, a, b)


PHI3_STACKED = {r"model\.layers\.1\.mlp\.gate_up_proj": 2} | {rf"model\.layers\.{i}\.self_attn\.qkv_proj": 2 for i in range(4)}
PEFT_CASES = {  # case -> (target_modules, PEFT's target_modules, HF modules whose adapter stacks n projections)
    "olmo2": (["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
              ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], {}),  # post-norm: the adapted output is normed
    "phi4_partial_tied": (["q_proj", "v_proj", "up_proj", "*.layers.1.*.linear_fc1", "o_proj"],
                          ["gate_up_proj", "o_proj", "qkv_proj"], PHI3_STACKED),
}


@pytest.mark.parametrize("case", PEFT_CASES)
def test_lora_exports_as_a_peft_adapter(demo_dir, data, tmp_path, case):
    """LoRA on OLMo 2 (its post-norm layers), and on Phi-3's projections (q and v of qkv_proj,
    up of gate_up_proj, gate too in layer 1 only) exported as PEFT adapters on HF's fused
    qkv_proj / gate_up_proj: PEFT's logits on the exported base are ours (the base with its
    adapters, unmerged) and the merged export's."""
    from test_convert import stage_cfg as export_cfg
    from test_lora import _hf_logits, _our_logits

    from alignflow.stages import export

    inputs = {"data": data, "model": str(convert_case(demo_dir, tmp_path / "model", case))}
    targets, peft_targets, stacked = PEFT_CASES[case]
    runs = {}
    for kind in ("lora", "lora_merged"):
        runs[kind] = tmp_path / kind
        sft.run(typed(stage_cfg("sft", demo_dir, finetuning_type=kind, trainer={"max_steps": 2},
                                optim={"lr": 1e-2, "warmup_steps": 1},
                                lora={"adapter_dim": 4, "alpha": 8, "adapter_dropout": 0.0, "target_modules": targets})),
                inputs, str(runs[kind]))
        export.run(export_cfg("unused", demo_dir), {"model": str(runs[kind])}, str(tmp_path / f"export-{kind}"))
    adapter = tmp_path / "export-lora" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == peft_targets  # every layer adapts these HF modules
    assert config["rank_pattern"] == {key: 4 * n for key, n in stacked.items()}  # n projections: rank n r, alpha n alpha
    assert config["alpha_pattern"] == {key: 8 * n for key, n in stacked.items()}
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    peft = _hf_logits(tmp_path / "export-lora", ids, adapter)
    base = _hf_logits(tmp_path / "export-lora", ids)
    merged = _hf_logits(tmp_path / "export-lora_merged", ids)
    ours = _our_logits(runs["lora"], inputs["model"], ids, peft.shape[-1])
    assert (peft - base).abs().max() > 1e-2  # the adapter matters, so the comparisons below can fail
    torch.testing.assert_close(peft, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(peft, merged, atol=1e-5, rtol=0)
