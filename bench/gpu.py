"""One command for a lent GPU that ends by itself within its budget (9 minutes, the wheels'
install included): the environment, the 1B-shape bench of alignflow's SFT, reference pass, DPO
and GRPO generation against TRL + HF transformers, the GPU stage tests, the GPU family tests.

Run from the repository root with `.whl/` carried (`bash infra/gpu-wheels.sh` here), on the GPU
machine's Python 3.12 and torch 2.11 (no Prefect, no hydra):
    PYTHONPATH=. python3 bench/gpu.py --install [--shape 1b|short] [--only PHASES] [--budget-s S] [--cap PHASE=S]
`--dry-run`: the same phases on CPU on the demo's tiny shape in fp32, the tests only collected.

Phases run in PHASES' order (what matters most first), each stopped at its cap and all of them
by the budget; one that has no time left does not start. Everything printed goes to
`$OUT/gpu.log` as it is printed (`--out`, default $OUT, else the work folder), each figure to
`$OUT/figures.jsonl` the moment it is measured (a side killed at its cap keeps what it measured
before), the sides' logs to `ours.log` and `trl.log`, the tests' output to `tests.log`; the last
line says what ran and what did not.

Shapes (`--shape`): `1b` (default), a random Llama of Llama-3.2-1B's sizes (hidden 2048, 16
layers, 32 heads / 8 KV heads, FFN 8192, vocab 128256, tied embeddings: 1.24 B parameters),
SFT rows packed to 4096 tokens, one row a micro batch; `short`, a shape less favourable to us: a
Llama of Qwen2.5-0.5B's sizes (hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864, vocab
151936, tied: 0.49 B), rows of 1024 tokens, 8 a micro batch, short chats and pairs, where
per-call overhead and the vocabulary's share of the FLOPs weigh more. Each is built from a
LlamaConfig, saved once and read by both sides; the demo tokenizer on generated chats,
preference pairs and the demo's prompts; bf16 with fp32 master weights on both sides; no
recompute on either side.
Each side runs in a fresh process; each measurement runs the shape's `warmup` steps (2; the
reference pass and generation: one pass, one batch), then times `steps` steps (5; one pass, all
batches) with the device synchronised at both ends; model build and data load are outside the
span on both sides. Tokens are real tokens (no padding); TFLOP/s and MFU are model FLOPs
(`alignflow.job.train.utilization`: Megatron-LM's formula, per document) over that span; peak
memory is torch's allocated CUDA memory over the span (CPU: the process's peak RSS, VmHWM).
- ours: `alignflow.job.train.engine.optimizer_step` with the SFT and DPO objectives (what the sft and
  dpo stages' loop calls each step), `alignflow.job.forward.objectives.pair_logprobs` in the
  stage's own frame (`forward_only_splits`: its precision), and `alignflow.job.generation.generate`
  on the policy (GRPO's rollouts);
- TRL 1.16 as its expert user runs it (settings printed): SFTTrainer with bfd packing (padding-
  free), DPOTrainer with precomputed reference log-probs (its padding-free DPO is disabled in
  1.16), TRL's precompute loop for the reference pass, and HF `generate` (GRPOTrainer's path
  without vLLM); flash_attention_2 where installed, else sdpa; gradient checkpointing off.
"""

import argparse
import importlib.metadata as md
import json
import os
import platform
import random
import re
import signal
import site
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

BUDGET_S = 540.0  # the whole command: the device tool's 10 minutes a command, less a minute to spare
MIN_PHASE_S = 5.0  # a phase does not start with less of the budget left
WHEELS_SITE = "/tmp/site"  # where `infra/gpu-wheels.sh install` puts them


@dataclass(frozen=True)
class Phase:
    name: str
    cap_s: float
    what: str


