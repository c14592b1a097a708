"""The grpo stage: Group Relative Policy Optimization on prep's prompts, on the training engine.

Each step (NeMo-RL's loop, one process group for generation and training):
1. take `num_prompts_per_step` prompts (a seeded, resumable order over prep's `prompts/train`);
   each DP rank takes its share of whole prompts;
2. roll out `num_generations_per_prompt` completions per prompt with the current policy
   (`alignflow.job.generation`: KV cache, generation_temperature/top_p/top_k, max_new_tokens,
   batches of generation_batch_size, seeded by (seed, step, DP rank, batch of the step), so a
   resumed run samples exactly what an uninterrupted one would);
3. score them with the `environment` rewards (their sum weighted by each entry's `weight`, as
   TRL's `reward_weights`; `alignflow.job.rewards`, and `score`: the `reward_model` input's scalar
   head on prompt + completion, `alignflow.job.forward.scores.model_scores`, a frozen forward-only copy in the policy's
   layout, as TRL's reward model in `reward_funcs` and NeMo-RL's reward-model environment; less DAPO's soft
   overlong penalty with `overlong_buffer_length`) and, with `use_dynamic_sampling`, drop the
   groups whose rewards agree and draw the next batch until the share is full (`rollout`);
   turn each group's rewards into advantages (`alignflow.job.losses.policy.group_advantages`; with
   `overlong_filtering` truncated samples keep their place in the baseline but get no gradient);
4. log-probs of the sampled tokens under the reference model (`inputs["ref_model"]`, skipped
   when ref_policy_kl_penalty is 0 or kl_type none; unfiltered) and, with several optimizer steps per batch, under the
   policy before the first update (the "old" policy of the ratio; with one step it is the
   current policy, detached);
5. `num_optimizer_steps_per_batch` optimizer steps, each on an equal slice of the rollouts,
   with the clipped policy loss (`alignflow.job.losses.policy.policy_loss`).
The learning-rate schedule, clipping, checkpoints (at step boundaries) and exact resume are
the engine's. Metrics per step: loss, mean reward, reward std, accuracy (exact match with the
prompt's answer), KL to the reference, clip fraction, importance ratio, response length,
truncation rate, generation tokens/s and end-to-end tokens/s (prompt + completion tokens of
the rollouts per second of step time). The stage's TFLOP/s and MFU count each step's model
FLOPs (`alignflow.job.train.utilization`): generation, the reference and the old-policy passes as
one forward each over the rollouts, the updates as training passes.

As NeMo-RL: the training log-probs are taken at the generation temperature (logits / T) and,
with top_k / top_p, under the same filtered, renormalised distribution (v0.6.0; the KL term
reads the unfiltered ones, as the reference's), and the rollouts' generation log-probs are
those of the distribution each token was drawn from (`Completion.sampling_logps`), so the
ratio and the importance weights compare one policy.
With `finetuning_type` lora / lora_merged and `ref_model` the same output as `model`, the
reference is the policy's own frozen base with its adapters disabled (no second copy);
generation reads each adapted weight merged with its adapter (`alignflow.job.model.lora`).
With `generation_engine: vllm` the rollouts come from a vLLM engine of the job
(`alignflow.job.engine.rollouts`), refit from the policy before each step, one seed per sample;
with the decoder, generation and training share the weights in one process. Either way a
step's token_mult_prob_error (how far the sampler's log-probs are from the trainer's) is a
metric, and beyond `max_token_mult_prob_error` it fails the stage. Any other reference model
is a second copy of the model in the same layout and dtype.
"""

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.utils import get_attr_wrapped_model
from transformers import AutoTokenizer

