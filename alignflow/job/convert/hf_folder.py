"""A model output (`alignflow.job.model_files` layout) as an HF folder that
`AutoModelForCausalLM.from_pretrained` loads: safetensors shards streamed one layer at a time,
config.json (its dtype set), generation_config.json and the tokenizer files. The export stage
publishes one; the benchmark stage writes one in its scratch for lm-eval's `hf` model."""

import json

import fsspec
import torch

from alignflow.job.model_files import TOKENIZER_FILES, ModelOutput, copy_files
from alignflow.job.model_files.safetensors_io import TensorSpec, write_sharded
from alignflow.job.convert.families import ModelShape, model_shape
from alignflow.job.convert.peft import model_reader
from alignflow.job.convert.streaming import dist_to_hf


def write_hf_folder(
    model: ModelOutput, weights: ModelOutput, out: str, dtype_name: str, max_shard_bytes: int
) -> tuple[ModelShape, list[TensorSpec], list[str]]:
    """`weights`' full weights (a LoRA output's merged into its base) under `out` with `model`'s
    config, generation config and tokenizer; (its shape, the tensors written, the shard files)."""
    hf_config = model.hf_config
    shape = model_shape(hf_config)
    specs, tensors = dist_to_hf(model_reader(weights, shape), shape, getattr(torch, dtype_name))
    files = write_sharded(out, specs, tensors, max_shard_bytes)
    copy_files(model.hf, ("generation_config.json",), out)
    copy_files(model.tokenizer, TOKENIZER_FILES, out)
    dtype_key = "torch_dtype" if "torch_dtype" in hf_config and "dtype" not in hf_config else "dtype"
    fs, root = fsspec.core.url_to_fs(out)
    fs.pipe(f"{root.rstrip('/')}/config.json", json.dumps({**hf_config, dtype_key: dtype_name}, indent=2).encode())
    return shape, specs, files
