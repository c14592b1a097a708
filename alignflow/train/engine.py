"""The training engine shared by the training stages (SFT, DPO, GRPO).

A stage gives the engine three things, none of them subclasses:
- `data`: `TrainData(train, val, seq_length)`, datasets that turn row indices into micro
  batches (dicts of tensors; see `alignflow.train.data.Dataset`);
- `objective`: `Objective(forward, loss)`: `forward(model, batch)` runs one model chunk on a
  micro batch (on pipeline stages other than the last it returns the hidden states), and
  `loss(output, batch)` (last stage only) returns `LossTerms(total, count, metrics)`: the
  summed loss, how many units (tokens, pairs, ...) it sums over, and optional per-unit sums
  of the metrics `Objective.metric_names` lists (e.g. DPO's reward accuracy). The step's loss
  and metrics are sum / sum(count) over the whole global batch (all micro batches, all DP ranks).
- the stage's config section (`TrainStageBase` as plain data) and the model to start from.

`Trainer.setup()` builds everything in order (parallel groups, model, weights, optimizer,
data order, resume, metrics); `Trainer.train()` is the loop; `save_checkpoint` / `cleanup`.
It writes into `alignflow.train.workspace.Workspace.dir`: the output itself on a filesystem,
a scratch folder whose checkpoints and outputs are uploaded when the output is on an object store.
GRPO's step differs (roll out, score, then optimizer steps on the rollouts), so
`alignflow.stages.grpo.GRPOTrainer` overrides `train_step` and reuses `optimizer_step` and
`per_token_logps`; everything else (schedule, checkpoints, resume, metrics) is shared.

Per step: the global batch's rows are cut into this DP rank's micro batches
(num_micro = global / (micro * DP)), forwarded and backwarded through Megatron's
`get_forward_backward_func` (no pipelining, 1F1B, or interleaved with virtual PP) with
`calculate_per_token_loss`: the model chunks are wrapped in Megatron-Core's
`DistributedDataParallel` (gradients accumulate in contiguous fp32 buffers, reduced over DP
in buckets, overlapped with the backward pass where CUDA is), and the schedule's
`finalize_model_grads` sums them over DP, ties the embedding copies of the first and last PP
stages, sums sequence-parallel norms over TP and divides by the global count. Megatron's
optimizer (`get_megatron_optimizer`: Adam or AdamW, its weight-decay groups without decay on
biases and norms) clips by the global norm and steps.

Precision (`precision`): fp32, or bf16 mixed precision (bf16 weights and activations, fp32
main weights in the optimizer, gradients accumulated and reduced in fp32); `auto` is bf16 on
GPU, fp32 on CPU, and bf16 runs on CPU too. `parallel.use_distributed_optimizer` shards the
fp32 main weights and Adam states over DP (ZeRO-1: reduce-scatter of gradients, all-gather
of weights, overlapped with the next forward where CUDA is). Activation recompute
(`recompute_granularity` selective/full, `recompute_method`, `recompute_num_layers`) is
Megatron's. Checkpoints (`alignflow.train.checkpointing`) reshard to another TP/PP/DP layout.

Simplified / missing: no fp16 (loss scaling) and no fp8; bf16 training starts from the input
weights rounded to bf16 (main weights are fp32 from then on; an HF model is usually bf16
anyway); no context parallelism, and sequence parallelism only with Transformer Engine
(untested here); data-parallel replicas start from identical weights (no DP random init).
"""

import functools
import json
import logging
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from omegaconf import OmegaConf
from torch import Tensor

from alignflow.checkpoint import HF_DIR, MODEL_DIR, TOKENIZER_DIR

from alignflow.megatron import checkpoint as megatron_checkpoint
from alignflow.megatron import runtime
from alignflow.megatron.model import build_gpt, packed_thd
from alignflow.train import checkpointing
from alignflow.train.checkpointing import TrainerState
from alignflow.train.data import Dataset, GlobalBatches, dp_micro_batches
from alignflow.train.metrics import MetricsLog
from alignflow.train.schedule import lr_at
from alignflow.train.workspace import CHECKPOINTS, cache_dir, local_model, workspace_for

