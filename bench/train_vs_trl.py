"""Our SFT, DPO and reference log-prob pass against TRL 1.16's, CPU, fp32, on three shapes.

Shapes (same model weights, data, chat template, batch and steps on both sides):
- demo: the demo's tiny Llama (158k parameters) on the demo arithmetic task (short, even
  lengths), micro batch 4, 16 rows per step, packed to 256 tokens for SFT;
- longtail: a ~1M-parameter Llama (4 layers, hidden 128, 4 heads / 2 KV heads) on generated
  chat data whose lengths are long-tailed (lognormal, 15 to 250 tokens), micro batch 8, 32
  rows per step, packed to 512 tokens for SFT;
- mid: a 25.7M-parameter Llama (8 layers, hidden 512, 8 heads / 4 KV heads, FFN 1536) on the
  long-tailed data, micro batch 4, 16 rows per step, packed to 512 tokens for SFT.
Throughput counts real (non-pad) tokens per second over the same span on both sides: a
step's mean tokens over the median time of the training steps after WARMUP steps, step end
to step end (model build, data loading and TRL's reference precompute are outside it; the
median, so that a step a burst of another process stalled does not decide); the reference
pass: the forward loop over the training pairs, the median of REF_PASSES passes. Each
measurement runs in a fresh process.
- ours: `alignflow.job.stages.sft.run` and `dpo.run` (reading the precomputed reference log-probs)
  as the pipeline runs them, timed from their metrics.jsonl (one record per step: the step's
  tokens and tokens/s; checkpoints and validation are outside the steps); no recompute; and the
  ref_logprobs stage's forward loop;
- TRL as its expert user runs it, settings printed: `SFTTrainer` (bfd packing, padding-free),
  `DPOTrainer` with `precompute_ref_log_probs=True` (training only; its padding-free DPO is off
  in 1.16), and TRL's precompute loop (`compute_ref_log_probs` over its dataloader); fp32
  (`bf16=False`: TRL's configs default to bf16 autocast), sdpa attention, and
  `gradient_checkpointing=False` (TRL's default is on; ours does not recompute), timed by a
  callback at each step end.
Last line: `ratio: sft <a> dpo <b> ref <c>`, each the minimum over the shapes of ours / TRL.
On a machine whose cores are busy, torch's threads stall at every op on both sides; pass
--threads 1 there, and read the load averages printed first and last.

Run: .venv/bin/python bench/train_vs_trl.py [--threads N] [--shapes demo longtail mid]   (needs the bench extra: trl, datasets;
--tiny: the shape `tiny` alone, long-tailed data on a 0.14M-parameter Llama for 2 timed steps, so CI runs it end to end)
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {  # name: (micro batch, rows per step, SFT / max length, timed steps, the model's shape (None: the demo's), pairs)
    "demo": (4, 16, 256, 20, None, None),
    "longtail": (
        8,
        32,
        512,
        15,
        {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 352, "head_dim": 32},
        1000,
    ),
    "mid": (
        4,
        16,
        512,
        4,
        {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1536, "head_dim": 64},
        200,
    ),
    "tiny": (  # --tiny
        4,
        8,
        512,
        2,
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 16},
        16,
    ),
}
WARMUP = 2  # training steps left out on both sides before the timed ones
REF_PASSES = 5  # the reference pass is timed this many times on each side, the median kept
TRL_SETTINGS = {
    "bf16": False,
    "gradient_checkpointing": False,
    "attn_implementation": "sdpa",
    "packing_strategy": "bfd (SFT)",
    "padding_free": "True (SFT)",
}


def peak_rss_mb() -> float:
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024


def longtail_files(assets: Path, work: Path, shape: dict, pairs: int) -> tuple[Path, Path]:
    """A seeded Llama of `shape` and long-tailed chat and preference data, made offline."""
    from safetensors.numpy import save_file

    from alignflow.orchestrator import demo

    model = work / "model-hf"
    model.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((assets / "tiny-llama" / "config.json").read_text()) | shape
    (model / "config.json").write_text(json.dumps(cfg))
    save_file(demo.init_weights(cfg), str(model / "model.safetensors"), metadata={"format": "pt"})
    words = " ".join(demo.SENTENCES).replace(".", "").replace(",", "").replace(";", "").split()
    rng = np.random.default_rng(0)
    text = lambda: " ".join(rng.choice(words, size=int(np.clip(rng.lognormal(3.2, 0.8), 6, 200))))  # noqa: E731
    data = work / "data"
    data.mkdir(exist_ok=True)
    (data / "sft.jsonl").write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": text()[:60]}, {"role": "assistant", "content": text()}]}) + "\n" for _ in range(2000)
        )
    )
    (data / "preference.jsonl").write_text(
        "".join(json.dumps({"prompt": text()[:60], "chosen": text(), "rejected": text()}) + "\n" for _ in range(pairs))
    )
    return model, data


def prepare(shape: str, work: Path) -> None:
    """Assets, prep (no val split: nothing but training is timed) and the converted model."""
    from alignflow.orchestrator import demo
    from alignflow.job.stages import convert, prep
    from alignflow.job.worker import typed

    assets = demo.build(work.parent / "demo")
    _, _, _, _, model_shape, pairs = SHAPES[shape]
    model, data = (assets / "tiny-llama", assets / "data") if model_shape is None else longtail_files(assets, work, model_shape, pairs)
    files = (
        {"sft": "sft_train.jsonl", "preference": "preference_train.jsonl"}
        if shape == "demo"
        else {"sft": "sft.jsonl", "preference": "preference.jsonl"}
    )
    cfg = typed(
        {
            "data": {kind: {"train": str(data / name)} for kind, name in files.items()} | {"prompts": None, "seq_length": SHAPES[shape][2]},
            "model": {"source": str(model), "tokenizer": str(assets / "tokenizer")},
        }
    )
    prep.run(cfg, {}, str(work / "prep"))
    convert.run(cfg, {}, str(work / "model"))
    (work / "shape.json").write_text(
        json.dumps({"hf": str(model), "tokenizer": str(assets / "tokenizer"), "data": {k: str(data / v) for k, v in files.items()}})
    )


def ours(kind: str, shape: str, work: Path) -> dict:
    from alignflow.job.stages import dpo, ref_logprobs, sft
    from alignflow.job.worker import typed

    micro, rows, _, steps = SHAPES[shape][:4]
    total = WARMUP + steps
    section = {
        "micro_batch_size": micro,
        "global_batch_size": rows,
        "precision": "fp32",
        "recompute_granularity": "none",
        "trainer": {"max_steps": total, "val_check_interval": total, "log_every_n_steps": 1},
        "checkpoint": {"every_n_steps": total},
        "optim": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 0},
    }
    cfg = typed({"sft": section, "dpo": section, "ref_logprobs": {"micro_batch_size": micro}, "model": {"source": str(work / "model")}})
    inputs = {"data": str(work / "prep"), "model": str(work / "model")}
    if kind == "sft":
        sft.run(cfg, inputs, str(work / "ours-sft"))
        return after_warmup(work / "ours-sft")
    if kind == "ref":  # the stage writes the reference DPO reads; then its forward loop alone is timed, as TRL's
        from alignflow.job.data.prepared import Prepared
        from alignflow.job.model import runtime
        from alignflow.job.stages.eval import SINGLE_RANK, load_model
        from alignflow.job.train.datasets import PreferencePairs

        ref_logprobs.run(cfg, inputs, str(work / "ours-ref"))
        runtime.init_parallel(SINGLE_RANK)
        model, _ = load_model(inputs["model"], 128)
        pairs = PreferencePairs(Prepared(inputs["data"]), "train")
        return {"tokens_per_s": pairs.num_tokens(range(len(pairs))) / median_seconds(lambda: ref_logprobs.pair_logprobs([model], pairs, micro))}
    dpo.run(cfg, {**inputs, "ref_logprobs": str(work / "ours-ref")}, str(work / "ours-dpo"))
    return after_warmup(work / "ours-dpo")


def after_warmup(out: Path) -> dict:
    """Tokens/s of the steps after WARMUP, from the stage's metrics.jsonl (a record per step: the
    tokens so far and that step's tokens/s, its time alone)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [(b["tokens"] - a["tokens"], b["tokens_per_s"]) for a, b in zip(records, records[1:]) if b["step"] > WARMUP]
    return {"tokens_per_s": np.mean([t for t, _ in steps]) / np.median([t / rate for t, rate in steps])}


