"""Sampling from a Megatron-Core GPTModel with a KV cache, for rollouts (GRPO) and eval.

`generate(model, prompts, sampling, batch_size, seed)` continues each prompt (token ids) until
EOS or `max_new_tokens`. Prompts of equal length share a batch (at most `batch_size` rows):
the prompt is prefilled once under a causal mask into Megatron's `StaticInferenceContext`
(its KV cache), then each step feeds only the new token. Sampling: temperature 0 is greedy;
otherwise logits / temperature, then top_k, then top_p (the smallest set of tokens whose
probability reaches top_p), then a draw with a `torch.Generator` seeded by `seed`, so the
same weights, prompts and seed give the same completions. Tokens of the padded vocab rows
(beyond `vocab_size`) are never chosen.

Parallelism: under TP every rank gathers the full logits and draws the same token (same
generator); under PP each step's hidden states go stage to stage by point-to-point sends and
the last stage broadcasts the chosen tokens to the others; DP ranks generate their own
prompts. Virtual PP (several chunks per rank) is not supported here and raises.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    eos_id: int
    vocab_size: int  # the tokenizer's: padded vocab rows are never sampled
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: Optional[int] = None


@dataclass
class Completion:
    tokens: list[int]  # the generated tokens, ending with EOS unless truncated
    logps: list[float]  # log p(token) under the model's unmodified distribution (temperature 1)
    truncated: bool  # reached max_new_tokens without EOS


@torch.inference_mode()
def generate(model, prompts: Sequence[Sequence[int]], sampling: Sampling, batch_size: int, seed: int = 0) -> list[Completion]:
    """Completions of `prompts`, in order. `model` is this rank's GPTModel (one PP stage)."""
    if isinstance(model, list):
        if len(model) > 1:
            raise NotImplementedError("generation with virtual pipeline parallelism (several model chunks per rank) is not supported; "
                                      "set parallel.virtual_pipeline_model_parallel_size: null")
        model = model[0]
    generator = torch.Generator(device=_device()).manual_seed(seed)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    completions: dict[int, Completion] = {}
    training = model.training
    model.eval()  # Megatron uses the KV cache in eval mode only
    try:
        for rows in by_length.values():
            for start in range(0, len(rows), batch_size):
                batch = rows[start : start + batch_size]
                prompt = torch.tensor([list(prompts[i]) for i in batch], dtype=torch.int64, device=_device())
                completions |= dict(zip(batch, _generate_batch(model, prompt, sampling, generator)))
    finally:
        model.train(training)
    return [completions[i] for i in range(len(prompts))]


def _generate_batch(model, prompt: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> list[Completion]:
    b, length = prompt.shape
    context = StaticInferenceContext(b, length + sampling.max_new_tokens)
    tokens, positions = prompt, torch.arange(length, device=prompt.device)[None].expand(b, -1)
    mask = ~torch.ones(length, length, dtype=torch.bool, device=prompt.device).tril()[None, None]
    chosen, logps = [], []
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    for _ in range(sampling.max_new_tokens):
        logits = _stage_forward(model, tokens, positions, mask, context)
        token, logp = sample(logits, sampling, generator) if logits is not None else _empty(b, prompt.device)
        token, logp = _from_last_stage(token, logp)
        chosen.append(token)
        logps.append(logp)
        done |= token == sampling.eos_id
        if done.all():
            break
        context.sequence_len_offset += tokens.shape[1]
        tokens, positions, mask = token[:, None], torch.full((b, 1), context.sequence_len_offset, device=prompt.device), None
    return [_cut(row, row_logps, sampling.eos_id) for row, row_logps in zip(torch.stack(chosen, 1).tolist(), torch.stack(logps, 1).tolist())]


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [b] and their log-probs [b] from last-position logits [b, padded vocab]."""
    logits = logits[:, : sampling.vocab_size].float()
    if sampling.temperature == 0:
        token = logits.argmax(-1)
    else:
        scores = logits / sampling.temperature
        if sampling.top_k is not None and sampling.top_k < scores.shape[-1]:
            kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if sampling.top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            probs = sorted_scores.softmax(-1)
            outside = probs.cumsum(-1) - probs >= sampling.top_p  # the mass before the token already reaches top_p
            scores = scores.scatter(-1, order, sorted_scores.masked_fill(outside, float("-inf")))
        # Inverse-CDF draw from softmax(scores) with one uniform per row (torch.multinomial is
        # several times slower on CPU): the first token whose cdf exceeds u < total, which is
        # never a zero-probability (filtered) one.
        cdf = scores.softmax(-1).cumsum(-1)
        total = cdf[:, -1:]
        u = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype) * total
        u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
        token = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    logp = logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    return token, logp


def _stage_forward(model, tokens, positions, mask, context) -> Optional[torch.Tensor]:
    """Last-position logits on the last PP stage; None on the others (after passing hidden states on)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1 and not model.pre_process:
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], model.config.hidden_size, dtype=model.config.pipeline_dtype, device=tokens.device)
        dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(tokens, positions, mask, inference_context=context, runtime_gather_output=True)
    if not model.post_process:
        dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return out[:, -1]


def _from_last_stage(token: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group, last = parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(token, src=last, group=group)
        dist.broadcast(logp, src=last, group=group)
    return token, logp


def _empty(b: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(b, dtype=torch.int64, device=device), torch.empty(b, dtype=torch.float32, device=device)


def _cut(tokens: list[int], logps: list[float], eos_id: int) -> Completion:
    end = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
    return Completion(tokens[:end], logps[:end], truncated=eos_id not in tokens)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