from alignflow.job.model_files import ModelOutput
from alignflow.orchestrator.config.schema import GRPOLossConfig, KLEstimator
from alignflow.orchestrator.kinds.grpo import grpo_batch_problems
from alignflow.job.data.prepared import Prepared
from alignflow.job.device import device
from alignflow.job.engine.rollouts import PolicyEngine, policy_engine
from alignflow.job.generation import Completion, Sampling, filter_logits, generate
from alignflow.job.losses.policy import group_advantages, policy_loss
from alignflow.job.model import lora
from alignflow.job.rewards import SCORE, exact_match, resolve, weighted_reward
from alignflow.job.forward.models import cache_dir, frozen_chunks, local_model
from alignflow.job.forward.objectives import sft_forward
from alignflow.job.forward.passes import LossTerms, Objective
from alignflow.job.forward.scores import model_scores
from alignflow.job.train import engine
from alignflow.job.train.data import packed_rows
from alignflow.job.train.datasets import Prompts
from alignflow.job.train.engine import Run, StepStats, TrainResult, all_reduce_dp, every, finish, training
from alignflow.job.train.utilization import FORWARD, ModelShape, model_flops

log = logging.getLogger("alignflow.grpo")
LOSS_METRICS = ("kl", "clip_fraction", "ratio", "token_mult_prob_error")


class Rollouts:
    """One step's samples on this rank (prompt + completion rows) as micro batches for the loss.

    Position t of a row predicts token t + 1, so the log-prob tensors (generation, old,
    reference) hold at t the log-prob of token t + 1, and `loss_mask` marks the completion.
    The rows are host data (collated as SFT's are); the per-sample tensors (advantages, the
    log-probs) stay on the rank's device, where the loss reads them."""

    def __init__(self, prompts: list[list[int]], completions: list[Completion], advantages: torch.Tensor, trained: torch.Tensor, pad_id: int):
        self.rows, self.seq_length, self.pad_id = [], max(len(p) + len(c.tokens) for p, c in zip(prompts, completions)), pad_id
        generation_logp = np.zeros((len(prompts), self.seq_length), dtype=np.float32)
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            ids = np.asarray(prompt + completion.tokens, dtype=np.int64)
            mask = np.r_[np.zeros(len(prompt)), np.full(len(completion.tokens), float(trained[i]))]
            self.rows.append((ids, mask, np.asarray([0, len(ids)])))
            generation_logp[i, len(prompt) - 1 : len(ids) - 1] = completion.sampling_logps
        self.generation_logp = torch.from_numpy(generation_logp).to(device())
        self.advantages = advantages.float().to(device())
        self.old_logp: torch.Tensor | None = None  # set before the first update when needed
        self.ref_logp: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def collate(self, indices: Sequence[int]) -> dict:
        indices = [int(i) for i in indices]
        batch = vars(packed_rows([self.rows[i] for i in indices], self.seq_length, self.pad_id))
        index = torch.tensor(indices, device=device())
        batch |= {"advantages": self.advantages[index], "generation_logp": self.generation_logp[index]}
        for name in ("old_logp", "ref_logp"):
            if getattr(self, name) is not None:
                batch[name] = getattr(self, name)[index]
        return batch

    def num_tokens(self, indices: Sequence[int]) -> int:
        return sum(len(self.rows[int(i)][0]) for i in indices)

    def document_lengths(self, indices: Sequence[int]) -> np.ndarray:
        return np.asarray([len(self.rows[int(i)][0]) for i in indices], dtype=np.int64)

    def store(self, name: str, micro: list[np.ndarray], logps: list[torch.Tensor]) -> None:
        """Per-micro-batch log-probs (last pipeline stage) as the `name` tensor of every sample."""
        if logps:
            full = torch.zeros(len(self.rows), self.seq_length, device=device())
            for indices, values in zip(micro, logps):
                full[torch.as_tensor(indices, device=device())] = values
            setattr(self, name, full)


