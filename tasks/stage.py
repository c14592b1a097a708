"""One Prefect task per stage: a thin adapter around the stage runner.

Policy lives here: retries only for infrastructure failures (preemption, node loss,
timeouts, a killed job); a config error or an exception in the stage's code is never
retried. The UI is best effort (`tasks.dashboard`): no API error fails or stops a stage. A cache hit ends Cached, a stage of a cancelled flow run Cancelled. Each stage
publishes one table artifact with its output URI, its job (id, final state, stdout/stderr
paths: also when the job failed), headline metrics, hardware use (tokens/s, TFLOP/s, MFU,
peak memory, where the stage measures them) and cost (FLOPs, wall time, device-hours,
hardware: `alignflow.orchestrator.cost`); training stages also publish their
curves (sparklines in markdown; report.html in the output has the charts) and their metrics
per step as a table.
"""

import logging
import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.states import Cancelled, Completed, State

from alignflow.orchestrator import cost
from alignflow.orchestrator.kinds import STAGES
from alignflow.orchestrator.launch import InfrastructureError, JobCancelled, JobError
from alignflow.orchestrator.pipeline import Stage
from alignflow.orchestrator.report import REPORT, curves_markdown, read_metrics
from alignflow.orchestrator.runner import StageResult, run_stage
from alignflow.orchestrator.store import options_for
from alignflow.job.train.utilization import HARDWARE_METRICS
from alignflow.job.worker import job_record
from tasks import dashboard

HEADLINE_METRICS = 5
STEP_ROWS = 40  # per-step metrics shown per stage: evenly spaced, first and last included


def _infrastructure_failure(task, task_run, state) -> bool:
    try:
        state.result()
    except InfrastructureError:
        return True
    except Exception:
        return False
    return False


class Wiring:
    """A stage as the flow built it and its upstream futures, out of Prefect's sight. Prefect
    resolves the futures among a task's parameters before it names the task run, so a stage
    waiting on others showed as `dpo-ea7`; submitted with these futures as `wait_for`, it is
    named first, waits (and ends NotReady if one failed), and reads their results here. A plain
    class: Prefect looks into dicts, lists and dataclasses for futures. The task runs the
    flow's stage (its config composed once per run), never a composition of its own."""

    def __init__(self, stage: Stage, futures: dict[str, PrefectFuture]):
        self.stage, self.futures = stage, futures

    def results(self) -> dict[str, StageResult]:
        return {name: future.result() for name, future in self.futures.items()}


@task(cache_policy=NO_CACHE, retry_condition_fn=_infrastructure_failure, retry_delay_seconds=5)
def stage_task(name: str, pipeline: str, overrides: tuple[str, ...], wiring: Wiring) -> State:
    """The stage's result in the state the UI should show: Completed, Cached (a committed
    output, no job) or Cancelled (its flow run was); a failure raises, as Failed. `name`,
    `pipeline` and `overrides` are for the UI's task run parameters."""
    stage = wiring.stage
    logger = get_run_logger()
    try:
        watcher = JobLogWatcher(name, logger)
        result = run_stage(stage, wiring.results(), log=watcher, output=watcher.job_output)
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
    """A stage's job as the flow log and the UI show it while it runs.

    The runner's lines (submission, job states, commit) and the job's own alignflow records
    (`alignflow.job.worker.job_record`) at INFO and above, at their level, reach the flow log;
    DEBUG records (where files go), submitit's lines, library warnings and prints stay in the
    job log (its path is on the submission line and in the stage's artifact). A record's
    event moves the stage's progress bar: a training step (`step`, `total`, `loss`: the
    description carries the latest step, loss and ETA) or prep's `percent`; a `link` (an
    online wandb run) becomes a link artifact."""

    def __init__(self, stage: str, logger: logging.Logger | logging.LoggerAdapter):
        self.stage, self.logger, self.bar, self.first_step = stage, logger, None, None

    def __call__(self, line: str) -> None:
        self.logger.info(line)

    def job_output(self, line: str) -> None:
        if (record := job_record(line)) is None or record["level"] == "DEBUG":
            return
        message, event = record["message"], record.get("event") or {}
        self.logger.log(getattr(logging, record["level"], logging.INFO), f"{self.stage}: {message}")
        if "step" in event:
            done, total = event["step"], max(event["total"], 1)
            loss = f", loss {format_value(event['loss'])}" if "loss" in event else ""
            self.progress(100.0 * done / total, f"step {done}/{total}{loss}{self.eta(done, total)}")
        elif "percent" in event:
            self.progress(float(event["percent"]), message)
        elif "link" in event:
            dashboard.link(_key("wandb", self.stage), event["link"], f"{self.stage} on wandb", f"{self.stage}: the wandb run")

    def eta(self, step: int, total: int) -> str:
        """From the steps seen by this watcher (a resumed run's earlier steps took no time here)."""
        if self.first_step is None:
            self.first_step = (step, time.monotonic())
            return ""
        first, at = self.first_step
        if step <= first:
            return ""
        return f", ETA {round((time.monotonic() - at) / (step - first) * (total - step))} s"

    def progress(self, percent: float, status: str) -> None:
        if self.bar is None:
            self.bar = dashboard.Progress(_key("progress", self.stage), self.stage)
        self.bar.set(percent, f"{self.stage}: {status}")


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
    shown = list(result.metrics)[:HEADLINE_METRICS]  # headline first, then how well it used the hardware
    shown += [k for k in (*HARDWARE_METRICS, *cost.METRICS) if k in result.metrics and k not in shown]
    rows += [{"field": k, "value": format_value(result.metrics[k])} for k in shown]
    _publish_table(result.stage, rows)
    if (table := STAGES[kind].table(result.metrics)) is not None:  # the kind's own table of its output
        rows = [{k: format_value(v) for k, v in row.items()} for row in table.rows]
        dashboard.table(_key(table.name, result.stage), rows, f"{result.stage}: {table.title}")


def _job_rows(job: dict | None) -> list[dict]:
    """The job that produced the output (on a cache hit: the one that did, back then)."""
    if not job:
        return []
    return [
        {"field": "job", "value": f"{job['launcher']} {job['job_id']} {job.get('state', '')}".rstrip()},
        {"field": "stdout", "value": job["stdout"]},
        {"field": "stderr", "value": job["stderr"]},
    ]


def _publish_table(stage: str, rows: list[dict]) -> None:
    dashboard.table(_key("stage", stage), rows, f"{stage} output, job and headline metrics")


def _publish_curves(result: StageResult, storage_options: dict) -> None:
    """The stage's curves (a markdown table of sparklines, which the UI renders as text) and its
    metrics per step (a table, evenly spaced rows, first and last included)."""
    records = read_metrics(result.uri, storage_options)
    if not records:
        return
    dashboard.markdown(
        _key("curves", result.stage),
        curves_markdown(result.stage, records) + f"\n\nreport: `{result.uri.rstrip('/')}/{REPORT}`",
        f"{result.stage}: curves",
    )
    picked = sorted({round(i * (len(records) - 1) / max(STEP_ROWS - 1, 1)) for i in range(STEP_ROWS)})
    rows = [{k: format_value(v) for k, v in records[i].items()} for i in picked]
    dashboard.table(_key("steps", result.stage), rows, f"{result.stage}: metrics per step")


def format_value(value) -> str:
    """A metric as a short string for artifacts."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def task_for(stage: Stage):
    """The Prefect task of a stage instance, named after it so the UI's graph reads like the pipeline."""
    return stage_task.with_options(name=stage.name, task_run_name=stage.name, retries=stage.section.retries)
