"""The `align` flow: compose the config, then run the pipeline's stages as Prefect tasks.

The flow reads like the pipeline: one task per stage instance, in run order
(`alignflow.orchestrator.pipeline`), each waiting on the upstream stages it is wired to. Nothing
is submitted until the whole config has validated. Stopping the flow run (SIGTERM from the
Prefect worker, Ctrl-C, SIGHUP) cancels the stages' jobs too, and the process exits within
seconds; a flow process that dies (SIGKILL) leaves them running, for a rerun to adopt. The UI
is best effort (`tasks.dashboard`). With `gate.thresholds` set, the run ends by comparing its
metrics with a baseline run's (`alignflow.orchestrator.gate`): a regression ends it Failed, named Regressed.
"""

import os
import time
from fnmatch import fnmatch

import fsspec
from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.futures import PrefectFuture
from prefect.context import FlowRunContext
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed, Failed, State

from alignflow.orchestrator import cost, gate, runs
from alignflow.orchestrator.config.compose import build
from alignflow.orchestrator.launch import cancel_jobs_on_interrupt, cpu_warning
from alignflow.orchestrator.orphans import reap_on_exit
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.report import pipeline_report, trend_markdown
from alignflow.orchestrator.runner import StageResult
from alignflow.orchestrator.store import options_for, store_of
from tasks import dashboard
from tasks.stage import Wiring, format_value, task_for

RENAME_WAIT_S = 10.0  # how long a submitted task run may take to reach the server
CANCEL_WAIT_S = 5.0  # how long a stopped run waits for its stages to end Cancelled (a Slurm job's cancel takes seconds)
UI_WAIT_S = 2.0  # then for the UI to show it: the process ends launch.STOP_S after the signal in any case
DRAIN_S = 300.0  # how long a finished run waits for a Prefect API that is down (a server restart is minutes long), so the UI shows how it ended
_VALIDATED: dict[tuple[str, tuple[str, ...]], Pipeline] = {}  # what `align run` validated before Prefect started, by run


def align_validated(stages: Pipeline, pipeline: str, overrides: list[str]) -> State:
    """`align` on a pipeline this process has just built (the CLI's check before Prefect starts),
    which the flow then takes instead of composing it again; the flow run's final state."""
    key = (pipeline, tuple(overrides))
    _VALIDATED[key] = stages
    try:
        return align(pipeline=pipeline, overrides=overrides, return_state=True)
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
def align(pipeline: str = "sft_dpo", overrides: list[str] | None = None, force: list[str] | None = None) -> dict[str, StageResult] | State:
    """Run `pipeline` with Hydra `overrides`; stages named in `force` re-run even if committed.
    Gated (`gate.thresholds`), it ends in the gate's state, its data the results where it completes."""
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
                futures[stage.name] = task_for(stage).submit(
                    stage.name, pipeline, tuple(overrides), Wiring(stage, upstream), wait_for=list(upstream.values())
                )
            _name_task_runs(futures)

            for done, future in enumerate(futures.values(), start=1):
                future.wait()
                progress.set(100.0 * done / len(futures))
    except Exception:  # a crash: the jobs run on, for a rerun to adopt
        raise
    except BaseException:  # stopped (TerminationSignal, Ctrl-C, SIGHUP): the running stages end Cancelled themselves
        _cancel_unfinished(futures)
        raise

    verdict = _publish_summary(pipeline, stages, futures)
    results = {stage: future.result() for stage, future in futures.items()}
    return results if verdict is None else _gate_state(verdict, results)


def _gate_state(verdict: gate.Verdict, results: dict[str, StageResult]) -> State:
    """The gate's state (`gate.Verdict.state`): Regressed (a Failed type) with the table in its
    message, Failed, or Completed naming its baseline, its data the results."""
    if verdict.state == "Completed":
        return Completed(data=results, message=verdict.message())
    return Failed(name=verdict.state, message=verdict.markdown() if verdict.regressed else verdict.message())


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


