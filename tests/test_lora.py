"""LoRA (finetuning_type lora / lora_merged) against HF PEFT and against itself at other layouts:
the exported PEFT adapter loaded by `peft` onto the exported base gives our logits and the
merged export's; TP2 and PP2 give TP1's losses; only the adapters train, so the optimizer
state is a small fraction of a full run's; a resumed run ends on the uninterrupted adapters;
targets that select nothing fail at compose, naming the key."""

import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from alignflow.orchestrator.config.compose import ConfigError, compose
from alignflow.job.convert import lora as targets

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import LAYOUT_TOLERANCE, assert_same_steps, convert_demo, metrics_lines, prep_demo, run_sft, sft_cfg, on_ranks, weights  # noqa: E402

LORA = {
    "finetuning_type": "lora",
    "lora": {"adapter_dim": 4, "alpha": 8, "adapter_dropout": 0.0, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]},
}


# ------------------------------------------------------------------ targets, at compose time


@pytest.mark.parametrize(
    "patterns,expected",
    [
        (
            ["linear_qkv"],
            {(0, "self_attention.linear_qkv"): ("q_proj", "k_proj", "v_proj"), (1, "self_attention.linear_qkv"): ("q_proj", "k_proj", "v_proj")},
        ),
        (["*_proj"], {(0, "self_attention.linear_proj"): ("o_proj",), (1, "self_attention.linear_proj"): ("o_proj",)}),  # the Customizer's meaning
        (
            ["q_proj", "up_proj"],
            {
                (layer, path): parts
                for layer in (0, 1)
                for path, parts in (("self_attention.linear_qkv", ("q_proj",)), ("mlp.linear_fc1", ("up_proj",)))
            },
        ),
        (["*.layers.0.*.linear_qkv"], {(0, "self_attention.linear_qkv"): ("q_proj", "k_proj", "v_proj")}),
        (["model.layers.1.mlp.gate_proj"], {(1, "mlp.linear_fc1"): ("gate_proj",)}),
    ],
)
def test_target_modules_select_hf_projections(patterns, expected):
    assert targets.select(patterns, num_layers=2) == expected


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["sft.lora.target_modules=[linear_qkv,linear_qvk]"], r"sft\.lora\.target_modules\[1\]: 'linear_qvk' matches no adaptable module"),
        (["sft.lora.target_modules=[*.layers.7.*.linear_qkv]"], r"sft\.lora\.target_modules\[0\]: '\*\.layers\.7\.\*\.linear_qkv' matches no"),
        (["sft.lora.target_modules=[]"], r"sft\.lora\.target_modules: empty"),
        (["sft.lora.adapter_dim=0"], r"sft\.lora\.adapter_dim: must be >= 1"),
        (["sft.recompute_granularity=full"], r"sft\.recompute_granularity: full recompute with LoRA is not supported"),
        (
            ["sft.lora.target_modules=[*.layers.0.*]", "sft.parallel.pipeline_model_parallel_size=2", "sft.resources.tasks_per_node=2"],
            r"sft\.lora\.target_modules: selects no module on pipeline stage 1",
        ),
    ],
)
def test_bad_lora_settings_fail_at_compose_naming_the_key(base_overrides, overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose("sft_dpo", [*base_overrides, "sft.finetuning_type=lora", *overrides])


def test_customizer_names_compose(base_overrides):
    cfg = compose("sft_lora_dpo", [*base_overrides, "sft.lora.target_modules=[*.layers.0.*.linear_qkv,*_proj]", "sft.lora.alpha=32"])
    assert cfg.sft.finetuning_type == "lora" and cfg.dpo.finetuning_type == "lora" and cfg.sft.lora.alpha == 32


# ------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-inputs")
    return {"data": str(prep_demo(demo_dir, root / "data", prompts=True)), "model": str(convert_demo(demo_dir, root / "model"))}


def lora_cfg(demo_dir, finetuning_type="lora", **section) -> dict:
    base = {**LORA, "finetuning_type": finetuning_type, "optim": {"lr": 1e-2, "warmup_steps": 1}}
    return sft_cfg(demo_dir, **OmegaConf.to_container(OmegaConf.merge(base, section)))


@pytest.fixture(scope="module")
def trained(demo_dir, inputs, tmp_path_factory):
    """The same 4 LoRA steps output as an adapter and as merged weights, and a full run's metrics."""
    root = tmp_path_factory.mktemp("lora-runs")
    metrics = {
        name: run_sft(lora_cfg(demo_dir, kind, trainer={"max_steps": 4}), inputs, root / name)
        for name, kind in (("lora", "lora"), ("merged", "lora_merged"))
    }
    metrics["full"] = run_sft(sft_cfg(demo_dir, trainer={"max_steps": 4}), inputs, root / "full")
    return root, metrics


def test_lora_output_is_the_base_by_reference_and_the_adapter(inputs, trained):
    root, metrics = trained
    out = root / "lora"
    assert not (out / "model").exists() and (out / "hf" / "config.json").exists()
    spec = json.loads((out / "lora.json").read_text())
    assert spec["base"] == inputs["model"] and spec["adapter_dim"] == 4 and spec["alpha"] == 8
    adapter = weights(out / "adapter")
    assert set(adapter) == {
        targets.adapter_key(layer, m.path, matrix, part)
        for layer in (0, 1)
        for m in targets.MODULES
        for part in m.parts
        for matrix in ("lora_A", "lora_B")
    }
    assert any(t.abs().max() > 0 for k, t in adapter.items() if "lora_B" in k)  # B starts at zero and trained
    assert set(weights(root / "lora" / "checkpoints" / "step-00000004" / "model")) == set(adapter)  # checkpoints: adapters only
    merged, base = weights(root / "merged" / "model"), weights(Path(inputs["model"]) / "model")
    assert merged.keys() == base.keys()
    embedding = "embedding.word_embeddings.weight"  # frozen: the base's, in the output's dtype (bf16 on CUDA, as a full bf16 run writes)
    assert torch.equal(merged[embedding], base[embedding].to(merged[embedding].dtype))
    assert not torch.equal(merged["decoder.layers.self_attention.linear_qkv.weight"], base["decoder.layers.self_attention.linear_qkv.weight"])
    assert metrics["lora"]["train_loss"] == pytest.approx(metrics["merged"]["train_loss"], abs=1e-6)


def test_lora_optimizer_state_is_a_small_fraction_of_a_full_run(trained):
    _, metrics = trained
    lora, full = metrics["lora"], metrics["full"]
    # 2 layers x r 4 x (in + out) of q (64 -> 64), k and v (64 -> 32), o (64 -> 64), gate and up (64 -> 176), down (176 -> 64)
    expected = 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 176) + (176 + 64))
    print(
        f"trainable {lora['trainable_params']} of {full['trainable_params']}; optimizer state "
        f"{lora['optimizer_state_bytes']} of {full['optimizer_state_bytes']} bytes"
    )
    assert lora["trainable_params"] == expected
    assert lora["optimizer_state_bytes"] == 2 * 4 * expected  # Adam's two fp32 moments
    assert lora["optimizer_state_bytes"] < 0.1 * full["optimizer_state_bytes"]


