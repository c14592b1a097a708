"""The SFT stage: supervised fine-tuning of a converted model on prep's packed SFT data.

Inputs: `data` = a prep output (`sft/train-*.parquet`, optional `sft/val-*.parquet`,
`metadata.json`), `model` = a model stage output (`alignflow.checkpoint` layout).
Output under `out`: `model/` (the final weights, torch_dist), `hf/` and `tokenizer/` copied
from the input model, `metrics.jsonl`, and `checkpoints/` (see
`alignflow.train.checkpointing`), from whose latest complete step a retried job resumes; the
commit leaves them out, or keeps the final one with `checkpoint.keep_optimizer`.
Returns the final train loss, final val loss, steps, tokens, tokens/s, TFLOP/s, MFU and
peak memory (`alignflow.train.engine.hardware_use`).

Supported: everything `alignflow.train.engine` supports (TP, PP, virtual PP, DP, the
distributed optimizer, bf16, activation recompute, gradient accumulation, schedules, clipping,
validation, early stopping, top-k checkpoints, exact resume, resume at another layout,
wandb, LoRA with `finetuning_type` lora / lora_merged: `alignflow.megatron.lora`).
Each packed row is one sequence whose documents do not see each other: with
Transformer Engine a micro batch runs as THD packed sequences (`PackedSeqParams` from the
rows' cu_seqlens, RoPE restarting per document); on Megatron's local spec each document
attends on its own through a fused kernel, with no mask (`DocumentWindowAttention`:
`alignflow.megatron.attention`), in training and forward-only passes alike; either narrowed
by a sliding window where the model has one. Labels are the
next token, trained only where loss_mask marks it and within the same document; the loss is
averaged over the loss tokens of the whole global batch.

Simplified:
- On the local spec, position ids restart at each document and are passed to the model, but
  Megatron's GPTModel computes RoPE for positions 0..s-1 of the row whatever position_ids
  say. RoPE scores depend only on the distance i - j, and attention never crosses a
  document, so this equals restarted positions up to float rounding (the test checks a
  packed row against its documents run one by one to 1e-5).
- The THD path (Transformer Engine) is written but has not run here (no GPU), nor has
  `packed_attention`'s CUDA kernel (`varlen`).
- Megatron's checkpoint I/O and the atomic checkpoint renames need a filesystem: with an
  object-store store the input model is downloaded and the job trains in a local scratch
  synced with `out` (`alignflow.train.workspace`); the data is read from any fsspec URI.
"""

import torch

from alignflow.data.prepared import Prepared
from alignflow.megatron.model import document_params, packed_thd, token_nll
from alignflow.train.datasets import PackedSFT, optional
from alignflow.train.engine import LossTerms, Objective, finish, training
from alignflow.train.loop import Supervised, supervised


def sft_forward(model, batch: dict) -> torch.Tensor:
    """Per-token cross entropy [b, s] on the last stage (hidden states elsewhere). With THD
    attention the micro batch is one flat sequence of documents [1, b * s] (see the top)."""
    tokens, labels, documents = batch["tokens"], batch["labels"], document_params(batch)
    if not packed_thd():
        return token_nll(model, tokens, batch["position_ids"], None, labels, packed_seq_params=documents)
    out = token_nll(model, tokens.view(1, -1), batch["position_ids"].view(1, -1), None, labels.view(1, -1), packed_seq_params=documents)
    return out.view(tokens.shape) if out.dim() == 2 else out


def sft_loss(per_token: torch.Tensor, batch: dict) -> LossTerms:
    mask = batch["loss_mask"]
    return LossTerms(total=(per_token.float() * mask).sum(), count=mask.sum().to(torch.int64))


SFT = Objective(forward=sft_forward, loss=sft_loss)


def load_data(data: Prepared) -> Supervised:
    return Supervised(train=PackedSFT(data, "train"), val=optional(PackedSFT, data, "val"), seq_length=data.seq_length)


def run(cfg, inputs: dict, out: str) -> dict:
    data = load_data(Prepared(inputs["data"]))
    with training("sft", cfg, inputs, out, len(data.train), cfg.sft.global_batch_size) as run:
        result = supervised(run, data, SFT)
    return finish(run, result)
