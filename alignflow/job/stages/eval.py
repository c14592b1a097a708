"""The eval stage: how good is each model of the pipeline on held-out data?

For the model under test (`inputs["model"]`) and each baseline (`inputs["baselines"]`, e.g.
the converted base model and the SFT model), on prep's validation splits:
- SFT validation loss (mean over loss tokens) and perplexity, on `eval.limit_batches` micro batches;
- preference accuracy: the share of held-out pairs whose chosen response the model finds
  more likely than the rejected one (summed log-probs of the response tokens);
- task accuracy: greedy generation (up to `eval.max_new_tokens`, stopping at EOS) on the
  first `eval.num_generation_samples` prompts, scored by `alignflow.job.rewards.exact_match`
  (math-verify); `eval.num_examples_shown` generations are kept as samples;
- with a `reward_model` input: each model's mean reward-model score of its greedy completions
  (`rm_score`; prompt + completion, `alignflow.job.forward.scores.model_scores`) and its win rate
  against the first baseline, where there is one (`rm_win_rate`: the share of those prompts where its completion
  scores higher than the baseline's, ties counting one half, AlpacaEval's rule; TRL 1.16 has no
  WinRateCallback, whose older versions counted judge wins the same way without ties).
- with `eval.sampling.k` set: `eval.sampling.n` completions sampled per prompt (its temperature,
  top_p, seed), and for each k pass@k (Chen et al.'s unbiased estimator from the c correct of
  n) and maj@k (the majority answer of the first k completions, correct or not), averaged
  over the prompts.
Beside each share (accuracy, preference accuracy) its standard error as lm-eval reports one
(`<metric>_stderr`: `binomial_stderr`), which the nightly gate (`alignflow.orchestrator.gate`) weighs drops by.
Metrics are `{model}.{metric}` with the model named by its stage (`sft.accuracy`, ...);
`eval.json` holds them and the samples. Runs in `eval.precision` at any layout (`eval.parallel`,
`eval.resources`): TP, PP and EP through Megatron's schedule and `alignflow.job.generation`, the
rows, pairs and prompts shared among the DP ranks (the last micro batch may be smaller) and
the results gathered, so every layout scores the same rows (tests/test_eval.py).
Greedy decoding is `alignflow.job.generation`'s (KV-cached, prompts of mixed lengths left-padded into
batches), or with `eval.generation_engine: vllm` a vLLM engine's (`alignflow.job.engine.rollouts`:
one engine while the models share a shape, refit to each model in turn).
What the job cost: `flops` (model FLOPs, `alignflow.job.train.utilization`: each validation row,
pair and generated prompt + completion one forward pass, as KV-cached generation computes each
token once; left padding and the reward model's scoring are not counted), `tokens` and
`compute_s` (the time in these passes, rank 0's), of which `generation_s` generating (and
scoring) completions: decoding is step by step, not bound by FLOPs.
"""

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import fsspec
import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoTokenizer

from alignflow.job.data.prepared import Prepared
from alignflow.job.device import device
from alignflow.job.engine.rollouts import PolicyEngine, policy_engine
from alignflow.job.generation import Sampling, generate
from alignflow.job.model import runtime
from alignflow.job.rewards import exact_match, extract_answer, gold_answer, majority_answer, pass_at_k, same_answer
from alignflow.job.forward.models import cache_dir, frozen_chunks, local_model
from alignflow.job.forward.objectives import SFT, pair_logprobs
from alignflow.job.forward.passes import loss_sums, resolve_precision
from alignflow.job.forward.scores import model_scores
from alignflow.job.train.datasets import PackedSFT, PreferencePairs, Prompts, optional
from alignflow.job.train.utilization import FORWARD, ModelShape, model_flops

log = logging.getLogger("alignflow.eval")
SINGLE_RANK = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "sequence_parallel": False,
    "use_distributed_optimizer": False,
}


