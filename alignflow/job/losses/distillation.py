"""Knowledge distillation's loss on the teacher's top-k, NeMo-RL's formulas.

Per loss position, with the teacher's top-k token ids S, its log-probs t_i (i in S) and the
student's log-probs s_i at the same ids, as NeMo-RL's `DistillationLossFn` and
`get_distillation_topk_logprobs_from_logits` compute them (nemo_rl/algorithms/loss/
loss_functions.py, nemo_rl/distributed/model_utils.py):
- the teacher's distribution is renormalised over its top-k: p = softmax(t) over S (NeMo-RL
  keeps the top-k logits, whose log_softmax over S is the same thing);
- the student's too, q = softmax(s) over S, unless `zero_outside_topk` (forward only): then q
  is the student's full-vocab probability (the mass outside S counts against it);
- forward KL(p || q) = sum_S p (log p - log q); reverse KL(q || p) = sum_S q (log q - log p);
  mixed = mixed_kl_weight x forward + (1 - mixed_kl_weight) x reverse.
NeMo-RL's `zero_outside_topk` with reverse or mixed KL adds an entropy term for the student's
mass outside S; that case is refused at compose (`alignflow.orchestrator.config.validate`), not computed.
The stage mixes in the SFT loss (the label's negative log-likelihood):
loss = (1 - sft_loss_weight) x KL + sft_loss_weight x NLL, averaged over loss tokens; NeMo-RL's
on-policy distillation has no SFT term (sft_loss_weight 0, the default, is its loss).
"""

from typing import Callable

from torch import Tensor

from alignflow.orchestrator.config.schema import DistillationLossConfig, KLType


def forward_kl(teacher: Tensor, student: Tensor) -> Tensor:
    return (teacher.exp() * (teacher - student)).sum(-1)


def reverse_kl(teacher: Tensor, student: Tensor) -> Tensor:
    return (student.exp() * (student - teacher)).sum(-1)


KL: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    KLType.forward: lambda t, s, w: forward_kl(t, s),
    KLType.reverse: lambda t, s, w: reverse_kl(t, s),
    KLType.mixed: lambda t, s, w: w * forward_kl(t, s) + (1 - w) * reverse_kl(t, s),
}


def topk_kl(student_logp: Tensor, teacher_logp: Tensor, cfg: DistillationLossConfig) -> Tensor:
    """Per-position KL [...] from the student's and the teacher's full-vocab log-probs at the
    teacher's top-k ids [..., k] (see the top for which distributions it compares)."""
    teacher = teacher_logp.log_softmax(-1)
    student = student_logp if cfg.zero_outside_topk else student_logp.log_softmax(-1)
    return KL[cfg.kl_type](teacher, student, cfg.mixed_kl_weight)


def mixed_loss(kl: Tensor, nll: Tensor, sft_loss_weight: float) -> Tensor:
    """Per-position loss: the KL and the SFT term mixed by `sft_loss_weight`."""
    return (1 - sft_loss_weight) * kl + sft_loss_weight * nll
