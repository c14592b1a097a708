"""The `generate` kind: sampled completions of prep's prompts by a model (`alignflow.job.stages.generate`)."""

from alignflow.orchestrator.config import schema
from alignflow.job.train.utilization import FORWARD
from alignflow.orchestrator.kinds.spec import CACHE, Count, StageKind, Work, one
from alignflow.orchestrator.verify import Need, OutputFormat, parquet

SPLITS = ("train", "val")


def checks(stage, key: str, check_paths: bool) -> list[str]:
    s, problems = stage.section, []
    if s.split not in SPLITS:
        problems.append(f"{key}.split: one of {', '.join(SPLITS)} (prep's prompts splits), got {s.split!r}")
    if s.num_prompts is not None and s.num_prompts < 1:
        problems.append(f"{key}.num_prompts: must be >= 1 or null (all), got {s.num_prompts}")
    if s.num_generations_per_prompt < 1:
        problems.append(f"{key}.num_generations_per_prompt: must be >= 1, got {s.num_generations_per_prompt}")
    if s.max_new_tokens < 1:
        problems.append(f"{key}.max_new_tokens: must be >= 1, got {s.max_new_tokens}")
    if s.temperature < 0:
        problems.append(f"{key}.temperature: must be >= 0 (0 = greedy), got {s.temperature}")
    elif s.temperature == 0 and s.num_generations_per_prompt > 1:
        problems.append(
            f"{key}.temperature: 0 is greedy, so the {s.num_generations_per_prompt} completions of a prompt would be one repeated; "
            "sample with a temperature > 0 or set num_generations_per_prompt: 1"
        )
    if not 0 < s.top_p <= 1:
        problems.append(f"{key}.top_p: must be in (0, 1], got {s.top_p}")
    if s.top_k is not None and s.top_k < 1:
        problems.append(f"{key}.top_k: must be >= 1 or null, got {s.top_k}")
    return problems


def work(stage, count: Count) -> list[Work]:
    """num_generations_per_prompt completions of max_new_tokens (an upper bound) per prompt."""
    s = stage.section
    prompts = count("prompts", s.split)
    if s.num_prompts is not None:
        prompts = s.num_prompts if prompts is None else min(prompts, s.num_prompts)
    items = None if prompts is None else prompts * s.num_generations_per_prompt
    return [Work("prompts", s.split, items, FORWARD, s.max_new_tokens, s.micro_batch_size)]


KIND = StageKind(
    schema=schema.GenerateConfig,
    output="completions",
    inputs={"data": one("prep"), "model": one("model")},
    resumable=False,
    output_format=OutputFormat(
        "completions.parquet: completions per prompt with their tokens and log-probs (alignflow.job.stages.generate)",
        (Need("completions.parquet", parquet),),
    ),
    headline=("completions", "completion_tokens_mean", "truncation_rate", "generation_tokens_per_s"),
    reads=("model",),
    context=CACHE,
    checks=checks,
    work=work,
)