def run(cfg, inputs: dict, out: str) -> dict:
    data, section = Prepared(inputs["data"]), cfg.eval
    runtime.init_parallel(section.parallel, seed=0)
    models = {_stage_name(uri): uri for uri in [inputs["model"], *inputs["baselines"]]}
    metrics, samples, completions = {}, {}, {}
    cost = torch.zeros(4, dtype=torch.float64, device=device())  # flops, tokens, seconds, generation seconds
    engines, served, engine = contextlib.ExitStack(), None, None
    try:
        for name, uri in models.items():
            dtype = resolve_precision(section.precision)
            chunks, decode = load_chunks(uri, section.parallel, cfg.model.make_vocab_size_divisible_by, dtype, cache_dir(cfg))
            started = time.perf_counter()
            if section.generation_engine == "vllm":  # one engine while the models share a shape, refit to each
                output = local_model(uri, cache_dir(cfg))
                if served != output.hf_config:
                    engines.close()
                    longest, folder = data.max_prompt_length + section.max_new_tokens, Path(f"{out}-engine")
                    engine = engines.enter_context(policy_engine(section, output.hf_config, output.tokenizer, dtype, longest, 0, folder))
                    served = output.hf_config
                engine.refit(chunks, name)
            results, samples[name], completions[name], passes = evaluate(chunks, decode, data, section, engine)
            shape, seconds = ModelShape.of(local_model(uri, cache_dir(cfg)).hf_config), time.perf_counter() - started
            figures = [model_flops(shape, passes.documents, FORWARD), sum(passes.documents), seconds, passes.generation_s]
            cost += torch.tensor(figures, dtype=torch.float64, device=device())
            metrics |= {f"{name}.{k}": v for k, v in results.items()}
            if dist.get_rank() == 0:
                log.info("%s: %s", name, results)
        if "reward_model" in inputs:
            chunks, _ = load_chunks(
                inputs["reward_model"], section.parallel, cfg.model.make_vocab_size_divisible_by, resolve_precision(section.precision), cache_dir(cfg)
            )
            baseline = _stage_name(inputs["baselines"][0]) if inputs["baselines"] else None
            metrics |= reward_model_metrics(chunks, completions, baseline, data.pad_id, section.micro_batch_size)
        seconds, generation_s = cost[2].item(), cost[3].item()
        dist.all_reduce(cost, group=parallel_state.get_data_parallel_group())  # each DP rank's share of the passes
        metrics |= {"flops": cost[0].item(), "tokens": int(cost[1].item()), "compute_s": round(seconds, 3), "generation_s": round(generation_s, 3)}
        dist.barrier()
        writer = dist.get_rank() == 0  # asked before teardown: afterwards every rank would answer "not initialized"
    finally:
        engines.close()
        runtime.teardown()
    if not writer:
        return metrics
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    fs.pipe(f"{root.rstrip('/')}/eval.json", json.dumps({"metrics": metrics, "samples": samples}, indent=2).encode())
    return metrics


def _stage_name(uri: str) -> str:
    """`{root}/{stage}/{fingerprint}` -> stage."""
    return uri.rstrip("/").split("/")[-2]


def load_chunks(uri: str, parallel, divisible_by: int, dtype: torch.dtype, cache: Path | None = None) -> tuple[list, Callable]:
    """This rank's chunks of the model of a stage output (`alignflow.job.model_files` layout, read at
    any layout) in eval mode in `dtype`, and its tokenizer's decode."""
    output = local_model(uri, cache or cache_dir())
    chunks = frozen_chunks(output, parallel, divisible_by, cache or cache_dir(), dtype)
    tokenizer = AutoTokenizer.from_pretrained(output.tokenizer, trust_remote_code=False)
    return chunks, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def load_model(uri: str, divisible_by: int, cache: Path | None = None):
    """The model on one rank (`SINGLE_RANK`) in fp32 and its tokenizer's decode."""
    chunks, decode = load_chunks(uri, SINGLE_RANK, divisible_by, torch.float32, cache)
    return chunks[0], decode


@dataclass
class Forwarded:
    """What a rank ran a model on: its documents' lengths and the seconds it spent generating."""

    documents: list[int] = field(default_factory=list)
    generation_s: float = 0.0


