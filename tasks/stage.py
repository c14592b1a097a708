"""One Prefect task per stage: a thin adapter around the stage runner.

Policy lives here: retries only for infrastructure failures (preemption, node loss,
timeouts, a killed job); a config error or an exception in the stage's code is never
retried. A cache hit ends Cached, a stage of a cancelled flow run Cancelled. Each stage
publishes one table artifact with its output URI, its job (id, final state, stdout/stderr
paths: also when the job failed) and headline metrics; training stages also publish their
curves (sparklines in markdown; report.html in the output has the charts) and their metrics
per step as a table.
"""

import re
from functools import lru_cache
from typing import Callable

from prefect import get_run_logger, task
from prefect.artifacts import (create_link_artifact, create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled, Completed, State

from alignflow.config.compose import compose
from alignflow.launch import InfrastructureError, JobCancelled, JobError
from alignflow.pipeline import Pipeline, Stage
from alignflow.report import REPORT, curves_markdown, read_metrics
from alignflow.runner import StageResult, run_stage
from alignflow.store import options_for

HEADLINE_METRICS = 5
STEP_ROWS = 40  # per-step metrics shown per stage: evenly spaced, first and last included


@lru_cache(maxsize=8)
def _pipeline(pipeline: str, overrides: tuple[str, ...]) -> Pipeline:
    return Pipeline.build(compose(pipeline, list(overrides)))


def _infrastructure_failure(task, task_run, state) -> bool:
    try:
        state.result()
    except InfrastructureError:
        return True
    except Exception:
        return False
    return False


@task(cache_policy=NO_CACHE, retry_condition_fn=_infrastructure_failure, retry_delay_seconds=5)
def stage_task(name: str, pipeline: str, overrides: tuple[str, ...], upstream: dict[str, StageResult]) -> State:
    """The stage's result in the state the UI should show: Completed, Cached (a committed
    output, no job) or Cancelled (its flow run was); a failure raises, as Failed."""
    stage = _pipeline(pipeline, tuple(overrides))[name]
    logger = get_run_logger()
    try:
        result = run_stage(stage, upstream, log=JobLogWatcher(name, logger.info))
    except JobCancelled as err:
        _publish_table(name, [{"field": "state", "value": "cancelled"}, *_job_rows(err.job)])
        return Cancelled(message=str(err))
    except JobError as err:
        _publish_table(name, [{"field": "state", "value": "failed"}, *_job_rows(err.job)])
        raise
    _publish(result, stage.kind)
    if stage.spec.resumable:
        _publish_curves(result, options_for(result.uri, stage.cfg))
    if result.cached:
        return Completed(name="Cached", data=result, message=f"cache hit: {result.uri}")
    return Completed(data=result)


class JobLogWatcher:
    """Forwards the job's log lines to Prefect and turns some of them into artifacts while the
    job runs: a training step line ("step 40/300: ...") or a progress line ("42.0% done, ...",
    prep's) moves the stage's progress bar, and a wandb run URL (online runs log it) becomes a
    link artifact."""

    STEP = re.compile(r"\bstep (\d+)/(\d+): ")
    DONE = re.compile(r"\b(\d+(?:\.\d+)?)% done\b")
    WANDB = re.compile(r"\bwandb run (https?://\S+)")

    def __init__(self, stage: str, log: Callable[[str], None]):
        self.stage, self.log, self.progress_id = stage, log, None

    def __call__(self, line: str) -> None:
        self.log(line)
        if step := self.STEP.search(line):
            self.progress(100.0 * int(step.group(1)) / max(int(step.group(2)), 1))
        elif done := self.DONE.search(line):
            self.progress(float(done.group(1)))
        elif wandb := self.WANDB.search(line):
            create_link_artifact(link=wandb.group(1), link_text=f"{self.stage} on wandb", key=_key("wandb", self.stage),
                                 description=f"{self.stage}: the wandb run")

    def progress(self, percent: float) -> None:
        if self.progress_id is None:
            self.progress_id = create_progress_artifact(percent, key=_key("progress", self.stage), description=f"{self.stage}: progress")
        else:
            update_progress_artifact(self.progress_id, percent)


def _key(kind: str, stage: str) -> str:
    return f"{kind}-{stage}".replace("_", "-")


def _publish(result: StageResult, kind: str) -> None:
    rows = [
        {"field": "output", "value": result.uri},
        {"field": "kind", "value": kind},
        {"field": "fingerprint", "value": result.fingerprint},
        {"field": "state", "value": "cache hit" if result.cached else "ran"},
        *_job_rows(result.job),
    ]
    rows += [{"field": k, "value": format_value(v)} for k, v in list(result.metrics.items())[:HEADLINE_METRICS]]  # headline first
    _publish_table(result.stage, rows)
    if kind == "eval":  # every metric of every model, one row per model
        models: dict[str, dict] = {}
        for key, value in result.metrics.items():
            model, _, metric = key.rpartition(".")
            models.setdefault(model, {"model": model})[metric] = format_value(value)
        create_table_artifact(table=list(models.values()), key=_key("models", result.stage),
                              description=f"{result.stage}: every metric of every model")


def _job_rows(job: dict | None) -> list[dict]:
    """The job that produced the output (on a cache hit: the one that did, back then)."""
    if not job:
        return []
    return [{"field": "job", "value": f"{job['launcher']} {job['job_id']} {job.get('state', '')}".rstrip()},
            {"field": "stdout", "value": job["stdout"]}, {"field": "stderr", "value": job["stderr"]}]


def _publish_table(stage: str, rows: list[dict]) -> None:
    create_table_artifact(table=rows, key=_key("stage", stage), description=f"{stage} output, job and headline metrics")


def _publish_curves(result: StageResult, storage_options: dict) -> None:
    """The stage's curves (a markdown table of sparklines, which the UI renders as text) and its
    metrics per step (a table, evenly spaced rows, first and last included)."""
    records = read_metrics(result.uri, storage_options)
    if not records:
        return
    create_markdown_artifact(markdown=curves_markdown(result.stage, records) + f"\n\nreport: `{result.uri.rstrip('/')}/{REPORT}`",
                             key=_key("curves", result.stage), description=f"{result.stage}: curves")
    picked = sorted({round(i * (len(records) - 1) / max(STEP_ROWS - 1, 1)) for i in range(STEP_ROWS)})
    rows = [{k: format_value(v) for k, v in records[i].items()} for i in picked]
    create_table_artifact(table=rows, key=_key("steps", result.stage), description=f"{result.stage}: metrics per step")


def format_value(value) -> str:
    """A metric as a short string for artifacts."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def task_for(stage: Stage):
    """The Prefect task of a stage instance, named after it so the UI's graph reads like the pipeline."""
    return stage_task.with_options(name=stage.name, task_run_name=stage.name, retries=stage.section.retries)