PHASES = (  # in order: what matters most first
    Phase("environment", 60, "the wheels' install (--install), versions, the device"),
    Phase("bench", 330, "the shape's inputs, then ours and TRL's SFT, reference pass, DPO and generation"),
    Phase("stage tests", 100, "pytest -m gpu, the stage tests"),
    Phase("family tests", 50, "pytest -m gpu, the family tests (one per model family)"),
)

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
SHAPES = {  # model; SFT rows; preference pairs (pair_micro: TRL's pairs, our packed rows per micro batch); prompts x generations; made data
    "1b": dict(
        model=LLAMA_1B,
        seq=4096,
        micro=1,
        rows=8,
        pair_micro=4,
        pairs=16,
        gen_batch=64,
        prompts=64,
        generations=4,
        max_new=256,
        warmup=2,
        steps=5,
        chats=(500, 20, 120, 150, 900),
        pair_data=(160, 20, 60, 100, 500),
    ),
    "short": dict(
        model=dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=151936,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        seq=1024,
        micro=8,
        rows=32,
        pair_micro=8,
        pairs=64,
        gen_batch=128,
        prompts=128,
        generations=4,
        max_new=128,
        warmup=2,
        steps=5,
        chats=(1500, 5, 40, 20, 200),
        pair_data=(500, 5, 30, 10, 120),
    ),
    "tiny": dict(
        model=None,
        seq=256,
        micro=2,
        rows=4,
        pair_micro=2,
        pairs=4,
        gen_batch=4,
        prompts=4,
        generations=2,
        max_new=8,
        warmup=1,
        steps=2,
        chats=(60, 5, 20, 10, 60),
        pair_data=(12, 5, 10, 5, 30),
    ),
}


