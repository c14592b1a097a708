"""The training engine: plain functions the training stages' loops are written from.

`setup` builds a `Run` in order (parallel groups, model, Megatron's DDP and optimizer, the
data order, resume from the latest checkpoint or the input model, metrics), inside
`training(...)`, which always tears the process groups down. A stage's loop then calls:
- `optimizer_step(run, objective, micro, dataset, ...)`: forward/backward of this rank's
  micro batches through Megatron's schedule and one optimizer step;
- `per_token_logps(run, chunks, ...)`: log-probs under a model (the policy, a reference);
- `validate(run, objective, val)`, `next_lr(run)`, `log_step(run, record)`,
  `save_checkpoint(run)`, `advance(run, stats)`;
and `finish(run, result)` publishes the final weights and returns the stage's metrics.
`alignflow.job.train.loop.supervised` is the SFT/DPO loop; GRPO writes its own
(`alignflow.job.stages.grpo`). A stage gives its loop a dataset (`alignflow.job.train.data.Dataset`)
and an `Objective(forward, loss)` (`alignflow.job.forward.passes`, which forward-only stages share
without importing this module). A step's loss and metrics are sum / sum(count) over the whole
global batch (all micro batches, all DP ranks).

The run writes into `alignflow.job.train.workspace.Workspace.dir`: the output itself on a
filesystem, a scratch folder whose checkpoints and outputs are uploaded when the output is on
an object store.

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
Megatron's. Checkpoints (`alignflow.job.train.checkpoints`) reshard to another TP/PP/DP layout.

LoRA (`finetuning_type` lora / lora_merged, `alignflow.job.model.lora`): `setup` loads the
input model, then attaches the adapters and freezes the rest, so Megatron's DDP and optimizer
hold the adapters only; checkpoints hold the adapters and their optimizer state (the frozen
base is reloaded from the input model on resume); `finish` publishes the adapter (lora) or the
merged weights (lora_merged). `trainable_params` and `optimizer_state_bytes` are in every
training stage's metrics, and so is its hardware use (`hardware_use`: TFLOP/s and MFU of the
model FLOPs of `alignflow.job.train.utilization` over the steps' time, peak memory).

Simplified / missing: no fp16 (loss scaling) and no fp8; bf16 training starts from the input
weights rounded to bf16 (main weights are fp32 from then on; an HF model is usually bf16
anyway); no context parallelism, and sequence parallelism only with Transformer Engine
(untested here); data-parallel replicas start from identical weights (no DP random init).
"""

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
from omegaconf import OmegaConf
from torch import Tensor

from alignflow.job.model_files import ADAPTER_DIR, HF_DIR, LORA_FILE, MODEL_DIR, TOKENIZER_DIR, ModelOutput
from alignflow.job.device import device
from alignflow.job.forward.models import cache_dir, load_model_output, local_model
from alignflow.job.forward.passes import Objective, eval_mode, hardware_use, loss_sums, resolve_precision, schedule
from alignflow.job.model import sharded_state
from alignflow.job.model import lora, runtime
from alignflow.job.model.gpt import build_gpt
from alignflow.job.train import checkpoints, utilization
from alignflow.job.train.checkpoints import TrainerState
from alignflow.job.train.data import Dataset, GlobalBatches, dp_micro_batches
from alignflow.job.train.metrics import MetricsLog
from alignflow.job.train.schedule import lr_at
from alignflow.job.train.workspace import CHECKPOINTS, Workspace, workspace_for

log = logging.getLogger("alignflow.job.train")


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0  # model FLOPs of the step over all ranks (`alignflow.job.train.utilization`)


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
    weights: Optional[Path] = None  # what `finish` publishes (`final_weights`)