def grpo_objective(cfg: GRPOLossConfig, sampling: Sampling) -> Objective:
    """The clipped policy loss on micro batches of `Rollouts`, its log-probs those of the
    distribution the rollouts were drawn from (`nll_forward`); each micro batch weighs the
    loss and the metrics by its `loss_units`."""
    kinds = (FILTERED, UNFILTERED) if cfg.kl_type != KLEstimator.none else (FILTERED,)

    def loss(per_token: torch.Tensor, batch: dict) -> LossTerms:
        nll = per_token.float()
        logp, logp_unfiltered = (-nll[..., 0], -nll[..., 1]) if nll.dim() == 3 else (-nll, -nll)
        old = batch.get("old_logp", logp.detach())
        ref = batch.get("ref_logp", logp_unfiltered.detach())
        out = policy_loss(
            cfg,
            logp,
            old,
            ref,
            batch["advantages"],
            batch["loss_mask"],
            batch["generation_logp"],
            logp_unfiltered=logp_unfiltered,
            max_completion_length=sampling.max_new_tokens,
        )
        metrics = {name: getattr(out, name) * out.units for name in LOSS_METRICS}
        return LossTerms(total=out.loss * out.units, count=out.units.to(torch.int64), metrics=metrics)

    return Objective(forward=nll_forward(sampling, kinds), loss=loss, metric_names=LOSS_METRICS)


FILTERED, UNFILTERED = "filtered", "unfiltered"


def nll_forward(sampling: Sampling, kinds: tuple[str, ...]):
    """Per-token -log p(label) [b, s] under softmax(logits / T) (NeMo-RL divides the training
    logits by the generation temperature; greedy, T = 0, counts as T = 1): UNFILTERED, and
    FILTERED, renormalised over the tokens top_k / top_p keep (`filter_logits`, the
    distribution the rollouts were drawn from, NeMo-RL v0.6; a label outside it, a numerical
    boundary case, gets 0 as NeMo-RL's do); stacked [b, s, 2] when both differ and are asked
    for. On pipeline stages other than the last: the hidden states."""
    temperature = sampling.temperature or 1.0
    filtering = sampling.temperature > 0 and (sampling.top_k is not None or sampling.top_p < 1)
    if not filtering and temperature == 1.0:
        return sft_forward

    def forward(model, batch: dict) -> torch.Tensor:
        out = sft_forward(model, dict(batch, labels=None))  # logits, vocab-parallel under TP
        if not get_attr_wrapped_model(model, "post_process"):
            return out
        labels = batch["labels"]
        logits = out.reshape(*labels.shape, out.shape[-1]).float() / temperature
        per_kind = []
        if filtering and FILTERED in kinds:
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., : sampling.vocab_size]
            logp = filter_logits(full, sampling.top_k, sampling.top_p).log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
            per_kind.append(torch.where(torch.isfinite(logp), -logp, torch.zeros_like(logp)))
        if not filtering or UNFILTERED in kinds:
            per_kind.append(tensor_parallel.vocab_parallel_cross_entropy(logits, labels))
        return per_kind[0] if len(per_kind) == 1 else torch.stack(per_kind, -1)

    return forward


@dataclass
class RolloutStats:
    """This rank's samples' scores, host data (from the decoded texts)."""

    rewards: torch.Tensor  # [samples] this rank's
    correct: torch.Tensor
    response_tokens: torch.Tensor
    truncated: torch.Tensor

    def global_metrics(self) -> dict[str, float]:
        """Metrics over every DP rank's samples."""
        r = self.rewards.double()
        sums = torch.tensor(
            [len(r), r.sum(), (r * r).sum(), self.correct.double().sum(), self.response_tokens.double().sum(), self.truncated.double().sum()],
            dtype=torch.float64,
            device=device(),
        )
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        n, total, squares, correct, tokens, truncated = sums.tolist()
        mean = total / n
        return {
            "reward_mean": mean,
            "reward_std": max(squares / n - mean * mean, 0.0) ** 0.5 * (n / max(n - 1, 1)) ** 0.5,
            "accuracy": correct / n,
            "response_length": tokens / n,
            "truncation_rate": truncated / n,
        }