def device_name():
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def environment(install: bool, out: Path, timeout_s: float) -> str:
    """The wheels installed (`--install`), then what this machine has; a word for the last line."""
    if install:
        with (out / "install.log").open("w") as log:
            code = run_capped(["bash", "infra/gpu-wheels.sh", "install"], log, timeout_s)
        print(f"wheels: {(out / 'install.log').read_text().strip().splitlines()[-1:]}", flush=True)
        if code:
            raise RuntimeError(f"infra/gpu-wheels.sh install failed ({code}): see install.log")
        site.addsitedir(WHEELS_SITE)
    import torch

    from alignflow.job.train.utilization import PEAK_SOURCE, peak_tflops

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, device {device_name() or 'CPU'}, "
        f"dense bf16 peak {peak_tflops(device_name()) or 'unknown (no MFU)'} TFLOP/s ({PEAK_SOURCE})"
    )
    for name in ("megatron-core", "transformers", "trl", "datasets", "accelerate", "liger-kernel", "flash-attn", "transformer-engine"):
        try:
            print(f"  {name} {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"  {name} absent")
    return device_name() or "CPU"


def gpu_tests(which: str, dry_run: bool, out: Path, timeout_s: float) -> str:
    """`pytest -m gpu` on the stage tests or the family tests (tests/conftest.py GPU_TESTS,
    GPU_FAMILY_TESTS), its output to tests.log as it runs; a dry run collects them and checks
    every listed test exists. Its summary for the last line."""
    sys.path.insert(0, "tests")
    from conftest import GPU_FAMILY_TESTS, GPU_TESTS

    tests = [t for t in GPU_TESTS if (t in GPU_FAMILY_TESTS) == (which == "family tests")]
    args = ["--collect-only", "-q"] if dry_run else ["-v", "-rfE", "--durations=10", f"--timeout={max(int(timeout_s) - 5, 10)}"]
    log = out / "tests.log"
    with log.open("a") as f:
        f.write(f"\n===== {which}\n")
        f.flush()
        start = log.stat().st_size
        code = run_capped([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "gpu", *args, *tests], f, timeout_s)
    text = log.read_text()[start:]
    if dry_run:
        collected = [line for line in text.splitlines() if "::" in line]
        missing = [t for t in tests if t not in {line.split("[")[0] for line in collected}]
        print(f"GPU {which}: {len(collected)} tests collected" + (f"; MISSING: {missing}" if missing else ""), flush=True)
        if missing or code:
            raise RuntimeError(f"{len(missing)} listed test(s) not collected, pytest exit {code}")
        return f"{len(collected)} collected"
    summary = next((line.strip("= ") for line in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed|error)", line)), f"exit {code}")
    print(f"GPU {which}: {summary}", flush=True)
    return summary


# ----------------------------------------------------------------------------- the inputs


def prepare(work: Path, shape: dict, dry_run: bool) -> None:
    """The demo tokenizer; a random HF Llama of the shape (the demo's tiny one in a dry run);
    chats, pairs and prompts; alignflow's prep and convert stages on them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from alignflow.orchestrator import demo
    from alignflow.job.data.prepared import Prepared
    from alignflow.job.stages import convert, prep
    from alignflow.job.train.datasets import Prompts
    from alignflow.job.worker import typed

    assets = demo.build(work / "demo")
    hf = assets / "tiny-llama"
    if not dry_run:
        base = json.loads((hf / "config.json").read_text())
        ids = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        torch.manual_seed(0)
        hf = work / "hf"
        config = LlamaConfig(**shape["model"], max_position_embeddings=shape["seq"], rms_norm_eps=1e-5, **ids)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(hf)
    words = [w.strip(".,;") for s in demo.SENTENCES for w in s.split()]
    rng = random.Random(0)
    text = lambda low, high: " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))  # noqa: E731
    n, ask_lo, ask_hi, say_lo, say_hi = shape["chats"]
    chats = [
        {"messages": [{"role": "user", "content": text(ask_lo, ask_hi)}, {"role": "assistant", "content": text(say_lo, say_hi)}]} for _ in range(n)
    ]
    n, ask_lo, ask_hi, say_lo, say_hi = shape["pair_data"]
    pairs = [{"prompt": text(ask_lo, ask_hi), "chosen": text(say_lo, say_hi), "rejected": text(say_lo, say_hi)} for _ in range(n)]
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("sft", chats), ("preference", pairs)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = {"sft": data / "sft.jsonl", "preference": data / "preference.jsonl", "prompts": assets / "data" / "prompts_train.jsonl"}
    model = {"source": str(hf), "tokenizer": str(assets / "tokenizer")}
    cfg = typed(
        {"data": {kind: {"train": str(path), "val_fraction": 0.0} for kind, path in files.items()} | {"seq_length": shape["seq"]}, "model": model}
    )
    prep.run(cfg, {}, str(work / "prep"))
    convert.run(cfg, {}, str(work / "model"))
    prompts = Prompts(Prepared(str(work / "prep")), "train")  # the same prompt tokens on both sides
    rollouts = [prompts.tokens(i) for i in range(shape["prompts"]) for _ in range(shape["generations"])]
    (work / "inputs.json").write_text(
        json.dumps({"hf": str(hf), "tokenizer": str(assets / "tokenizer"), "prompts": rollouts, "files": {k: str(v) for k, v in files.items()}})
    )


# ----------------------------------------------------------------------------- measuring


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM


def peak_gib() -> float:
    import torch

    from alignflow.job.train.utilization import peak_rss_bytes

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return peak_rss_bytes() / 2**30


FIGURES: list[Path] = []  # the figures file (`--figures`): each figure is appended the moment it is measured
SIDE: list[str] = []  # the side this process measures, named in each of its rows


def record(row: dict) -> dict:
    row = {"side": SIDE[0], **row} if SIDE else row
    for path in FIGURES:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return row


def result(kind: str, tokens: float, flops: float, seconds: float, settings: str) -> dict:
    from alignflow.job.train.utilization import figures

    row = {"kind": kind, "tokens_per_s": tokens / seconds, **figures(flops, seconds, 1, device_name()), "peak_gib": peak_gib(), "settings": settings}
    return record(row)


def ours(work: Path, shape: dict, precision: str) -> list[dict]:
    from transformers import AutoTokenizer

    from alignflow.job.data.prepared import Prepared
    from alignflow.job.generation import Sampling, generate
    from alignflow.job.forward.passes import forward_only_splits
    from alignflow.job.stages import dpo, ref_logprobs, sft
    from alignflow.job.train import engine
    from alignflow.job.train.data import dp_micro_batches
    from alignflow.job.train.datasets import PreferencePairs
    from alignflow.job.train.utilization import FORWARD, ModelShape, model_flops
    from alignflow.job.worker import typed

    paths = json.loads((work / "inputs.json").read_text())
    total = shape["warmup"] + shape["steps"]
    section = {
        "precision": precision,
        "trainer": {"max_steps": total, "val_check_interval": 10**6},
        "checkpoint": {"every_n_steps": 10**6},
        "optim": {"lr": 1e-5, "min_lr": 1e-6, "warmup_steps": 0},
        "recompute_granularity": "none",
    }
    cfg = typed(
        {
            "sft": section | {"micro_batch_size": shape["micro"], "global_batch_size": shape["rows"]},
            "dpo": section | {"micro_batch_size": shape["pair_micro"], "global_batch_size": shape["pairs"]},
            "ref_logprobs": {"micro_batch_size": shape["pair_micro"]},
            "model": {"source": str(work / "model")},
            "store": {"cache_dir": str(work / "cache")},
        }
    )
    inputs, prepared = {"data": str(work / "prep"), "model": str(work / "model")}, Prepared(str(work / "prep"))

    def train(kind: str, data, objective, then=None) -> list[dict]:
        with engine.training(kind, cfg, inputs, str(work / f"ours-{kind}"), len(data.train), cfg[kind].global_batch_size) as run:
            tokens = flops = seconds = 0.0
            for step in range(total):
                if step == shape["warmup"]:
                    reset_peak()
                indices = run.batches.indices(run.state.position)
                micro = dp_micro_batches(data.train, indices, cfg[kind].micro_batch_size, 0, 1)
                sync()
                started = time.perf_counter()
                engine.optimizer_step(run, objective, micro, data.train, data.seq_length, data.rows_per_item)
                sync()
                if step >= shape["warmup"]:
                    seconds += time.perf_counter() - started
                    tokens, flops = tokens + data.train.num_tokens(indices), flops + run.step_flops(data.train, indices)
                run.state.position = run.batches.next(run.state.position)
            out = [result(kind, tokens, flops, seconds, f"{run.dtype} weights, fp32 main weights and grads, no recompute")]
            return out + (attempt("generation", lambda: then(run)) if then else [])

    def rollouts(run) -> list[dict]:  # GRPO's generation on the policy it trains, as grpo.step calls it
        tokenizer, tokens = AutoTokenizer.from_pretrained(paths["tokenizer"]), paths["prompts"]
        sampling = Sampling(max_new_tokens=shape["max_new"], eos_id=tokenizer.eos_token_id, vocab_size=len(tokenizer), temperature=1.0)
        engine.gather_weights(run.model)
        generate(run.chunks, tokens[: shape["gen_batch"]], sampling, shape["gen_batch"], seed=0)  # warm-up
        reset_peak()
        sync()
        started = time.perf_counter()
        done = generate(run.chunks, tokens, sampling, shape["gen_batch"], seed=1)
        sync()
        seconds, new = time.perf_counter() - started, sum(len(c.tokens) for c in done)
        flops = model_flops(ModelShape.of(run.init.hf_config), [len(p) + len(c.tokens) for p, c in zip(tokens, done)], FORWARD)
        return [result("generation", new, flops, seconds, f"KV cache, batch {shape['gen_batch']}, temperature 1, {run.dtype}")]

    def reference_pass() -> list[dict]:
        measured = []

        def each(model, chunks, pairs, split):
            ref_logprobs.pair_logprobs(chunks, pairs, shape["pair_micro"])  # warm-up pass
            reset_peak()
            sync()
            started = time.perf_counter()
            ref_logprobs.pair_logprobs(chunks, pairs, shape["pair_micro"])
            sync()
            seconds, everything = time.perf_counter() - started, range(len(pairs))
            flops = model_flops(ModelShape.of(model.hf_config), pairs.document_lengths(everything), FORWARD)
            dtype = next(chunks[0].parameters()).dtype
            measured.append(result("reference", pairs.num_tokens(everything), flops, seconds, f"{dtype} weights, no grad"))
            return {}

        forward_only_splits(cfg, cfg.ref_logprobs, inputs["model"], PreferencePairs, prepared, each)
        return measured

    def preference() -> list[dict]:
        ref_logprobs.run(cfg, inputs, str(work / "ours-ref"))  # the stage: the reference log-probs DPO reads
        return train("dpo", dpo.load_data(prepared, str(work / "ours-ref")), dpo.dpo_objective(cfg.dpo.loss))

    return (
        attempt("sft", lambda: train("sft", sft.load_data(prepared), sft.SFT, then=rollouts))
        + attempt("reference", reference_pass)
        + attempt("dpo", preference)
    )


def trl(work: Path, shape: dict, on_gpu: bool) -> list[dict]:
    import importlib.util

    import torch
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from alignflow.job.train.utilization import FORWARD, TRAINING, ModelShape, model_flops

    paths = json.loads((work / "inputs.json").read_text())
    model_shape = ModelShape.of(json.loads(Path(paths["hf"], "config.json").read_text()))
    tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])
    attention = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    warmup, steps = shape["warmup"], shape["steps"]
    common = dict(
        output_dir=str(work / "trl"),
        max_steps=warmup + steps,
        learning_rate=1e-5,
        bf16=on_gpu,
        use_cpu=not on_gpu,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        logging_steps=10**6,
        seed=0,
        disable_tqdm=True,
    )
    settings = f"attn {attention}, {'fp32 weights + bf16 autocast' if on_gpu else 'fp32'}, gradient_checkpointing False"
    print(f"TRL settings: {common}, attn_implementation={attention}", flush=True)

    def load(dtype=torch.float32):
        return AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=dtype, attn_implementation=attention)

    class Span(TrainerCallback):
        """The steps after warm-up: step end to step end, device synchronised."""

        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.ends.append(time.perf_counter())
            if len(self.ends) == warmup:
                reset_peak()

        def seconds(self) -> float:
            return self.ends[warmup + steps - 1] - self.ends[warmup - 1]

    def train(trainer, kind: str, tokens_per_row: float, flops_per_row: float, rows: int, what: str) -> dict:
        span = Span()
        trainer.add_callback(span)
        trainer.train()
        return result(kind, tokens_per_row * rows * steps, flops_per_row * rows * steps, span.seconds(), f"{settings}, {what}")

    def sft() -> list[dict]:
        chats = [json.loads(line) for line in Path(paths["files"]["sft"]).read_text().splitlines()]
        args = SFTConfig(
            **common,
            packing=True,
            packing_strategy="bfd",
            padding_free=True,
            max_length=shape["seq"],
            per_device_train_batch_size=shape["micro"],
            gradient_accumulation_steps=shape["rows"] // shape["micro"],
        )
        trainer = SFTTrainer(model=load(), args=args, train_dataset=Dataset.from_list(chats), processing_class=tokenizer)
        packed = trainer.train_dataset["seq_lengths"]  # the documents of each packed row
        flops = sum(model_flops(model_shape, row, TRAINING) for row in packed)
        return [train(trainer, "sft", sum(map(sum, packed)) / len(packed), flops / len(packed), shape["rows"], "bfd packing (padding-free)")]

    def preference() -> list[dict]:
        rows = [json.loads(line) for line in Path(paths["files"]["preference"]).read_text().splitlines()]
        pairs = Dataset.from_list(
            [
                {
                    "prompt": [{"role": "user", "content": r["prompt"]}],
                    "chosen": [{"role": "assistant", "content": r["chosen"]}],
                    "rejected": [{"role": "assistant", "content": r["rejected"]}],
                }
                for r in rows
            ]
        )
        args = DPOConfig(
            **common,
            precompute_ref_log_probs=True,
            max_length=None,
            beta=0.1,
            per_device_train_batch_size=shape["pair_micro"],
            gradient_accumulation_steps=shape["pairs"] // shape["pair_micro"],
        )
        trainer = DPOTrainer(model=load(), args=args, train_dataset=pairs, processing_class=tokenizer)  # TRL's precompute once: a warm-up
        data = trainer.train_dataset
        documents = [(len(p) + len(c), len(p) + len(r)) for p, c, r in zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])]
        loader = trainer.accelerator.prepare(
            DataLoader(
                data.remove_columns(["ref_chosen_logps", "ref_rejected_logps"]),
                batch_size=shape["pair_micro"],
                collate_fn=trainer.data_collator,
                shuffle=False,
            )
        )
        reset_peak()
        sync()
        started = time.perf_counter()
        for batch in loader:  # TRL's precompute loop (`_precompute_ref_logps`), without its caching
            trainer.compute_ref_log_probs(trainer.model, batch)
        sync()
        reference = result(
            "reference",
            sum(map(sum, documents)),
            model_flops(model_shape, [n for d in documents for n in d], FORWARD),
            time.perf_counter() - started,
            f"{settings}, the policy model (TRL precomputes with it), padded pairs, no grad",
        )
        per_pair = [model_flops(model_shape, d, TRAINING) for d in documents]
        return [
            reference,
            train(
                trainer,
                "dpo",
                sum(map(sum, documents)) / len(documents),
                sum(per_pair) / len(per_pair),
                shape["pairs"],
                "precomputed reference, padded pairs (padding-free DPO is off in TRL 1.16)",
            ),
        ]

    def generation() -> list[dict]:  # GRPOTrainer's rollouts without vLLM: HF generate, left-padded batches
        model = load(torch.bfloat16 if on_gpu else torch.float32).to("cuda" if on_gpu else "cpu").eval()
        tokenizer.padding_side, prompts = "left", paths["prompts"]
        new_tokens, flops, seconds = 0, 0.0, 0.0
        for start in range(-shape["gen_batch"], len(prompts), shape["gen_batch"]):  # the first batch twice: a warm-up
            batch = tokenizer.pad({"input_ids": prompts[max(start, 0) : max(start, 0) + shape["gen_batch"]]}, return_tensors="pt").to(model.device)
            if start == 0:
                reset_peak()
            sync()
            began = time.perf_counter()
            with torch.no_grad():
                done = model.generate(
                    **batch,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=shape["max_new"],
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            sync()
            if start >= 0:
                seconds += time.perf_counter() - began
                completion = done[:, batch["input_ids"].shape[1] :].tolist()
                lengths = [row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row) for row in completion]
                new_tokens += sum(lengths)
                flops += model_flops(model_shape, [int(m.sum()) + n for m, n in zip(batch["attention_mask"], lengths)], FORWARD)
        return [result("generation", new_tokens, flops, seconds, f"HF generate, batch {shape['gen_batch']}, temperature 1, {model.dtype}")]

    return attempt("sft", sft) + attempt("dpo", preference) + attempt("generation", generation)


def attempt(kind: str, measure) -> list[dict]:
    """A measurement, or what stopped it (e.g. out of memory), recorded: the others still run."""
    import gc

    import torch

    try:
        return measure()
    except Exception as err:  # noqa: BLE001 (reported, and the next measurement runs)
        traceback.print_exc()
        return [record({"kind": kind, "error": f"{type(err).__name__}: {err}"[:300]})]
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_capped(command: list[str], log, timeout_s: float) -> int:
    """`command`'s exit code, its output into `log`; past `timeout_s` it is killed with every
    process it started (TimeoutExpired)."""
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise


def side(who: str, work: Path, out: Path, flags: list[str], timeout_s: float) -> list[dict]:
    """One side's measurements in a fresh process (its own peak memory), stopped at `timeout_s`:
    what it measured by then is in figures.jsonl, with a row saying what it did not."""
    figures, log = out / "figures.jsonl", out / f"{who}.log"
    before = len(_rows(figures))
    with log.open("w") as stderr:
        try:
            code = run_capped([sys.executable, __file__, "--side", who, "--figures", str(figures), str(work), *flags], stderr, timeout_s)
            ending = None if code == 0 else f"exit code {code}"
        except subprocess.TimeoutExpired:
            ending = f"stopped at its cap ({timeout_s:.0f} s)"
    measured = _rows(figures)[before:]
    print("\n".join(line for line in log.read_text().splitlines() if "settings" in line))
    if ending is not None:
        measured.append(record({"side": who, "kind": who, "error": ending}))
    if any("error" in r for r in measured):
        print(f"{who}: something failed; the end of {log}:\n{log.read_text()[-4000:]}")
    return measured


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cell(value, spec: str) -> str:
    return f"{'-':>{int(re.match(r'[0-9]+', spec).group())}}" if value is None else format(value, spec)


def report(shape: dict, ours_: list[dict], trl_: list[dict], dry_run: bool) -> int:
    """The table, each measurement's settings or error, and issue 22's bars; the number of errors."""
    mine, theirs = ({r["kind"]: r for r in rows if "error" not in r} for rows in (ours_, trl_))
    print(
        f"\n{'':<12}{'ours tok/s':>12}{'TRL tok/s':>12}{'ours/TRL':>9}{'ours TFLOP/s':>14}{'ours MFU':>10}{'TRL TFLOP/s':>13}"
        f"{'TRL MFU':>9}{'ours GiB':>10}{'TRL GiB':>9}"
    )
    speedup = lambda a, b: a["tokens_per_s"] / b["tokens_per_s"] if a and b else None  # noqa: E731
    for kind in ("sft", "reference", "dpo", "generation"):
        a, b = mine.get(kind, {}), theirs.get(kind, {})
        print(
            f"{kind:<12}{cell(a.get('tokens_per_s'), '12,.0f')}{cell(b.get('tokens_per_s'), '12,.0f')}{cell(speedup(a, b), '9.2f')}"
            f"{cell(a.get('tflops'), '14.4g')}{cell(a.get('mfu'), '10.3f')}{cell(b.get('tflops'), '13.4g')}{cell(b.get('mfu'), '9.3f')}"
            f"{cell(a.get('peak_gib'), '10.2f')}{cell(b.get('peak_gib'), '9.2f')}"
        )
    for who, rows in (("ours", ours_), ("TRL", trl_)):
        for r in rows:
            print(f"  {who} {r['kind']}: {r.get('settings') or 'ERROR ' + r['error']}")
    errors = sum("error" in r for r in ours_ + trl_)
    peak_vs_estimate = mine["sft"]["peak_gib"] * 2**30 / shape["footprint"].total if "sft" in mine else None
    if all(kind in mine for kind in ("sft", "reference", "dpo")) and all(kind in theirs for kind in ("sft", "dpo")):
        bars = [
            ("SFT MFU >= 0.40", (mine["sft"]["mfu"] or 0) >= 0.40),
            ("reference tokens/s >= 2.5 x SFT's", speedup(mine["reference"], mine["sft"]) >= 2.5),
            ("DPO tokens/s >= 0.9 x SFT's", speedup(mine["dpo"], mine["sft"]) >= 0.9),
            ("SFT ours >= 1.3 x TRL", speedup(mine["sft"], theirs["sft"]) >= 1.3),
            ("DPO ours >= 1.3 x TRL", speedup(mine["dpo"], theirs["dpo"]) >= 1.3),
            ("SFT peak within 15% of the estimate", abs(peak_vs_estimate - 1) <= 0.15),
        ]
        print(
            "\nissue 22's bars"
            + (" (a CPU dry run: not judged)" if dry_run else "")
            + ": "
            + "; ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in bars)
        )
    if peak_vs_estimate is not None:
        print(
            f"SFT peak {mine['sft']['peak_gib']:.2f} GiB; estimated (alignflow.orchestrator.config.memory: Megatron's state per parameter, "
            f"Korthikanti et al.'s activations for this layer) {shape['footprint'].describe()}; measured / estimated "
            f"{peak_vs_estimate:.3f}"
        )
    return errors


def bench(args, out: Path, timeout_s: float) -> str:
    """The shape's inputs, then each side in its own process, then the table: ours first, and
    at most half of what is left after the inputs, so TRL always gets its turn."""
    deadline = time.monotonic() + timeout_s
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-gpu-"))
    flags = [f"--shape={args.shape}"] + (["--dry-run"] if args.dry_run else [])
    started = time.perf_counter()
    with (out / "prepare.log").open("w") as log:
        if code := run_capped([sys.executable, __file__, "--side", "prepare", str(work), *flags], log, timeout_s):
            raise RuntimeError(f"making the inputs failed (exit code {code}): see prepare.log")
    shape = measured_shape(work, SHAPES["tiny" if args.dry_run else args.shape], args.dry_run)
    print(
        f"\nshape: {shape['params'] / 1e6:.1f}M parameters, rows of {shape['seq']} tokens; inputs made in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    mine = side("ours", work, out, flags, (deadline - time.monotonic()) / 2)
    theirs = side("trl", work, out, flags, deadline - time.monotonic())
    errors = report(shape, mine, theirs, args.dry_run)
    kinds = lambda rows: ", ".join(r["kind"] for r in rows if "error" not in r) or "nothing"  # noqa: E731
    return f"ours: {kinds(mine)}; TRL: {kinds(theirs)}" + (f"; {errors} error(s)" if errors else "")


def measured_shape(work: Path, shape: dict, dry_run: bool) -> dict:
    """The shape with its parameter count and what `align plan` estimates for its SFT step."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from alignflow.orchestrator.config.memory import Dimensions, Layout, estimate

    config = json.loads(Path(json.loads((work / "inputs.json").read_text())["hf"], "config.json").read_text())
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(LlamaConfig(**config)).parameters())
    layout = Layout(world=1, bf16=not dry_run, micro_batch=shape["micro"], seq_length=shape["seq"], micro_batches=shape["rows"] // shape["micro"])
    return shape | {"params": params, "footprint": estimate(Dimensions.of(config), layout)}


class Tee:
    """This process's output to the terminal and to gpu.log, line by line as it is printed."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, path.open("a", buffering=1)

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()


def run_phases(args, out: Path) -> int:
    """Each phase in order within its cap and the budget; the last line says what ran and what did not."""
    caps = {phase.name: phase.cap_s for phase in PHASES} | dict(args.cap)
    chosen = [phase for phase in PHASES if not args.only or phase.name in args.only]
    deadline = time.monotonic() + args.budget_s
    print(
        f"budget {args.budget_s:.0f} s; phases (cap s): "
        + ", ".join(f"{p.name} {caps[p.name]:.0f}" for p in chosen)
        + f"; figures as measured: {out / 'figures.jsonl'}"
    )
    steps = {
        "environment": lambda cap: environment(args.install, out, cap),
        "bench": lambda cap: bench(args, out, cap),
        "stage tests": lambda cap: gpu_tests("stage tests", args.dry_run, out, cap),
        "family tests": lambda cap: gpu_tests("family tests", args.dry_run, out, cap),
    }
    ran, not_run, failed = [], [], 0
    for phase in chosen:
        left = deadline - time.monotonic()
        cap = min(caps[phase.name], left)
        if left < MIN_PHASE_S:
            not_run.append(f"{phase.name} (no time left in the {args.budget_s:.0f} s budget)")
            continue
        print(f"\n== {phase.name} (cap {cap:.0f} s): {phase.what}", flush=True)
        started = time.monotonic()
        try:
            said = steps[phase.name](cap)
            ran.append(f"{phase.name} ({said}; {time.monotonic() - started:.0f} s)")
            failed += bool(re.search(r"\b[1-9]\d* (failed|error)", said))
        except subprocess.TimeoutExpired:
            not_run.append(f"{phase.name} (stopped at its cap, {cap:.0f} s: what it measured before is kept)")
            failed += 1
        except Exception as err:  # noqa: BLE001 - said on the last line; the next phase runs
            traceback.print_exc()
            not_run.append(f"{phase.name} (failed: {type(err).__name__}: {str(err)[:200]})")
            failed += 1
    not_run += [f"{p.name} (not chosen)" for p in PHASES if p not in chosen]
    print(f"\nran: {'; '.join(ran) or 'nothing'} | did not run: {'; '.join(not_run) or 'nothing'}", flush=True)
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, the demo's tiny shape, fp32; tests only collected")
    parser.add_argument("--install", action="store_true", help="install .whl/ first (infra/gpu-wheels.sh install), within the budget")
    parser.add_argument("--shape", choices=[name for name in SHAPES if name != "tiny"], default="1b")
    parser.add_argument("--only", type=lambda text: [name.strip() for name in text.split(",")], help="phases to run, comma-separated")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole command's time, the install included")
    parser.add_argument("--cap", action="append", default=[], type=lambda text: (text.split("=")[0], float(text.split("=")[1])), help="PHASE=S")
    parser.add_argument("--out", help="where the logs and figures go (default: $OUT, else a temporary folder)")
    parser.add_argument("--side", choices=("prepare", "ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--figures", help=argparse.SUPPRESS)
    parser.add_argument("work", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if unknown := ({name for name, _ in args.cap} | set(args.only or ())) - {phase.name for phase in PHASES}:
        parser.error(f"no such phase: {', '.join(sorted(unknown))} (phases: {', '.join(p.name for p in PHASES)})")
    if args.side:  # one step of the bench, in its own process
        import torch

        shape, on_gpu = SHAPES["tiny" if args.dry_run else args.shape], torch.cuda.is_available() and not args.dry_run
        if args.side == "prepare":
            prepare(Path(args.work), shape, args.dry_run)
            return 0
        FIGURES.append(Path(args.figures))
        SIDE.append(args.side)
        ours(Path(args.work), shape, "bf16" if on_gpu else "fp32") if args.side == "ours" else trl(Path(args.work), shape, on_gpu)
        return 0
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="alignflow-gpu-out-"))
    out.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(sys.stdout, out / "gpu.log")
    FIGURES.append(out / "figures.jsonl")
    if not args.dry_run and not (Path("/proc/driver/nvidia/gpus").is_dir() or os.environ.get("CUDA_VISIBLE_DEVICES")):
        print("no GPU here: use --dry-run")
        return 2
    return run_phases(args, out)


if __name__ == "__main__":  # Megatron's checkpoint writer starts a spawn-context process: guard the entry point
    sys.exit(main())
