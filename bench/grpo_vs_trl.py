"""Our GRPO step against TRL's `GRPOTrainer` (transformers generate, no vLLM), CPU, fp32: two models
x two generation batch sizes, in one run.

Models, both seeded Llamas built offline as the demo's (`demo.init_weights`; ours converted by the
convert stage, TRL the HF original, so the same weights): `demo`, the demo's 158k-parameter model
on its arithmetic prompts (12 tokens each); `1m`, 0.94M parameters (4 layers, hidden 128, 4 heads
in 2 query groups) on the same questions behind a long-tailed system text (0 to 6 sentences, half
none: 12 to 227 tokens, so a batch mixes lengths). Per step B = 8 or 64 samples (B/8 prompts x 8
generations) generated in one batch, exactly 64 new tokens each (EOS off on our side, TRL's
min_new_tokens), temperature 1; rewards `alignflow.job.rewards.exact_match`; KL 0.01 to a reference
copy; micro batches of 8 (B/8 accumulated), one AdamW step (constant lr 1e-5, clip 1.0).
Each side runs in a fresh process; WARMUP steps are left out, then the median of STEPS is taken
(so a step that a burst of another process stalled does not decide).
- step time: prompts to after the optimizer step. Ours `alignflow.job.stages.grpo.step` on the
  engine's run; TRL on_step_begin -> on_step_end (generation happens inside its first micro step).
- generated tok/s: completion tokens / seconds of the generation call (ours: the step's
  generation_tokens_per_s; TRL: its `_generate_single_turn`).
The last line is `ratio: generation <d> step <e>`: d the smallest ours/TRL generated tok/s,
e the smallest TRL/ours step time, over models and batch sizes.
On a machine whose cores are busy, torch's threads stall at every op on both sides; pass
--threads 1 there, and read the load average printed first.

Run: .venv/bin/python bench/grpo_vs_trl.py [--threads N]   (needs the bench extra: trl, datasets; --tiny: SIZES' tiny
run, one model at one batch size for 1 + 1 steps of 8 new tokens, so CI runs it end to end)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "demo": {},
    "1m": {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
}
SIZES = {  # name: (models, batch sizes, new tokens, warm-up steps, timed steps)
    "full": (tuple(SHAPES), (8, 64), 64, 2, 5),
    "tiny": (("1m",), (8,), 8, 1, 1),
}
SIZE = "tiny" if "--tiny" in sys.argv else "full"  # each measurement's process is given the flag too
MODELS, BATCHES, NEW_TOKENS, WARMUP, STEPS = SIZES[SIZE]
GENERATIONS, MICRO = 8, 8
LR, KL, SEED = 1e-5, 0.01, 1234


def prepare(work: Path) -> None:
    """Per model: HF weights, prompts (as chat messages), prep (no val split) and the converted model."""
    import numpy as np
    from omegaconf import OmegaConf
    from safetensors.numpy import save

    from alignflow.orchestrator import demo
    from alignflow.orchestrator.config.schema import PrepConfig
    from alignflow.job.stages import convert, prep

    assets, rng = demo.build(work / "demo"), np.random.default_rng(SEED)
    rows = [json.loads(line) for line in (assets / "data" / "prompts_train.jsonl").read_text().splitlines()]
    for shape in MODELS:
        overrides = SHAPES[shape]
        (work / shape / "hf").mkdir(parents=True)
        config = {**json.loads((assets / "tiny-llama" / "config.json").read_text()), **overrides}
        (work / shape / "hf" / "config.json").write_text(json.dumps(config))
        (work / shape / "hf" / "model.safetensors").write_bytes(save(demo.init_weights(config), metadata={"format": "pt"}))
        system = [" ".join(demo.SENTENCES[: min(int(rng.pareto(1.0)), 6)]) if shape != "demo" else "" for _ in rows]  # 12-227 tokens
        lines = [
            {"prompt": [{"role": "system", "content": s}] * bool(s) + [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r, s in zip(rows, system)
        ]
        (work / shape / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        spec = {
            "train": str(work / shape / "prompts.jsonl"),
            "val": None,
            "val_fraction": 0.0,
            "format": "auto",
            "dev_choose_samples": None,
            "answer_key": "answer",
        }
        cfg = OmegaConf.create(
            {
                "prep": OmegaConf.structured(PrepConfig),
                "data": {
                    "sft": None,
                    "preference": None,
                    "prompts": spec,
                    "seq_length": 512,
                    "max_prompt_length": 256,
                    "truncation": "keep_start",
                    "packing": True,
                    "seed": 0,
                },
                "model": {
                    "source": str(work / shape / "hf"),
                    "hf_config": None,
                    "tokenizer": str(assets / "tokenizer"),
                    "chat_template": None,
                    "make_vocab_size_divisible_by": 128,
                },
                "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}},
            }
        )
        prep.run(cfg, {}, str(work / shape / "prep"))
        convert.run(cfg, {}, str(work / shape / "model"))


def ours(work: Path, shape: str, batch: int) -> list[tuple[float, float, float]]:
    """(step s, generated tokens, generation s) of each step of the grpo stage's own `step`."""
    import dataclasses

    from alignflow.job.model_files import ModelOutput
    from alignflow.job.data.prepared import Prepared
    from alignflow.job.stages import grpo
    from alignflow.job.train import engine
    from alignflow.job.train.datasets import Prompts
    from alignflow.job.worker import typed

    cfg = typed(
        {
            "grpo": {
                "num_prompts_per_step": batch // GENERATIONS,
                "num_generations_per_prompt": GENERATIONS,
                "generation_batch_size": batch,
                "micro_batch_size": MICRO,
                "max_new_tokens": NEW_TOKENS,
                "generation_temperature": 1.0,
                "loss": {"ref_policy_kl_penalty": KL},
                "precision": "fp32",
                "trainer": {"max_steps": WARMUP + STEPS, "val_check_interval": 0, "log_every_n_steps": 1000, "seed": SEED},
                "checkpoint": {"every_n_steps": 1000, "resume": False},
                "optim": {"lr": LR, "min_lr": LR, "warmup_steps": 0, "weight_decay": 0.01},
            },  # constant lr, as TRL's
            "model": {"source": str(work / shape / "hf"), "tokenizer": str(work / "demo" / "tokenizer")},
            "store": {"cache_dir": str(work / "cache")},
        }
    )
    model, data, steps = str(work / shape / "model"), Prepared(str(work / shape / "prep")), []
    prompts = Prompts(data, "train")
    with engine.training("grpo", cfg, {"model": model}, str(work / f"ours-{shape}-{batch}"), len(prompts), batch // GENERATIONS) as run:
        env = grpo.environment(run, cfg.grpo, data, ModelOutput(model), 128)
        env.sampling = dataclasses.replace(env.sampling, eos_id=-1)  # every completion max_new_tokens long, as TRL's min_new_tokens
        objective = grpo.grpo_objective(cfg.grpo.loss, env.sampling)
        while run.state.step < run.total_steps:
            started = time.perf_counter()
            stats, _ = grpo.step(run, prompts, env, objective)
            engine.advance(run, stats, seconds := time.perf_counter() - started)
            tokens = stats.metrics["response_length"] * batch
            steps.append((seconds, tokens, tokens / stats.metrics["generation_tokens_per_s"]))
    return steps


def trl(work: Path, shape: str, batch: int) -> list[tuple[float, float, float]]:
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from alignflow.job.rewards import exact_match
    from alignflow.job.train.data import DataPosition, GlobalBatches

    # Our prep's rows in the order our trainer takes them (GlobalBatches, same seed); TRL reads them in order.
    table = pq.read_table(next((work / shape / "prep" / "prompts").glob("train-*.parquet")))
    lines = [json.loads(line) for line in (work / shape / "prompts.jsonl").read_text().splitlines()]
    batches, position, order = GlobalBatches(table.num_rows, batch // GENERATIONS, SEED), DataPosition(0, 0), []
    for _ in range(WARMUP + STEPS):
        order += batches.indices(position).tolist()
        position = batches.next(position)
    rows = table.take(order).to_pylist()
    dataset = Dataset.from_list([{"prompt": lines[r["sample_id"]]["prompt"], "answer": r["answer"]} for r in rows])
    args = GRPOConfig(
        output_dir=str(work / f"trl-{shape}-{batch}"),
        use_cpu=True,
        bf16=False,
        seed=SEED,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        max_steps=WARMUP + STEPS,
        shuffle_dataset=False,
        num_iterations=1,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=batch // MICRO,
        num_generations=GENERATIONS,
        max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=KL,
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.01,
        max_grad_norm=1.0,
    )

    def reward(completions, answer, **_):
        return [exact_match("", c[0]["content"], a) for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(work / shape / "hf", dtype=torch.float32),
        args=args,
        reward_funcs=reward,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(work / "demo" / "tokenizer"),
    )
    if [list(p) for p in trainer._tokenize_prompts(dataset["prompt"][:])[0]] != [r["prompt_ids"] for r in rows]:
        raise RuntimeError("TRL's prompt ids differ from our prep's")

    generations, steps, generate = [], [], trainer._generate_single_turn

    def timed_generate(*a, **kw):
        started = time.perf_counter()
        completion_ids, logprobs = generate(*a, **kw)
        generations.append((sum(len(c) for c in completion_ids), time.perf_counter() - started))
        return completion_ids, logprobs

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter() - self.started)

    trainer._generate_single_turn = timed_generate
    trainer.add_callback(StepTimer())
    trainer.train()
    if len(generations) != len(steps):
        raise RuntimeError(f"{len(generations)} generation calls for {len(steps)} steps")
    return [(s, t, g) for s, (t, g) in zip(steps, generations)]


def measure(who: str, work: Path, shape: str, batch: int, threads: str) -> dict:
    command = [sys.executable, __file__, who, str(work), shape, str(batch), threads, *["--tiny"] * (SIZE == "tiny")]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{who} {shape} B={batch} failed: {(out.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    steps = json.loads(out.stdout.strip().splitlines()[-1])[WARMUP:]
    return {
        "step_s": statistics.median(s for s, _, _ in steps),
        "tok_s": statistics.median(t / g for _, t, g in steps),
        "tokens": statistics.mean(t for _, t, _ in steps),
    }


if __name__ == "__main__" and sys.argv[1:2] in (["ours"], ["trl"]):  # one measurement in its own process
    who, work, shape, batch, threads = sys.argv[1:6]
    if threads != "default":
        import torch

        torch.set_num_threads(int(threads))
    print(json.dumps((ours if who == "ours" else trl)(Path(work), shape, int(batch))))
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="default", help="torch threads of both sides (default: torch's default)")
    parser.add_argument("--tiny", action="store_true", help="SIZES' tiny run")
    threads = parser.parse_args().threads
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; fp32 CPU, torch threads {threads}; "
        f"{NEW_TOKENS} new tokens forced, {GENERATIONS} generations per prompt, micro batch {MICRO}, median of {STEPS} steps after {WARMUP}"
    )
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-grpo-"))
    prepare(work)
    print(f"{'model':<6}{'B':>4}{'gen tok/s ours':>16}{'TRL':>8}{'ratio':>7}{'step s ours':>13}{'TRL':>8}{'TRL/ours':>9}")
    generation, step = [], []
    for shape in MODELS:
        for batch in BATCHES:
            a, b = measure("ours", work, shape, batch, threads), measure("trl", work, shape, batch, threads)
            if abs(a["tokens"] - b["tokens"]) > 0.5:
                sys.exit(f"{shape} B={batch}: {a['tokens']} generated tokens per step here, {b['tokens']} in TRL")
            generation.append(a["tok_s"] / b["tok_s"])
            step.append(b["step_s"] / a["step_s"])
            print(
                f"{shape:<6}{batch:>4}{a['tok_s']:>16.0f}{b['tok_s']:>8.0f}{generation[-1]:>7.2f}{a['step_s']:>13.3f}{b['step_s']:>8.3f}"
                f"{step[-1]:>9.2f}",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"ratio: generation {min(generation):.2f} step {min(step):.2f}")