@dataclass
class Environment:
    """What a GRPO step needs besides the run: how to sample, score and refer."""

    tokenizer: Any
    pad_id: int
    sampling: Sampling
    rewards: list  # (reward function, its kwargs, its weight) of the rule rewards
    ref_chunks: list | None  # the reference model (None without a KL term); run with its adapters disabled
    score_weight: float = 0.0  # the summed weights of the `score` entries
    score_chunks: list | None = None  # the reward model, for `score` entries
    engine: PolicyEngine | None = None  # with generation_engine: vllm; None: the decoder on the policy's chunks


def environment(
    run: Run,
    section: Any,
    prompts: Prepared,
    ref_model: ModelOutput,
    divisible_by: int,
    same_model: bool = False,
    reward_model: ModelOutput | None = None,
) -> Environment:
    """What a step needs; `same_model`: the reference is the run's input model, so a LoRA run
    refers to its own frozen base; `reward_model` scores the `score` entries."""
    tokenizer = AutoTokenizer.from_pretrained(run.init.tokenizer, trust_remote_code=False)
    sampling = Sampling(
        max_new_tokens=section.max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        vocab_size=len(tokenizer),
        temperature=section.generation_temperature,
        top_p=section.generation_top_p,
        top_k=section.generation_top_k,
    )
    ref_chunks, kl = None, section.loss.ref_policy_kl_penalty > 0 and section.loss.kl_type != KLEstimator.none
    if kl and run.lora and same_model:
        ref_chunks = run.chunks
    elif kl:
        ref_chunks = frozen_chunks(ref_model, section.parallel, divisible_by, run.cache, params_dtype=run.dtype)
    rules = [(resolve(r.name), dict(r.kwargs or {}), r.weight) for r in section.environment if r.name != SCORE]
    score_weight = sum(r.weight for r in section.environment if r.name == SCORE)
    score_chunks = None if reward_model is None else frozen_chunks(reward_model, section.parallel, divisible_by, run.cache, params_dtype=run.dtype)
    return Environment(tokenizer, prompts.pad_id, sampling, rules, ref_chunks, score_weight, score_chunks)


def train(run: Run, prompts: Prompts, env: Environment, objective: Objective) -> TrainResult:
    """GRPO's loop: each step rolls out, scores and optimizes (`step`); logs and checkpoints as SFT's."""
    cfg, state = run.cfg, run.state
    first_tokens, window_seconds, window_tokens, last_rollout = state.tokens, 0.0, 0, {}
    while state.step < run.total_steps:
        started = time.perf_counter()
        stats, last_rollout = step(run, prompts, env, objective)
        seconds = time.perf_counter() - started
        engine.advance(run, stats, seconds)
        window_seconds, window_tokens = window_seconds + seconds, window_tokens + stats.tokens
        last = state.step == run.total_steps
        if last or state.step == 1 or every(state.step, cfg.trainer.log_every_n_steps):
            engine.log_step(
                run,
                {
                    "step": state.step,
                    "loss": stats.loss,
                    "lr": stats.lr,
                    "grad_norm": stats.grad_norm,
                    "tokens": state.tokens,
                    "tokens_per_s": window_tokens / max(window_seconds, 1e-9),
                    **stats.metrics,
                },
            )
            window_seconds, window_tokens = 0.0, 0
        if last or engine.checkpoint_due(run):
            engine.save_checkpoint(run)
    return engine.result(run, first_tokens, summary(run, last_rollout))