log = logging.getLogger("alignflow.train")


@dataclass
class LossTerms:
    total: Tensor  # summed loss of the micro batch (a scalar with grad)
    count: Tensor  # units it sums over (int scalar)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # sums over the same units


@dataclass
class Objective:
    forward: Callable[[Any, dict], Tensor]
    loss: Callable[[Tensor, dict], LossTerms]
    metric_names: tuple[str, ...] = ()  # every rank must know them: only the last stage computes them


@dataclass
class TrainData:
    train: Dataset
    val: Optional[Dataset]
    seq_length: int  # every micro batch is padded to it (pipeline buffers have one shape)
    rows_per_item: int = 1  # model rows per dataset item: 2 for preference pairs (chosen, rejected)


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainResult:
    steps: int
    train_loss: Optional[float]
    val_loss: Optional[float]
    tokens: int
    tokens_per_s: float
    stopped_early: bool
    checkpoint: Path  # the final checkpoint folder
    summary: dict = field(default_factory=dict)  # stage-specific headline metrics, listed first


def check_supported(parallel: Any) -> None:
    if parallel.context_parallel_size > 1:
        raise NotImplementedError("context_parallel_size > 1 needs Transformer Engine's attention: not implemented")
    if parallel.sequence_parallel and not gpt_layer_specs.HAVE_TE:
        raise NotImplementedError("sequence_parallel needs Transformer Engine's norms; Megatron's local spec (CPU) refuses it")


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_precision(precision: str) -> torch.dtype:
    """The weights' dtype: auto = bf16 on GPU, fp32 on CPU (where bf16 runs too, e.g. to test it)."""
    return PRECISIONS[("bf16" if torch.cuda.is_available() else "fp32") if precision == "auto" else precision]


