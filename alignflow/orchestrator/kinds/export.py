"""The `export` kind: a model as HF safetensors (and a PEFT adapter), to a destination (`alignflow.job.stages.export`)."""

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.kinds.spec import StageKind, one
from alignflow.orchestrator.verify import Need, OutputFormat, json_file, safetensors

KIND = StageKind(
    schema=schema.ExportConfig,
    output="hf",
    inputs={"model": one("model", "reward_model")},
    resumable=False,
    output_format=OutputFormat(
        "HF safetensors shards + config + tokenizer, + adapter/ (HF PEFT) for LoRA (alignflow.job.stages.export)",
        (
            Need("config.json", json_file),
            Need("*.safetensors", safetensors),
            Need("*.index.json", json_file, required=False),
            Need("adapter/*.safetensors", safetensors, required=False),
            Need("adapter/*.json", json_file, required=False),
        ),
    ),
    headline=("architecture", "dtype", "shards", "destination"),
)
