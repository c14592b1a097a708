"""The convert stage: an HF checkpoint (or a Megatron / NeMo 2 torch_dist one) -> Megatron torch_dist.

Supported: every architecture of `alignflow.job.convert.families` (Llama 2/3 with biases and any
llama3 rope constants, Mistral, Qwen2, Qwen3, Gemma 2/3 text, Phi-3/4, OLMo 2, Mixtral,
Qwen3-MoE), from `model.safetensors` or shards + index.json on any fsspec URI; or a torch_dist checkpoint whose keys may carry NeMo 2's `module.` prefix, with
its HF config.json in `model.hf_config`. Tensors stream one fused parameter at a time, so
peak memory stays near one layer's largest parameter. The fingerprint covers the content of
the source files (see `alignflow.orchestrator.fingerprint`), so an edited source is never served stale.
Reading a source runs no code from it: HF weights as safetensors only, a torch_dist source's
pickled `.metadata` through a restricted unpickler and its `common.pt` not at all
(`alignflow.job.model_files.untrusted`).

Output (`alignflow.job.model_files` layout): `model/` the torch_dist checkpoint, `hf/` the HF
config it came from, `tokenizer/` the tokenizer files. A torch_dist checkpoint stores global
tensors, so `convert.parallel` only sets the vocab padding (multiple of
make_vocab_size_divisible_by x TP) and is checked against the model at compose time; any
TP/PP layout loads the result.
"""

import json
import logging
import math
import time

import fsspec

from alignflow.job.model_files import HF_CONFIG_FILES, HF_DIR, MODEL_DIR, TOKENIZER_DIR, TOKENIZER_FILES, copy_files
from alignflow.job.model_files.dist_io import DistCheckpointReader, save_lazy
from alignflow.job.model_files.safetensors_io import SafetensorsReader
from alignflow.job.convert.families import model_shape
from alignflow.job.convert.sharding import padded_vocab_size
from alignflow.job.convert.streaming import dist_to_dist_entries, hf_to_dist_entries

log = logging.getLogger("alignflow.job.convert")


def run(cfg, inputs: dict, out: str) -> dict:
    started = time.time()
    source = cfg.model.source.rstrip("/")
    config_dir = (cfg.model.hf_config or source).rstrip("/")
    shape = model_shape(json.loads(fsspec.open(f"{config_dir}/config.json").open().read()))
    tp = cfg.convert.parallel.tensor_model_parallel_size
    padded = padded_vocab_size(shape.vocab_size, tp, cfg.model.make_vocab_size_divisible_by)
    if is_dist_checkpoint(source):
        entries = dist_to_dist_entries(DistCheckpointReader(source), shape)
    else:
        entries = hf_to_dist_entries(SafetensorsReader(source), shape, padded)
    log.info("converting %s (%s, %d layers)", source, shape.architecture, shape.num_layers)
    save_lazy(f"{out}/{MODEL_DIR}", entries)
    copy_files(config_dir, HF_CONFIG_FILES, f"{out}/{HF_DIR}", required=("config.json",))
    copy_files(cfg.model.tokenizer, TOKENIZER_FILES, f"{out}/{TOKENIZER_DIR}")
    seconds = time.time() - started
    nbytes = sum(math.prod(e.global_shape) * e.dtype.itemsize for e in entries)
    return {
        "architecture": shape.architecture,
        "parameters": sum(math.prod(e.global_shape) for e in entries),
        "megabytes": round(nbytes / 1e6, 3),
        "mb_per_s": round(nbytes / 1e6 / seconds, 1),
        "padded_vocab_size": padded,
        "seconds": round(seconds, 3),
    }


def is_dist_checkpoint(uri: str) -> bool:
    fs, path = fsspec.core.url_to_fs(uri)
    return fs.exists(f"{path.rstrip('/')}/metadata.json") and fs.exists(f"{path.rstrip('/')}/.metadata")
