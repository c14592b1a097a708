"""The `eval` kind: metrics of a model and its baselines on prep's validation data (`alignflow.stages.eval`)."""

from alignflow.config import schema
from alignflow.kinds.spec import CACHE, StageKind, Table, many, one
from alignflow.verify import Need, OutputFormat, json_file


def table(metrics: dict) -> Table:
    """Every metric of every model, one row per model (metrics are named `{model}.{metric}`)."""
    models: dict[str, dict] = {}
    for key, value in metrics.items():
        model, _, metric = key.rpartition(".")
        models.setdefault(model, {"model": model})[metric] = value
    return Table("models", "every metric of every model", list(models.values()))


KIND = StageKind(schema=schema.EvalConfig, output="eval", inputs={"data": one("prep"), "model": one("model"), "baselines": many("model")},
                 resumable=False, output_format=OutputFormat("eval.json: metrics per model and samples (alignflow.stages.eval)", (Need("eval.json", json_file),)),
                 headline=("*.accuracy", "*.preference_accuracy", "*.val_loss"), reads=("model",), context=CACHE, table=table)
