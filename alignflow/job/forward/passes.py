"""Megatron's pipeline schedule over collated micro batches, an objective's sums over them, and
the frame of a forward-only stage.

An `Objective(forward, loss)`: `forward(model, batch)` runs one model chunk on a micro batch
(on pipeline stages other than the last it returns the hidden states), and `loss(output,
batch)` (last stage only) returns `LossTerms(total, count, metrics)`: the summed loss, how many
units (tokens, pairs, ...) it sums over, and per-unit sums of the metrics
`Objective.metric_names` lists. `loss_sums` gives the (loss sum, count, metric sums) over every
micro batch of every DP rank; the training engine (`alignflow.job.train.engine`) divides by the
global count and steps.
"""

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from alignflow.orchestrator.config.schema import resolved_precision
from alignflow.job.data.prepared import Prepared
from alignflow.job.device import device, to_device
from alignflow.job.forward.models import cache_dir, frozen_chunks, local_model
from alignflow.job.model import runtime
from alignflow.job.model.decoder import LeanForward
from alignflow.job.model.gpt import packed_thd
from alignflow.job.train import utilization
from alignflow.job.train.datasets import optional


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


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_precision(precision: str) -> torch.dtype:
    """The weights' dtype. A pipeline's stage arrives resolved (`alignflow.orchestrator.pipeline`); `auto` in
    a config given straight to a stage is resolved by this machine's CUDA, the same way."""
    return PRECISIONS[resolved_precision(precision, on_gpu=torch.cuda.is_available())]


def loss_sums(
    chunks: list, objective: Objective, batches: list[dict], seq_length: int, rows: int, forward_only: bool
) -> tuple[float, float, dict[str, float]]:
    """`objective` over collated micro batches through Megatron's schedule; the (loss sum,
    count, metric sums) over every micro batch of every DP rank, on every rank."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return objective.forward(model, batch), functools.partial(_reported_loss, objective, batch)

    outputs = schedule(chunks, forward_step, batches, seq_length, rows, forward_only)
    names = objective.metric_names
    sums = torch.zeros(2 + len(names), dtype=torch.float64, device=device())
    for out in outputs:
        sums += out["terms"].double()
    dist.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())  # only the last stage has it
    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    return sums[0].item(), sums[1].item(), {name: sums[2 + i].item() for i, name in enumerate(names)}


def _reported_loss(objective: Objective, batch: dict, output: Tensor):
    terms = objective.loss(output, batch)
    extra = [terms.metrics[name].detach().float() for name in objective.metric_names]
    reported = torch.stack([terms.total.detach().float(), terms.count.detach().float(), *extra])
    return terms.total, terms.count.to(torch.int), {"terms": reported}


def schedule(chunks: list, forward_step, batches: list[dict], seq_length: int, rows: int, forward_only: bool) -> list:
    """Megatron's pipeline schedule over collated micro batches of `rows` x `seq_length` (with
    PP > 1 the stages exchange each micro batch's shape, so packed ones may differ); the loss
    functions' outputs (last stage only). THD attention runs a micro batch as one flat
    sequence, so its stages pass [b * s, 1, h]. On one rank the forward steps get a
    `LeanForward` in the model's place where it computes what the model would. Under EP a
    forward-only pass runs as many micro batches as the most of its EP group (`_stand_ins`)."""
    length = seq_length
    if packed_thd():
        rows, length = 1, rows * length
    if (lean := LeanForward.of(chunks, seq_length)) is not None:  # the same numbers, fewer ops
        forward_step = functools.partial(_with_model, forward_step, lean)
    real = len(batches)
    batches = batches + _stand_ins(batches, forward_only)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[map(to_device, batches) for _ in chunks],  # one micro batch at a time
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=length,
        micro_batch_size=rows,
        forward_only=forward_only,
    )[:real]


def _stand_ins(batches: list[dict], forward_only: bool) -> list[dict]:
    """Under EP every MoE layer exchanges tokens within the EP group, whose ranks are DP ranks
    with micro batches of their own: each must run as many as the group's most, or the
    exchanges pair up wrongly and hang. A forward-only pass repeats its last micro batch (its
    outputs dropped); a training pass (whose stand-ins would add MoE auxiliary-loss gradients)
    with uneven counts is refused on every rank of the group."""
    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return []
    counts = torch.empty(parallel_state.get_expert_model_parallel_world_size(), dtype=torch.long, device=device())
    dist.all_gather_into_tensor(counts, torch.tensor([len(batches)], device=device()), group=parallel_state.get_expert_model_parallel_group())
    fewest, most = min(counts.tolist()), max(counts.tolist())
    if fewest == most:
        return []
    if not forward_only or not batches:
        raise ValueError(
            f"parallel.expert_model_parallel_size: the ranks of an expert-parallel group have {fewest} to {most} micro "
            f"batches of their own{'' if forward_only else ' in a training step'}; they must forward equally many "
            "(give each data-parallel rank the same number of micro batches, or set expert_model_parallel_size: 1)"
        )
    return [batches[-1]] * (most - len(batches))


def _with_model(forward_step, model, data_iterator, _):
    return forward_step(data_iterator, model)


def forward_only_splits(cfg, section, model_uri: str, dataset: type, data: Prepared, each: Callable) -> dict:
    """The frame of a forward-only stage (ref_logprobs, teacher_logprobs): the model at
    `model_uri` frozen at `section.parallel` in `section.precision`, then `each(model, chunks,
    rows, split)` for each split of `data` that has `dataset` rows, its metrics merged, and the
    hardware use of these passes (their writes included) with their FLOPs, tokens and seconds;
    the ranks meet before teardown."""
    model = local_model(model_uri, cache_dir(cfg))
    runtime.init_parallel(section.parallel, seed=0)
    try:
        chunks = frozen_chunks(model, section.parallel, cfg.model.make_vocab_size_divisible_by, cache_dir(cfg), resolve_precision(section.precision))
        metrics, tokens, flops, seconds, shape = {}, 0, 0.0, 0.0, utilization.ModelShape.of(model.hf_config)
        for split in ("train", "val"):
            if (rows := optional(dataset, data, split)) is not None:
                started = time.perf_counter()
                metrics |= each(model, chunks, rows, split)
                seconds += time.perf_counter() - started
                everything = range(len(rows))
                tokens += rows.num_tokens(everything)
                flops += utilization.model_flops(shape, rows.document_lengths(everything), utilization.FORWARD)
        metrics |= {"tokens_per_s": round(tokens / max(seconds, 1e-9), 1)} | hardware_use(flops, seconds)
        metrics |= {"flops": flops, "tokens": tokens, "compute_s": round(seconds, 3)}  # what the job cost
        dist.barrier()
    finally:
        runtime.teardown()
    return metrics


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


def hardware_use(flops: float, seconds: float) -> dict:
    """TFLOP/s and MFU of `flops` model FLOPs (all ranks) in `seconds` (the slowest rank's), and
    the peak memory of the busiest rank: torch's allocated CUDA memory on GPU (the caching
    allocator's reserve and the CUDA context come on top), the process's peak RSS on CPU."""
    on_gpu = device().type == "cuda"
    peak = torch.cuda.max_memory_allocated() if on_gpu else utilization.peak_rss_bytes()
    measured = torch.tensor([seconds, peak], dtype=torch.float64, device=device())
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    seconds, peak = measured.tolist()
    return utilization.figures(flops, seconds, dist.get_world_size(), torch.cuda.get_device_name() if on_gpu else None) | {
        "peak_memory_gib": round(peak / 2**30, 3),
        "peak_memory_of": "cuda max_memory_allocated" if on_gpu else "peak RSS",
    }