@torch.no_grad()
def evaluate(chunks: list, decode, data: Prepared, cfg, engine: PolicyEngine | None = None) -> tuple[dict, list, list, Forwarded]:
    """The metrics of one model, the same on every rank, at any TP/PP/DP layout: the data are
    shared among the DP ranks (the last share may be smaller) and the sums gathered; this
    rank's greedy prompt + completion token rows; and what this rank forwarded (for the
    stage's cost). Completions come from `engine` (refit to this model) where there is one."""
    results, samples, rows, outcomes, done = {}, [], [], {}, Forwarded()  # outcomes: share -> how many 0/1 outcomes it is the mean of
    if val := optional(PackedSFT, data, "val"):
        results |= sft_val_loss(chunks, val, cfg.micro_batch_size, cfg.limit_batches)
        done.documents += val.document_lengths(_my_share(min(len(val), cfg.micro_batch_size * cfg.limit_batches))).tolist()
    if pairs := optional(PreferencePairs, data, "val"):
        results["preference_accuracy"], outcomes["preference_accuracy"] = preference_accuracy(chunks, pairs, cfg.micro_batch_size), len(pairs)
        done.documents += pairs.document_lengths(_my_share(len(pairs))).tolist()
    if prompts := optional(Prompts, data, "val"):
        started = time.perf_counter()
        results["accuracy"], samples, rows = task_accuracy(chunks, engine, decode, prompts, data.tokenizer, cfg)
        outcomes["accuracy"] = min(len(prompts), cfg.num_generation_samples)
        done.documents += [len(row) for row in rows]
        if cfg.sampling.k:
            sampled, generated = sampled_accuracy(chunks, engine, decode, prompts, data.tokenizer, cfg)
            results |= sampled
            done.documents += generated
        done.generation_s = time.perf_counter() - started
    return results | {f"{k}_stderr": binomial_stderr(results[k], n) for k, n in outcomes.items() if n > 1}, samples, rows, done


def binomial_stderr(share: float, n: int) -> float:
    """The standard error of the mean of n 0/1 outcomes as lm-eval's `acc_stderr` (`mean_stderr`):
    the sample standard deviation (n - 1 in the variance) over sqrt(n) = sqrt(p (1 - p) / (n - 1))."""
    return math.sqrt(share * (1 - share) / (n - 1))


def _my_share(n: int) -> np.ndarray:
    """This DP rank's contiguous share of n items (shares differ by at most one)."""
    return np.array_split(np.arange(n), parallel_state.get_data_parallel_world_size())[parallel_state.get_data_parallel_rank()]


def sft_val_loss(chunks: list, dataset: PackedSFT, micro_batch_size: int, limit_batches: int) -> dict:
    """Mean loss over the loss tokens of the first limit_batches x micro_batch_size rows."""
    share = _my_share(min(len(dataset), micro_batch_size * limit_batches))
    batches = [dataset.collate(m) for m in dataset.micro_batches(share, micro_batch_size)]
    total, count, _ = loss_sums(chunks, SFT, batches, dataset.seq_length, micro_batch_size, forward_only=True)
    loss = total / max(count, 1)
    return {"val_loss": loss, "perplexity": float(np.exp(loss))}


def preference_accuracy(chunks: list, pairs: PreferencePairs, micro_batch_size: int) -> float:
    """Share of pairs where sum log p(chosen response) > sum log p(rejected response)."""
    columns = pair_logprobs(chunks, pairs, micro_batch_size)  # on the rank of each DP share that writes
    wins = torch.zeros(2, dtype=torch.float64, device=device())
    if columns is not None:
        wins += torch.tensor(
            [sum(c > r for c, r in zip(columns["chosen_logp"], columns["rejected_logp"])), len(columns["sample_id"])],
            dtype=torch.float64,
            device=device(),
        )
    dist.all_reduce(wins)
    return float(wins[0] / wins[1])


def task_accuracy(chunks: list, engine, decode, prompts: Prompts, tokenizer: dict, cfg) -> tuple[float, list, list]:
    """Greedy completions of the first num_generation_samples prompts, scored by exact match;
    and this rank's rows of prompt + completion tokens."""
    share = _my_share(min(len(prompts), cfg.num_generation_samples))
    sampling = Sampling(max_new_tokens=cfg.max_new_tokens, eos_id=tokenizer["eos_token_id"], vocab_size=tokenizer["vocab_size"])
    completions = _generate(chunks, engine, [prompts.tokens(int(i)) for i in share], sampling, cfg.micro_batch_size, [0] * len(share))
    mine = []
    for i, completion in zip(share, completions):
        text, i = decode(completion.tokens), int(i)
        mine.append(
            {
                "prompt": prompts.text[i],
                "completion": text,
                "answer": prompts.answer[i],
                "correct": exact_match(prompts.text[i], text, prompts.answer[i]),
            }
        )
    scored = [row for part in _gather_dp(mine) for row in part]
    rows = [prompts.tokens(int(i)) + completion.tokens for i, completion in zip(share, completions)]
    return sum(s["correct"] for s in scored) / max(len(scored), 1), scored[: cfg.num_examples_shown], rows


