"""The `teacher_logprobs` kind: a teacher's top-k log-probs at each loss position (`alignflow.job.stages.teacher_logprobs`)."""

from omegaconf import DictConfig

from alignflow.orchestrator.config import schema
from alignflow.job.train.utilization import FORWARD
from alignflow.orchestrator.kinds.spec import CACHE, Count, StageKind, Work, one
from alignflow.orchestrator.verify import Need, OutputFormat, parquet


def checks(stage, key: str, check_paths: bool) -> list[str]:
    return _check_teacher_logprobs(key, stage.section)


def _check_teacher_logprobs(key: str, section: DictConfig) -> list[str]:
    return [] if section.topk_logits_k >= 1 else [f"{key}.topk_logits_k: must be >= 1, got {section.topk_logits_k}"]


def work(stage, count: Count) -> list[Work]:
    """One forward pass of the teacher over every SFT row of both splits."""
    return [Work("sft", split, None, FORWARD) for split in ("train", "val")]


# Its output has the teacher's tokenizer, whose token ids must index the data's vocabulary.
KIND = StageKind(
    schema=schema.TeacherLogprobsConfig,
    output="teacher_logprobs",
    inputs={"data": one("prep"), "teacher": one("model")},
    resumable=False,
    output_format=OutputFormat(
        "Parquet per-row teacher top-k token ids and log-probs at the loss positions (alignflow.job.data.teacher_topk)",
        (Need("train-*.parquet", parquet), Need("val-*.parquet", parquet, required=False)),
    ),
    headline=("train.rows", "train.positions", "val.rows", "train.mean_top1_logp"),
    reads=("model",),
    context=CACHE,
    checks=checks,
    tokenizer_role="teacher",
    same_tokenizer=("data", "teacher"),
    work=work,
)
