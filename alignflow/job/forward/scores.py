"""A reward model's score of rows of token ids (GRPO's `score` reward, eval's reward-model score
and win rate): its own module, so the stages that do not score (SFT, DPO, the reference) keep
their code identity."""

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from alignflow.job.device import device
from alignflow.job.forward.objectives import logits_forward
from alignflow.job.forward.passes import eval_mode, schedule
from alignflow.job.train.data import packed_rows


def model_scores(chunks: list, rows: list[list[int]], pad_id: int, micro_batch_size: int) -> torch.Tensor:
    """A reward model's score of each row of token ids [rows] (float64, host), on every rank of
    the model-parallel group: its scalar head at the row's last token that is not `pad_id` (HF's
    ...ForSequenceClassification rule), computed on the last pipeline stage and broadcast.
    Identical rows are scored once: a GRPO group's identical completions must tie to the last
    bit (scored in different micro batches they differ by ~1e-7, a spread the group's
    normalized advantages would divide by), and they are common."""
    distinct: dict[tuple, int] = {}
    index = [distinct.setdefault(tuple(row), len(distinct)) for row in rows]
    return _scores(chunks, [list(row) for row in distinct], pad_id, micro_batch_size)[index]


def _scores(chunks: list, rows: list[list[int]], pad_id: int, micro_batch_size: int) -> torch.Tensor:
    last = [max((i for i, t in enumerate(row) if t != pad_id), default=0) for row in rows]
    length = max(len(row) for row in rows)
    micro = [range(i, min(i + micro_batch_size, len(rows))) for i in range(0, len(rows), micro_batch_size)]
    batches = [
        vars(packed_rows([(np.asarray(rows[i]), np.zeros(len(rows[i])), np.asarray([0, len(rows[i])])) for i in m], length, pad_id))
        | {"last": torch.tensor([last[i] for i in m], device="cpu")}  # host, as packed_rows' rows
        for m in micro
    ]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return logits_forward(model, batch), lambda out: (
            out.sum() * 0,
            torch.tensor(1, device=out.device),
            {"scores": out[torch.arange(len(batch["last"]), device=out.device), batch["last"].to(out.device), 0].double()},
        )

    with eval_mode(chunks), torch.no_grad():
        outputs = schedule(chunks, forward_step, batches, length, micro_batch_size, forward_only=True)
    scores = torch.cat([out["scores"] for out in outputs]) if outputs else torch.zeros(len(rows), dtype=torch.float64, device=device())
    dist.broadcast(scores, parallel_state.get_pipeline_model_parallel_last_rank(), group=parallel_state.get_pipeline_model_parallel_group())
    return scores.cpu()
