"""The eval stage: how good is each model of the pipeline on held-out data?

For the model under test (`inputs["model"]`) and each baseline (`inputs["baselines"]`, e.g.
the converted base model and the SFT model), on prep's validation splits:
- SFT validation loss (mean over loss tokens) and perplexity, on `eval.limit_batches` micro batches;
- preference accuracy: the share of held-out pairs whose chosen response the model finds
  more likely than the rejected one (summed log-probs of the response tokens);
- task accuracy: greedy generation (up to `eval.max_new_tokens`, stopping at EOS) on the
  first `eval.num_generation_samples` prompts, scored by exact numeric match with the answer;
  `eval.num_examples_shown` generations are kept as samples.
Metrics are `{model}.{metric}` with the model named by its stage (`sft.accuracy`, ...);
`eval.json` holds them and the samples. Runs on one rank (TP1/PP1): generation at TP/PP > 1
is not built here, and the model is small enough for evaluation to need neither.
Greedy decoding is `alignflow.generation`'s (KV-cached, prompts of mixed lengths left-padded into batches).
"""

import json
import logging
from pathlib import Path

import fsspec
import numpy as np
import torch
from transformers import AutoTokenizer

from alignflow.data.prepared import SIDES, Prepared
from alignflow.generation import Sampling, generate
from alignflow.megatron import checkpoint, runtime
from alignflow.megatron.model import build_gpt
from alignflow.rewards import exact_match
from alignflow.stages.sft import sft_forward, sft_loss
from alignflow.train.data import packed_rows
from alignflow.train.datasets import PackedSFT, PreferencePairs, Prompts, optional
from alignflow.train.workspace import cache_dir, local_model

log = logging.getLogger("alignflow.eval")
SINGLE_RANK = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
               "context_parallel_size": 1, "sequence_parallel": False, "use_distributed_optimizer": False}


def run(cfg, inputs: dict, out: str) -> dict:
    data = Prepared(inputs["data"])
    runtime.init_parallel(SINGLE_RANK, seed=0)
    models = {_stage_name(uri): uri for uri in [inputs["model"], *inputs["baselines"]]}
    metrics, samples = {}, {}
    try:
        for name, uri in models.items():
            model, decode = load_model(uri, cfg.model.make_vocab_size_divisible_by, cache_dir(cfg))
            results, samples[name] = evaluate(model, decode, data, cfg.eval)
            metrics |= {f"{name}.{k}": v for k, v in results.items()}
            log.info("%s: %s", name, results)
    finally:
        runtime.teardown()
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    fs.pipe(f"{root.rstrip('/')}/eval.json", json.dumps({"metrics": metrics, "samples": samples}, indent=2).encode())
    return metrics


def _stage_name(uri: str) -> str:
    """`{root}/{stage}/{fingerprint}` -> stage."""
    return uri.rstrip("/").split("/")[-2]


def load_model(uri: str, divisible_by: int, cache: Path | None = None):
    """The model of a stage output (`alignflow.checkpoint` layout) and its tokenizer's decode."""
    output = local_model(uri, cache or cache_dir())
    model = build_gpt(output.hf_config, SINGLE_RANK, make_vocab_size_divisible_by=divisible_by)
    checkpoint.load([model], output.weights)
    tokenizer = AutoTokenizer.from_pretrained(output.tokenizer)
    return model.eval(), lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@torch.no_grad()
def evaluate(model, decode, data: Prepared, cfg) -> tuple[dict, list]:
    results, samples = {}, []
    if val := optional(PackedSFT, data, "val"):
        results |= sft_val_loss(model, val, cfg.micro_batch_size, cfg.limit_batches)
    if pairs := optional(PreferencePairs, data, "val"):
        results["preference_accuracy"] = preference_accuracy(model, pairs, cfg.micro_batch_size)
    if prompts := optional(Prompts, data, "val"):
        results["accuracy"], samples = task_accuracy(model, decode, prompts, data.tokenizer, cfg)
    return results, samples


def sft_val_loss(model, dataset: PackedSFT, micro_batch_size: int, limit_batches: int) -> dict:
    total, count = 0.0, 0
    for start in range(0, min(len(dataset), micro_batch_size * limit_batches), micro_batch_size):
        batch = dataset.collate(range(start, min(start + micro_batch_size, len(dataset))))
        terms = sft_loss(sft_forward(model, batch), batch)
        total, count = total + terms.total.item(), count + int(terms.count)
    loss = total / max(count, 1)
    return {"val_loss": loss, "perplexity": float(np.exp(loss))}


def preference_accuracy(model, pairs: PreferencePairs, micro_batch_size: int) -> float:
    """Share of pairs where sum log p(chosen response) > sum log p(rejected response)."""
    logps = {side: response_logps(model, pairs, side, micro_batch_size) for side in SIDES}
    return float((logps["chosen"] > logps["rejected"]).float().mean())


def response_logps(model, pairs: PreferencePairs, side: str, micro_batch_size: int) -> torch.Tensor:
    out = []
    for start in range(0, len(pairs), micro_batch_size):
        batch = vars(packed_rows(pairs.rows(side, range(start, min(start + micro_batch_size, len(pairs)))), pairs.seq_length, pairs.pad_id))
        per_token = sft_forward(model, batch)
        out.append(-(per_token * batch["loss_mask"]).sum(-1))
    return torch.cat(out)


def task_accuracy(model, decode, prompts: Prompts, tokenizer: dict, cfg) -> tuple[float, list]:
    n = min(len(prompts), cfg.num_generation_samples)
    sampling = Sampling(max_new_tokens=cfg.max_new_tokens, eos_id=tokenizer["eos_token_id"], vocab_size=tokenizer["vocab_size"])
    completions = generate(model, [prompts.tokens(i) for i in range(n)], sampling, cfg.micro_batch_size)
    scored = []
    for i, completion in enumerate(completions):
        text = decode(completion.tokens)
        scored.append({"prompt": prompts.text[i], "completion": text, "answer": prompts.answer[i],
                       "correct": exact_match(prompts.text[i], text, prompts.answer[i])})
    return sum(s["correct"] for s in scored) / max(n, 1), scored[: cfg.num_examples_shown]
