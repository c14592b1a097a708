"""The supervised loop of SFT and DPO, written from the engine's functions.

Each step: this DP rank's micro batches of the step's global batch, one optimizer step; then
validation every `trainer.val_check_interval` steps (and at the end), a metrics record on
the first and last steps, every `log_every_n_steps` and after each validation, and a
checkpoint every `checkpoint.every_n_steps` or `every_n_minutes` (and at the end or on early
stopping).
"""

import time
from dataclasses import dataclass
from typing import Optional

from alignflow.job.train import engine
from alignflow.job.train.data import Dataset, dp_micro_batches
from alignflow.job.train.engine import Objective, Run, TrainResult, every


@dataclass
class Supervised:
    """What the loop trains on: datasets of items, each `rows_per_item` model rows, micro
    batches of rows of `seq_length` tokens."""

    train: Dataset
    val: Optional[Dataset]
    seq_length: int
    rows_per_item: int = 1


def supervised(run: Run, data: Supervised, objective: Objective) -> TrainResult:
    cfg, state = run.cfg, run.state
    check_batch_sizes(run)
    first_tokens, window_seconds, window_tokens = state.tokens, 0.0, 0
    while state.step < run.total_steps and not state.stopped_early:
        started = time.perf_counter()
        indices = run.batches.indices(state.position)
        micro = dp_micro_batches(data.train, indices, cfg.micro_batch_size, run.dp_rank, run.dp_size)
        stats = engine.optimizer_step(run, objective, micro, data.train, data.seq_length, data.rows_per_item)
        stats.tokens = engine.all_reduce_dp(sum(data.train.num_tokens(m) for m in micro))
        stats.flops = run.step_flops(data.train, indices)
        seconds = time.perf_counter() - started
        engine.advance(run, stats, seconds)
        window_seconds, window_tokens = window_seconds + seconds, window_tokens + stats.tokens
        last = state.step == run.total_steps
        validated = data.val is not None and (last or every(state.step, cfg.trainer.val_check_interval))
        val_loss = engine.validate(run, objective, data.val, data.seq_length, data.rows_per_item) if validated else None
        if val_loss is not None or last or state.step == 1 or every(state.step, cfg.trainer.log_every_n_steps):
            record = {
                "step": state.step,
                "loss": stats.loss,
                "lr": stats.lr,
                "grad_norm": stats.grad_norm,
                "tokens": state.tokens,
                "tokens_per_s": window_tokens / max(window_seconds, 1e-9),
                **stats.metrics,
            }
            if val_loss is not None:
                record |= {"val_loss": val_loss, **run.last_val_metrics}
            engine.log_step(run, record)
            window_seconds, window_tokens = 0.0, 0
        if last or state.stopped_early or engine.checkpoint_due(run):
            engine.save_checkpoint(run)
    return engine.result(run, first_tokens)


def check_batch_sizes(run: Run) -> None:
    cfg = run.cfg
    if cfg.global_batch_size % (cfg.micro_batch_size * run.dp_size):
        raise ValueError(
            f"global_batch_size {cfg.global_batch_size} is not a multiple of micro_batch_size * DP ({cfg.micro_batch_size} * {run.dp_size})"
        )