def check_supported(parallel: Any) -> None:
    if parallel.context_parallel_size > 1:
        raise NotImplementedError("context_parallel_size > 1 needs Transformer Engine's attention: not implemented")
    if parallel.sequence_parallel and not gpt_layer_specs.HAVE_TE:
        raise NotImplementedError("sequence_parallel needs Transformer Engine's norms; Megatron's local spec (CPU) refuses it")


@dataclass
class Run:
    """One training job's pieces, as `setup` builds them."""

    kind: str
    cfg: Any  # the stage's typed section
    init: ModelOutput  # the model it starts from (a local folder)
    hf_config: dict  # the HF config of the model it trains: the input's, or a reward model's on its trunk
    source: str  # the URI of that model as the pipeline gave it (a LoRA output's base)
    cache: Path  # where input models from object stores are copied (`alignflow.job.train.workspace`)
    workspace: Workspace
    dtype: torch.dtype
    rank: int
    dp_rank: int
    dp_size: int
    chunks: list  # the GPTModel chunks: weights, checkpoints, generation
    model: list  # the DDP-wrapped chunks the training schedule runs
    optimizer: MegatronOptimizer
    batches: GlobalBatches
    total_steps: int
    state: TrainerState = field(default_factory=TrainerState)
    metrics: Optional[MetricsLog] = None
    last_val_metrics: dict = field(default_factory=dict)
    step_seconds: float = 0.0  # time in training steps (validation and checkpoints are I/O)
    flops: float = 0.0  # model FLOPs of this job's steps
    val_seconds: float = 0.0  # time in validation passes
    val_flops: float = 0.0  # their model FLOPs
    generation_seconds: float = 0.0  # of the step time, in generation (GRPO's rollouts)
    checkpointed_at: float = field(default_factory=time.monotonic)  # when this job last saved (or started)

    @property
    def out(self) -> Path:
        return self.workspace.dir

    @property
    def lora(self) -> bool:
        """Whether it trains LoRA adapters on a frozen base (finetuning_type lora / lora_merged)."""
        return self.cfg.finetuning_type != "all_weights"

    @property
    def trained(self) -> str:
        """The weights its checkpoints hold (`alignflow.job.model.sharded_state.SELECT`): a LoRA
        run's base never changes and is its input model, so they hold the adapters only."""
        return "adapters" if self.lora else "all"

    @property
    def checkpoints(self) -> Path:
        return self.workspace.dir / CHECKPOINTS

    def step_flops(self, dataset: Dataset, indices: np.ndarray) -> float:
        """Model FLOPs of a training step on these items of `dataset` (a global batch)."""
        passes = utilization.LORA_TRAINING if self.lora else utilization.TRAINING
        return utilization.model_flops(utilization.ModelShape.of(self.hf_config), dataset.document_lengths(indices), passes)


@contextmanager
def training(
    kind: str, cfg: Any, inputs: dict, out: str, num_rows: int, rows_per_step: int, model_config: Optional[Callable[[dict], dict]] = None
) -> Iterator[Run]:
    """A run of the `kind` section of `cfg` from `inputs["model"]` into `out`, over `num_rows`
    dataset items taken `rows_per_step` per step; the process groups are torn down after it.
    `model_config` gives the HF config of the model to train from the input's (a reward model:
    `alignflow.job.convert.families.score_config`); the output's hf/config.json is it."""
    run = None
    try:
        run = setup(kind, cfg, inputs, out, num_rows, rows_per_step, model_config)
        yield run
    except BaseException:
        if run is not None:
            run.workspace.close(failed=True)
        raise
    else:
        run.workspace.close(failed=False)
    finally:
        if run is not None and run.metrics is not None:
            run.metrics.close()
        runtime.teardown()


