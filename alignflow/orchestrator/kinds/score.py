"""The `score` kind: rewards of generated completions, and the next round's SFT rows and
preference pairs from them (`alignflow.job.stages.score`)."""

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.kinds.spec import CACHE, StageKind, environment_problems, one, optional, reward_model_use_problems
from alignflow.orchestrator.verify import Need, OutputFormat, json_lines, parquet


def checks(stage, key: str, check_paths: bool) -> list[str]:
    problems = environment_problems(stage.section.environment, key) + reward_model_use_problems(stage, key, "reward_model")
    if stage.section.min_margin < 0:
        problems.append(f"{key}.min_margin: must be >= 0 (a pair's best - worst reward exceeds it), got {stage.section.min_margin}")
    return problems


KIND = StageKind(
    schema=schema.ScoreConfig,
    output="scored",
    inputs={"completions": one("completions"), "reward_model": optional("reward_model")},
    resumable=False,
    output_format=OutputFormat(
        "scored.parquet (completions with rewards) + sft.jsonl (best per prompt) + preference.jsonl (best vs worst) (alignflow.job.stages.score)",
        (Need("scored.parquet", parquet), Need("sft.jsonl", json_lines), Need("preference.jsonl", json_lines)),
    ),
    headline=("reward_mean", "best_reward_mean", "sft_rows", "preference_pairs"),
    reads=("model",),
    context=CACHE,
    imports=("environment.*.name",),
    checks=checks,
    tokenizer_role="completions",
)
