"""The `dpo` kind: DPO-family preference training against precomputed reference log-probs (`alignflow.job.stages.dpo`)."""

from omegaconf import DictConfig

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.config.schema import DPO_REFERENCE_FREE, DPO_SMOOTHED, DPOLoss
from alignflow.orchestrator.kinds.spec import TRAIN_HEADLINE, TRAINING, StageKind, one, pair_rows, trained_on


def checks(stage, key: str, check_paths: bool) -> list[str]:
    return _check_dpo_loss(f"{key}.loss", stage.section.loss)


def _check_dpo_loss(key: str, loss: DictConfig) -> list[str]:
    types, problems = [DPOLoss(name) for name in loss.loss_type], []
    if loss.beta <= 0:
        problems.append(f"{key}.beta: must be > 0, got {loss.beta}")
    if not types:
        problems.append(f"{key}.loss_type: needs at least one loss type")
    if loss.loss_weights is not None and len(loss.loss_weights) != len(types):
        problems.append(f"{key}.loss_weights: {len(loss.loss_weights)} weights for {len(types)} loss types (one each, as TRL)")
    if not 0 <= loss.label_smoothing < 0.5:
        problems.append(f"{key}.label_smoothing: must be in [0, 0.5), got {loss.label_smoothing}")
    elif loss.label_smoothing > 0 and not DPO_SMOOTHED.intersection(types):
        problems.append(
            f"{key}.label_smoothing: none of {[t.value for t in types]} uses it (TRL 1.16 ignores it there); "
            f"conservative DPO is loss_type [cdpo]; label smoothing enters {sorted(t.value for t in DPO_SMOOTHED)}"
        )
    if DPOLoss.exo_pair in types and loss.label_smoothing == 0:
        problems.append(f"{key}.label_smoothing: exo_pair needs it > 0 (the EXO paper uses 1e-3)")
    if DPO_REFERENCE_FREE.intersection(types) and set(types) - DPO_REFERENCE_FREE - {DPOLoss.sft}:
        problems.append(
            f"{key}.loss_type: {[t.value for t in types]} mixes reference-free losses "
            f"({sorted(t.value for t in DPO_REFERENCE_FREE)}) with ones against the reference"
        )
    if loss.discopop_tau <= 0:
        problems.append(f"{key}.discopop_tau: must be > 0, got {loss.discopop_tau}")
    return problems


KIND = StageKind(
    schema=schema.DPOConfig,
    output="model",
    inputs={"data": one("prep"), "model": one("model"), "ref_logprobs": one("ref_logprobs")},
    resumable=True,
    headline=("val_reward_accuracy", *TRAIN_HEADLINE),
    reads=("model",),
    context=TRAINING,
    checks=checks,
    rows=pair_rows,
    load_balancing=True,
    work=trained_on("preference"),
)