class Trainer:
    def __init__(self, cfg: Any, model_cfg: Any, hf_config: dict, init_model: str, data: TrainData, objective: Objective,
                 out: str, wandb_cfg: Any = None, name: str = "train", cache: Optional[Path] = None):
        """`init_model`: a local folder; `out`: the stage's output URI, on an object store worked
        on in a scratch folder of `cache` (see `alignflow.train.workspace`)."""
        self.cfg, self.model_cfg, self.hf_config, self.init_model = cfg, model_cfg, hf_config, init_model
        self.data, self.objective, self.name, self.wandb_cfg = data, objective, name, wandb_cfg
        self.workspace = workspace_for(out, cache or cache_dir())
        self.out = self.workspace.dir
        self.checkpoints = self.out / CHECKPOINTS

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg = self.cfg
        check_supported(cfg.parallel)
        self.dtype = resolve_precision(cfg.precision)
        runtime.init_parallel(cfg.parallel, seed=cfg.trainer.seed)
        self.rank = dist.get_rank()
        self.dp_rank, self.dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        self.check_batch_sizes()
        built = build_gpt(self.hf_config, cfg.parallel, params_dtype=self.dtype,
                          make_vocab_size_divisible_by=self.model_cfg.make_vocab_size_divisible_by,
                          hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
                          calculate_per_token_loss=True, **recompute_settings(cfg))
        self.chunks = built if isinstance(built, list) else [built]  # the GPTModels: weights, checkpoints, generation
        self.model = wrap_ddp(self.chunks, ddp_config(cfg.parallel))  # what the training schedule runs
        self.optimizer = build_optimizer(self.model, cfg, self.dtype)
        self.batches = GlobalBatches(len(self.data.train), self.rows_per_step(), cfg.trainer.seed)
        self.total_steps = cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else cfg.trainer.max_epochs * self.batches.per_epoch
        self.state = self.resume_or_start()
        self.metrics = MetricsLog(self.out, self.checkpoints, self.state.step, self.wandb_cfg, self.name) if self.rank == 0 else None

    def rows_per_step(self) -> int:
        """Dataset items each step consumes."""
        return self.cfg.global_batch_size

    def check_batch_sizes(self) -> None:
        cfg = self.cfg
        if cfg.global_batch_size % (cfg.micro_batch_size * self.dp_size):
            raise ValueError(f"global_batch_size {cfg.global_batch_size} is not a multiple of micro_batch_size * DP "
                             f"({cfg.micro_batch_size} * {self.dp_size})")

    def resume_or_start(self) -> TrainerState:
        """The latest complete checkpoint, or the input model (with resume off, old checkpoints are removed)."""
        if self.rank == 0:
            self.workspace.restore(self.cfg.checkpoint.resume)
        dist.barrier()
        self.workspace.check_shared()
        steps = checkpointing.complete_steps(self.checkpoints)
        if steps:
            path = checkpointing.step_dir(self.checkpoints, steps[-1])
            state = checkpointing.load(path, self.chunks, self.optimizer)
            if self.rank == 0:
                log.info("resumed from %s (step %d of %d)", path, state.step, self.total_steps)
            return state
        megatron_checkpoint.load(self.chunks, f"{self.init_model.rstrip('/')}/model")
        self.optimizer.reload_model_params()  # fp32 main weights from the loaded ones
        if self.rank == 0:
            log.info("starting from %s: %d steps of %d rows", self.init_model, self.total_steps, self.cfg.global_batch_size)
        return TrainerState()

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        cfg, state = self.cfg.trainer, self.state
        # Throughput counts the time of training steps only: validation and checkpoints are I/O.
        step_seconds, window_seconds, window_tokens, first_tokens = 0.0, 0.0, 0, state.tokens
        for chunk in self.chunks:
            chunk.train()
        while state.step < self.total_steps and not state.stopped_early:
            step_started = time.perf_counter()
            stats = self.train_step(self.batches.indices(state.position))
            step_seconds += time.perf_counter() - step_started
            window_seconds += time.perf_counter() - step_started
            state.step += 1
            state.position = self.batches.next(state.position)
            state.tokens += stats.tokens
            state.last_loss = stats.loss
            window_tokens += stats.tokens
            last = state.step == self.total_steps
            val_loss = None
            if self.data.val is not None and (last or _every(state.step, cfg.val_check_interval)):
                val_loss = self.validate()
                self.track_early_stopping(val_loss)
            if val_loss is not None or last or state.step == 1 or _every(state.step, cfg.log_every_n_steps):
                record = {"step": state.step, "loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
                          "tokens": state.tokens, "tokens_per_s": window_tokens / max(window_seconds, 1e-9)}
                record |= stats.metrics
                if val_loss is not None:
                    record |= {"val_loss": val_loss, **self.last_val_metrics}
                if self.metrics is not None:
                    self.metrics.write(record, self.total_steps)
                window_seconds, window_tokens = 0.0, 0
            if last or state.stopped_early or _every(state.step, self.cfg.checkpoint.every_n_steps):
                self.save_checkpoint()
        final = checkpointing.complete_steps(self.checkpoints)
        if not final or final[-1] != state.step:  # e.g. zero steps ran: nothing to resume from yet
            self.save_checkpoint()
        return TrainResult(
            steps=state.step, train_loss=state.last_loss, val_loss=state.last_val_loss, tokens=state.tokens,
            tokens_per_s=(state.tokens - first_tokens) / max(step_seconds, 1e-9),
            stopped_early=state.stopped_early, checkpoint=checkpointing.step_dir(self.checkpoints, state.step),
            summary=self.summary(),
        )

    def summary(self) -> dict:
        """Stage-specific headline metrics of the finished run (none for the supervised stages)."""
        return {}

    def train_step(self, indices: np.ndarray) -> StepStats:
        micro = dp_micro_batches(indices, self.cfg.micro_batch_size, self.dp_rank, self.dp_size)
        stats = self.optimizer_step(micro, self.data.train, self.data.seq_length, self.next_lr())
        stats.tokens = all_reduce_dp(sum(self.data.train.num_tokens(m) for m in micro))
        return stats

    def next_lr(self) -> float:
        """The learning rate of the step about to run."""
        optim = self.cfg.optim
        return lr_at(self.state.step + 1, lr=optim.lr, min_lr=optim.min_lr, warmup_steps=optim.warmup_steps,
                     total_steps=self.total_steps, schedule=optim.schedule)

    def optimizer_step(self, micro: list[np.ndarray], dataset: Dataset, seq_length: int, lr: float) -> StepStats:
        """One optimizer step on this rank's micro batches of a global batch (tokens left at 0).
        The schedule leaves the gradients reduced and divided by the global count (see top)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        total, count, metrics = self.run_micro_batches(micro, dataset, forward_only=False, seq_length=seq_length)
        set_lr(self.optimizer, lr, self.cfg.optim.weight_decay)
        _, grad_norm, _ = self.optimizer.step()  # no loss scaler (bf16 / fp32): a step always applies
        return StepStats(loss=total / max(count, 1.0), grad_norm=grad_norm, lr=lr, tokens=0,
                         metrics={k: v / max(count, 1.0) for k, v in metrics.items()})

    def run_micro_batches(self, micro: list[np.ndarray], dataset: Optional[Dataset] = None,
                          forward_only: bool = False, seq_length: Optional[int] = None) -> tuple[float, float, dict[str, float]]:
        """Forward (and backward) `micro`; returns the global (loss sum, count, metric sums) on every rank."""
        outputs = self.schedule(self.model, self._forward_step, micro, dataset or self.data.train, forward_only, seq_length)
        names = self.objective.metric_names
        sums = torch.zeros(2 + len(names), dtype=torch.float64, device=device())
        for out in outputs:
            sums += out["terms"].double()
        dist.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())  # only the last stage has it
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        return sums[0].item(), sums[1].item(), {name: sums[2 + i].item() for i, name in enumerate(names)}

    def schedule(self, chunks: list, forward_step, micro: list[np.ndarray], dataset: Dataset, forward_only: bool,
                 seq_length: Optional[int] = None) -> list:
        """Megatron's pipeline schedule over `micro`; the loss functions' outputs (last stage only).
        THD attention runs a micro batch as one flat sequence, so its stages pass [b * s, 1, h]."""
        batches = [to_device(dataset.collate(m)) for m in micro]
        rows, length = self.cfg.micro_batch_size * self.data.rows_per_item, seq_length or self.data.seq_length
        if packed_thd():
            rows, length = 1, rows * length
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches),
            seq_length=length, micro_batch_size=rows, forward_only=forward_only,
        )

    @torch.no_grad()
    def per_token_logps(self, chunks: list, micro: list[np.ndarray], dataset: Dataset, seq_length: int) -> list[Tensor]:
        """log p(label) per position [micro, s] of each micro batch under `chunks` (e.g. a reference
        model); on the last pipeline stage only (an empty list elsewhere)."""
        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            return self.objective.forward(model, batch), lambda nll: (nll.sum() * 0, torch.tensor(1), {"logp": -nll.detach().float()})

        with eval_mode(chunks):
            outputs = self.schedule(chunks, forward_step, micro, dataset, forward_only=True, seq_length=seq_length)
        return [out["logp"] for out in outputs]

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        return self.objective.forward(model, batch), functools.partial(self._loss, batch)

    def _loss(self, batch: dict, output: Tensor):
        terms = self.objective.loss(output, batch)
        extra = [terms.metrics[name].detach().float() for name in self.objective.metric_names]
        reported = torch.stack([terms.total.detach().float(), terms.count.detach().float(), *extra])
        return terms.total, terms.count.to(torch.int), {"terms": reported}

    # ------------------------------------------------------------------ validation, early stopping

    def validate(self) -> Optional[float]:
        """Mean loss over the first limit_val_batches x micro_batch_size rows of the val split,
        shared among the DP ranks, so every layout validates on the same rows."""
        micro_size = self.cfg.micro_batch_size
        rows = min(self.cfg.trainer.limit_val_batches * micro_size, len(self.data.val))
        rows -= rows % (micro_size * self.dp_size)
        if rows <= 0:
            return None
        micro = dp_micro_batches(np.arange(rows), micro_size, self.dp_rank, self.dp_size)
        with eval_mode(self.chunks), torch.no_grad():
            total, count, metrics = self.run_micro_batches(micro, self.data.val, forward_only=True)
        self.state.last_val_loss = total / max(count, 1.0)
        self.last_val_metrics = {f"val_{k}": v / max(count, 1.0) for k, v in metrics.items()}
        return self.state.last_val_loss

    def track_early_stopping(self, val_loss: Optional[float]) -> None:
        patience, state = self.cfg.trainer.early_stopping_patience, self.state
        if val_loss is None:
            return
        if state.best_val_loss is None or val_loss < state.best_val_loss - self.cfg.trainer.early_stopping_min_delta:
            state.best_val_loss, state.bad_validations = val_loss, 0
            return
        state.bad_validations += 1
        if patience is not None and state.bad_validations >= patience:
            state.stopped_early = True
            log.info("early stopping at step %d: val_loss has not improved for %d validations", state.step, patience)

    # ------------------------------------------------------------------ checkpoint, cleanup

    def save_checkpoint(self) -> None:
        gather_weights(self.model)
        path = checkpointing.save(self.checkpoints, self.chunks, self.optimizer, self.state)
        if self.rank == 0:
            ckpt = self.cfg.checkpoint
            deleted = checkpointing.prune(self.checkpoints, ckpt.save_top_k, ckpt.monitor, ckpt.mode)
            log.info("checkpoint %s%s", path, f" (removed steps {deleted})" if deleted else "")
            self.workspace.push_checkpoint(path, ckpt.save_top_k, ckpt.monitor, ckpt.mode)
        dist.barrier()

    def cleanup(self) -> None:
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        runtime.teardown()


# ---------------------------------------------------------------------- shared pieces


def recompute_settings(cfg: Any) -> dict:
    """TransformerConfig's activation-recompute fields for a stage's knobs (see the schema)."""
    if cfg.recompute_granularity == "none":
        return {}
    if cfg.recompute_granularity == "selective":  # Megatron's default module: the core attention
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": cfg.recompute_method, "recompute_num_layers": cfg.recompute_num_layers}


def ddp_config(parallel: Any) -> DistributedDataParallelConfig:
    """Gradients accumulate in fp32 buffers and are reduced in fp32 whatever the weights' dtype;
    reduce-scattered to the distributed optimizer's shards; overlapped where CUDA is (or as set)."""
    on_gpu, distributed = torch.cuda.is_available(), parallel.use_distributed_optimizer
    overlap_grads = on_gpu if parallel.overlap_grad_reduce is None else parallel.overlap_grad_reduce
    overlap_params = on_gpu and distributed if parallel.overlap_param_gather is None else parallel.overlap_param_gather
    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed,
                                         overlap_grad_reduce=overlap_grads, overlap_param_gather=overlap_params)