def step(run: Run, prompts: Prompts, env: Environment, objective: Objective) -> tuple[StepStats, dict]:
    """Roll out and score this rank's share of the step's prompts (`rollout`), and take
    num_optimizer_steps_per_batch optimizer steps on equal slices of the rollouts."""
    cfg, started = run.cfg, time.perf_counter()
    engine.gather_weights(run.model)  # the sampler reads the weights directly, not through the DDP hooks
    refit = env.engine.refit(run.chunks, run.state.step) if env.engine is not None else {}
    kept, stats, rounds = rollout(run, prompts, env)
    generation_s = time.perf_counter() - started
    run.generation_seconds += generation_s
    rollouts = kept.rollouts(cfg, env.pad_id)
    samples = np.arange(len(rollouts))
    micro = [samples[i : i + cfg.micro_batch_size] for i in range(0, len(samples), cfg.micro_batch_size)]
    if env.ref_chunks is not None:
        with lora.disabled(env.ref_chunks):
            rollouts.store(
                "ref_logp",
                micro,
                engine.per_token_logps(run, env.ref_chunks, nll_forward(env.sampling, (UNFILTERED,)), micro, rollouts, rollouts.seq_length),
            )
    if cfg.num_optimizer_steps_per_batch > 1:
        rollouts.store(
            "old_logp", micro, engine.per_token_logps(run, run.chunks, nll_forward(env.sampling, (FILTERED,)), micro, rollouts, rollouts.seq_length)
        )
    per_update = len(micro) // cfg.num_optimizer_steps_per_batch
    updates = [
        engine.optimizer_step(run, objective, micro[k * per_update : (k + 1) * per_update], rollouts, rollouts.seq_length)
        for k in range(cfg.num_optimizer_steps_per_batch)
    ]
    generated = all_reduce_dp(float(stats.response_tokens.sum()))
    forwards = (
        1 + (env.ref_chunks is not None) + (cfg.num_optimizer_steps_per_batch > 1) + (env.score_chunks is not None)
    )  # generation, reference, old policy, reward model
    flops = all_reduce_dp(
        run.step_flops(rollouts, samples) + forwards * model_flops(ModelShape.of(run.init.hf_config), rollouts.document_lengths(samples), FORWARD)
    )
    summary_metrics = stats.global_metrics()
    metrics = summary_metrics | {name: float(np.mean([u.metrics[name] for u in updates])) for name in LOSS_METRICS}
    metrics["generation_tokens_per_s"] = generated / max(all_reduce_dp(generation_s, dist.ReduceOp.MAX), 1e-9)
    metrics |= {k: refit[k] for k in ("refit_s", "refit_bytes") if k in refit}
    bound = cfg.max_token_mult_prob_error
    if bound is not None and metrics["token_mult_prob_error"] > bound:
        raise ValueError(
            f"grpo.max_token_mult_prob_error: at step {run.state.step + 1} the sampler's log-probs are "
            f"{metrics['token_mult_prob_error']:.4f}x off the trainer's (bound {bound}): the {cfg.generation_engine} engine "
            "did not sample from the policy being trained (a refit or a sampling setting went wrong); the last checkpoint is kept"
        )
    if cfg.use_dynamic_sampling:
        metrics["dynamic_sampling_num_gen_batches"] = rounds
    return StepStats(
        loss=float(np.mean([u.loss for u in updates])),
        grad_norm=updates[-1].grad_norm,
        lr=updates[-1].lr,
        tokens=all_reduce_dp(rollouts.num_tokens(samples)),
        metrics=metrics,
        flops=flops,
    ), summary_metrics


@dataclass
class Scored:
    """Scored samples of this rank, host data in groups of num_generations_per_prompt."""

    prompts: list[list[int]]  # token ids, one per sample
    completions: list[Completion]
    rewards: torch.Tensor  # [samples] summed rewards, with the overlong penalty
    task_rewards: torch.Tensor  # [samples] before the penalty
    correct: torch.Tensor

    def groups(self, g: int, which: Sequence[int]) -> "Scored":
        rows = [k * g + j for k in which for j in range(g)]
        return Scored(
            [self.prompts[r] for r in rows], [self.completions[r] for r in rows], self.rewards[rows], self.task_rewards[rows], self.correct[rows]
        )

    def __add__(self, other: "Scored") -> "Scored":
        return Scored(
            self.prompts + other.prompts,
            self.completions + other.completions,
            torch.cat([self.rewards, other.rewards]),
            torch.cat([self.task_rewards, other.task_rewards]),
            torch.cat([self.correct, other.correct]),
        )

    def stats(self) -> RolloutStats:
        return RolloutStats(
            rewards=self.rewards,
            correct=self.correct,
            response_tokens=torch.tensor([len(c.tokens) for c in self.completions], device="cpu"),
            truncated=torch.tensor([c.truncated for c in self.completions], dtype=torch.bool, device="cpu"),
        )

    def rollouts(self, cfg: Any, pad_id: int) -> Rollouts:
        """The batch to train on: group advantages (with dynamic sampling and the overlong
        penalty the std is the task rewards', as NeMo-RL's) and, with `overlong_filtering`,
        truncated samples kept in their group's statistics but out of the gradient."""
        g = cfg.num_generations_per_prompt
        std_rewards = self.task_rewards.view(-1, g) if cfg.use_dynamic_sampling else None
        advantages = group_advantages(self.rewards.view(-1, g), cfg.use_rloo, cfg.normalize_rewards, std_rewards=std_rewards).flatten()
        truncated = torch.tensor([c.truncated for c in self.completions], dtype=torch.bool, device="cpu")
        trained = ~truncated if cfg.overlong_filtering else torch.ones_like(truncated)
        return Rollouts(self.prompts, self.completions, advantages, trained, pad_id)


