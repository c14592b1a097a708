"""The `ref_logprobs` kind: the reference model's log-probs of each preference pair (`alignflow.job.stages.ref_logprobs`)."""

from alignflow.orchestrator.config import schema
from alignflow.job.train.utilization import FORWARD
from alignflow.orchestrator.kinds.spec import CACHE, Count, StageKind, Work, one
from alignflow.orchestrator.verify import Need, OutputFormat, parquet


def work(stage, count: Count) -> list[Work]:
    """One forward pass over every pair of both splits."""
    return [Work("preference", split, None, FORWARD) for split in ("train", "val")]


KIND = StageKind(
    schema=schema.RefLogprobsConfig,
    output="ref_logprobs",
    inputs={"data": one("prep"), "model": one("model")},
    resumable=False,
    output_format=OutputFormat(
        "Parquet per-pair reference log-probs (alignflow.job.stages.ref_logprobs)",
        (Need("train-*.parquet", parquet), Need("val-*.parquet", parquet, required=False)),
    ),
    headline=("train.pairs", "val.pairs", "train.mean_chosen_logp"),
    reads=("model",),
    context=CACHE,
    work=work,
)
