"""One command for a GPU machine: the environment, the GPU test subset, then alignflow's SFT,
reference pass, DPO and GRPO generation against TRL + HF transformers on two Llama shapes.

Run from the repository root (Python 3.12 and torch 2.11 as the machine has them, the wheels of
`infra/gpu-wheels.sh` installed; no Prefect, no hydra):
    PYTHONPATH=. python3 bench/gpu.py [--skip-tests] [--skip-bench] [--shape 1b|short] [--dry-run]
`--dry-run`: the same steps on CPU on the demo's tiny shape in fp32, the tests only collected.

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
The tests and the measurements each fit one 10-minute command: run them apart
(`--skip-bench`, then `--skip-tests`).
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
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from alignflow.orchestrator.config.memory import GIB, Dimensions, Layout, estimate
from alignflow.job.train.utilization import FORWARD, PEAK_SOURCE, TRAINING, ModelShape, figures, model_flops, peak_rss_bytes, peak_tflops

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


def environment() -> None:
    import torch

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, device {device_name() or 'CPU'}, "
        f"dense bf16 peak "
        f"{peak_tflops(device_name()) or 'unknown (no MFU)'} TFLOP/s ({PEAK_SOURCE})"
    )
    for name in ("megatron-core", "transformers", "trl", "datasets", "accelerate", "flash-attn", "transformer-engine"):
        try:
            print(f"  {name} {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"  {name} absent")


def gpu_tests(dry_run: bool) -> int:
    """`pytest -m gpu` (tests/conftest.py GPU_TESTS); a dry run collects them and checks every listed test exists."""
    sys.path.insert(0, "tests")
    from conftest import GPU_TESTS

    files = sorted({t.split("::")[0] for t in GPU_TESTS})
    args = ["--collect-only", "-q"] if dry_run else ["-v", "-rfE", "--durations=10", "--timeout=300"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "gpu", *args, *files], capture_output=dry_run, text=True
    )
    if dry_run:
        found = {line.split("[")[0] for line in out.stdout.splitlines() if "::" in line}
        missing = [t for t in GPU_TESTS if t not in found]
        print(f"GPU test subset: {len(found)} tests collected" + (f"; MISSING: {missing}" if missing else ""))
        return out.returncode or len(missing)
    return out.returncode


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

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return peak_rss_bytes() / 2**30


def result(kind: str, tokens: float, flops: float, seconds: float, settings: str) -> dict:
    return {"kind": kind, "tokens_per_s": tokens / seconds, **figures(flops, seconds, 1, device_name()), "peak_gib": peak_gib(), "settings": settings}


def ours(work: Path, shape: dict, precision: str) -> list[dict]:
    from transformers import AutoTokenizer

    from alignflow.job.data.prepared import Prepared
    from alignflow.job.generation import Sampling, generate
    from alignflow.job.forward.passes import forward_only_splits
    from alignflow.job.stages import dpo, ref_logprobs, sft
    from alignflow.job.train import engine
    from alignflow.job.train.data import dp_micro_batches
    from alignflow.job.train.datasets import PreferencePairs
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
    """A measurement, or what stopped it (e.g. out of memory): the others still run."""
    import gc

    import torch

    try:
        return measure()
    except Exception as err:  # noqa: BLE001 (reported, and the next measurement runs)
        traceback.print_exc()
        return [{"kind": kind, "error": f"{type(err).__name__}: {err}"[:300]}]
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def side(who: str, work: Path, flags: list[str]) -> list[dict]:
    """One side's measurements in a fresh process (its own peak memory); its last line is JSON,
    its log (stderr) in the work folder, whose tail is shown when something failed."""
    log = work / f"{who}.log"
    with log.open("w") as stderr:
        out = subprocess.run([sys.executable, __file__, "--side", who, str(work), *flags], stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines = out.stdout.strip().splitlines()
    print("\n".join(line for line in lines[:-1] if "settings" in line))
    measured = json.loads(lines[-1]) if out.returncode == 0 and lines else [{"kind": who, "error": f"exit code {out.returncode}"}]
    if any("error" in r for r in measured):
        print(f"{who}: something failed; the end of {log}:\n{log.read_text()[-4000:]}")
    return measured


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
    peak_vs_estimate = mine["sft"]["peak_gib"] * GIB / shape["footprint"].total if "sft" in mine else None
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, the demo's tiny shape, fp32; tests only collected")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--shape", choices=[name for name in SHAPES if name != "tiny"], default="1b")
    parser.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("work", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    shape, on_gpu = SHAPES["tiny" if args.dry_run else args.shape], torch.cuda.is_available() and not args.dry_run
    if args.side:  # one side's measurements, in its own process
        measured = ours(Path(args.work), shape, "bf16" if on_gpu else "fp32") if args.side == "ours" else trl(Path(args.work), shape, on_gpu)
        print(json.dumps(measured))
        return 0
    if not on_gpu and not args.dry_run:
        print("no GPU here: use --dry-run")
        return 2
    environment()
    failed = 0 if args.skip_tests else gpu_tests(args.dry_run)
    if args.skip_bench:
        return failed
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-gpu-"))
    started = time.perf_counter()
    prepare(work, shape, args.dry_run)
    config = json.loads(Path(json.loads((work / "inputs.json").read_text())["hf"], "config.json").read_text())
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM, LlamaConfig

        shape = shape | {"params": sum(p.numel() for p in AutoModelForCausalLM.from_config(LlamaConfig(**config)).parameters())}
    layout = Layout(
        world=1, bf16=not args.dry_run, micro_batch=shape["micro"], seq_length=shape["seq"], micro_batches=shape["rows"] // shape["micro"]
    )
    shape["footprint"] = estimate(Dimensions.of(config), layout)  # what `align plan` estimates for this SFT
    print(
        f"\nshape: {shape['params'] / 1e6:.1f}M parameters, rows of {shape['seq']} tokens; inputs made in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    sides = [side(who, work, [f"--shape={args.shape}"] + (["--dry-run"] if args.dry_run else [])) for who in ("ours", "trl")]
    return failed + report(shape, *sides, args.dry_run)


if __name__ == "__main__":  # Megatron's checkpoint writer starts a spawn-context process: guard the entry point
    sys.exit(main())
