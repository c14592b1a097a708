"""The `benchmark` kind: lm-evaluation-harness tasks on each model of the pipeline
(`alignflow.job.stages.benchmark`).

Its identity: the models' fingerprints (inputs), the task names and settings (config), lm-eval's
and datasets' versions (`packages`: they fix the built-in tasks' YAML and the metrics), and the
content of every file of `include_path` and of the local data files its named tasks read
(`source_files`). Task names are checked here against lm-eval's own task index, which reads the
YAMLs without loading any data; a task whose data files are remote is refused here, one whose
dataset is a Hub id at job start (`HF_DATASETS_OFFLINE`: only the local datasets cache).
"""

from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.kinds.spec import CACHE, Role, StageKind, Table
from alignflow.orchestrator.verify import Need, OutputFormat, json_file

STDERR = "_stderr"


def task_manager(include_path: str | None, tasks: list[str]):
    """lm-eval's TaskManager over `include_path`, and over lm-eval's built-in tasks only where a
    task is not found there (indexing the ~15,000 built-in ones takes seconds)."""
    from lm_eval.tasks import TaskManager  # datasets, no torch

    if not include_path:
        return _built_in()
    local = TaskManager(include_path=include_path, include_defaults=False)
    return local if all(task in local.all_tasks for task in tasks) else TaskManager(include_path=include_path)


@lru_cache(maxsize=1)
def _built_in():
    """lm-eval's own tasks, indexed once per process (they change only with its version)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def data_files(entry_cfg: dict) -> list[str]:
    """The files a task's `dataset_kwargs.data_files` names (a string, a list, or split -> either)."""
    named = (entry_cfg.get("dataset_kwargs") or {}).get("data_files") or []
    values = named.values() if isinstance(named, dict) else [named]
    return [file for value in values for file in ([value] if isinstance(value, str) else value)]


def _remote(path: str) -> bool:
    return urlparse(path).scheme not in ("", "file")


def checks(stage, key: str, check_paths: bool) -> list[str]:
    section, problems = stage.section, []
    if not stage.inputs["models"]:
        problems.append(f"{key}.inputs.models: name at least one model stage to benchmark")
    if not section.tasks:
        problems.append(f"{key}.tasks: name at least one lm-eval task (e.g. arithmetic_demo, gsm8k)")
    if section.fewshot_as_multiturn and not section.apply_chat_template:
        problems.append(f"{key}.fewshot_as_multiturn: few-shot examples as chat turns need {key}.apply_chat_template: true")
    if section.include_path is not None and not Path(section.include_path).is_dir():
        return [*problems, f"{key}.include_path: {section.include_path} is not a local folder of lm-eval task YAMLs"]
    if problems or not check_paths:
        return problems
    index = task_manager(section.include_path, list(section.tasks)).task_index
    if unknown := [task for task in section.tasks if task not in index]:
        where = f"lm-eval {_version()}'s tasks" + (f" or {section.include_path}" if section.include_path else "")
        problems.append(f"{key}.tasks: {', '.join(unknown)} is not a task, group or tag of {where} (`lm_eval ls tasks`)")
    for task in section.tasks:
        files = data_files(index[task].cfg or {}) if task in index else []
        if remote := [f for f in files if _remote(f)]:
            problems.append(
                f"{key}.tasks: {task} reads {', '.join(remote)}, not a local file (benchmarks run offline): point its data_files at a copy"
            )
        elif missing := [f for f in files if not Path(f).exists()]:
            problems.append(f"{key}.tasks: {task} reads {', '.join(missing)}, which does not exist")
    return problems


def source_files(section) -> list[str]:
    """Every file of include_path (lm-eval's `__pycache__` of a task's `!function` module left
    out) and the local data files that the named tasks read from elsewhere."""
    if not section.tasks:
        return []
    folder = (
        [str(p) for p in sorted(Path(section.include_path).rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
        if section.include_path
        else []
    )
    index = task_manager(section.include_path, list(section.tasks)).task_index
    read = [f for task in section.tasks if task in index for f in data_files(index[task].cfg or {}) if not _remote(f) and Path(f).exists()]
    return [*folder, *sorted(set(read) - set(folder))]


def _version() -> str:
    from importlib.metadata import version

    return version("lm-eval")


def table(metrics: dict) -> Table | None:
    """A row per model, a column per task metric: `value ± stderr` (metrics are `{model}.{task}.{metric}`)."""
    models: dict[str, dict] = {}
    for key, value in metrics.items():
        model, _, rest = key.partition(".")
        task, _, metric = rest.rpartition(".")
        if not task or metric.endswith(STDERR):
            continue
        stderr = metrics.get(f"{key}{STDERR}")
        models.setdefault(model, {"model": model})[f"{task} {metric}"] = f"{value:.4g}" + (f" ± {stderr:.2g}" if stderr is not None else "")
    return Table("benchmarks", "models x lm-eval tasks (± standard error)", list(models.values())) if models else None


KIND = StageKind(
    schema=schema.BenchmarkConfig,
    output="benchmark",
    inputs={"models": Role("model", many=True)},
    resumable=False,
    output_format=OutputFormat(
        "benchmark.json: per model x task, lm-eval's metrics with stderr, n-samples and version; lm_eval/<model>.json: "
        "lm-eval's results per model (alignflow.job.stages.benchmark)",
        (Need("benchmark.json", json_file), Need("lm_eval/*.json", json_file)),
    ),
    headline=("*.acc", "*.acc_norm", "*.exact_match", "*.exact_match@*-match", "*.exact_match@*-extract"),
    trend=("*.acc", "*.acc_norm", "*.exact_match", "*.exact_match@*-match", "*.exact_match@*-extract"),
    context=CACHE,
    source_files=source_files,
    packages=("lm-eval", "datasets"),
    checks=checks,
    table=table,
)