def _publish_summary(pipeline: str, stages: Pipeline, futures: dict[str, PrefectFuture]) -> gate.Verdict | None:
    """The summary artifact (a table narrow enough for a laptop screen), the run's report.html,
    its run record (`align compare` reads it), the gate's verdict (None: no gate) and the trend
    across the runs of its series."""
    lines = [f"# align `{pipeline}`", "", "| stage | kind | state | fingerprint | headline metrics |", "|---|---|---|---|---|"]
    rows = []
    for name, future in futures.items():
        state = future.state
        result = future.result(raise_on_failure=False) if state.is_completed() else None
        done = isinstance(result, StageResult)
        rows.append(
            {
                "name": name,
                "kind": stages[name].kind,
                "state": state.name,
                "fingerprint": result.fingerprint if done else "",
                "uri": result.uri if done else "",
                "metrics": result.metrics if done else {},
                "cached": result.cached if done else None,
            }
        )
        metrics = ", ".join(f"{k}={format_value(v)}" for k, v in list(rows[-1]["metrics"].items())[:3])
        lines.append(f"| {name} | {stages[name].kind} | {state.name} | {f'`{result.fingerprint}`' if done else ''} | {metrics} |")
    store, name = store_of(stages.cfg), flow_run.name or "align"
    record = {
        "name": name,
        "pipeline": stages.name,
        "flow_run_id": str(flow_run.id),
        "deployment": _deployment(),
        "overrides": list(flow_run.parameters.get("overrides") or []),
        "stages": rows,
        "compute": cost.usage(rows),
    }
    verdict = _judge(stages.cfg.gate, store, record)
    record |= {"gate": verdict.as_dict()} if verdict else {}
    trend = _trend(stages, store, record)
    report = _write_report(stages, rows, trend, verdict.message() if verdict else "")
    uri = runs.write(store, name, record)
    lines += [
        "",
        cost.usage_line(record["compute"]),
        "",
        f"report: `{report}` (every stage's curves and config)",
        f"compare with another run: `align compare '{flow_run.name}' OTHER_RUN` (record: `{uri}`)",
    ]
    lines += ["", verdict.markdown()] if verdict and verdict.baseline else ["", verdict.message()] if verdict else []
    key = pipeline.replace("_", "-")
    dashboard.markdown(f"align-{key}", "\n".join(lines), "pipeline summary")
    if verdict and verdict.regressed:
        dashboard.markdown("regression", verdict.markdown(), f"align {pipeline}: what dropped against the baseline run")
    if len(trend) >= 2:
        dashboard.markdown(
            f"trend-{key}", trend_markdown(f"align {pipeline}: the last {len(trend)} runs", trend), f"align {pipeline}: metrics across runs"
        )
    logger = get_run_logger()
    logger.info("\n".join(lines))
    if dashboard.api_down():
        logger.warning(
            f"the Prefect API is down: this run waits up to {DRAIN_S:.0f} s for it, so that the UI shows how it ended (every stage's output is in the store)"
        )
    if missed := dashboard.drain(DRAIN_S):
        logger.warning(
            f"the Prefect API is still unreachable: {len(missed)} updates of the UI wait for it "
            f"({', '.join(missed[:5])}); every stage's output and the run's record are in the store: {uri}"
        )
    return verdict


def _deployment() -> str | None:
    """`align/nightly` for a deployment's flow run: its series for the gate's `last` baseline and
    the trend, kept when `prefect deploy` recreates the deployment under a new id. From the run's
    context: the flow's name and the deployment's name, which Prefect's workers and runners put in
    the run's environment (PREFECT__DEPLOYMENT_NAME); not `prefect.runtime.deployment`, which asks
    the API: a run's end must not need the API (it may be down; the run ends from the store all the
    same). A deployment run started without that variable is keyed by its deployment's id."""
    context = FlowRunContext.get()
    deployment_id = context.flow_run.deployment_id if context and context.flow_run else None
    if deployment_id is None:
        return None
    name = os.environ.get("PREFECT__DEPLOYMENT_NAME")
    return f"{context.flow.name}/{name}" if name else str(deployment_id)


def _judge(section, store, record: dict) -> gate.Verdict | None:
    if not section.thresholds:
        return None
    return gate.judge(dict(section.thresholds), section.sigmas, record, gate.baseline_of(store, section.baseline, record))


def _trend(stages: Pipeline, store, record: dict) -> list[tuple[str, dict]]:
    """The gated metrics (ungated: the eval stages') across the last `gate.trend_runs` runs of the series, this one last."""
    metrics = gate.metrics_of(record)
    names = list(gate.gated(stages.cfg.gate.thresholds, metrics)) or [k for k in metrics if _charted(stages, k)]
    earlier = [r for r in gate.series(store, record) if r["name"] != record["name"]]
    return gate.trend([*earlier, record][-stages.cfg.gate.trend_runs :], names)


def _charted(stages: Pipeline, key: str) -> bool:
    """A `{stage}.{metric}` its kind charts across runs when no gate names what to chart."""
    stage, _, metric = key.partition(".")
    return any(fnmatch(metric, pattern) for pattern in stages[stage].spec.trend)


def _write_report(stages: Pipeline, rows: list[dict], trend: list[tuple[str, dict]], verdict: str) -> str:
    """`{store.root}/_reports/<run name>.html`, linking each stage's report.html, with the trend across runs."""
    cfg = stages.cfg
    uri = f"{cfg.store.root.rstrip('/')}/{runs.REPORTS}/{runs.slug(flow_run.name or 'align')}.html"
    with fsspec.open(uri, "w", auto_mkdir=True, **options_for(uri, cfg)) as f:
        f.write(pipeline_report(f"align {stages.name}: {flow_run.name}", rows, trend, verdict))
    return uri
