"""The teacher_logprobs stage: the teacher's top-k next-token log-probs on prep's SFT rows, once.

NeMo-RL's distillation runs the teacher beside the student at every step; here the teacher
runs forward only, once per (teacher, data, k) fingerprint, and the distillation stage reads
the result, so the teacher never sits beside the student (as ref_logprobs does for DPO).
Supported: any model in the `alignflow.job.model_files` layout at the configured TP/PP/DP
(`teacher_logprobs.parallel`, `.resources`): the rows are shared among the DP ranks, the
top-k taken over the vocab split across TP ranks (`alignflow.job.model.vocab_parallel`), on
the last pipeline stage. Rows are prep's packed SFT rows as the training stages collate them
(documents never attend across each other), so the positions line up with the student's.

Output: the format of `alignflow.job.data.teacher_topk`, one shard per DP rank, for the train and
val splits of prep's SFT data: at each loss position the `topk_logits_k` most likely next
tokens and their full-vocab log-probs (the forward in `teacher_logprobs.precision`).
Metrics: rows and loss positions per split, the mean top-1 log-prob (how sure the teacher is),
and the passes' tokens/s, TFLOP/s, MFU and peak memory (`alignflow.job.forward.passes.hardware_use`).
"""

import logging

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from alignflow.job.data import teacher_topk
from alignflow.job.data.prepared import Prepared
from alignflow.job.device import device
from alignflow.job.forward.objectives import logits_forward
from alignflow.job.forward.passes import forward_only_splits, schedule
from alignflow.job.model.vocab_parallel import topk_logprobs
from alignflow.job.train.datasets import PackedSFT

log = logging.getLogger("alignflow.teacher_logprobs")


def run(cfg, inputs: dict, out: str) -> dict:
    section = cfg.teacher_logprobs

    def each(teacher, chunks: list, rows: PackedSFT, split: str) -> dict:
        columns = row_topk(chunks, rows, section.micro_batch_size, section.topk_logits_k, teacher.hf_config["vocab_size"])
        if columns is not None:
            teacher_topk.write(columns, section.topk_logits_k, out, split, parallel_state.get_data_parallel_rank())
        return summary(split, columns, section.topk_logits_k)

    return forward_only_splits(cfg, section, inputs["teacher"], PackedSFT, Prepared(inputs["data"]), each)


def row_topk(chunks: list, rows: PackedSFT, micro_batch_size: int, k: int, vocab_size: int) -> dict | None:
    """This DP rank's share of the rows through the teacher, `micro_batch_size` rows per micro
    batch; the columns of `alignflow.job.data.teacher_topk` on the rank that writes them."""
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    share = np.array_split(np.arange(len(rows)), dp_size)[dp_rank]
    micro = rows.micro_batches(share, micro_batch_size)
    batches = [rows.collate(m) for m in micro]

    def forward_step(data_iterator, model):
        return logits_forward(model, next(data_iterator)), _topk

    def _topk(logits):
        logp, ids = topk_logprobs(logits, k, vocab_size)
        return logits.new_zeros(()), torch.tensor(1, device=logits.device), {"logp": logp.cpu(), "ids": ids.cpu()}  # host data to write

    with torch.no_grad():
        outputs = schedule(chunks, forward_step, batches, rows.seq_length, micro_batch_size, forward_only=True)
    if not (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0):
        return None
    columns: dict[str, list] = {name: [] for name in teacher_topk.SCHEMA.names}
    for m, batch, top in zip(micro, batches, outputs):
        for r, i in enumerate(m):
            positions = np.flatnonzero(batch["loss_mask"][r].numpy())
            columns["row"].append(int(i))
            columns["tokens"].append(rows.num_tokens([i]))
            columns["positions"].append(positions.tolist())
            columns["ids"].append(top["ids"][r, positions].flatten().tolist())
            columns["logprobs"].append(top["logp"][r, positions].flatten().tolist())
    return columns


def summary(split: str, columns: dict | None, k: int) -> dict:
    """Rows, loss positions and the mean top-1 log-prob of a split over every DP rank's share
    (only the writing rank of each share has columns; the sums are all-reduced)."""
    sums = torch.zeros(3, dtype=torch.float64, device=device())
    if columns is not None:
        top1 = [row[j] for row in columns["logprobs"] for j in range(0, len(row), k)]
        sums += torch.tensor([len(columns["row"]), len(top1), sum(top1)], dtype=torch.float64, device=device())
    dist.all_reduce(sums)
    return {f"{split}.rows": int(sums[0]), f"{split}.positions": int(sums[1]), f"{split}.mean_top1_logp": float(sums[2] / max(sums[1], 1))}
