"""The per-rank memory estimate (`alignflow.orchestrator.config.memory`) against independent counts: HF's own
parameter counts of real-architecture configs (dense and MoE), autograd's saved tensors of
alignflow's layers, and (slow) the peak memory of SFT runs on the CPU; every preset plans and
an impossible layout is refused at compose with its numbers."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from alignflow import PROJECT_ROOT
from alignflow.orchestrator.config.compose import ConfigError, build, compose
from alignflow.orchestrator.config.memory import GIB, Dimensions, Layout, estimate, layer_activation_bytes
from alignflow.orchestrator.config.validate import memory_estimates
from flows.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import RANKS, convert_demo, job_env, sft_cfg  # noqa: E402

PRESETS = sorted(p.stem for p in (PROJECT_ROOT / "conf" / "model").glob("*.yaml") if not p.stem.startswith("tiny_"))  # real sizes
SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)
MOE = {
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)),
}


def hf_model(config_cls, model_cls, **extra):
    model = model_cls(config_cls(**SMALL, **extra))
    return model, {**model.config.to_dict(), "architectures": [model_cls.__name__]}


@pytest.mark.parametrize("tied", [False, True])
def test_dense_parameters_are_hf_s(tied):
    model, config = hf_model(LlamaConfig, LlamaForCausalLM, tie_word_embeddings=tied)
    assert Dimensions.of(config).total_params() == model.num_parameters()


@pytest.mark.parametrize("family", MOE)
def test_moe_parameters_are_hf_s_and_experts_split_over_expert_parallel_ranks(family):
    """Experts (HF's `experts` modules) are divided over EP, the rest is whole on every rank."""
    config_cls, model_cls, extra = MOE[family]
    model, config = hf_model(config_cls, model_cls, **extra)
    dims = Dimensions.of(config)
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))  # Qwen3's, not sized
    assert dims.total_params() == model.num_parameters() - norms
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert dims.layers * dims.expert_params() == experts
    fp32 = Layout(world=4, bf16=False, micro_batch=1, seq_length=8, vocab_divisible_by=1)
    for ep in (1, 2):
        weights = estimate(dims, replace(fp32, ep=ep)).weights
        assert weights == pytest.approx(4 * (model.num_parameters() - experts - norms + experts / ep), rel=1e-3)  # + final norm
    # The distributed optimizer shards experts over world / (EP x TP x PP), the rest over DP.
    sharded = replace(fp32, distributed_optimizer=True)
    dense = model.num_parameters() - experts - norms
    assert estimate(dims, replace(sharded, ep=2)).optimizer == pytest.approx(8 * (dense / 4 + experts / 2 / 2), rel=1e-3)


