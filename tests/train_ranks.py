"""Helpers for the SFT tests, and the job they run in a subprocess or on ranks (`on_ranks`, by
tests/ranks.py) as

    tests/train_ranks.py CFG.json DATA MODEL OUT [--stage dpo --ref-logprobs REF]
    tests/train_ranks.py CFG.json DATA MODEL OUT --stage grpo --ref-model REF
    tests/train_ranks.py CFG.json DATA MODEL OUT --stage eval (or ref_logprobs)
    tests/train_ranks.py CFG.json DATA TEACHER OUT --stage teacher_logprobs
    tests/train_ranks.py CFG.json DATA MODEL OUT --stage reward_model
    tests/train_ranks.py CFG.json DATA MODEL OUT --stage distillation --teacher-logprobs T
    python tests/train_ranks.py CFG.json DATA MODEL OUT --pause-after-checkpoint 2

Each rank calls `alignflow.job.stages.<stage>.run(cfg, {"data": DATA, "model": MODEL, ...}, OUT)`; rank 0
writes the returned metrics to OUT/result.json. `--pause-after-checkpoint` sleeps after every
checkpoint so that a test can kill the job between two checkpoints.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from ranks import run_ranks  # noqa: E402

SEQ_LENGTH = 64
RANKS = Path(__file__)
# |loss|, |grad norm|, |val loss| between runs at two layouts: fp32 rounds alike; bf16 rounds
# each layout's matmuls (split over TP, or whole) and the activations PP passes on differently.
LAYOUT_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-3}


def prep_demo(demo_dir: Path, out: Path, prompts: bool = False, preference: bool = False) -> Path:
    """The demo SFT task packed into rows of SEQ_LENGTH tokens (and its prompts, for GRPO; its
    preference pairs, for DPO and reward models)."""
    from alignflow.job.stages import prep

    data = demo_dir / "data"
    spec = {
        kind: {
            "train": str(data / f"{kind}_train.jsonl"),
            "val": str(data / f"{kind}_val.jsonl"),
            "val_fraction": 0.0,
            "format": "auto",
            "dev_choose_samples": None,
            "answer_key": "answer",
        }
        for kind in ("sft", "prompts", "preference")
    }
    prep.run(
        typed(
            {
                "prep": {"skip_bad_rows": False, "rows_per_shard": 10000},
                "data": {
                    "sft": spec["sft"],
                    "preference": spec["preference"] if preference else None,
                    "prompts": spec["prompts"] if prompts else None,
                    "seq_length": SEQ_LENGTH,
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


def convert_demo(demo_dir: Path, out: Path, folder: str = "tiny-llama", **hf_overrides) -> Path:
    """A demo model (`folder`: tiny-llama, hidden 64, 2 layers, 4 heads, 2 kv heads, or another
    of `alignflow.orchestrator.demo.MODELS`, or an HF folder's absolute path) as a model stage output; with `hf_overrides` (num_hidden_layers,
    tie_word_embeddings, attention_bias...), a random HF model of its shape with those changes
    (biases random too, so their mapping matters)."""
    source = demo_dir / folder
    if hf_overrides:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source, **hf_overrides))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.1)
        source = out.with_name(out.name + "-hf")
        model.save_pretrained(source)
    return convert_hf(demo_dir, source, out)


def convert_hf(demo_dir: Path, source: Path, out: Path) -> Path:
    """An HF folder over the demo tokenizer converted (TP1) as a model stage output at `out`."""
    from alignflow.job.stages import convert

    convert.run(
        typed(
            {
                "model": {"source": str(source), "hf_config": None, "tokenizer": str(demo_dir / "tokenizer"), "make_vocab_size_divisible_by": 128},
                "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}},
            }
        ),
        {},
        str(out),
    )
    return out


def convert_case(demo_dir: Path, out: Path, case: str, **changes) -> Path:
    """A tiny random HF model of `megatron_ranks.CASES[case]` (a family the demo has no model
    of) over the demo tokenizer's vocabulary, initialized as the demo's, `changes` over its
    config, converted as a model stage output."""
    from megatron_ranks import tiny_hf_model

    source = out.with_name(out.name + "-hf")
    tiny_hf_model(case, **{"vocab_size": 512, "max_position_embeddings": 512, "initializer_range": 0.02, **changes})[0].save_pretrained(source)
    return convert_hf(demo_dir, source, out)


def sft_cfg(demo_dir: Path, tp: int = 1, pp: int = 1, **sft) -> dict:
    """The schema's SFT defaults as plain data, with `sft` merged over them (nested dicts)."""
    return stage_cfg("sft", demo_dir, tp, pp, **sft)


