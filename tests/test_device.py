"""Every stage's step on a device that is not the CPU, so that a tensor made anywhere else fails
as it would on a GPU (`tests/accelerator.py`: device `accel`, CPU tensors inside, CUDA's rules
on mixing devices), and computes there what it computes on the CPU; generation reads the host
once a stretch of tokens; and every tensor factory in alignflow names its device."""

import ast
import sys
from pathlib import Path

import pytest
import torch

from alignflow import PROJECT_ROOT
from alignflow.job import device
from alignflow.job.data.prepared import Prepared
from alignflow.job.generation import EOS_CHECK_EVERY_DEFAULT, Sampling, generate
from alignflow.job.model import runtime
from alignflow.job.stages import distillation, dpo, eval as eval_stage, grpo, prep, ref_logprobs, sft, teacher_logprobs
from alignflow.job.forward.passes import LossTerms, Objective
from alignflow.job.train.engine import training
from alignflow.job.train.loop import supervised
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
import accelerator  # noqa: E402
from accelerator import ACCEL, DeviceMismatch  # noqa: E402
from train_ranks import convert_demo, stage_cfg  # noqa: E402

ONE_STEP = {"micro_batch_size": 2, "global_batch_size": 4, "trainer": {"max_steps": 1, "val_check_interval": 1, "limit_val_batches": 1}}
FORWARD_ONLY = {"model": {"make_vocab_size_divisible_by": 128}}
CONFIGS = {
    "sft": lambda demo: stage_cfg("sft", demo, **ONE_STEP),
    "dpo": lambda demo: stage_cfg("dpo", demo, **ONE_STEP),
    # bf16 weights (a GPU's default): Megatron's mixed-precision optimizer and its own attention in training
    "dpo_bf16": lambda demo: stage_cfg("dpo", demo, **ONE_STEP, precision="bf16"),
    # the teacher is the student: without the SFT term the gradient is rounding noise, which Adam's first step scales up
    "distillation": lambda demo: stage_cfg("distillation", demo, **ONE_STEP, loss={"sft_loss_weight": 0.5}),
    # two updates per batch: the old policy's log-probs too; the reference's with the KL term
    "grpo": lambda demo: stage_cfg(
        "grpo",
        demo,
        **ONE_STEP,
        num_prompts_per_step=2,
        num_generations_per_prompt=2,
        max_new_tokens=20,
        generation_batch_size=2,
        num_optimizer_steps_per_batch=2,
        loss={"ref_policy_kl_penalty": 0.1},
    ),
    # with recompute: Megatron's own forward and backward (not the one-rank lean ones)
    "sft_lora": lambda demo: stage_cfg("sft", demo, **ONE_STEP, finetuning_type="lora", recompute_granularity="selective"),
    "ref_logprobs": lambda demo: {"ref_logprobs": {"micro_batch_size": 2, "parallel": eval_stage.SINGLE_RANK}, **FORWARD_ONLY},
    "teacher_logprobs": lambda demo: {
        "teacher_logprobs": {"micro_batch_size": 2, "topk_logits_k": 4, "parallel": eval_stage.SINGLE_RANK},
        **FORWARD_ONLY,
    },
    "eval": lambda demo: {
        "eval": {"micro_batch_size": 2, "limit_batches": 2, "num_generation_samples": 4, "max_new_tokens": 20, "parallel": eval_stage.SINGLE_RANK},
        **FORWARD_ONLY,
    },
}
MODULES = {
    "sft": sft,
    "dpo": dpo,
    "dpo_bf16": dpo,
    "distillation": distillation,
    "grpo": grpo,
    "sft_lora": sft,
    "ref_logprobs": ref_logprobs,
    "teacher_logprobs": teacher_logprobs,
    "eval": eval_stage,
}
TIMINGS = ("tokens_per_s", "tflops", "mfu", "peak_memory_gib", "peak_memory_of", "compute_s", "generation_s")  # how fast and how big, not what
# bf16 validation attends through torch's kernels: math on accel, flash on the CPU, rounding apart in bf16
# (relative, absolute): bf16 DPO's rewards are beta x log-prob sums of a few hundredths, whose bf16
# rounding in another summation order moves them by up to about 2e-4 (its validation metrics too)
TOLERANCE = {"dpo_bf16": (1e-3, 5e-4)}


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory) -> dict:
    """A few rows of each demo data set, the demo model, its reference log-probs and top-k (on the CPU)."""
    root = tmp_path_factory.mktemp("device")
    data = demo_dir / "data"
    spec = {
        kind: {
            "train": str(data / f"{kind}_train.jsonl"),
            "val": str(data / f"{kind}_val.jsonl"),
            "val_fraction": 0.0,
            "format": "auto",
            "dev_choose_samples": rows,
            "answer_key": "answer",
        }
        for kind, rows in (("sft", 96), ("preference", 8), ("prompts", 8))
    }
    prep.run(
        typed(
            {
                "prep": {"skip_bad_rows": False, "rows_per_shard": 10000},
                "data": {**spec, "seq_length": 256, "max_prompt_length": 32, "truncation": "keep_start", "packing": True, "seed": 0},
                "model": {"tokenizer": str(demo_dir / "tokenizer"), "chat_template": None},
            }
        ),
        {},
        str(root / "prep"),
    )
    model = str(convert_demo(demo_dir, root / "base"))
    found = {"data": str(root / "prep"), "model": model, "ref_model": model, "teacher": model, "baselines": []}
    for kind, role in (("ref_logprobs", "ref_logprobs"), ("teacher_logprobs", "teacher_logprobs")):
        MODULES[kind].run(typed(CONFIGS[kind](demo_dir)), found, str(root / kind))
        found[role] = str(root / kind)
    return found


