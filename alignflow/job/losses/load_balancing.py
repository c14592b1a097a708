"""HF's load-balancing auxiliary loss of a mixture-of-experts model (Mixtral, Qwen3-MoE), the
term their `forward` adds to the language-model loss, times `router_aux_loss_coef`, when the
config sets `output_router_logits` (transformers 5.23 `load_balancing_loss_func`: Switch
Transformer's eqs. 4-6).

Over one forward call (a micro batch) and all MoE layers at once, not per layer as
Megatron-Core's aux loss: with f_e the share of (token, layer) pairs whose top k holds expert
e and P_e the mean softmax probability of e over the same pairs, the loss is
num_experts x sum_e f_e P_e. Padding (HF: attention_mask 0) is left out of both. Only P carries
a gradient: the top-k counts are constants.
"""

import torch
from torch import Tensor


def load_balancing_loss(router_logits: list[Tensor], token_mask: Tensor, num_experts: int, top_k: int) -> Tensor:
    """The loss (a scalar, fp32) from each MoE layer's router logits [tokens, experts] of a
    micro batch whose tokens `token_mask` ([rows, length], flattened in the same order) marks."""
    keep = token_mask.reshape(-1, 1).float()
    routed, probs = keep.new_zeros(num_experts), keep.new_zeros(num_experts)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        top = torch.zeros_like(p).scatter_(1, p.detach().topk(top_k, dim=-1).indices, 1.0)
        routed = routed + (top * keep).sum(0)
        probs = probs + (p * keep).sum(0)
    pairs = (len(router_logits) * keep.sum()).clamp(min=1)
    return num_experts * ((routed / pairs) * (probs / pairs)).sum()
