"""The `distillation` kind: a student trained on a teacher's top-k log-probs (`alignflow.job.stages.distillation`)."""

from omegaconf import DictConfig

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.kinds.spec import TRAIN_HEADLINE, TRAINING, StageKind, one, one_sequence, trained_on


def checks(stage, key: str, check_paths: bool) -> list[str]:
    return _check_distillation(key, stage.section)


def _check_distillation(key: str, section: DictConfig) -> list[str]:
    loss, problems = section.loss, []
    if not 0 <= loss.sft_loss_weight <= 1:
        problems.append(f"{key}.loss.sft_loss_weight: must be in [0, 1] (loss = (1 - w) x KL + w x SFT), got {loss.sft_loss_weight}")
    if not 0 <= loss.mixed_kl_weight <= 1:
        problems.append(f"{key}.loss.mixed_kl_weight: must be in [0, 1], got {loss.mixed_kl_weight}")
    if loss.zero_outside_topk and loss.kl_type != "forward":
        problems.append(
            f"{key}.loss.zero_outside_topk: only with kl_type forward (NeMo-RL's entropy correction for reverse and mixed KL is not built)"
        )
    return problems


# The teacher's token ids index the student's vocabulary, and its top-k are joined to prep's rows by row index.
KIND = StageKind(
    schema=schema.DistillationConfig,
    output="model",
    inputs={"data": one("prep"), "model": one("model"), "teacher_logprobs": one("teacher_logprobs")},
    resumable=True,
    headline=("val_kl", *TRAIN_HEADLINE),
    reads=("model",),
    context=TRAINING,
    checks=checks,
    rows=one_sequence,
    same_tokenizer=("model", "teacher_logprobs"),
    same_upstream=(("data", "teacher_logprobs", "data"),),
    work=trained_on("sft"),
)
