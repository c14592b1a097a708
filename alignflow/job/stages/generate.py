"""The generate stage: `num_generations_per_prompt` sampled completions of each of prep's prompts
(`generate.split`, its first `num_prompts`) by a model output, for `score` and the rounds built
on it (rejection sampling, online DPO).

Sampling is the decoder's (`alignflow.job.generation`: temperature, top_p, top_k, stop at EOS,
`max_new_tokens`) or, with `generate.generation_engine: vllm`, a vLLM engine's refit to the model
(`alignflow.job.engine.rollouts`). The prompts are shared among the DP ranks; each completion
has its own seed from (seed, prompt, sample) on the engine, each DP rank one seed on the decoder.
Output: completions.parquet, one row per completion (prompt_index, sample, prompt, answer,
prompt_tokens, completion, tokens, logp: the summed log-probs of its tokens under the sampling distribution,
truncated), and the metrics: prompts, completions, mean completion tokens, truncation rate and
the generation's tokens/s.
"""

import logging
import time
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoTokenizer

from alignflow.job.data.prepared import Prepared
from alignflow.job.engine.rollouts import policy_engine
from alignflow.job.forward.models import cache_dir, frozen_chunks, local_model
from alignflow.job.forward.passes import resolve_precision
from alignflow.job.generation import Sampling, generate
from alignflow.job.model import runtime
from alignflow.job.train.datasets import Prompts

log = logging.getLogger("alignflow.generate")
FILE = "completions.parquet"


def run(cfg, inputs: dict, out: str) -> dict:
    section = cfg.generate
    data = Prepared(inputs["data"])
    prompts = Prompts(data, section.split)
    runtime.init_parallel(section.parallel, seed=section.seed)
    try:
        output, dtype = local_model(inputs["model"], cache_dir(cfg)), resolve_precision(section.precision)
        chunks = frozen_chunks(output, section.parallel, cfg.model.make_vocab_size_divisible_by, cache_dir(cfg), dtype)
        tokenizer = AutoTokenizer.from_pretrained(output.tokenizer, trust_remote_code=False)
        sampling = Sampling(
            max_new_tokens=section.max_new_tokens,
            eos_id=tokenizer.eos_token_id,
            vocab_size=len(tokenizer),
            temperature=section.temperature,
            top_p=section.top_p,
            top_k=section.top_k,
        )
        n = len(prompts) if section.num_prompts is None else min(section.num_prompts, len(prompts))
        dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        share, g = np.array_split(np.arange(n), dp_size)[dp_rank], section.num_generations_per_prompt
        asked = [(int(i), j) for i in share for j in range(g)]
        tokens = [prompts.tokens(i) for i, _ in asked]
        started = time.perf_counter()
        longest = data.max_prompt_length + section.max_new_tokens  # prep cut every prompt to it
        with policy_engine(section, output.hf_config, output.tokenizer, dtype, longest, section.seed, Path(f"{out}-engine")) as engine:
            if engine is not None:
                engine.refit(chunks, 0)
                seeds = [int(np.random.SeedSequence([section.seed, i, j]).generate_state(1)[0]) for i, j in asked]
                completions = engine.generate(tokens, sampling, seeds, dp_rank)
            else:
                seed = int(np.random.SeedSequence([section.seed, dp_rank]).generate_state(1)[0])
                completions = generate(chunks, tokens, sampling, section.micro_batch_size, seed=seed)
        seconds = time.perf_counter() - started
        rows = [
            {
                "prompt_index": i,
                "sample": j,
                "prompt": prompts.text[i],
                "answer": prompts.answer[i],
                "prompt_tokens": prompts.tokens(i),
                "completion": tokenizer.decode(c.tokens, skip_special_tokens=True),
                "tokens": list(c.tokens),
                "logp": float(np.sum(c.sampling_logps)),
                "truncated": bool(c.truncated),
            }
            for (i, j), c in zip(asked, completions)
        ]
        gathered = [None] * dist.get_world_size(parallel_state.get_data_parallel_group())
        dist.all_gather_object(gathered, (rows, seconds), group=parallel_state.get_data_parallel_group())
        writer = dist.get_rank() == 0
    finally:
        runtime.teardown()
    all_rows = [row for part, _ in gathered for row in part]
    generated = sum(len(row["tokens"]) for row in all_rows)
    slowest = max(s for _, s in gathered)
    metrics = {
        "prompts": n,
        "completions": len(all_rows),
        "completion_tokens_mean": generated / max(len(all_rows), 1),
        "truncation_rate": sum(row["truncated"] for row in all_rows) / max(len(all_rows), 1),
        "generation_tokens_per_s": generated / max(slowest, 1e-9),
    }
    if writer:
        fs, root = fsspec.core.url_to_fs(out)
        fs.makedirs(root, exist_ok=True)
        with fs.open(f"{root.rstrip('/')}/{FILE}", "wb") as f:
            pq.write_table(pa.Table.from_pylist(all_rows), f)
        log.info("%s", metrics)
    return metrics
