"""The score stage: each generated completion's reward, and from them the next round's data.

The reward is grpo's: the weighted sum of `score.environment`'s rules (`exact_match`, math-verify;
any `module:function`), with `{name: score}` entries the `reward_model` input's score of prompt +
completion (`alignflow.job.forward.scores.model_scores`, at `score.parallel`). Then, per prompt:
its best non-empty completion (the highest reward, the first sample on a tie) is an SFT row where it has
at least `min_reward` (rejection sampling), and its best against its worst a preference pair
where they differ by more than `min_margin` (online DPO). prep reads both through its
`generated` input.

Output: scored.parquet (generate's columns and `reward`), sft.jsonl (chat `messages`: the prompt
as the user's turn, the completion as the assistant's) and preference.jsonl (TRL's
prompt / chosen / rejected strings). Metrics: reward_mean, best_reward_mean, sft_rows,
preference_pairs.
"""

import json
import logging

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoTokenizer

from alignflow.job.data.spill import Ranks
from alignflow.job.forward.models import cache_dir, frozen_chunks, local_model
from alignflow.job.forward.passes import resolve_precision
from alignflow.job.forward.scores import model_scores
from alignflow.job.model import runtime
from alignflow.job.rewards import SCORE, resolve, weighted_reward

log = logging.getLogger("alignflow.score")
COMPLETIONS = "completions.parquet"  # generate's output
FILES = {"scored": "scored.parquet", "sft": "sft.jsonl", "preference": "preference.jsonl"}


def run(cfg, inputs: dict, out: str) -> dict:
    section, writer = cfg.score, Ranks.of_job().rank == 0  # asked first: the reward model's teardown ends the group
    fs, root = fsspec.core.url_to_fs(inputs["completions"])
    with fs.open(f"{root.rstrip('/')}/{COMPLETIONS}", "rb") as f:
        rows = pq.read_table(f).to_pylist()
    rules = [(resolve(r.name), dict(r.kwargs or {}), r.weight) for r in section.environment if r.name != SCORE]
    rewards = np.array([weighted_reward(rules, row["prompt"], row["completion"], row["answer"], "score.environment") for row in rows])
    if weight := sum(r.weight for r in section.environment if r.name == SCORE):
        rewards = rewards + weight * reward_model_scores(cfg, section, inputs["reward_model"], rows)
    for row, value in zip(rows, rewards):
        row["reward"] = float(value)
    sft, pairs = choose(rows, section.min_reward, section.min_margin)
    best = [max(group, key=lambda row: row["reward"])["reward"] for group in by_prompt(rows).values()]
    metrics = {
        "reward_mean": float(rewards.mean()) if len(rows) else 0.0,
        "best_reward_mean": float(np.mean(best)) if best else 0.0,
        "sft_rows": len(sft),
        "preference_pairs": len(pairs),
    }
    if not writer:
        return metrics
    fs, root = fsspec.core.url_to_fs(out)
    root = root.rstrip("/")
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/{FILES['scored']}", "wb") as f:
        pq.write_table(pa.Table.from_pylist(rows), f)
    for name, lines in (("sft", sft), ("preference", pairs)):
        fs.pipe(f"{root}/{FILES[name]}", "".join(json.dumps(line) + "\n" for line in lines).encode())
    log.info("%s", metrics)
    return metrics


def by_prompt(rows: list[dict]) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = {}
    for row in sorted(rows, key=lambda row: (row["prompt_index"], row["sample"])):
        groups.setdefault(row["prompt_index"], []).append(row)
    return groups


def choose(rows: list[dict], min_reward: float | None, min_margin: float) -> tuple[list[dict], list[dict]]:
    """Per prompt, among its non-empty completions: the best as an SFT row (with at least
    `min_reward`), and the best against the worst as a pair (where they differ by more than
    `min_margin`); ties go to the first sample, so the choice is the same on every run."""
    sft, pairs = [], []
    for group in by_prompt(rows).values():
        group = [row for row in group if row["completion"].strip()]  # an empty answer teaches nothing (prep refuses it)
        if not group:
            continue
        best = max(group, key=lambda row: row["reward"])  # max and min keep the first of equals
        worst = min(group, key=lambda row: row["reward"])
        if min_reward is None or best["reward"] >= min_reward:
            sft.append({"messages": [{"role": "user", "content": best["prompt"]}, {"role": "assistant", "content": best["completion"]}]})
        if best["reward"] - worst["reward"] > min_margin:
            pairs.append({"prompt": best["prompt"], "chosen": best["completion"], "rejected": worst["completion"]})
    return sft, pairs


def reward_model_scores(cfg, section, uri: str, rows: list[dict]) -> np.ndarray:
    """The reward model's score of each row's prompt + completion tokens, on the job's ranks."""
    runtime.init_parallel(section.parallel, seed=0)
    try:
        output = local_model(uri, cache_dir(cfg))
        chunks = frozen_chunks(output, section.parallel, cfg.model.make_vocab_size_divisible_by, cache_dir(cfg), resolve_precision(section.precision))
        tokenizer = AutoTokenizer.from_pretrained(output.tokenizer, trust_remote_code=False)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        scores = model_scores(chunks, [row["prompt_tokens"] + row["tokens"] for row in rows], pad, section.micro_batch_size)
        return scores.numpy()
    finally:
        runtime.teardown()
