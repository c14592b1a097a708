"""The `align` flow: compose the config, then run the pipeline's stages as Prefect tasks.

The flow reads like the pipeline: one task per stage instance, in run order
(`alignflow.pipeline`), each waiting on the upstream stages it is wired to. Nothing
is submitted until the whole config has validated. Cancelling the flow run (SIGTERM from
the Prefect worker, or Ctrl-C) cancels the stages' jobs too.
"""

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture

from alignflow.config.compose import compose
from alignflow.launch import cancel_jobs_on_interrupt
from alignflow.orphans import reap_on_exit
from alignflow.pipeline import Pipeline
from alignflow.runner import StageResult
from tasks.stage import format_value, task_for


@flow(name="align", log_prints=True)
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

    _publish_summary(pipeline, futures)
    return {stage: future.result() for stage, future in futures.items()}


def _publish_summary(pipeline: str, futures: dict[str, PrefectFuture]) -> None:
    lines = [f"# align `{pipeline}`", "", "| stage | state | fingerprint | output | metrics |", "|---|---|---|---|---|"]
    for stage, future in futures.items():
        state = future.state
        result = future.result(raise_on_failure=False) if state.is_completed() else None
        if isinstance(result, StageResult):
            status = "cache hit" if result.cached else "ran"
            metrics = ", ".join(f"{k}={format_value(v)}" for k, v in list(result.metrics.items())[:4])
            lines.append(f"| {stage} | {status} | `{result.fingerprint}` | `{result.uri}` | {metrics} |")
        else:
            lines.append(f"| {stage} | {state.name} | | | |")
    create_markdown_artifact(markdown="\n".join(lines), key=f"align-{pipeline}".replace("_", "-"), description="pipeline summary")
    get_run_logger().info("\n".join(lines))
