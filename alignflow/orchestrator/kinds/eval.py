"""The `eval` kind: metrics of a model and its baselines on prep's validation data (`alignflow.job.stages.eval`)."""

from omegaconf import DictConfig

from alignflow.orchestrator.config import schema
from alignflow.job.train.utilization import FORWARD
from alignflow.orchestrator.kinds.spec import CACHE, Count, StageKind, Table, Work, many, one, optional
from alignflow.orchestrator.verify import Need, OutputFormat, json_file


def checks(stage, key: str, check_paths: bool) -> list[str]:
    return eval_sampling_problems(stage.section, key)


def eval_sampling_problems(section: DictConfig, key: str = "eval") -> list[str]:
    """eval.sampling (pass@k, maj@k): n samples per prompt, k of them at a time, drawn at random."""
    s, key, problems = section.sampling, f"{key}.sampling", []
    if any(k < 1 for k in s.k):
        problems.append(f"{key}.k: every k must be >= 1, got {list(s.k)}")
    elif s.k and max(s.k) > s.n:
        problems.append(f"{key}.k: k = {max(s.k)} is more than the {s.n} completions sampled per prompt ({key}.n); raise n or lower k")
    if s.n < 1:
        problems.append(f"{key}.n: must be >= 1, got {s.n}")
    if s.temperature < 0:
        problems.append(f"{key}.temperature: must be >= 0 (0 = greedy), got {s.temperature}")
    elif s.temperature == 0 and s.n > 1 and s.k:
        problems.append(
            f"{key}.temperature: 0 is greedy, so the {s.n} completions of a prompt would be one repeated; "
            "sample with a temperature > 0 (e.g. 1.0) or set n: 1"
        )
    if not 0 < s.top_p <= 1:
        problems.append(f"{key}.top_p: must be in (0, 1], got {s.top_p}")
    return problems


def table(metrics: dict) -> Table:
    """Every metric of every model, one row per model (metrics are named `{model}.{metric}`; the
    job's own, its cost, have no model)."""
    models: dict[str, dict] = {}
    for key, value in metrics.items():
        model, _, metric = key.rpartition(".")
        if model:
            models.setdefault(model, {"model": model})[metric] = value
    return Table("models", "every metric of every model", list(models.values()))


def work(stage, count: Count) -> list[Work]:
    """Per model (the model and each baseline), forward passes over: limit_batches micro batches
    of SFT val rows, every val pair, and num_generation_samples val prompts (n each more when
    sampling) with max_new_tokens generated in micro batches (an upper bound: EOS stops a
    completion earlier). The reward model's scoring is not counted."""
    section = stage.section

    def at_most(dataset: str, most: int | None) -> int | None:
        bounds = [n for n in (count(dataset, "val"), most) if n is not None]
        return min(bounds) if bounds else None

    prompts, new, micro = at_most("prompts", section.num_generation_samples), section.max_new_tokens, section.micro_batch_size
    sampled = None if prompts is None else prompts * section.sampling.n * bool(section.sampling.k)
    one_model = [
        Work("sft", "val", at_most("sft", section.limit_batches * micro), FORWARD),
        Work("preference", "val", at_most("preference", None), FORWARD),
        Work("prompts", "val", prompts, FORWARD, new, micro),
        Work("prompts", "val", sampled, FORWARD, new, micro),
    ]
    return one_model * (1 + len(stage.inputs.get("baselines", ())))


KIND = StageKind(
    schema=schema.EvalConfig,
    output="eval",
    inputs={"data": one("prep"), "model": one("model"), "baselines": many("model"), "reward_model": optional("reward_model")},
    resumable=False,
    output_format=OutputFormat("eval.json: metrics per model and samples (alignflow.job.stages.eval)", (Need("eval.json", json_file),)),
    headline=("*.accuracy", "*.preference_accuracy", "*.val_loss"),
    trend=("*.accuracy", "*.preference_accuracy", "*.val_loss"),
    reads=("model",),
    context=CACHE,
    checks=checks,
    table=table,
    work=work,
)
