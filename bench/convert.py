"""HF -> Megatron conversion: throughput against a plain read of the same files, and peak RSS.

Builds a synthetic bf16 checkpoint (random weights, 1 GB shards + index.json): a Llama of about
2 GB, or with --shape mixtral a Mixtral of about 1.7 GB (8 layers of 8 experts: 192 expert
matrices per checkpoint key, each its own chunks), then measures in the same run, each time after evicting the shards from the
page cache (posix_fadvise DONTNEED), as a real conversion reads a checkpoint it has not read:
- a plain read of every shard file (64 MiB blocks, bytes discarded): the I/O ceiling (the
  same read from the page cache is printed too);
- the convert stage (`alignflow.job.stages.convert.run`) in a fresh process, which reads, fuses
  and writes the torch_dist checkpoint; its peak RSS is the kernel's high-water mark (VmHWM)
  and is shown against the largest tensor and the checkpoint size, beside the RSS of a
  process that only imports the same modules.

Run: .venv/bin/python bench/convert.py [WORKDIR] [--shape mixtral]   (needs ~5 GB of free disk in WORKDIR; --tiny: the
shape at SIZES' tiny sizes, about 10 MB in 4 MB shards, so CI runs it end to end)
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from alignflow.orchestrator import demo
from alignflow.job.model_files.safetensors_io import TensorSpec, write_sharded

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 20,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
MIXTRAL = {
    **CONFIG,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
SHAPES = {"llama": CONFIG, "mixtral": MIXTRAL}
SIZES = {  # name: (the shape's sizes overridden, shard bytes)
    "full": ({}, 10**9),
    "tiny": ({"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 8192}, 4 * 10**6),
}
CHILD = """
import json, re, sys
from omegaconf import OmegaConf
from alignflow.job.stages import convert
metrics = convert.run(OmegaConf.create(json.loads(sys.argv[2])), {}, sys.argv[3]) if sys.argv[1] == "convert" else {}
hwm_kib = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(json.dumps({"peak_rss": hwm_kib * 1024, **metrics}))
"""


def hf_specs(c: dict) -> list[TensorSpec]:
    h, f, kv = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"] * c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
        }
        if "num_local_experts" in c:  # Mixtral: a router and w1 (gate), w3 (up), w2 (down) per expert
            shapes[p + "block_sparse_moe.gate.weight"] = (c["num_local_experts"], h)
            for e in range(c["num_local_experts"]):
                x = f"{p}block_sparse_moe.experts.{e}."
                shapes |= {x + "w1.weight": (f, h), x + "w3.weight": (f, h), x + "w2.weight": (h, f)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (c["vocab_size"], h)}
    return [TensorSpec(name, torch.bfloat16, shape) for name, shape in shapes.items()]


def evict(files: list[Path]) -> None:
    """Drop the files' clean pages from the page cache, so the next read goes to the disk."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def plain_read(files: list[Path]) -> float:
    started = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    return time.perf_counter() - started


def child(*args: str) -> tuple[dict, float]:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1]), time.perf_counter() - started


parser = argparse.ArgumentParser()
parser.add_argument("workdir", nargs="?")
parser.add_argument("--shape", choices=sorted(SHAPES), default="llama")
parser.add_argument("--tiny", action="store_true", help="the shape at SIZES['tiny']")
args = parser.parse_args()
sizes, shard_bytes = SIZES["tiny" if args.tiny else "full"]
config = SHAPES[args.shape] | sizes
work = Path(args.workdir or tempfile.mkdtemp(prefix="alignflow-bench-convert-"))
source, out = work / "hf", work / "megatron"
specs = hf_specs(config)
size = sum(s.nbytes for s in specs)
largest = max(specs, key=lambda s: s.nbytes)
print(f"synthetic {args.shape}: {len(specs)} tensors, {size / 1e9:.2f} GB bf16, largest {largest.name} {largest.nbytes / 1e6:.0f} MB")
generator = torch.Generator().manual_seed(0)
write_sharded(str(source), specs, (torch.randn(s.shape, generator=generator).to(torch.bfloat16) for s in specs), max_shard_bytes=shard_bytes)
(source / "config.json").write_text(json.dumps(config))
tokenizer = demo.build(work / "demo") / "tokenizer"
files = sorted(source.glob("*.safetensors"))

warm_s = plain_read(files)
evict(files)
read_s = plain_read(files)
cfg = {
    "model": {"source": str(source), "hf_config": None, "tokenizer": str(tokenizer), "make_vocab_size_divisible_by": 128},
    "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}},
}
baseline, _ = child("imports-only")
evict(files)
converted, convert_s = child("convert", json.dumps(cfg), str(out))

read_mbs, convert_mbs = size / 1e6 / read_s, size / 1e6 / convert_s
print(f"{'':<34}{'seconds':>9}{'MB/s':>9}")
print(f"{'plain read (page cache)':<34}{warm_s:>9.2f}{size / 1e6 / warm_s:>9.0f}")
print(f"{'plain read of the shards':<34}{read_s:>9.2f}{read_mbs:>9.0f}")
print(
    f"{'alignflow convert stage':<34}{converted['seconds']:>9.2f}{converted['mb_per_s']:>9.0f}   {converted['mb_per_s'] / read_mbs:.0%} of plain read"
)
print(f"{'  the same, with process start-up':<34}{convert_s:>9.2f}{convert_mbs:>9.0f}   {convert_mbs / read_mbs:.0%} of plain read")
peak = converted["peak_rss"]
print(
    f"peak RSS of convert: {peak / 1e6:.0f} MB = {peak / size:.1%} of the checkpoint, "
    f"{peak / largest.nbytes:.1f}x the largest tensor; a process importing the same modules: {baseline['peak_rss'] / 1e6:.0f} MB"
)
print(f"bench process peak RSS (generation): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB")
if args.workdir is None:
    shutil.rmtree(work)