def setup(
    kind: str, cfg: Any, inputs: dict, out: str, num_rows: int, rows_per_step: int, model_config: Optional[Callable[[dict], dict]] = None
) -> Run:
    section, cache = cfg[kind], cache_dir(cfg)
    check_supported(section.parallel)
    dtype = resolve_precision(section.precision)
    init = local_model(inputs["model"], cache)
    hf_config = model_config(init.hf_config) if model_config else init.hf_config
    runtime.init_parallel(section.parallel, seed=section.trainer.seed)
    chunks = build_gpt(
        hf_config,
        section.parallel,
        params_dtype=dtype,
        head_seed=section.trainer.seed,
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        hidden_dropout=section.hidden_dropout,
        attention_dropout=section.attention_dropout,
        calculate_per_token_loss=True,
        **recompute_settings(section),
    )
    if section.finetuning_type != "all_weights":  # the frozen base first, then its adapters: all the optimizer sees
        load_model_output(chunks, init, cache)
        lora.attach(chunks, lora.LoRASettings.of(section.lora), seed=section.trainer.seed)
    model = wrap_ddp(chunks, ddp_config(section.parallel))
    batches = GlobalBatches(num_rows, rows_per_step, section.trainer.seed)
    trainer = section.trainer
    run = Run(
        kind,
        section,
        init,
        hf_config,
        inputs["model"],
        cache,
        workspace_for(out, cache),
        dtype,
        dist.get_rank(),
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
        chunks,
        model,
        build_optimizer(model, section, dtype),
        batches,
        trainer.max_steps if trainer.max_steps > 0 else trainer.max_epochs * batches.per_epoch,
    )
    try:
        run.state = resume_or_start(run)
    except BaseException:
        run.workspace.close(failed=True)
        raise
    if run.rank == 0:
        run.metrics = MetricsLog(run.out, run.checkpoints, run.state.step, OmegaConf.select(cfg, "logging.wandb"), kind)
    return run


def resume_or_start(run: Run) -> TrainerState:
    """The latest complete checkpoint, or the input model (with resume off, old checkpoints are removed)."""
    if run.workspace.leader:  # of this node's scratch (object stores), else rank 0
        run.workspace.restore(run.cfg.checkpoint.resume)
    dist.barrier()
    steps = checkpoints.complete_steps(run.checkpoints)
    if steps:
        path = checkpoints.step_dir(run.checkpoints, steps[-1])
        state = checkpoints.load(path, run.chunks, run.optimizer, run.trained)
        if run.rank == 0:
            log.info("resumed from %s (step %d of %d)", path, state.step, run.total_steps)
        return state
    if not run.lora:  # a LoRA run loaded its base before attaching its adapters (`setup`)
        load_model_output(run.chunks, run.init, run.cache)
    run.optimizer.reload_model_params()  # fp32 main weights from the loaded ones
    if run.rank == 0:
        log.info("starting from %s: %d steps of %d rows", run.init.uri, run.total_steps, run.batches.size)
    return TrainerState()


def next_lr(run: Run) -> float:
    """The learning rate of the step about to run."""
    optim = run.cfg.optim
    return lr_at(
        run.state.step + 1, lr=optim.lr, min_lr=optim.min_lr, warmup_steps=optim.warmup_steps, total_steps=run.total_steps, schedule=optim.schedule
    )


def optimizer_step(run: Run, objective: Objective, micro: list[np.ndarray], dataset: Dataset, seq_length: int, rows_per_item: int = 1) -> StepStats:
    """One optimizer step on this rank's micro batches of a global batch (tokens left at 0).
    The schedule leaves the gradients reduced and divided by the global count (see top)."""
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    total, count, metrics = forward_backward(run, objective, micro, dataset, seq_length, rows_per_item, forward_only=False)
    lr = next_lr(run)
    set_lr(run.optimizer, lr, run.cfg.optim.weight_decay)
    _, grad_norm, _ = run.optimizer.step()  # no loss scaler (bf16 / fp32): a step always applies
    return StepStats(loss=total / max(count, 1.0), grad_norm=grad_norm, lr=lr, tokens=0, metrics={k: v / max(count, 1.0) for k, v in metrics.items()})