@pytest.fixture
def on_accel():
    device.use(ACCEL)
    yield ACCEL
    device.use(None)


def run_stage(kind: str, demo_dir: Path, inputs: dict, out: Path) -> dict:
    """The stage's metrics but timings; a missing one (None, e.g. no val split) as NaN, which approx compares."""
    metrics = MODULES[kind].run(typed(CONFIGS[kind](demo_dir)), inputs, str(out))
    return {k: float("nan") if v is None else v for k, v in metrics.items() if k not in TIMINGS}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_stage_on_another_device_computes_what_it_computes_on_the_cpu(kind, demo_dir, inputs, tmp_path, on_accel):
    """One step (or one pass) on accel, then the same on the CPU: the same metrics (attention
    takes torch's math kernel on accel, whose sums round differently in the last bits)."""
    reads = accelerator.host_reads
    on_device = run_stage(kind, demo_dir, inputs, tmp_path / "accel")
    assert accelerator.host_reads > reads  # it really ran there
    device.use(None)
    on_cpu = run_stage(kind, demo_dir, inputs, tmp_path / "cpu")
    rel, abs_ = TOLERANCE.get(kind, (1e-5, 1e-6))
    assert on_device == pytest.approx(on_cpu, rel=rel, abs=abs_, nan_ok=True)


def test_a_cpu_tensor_planted_in_a_dpo_step_fails_naming_the_op(demo_dir, inputs, tmp_path, on_accel):
    """A DPO loss that counts its pairs in a CPU tensor (as `dpo_objective` once did): the step
    stops at the op that meets it, named."""
    objective = dpo.dpo_objective(typed(CONFIGS["dpo"](demo_dir)).dpo.loss)

    def planted(per_token, batch) -> LossTerms:
        terms = objective.loss(per_token, batch)
        return LossTerms(terms.total, torch.tensor(batch["pairs"], dtype=torch.int64, device="cpu"), terms.metrics)

    cfg = typed(CONFIGS["dpo"](demo_dir))
    data = dpo.load_data(Prepared(inputs["data"]), inputs["ref_logprobs"])
    with pytest.raises(DeviceMismatch, match=r"device mismatch: aten\.stack\.default got tensors on accel:0 and on cpu \[\]"):
        with training("dpo", cfg, inputs, str(tmp_path / "out"), len(data.train), cfg.dpo.global_batch_size) as run:
            supervised(run, data, Objective(objective.forward, planted, objective.metric_names))


def test_generation_reads_the_host_once_a_stretch_and_samples_what_the_cpu_samples(demo_dir, inputs, on_accel):
    """Sampled completions of mixed lengths in several batches, some ending early at EOS: on accel
    the host learns whether a batch has ended once every EOS_CHECK_EVERY_DEFAULT tokens, and
    the completions (and the draws of the batches after an early end) are the CPU's."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    runtime.init_parallel(eval_stage.SINGLE_RANK)
    try:
        chunks, _ = eval_stage.load_chunks(inputs["model"], eval_stage.SINGLE_RANK, 128, torch.float32)
        sampling = Sampling(max_new_tokens=24, eos_id=-1, vocab_size=chunks[0].vocab_size, temperature=1.0)
        eos = generate(chunks, prompts, sampling, batch_size=1, seed=3)[0].tokens[5]  # a token some rows draw early
        sampling = Sampling(max_new_tokens=24, eos_id=eos, vocab_size=sampling.vocab_size, temperature=1.0)
        reads = accelerator.host_reads
        on_device = generate(chunks, prompts, sampling, batch_size=1, seed=3)
        reads = accelerator.host_reads - reads
        device.use(None)
        chunks, _ = eval_stage.load_chunks(inputs["model"], eval_stage.SINGLE_RANK, 128, torch.float32)
        on_cpu = generate(chunks, prompts, sampling, batch_size=1, seed=3)
    finally:
        runtime.teardown()
    assert [c.tokens for c in on_device] == [c.tokens for c in on_cpu]
    assert any(not c.truncated and len(c.tokens) < 24 for c in on_cpu) and any(c.truncated for c in on_cpu)
    assert on_device[0].logps == pytest.approx(on_cpu[0].logps, abs=1e-5)
    batches, stretches = 4, -(-24 // EOS_CHECK_EVERY_DEFAULT)
    assert reads <= batches * (stretches + 2)  # + the padding check and the final read of the tokens (a read a token: 4 x 26)


# torch's factories that make a tensor (or generator) on the CPU unless told otherwise
FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "linspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "Generator",
}


def test_every_tensor_factory_in_alignflow_says_where():
    """Where the step tests do not reach: every factory call names its device, the rank's
    (`alignflow.job.device.device()`, an input's) or "cpu" for host data on purpose."""
    silent = []
    for path in sorted((PROJECT_ROOT / "alignflow").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES
                and ast.unparse(node.func.value) == "torch"
                and not any(k.arg == "device" for k in node.keywords)
            ):
                silent.append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not silent, "tensors made without a device:\n" + "\n".join(silent)