def briefly_tuned(demo_dir: Path, data: str, base: str, out: Path, folder: str = "tiny-llama") -> str:
    """A demo model (`folder`, converted as `base`) fine-tuned briefly on prep's SFT data `data`
    (60 steps at lr 3e-3, one rank): it answers with numbers, some right. Its output's URI."""
    from alignflow.job.stages import sft

    cfg = sft_cfg(
        demo_dir,
        micro_batch_size=8,
        global_batch_size=16,
        trainer={"max_steps": 60, "val_check_interval": 60},
        optim={"lr": 3e-3, "warmup_steps": 5, "min_lr": 3e-4},
        checkpoint={"every_n_steps": 60},
    )
    cfg["model"]["source"] = str(demo_dir / folder)
    sft.run(typed(cfg), {"data": data, "model": base}, str(out))
    return str(out)


def stage_cfg(stage: str, demo_dir: Path, tp: int = 1, pp: int = 1, **section) -> dict:
    """The schema's defaults of a training stage (sft, dpo) as plain data, `section` merged over them."""
    from alignflow.orchestrator.config.schema import (
        DistillationConfig,
        DPOConfig,
        GRPOConfig,
        LoggingConfig,
        ModelConfig,
        RewardModelConfig,
        SFTConfig,
    )

    base = OmegaConf.structured(
        {"sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig, "distillation": DistillationConfig, "reward_model": RewardModelConfig}[stage]
    )
    base.optim.min_lr = 1e-4  # the default is an interpolation of the composed config
    overrides = {
        "resources": {"tasks_per_node": tp * pp},
        "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "trainer": {"max_steps": 5, "log_every_n_steps": 1, "val_check_interval": 5, "limit_val_batches": 2},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
    }
    merged = OmegaConf.merge(base, overrides, section)
    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"source": str(demo_dir / "tiny-llama"), "tokenizer": str(demo_dir / "tokenizer")})
    logging_cfg = OmegaConf.structured(LoggingConfig)
    logging_cfg.wandb.api_key = None
    return {
        stage: OmegaConf.to_container(merged, enum_to_str=True),
        "model": OmegaConf.to_container(model, enum_to_str=True),
        "logging": OmegaConf.to_container(logging_cfg, enum_to_str=True),
    }


def run_sft(cfg: dict, inputs: dict, out: Path) -> dict:
    """The SFT stage in this process (one rank)."""
    from alignflow.job.stages import sft

    return sft.run(typed(cfg), inputs, str(out))


