"""Our GRPO step against TRL's `GRPOTrainer` (transformers generate, no vLLM), on one tiny model, CPU, fp32.

Same model (the demo's tiny Llama: ours converted to our Megatron layout, TRL the HF
original, so the same weights), same prompts in the same order (the demo's arithmetic
prompts through the same chat template: TRL gets conversational messages and renders them
with the tokenizer's template; the script checks its prompt ids equal our prep's), same
step: P = 8 prompts x G = 8 generations = 64 completions, all generated in one batch (every
demo prompt renders to 12 tokens, so our sampler, which batches prompts of equal length, also
makes one batch of 64 and TRL's left padding adds nothing),
exactly 32 new tokens each (sampling never stops early on either side), temperature 1,
top_p 1, no top_k; rewards by `alignflow.rewards.exact_match`; KL to a reference model with
coefficient 0.01 (so both hold and run a reference copy); one optimizer step per batch on all
64 samples in one micro batch (AdamW, constant lr 1e-5, weight decay 0.01, betas 0.9/0.98,
clip 1.0); no checkpoints or logging inside the timed region.
Each side runs in a fresh process (peak RSS, VmHWM, is its own); WARMUP steps are run
first and left out, then STEPS steps are timed.
- step time: one GRPO step, from the batch's prompts to after the optimizer step (generate
  the group completions, decode and score, reference log-probs, forward/backward, clip,
  step). Ours: `GRPOTrainer.train_step` inside the engine's loop; TRL: on_step_begin ->
  on_step_end (its `training_step`, which generates in `_prepare_inputs`, then clip and
  optimizer step).
- generated tok/s: completion tokens / seconds of the rollout generation call only. Ours:
  `alignflow.generation.generate` inside train_step (its generation_tokens_per_s metric),
  with EOS disabled (Sampling.eos_id = -1) so every row runs max_new_tokens; TRL: its
  `_generate_single_turn` (left padding, `model.generate`, cut at EOS), with
  generation_kwargs={"min_new_tokens": 32} so EOS is masked until the limit.

Measured on this machine (2 CPU cores, idle, torch's default threads), ours / TRL:
    generated tok/s 44628 / 35834 (1.25x), step 0.091 / 0.126 s (0.72x), peak RSS 613 / 684 MB.
Our sampler: KV cache, inference mode, and an inverse-CDF draw with one uniform per row
(torch.multinomial alone took a fifth of the decode time). On a machine whose cores are
busy with other work torch's OpenMP threads stall at every op and both sides slow down
many times over; pass --threads 1 there. Timings vary by 10-20% from run to run.

Run: .venv/bin/python bench/grpo_vs_trl.py [--threads N]   (needs the bench extra: trl, datasets)
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, GENERATIONS, NEW_TOKENS, WARMUP, STEPS = 8, 8, 32, 2, 5
LR, KL, SEED = 1e-5, 0.01, 1234


def peak_rss_mb() -> float:
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024


def prepare(work: Path) -> None:
    """Demo assets, prep of the prompts (no val split) and the converted model."""
    from omegaconf import OmegaConf

    from alignflow import demo
    from alignflow.config.schema import PrepConfig
    from alignflow.stages import convert, prep

    assets = demo.build(work / "demo")
    spec = {"train": str(assets / "data" / "prompts_train.jsonl"), "val": None, "val_fraction": 0.0, "format": "auto",
            "dev_choose_samples": None, "answer_key": "answer"}
    cfg = OmegaConf.create({"prep": PrepConfig(),
                            "data": {"sft": None, "preference": None, "prompts": spec, "seq_length": 256, "max_prompt_length": 64,
                                     "truncation": "keep_start", "packing": True, "seed": 0},
                            "model": {"source": str(assets / "tiny-llama"), "hf_config": None, "tokenizer": str(assets / "tokenizer"),
                                      "chat_template": None, "make_vocab_size_divisible_by": 128},
                            "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}}})
    prep.run(cfg, {}, str(work / "prep"))
    convert.run(cfg, {}, str(work / "model"))


def grpo_cfg(demo: Path):
    from omegaconf import OmegaConf

    from alignflow.config.schema import GRPOConfig, ModelConfig

    base = OmegaConf.structured(GRPOConfig)
    base.optim.min_lr = LR  # constant lr, as TRL's "constant" schedule (the default is an interpolation)
    section = OmegaConf.merge(base, {
        "num_prompts_per_step": PROMPTS, "num_generations_per_prompt": GENERATIONS, "generation_batch_size": PROMPTS * GENERATIONS,
        "micro_batch_size": PROMPTS * GENERATIONS, "global_batch_size": PROMPTS * GENERATIONS, "num_optimizer_steps_per_batch": 1,
        "max_new_tokens": NEW_TOKENS, "generation_temperature": 1.0, "generation_top_p": 1.0, "generation_top_k": None,
        "ref_policy_kl_penalty": KL, "precision": "fp32",
        "trainer": {"max_steps": WARMUP + STEPS, "val_check_interval": 0, "log_every_n_steps": 1000, "seed": SEED},
        "checkpoint": {"every_n_steps": 1000, "resume": False}, "optim": {"lr": LR, "warmup_steps": 0, "weight_decay": 0.01}})
    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"source": str(demo / "tiny-llama"), "tokenizer": str(demo / "tokenizer")})
    return tuple(OmegaConf.create(OmegaConf.to_container(c, enum_to_str=True)) for c in (section, model))  # as a stage gets them


def ours(work: Path) -> dict:
    import dataclasses

    from alignflow.checkpoint import HF_DIR
    from alignflow.losses.policy import GRPOLossConfig
    from alignflow.stages.grpo import GRPOTrainer, grpo_objective, load_data

    section, model_cfg = grpo_cfg(work / "demo")
    model_dir = work / "model"
    hf_config = json.loads((model_dir / HF_DIR / "config.json").read_text())
    trainer = GRPOTrainer(section, model_cfg, hf_config, str(model_dir), load_data(str(work / "prep")),
                          grpo_objective(GRPOLossConfig.from_stage(section)), str(work / "ours-grpo"), None, name="grpo",
                          ref_model=str(model_dir))
    steps = []  # (step seconds, generated tokens, generation seconds)
    step = trainer.train_step

    def timed_step(indices):
        started = time.perf_counter()
        stats = step(indices)
        seconds = time.perf_counter() - started
        tokens = stats.metrics["response_length"] * len(indices) * GENERATIONS
        steps.append((seconds, tokens, tokens / stats.metrics["generation_tokens_per_s"]))
        return stats

    trainer.train_step = timed_step
    try:
        trainer.setup()
        # Never stop at EOS, as TRL's min_new_tokens: every completion is max_new_tokens long.
        trainer.sampling = dataclasses.replace(trainer.sampling, eos_id=-1)
        trainer.train()
    finally:
        trainer.cleanup()
    return summarize(steps[WARMUP:])


def trl(work: Path) -> dict:
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from alignflow.rewards import exact_match
    from alignflow.train.data import DataPosition, GlobalBatches

    demo = work / "demo"
    # Our prep's prompts (ids, answer) and the raw question of each row (sample_id = its line in the jsonl).
    table = pq.read_table(next((work / "prep" / "prompts").glob("train-*.parquet")))
    questions = [json.loads(line)["prompt"] for line in (demo / "data" / "prompts_train.jsonl").read_text().splitlines()]
    # The rows in the order our trainer takes them (GlobalBatches, same seed); TRL reads them in order (no shuffle).
    batches, position, order = GlobalBatches(table.num_rows, PROMPTS, SEED), DataPosition(0, 0), []
    for _ in range(WARMUP + STEPS):
        order += batches.indices(position).tolist()
        position = batches.next(position)
    rows = table.take(order).to_pylist()
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": questions[r["sample_id"]]}], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_):
        return [exact_match("", c[0]["content"], a) for c, a in zip(completions, answer)]

    model = AutoModelForCausalLM.from_pretrained(demo / "tiny-llama", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(demo / "tokenizer")
    args = GRPOConfig(
        output_dir=str(work / "trl-grpo"), use_cpu=True, bf16=False, gradient_checkpointing=False, seed=SEED,
        report_to=[], save_strategy="no", logging_steps=1000, disable_tqdm=True, max_steps=WARMUP + STEPS,
        # one step = PROMPTS x GENERATIONS completions, generated together, one optimizer step on them
        per_device_train_batch_size=PROMPTS * GENERATIONS, gradient_accumulation_steps=1, num_generations=GENERATIONS,
        steps_per_generation=1, num_iterations=1, shuffle_dataset=False,
        max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS},
        temperature=1.0, top_p=1.0, top_k=0, beta=KL,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-8, max_grad_norm=1.0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer)

    prompt_ids = trainer._tokenize_prompts(dataset["prompt"][:PROMPTS])[0]
    ours_ids = [table.column("prompt_ids")[i].as_py() for i in order[:PROMPTS]]
    if [list(p) for p in prompt_ids] != ours_ids:
        raise RuntimeError(f"TRL's prompt ids differ from our prep's: {prompt_ids[0]} vs {ours_ids[0]}")

    generations = []  # (generated tokens, generation seconds) per call
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):
        started = time.perf_counter()
        completion_ids, logprobs = generate(*a, **kw)
        generations.append((sum(len(c) for c in completion_ids), time.perf_counter() - started))
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
    step_seconds = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - self.started)

    trainer.add_callback(StepTimer())
    trainer.train()
    if len(generations) != len(step_seconds):
        raise RuntimeError(f"{len(generations)} generation calls for {len(step_seconds)} steps")
    return summarize([(s, t, g) for s, (t, g) in zip(step_seconds, generations)][WARMUP:])


def summarize(steps: list[tuple[float, float, float]]) -> dict:
    seconds, tokens, generation = (sum(column) for column in zip(*steps))
    return {"step_s": seconds / len(steps), "generated_tokens_per_s": tokens / generation,
            "tokens_per_step": tokens / len(steps), "generation_share": generation / seconds}


def measure(who: str, work: Path, threads: str) -> dict:
    out = subprocess.run([sys.executable, __file__, who, str(work), threads], capture_output=True, text=True)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__" and len(sys.argv) == 4:  # a measurement in its own process
    who, work, threads = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if threads != "default":
        import torch

        torch.set_num_threads(int(threads))
    result = (ours if who == "ours" else trl)(work)
    print(json.dumps({**result, "peak_rss_mb": peak_rss_mb()}))
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="default", help="torch threads of both sides (default: torch's default)")
    threads = parser.parse_args().threads
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-grpo-"))
    prepare(work)
    a, b = measure("ours", work, threads), measure("trl", work, threads)
    print(f"tiny Llama GRPO, {PROMPTS} prompts x {GENERATIONS} generations x {NEW_TOKENS} new tokens (forced) per step, "
          f"KL {KL}, fp32 CPU, torch threads {threads}; mean of {STEPS} steps after {WARMUP} warm-up")
    if "error" in a or "error" in b:
        print(f"ours: {a.get('error', 'ok')}  TRL: {b.get('error', 'ok')}")
        sys.exit(1)
    print(f"{'':<22}{'ours':>10}{'TRL':>10}{'ours/TRL':>10}")
    for key, label, fmt in (("generated_tokens_per_s", "generated tok/s", ".0f"), ("step_s", "step time (s)", ".3f"),
                            ("generation_share", "generation share", ".2f"), ("tokens_per_step", "generated tok/step", ".0f"),
                            ("peak_rss_mb", "peak RSS (MB)", ".0f")):
        print(f"{label:<22}{a[key]:>10{fmt}}{b[key]:>10{fmt}}{a[key] / b[key]:>10.2f}")