def forward_backward(
    run: Run, objective: Objective, micro: list[np.ndarray], dataset: Dataset, seq_length: int, rows_per_item: int, forward_only: bool
) -> tuple[float, float, dict[str, float]]:
    """Forward (and backward) this rank's micro batches `micro` of `dataset`; the global (loss
    sum, count, metric sums) on every rank."""
    batches = [dataset.collate(m) for m in as_many_as_the_expert_group(micro)]
    return loss_sums(run.model, objective, batches, seq_length, run.cfg.micro_batch_size * rows_per_item, forward_only)


def as_many_as_the_expert_group(micro: list[np.ndarray]) -> list[np.ndarray]:
    """`micro` split until it counts as many micro batches as the most of its expert-parallel
    group: under EP every MoE layer exchanges tokens among those ranks once per micro batch, so
    each must run equally many, and preference pairs pack into a different number on each
    rank. The longest micro batch is halved first; every rank holds as many items, so the
    split always reaches the most."""
    group = parallel_state.get_expert_model_parallel_group() if parallel_state.get_expert_model_parallel_world_size() > 1 else None
    if group is None:
        return micro
    most = torch.tensor(len(micro), device=device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    micro = list(micro)
    while len(micro) < most.item():
        longest = max(range(len(micro)), key=lambda k: len(micro[k]))
        half = (len(micro[longest]) + 1) // 2
        micro[longest : longest + 1] = [micro[longest][:half], micro[longest][half:]]
    return micro


@torch.no_grad()
def per_token_logps(run: Run, chunks: list, forward: Callable, micro: list[np.ndarray], dataset: Dataset, seq_length: int) -> list[Tensor]:
    """log p(label) per position [micro, s] of each micro batch under `chunks` (the policy, a
    reference model); on the last pipeline stage only (an empty list elsewhere)."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return forward(model, batch), lambda nll: (nll.sum() * 0, torch.tensor(1, device=nll.device), {"logp": -nll.detach().float()})

    with eval_mode(chunks):
        outputs = schedule(chunks, forward_step, [dataset.collate(m) for m in micro], seq_length, run.cfg.micro_batch_size, forward_only=True)
    return [out["logp"] for out in outputs]


def validate(run: Run, objective: Objective, val: Dataset, seq_length: int, rows_per_item: int = 1) -> Optional[float]:
    """Mean loss over the first limit_val_batches x micro_batch_size rows of the val split,
    shared among the DP ranks, so every layout validates on the same rows."""
    micro_size = run.cfg.micro_batch_size
    rows = min(run.cfg.trainer.limit_val_batches * micro_size, len(val))
    rows -= rows % (micro_size * run.dp_size)
    if rows <= 0:
        return None
    micro, started = dp_micro_batches(val, np.arange(rows), micro_size, run.dp_rank, run.dp_size), time.perf_counter()
    with eval_mode(run.chunks), torch.no_grad():
        total, count, metrics = forward_backward(run, objective, micro, val, seq_length, rows_per_item, forward_only=True)
    run.val_seconds += time.perf_counter() - started
    run.val_flops += utilization.model_flops(utilization.ModelShape.of(run.hf_config), val.document_lengths(np.arange(rows)), utilization.FORWARD)
    run.state.last_val_loss = total / max(count, 1.0)
    run.last_val_metrics = {f"val_{k}": v / max(count, 1.0) for k, v in metrics.items()}
    track_early_stopping(run, run.state.last_val_loss)
    return run.state.last_val_loss


def track_early_stopping(run: Run, val_loss: float) -> None:
    patience, state = run.cfg.trainer.early_stopping_patience, run.state
    if state.best_val_loss is None or val_loss < state.best_val_loss - run.cfg.trainer.early_stopping_min_delta:
        state.best_val_loss, state.bad_validations = val_loss, 0
        return
    state.bad_validations += 1
    if patience is not None and state.bad_validations >= patience:
        state.stopped_early = True
        log.info("early stopping at step %d: val_loss has not improved for %d validations", state.step, patience)


def advance(run: Run, stats: StepStats, seconds: float) -> None:
    """The run's state after a step: its count, data position, tokens and loss."""
    state = run.state
    state.step += 1
    state.position = run.batches.next(state.position)
    state.tokens += stats.tokens
    state.last_loss = stats.loss
    run.step_seconds += seconds
    run.flops += stats.flops


def log_step(run: Run, record: dict) -> None:
    """metrics.jsonl, wandb and a progress line in the job log (rank 0)."""
    if run.metrics is not None:
        run.metrics.write(record, run.total_steps)


def checkpoint_due(run: Run) -> bool:
    """Every `checkpoint.every_n_steps` steps, and once `every_n_minutes` of wall time have passed
    since the last save, on rank 0's clock so that every rank saves together (one broadcast of
    a flag per step): a job killed by its time limit loses at most that much work."""
    ckpt = run.cfg.checkpoint
    if every(run.state.step, ckpt.every_n_steps):
        return True
    if ckpt.every_n_minutes is None:
        return False
    due = torch.tensor([int(time.monotonic() - run.checkpointed_at >= 60 * ckpt.every_n_minutes)], device=device())
    if dist.get_world_size() > 1:
        dist.broadcast(due, src=0)
    return bool(due.item())


def save_checkpoint(run: Run) -> None:
    run.checkpointed_at = time.monotonic()
    gather_weights(run.model)
    path = checkpoints.save(run.checkpoints, run.chunks, run.optimizer, run.state, run.trained, leader=run.workspace.leader)
    ckpt = run.cfg.checkpoint
    if run.workspace.leader:
        deleted = checkpoints.prune(run.checkpoints, ckpt.save_top_k, ckpt.monitor, ckpt.mode)
        if run.rank == 0:
            log.debug("checkpoint %s%s", path, f" (removed steps {deleted})" if deleted else "")
    run.workspace.push_checkpoint(path, ckpt.save_top_k, ckpt.monitor, ckpt.mode)
    dist.barrier()


def result(run: Run, first_tokens: int, summary: Optional[dict] = None) -> TrainResult:
    """The run's result after its loop; saves a last checkpoint unless the loop just did, and
    the merged weights of a lora_merged run."""
    final = checkpoints.complete_steps(run.checkpoints)
    if not final or final[-1] != run.state.step:  # e.g. zero steps ran: nothing to resume from yet
        save_checkpoint(run)
    state = run.state
    checkpoint = checkpoints.step_dir(run.checkpoints, state.step)
    footprint = {"trainable_params": lora.trainable_params(run.chunks), "optimizer_state_bytes": optimizer_state_bytes(run.optimizer)}
    footprint |= hardware_use(run.flops, run.step_seconds)
    footprint |= {"flops": run.flops + run.val_flops, "compute_s": round(run.step_seconds + run.val_seconds, 3)}  # what the job cost
    footprint |= {"generation_s": round(run.generation_seconds, 3)} if run.generation_seconds else {}
    weights = final_weights(run, checkpoint)
    run.workspace.gather(weights)  # rank 0 publishes them (`finish`): its copy must hold every node's files
    return TrainResult(
        steps=state.step,
        train_loss=state.last_loss,
        val_loss=state.last_val_loss,
        tokens=state.tokens,
        tokens_per_s=(state.tokens - first_tokens) / max(run.step_seconds, 1e-9),
        stopped_early=state.stopped_early,
        checkpoint=checkpoint,
        summary=(summary or {}) | footprint,
        weights=weights,
    )


MERGED = ".merged-model"  # a lora_merged run's final weights, until `finish` publishes them


def final_weights(run: Run, checkpoint: Path) -> Path:
    """The folder to publish as the output's weights: the last checkpoint's (all weights, or a
    LoRA run's adapters), or for lora_merged the adapters folded into the base, written here."""
    if run.cfg.finetuning_type != "lora_merged":
        return checkpoint / "model"
    merged = run.out / MERGED
    if run.workspace.leader:
        shutil.rmtree(merged, ignore_errors=True)
    dist.barrier()
    gather_weights(run.model)
    lora.merge(run.chunks)
    sharded_state.save(run.chunks, str(merged))
    dist.barrier()
    return merged


def optimizer_state_bytes(optimizer: MegatronOptimizer) -> int:
    """Bytes of the optimizer's state over all ranks: Adam's moments and, under bf16, the fp32
    main weights (what a LoRA run saves most of)."""
    local = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        local += sum(
            t.numel() * t.element_size() for state in inner.optimizer.state.values() for t in state.values() if isinstance(t, Tensor) and t.dim() > 0
        )
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):  # Float16Optimizer's, DistributedOptimizer's
            local += sum(p.numel() * p.element_size() for group in getattr(inner, name, None) or [] for p in group)
    total = torch.tensor(local, dtype=torch.int64, device=device())
    dist.all_reduce(total)
    return int(total.item())


