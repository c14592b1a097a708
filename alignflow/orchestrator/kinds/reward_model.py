"""The `reward_model` kind: a Bradley-Terry reward model with a scalar head (`alignflow.job.stages.reward_model`)."""

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.config.schema import FinetuningType
from alignflow.orchestrator.kinds.spec import TRAIN_HEADLINE, TRAINING, StageKind, one, pair_rows, trained_on
from alignflow.orchestrator.verify import Need, OutputFormat, json_file, nonempty, torch_dist


def checks(stage, key: str, check_paths: bool) -> list[str]:
    section = stage.section
    if section.finetuning_type != FinetuningType.all_weights:
        return [
            f"{key}.finetuning_type: {section.finetuning_type} is not supported by reward_model (LoRA would leave its new "
            "scalar head frozen at its random init); use all_weights"
        ]
    return []


KIND = StageKind(
    schema=schema.RewardModelConfig,
    output="reward_model",
    inputs={"data": one("prep"), "model": one("model", "reward_model")},
    resumable=True,
    output_format=OutputFormat(
        "Megatron torch_dist model/ with the scalar head rm_head.weight + hf/ (config.json: the "
        "...ForSequenceClassification, one label, pad_token_id) + tokenizer/ (alignflow.job.stages.reward_model)",
        (
            Need("hf/config.json", json_file),
            Need("tokenizer/*", nonempty),
            Need("model", torch_dist),
            *(
                Need(f"checkpoints/step-*/{part}", check, required=False)
                for part, check in (("model", torch_dist), ("optimizer", torch_dist), ("trainer.json", json_file))
            ),
        ),
    ),
    headline=("val_reward_accuracy", "val_reward_margin", *TRAIN_HEADLINE),
    reads=("model",),
    context=TRAINING,
    checks=checks,
    rows=pair_rows,
    work=trained_on("preference"),  # its head (width 1) counted as the vocabulary's: an overestimate
)
