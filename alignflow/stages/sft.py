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
  synced with `out` (`alignflow.train.workspace`); the data is read from any fsspec URI.
"""

import torch
from megatron.core import parallel_state

from alignflow.convert.families import model_shape
from alignflow.data.prepared import Prepared
from alignflow.losses.load_balancing import load_balancing_loss
from alignflow.megatron.decoder import router_logits
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


def with_load_balancing(objective: Objective, hf_config: dict) -> Objective:
    """`objective` plus HF's load-balancing loss where the model's config.json sets
    output_router_logits: router_aux_loss_coef x `load_balancing_loss` of each micro batch (one
    forward call, as HF's: its documents' tokens, padding left out), reported as `aux_loss`.

    A micro batch adds it times its count (loss tokens for SFT, pairs for DPO), so a step's
    loss is the objective's plus coef x the count-weighted mean of its micro batches' aux
    losses: with one micro batch, HF's model loss (and TRL 1.16's DPO loss) exactly. With
    several, TRL averages coef x aux over the micro batches plainly (gradient accumulation:
    each micro batch's aux / steps); alignflow weights each by its count, as the mean it is
    added to, which is the same where the micro batches hold equal counts. (An aux loss depends
    on which tokens share a forward call, so no other grouping of a step matches it exactly.)
    Needs every layer's router logits of the forward with their gradients: one pipeline stage,
    no full recompute (refused at compose, and here)."""
    shape = model_shape(hf_config)
    if not shape.moe_aux_loss_coef:
        return objective
    coef = shape.moe_aux_loss_coef

    def forward(model, batch: dict):
        out = objective.forward(model, batch)
        logits = router_logits(model)
        recomputed = torch.is_grad_enabled() and not all(layer.requires_grad for layer in logits)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1 or recomputed:
            raise NotImplementedError("HF's load-balancing loss (output_router_logits) needs every layer's router logits of the "
                                      "forward with their gradients: pipeline_model_parallel_size 1, no full activation recompute")
        return out, load_balancing_loss(logits, batch["token_mask"], shape.num_experts, shape.moe_top_k)

    def loss(output, batch: dict) -> LossTerms:
        out, aux = output
        terms = objective.loss(out, batch)
        weight = terms.count.to(aux.dtype)
        return LossTerms(terms.total + coef * aux * weight, terms.count, terms.metrics | {"aux_loss": aux.detach() * weight})

    return Objective(forward, loss, (*objective.metric_names, "aux_loss"))


def load_data(data: Prepared) -> Supervised:
    return Supervised(train=PackedSFT(data, "train"), val=optional(PackedSFT, data, "val"), seq_length=data.seq_length)


def run(cfg, inputs: dict, out: str) -> dict:
    data = load_data(Prepared(inputs["data"]))
    with training("sft", cfg, inputs, out, len(data.train), cfg.sft.global_batch_size) as run:
        result = supervised(run, data, with_load_balancing(SFT, run.init.hf_config))
    return finish(run, result)
