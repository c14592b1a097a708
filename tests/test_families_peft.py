"""LoRA on the families whose layers are alignflow's own or whose HF modules fuse projections
(OLMo 2: post-norm; Phi-3: qkv_proj, gate_up_proj) exports as PEFT adapters that PEFT loads
onto the exported base with our logits."""

import json
import sys
from pathlib import Path

import pytest
import torch

from alignflow.job.stages import sft
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import convert_case, prep_demo, stage_cfg  # noqa: E402


@pytest.fixture(scope="module")
def data(demo_dir, tmp_path_factory):
    return str(prep_demo(demo_dir, tmp_path_factory.mktemp("families-peft") / "data"))


PHI3_STACKED = {r"model\.layers\.1\.mlp\.gate_up_proj": 2} | {rf"model\.layers\.{i}\.self_attn\.qkv_proj": 2 for i in range(4)}
PEFT_CASES = {  # case -> (target_modules, PEFT's target_modules, HF modules whose adapter stacks n projections)
    "olmo2": (
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
        {},
    ),  # post-norm: the adapted output is normed
    "phi4_partial_tied": (["q_proj", "v_proj", "up_proj", "*.layers.1.*.linear_fc1", "o_proj"], ["gate_up_proj", "o_proj", "qkv_proj"], PHI3_STACKED),
}


@pytest.mark.parametrize("case", PEFT_CASES)
def test_lora_exports_as_a_peft_adapter(demo_dir, data, tmp_path, case):
    """LoRA on OLMo 2 (its post-norm layers), and on Phi-3's projections (q and v of qkv_proj,
    up of gate_up_proj, gate too in layer 1 only) exported as PEFT adapters on HF's fused
    qkv_proj / gate_up_proj: PEFT's logits on the exported base are ours (the base with its
    adapters, unmerged) and the merged export's."""
    from test_convert import stage_cfg as export_cfg
    from test_lora import _hf_logits, _our_logits

    from alignflow.job.stages import export

    inputs = {"data": data, "model": str(convert_case(demo_dir, tmp_path / "model", case))}
    targets, peft_targets, stacked = PEFT_CASES[case]
    runs = {}
    for kind in ("lora", "lora_merged"):
        runs[kind] = tmp_path / kind
        sft.run(
            typed(
                stage_cfg(
                    "sft",
                    demo_dir,
                    finetuning_type=kind,
                    trainer={"max_steps": 2},
                    optim={"lr": 1e-2, "warmup_steps": 1},
                    lora={"adapter_dim": 4, "alpha": 8, "adapter_dropout": 0.0, "target_modules": targets},
                )
            ),
            inputs,
            str(runs[kind]),
        )
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
