"""Sampling from a Megatron-Core GPTModel with a KV cache, for rollouts (GRPO) and eval.

`generate(chunks, prompts, sampling, batch_size, seed)` continues each prompt (token ids) until
EOS or `max_new_tokens`. Prompts are sorted by length (stably, so GRPO's groups stay together)
and cut into batches of at most `batch_size` rows; a batch of mixed lengths is left-padded
(`alignflow.job.model.decoder`: its own positions and attention mask per row, no recomputation).
Its prompts are prefilled once (identical prompts once for all their rows), then each step
feeds only the new tokens. Sampling: temperature 0 is greedy; otherwise logits / temperature,
then top_k, then top_p (`filter_logits`: the smallest set of tokens whose probability reaches
top_p), then a
draw with one uniform per row from a host `torch.Generator` seeded by `seed` (sent to the
device a stretch of steps at a time), so the same weights, prompts, batch size and seed give
the same completions on any device. Tokens of the padded vocab rows (beyond `vocab_size`) are
never chosen. A batch ends once each of its rows has drawn EOS: the device keeps that flag,
and the host reads it every `EOS_CHECK_EVERY` steps (a GPU sync each), dropping the steps
past the end and undoing their draws, so the completions are those of a check at every step.

Why not Megatron's module forward with its `StaticInferenceContext`: per token it cost 80
module calls, 36 tensor-parallel autograd functions (no-ops at TP1), autocast wrappers and
inference-context bookkeeping; at 8 rows on a 1M-parameter model a
decode step took 2.1 ms of CPU for ~0.3 ms of matrix products, and prompts had to be of equal
length. The decoder (0.6 ms there) runs the same math on the model's own parameters (HF's
greedy tokens exactly: tests/test_generation.py, TP2 / PP2 in tests/test_megatron_model.py);
it supports the Llama family and refuses other models.

Parallelism: under TP every rank holds its shards, gathers the full logits and draws the same
token (same generator); under PP hidden states go stage to stage by point-to-point sends and
the last stage broadcasts the chosen tokens to the others; DP ranks generate their own
prompts. Under EP the ranks of an EP group are DP ranks with different prompts whose MoE
layers exchange tokens (`alignflow.job.model.decoder`), so they decode in step: each runs as
many batches as the group's most (a rank short of them prefills a stand-in row, EOS alone),
and a batch stops at the first check where every rank's rows have ended (a max over the group
beside the host read); a rank done before then feeds its last tokens again, draws no uniforms
and keeps no step, so its completions and its generator's state are those it has alone (EP1).
Virtual PP (several chunks per rank) is not supported here and raises.
Not done: CUDA graphs (a captured step needs fixed shapes: attention over the whole cache under
a length mask; no GPU here to test one), and dropping finished rows from a batch (they decode
on, as HF's do).
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from alignflow.job.device import device
from alignflow.job.model.decoder import Decoder


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
    """One continuation. Two log-probs per token, for the two uses of a rollout:
    - `logps`: log p(token) under the model's own distribution, log_softmax(logits);
    - `sampling_logps`: under the distribution it was drawn from, log_softmax of logits /
      temperature after top_k / top_p (`filter_logits`; vLLM's "processed" log-probs, which
      NeMo-RL's training log-probs match); equal to `logps` at temperature 0 (greedy) or 1
      without filtering, and filled with `logps` when not given."""

    tokens: list[int]  # the generated tokens, ending with EOS unless truncated
    logps: list[float]
    truncated: bool  # reached max_new_tokens without EOS
    sampling_logps: Optional[list[float]] = None

    def __post_init__(self):
        if self.sampling_logps is None:
            self.sampling_logps = list(self.logps)


# Decode steps between reads of "has every row ended?" on the host: each read waits for the
# device (a GPU sync), so on an accelerator they come every few tokens and the steps decoded past
# the end are dropped; the CPU has nothing to wait for, and a step past the end costs real time.
EOS_CHECK_EVERY = {"cpu": 1}
EOS_CHECK_EVERY_DEFAULT = 16


@torch.inference_mode()
def generate(chunks: Sequence, prompts: Sequence[Sequence[int]], sampling: Sampling, batch_size: int, seed: int = 0) -> list[Completion]:
    """Completions of `prompts`, in order. `chunks` are this rank's model chunks (`build_gpt`),
    one PP stage; their weights are read directly, so with overlapped parameter gathers call
    `alignflow.job.train.engine.gather_weights` first."""
    if len(chunks) > 1:
        raise NotImplementedError(
            "generation with virtual pipeline parallelism (several model chunks per rank) is not supported; "
            "set parallel.virtual_pipeline_model_parallel_size: null"
        )
    [model] = chunks
    generator = torch.Generator(device="cpu").manual_seed(seed)  # draws on the host: the same samples on every device type
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    group = parallel_state.get_expert_model_parallel_group() if parallel_state.get_expert_model_parallel_world_size() > 1 else None
    batches += [[]] * (_group_max(len(batches), group) - len(batches))  # stand-in batches: as many as the group's most
    completions: dict[int, Completion] = {}
    for batch in batches:
        completions |= dict(zip(batch, _generate_batch(model, [prompts[i] for i in batch], sampling, generator, group)))
    return [completions[i] for i in range(len(prompts))]


def _generate_batch(
    model, prompts: list[Sequence[int]], sampling: Sampling, generator: torch.Generator, group: Optional[dist.ProcessGroup]
) -> list[Completion]:
    """One batch's completions. Under EP (`group`) the batch stops when every rank's has ended:
    a rank whose rows have all ended (or with no prompts: a stand-in row, EOS alone) keeps
    decoding, drawing nothing, its results dropped."""
    settled = not prompts  # this rank's completions are known: from here on it only keeps in step
    prompts = prompts or [[sampling.eos_id]]
    longest, where = max(len(p) for p in prompts), device()
    distinct = list(dict.fromkeys(tuple(p) for p in prompts))  # each distinct prompt prefilled once (on the host: no device read)
    index = {p: i for i, p in enumerate(distinct)}
    inverse = torch.tensor([index[tuple(p)] for p in prompts], device=where)
    decoder = Decoder(model, [longest - len(p) for p in prompts], longest + sampling.max_new_tokens)
    pad = [longest - len(p) for p in distinct]
    logits = decoder.prefill(torch.tensor([[0] * n + list(p) for n, p in zip(pad, distinct)], device=where), pad, inverse)
    b, every, last = len(prompts), EOS_CHECK_EVERY.get(where.type, EOS_CHECK_EVERY_DEFAULT), sampling.max_new_tokens - 1
    chosen, done, ended = [], torch.zeros(b, dtype=torch.bool, device=where), []
    fed = torch.full((b,), sampling.eos_id, device=where)  # the tokens of the next decode step
    for step in range(sampling.max_new_tokens):
        offset = step % every
        if not settled:
            if offset == 0:  # this stretch's uniforms, and the generator's state before them
                state, uniforms = generator.get_state(), _uniforms(generator, sampling, min(every, last + 1 - step), b, where)
            drawn = None
            if logits is not None:
                drawn = torch.stack(sample(logits, sampling, None if uniforms is None else uniforms[offset])).double()
            drawn = _from_last_stage(drawn, b)  # [3, b]: token, logp, sampling logp
            chosen.append(drawn)
            fed = drawn[0].long()
            done |= drawn[0] == sampling.eos_id
            ended.append(done.all())
        if offset == every - 1 or step == last:
            if not settled and True in (stretch := torch.stack(ended[step - offset :]).tolist()):  # the host read
                # keep the steps up to the first that ended every row, and only their draws
                kept = stretch.index(True) + 1
                del chosen[step - offset + kept :]
                generator.set_state(state)
                _uniforms(generator, sampling, kept, b, torch.device("cpu"))
                settled = True
            if _group_max(int(not settled), group) == 0:
                break
        if step == last:
            break
        logits = decoder.decode(fed)
    if not chosen:
        return []
    tokens, logps, sampling_logps = torch.stack(chosen, -1).tolist()
    return [_cut([int(t) for t in row], *row_logps, sampling.eos_id) for row, *row_logps in zip(tokens, logps, sampling_logps)]


def _group_max(value: int, group: Optional[dist.ProcessGroup]) -> int:
    """The largest `value` over the EP group (this rank's own without one)."""
    if group is None:
        return value
    most = torch.tensor([value], device=device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return int(most.item())


def _uniforms(generator: torch.Generator, sampling: Sampling, steps: int, rows: int, where: torch.device) -> Optional[torch.Tensor]:
    """The sampler's uniforms of `steps` steps [steps, rows, 1], drawn on the host in one go (the
    generator's stream is the same whether drawn step by step or at once) and sent to `where`
    together; None for greedy decoding, which draws nothing."""
    if sampling.temperature == 0:
        return None
    return torch.rand(steps, rows, 1, generator=generator, device="cpu").to(where, non_blocking=True)


def sample(logits: torch.Tensor, sampling: Sampling, uniform: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next tokens [b], their log-probs [b] and their log-probs under the tempered, filtered
    distribution they were drawn from [b], from
    last-position logits [b, padded vocab] and one uniform in [0, 1) per row [b, 1] (None when
    greedy, temperature 0)."""
    logits = logits[:, : sampling.vocab_size].float()
    logp = logits.log_softmax(-1)
    if sampling.temperature == 0:
        token = logits.argmax(-1)
        token_logp = logp.gather(-1, token[:, None]).squeeze(-1)
        return token, token_logp, token_logp
    scores = filter_logits(logits / sampling.temperature if sampling.temperature != 1 else logits, sampling.top_k, sampling.top_p)
    # Inverse-CDF draw from softmax(scores) with one uniform per row (torch.multinomial is
    # several times slower on CPU): the first token whose cdf exceeds u < total, which is
    # never a zero-probability (filtered) one.
    cdf = scores.softmax(-1).cumsum(-1)
    total = cdf[:, -1:]
    u = uniform * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    token = torch.searchsorted(cdf, u, right=True)
    return token.squeeze(-1), logp.gather(-1, token).squeeze(-1), scores.log_softmax(-1).gather(-1, token).squeeze(-1)


def filter_logits(scores: torch.Tensor, top_k: Optional[int], top_p: float) -> torch.Tensor:
    """`scores` [..., vocab] with the tokens outside top_k, then outside top_p (the smallest set
    whose probability reaches top_p), at -inf: the distribution sampling draws from, and GRPO's
    training log-probs renormalise over (NeMo-RL v0.6); differentiable in the kept scores."""
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.detach().topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores.detach() < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.detach().sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # the mass before the token already reaches top_p
        scores = scores.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return scores


def _from_last_stage(drawn: Optional[torch.Tensor], b: int) -> torch.Tensor:
    """The last pipeline stage's draw on every stage, in one broadcast (float64 holds the token ids exactly)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if drawn is None:
            drawn = torch.empty(3, b, dtype=torch.float64, device=device())
        dist.broadcast(drawn, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=parallel_state.get_pipeline_model_parallel_group())
    return drawn


def _cut(tokens: list[int], logps: list[float], sampling_logps: list[float], eos_id: int) -> Completion:
    end = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
    return Completion(tokens[:end], logps[:end], truncated=eos_id not in tokens, sampling_logps=sampling_logps[:end])