def finish(run: Run, result: TrainResult) -> dict:
    """After `training`: publish the final weights as `{out}/model` (a LoRA run's adapter as
    `{out}/adapter` + lora.json) beside the input model's hf/ (its config.json the trained
    model's, where that differs: a reward model's) and tokenizer/ (uploaded with the outputs on
    an object store); the stage's metrics (the last validation's too: DPO's and the reward
    model's headline val_reward_accuracy)."""
    if run.rank == 0:
        publish(result.weights, run.init, run.out, ADAPTER_DIR if run.cfg.finetuning_type == "lora" else MODEL_DIR)
        if run.hf_config != run.init.hf_config:
            (run.out / HF_DIR / "config.json").write_text(json.dumps(run.hf_config, indent=2) + "\n")
        if run.cfg.finetuning_type == "lora":
            settings = OmegaConf.to_container(run.cfg.lora, resolve=True)
            (run.out / LORA_FILE).write_text(json.dumps({"base": run.source, **settings}, indent=2) + "\n")
        shutil.rmtree(run.out / MERGED, ignore_errors=True)
        run.workspace.push_outputs()
    return (
        result.summary
        | run.last_val_metrics
        | {
            "train_loss": result.train_loss,
            "val_loss": result.val_loss,
            "steps": result.steps,
            "tokens": result.tokens,
            "tokens_per_s": round(result.tokens_per_s, 1),
            "stopped_early": result.stopped_early,
        }
    )


