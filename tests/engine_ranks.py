"""Rank script for tests/test_refit.py: the policy (an HF model converted at --tp/--pp) moved off
its checkpoint as an update moves it, refit into a vLLM engine started on dummy weights
(`alignflow.job.engine.rollouts`), then the engine's greedy completions against the decoder's
on the same live weights (fp32), each DP rank asking for its own prompts."""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron_ranks import converted_chunks, parallel_cfg
from omegaconf import OmegaConf
from safetensors.torch import load_file

from alignflow.job.engine.rollouts import policy_engine
from alignflow.job.generation import Sampling, generate
from alignflow.job.model import runtime

PROMPTS = [[1, 5, 9, 13, 7], [1, 22, 4], [1, 30, 31, 32, 33, 34, 35], [1, 8]]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--python", required=True)
    parser.add_argument("--log-folder", required=True)
    parser.add_argument("model", type=Path)
    args = parser.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    state = load_file(args.model / "model.safetensors")
    parallel = parallel_cfg(args.tp, args.pp)
    runtime.init_parallel(parallel)
    chunks = converted_chunks(config, parallel, state)
    with torch.no_grad():  # the same move on every rank's shards: a policy the checkpoint is not
        generator = torch.Generator().manual_seed(7)
        for _, param in sorted(chunks[0].named_parameters()):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    section = OmegaConf.create(
        {
            "generation_engine": "vllm",
            "vllm": {"python": args.python, "tensor_parallel_size": 1, "max_model_len": 64, "kv_cache_gib": 1, "bucket_mb": 1},
        }
    )
    sampling = Sampling(max_new_tokens=12, eos_id=config["eos_token_id"], vocab_size=config["vocab_size"])
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = PROMPTS[dp_rank::dp_size]
    decoder = generate(chunks, mine, sampling, batch_size=4)
    failed = False
    with policy_engine(section, config, str(args.model), torch.float32, 64, 0, Path(args.log_folder)) as engine:
        metrics = engine.refit(chunks, version=1)
        served = engine.generate(mine, sampling, [0] * len(mine), dp_rank)
    for d, e in zip(decoder, served):
        same = d.tokens == e.tokens
        error = max((abs(a - b) for a, b in zip(d.sampling_logps, e.sampling_logps)), default=0.0) if same else float("inf")
        print(f"rank {dist.get_rank()}: engine tokens {'==' if same else '!='} decoder's, max |logp difference| {error:.2e}", flush=True)
        failed |= not (same and error < 1e-4)
    print(f"rank {dist.get_rank()}: refit {metrics['refit_buckets']} buckets, {metrics['refit_bytes']} bytes", flush=True)
    runtime.teardown()
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