def trl(kind: str, shape: str, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    micro, rows, length, steps = SHAPES[shape][:4]
    files = json.loads((work / "shape.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(files["hf"], dtype=torch.float32, attn_implementation=TRL_SETTINGS["attn_implementation"])
    tokenizer = AutoTokenizer.from_pretrained(files["tokenizer"])
    common = dict(
        output_dir=str(work / f"trl-{kind}"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,
        max_steps=WARMUP + steps,
        learning_rate=1e-4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=10**6,
        seed=0,
        bf16=TRL_SETTINGS["bf16"],
        gradient_checkpointing=TRL_SETTINGS["gradient_checkpointing"],
        disable_tqdm=True,
    )
    data = [json.loads(line) for line in Path(files["data"]["sft" if kind == "sft" else "preference"]).read_text().splitlines()]

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.at = []

        def on_step_end(self, args, state, control, **kwargs):
            self.at.append(time.perf_counter())

    def step_seconds(trainer) -> float:
        """The median time of the steps after WARMUP, step end to step end."""
        ends = StepEnds()
        trainer.add_callback(ends)
        trainer.train()
        return float(np.median(np.diff(ends.at[WARMUP - 1 :])))

    if kind == "sft":
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, packing=True, packing_strategy="bfd", padding_free=True, max_length=length),
            train_dataset=Dataset.from_list(data),
            processing_class=tokenizer,
        )
        lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
        return {"tokens_per_s": sum(lengths) / len(lengths) * rows / step_seconds(trainer)}
    pairs = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in data
        ]
    )
    trainer = DPOTrainer(
        model=model,
        args=DPOConfig(**common, precompute_ref_log_probs=kind == "dpo", max_length=length, beta=0.1),
        train_dataset=pairs,
        processing_class=tokenizer,
    )
    prepared = trainer.train_dataset
    per_pair = [len(p) * 2 + len(c) + len(r) for p, c, r in zip(prepared["prompt_ids"], prepared["chosen_ids"], prepared["rejected_ids"])]
    if kind == "dpo":
        return {"tokens_per_s": sum(per_pair) / len(per_pair) * rows / step_seconds(trainer)}
    loader = torch.utils.data.DataLoader(prepared, batch_size=micro, collate_fn=trainer.data_collator, shuffle=False)

    def forward_pass():
        with torch.no_grad():
            for batch in loader:
                trainer.compute_ref_log_probs(trainer.model, batch)

    return {"tokens_per_s": sum(per_pair) / median_seconds(forward_pass)}