def publish(weights: Path, init: ModelOutput, out: Path, name: str = MODEL_DIR) -> None:
    """The final weights as `{out}/{name}`, with the input model's hf/ and tokenizer/."""
    for dest, source in ((name, weights), (HF_DIR, Path(init.hf)), (TOKENIZER_DIR, Path(init.tokenizer))):
        tmp = out / f".tmp-{dest}"
        shutil.rmtree(tmp, ignore_errors=True)
        if source.exists():
            shutil.copytree(source, tmp)
            shutil.rmtree(out / dest, ignore_errors=True)
            tmp.rename(out / dest)
    log.debug("final %s at %s", name, out / name)


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
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed, overlap_grad_reduce=overlap_grads, overlap_param_gather=overlap_params
    )


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
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            decoupled_weight_decay=DECOUPLED_DECAY[optim.name],
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
            overlap_param_gather=model[0].ddp_config.overlap_param_gather,
            clip_grad=cfg.trainer.gradient_clip_val,
        ),
        model,
    )


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


def all_reduce_dp(value, op=dist.ReduceOp.SUM):
    """An int or float reduced over the data-parallel group (same type back)."""
    t = torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64, device=device())
    dist.all_reduce(t, op=op, group=parallel_state.get_data_parallel_group())
    return type(value)(t.item())


def every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0