def saved_activation_bytes(config: dict, dtype: torch.dtype, rows: int, seq: int) -> int:
    """Bytes of the tensors autograd keeps over one forward of alignflow's model (weights aside)."""
    from megatron_ranks import parallel_cfg

    from alignflow.job.model.decoder import LeanForward
    from alignflow.job.model.gpt import build_gpt

    [model] = build_gpt(config, parallel_cfg(), params_dtype=dtype)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, config["vocab_size"], (rows, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).expand(rows, seq)
    forward = LeanForward.of([model], seq) or model  # the lean forward where it runs (fp32, one rank), else Megatron's
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        forward(tokens, positions, None)
    return sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_keeps_what_the_estimate_counts(one_rank, dtype):
    """Per layer: the difference of saved bytes between 4 and 2 layers, within 12% (the lean
    forward keeps one MLP copy fewer than Megatron's layer, which the estimate counts)."""
    config = {**SMALL, "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160, "vocab_size": 100}
    rows, seq = 2, 128
    per_layer = (
        saved_activation_bytes({**config, "num_hidden_layers": 4}, dtype, rows, seq)
        - saved_activation_bytes({**config, "num_hidden_layers": 2}, dtype, rows, seq)
    ) / 2
    estimated = layer_activation_bytes(Dimensions.of(config), Layout(world=1, bf16=dtype == torch.bfloat16, micro_batch=rows, seq_length=seq))
    assert per_layer == pytest.approx(estimated, rel=0.12)


def plan_memory(overrides: list[str], pipeline: str = "sft_dpo", check_paths: bool = False) -> dict:
    return memory_estimates(build(pipeline, overrides, check_paths=check_paths), check_paths=check_paths)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_plans_its_memory_and_fits_its_gpus(preset, base_overrides, capsys):
    on_slurm = [*base_overrides, f"model={preset}", "launcher=slurm"]  # presets of several nodes need a cluster
    memory = plan_memory(on_slurm, "sft_grpo")
    limit = compose("sft_grpo", on_slurm, check_paths=False).launcher.gpu_memory_gib
    assert set(memory) == {"sft", "grpo"} and all(m.shape_from == "model.architecture" for m in memory.values())
    assert all(0.3 * limit * GIB < m.footprint.total < 0.9 * limit * GIB for m in memory.values())  # headroom for CUDA
    # `align plan` prints the estimate before refusing the hub id that is not in this machine's cache.
    assert main(["plan", *on_slurm]) == 2
    out = capsys.readouterr().out
    assert "estimated memory per rank in GiB" in out and "model.source:" in out and "is not in the local Hugging Face cache" in out


def test_presets_cover_the_families_of_the_issue():
    sources = {preset: compose(None, [f"model={preset}", "launcher=slurm"], check_paths=False).model.source for preset in PRESETS}
    assert set(sources.values()) >= {
        "meta-llama/Llama-3.1-8B",
        "meta-llama/Llama-3.1-70B",
        "Qwen/Qwen3-8B",
        "Qwen/Qwen3-32B",
        "Qwen/Qwen3-30B-A3B",
        "google/gemma-3-12b-pt",
        "google/gemma-3-27b-pt",
        "mistralai/Mixtral-8x7B-v0.1",
    }


def test_a_layout_that_cannot_fit_is_refused_with_its_numbers(base_overrides, capsys):
    assert main(["plan", *base_overrides, "model=llama3_1_8b", "sft.parallel.tensor_model_parallel_size=1"]) == 2
    said = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "model.source: meta-llama/Llama-3.1-8B is not in the local Hugging Face cache" in said  # said beside the layout's problem
    assert "sft: needs an estimated" in said and "more than launcher.gpu_memory_gib = 79 GiB" in said
    with pytest.raises(ConfigError) as err:
        compose("sft_dpo", [*base_overrides, "model=llama3_1_8b", "sft.parallel.tensor_model_parallel_size=1"], check_paths=False)
    message = str(err.value)
    assert "sft: needs an estimated" in message and "more than launcher.gpu_memory_gib = 79 GiB" in message
    assert "tensor 1 x pipeline 1 x expert 1 x data 8, micro_batch_size 1 x 4096 tokens, bf16, recompute none" in message
    assert "dpo:" not in message  # dpo keeps the preset's TP2
    # the same layout with full recompute fits
    compose(
        "sft_dpo",
        [*base_overrides, "model=llama3_1_8b", "sft.parallel.tensor_model_parallel_size=1", "sft.recompute_granularity=full"],
        check_paths=False,
    )


def test_the_estimate_shrinks_as_the_layout_says(base_overrides):
    """Directions a reader can check without the formula: TP, PP, the distributed optimizer and recompute each lower it."""

    def total(*overrides):
        return plan_memory([*base_overrides, "model=qwen3_8b", "launcher.gpu_memory_gib=null", *overrides])["sft"].footprint

    base = total("sft.parallel.tensor_model_parallel_size=1", "sft.recompute_granularity=none")
    assert total("sft.parallel.tensor_model_parallel_size=2", "sft.recompute_granularity=none").weights == pytest.approx(base.weights / 2, rel=0.01)
    assert total("sft.parallel.tensor_model_parallel_size=1", "sft.recompute_granularity=full").activations < base.activations / 3
    no_distopt = total("sft.parallel.tensor_model_parallel_size=1", "sft.parallel.use_distributed_optimizer=false")
    assert no_distopt.optimizer == pytest.approx(8 * base.optimizer, rel=1e-6)  # 8 data-parallel ranks
    assert total("sft.parallel.tensor_model_parallel_size=1", "sft.micro_batch_size=2").activations == pytest.approx(2 * base.activations)


def test_grpo_counts_its_frozen_reward_model_as_one_more_model(base_overrides):
    """A reward_model input adds one frozen model's weights, as the reference does (against GRPO without a KL term)."""

    def weights(pipeline: str, *overrides: str) -> float:
        return plan_memory([*base_overrides, "model=qwen3_8b", "launcher.gpu_memory_gib=null", *overrides], pipeline)["grpo"].footprint.weights

    alone, with_reference = weights("sft_grpo", "grpo.loss.ref_policy_kl_penalty=0"), weights("sft_grpo")
    assert with_reference > alone and weights("sft_rm_grpo") - with_reference == pytest.approx(with_reference - alone)


# ----------------------------------------------------------------------------- measured (slow)

SEQ = 512
# name -> (HF overrides of the demo's tiny Llama, micro batch): one mostly weights and optimizer
# state (22M parameters, 2 x 512 tokens), one mostly activations (6M parameters, 8 x 512 tokens).
SHAPES = {
    "weights": (
        dict(
            hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, head_dim=64, vocab_size=16000
        ),
        2,
    ),
    "activations": (
        dict(
            hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096
        ),
        8,
    ),
}


def prep(demo_dir: Path, out: Path) -> Path:
    from alignflow.job.stages import prep as prep_stage
    from alignflow.job.worker import typed

    data = demo_dir / "data"
    spec = {
        "train": str(data / "sft_train.jsonl"),
        "val": str(data / "sft_val.jsonl"),
        "val_fraction": 0.0,
        "format": "auto",
        "dev_choose_samples": None,
        "answer_key": "answer",
    }
    prep_stage.run(
        typed(
            {
                "prep": {"skip_bad_rows": False, "rows_per_shard": 10000},
                "data": {
                    "sft": spec,
                    "preference": None,
                    "prompts": None,
                    "seq_length": SEQ,
                    "max_prompt_length": 32,
                    "truncation": "keep_start",
                    "packing": True,
                    "seed": 0,
                },
                "model": {"tokenizer": str(demo_dir / "tokenizer"), "chat_template": None},
            }
        ),
        {},
        str(out),
    )
    return out


def measured_peak(demo_dir: Path, data: Path, model: Path, micro: int, out: Path) -> float:
    """Peak RSS of an SFT job of 2 steps (one micro batch each) in a process of its own, bytes."""
    cfg = sft_cfg(
        demo_dir,
        micro_batch_size=micro,
        global_batch_size=micro,
        precision="fp32",
        trainer={"max_steps": 2, "val_check_interval": 100, "limit_val_batches": 1},
    )
    out.mkdir(parents=True)
    (cfg_file := out.with_suffix(".json")).write_text(json.dumps(cfg))
    # glibc's dynamic mmap threshold keeps the pages of freed activations on the heap (here ~100 MiB,
    # +-30 MiB run to run); a fixed one gives every large tensor its own mapping, returned when it is
    # freed, so the peak RSS is the tensors' (as torch.cuda.max_memory_allocated on a GPU).
    env = job_env() | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run(
        [sys.executable, str(RANKS), str(cfg_file), str(data), str(model), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=RANKS.parents[1],
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((out / "result.json").read_text())
    assert metrics["peak_memory_of"] == "peak RSS"
    return metrics["peak_memory_gib"] * GIB


@pytest.mark.slow
def test_the_estimate_is_within_15_percent_of_the_measured_peak(demo_dir, base_overrides, tmp_path):
    """The CPU's peak RSS holds the interpreter, torch and Megatron (~0.55 GiB) besides the model,
    and cannot tell them apart: the same SFT job on the demo's tiny model (a shape the estimate
    puts at a few MiB) measures that, and each shape's measured peak above it is compared with
    its estimate above the tiny model's."""
    data = prep(demo_dir, tmp_path / "data")
    shapes = {"tiny": ({}, 2), **SHAPES}
    peaks, estimates = {}, {}
    for name, (hf, micro) in shapes.items():
        model = convert_demo(demo_dir, tmp_path / name, **hf) if hf else convert_demo(demo_dir, tmp_path / name)
        peaks[name] = measured_peak(demo_dir, data, model, micro, tmp_path / f"{name}-sft")
        source = tmp_path / f"{name}-hf" if hf else demo_dir / "tiny-llama"
        estimates[name] = plan_memory(
            [
                *base_overrides,
                f"model.source={source}",
                f"model.tokenizer={demo_dir}/tokenizer",
                f"data.seq_length={SEQ}",
                f"sft.micro_batch_size={micro}",
                f"sft.global_batch_size={micro}",
                "sft.precision=fp32",
            ],
            check_paths=True,
        )["sft"].footprint.total
    for name in SHAPES:
        measured, estimated = peaks[name] - peaks["tiny"], estimates[name] - estimates["tiny"]
        print(f"{name}: measured {measured / 2**20:.0f} MiB, estimated {estimated / 2**20:.0f} MiB")
        assert estimated == pytest.approx(measured, rel=0.15), (name, measured / 2**20, estimated / 2**20)
