"""The `align` flow: compose the config, then run the pipeline's stages as Prefect tasks.

The flow reads like the pipeline: one task per stage instance, in run order
(`alignflow.pipeline`), each waiting on the upstream stages it is wired to. Nothing
is submitted until the whole config has validated. Stopping the flow run (SIGTERM from the
Prefect worker, Ctrl-C, SIGHUP) cancels the stages' jobs too, and the process exits within
seconds; a flow process that dies (SIGKILL) leaves them running, for a rerun to adopt. The UI
is best effort (`tasks.dashboard`).
"""

import time

import fsspec
from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.states import Cancelled

from alignflow import runs
from alignflow.config.compose import build
from alignflow.launch import cancel_jobs_on_interrupt, cpu_warning
from alignflow.orphans import reap_on_exit
from alignflow.pipeline import Pipeline
from alignflow.report import pipeline_report
from alignflow.runner import StageResult
from alignflow.store import options_for, store_of
from tasks import dashboard
from tasks.stage import Wiring, format_value, task_for

RENAME_WAIT_S = 10.0  # how long a submitted task run may take to reach the server
CANCEL_WAIT_S = 5.0  # how long a stopped run waits for its stages to end Cancelled (a Slurm job's cancel takes seconds)
UI_WAIT_S = 2.0  # then for the UI to show it: the process ends launch.STOP_S after the signal in any case
DRAIN_S = 30.0  # how long a finished run waits for the UI to catch up with a Prefect API that is down
_VALIDATED: dict[tuple[str, tuple[str, ...]], Pipeline] = {}  # what `align run` validated before Prefect started, by run


def align_validated(stages: Pipeline, pipeline: str, overrides: list[str]) -> dict[str, StageResult]:
    """`align` on a pipeline this process has just built (the CLI's check before Prefect starts),
    which the flow then takes instead of composing it again."""
    key = (pipeline, tuple(overrides))
    _VALIDATED[key] = stages
    try:
        return align(pipeline=pipeline, overrides=overrides)
    finally:
        _VALIDATED.pop(key, None)


def run_name() -> str:
    """`sft_dpo · slurm · s3 · 11-23 14:05:09`: the pipeline and where it runs, at a glance in the UI."""
    parameters = flow_run.parameters
    overrides = dict(o.split("=", 1) for o in parameters.get("overrides") or [] if "=" in o)
    store = overrides.get("store.root", "")
    where = store.split("://", 1)[0] if "://" in store else "local store"
    return f"{parameters.get('pipeline', 'sft_dpo')} · {overrides.get('launcher', 'local')} · {where} · {time.strftime('%m-%d %H:%M:%S')}"


@flow(name="align", flow_run_name=run_name, log_prints=True)
def align(pipeline: str = "sft_dpo", overrides: list[str] | None = None, force: list[str] | None = None) -> dict[str, StageResult]:
    """Run `pipeline` with Hydra `overrides`; stages named in `force` re-run even if committed."""
    reap_on_exit()  # if this process is killed, its helpers (the ephemeral Prefect server) die with it; its jobs run on
    overrides = [*(overrides or []), *([f"force=[{','.join(force)}]"] if force else [])]
    stages = _VALIDATED.pop((pipeline, tuple(overrides)), None) or build(pipeline, overrides)  # composed once per run
    if (warning := cpu_warning(stages.cfg.launcher)) is not None:
        get_run_logger().warning(warning)
    progress = dashboard.Progress(None, f"align {pipeline}: stages done")
    progress.set(0.0)

    futures: dict[str, PrefectFuture] = {}
    try:
        with cancel_jobs_on_interrupt():  # the signal lands here, in the main thread, not in the tasks' threads
            for stage in stages:
                upstream = {name: futures[name] for name in stage.upstream()}
                futures[stage.name] = task_for(stage).submit(stage.name, pipeline, tuple(overrides), Wiring(stage, upstream),
                                                             wait_for=list(upstream.values()))
            _name_task_runs(futures)

            for done, future in enumerate(futures.values(), start=1):
                future.wait()
                progress.set(100.0 * done / len(futures))
    except Exception:  # a crash: the jobs run on, for a rerun to adopt
        raise
    except BaseException:  # stopped (TerminationSignal, Ctrl-C, SIGHUP): the running stages end Cancelled themselves
        _cancel_unfinished(futures)
        raise

    _publish_summary(pipeline, stages, futures)
    return {stage: future.result() for stage, future in futures.items()}