def job_env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(RANKS.parents[1])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def job_args(cfg: dict, inputs: dict, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out.with_suffix(".cfg.json")
    cfg_file.write_text(json.dumps(cfg))
    return [str(RANKS), str(cfg_file), inputs["data"], inputs["model"], str(out)]


def on_ranks(nproc: int, cfg: dict, inputs: dict, out: Path, *extra: str) -> None:
    """This file's job on `nproc` ranks (the stage's metrics in OUT/result.json)."""
    run = run_ranks(nproc, RANKS, *job_args(cfg, inputs, out)[1:], *extra)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def weights(model_dir: Path) -> dict:
    """Every tensor of a torch_dist checkpoint, by name."""
    from alignflow.job.model_files.dist_io import DistCheckpointReader

    reader = DistCheckpointReader(str(model_dir))
    return {key: reader.read(key) for key in reader.keys()}


def metrics_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_hardware_use(metrics: dict, model: Path, row_length: int, passes: int) -> None:
    """A stage's hardware figures: on the CPU no MFU (no peak) and its peak RSS, on CUDA an MFU
    and torch's peak allocation; on both, model FLOPs per token
    between `passes` x 2N (N: the weight matrices a token goes through, counted on a model that
    HF builds from the config: its LM, or a reward model's classifier) and that plus PaLM's
    attention term over the whole score matrix of a full row (an upper bound: documents are no
    longer than a row, and causal)."""
    import torch
    import transformers
    from transformers import LlamaConfig

    saved = json.loads((model / "hf" / "config.json").read_text())
    config = LlamaConfig(**saved)
    with torch.device("meta"):
        hf = getattr(transformers, saved["architectures"][0])(config)
    lookup = 0 if config.tie_word_embeddings else hf.get_input_embeddings().weight.numel()  # a lookup, no product
    matrices = sum(p.numel() for p in hf.parameters() if p.dim() == 2) - lookup
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * row_length
    per_token = metrics["tflops"] * 1e12 / metrics["tokens_per_s"]
    assert 0.99 * passes * 2 * matrices <= per_token <= 1.01 * passes * (2 * matrices + attention), (per_token, matrices)
    if metrics["peak_memory_of"] == "peak RSS":
        assert metrics["mfu"] is None and 0.1 < metrics["peak_memory_gib"] < 24
    else:
        assert metrics["peak_memory_of"] == "cuda max_memory_allocated" and 0 < metrics["mfu"] < 1 and 0 < metrics["peak_memory_gib"] < 24


def assert_same_steps(reference: Path, other: Path, tolerance: float, keys=("loss", "grad_norm", "val_loss"), steps: int = 5) -> None:
    """`other`'s metrics lines are `reference`'s, step for step, within `tolerance` on `keys`."""
    expected, got = metrics_lines(reference), metrics_lines(other)
    print(f"{other.name}: max |loss - {reference.name}| = {max(abs(a['loss'] - b['loss']) for a, b in zip(expected, got)):.2e}")
    assert [line["step"] for line in got] == list(range(1, steps + 1))
    for a, b in zip(expected, got):
        for key in keys:
            if key in a:
                assert abs(b[key] - a[key]) <= tolerance, (key, a, b)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("cfg")
    parser.add_argument("data")
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--pause-after-checkpoint", type=float, default=0.0)
    parser.add_argument(
        "--stage", default="sft", choices=["sft", "dpo", "grpo", "eval", "ref_logprobs", "teacher_logprobs", "distillation", "reward_model"]
    )
    parser.add_argument("--ref-logprobs", default=None)
    parser.add_argument("--ref-model", default=None)
    parser.add_argument("--teacher-logprobs", default=None)
    args = parser.parse_args()

    from alignflow.job.stages import distillation, dpo, eval as eval_stage, grpo, ref_logprobs, reward_model, sft, teacher_logprobs
    from alignflow.job.train import checkpoints

    if args.pause_after_checkpoint:
        save = checkpoints.save

        def slow_save(*a, **kw):
            path = save(*a, **kw)
            print(f"checkpoint {path}", flush=True)
            time.sleep(args.pause_after_checkpoint)
            return path

        checkpoints.save = slow_save
    inputs = {"data": args.data, "model": args.model}
    inputs |= {
        role: path
        for role, path in (("ref_logprobs", args.ref_logprobs), ("ref_model", args.ref_model), ("teacher_logprobs", args.teacher_logprobs))
        if path
    }
    inputs |= {"baselines": []} if args.stage == "eval" else {}
    inputs |= {"teacher": inputs.pop("model")} if args.stage == "teacher_logprobs" else {}
    stage = {
        "sft": sft,
        "dpo": dpo,
        "grpo": grpo,
        "eval": eval_stage,
        "ref_logprobs": ref_logprobs,
        "teacher_logprobs": teacher_logprobs,
        "distillation": distillation,
        "reward_model": reward_model,
    }[args.stage]
    metrics = stage.run(typed(json.loads(Path(args.cfg).read_text())), inputs, args.out)
    if int(os.environ.get("RANK", 0)) == 0:
        (Path(args.out) / "result.json").write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