def wrap_ddp(chunks: list, config: DistributedDataParallelConfig) -> list[DistributedDataParallel]:
    """Megatron's DDP around each chunk (buckets on the first only, as Megatron-LM), and the
    schedule's hooks into it: `finalize_model_grads` after the last micro batch and, with
    overlap, no gradient reduction before the last micro batch of each chunk."""
    model = [DistributedDataParallel(chunk.config, config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
    schedule = chunks[0].config  # one TransformerConfig shared by the chunks
    schedule.finalize_model_grads_func = finalize_model_grads
    if config.overlap_grad_reduce:
        no_sync, grad_sync = [m.no_sync for m in model], [m.start_grad_sync for m in model]
        schedule.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        schedule.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    return model


DECOUPLED_DECAY = {"adamw": True, "adam": False}  # AdamW's decoupled weight decay, or Adam's L2 term


def build_optimizer(model: list, cfg: Any, dtype: torch.dtype) -> MegatronOptimizer:
    """Megatron's optimizer over the DDP-wrapped chunks: fp32 main weights for bf16 ones, ZeRO-1
    with `parallel.use_distributed_optimizer`, no weight decay on biases and norms (its groups'
    wd_mult, see `set_lr`), clipping by the global norm at `trainer.gradient_clip_val` (0: off)."""
    optim = cfg.optim
    if optim.name not in DECOUPLED_DECAY:
        raise ValueError(f"unknown optimizer {optim.name!r}; supported: {', '.join(DECOUPLED_DECAY)}")
    return get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        decoupled_weight_decay=DECOUPLED_DECAY[optim.name], adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_param_gather=model[0].ddp_config.overlap_param_gather, clip_grad=cfg.trainer.gradient_clip_val,
    ), model)


