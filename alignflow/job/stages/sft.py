"""The SFT stage: supervised fine-tuning of a converted model on prep's packed SFT data.

Inputs: `data` = a prep output (`sft/train-*.parquet`, optional `sft/val-*.parquet`,
`metadata.json`), `model` = a model stage output (`alignflow.job.model_files` layout).
Output under `out`: `model/` (the final weights, torch_dist), `hf/` and `tokenizer/` copied
from the input model, `metrics.jsonl`, and `checkpoints/` (see
`alignflow.job.train.checkpoints`), from whose latest complete step a retried job resumes; the
commit leaves them out, or keeps the final one with `checkpoint.keep_optimizer`.
Returns the final train loss, final val loss, steps, tokens, tokens/s, TFLOP/s, MFU and
peak memory (`alignflow.job.forward.passes.hardware_use`).

Supported: everything `alignflow.job.train.engine` supports (TP, PP, virtual PP, DP, the
distributed optimizer, bf16, activation recompute, gradient accumulation, schedules, clipping,
validation, early stopping, top-k checkpoints, exact resume, resume at another layout,
wandb, LoRA with `finetuning_type` lora / lora_merged: `alignflow.job.model.lora`).
Each packed row is one sequence whose documents do not see each other: with
Transformer Engine a micro batch runs as THD packed sequences (`PackedSeqParams` from the
rows' cu_seqlens, RoPE restarting per document); on Megatron's local spec each document
attends on its own through a fused kernel, with no mask (`DocumentWindowAttention`:
`alignflow.job.model.attention`), in training and forward-only passes alike; either narrowed
by a sliding window where the model has one. Labels are the
next token, trained only where loss_mask marks it and within the same document; the loss is
averaged over the loss tokens of the whole global batch. A mixture-of-experts model whose
config sets output_router_logits adds HF's load-balancing loss (`with_load_balancing`).

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
  synced with `out` (`alignflow.job.train.workspace`); the data is read from any fsspec URI.
"""

from alignflow.job.data.prepared import Prepared
from alignflow.job.forward.objectives import SFT
from alignflow.job.train.datasets import PackedSFT, optional
from alignflow.job.train.engine import finish, training
from alignflow.job.train.loop import Supervised, supervised
from alignflow.job.train.objectives import with_load_balancing


def load_data(data: Prepared) -> Supervised:
    return Supervised(train=PackedSFT(data, "train"), val=optional(PackedSFT, data, "val"), seq_length=data.seq_length)


def run(cfg, inputs: dict, out: str) -> dict:
    data = load_data(Prepared(inputs["data"]))
    with training("sft", cfg, inputs, out, len(data.train), cfg.sft.global_batch_size) as run:
        result = supervised(run, data, with_load_balancing(SFT, run.init.hf_config))
    return finish(run, result)
