"""Our SFT, DPO and reference log-prob pass against TRL's, on one tiny model, CPU, fp32.

Same model (the demo's tiny Llama), same data (the demo's arithmetic task through the same
chat template), same effective batch (micro 4 x accumulation 4 = 16 rows per step, packed
to 256 tokens for SFT), same number of steps. Each measurement runs in a fresh process so
its peak RSS (VmHWM) is its own; throughput counts real (non-pad) tokens per second of the
training loop (the reference pass: of the forward loop over the training pairs).
- ours: `alignflow.stages.sft.run` and `dpo.run` (reading the precomputed reference
  log-probs) as the pipeline runs them (checkpoints included), and the forward loop of the
  ref_logprobs stage (`pair_logprobs`);
- TRL: `SFTTrainer` (packing, bfd), `DPOTrainer` with `precompute_ref_log_probs=True`
  (training only), and TRL's precompute loop (`compute_ref_log_probs` over its dataloader).

Run: .venv/bin/python bench/train_vs_trl.py   (needs the bench extra: trl, datasets)
"""

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ, MICRO, GLOBAL, STEPS = 256, 4, 16, 30


def peak_rss_mb() -> float:
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024


def stage_cfg(stage: str, demo: Path) -> dict:
    from omegaconf import OmegaConf

    from alignflow.config.schema import DPOConfig, ModelConfig, SFTConfig

    section = OmegaConf.merge(OmegaConf.structured({"sft": SFTConfig, "dpo": DPOConfig}[stage]), {
        "micro_batch_size": MICRO, "global_batch_size": GLOBAL, "trainer": {"max_steps": STEPS, "val_check_interval": STEPS},
        "checkpoint": {"every_n_steps": STEPS}, "optim": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 0}})
    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"source": str(demo / "tiny-llama"), "tokenizer": str(demo / "tokenizer")})
    return OmegaConf.create({stage: OmegaConf.to_container(section, enum_to_str=True), "model": OmegaConf.to_container(model),
                             "ref_logprobs": {"micro_batch_size": MICRO, "parallel": {"tensor_model_parallel_size": 1,
                              "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
                              "context_parallel_size": 1, "sequence_parallel": False, "use_distributed_optimizer": False}}})


