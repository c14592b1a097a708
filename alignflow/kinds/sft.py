"""The `sft` kind: supervised fine-tuning on packed sequences (`alignflow.stages.sft`)."""

from alignflow.config import schema
from alignflow.kinds.spec import TRAIN_HEADLINE, TRAINING, StageKind, one, one_sequence

KIND = StageKind(schema=schema.SFTConfig, output="model", inputs={"data": one("prep"), "model": one("model")}, resumable=True,
                 headline=TRAIN_HEADLINE, reads=("model",), context=TRAINING, rows=one_sequence, load_balancing=True)