def set_lr(optimizer: MegatronOptimizer, lr: float, weight_decay: float) -> None:
    """This step's learning rate and weight decay times each group's multipliers, as Megatron's
    OptimizerParamScheduler sets them (Megatron's groups: wd_mult 0 for biases and norms)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


def gather_weights(model: list[DistributedDataParallel]) -> None:
    """With overlapped parameter gathers, an optimizer step leaves the other DP ranks' shards of
    the weights to the next forward's hooks: gather them before the weights are read directly."""
    if model[0].ddp_config.overlap_param_gather:
        for chunk in model:
            chunk.start_param_sync(force_sync=True)


@contextmanager
def eval_mode(chunks: list) -> Iterator[None]:
    """`chunks` in eval mode (no dropout) for the block, back in train mode after it."""
    for chunk in chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk in chunks:
            chunk.train()


def all_reduce_dp(value, op=dist.ReduceOp.SUM):
    """An int or float reduced over the data-parallel group (same type back)."""
    t = torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64, device=device())
    dist.all_reduce(t, op=op, group=parallel_state.get_data_parallel_group())
    return type(value)(t.item())


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def to_device(batch: dict) -> dict:
    if not torch.cuda.is_available():
        return batch
    return {k: v.cuda(non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def run_training_stage(name: str, cfg: Any, inputs: dict, data: TrainData, objective: Objective, out: str,
                       trainer_class: type = Trainer, **trainer_args) -> dict:
    """What a training stage's `run` does: train `cfg[name]` from `inputs["model"]`, then
    publish the final weights as `{out}/model` beside the input model's hf/ and tokenizer/."""
    cache = cache_dir(cfg)
    model_dir = local_model(inputs["model"], cache)
    hf_config = json.loads((model_dir / HF_DIR / "config.json").read_text())
    trainer = trainer_class(cfg[name], cfg.model, hf_config, str(model_dir), data, objective, out,
                            OmegaConf.select(cfg, "logging.wandb"), name=name, cache=cache, **trainer_args)
    try:
        trainer.setup()
        result = trainer.train()
        if trainer.rank == 0:
            publish(result.checkpoint, model_dir, trainer.out)
    finally:
        trainer.cleanup()
    if trainer.rank == 0:  # after cleanup, which finishes the wandb run's files
        trainer.workspace.push_outputs()
    return result.summary | {
        "train_loss": result.train_loss,
        "val_loss": result.val_loss,
        "steps": result.steps,
        "tokens": result.tokens,
        "tokens_per_s": round(result.tokens_per_s, 1),
        "stopped_early": result.stopped_early,
    }


def publish(checkpoint: Path, model_dir: Path, out: Path) -> None:
    """The final checkpoint's weights as `{out}/model`, with the input model's hf/ and tokenizer/."""
    for name, source in ((MODEL_DIR, checkpoint / "model"), (HF_DIR, model_dir / HF_DIR), (TOKENIZER_DIR, model_dir / TOKENIZER_DIR)):
        tmp = out / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        if source.exists():
            shutil.copytree(source, tmp)
            shutil.rmtree(out / name, ignore_errors=True)
            tmp.rename(out / name)
    log.info("final model at %s", out / MODEL_DIR)