def reward_model_metrics(chunks: list, rows: dict[str, list], baseline: str | None, pad_id: int, micro_batch_size: int) -> dict:
    """Each model's mean reward-model score of its completions (`rm_score`) and, with a
    baseline, but the baseline's, its win rate against the baseline's completions of the same
    prompts (`rm_win_rate`, ties one half); `rows`: model -> this rank's prompt + completion rows."""
    scores = {
        name: model_scores(chunks, mine, pad_id, micro_batch_size) if mine else torch.zeros(0, dtype=torch.float64, device="cpu")
        for name, mine in rows.items()
    }
    metrics = {}
    for name, mine in scores.items():
        theirs = scores[baseline] if baseline else mine
        wins = (mine > theirs).double() + 0.5 * (mine == theirs).double()
        sums = torch.tensor([mine.sum(), wins.sum(), len(mine)], dtype=torch.float64, device=device())
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        metrics[f"{name}.rm_score"] = float(sums[0] / sums[2])
        if baseline not in (None, name):
            metrics[f"{name}.rm_win_rate"] = float(sums[1] / sums[2])
    return metrics


def sampled_accuracy(chunks: list, engine, decode, prompts: Prompts, tokenizer: dict, cfg) -> tuple[dict, list[int]]:
    """pass@k and maj@k for each k of `cfg.sampling`, over n sampled completions of each of the
    first num_generation_samples prompts; each DP rank draws its share from its own seed (the
    engine: each completion from its own, by its place). And the lengths of this rank's prompt
    + completion rows."""
    s, share = cfg.sampling, _my_share(min(len(prompts), cfg.num_generation_samples))
    sampling = Sampling(
        max_new_tokens=cfg.max_new_tokens,
        eos_id=tokenizer["eos_token_id"],
        vocab_size=tokenizer["vocab_size"],
        temperature=s.temperature,
        top_p=s.top_p,
    )
    seed = int(np.random.SeedSequence([s.seed, parallel_state.get_data_parallel_rank()]).generate_state(1)[0])
    seeds = [int(np.random.SeedSequence([s.seed, int(i), t]).generate_state(1)[0]) for i in share for t in range(s.n)]
    completions = _generate(chunks, engine, [prompts.tokens(int(i)) for i in share for _ in range(s.n)], sampling, cfg.micro_batch_size, seeds, seed)
    answers = [extract_answer(decode(c.tokens)) for c in completions]
    mine = [prompt_scores(gold_answer(prompts.answer[int(i)]), answers[j * s.n : (j + 1) * s.n], s.k) for j, i in enumerate(share)]
    scored = [row for part in _gather_dp(mine) for row in part]
    lengths = [len(prompts.tokens(int(i))) + len(completions[j * s.n + t].tokens) for j, i in enumerate(share) for t in range(s.n)]
    return ({name: float(np.mean([row[name] for row in scored])) for name in scored[0]} if scored else {}), lengths


def _generate(chunks: list, engine, prompts: list, sampling: Sampling, batch_size: int, seeds: list[int], seed: int = 0) -> list:
    """Completions of this rank's prompts: by the engine, each with its seed, or by the decoder
    from one `seed`."""
    if engine is not None:
        return engine.generate(prompts, sampling, seeds, parallel_state.get_data_parallel_rank())
    return generate(chunks, prompts, sampling, batch_size, seed=seed)


def prompt_scores(gold: list, answers: list[list], ks: list[int]) -> dict:
    """One prompt's pass@k and maj@k for each k, from its n parsed answers."""
    correct = sum(same_answer(gold, answer) for answer in answers)
    return {
        **{f"pass@{k}": pass_at_k(len(answers), correct, k) for k in ks},
        **{f"maj@{k}": float(same_answer(gold, majority_answer(answers[:k]))) for k in ks},
    }


def _gather_dp(obj) -> list:
    """Every DP rank's `obj`, in DP rank order."""
    group = parallel_state.get_data_parallel_group()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
