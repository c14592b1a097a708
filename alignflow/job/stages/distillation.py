"""The distillation stage: a student trained toward a teacher on prep's SFT data (NeMo
Customizer's training_type distillation).

Inputs: `data` = a prep output (packed SFT rows), `model` = the student (a model output),
`teacher_logprobs` = the teacher's top-k log-probs on the same prep's rows, computed once by
the teacher_logprobs stage (the teacher never runs here, so teacher and student need not fit
together; they may differ in size but must share the tokenizer, checked at compose).
Loss per loss token (`alignflow.job.losses.distillation`, NeMo-RL's names under
`distillation.loss`): (1 - sft_loss_weight) x KL over the teacher's top-k (forward by default,
both distributions renormalised over the top-k, as NeMo-RL) + sft_loss_weight x the label's
negative log-likelihood, averaged over the loss tokens of the global batch. The student's
log-probs come from its vocab-parallel logits (`alignflow.job.model.vocab_parallel`), at the
label and at the teacher's top-k ids, with one softmax normaliser for both.
Metrics per step (and per validation, `val_` prefixed: `val_kl` is the held-out KL to the
teacher): loss, kl, sft_loss.

Supported: everything the SFT stage supports (the same engine and loop: TP, PP, DP, bf16,
checkpoints and exact resume); packed rows, the teacher's top-k aligned to them per token.
Simplified: the logits are materialised per micro batch ([b, s, V / TP] fp32 on the last
stage), not chunked over the sequence as NeMo-RL's `logprob_chunk_size` does; no
`zero_outside_topk` with reverse or mixed KL (refused at compose).

Output: the final student in the `alignflow.job.model_files` layout, and metrics.jsonl.
"""

import torch

from alignflow.orchestrator.config.schema import DistillationLossConfig
from alignflow.job.data.prepared import Prepared
from alignflow.job.losses.distillation import mixed_loss, topk_kl
from alignflow.job.model.vocab_parallel import logprobs_at
from alignflow.job.forward.objectives import logits_forward
from alignflow.job.forward.passes import LossTerms, Objective
from alignflow.job.train.datasets import DistillRows, optional
from alignflow.job.train.engine import finish, training
from alignflow.job.train.loop import Supervised, supervised

METRICS = ("kl", "sft_loss")


def distillation_objective(cfg: DistillationLossConfig, vocab_size: int) -> Objective:
    def loss(logits: torch.Tensor, batch: dict) -> LossTerms:
        kl, nll = token_terms(cfg, logits, batch, vocab_size)
        mask = batch["loss_mask"].to(kl.device)
        total = (mixed_loss(kl, nll, cfg.sft_loss_weight) * mask).sum()
        sums = {"kl": (kl.detach() * mask).sum(), "sft_loss": (nll.detach() * mask).sum()}
        return LossTerms(total=total, count=mask.sum().to(torch.int64), metrics=sums)

    return Objective(forward=logits_forward, loss=loss, metric_names=METRICS)


def token_terms(cfg: DistillationLossConfig, logits: torch.Tensor, batch: dict, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL to the teacher and label NLL [b, s], from one vocab-parallel softmax."""
    ids = torch.cat([batch["labels"][..., None], batch["teacher_ids"]], dim=-1)
    logp = logprobs_at(logits, ids, vocab_size)
    kl = topk_kl(logp[..., 1:], batch["teacher_logp"].to(logp), cfg)
    return kl, -logp[..., 0]


def load_data(data: Prepared, teacher_uri: str) -> Supervised:
    return Supervised(train=DistillRows(data, "train", teacher_uri), val=optional(DistillRows, data, "val", teacher_uri), seq_length=data.seq_length)


def run(cfg, inputs: dict, out: str) -> dict:
    data = load_data(Prepared(inputs["data"]), inputs["teacher_logprobs"])
    with training("distillation", cfg, inputs, out, len(data.train), cfg.distillation.global_batch_size) as run:
        result = supervised(run, data, distillation_objective(cfg.distillation.loss, run.init.hf_config["vocab_size"]))
    return finish(run, result)
