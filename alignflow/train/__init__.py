"""The training engine shared by the training stages: data order, schedules, the step, checkpoints.

See `alignflow.train.engine` for how a stage plugs in its batches and its loss.
"""

from alignflow.train.data import DataPosition, GlobalBatches, PackedRows, packed_rows, read_split
from alignflow.train.engine import LossTerms, Objective, Trainer, TrainData, TrainResult
from alignflow.train.schedule import lr_at

__all__ = [
    "DataPosition", "GlobalBatches", "LossTerms", "Objective", "PackedRows", "TrainData", "TrainResult", "Trainer",
    "lr_at", "packed_rows", "read_split",
]
