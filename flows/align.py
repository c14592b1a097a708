"""The `align` flow: compose the config, then run the pipeline's stages as Prefect tasks.

The flow reads like the pipeline: one task per stage instance, in run order
(`alignflow.pipeline`), each waiting on the upstream stages it is wired to. Nothing
is submitted until the whole config has validated. Cancelling the flow run (SIGTERM from
the Prefect worker, or Ctrl-C) cancels the stages' jobs too.
"""

import re
import time

import fsspec
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run

from alignflow.config.compose import compose
from alignflow.launch import cancel_jobs_on_interrupt
from alignflow.orphans import reap_on_exit
from alignflow.pipeline import Pipeline
from alignflow.report import pipeline_report
from alignflow.runner import StageResult
from alignflow.store import options_for
from tasks.stage import format_value, task_for


def run_name() -> str:
    """`sft_dpo · slurm · s3 · 11-23 14:05`: the pipeline and where it runs, at a glance in the UI."""
    parameters = flow_run.parameters
    overrides = dict(o.split("=", 1) for o in parameters.get("overrides") or [] if "=" in o)
    store = overrides.get("store.root", "")
    where = store.split("://", 1)[0] if "://" in store else "local store"
    return f"{parameters.get('pipeline', 'sft_dpo')} · {overrides.get('launcher', 'local')} · {where} · {time.strftime('%m-%d %H:%M')}"


@flow(name="align", flow_run_name=run_name, log_prints=True)
def align(pipeline: str = "sft_dpo", overrides: list[str] | None = None, force: list[str] | None = None) -> dict[str, StageResult]:
    """Run `pipeline` with Hydra `overrides`; stages named in `force` re-run even if committed."""
    reap_on_exit()  # if this process is killed, its jobs and its ephemeral Prefect server die with it
    overrides = [*(overrides or []), *([f"force=[{','.join(force)}]"] if force else [])]
    stages = Pipeline.build(compose(pipeline, overrides))
    progress = create_progress_artifact(progress=0.0, description=f"align {pipeline}: stages done")

    futures: dict[str, PrefectFuture] = {}
    with cancel_jobs_on_interrupt():  # the signal lands here, in the main thread, not in the tasks' threads
        for stage in stages:
            upstream = {name: futures[name] for name in stage.upstream()}
            futures[stage.name] = task_for(stage).submit(stage.name, pipeline, tuple(overrides), upstream)

        for done, future in enumerate(futures.values(), start=1):
            future.wait()
            update_progress_artifact(progress, progress=100.0 * done / len(futures))

    _publish_summary(pipeline, stages, futures)
    return {stage: future.result() for stage, future in futures.items()}


def _publish_summary(pipeline: str, stages: Pipeline, futures: dict[str, PrefectFuture]) -> None:
    """The summary artifact (a table narrow enough for a laptop screen) and the run's report.html."""
    lines = [f"# align `{pipeline}`", "", "| stage | kind | state | fingerprint | headline metrics |", "|---|---|---|---|---|"]
    rows = []
    for name, future in futures.items():
        state = future.state
        result = future.result(raise_on_failure=False) if state.is_completed() else None
        if isinstance(result, StageResult):
            metrics = ", ".join(f"{k}={format_value(v)}" for k, v in list(result.metrics.items())[:3])
            lines.append(f"| {name} | {stages[name].kind} | {state.name} | `{result.fingerprint}` | {metrics} |")
            rows.append({"name": name, "kind": stages[name].kind, "state": state.name, "fingerprint": result.fingerprint,
                         "uri": result.uri, "metrics": result.metrics})
        else:
            lines.append(f"| {name} | {stages[name].kind} | {state.name} | | |")
    report = _write_report(stages, rows)
    lines += ["", f"report: `{report}` (every stage's curves and config)"]
    create_markdown_artifact(markdown="\n".join(lines), key=f"align-{pipeline}".replace("_", "-"), description="pipeline summary")
    get_run_logger().info("\n".join(lines))


def _write_report(stages: Pipeline, rows: list[dict]) -> str:
    """`{store.root}/_reports/<run name>.html`, linking each stage's report.html."""
    cfg = next(iter(stages)).cfg
    slug = re.sub(r"[^\w.-]+", "_", flow_run.name or "align")
    uri = f"{cfg.store.root.rstrip('/')}/_reports/{slug}.html"
    with fsspec.open(uri, "w", auto_mkdir=True, **options_for(uri, cfg)) as f:
        f.write(pipeline_report(f"align {stages.name}: {flow_run.name}", rows))
    return uri