def median_seconds(fn, passes: int = REF_PASSES) -> float:
    """The median time of `passes` calls: one pass over the pairs lasts about a second, where a
    burst of another process decides a single timing."""
    seconds = []
    for _ in range(passes):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return float(np.median(seconds))


def parameters(config: dict) -> int:
    """The parameters of an HF Llama config (a model built on the meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**config)).parameters())


def measure(who: str, kind: str, shape: str, work: Path, threads: str) -> dict:
    out = subprocess.run([sys.executable, __file__, who, kind, shape, str(work), threads], capture_output=True, text=True)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__" and len(sys.argv) == 6:  # a measurement in its own process
    who, kind, shape, work, threads = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), sys.argv[5]
    if threads != "default":
        import torch

        torch.set_num_threads(int(threads))
    result = (ours if who == "ours" else trl)(kind, shape, work)
    print(json.dumps({**result, "peak_rss_mb": peak_rss_mb()}))
elif __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="default", help="torch threads of both sides (default: torch's default)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["demo", "longtail", "mid"])
    parser.add_argument("--tiny", action="store_true", help="--shapes tiny")
    args = parser.parse_args()
    threads, shapes = args.threads, {name: SHAPES[name] for name in (["tiny"] if args.tiny else args.shapes)}
    root, ratios = Path(tempfile.mkdtemp(prefix="alignflow-bench-train-")), {"sft": [], "dpo": [], "ref": []}
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; torch threads {threads}")
    print(f"TRL settings: {TRL_SETTINGS}; ours: fp32, no recompute; both timed over the steps after {WARMUP} warm-up steps")
    for shape, (micro, rows, length, steps, _, _) in shapes.items():
        work = root / shape
        prepare(shape, work)
        params = json.loads((work / "model" / "hf" / "config.json").read_text())
        print(
            f"\n{shape} ({parameters(params) / 1e6:.2f}M parameters): micro {micro}, {rows} rows/step, {steps} timed steps, length {length}, "
            f"fp32 CPU; tokens/s of real tokens",
            flush=True,
        )
        print(f"{'':<26}{'ours tok/s':>12}{'TRL tok/s':>12}{'ours/TRL':>10}{'ours MB':>10}{'TRL MB':>10}")
        for kind, label in (("sft", "SFT"), ("ref", "reference log-probs"), ("dpo", "DPO (precomputed ref)")):
            a, b = measure("ours", kind, shape, work, threads), measure("trl", kind, shape, work, threads)
            if "error" in a or "error" in b:
                print(f"{label:<26} ours: {a.get('error', 'ok')}  TRL: {b.get('error', 'ok')}")
                ratios[kind].append(float("nan"))
                continue
            ratios[kind].append(a["tokens_per_s"] / b["tokens_per_s"])
            print(
                f"{label:<26}{a['tokens_per_s']:>12.0f}{b['tokens_per_s']:>12.0f}{ratios[kind][-1]:>10.2f}"
                f"{a['peak_rss_mb']:>10.0f}{b['peak_rss_mb']:>10.0f}"
            )
    worst = {kind: min(zip(values, shapes)) for kind, values in ratios.items()}
    print(
        "\nworst ours/TRL: "
        + ", ".join(f"{kind} {ratio:.2f} ({shape})" for kind, (ratio, shape) in worst.items())
        + ("; mid: " + ", ".join(f"{kind} {values[list(shapes).index('mid')]:.2f}" for kind, values in ratios.items()) if "mid" in shapes else "")
    )
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"ratio: sft {min(ratios['sft']):.2f} dpo {min(ratios['dpo']):.2f} ref {min(ratios['ref']):.2f}")