def _name_task_runs(futures: dict[str, PrefectFuture]) -> None:
    """Each stage's task run named after it from the start: Prefect records a task run under
    `dpo-ea7` and sends its name with its next state, which for a stage waiting on others
    comes when they end (`tasks.stage.Wiring`)."""
    for name, future in futures.items():
        dashboard.set_task_run_name(future.task_run_id, name, RENAME_WAIT_S)


def _cancel_unfinished(futures: dict[str, PrefectFuture]) -> None:
    """Every stage of a stopped flow run ends Cancelled. The running ones do so themselves as
    their jobs are cancelled; those waiting on them then give up as Prefect's NotReady
    (Pending), which the UI would show for ever: those are marked Cancelled once their thread is
    done (never before: its own NotReady would come after). Best effort: a stop never waits on
    the API for long."""
    deadline = time.monotonic() + CANCEL_WAIT_S
    for future in futures.values():
        future.wait(timeout=max(deadline - time.monotonic(), 0.0))
    for name, future in futures.items():
        if future.wrapped_future.done() and not future.state.is_final():
            state = Cancelled(message=f"{name}: its flow run was cancelled")
            dashboard.call(f"cancel:{name}", lambda run=future.task_run_id, state=state: _force_state(run, state))
    dashboard.drain(UI_WAIT_S)


def _force_state(task_run_id, state) -> None:
    with get_client(sync_client=True) as client:
        client.set_task_run_state(task_run_id, state, force=True)


def _publish_summary(pipeline: str, stages: Pipeline, futures: dict[str, PrefectFuture]) -> None:
    """The summary artifact (a table narrow enough for a laptop screen), the run's report.html
    and its run record (`align compare` reads it)."""
    lines = [f"# align `{pipeline}`", "", "| stage | kind | state | fingerprint | headline metrics |", "|---|---|---|---|---|"]
    rows = []
    for name, future in futures.items():
        state = future.state
        result = future.result(raise_on_failure=False) if state.is_completed() else None
        done = isinstance(result, StageResult)
        rows.append({"name": name, "kind": stages[name].kind, "state": state.name, "fingerprint": result.fingerprint if done else "",
                     "uri": result.uri if done else "", "metrics": result.metrics if done else {}})
        metrics = ", ".join(f"{k}={format_value(v)}" for k, v in list(rows[-1]["metrics"].items())[:3])
        lines.append(f"| {name} | {stages[name].kind} | {state.name} | {f'`{result.fingerprint}`' if done else ''} | {metrics} |")
    store = store_of(stages.cfg)
    report = _write_report(stages, rows)
    record = runs.write(store, flow_run.name or "align", {"pipeline": stages.name, "flow_run_id": str(flow_run.id),
                                                          "overrides": list(flow_run.parameters.get("overrides") or []), "stages": rows})
    lines += ["", f"report: `{report}` (every stage's curves and config)",
              f"compare with another run: `align compare '{flow_run.name}' OTHER_RUN` (record: `{record}`)"]
    dashboard.markdown(f"align-{pipeline}".replace("_", "-"), "\n".join(lines), "pipeline summary")
    logger = get_run_logger()
    logger.info("\n".join(lines))
    if missed := dashboard.drain(DRAIN_S):
        logger.warning(f"the Prefect API is still unreachable: {len(missed)} updates of the UI wait for it "
                       f"({', '.join(missed[:5])}); every stage's output and the run's record are in the store: {record}")


def _write_report(stages: Pipeline, rows: list[dict]) -> str:
    """`{store.root}/_reports/<run name>.html`, linking each stage's report.html."""
    cfg = stages.cfg
    uri = f"{cfg.store.root.rstrip('/')}/{runs.REPORTS}/{runs.slug(flow_run.name or 'align')}.html"
    with fsspec.open(uri, "w", auto_mkdir=True, **options_for(uri, cfg)) as f:
        f.write(pipeline_report(f"align {stages.name}: {flow_run.name}", rows))
    return uri