def rollout(run: Run, prompts: Prompts, env: Environment) -> tuple[Scored, RolloutStats, int]:
    """This rank's share of the step's prompts, rolled out and scored; the stats of every
    sample generated, and the number of batches drawn. With `use_dynamic_sampling` (DAPO) a
    group whose task rewards all agree is dropped and the next batch (one data position
    further, the same on every rank) is drawn, until each rank keeps its share of
    num_prompts_per_step groups, the first ones in data order, or dynamic_sampling_max_gen_batches
    batches are spent (an error, as NeMo-RL's). Simplified: each DP rank fills its own share."""
    cfg, g = run.cfg, run.cfg.num_generations_per_prompt
    share, kept, generated = cfg.num_prompts_per_step // run.dp_size, None, None
    for batch in range(cfg.dynamic_sampling_max_gen_batches if cfg.use_dynamic_sampling else 1):
        if batch:
            run.state.position = run.batches.next(run.state.position)
        if kept is None or len(kept.completions) < share * g:
            mine = run.batches.indices(run.state.position)[run.dp_rank * share : (run.dp_rank + 1) * share]
            scored = generate_and_score(run, prompts, env, mine, batch)
            generated = scored if generated is None else generated + scored
            spread = scored.task_rewards.view(-1, g).std(-1) > 0 if cfg.use_dynamic_sampling else torch.ones(share, dtype=torch.bool, device="cpu")
            useful = scored.groups(g, torch.nonzero(spread).flatten().tolist())
            kept = useful if kept is None else kept + useful
        elif env.engine is not None:  # full: no prompts, but every rank takes part in the engine's round
            env.engine.generate([], env.sampling, [], run.dp_rank)
        else:  # full: no prompts, but an EP group's ranks generate in step (alignflow.job.generation)
            generate(run.chunks, [], env.sampling, cfg.generation_batch_size)
        if not cfg.use_dynamic_sampling or all_reduce_dp(int(len(kept.completions) < share * g), dist.ReduceOp.MAX) == 0:
            return kept.groups(g, range(share)), generated.stats(), batch + 1
    raise ValueError(
        f"grpo.dynamic_sampling_max_gen_batches: {cfg.dynamic_sampling_max_gen_batches} batches gave fewer than "
        f"num_prompts_per_step = {cfg.num_prompts_per_step} groups whose rewards differ; raise it, or "
        "num_generations_per_prompt, or use easier prompts"
    )


