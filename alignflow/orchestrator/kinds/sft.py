"""The `sft` kind: supervised fine-tuning on packed sequences (`alignflow.job.stages.sft`)."""

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.kinds.spec import TRAIN_HEADLINE, TRAINING, StageKind, one, one_sequence, trained_on

KIND = StageKind(
    schema=schema.SFTConfig,
    output="model",
    inputs={"data": one("prep"), "model": one("model")},
    resumable=True,
    headline=TRAIN_HEADLINE,
    reads=("model",),
    context=TRAINING,
    rows=one_sequence,
    load_balancing=True,
    work=trained_on("sft"),
)
