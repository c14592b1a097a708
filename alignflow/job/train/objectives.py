"""What training objectives share: HF's MoE load-balancing loss added to any objective
(`with_load_balancing`, SFT's and DPO's)."""

import torch
from megatron.core import parallel_state

from alignflow.job.convert.families import model_shape
from alignflow.job.forward.passes import LossTerms, Objective
from alignflow.job.losses.load_balancing import load_balancing_loss
from alignflow.job.model.decoder import router_logits


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
            raise NotImplementedError(
                "HF's load-balancing loss (output_router_logits) needs every layer's router logits of the "
                "forward with their gradients: pipeline_model_parallel_size 1, no full activation recompute"
            )
        return out, load_balancing_loss(logits, batch["token_mask"], shape.num_experts, shape.moe_top_k)

    def loss(output, batch: dict) -> LossTerms:
        out, aux = output
        terms = objective.loss(out, batch)
        weight = terms.count.to(aux.dtype)
        return LossTerms(terms.total + coef * aux * weight, terms.count, terms.metrics | {"aux_loss": aux.detach() * weight})

    return Objective(forward, loss, (*objective.metric_names, "aux_loss"))