def generate_and_score(run: Run, prompts: Prompts, env: Environment, mine: np.ndarray, batch: int) -> Scored:
    """num_generations_per_prompt completions of each prompt of `mine`, seeded by (seed, step,
    DP rank, batch of the step), and their rewards."""
    cfg, g = run.cfg, run.cfg.num_generations_per_prompt
    tokens = [prompts.tokens(int(i)) for i in mine for _ in range(g)]
    if env.engine is not None:  # a seed per sample, by its place in the step: the same samples at any DP size
        first = run.dp_rank * len(mine) * g
        seeds = [int(np.random.SeedSequence([cfg.trainer.seed, run.state.step, batch, first + i]).generate_state(1)[0]) for i in range(len(tokens))]
        completions = env.engine.generate(tokens, env.sampling, seeds, run.dp_rank)
    else:
        seed = int(np.random.SeedSequence([cfg.trainer.seed, run.state.step, run.dp_rank] + [batch] * (batch > 0)).generate_state(1)[0])
        completions = generate(run.chunks, tokens, env.sampling, cfg.generation_batch_size, seed=seed)
    texts = [env.tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
    prompt_text = [prompts.text[int(i)] for i in mine for _ in range(g)]
    answers = [prompts.answer[int(i)] for i in mine for _ in range(g)]
    # rewards, lengths and matches are host data (scored on the CPU); the loss moves the rollouts to the device
    task = torch.tensor([reward(env, p, t, a) for p, t, a in zip(prompt_text, texts, answers)], dtype=torch.float64, device="cpu")
    if env.score_chunks is not None:
        task += env.score_weight * model_scores(
            env.score_chunks, [t + c.tokens for t, c in zip(tokens, completions)], env.pad_id, cfg.micro_batch_size
        )
    lengths = torch.tensor([len(c.tokens) for c in completions], dtype=torch.float64, device="cpu")
    penalty = (
        0.0
        if cfg.overlong_buffer_length is None
        else overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer_length, cfg.overlong_buffer_penalty)
    )
    correct = torch.tensor([exact_match(p, t, a) for p, t, a in zip(prompt_text, texts, answers)], device="cpu")
    return Scored(tokens, completions, task + penalty, task, correct)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13; NeMo-RL's `apply_reward_shaping`, TRL's
    `get_soft_overlong_punishment` at penalty 1): 0 up to max_length - buffer_length, then
    falling linearly to -penalty at max_length."""
    return (-(lengths - (max_length - buffer_length)) / buffer_length * penalty).clamp(max=0.0)


def reward(env: Environment, prompt: str, completion: str, answer: str) -> float:
    """The weighted sum of one sample's rule rewards (`alignflow.job.rewards.weighted_reward`)."""
    return weighted_reward(env.rewards, prompt, completion, answer, "grpo.environment")


def summary(run: Run, rollout: dict) -> dict:
    """The mean reward of the first and of the last tenth of the logged steps (one step's
    reward is noisy: the trend is what shows learning), and the last step's rollouts."""
    if run.metrics is None or not run.metrics.path.exists():  # rank 0 reports the result
        return {}
    rewards = [json.loads(line)["reward_mean"] for line in run.metrics.path.read_text().splitlines() if line.strip()]
    tenth = max(len(rewards) // 10, 1)
    return {
        "reward_first_tenth": float(np.mean(rewards[:tenth])),
        "reward_last_tenth": float(np.mean(rewards[-tenth:])),
        **{k: rollout[k] for k in ("reward_mean", "accuracy") if k in rollout},
    }


def run(cfg, inputs: dict, out: str) -> dict:
    section, data = cfg.grpo, Prepared(inputs["data"])
    prompts, ref_model = Prompts(data, "train"), local_model(inputs["ref_model"], cache_dir(cfg))
    reward_model = local_model(inputs["reward_model"], cache_dir(cfg)) if "reward_model" in inputs else None
    with training("grpo", cfg, inputs, out, len(prompts), section.num_prompts_per_step) as run:
        if problems := grpo_batch_problems(section, run.dp_size):
            raise ValueError("; ".join(problems))
        env = environment(run, section, data, ref_model, cfg.model.make_vocab_size_divisible_by, inputs["ref_model"] == inputs["model"], reward_model)
        longest = data.max_prompt_length + section.max_new_tokens
        engine_args = (section, run.hf_config, run.init.tokenizer, run.dtype, longest, section.trainer.seed, Path(f"{out}-engine"))
        with policy_engine(*engine_args) as env.engine:
            result = train(run, prompts, env, grpo_objective(section.loss, env.sampling))
    return finish(run, result)