def _hf_logits(folder: Path, ids: torch.Tensor, adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(ids).logits


def _our_logits(lora_out: Path, base: str, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Our Megatron model with its adapters as trained (not merged): the base, then the adapter."""
    from megatron_ranks import megatron_logits, parallel_cfg

    from alignflow.job.model_files import ModelOutput
    from alignflow.job.model import sharded_state, lora, runtime
    from alignflow.job.model.gpt import build_gpt

    parallel = parallel_cfg()
    runtime.init_parallel(parallel)
    try:
        output = ModelOutput(str(lora_out))
        model = build_gpt(output.hf_config, parallel)[0].eval()
        sharded_state.load([model], ModelOutput(base).weights)
        lora.attach([model], lora.LoRASettings(**{k: output.lora[k] for k in lora.LoRASettings.__dataclass_fields__}), seed=0)
        sharded_state.load([model], output.adapter, "adapters")
        with torch.no_grad():
            return megatron_logits([model], ids)[..., :vocab]
    finally:
        runtime.teardown()


def test_peft_adapter_gives_our_logits_and_the_merged_exports(demo_dir, inputs, trained, tmp_path):
    from test_convert import stage_cfg

    from alignflow.job.stages import export

    root, _ = trained
    exports = {name: tmp_path / name for name in ("lora", "merged")}
    for name, out in exports.items():
        export.run(stage_cfg("unused", demo_dir), {"model": str(root / name)}, str(out))
    config = json.loads((exports["lora"] / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    vocab = json.loads((exports["lora"] / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    peft = _hf_logits(exports["lora"], ids, exports["lora"] / "adapter")
    base = _hf_logits(exports["lora"], ids)
    merged = _hf_logits(exports["merged"], ids)
    ours = _our_logits(root / "lora", inputs["model"], ids, peft.shape[-1])
    print(
        f"max |peft - ours| {(peft - ours).abs().max():.2e}, |peft - merged| {(peft - merged).abs().max():.2e}, "
        f"|peft - base| {(peft - base).abs().max():.2e}"
    )
    assert (peft - base).abs().max() > 1e-2  # the adapter matters, so the comparisons below can fail
    torch.testing.assert_close(peft, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(peft, merged, atol=1e-5, rtol=0)


def test_resumed_lora_run_ends_on_the_uninterrupted_adapters(demo_dir, inputs, tmp_path):
    """Checkpoints hold the adapters and their optimizer state; the frozen base comes back from the input model."""

    def cfg(steps):
        return lora_cfg(demo_dir, trainer={"max_steps": steps}, checkpoint={"every_n_steps": 2}, optim={"schedule": "constant", "warmup_steps": 0})

    run_sft(cfg(4), inputs, tmp_path / "straight")
    run_sft(cfg(2), inputs, tmp_path / "resumed")
    run_sft(cfg(4), inputs, tmp_path / "resumed")  # resumes from step 2
    expected, got = weights(tmp_path / "straight" / "adapter"), weights(tmp_path / "resumed" / "adapter")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert [m["loss"] for m in metrics_lines(tmp_path / "straight")][2:] == [m["loss"] for m in metrics_lines(tmp_path / "resumed")][-2:]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(demo_dir, inputs, tmp_path, tp, pp):
    """LoRA on every projection: TP2 (A replicated / B sharded on column-parallel layers, the
    reverse on row-parallel ones) and PP2 give TP1's losses, grad norms and val loss over 5 steps."""
    reference = tmp_path / "tp1"
    run_sft(lora_cfg(demo_dir, trainer={"val_check_interval": 5}), inputs, reference)
    parallel = tmp_path / f"tp{tp}pp{pp}"
    cfg = lora_cfg(
        demo_dir,
        trainer={"val_check_interval": 5},
        resources={"tasks_per_node": tp * pp},
        parallel={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
    )
    on_ranks(tp * pp, cfg, inputs, parallel)
    assert_same_steps(reference, parallel, LAYOUT_TOLERANCE["fp32"])
    ref_adapter, got_adapter = weights(reference / "adapter"), weights(parallel / "adapter")
    assert ref_adapter.keys() == got_adapter.keys()
    assert max((ref_adapter[k] - got_adapter[k]).abs().max().item() for k in ref_adapter) < 1e-4


def completion_length(prompt: str, completion: str, answer: str) -> float:
    """A reward that differs between samples even from an untrained model, so GRPO's advantages do too."""
    return float(len(completion))


def test_grpo_lora_refers_to_its_own_frozen_base(demo_dir, trained, inputs, tmp_path):
    """GRPO with LoRA on a LoRA SFT output (its adapter merged into the base), ref_model = model:
    the reference is the frozen base with the adapters disabled, so the KL is exactly 0 while B
    is still zero and grows once the adapters train; generation reads the adapted weights."""
    from test_grpo import grpo_cfg, run_grpo

    root, _ = trained
    model = str(root / "lora")
    cfg = grpo_cfg(
        demo_dir,
        **LORA,
        environment=[{"name": "test_lora:completion_length"}],
        optim={"lr": 2e-2, "warmup_steps": 0},
        generation_temperature=1.0,
        max_new_tokens=6,
    )
    result = run_grpo(cfg, {"data": inputs["data"], "model": model, "ref_model": model}, tmp_path / "grpo")
    lines = metrics_lines(tmp_path / "grpo")
    assert result["steps"] == 3 and lines[0]["kl"] == 0.0 and lines[-1]["kl"] > 0
    assert json.loads((tmp_path / "grpo" / "lora.json").read_text())["base"] == model


# ------------------------------------------------------------------ dropout, as PEFT draws it


@pytest.mark.parametrize("path", ["self_attention.linear_qkv", "mlp.linear_fc1"])
def test_dropout_draws_one_mask_per_projection_as_peft(one_rank, path):
    """With adapter_dropout 0.5, a fused module's adapter output equals PEFT's own LoRA layers (q,
    k, v / gate, up: one each, called in HF's order) on the same A, B, input and RNG state: each
    projection draws its own dropout mask, not one shared by the fused module."""
    from megatron_ranks import tiny_hf_model
    from peft import LoraConfig, inject_adapter_in_model

    from alignflow.job.model import lora
    from alignflow.job.model.gpt import build_gpt

    _, config = tiny_hf_model("llama")
    [model] = build_gpt(config, one_rank)
    lora.attach([model], lora.LoRASettings(adapter_dim=4, alpha=8, adapter_dropout=0.5, target_modules=(path.split(".")[-1],)), seed=0)
    adapter = model.decoder.layers[0].get_submodule(path).adapter.train()
    parts = adapter.spec.parts
    hf = torch.nn.ModuleDict({part: torch.nn.Linear(config["hidden_size"], adapter.lora_B[part].shape[0], bias=False) for part in parts})
    hf = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=list(parts)), hf).train()
    with torch.no_grad():
        for part in parts:
            adapter.lora_B[part].normal_()
            hf[part].base_layer.weight.zero_()  # the adapter's term alone
            hf[part].lora_A["default"].weight.copy_(adapter.lora_A[part])
            hf[part].lora_B["default"].weight.copy_(adapter.lora_B[part])
        x = torch.randn(7, 1, config["hidden_size"])
        torch.manual_seed(2)
        ours = adapter(x)
        torch.manual_seed(2)
        theirs = lora.fuse_last_dim(adapter.spec, [hf[part](x) for part in parts], adapter.config)
        torch.manual_seed(2)
        assert not torch.allclose(adapter(x), adapter(x), atol=1e-3)  # dropout is really on
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