def prepare(work: Path) -> None:
    """Demo assets, prep (no val split: nothing but training is timed) and the converted model."""
    from omegaconf import OmegaConf

    from alignflow import demo
    from alignflow.config.schema import PrepConfig
    from alignflow.stages import convert, prep

    assets = demo.build(work / "demo")
    spec = {k: {"train": str(assets / "data" / f"{k}_train.jsonl"), "val": None, "val_fraction": 0.0, "format": "auto",
                "dev_choose_samples": None, "answer_key": "answer"} for k in ("sft", "preference")}
    cfg = OmegaConf.create({"prep": PrepConfig(),
                            "data": {**spec, "prompts": None, "seq_length": SEQ, "max_prompt_length": 64, "truncation": "keep_start",
                                     "packing": True, "seed": 0},
                            "model": {"source": str(assets / "tiny-llama"), "hf_config": None, "tokenizer": str(assets / "tokenizer"),
                                      "chat_template": None, "make_vocab_size_divisible_by": 128},
                            "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}}})
    prep.run(cfg, {}, str(work / "prep"))
    convert.run(cfg, {}, str(work / "model"))


def ours(kind: str, work: Path) -> dict:
    from alignflow.stages import dpo, ref_logprobs, sft

    demo, inputs = work / "demo", {"data": str(work / "prep"), "model": str(work / "model")}
    if kind == "sft":
        return {"tokens_per_s": sft.run(stage_cfg("sft", demo), inputs, str(work / "ours-sft"))["tokens_per_s"]}
    if kind == "ref":  # the stage writes the reference DPO reads; then its forward loop alone is timed, as TRL's
        from alignflow.megatron import runtime
        from alignflow.stages.eval import SINGLE_RANK, load_model
        from alignflow.train.preference import load_pairs

        ref_logprobs.run(stage_cfg("dpo", demo), inputs, str(work / "ours-ref"))
        runtime.init_parallel(SINGLE_RANK)
        model, _ = load_model(inputs["model"], 128)
        pairs = load_pairs(inputs["data"], "train", SEQ, 0)
        started = time.perf_counter()
        ref_logprobs.pair_logprobs([model], pairs, MICRO)
        return {"tokens_per_s": pairs.num_tokens(range(len(pairs))) / (time.perf_counter() - started)}
    return {"tokens_per_s": dpo.run(stage_cfg("dpo", demo), {**inputs, "ref_logprobs": str(work / "ours-ref")}, str(work / "ours-dpo"))["tokens_per_s"]}


def trl(kind: str, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    demo = work / "demo"
    model = AutoModelForCausalLM.from_pretrained(demo / "tiny-llama", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(demo / "tokenizer")
    common = dict(output_dir=str(work / f"trl-{kind}"), per_device_train_batch_size=MICRO, gradient_accumulation_steps=GLOBAL // MICRO,
                  max_steps=STEPS, learning_rate=1e-4, use_cpu=True, report_to=[], save_strategy="no", logging_steps=STEPS, seed=0)
    rows = [json.loads(line) for line in (demo / "data" / f"{'sft' if kind == 'sft' else 'preference'}_train.jsonl").read_text().splitlines()]
    if kind == "sft":
        trainer = SFTTrainer(model=model, args=SFTConfig(**common, packing=True, max_length=SEQ), train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer)
        lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
        seconds = trainer.train().metrics["train_runtime"]
        return {"tokens_per_s": sum(lengths) / len(lengths) * GLOBAL * STEPS / seconds}
    pairs = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    trainer = DPOTrainer(model=model, args=DPOConfig(**common, precompute_ref_log_probs=kind == "dpo", max_length=SEQ, beta=0.1),
                         train_dataset=pairs, processing_class=tokenizer)
    data = trainer.train_dataset
    per_pair = [len(p) * 2 + len(c) + len(r) for p, c, r in zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])] \
        if "prompt_ids" in data.column_names else [len(c) + len(r) for c, r in zip(data["chosen_input_ids"], data["rejected_input_ids"])]
    if kind == "dpo":
        seconds = trainer.train().metrics["train_runtime"]
        return {"tokens_per_s": sum(per_pair) / len(per_pair) * GLOBAL * STEPS / seconds}
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, collate_fn=trainer.data_collator, shuffle=False)
    started = time.perf_counter()
    with torch.no_grad():
        for batch in loader:
            trainer.compute_ref_log_probs(trainer.model, batch)
    return {"tokens_per_s": sum(per_pair) / (time.perf_counter() - started)}


def measure(who: str, kind: str, work: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, who, kind, str(work)], capture_output=True, text=True)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__" and len(sys.argv) == 4:  # a measurement in its own process
    who, kind, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    result = (ours if who == "ours" else trl)(kind, work)
    print(json.dumps({**result, "peak_rss_mb": peak_rss_mb()}))
elif __name__ == "__main__":
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-train-"))
    prepare(work)
    print(f"tiny Llama, {GLOBAL} rows/step (micro {MICRO}), {STEPS} steps, seq {SEQ}, fp32 CPU; tokens/s of real tokens")
    print(f"{'':<26}{'ours tok/s':>12}{'TRL tok/s':>12}{'ours MB':>10}{'TRL MB':>10}")
    for kind, label in (("sft", "SFT"), ("ref", "reference log-probs"), ("dpo", "DPO (precomputed ref)")):
        a, b = measure("ours", kind, work), measure("trl", kind, work)
        if "error" in a or "error" in b:
            print(f"{label:<26} ours: {a.get('error', 'ok')}  TRL: {b.get('error', 'ok')}")
            continue
        print(f"{label:<26}{a['tokens_per_s']:>12.0f}{b['tokens_per_s']:>12.0f}{a['peak_rss_mb']:>10.0f}{b['peak_rss_mb']:>10.0f}")
