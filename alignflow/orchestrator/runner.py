"""The stage runner: fingerprint -> cache check -> lease -> submit job -> commit, per stage
instance of a `Pipeline` (its name is its store prefix: `{root}/{name}/{fingerprint}`).

Orchestrator side (no torch, no prefect): the Prefect task in `tasks/` is a thin adapter
around `run_stage`, and `align plan` uses `plan` to show the same decisions without
running anything.
"""

import logging
import time
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatch
from typing import Callable

import submitit
from fsspec.implementations.local import LocalFileSystem
from omegaconf import OmegaConf

from alignflow import __version__
from alignflow.orchestrator import cost
from alignflow.orchestrator.config.slices import for_job, identity, masked, stage_paths
from alignflow.orchestrator.fingerprint import NUMERIC_PACKAGES, code_identity, differences, digest, fingerprint, package_versions, source_identity
from alignflow.orchestrator.launch import JobError, JobRecord, adoptable, job_record, reattach, stop, submit, time_limit, wait
from alignflow.orchestrator.lease import Lease
from alignflow.orchestrator.pipeline import Pipeline, Stage
from alignflow.orchestrator.report import REPORT, read_metrics, stage_report
from alignflow.job.train.utilization import HARDWARE_METRICS
from alignflow.orchestrator.kinds import OUTPUTS, job_paths, user_imports, worker_module
from alignflow.orchestrator.store import TRAINING_STATE, Store, options_for, store_of
from alignflow.job.worker import run_stage_job

_RECORDED_PACKAGES = ("torch", "megatron-core", "transformers", "tokenizers", "pyarrow", "submitit")
_log = logging.getLogger("alignflow.orchestrator.runner")


@dataclass
class StageResult:
    """The small record a Prefect task returns: where the output is and what it measured."""

    stage: str
    fingerprint: str
    uri: str
    metrics: dict = field(default_factory=dict)
    cached: bool = False
    job: dict | None = None


@dataclass
class PlannedStage:
    stage: str
    kind: str
    fingerprint: str
    uri: str
    status: str  # "committed", "run", "forced"
    reason: str


def stage_identity(stage: Stage, upstream: dict[str, str]) -> dict:
    """What makes `stage`'s output what it is (`alignflow.orchestrator.fingerprint`), given its upstream
    stages' fingerprints (name -> fingerprint)."""
    spec, cfg = stage.spec, stage.cfg
    sources = {}
    for path in spec.sources:
        uri = OmegaConf.select(cfg, path)
        if uri is not None:
            sources[path] = digest(source_identity(uri, options_for(uri, cfg)))
    for uri in spec.source_files(stage.section):
        sources[uri] = digest(source_identity(uri, options_for(uri, cfg)))
    return {
        "kind": stage.kind,
        "code": code_identity(worker_module(stage.kind), user_imports(stage.kind, stage.section)),
        "packages": package_versions((*NUMERIC_PACKAGES, *spec.packages)),
        "config": identity(cfg, stage_paths(stage.kind, spec.reads)),
        "sources": sources,
        "inputs": _by_role(stage, upstream),
    }


def plan(pipeline: Pipeline) -> list[PlannedStage]:
    """Every stage of the pipeline with its fingerprint, output URI and what a run would do, and why."""
    fps, planned = {}, []
    for stage in pipeline:
        store, ident = store_of(stage.cfg), stage_identity(stage, fps)
        fps[stage.name] = fp = fingerprint(ident)
        uri = store.uri(store.output_path(stage.name, fp))
        if stage.name in stage.cfg.force:
            status, reason = "forced", "listed in force"
        elif store.read_manifest(stage.name, fp) is not None:
            status, reason = "committed", "output committed: cache hit, no job"
        else:
            status, reason = "run", _why_not_committed(store, stage.name, ident)
        planned.append(PlannedStage(stage.name, stage.kind, fp, uri, status, reason))
    return planned


def _why_not_committed(store: Store, name: str, ident: dict) -> str:
    previous = store.latest_manifest(name)
    if previous is None or "identity" not in previous:
        return f"no committed output of {name} yet"
    changes = differences(ident, previous["identity"])
    return f"since {previous['fingerprint']}: " + "; ".join(changes or ["(no difference recorded)"])


def run_stage(
    stage: Stage, upstream: dict[str, StageResult], log: Callable[[str], None] = _log.info, output: Callable[[str], None] | None = None
) -> StageResult:
    """Produce `stage`'s output, or return the committed one (a cache hit submits no job).
    `log` gets what the runner does, `output` the job's output (default: `log`)."""
    store, cfg, name = store_of(stage.cfg), stage.cfg, stage.name
    ident = stage_identity(stage, {up: r.fingerprint for up, r in upstream.items()})
    fp = fingerprint(ident)
    forced = name in cfg.force
    if not forced and (manifest := store.read_manifest(name, fp)) is not None:
        log(f"{name} {fp}: cache hit at {store.uri(store.output_path(name, fp))}")
        return _result(store, name, fp, manifest, cached=True)
    adopt = None if forced else adoptable  # a forced re-run computes afresh: it stops a dead run's job instead
    with store.lease(name, fp, cfg.store.lease_ttl_s, cfg.store.poll_interval_s, log, take_committed=not forced, adopt=adopt) as lease:
        manifest = store.read_manifest(name, fp)
        if lease is None or (manifest is not None and not forced):
            log(f"{name} {fp}: committed by a concurrent run")
            return _result(store, name, fp, manifest, cached=True)
        return _execute(stage, store, ident, upstream, lease, log, output or log)


def _execute(
    stage: Stage, store: Store, ident: dict, upstream: dict[str, StageResult], lease: Lease, log: Callable[[str], None], output: Callable[[str], None]
) -> StageResult:
    spec, cfg, name, started, fp = stage.spec, stage.cfg, stage.name, time.time(), fingerprint(ident)
    inputs = _by_role(stage, {up: r.uri for up, r in upstream.items()})
    staging = store.uri(store.staging_path(name, fp))
    paths = job_paths(stage.kind)
    job, record, fresh = _start_or_adopt(stage, store, ident, inputs, paths, lease, log)
    try:
        metrics = wait(job, log, poll_s=min(cfg.store.poll_interval_s, 1.0), record=record, output=output, from_start=fresh)
    except JobError:
        raise
    except Exception:  # not the job's failure: it runs on, and a rerun adopts it
        lease.abandon()
        log(f"{name} {fp}: stopped waiting for job {record.job_id}, which runs on: a rerun of the pipeline carries on with it")
        raise
    summary = {"stage": name, "kind": stage.kind, "fingerprint": fp, "metrics": headline_first(metrics, spec.headline), "config": masked(cfg, paths)}
    records = read_metrics(staging, options_for(staging, cfg))  # a training stage's curves
    table = spec.table(metrics)  # the kind's own table of its output
    if records or table is not None or any(k in metrics for k in HARDWARE_METRICS):  # training, forward and tabled stages: a report beside the output
        store.fs.pipe(f"{store.staging_path(name, fp)}/{REPORT}", stage_report(name, summary, records, table).encode())
    kept, leave_out = store.committed_checkpoint(name, fp, keep_latest=keeps_optimizer(stage))  # IncompleteOutput: not retried
    manifest = {
        **summary,
        "identity": ident,
        "inputs": {up: {"uri": r.uri, "fingerprint": r.fingerprint} for up, r in upstream.items()},
        "input_roles": inputs,
        "versions": {"alignflow": __version__, **package_versions(_RECORDED_PACKAGES)},
        "job": asdict(record),
        "seconds": round(time.time() - started, 3),
        "files": store.staged_files(name, fp, leave_out),
        "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    } | ({TRAINING_STATE: kept} if kept else {})
    lease.check()  # a run whose lease was taken over commits nothing
    uri = store.commit(name, fp, manifest, OUTPUTS[spec.output], leave_out)  # IncompleteOutput: the stage's bug or the disk's, not retried
    log(f"{name} {fp}: committed {uri}")
    try:
        cost.record(store, stage, manifest)  # the store's throughput table, which `align plan` predicts from
    except (OSError, ValueError) as err:  # the output is committed all the same; only a prediction will know less
        log(f"{name} {fp}: its row of {store.uri(store.path(cost.COMPUTE))} was not written: {err}")
    return _result(store, name, fp, manifest, cached=False)


def _start_or_adopt(
    stage: Stage, store: Store, ident: dict, inputs: dict, paths: tuple, lease: Lease, log: Callable[[str], None]
) -> tuple[submitit.Job, JobRecord, bool]:
    """The stage's job: the one a dead run left running (adopted with its lease), or a new one,
    recorded beside the lease so that a rerun can adopt it in turn. A dead run's job that is
    not adopted is stopped first: two jobs never share a staging folder."""
    cfg, name, fp = stage.cfg, stage.name, fingerprint(ident)
    if lease.adopted is not None:
        record = JobRecord(**lease.adopted["job"])
        log(f"{name} {fp}: carrying on with {record.launcher} job {record.job_id} of a run that is gone, log {record.stdout}")
        return reattach(lease.adopted["job"]), record, False
    if lease.previous is not None and not stop(lease.previous["job"]):
        time.sleep(lease.ttl_s / 4)  # out of reach from here: it stops itself once it sees the lease is not its run's
    if name in cfg.force or not stage.spec.resumable:
        store.clear_staging(name, fp)
    store.fs.makedirs(store.staging_path(name, fp), exist_ok=True)
    storage_options = for_job(cfg, ("store.storage_options",))["store"]["storage_options"]
    job = submit(
        cfg.launcher,
        stage.section,
        f"{name}-{fp}",
        run_stage_job,
        stage.kind,
        for_job(cfg, paths),
        inputs,
        store.uri(store.staging_path(name, fp)),
        storage_options,
        lease.fence(),
        ident,
        resumable=stage.spec.resumable,
        shared=(store.staging_path(name, fp),) if isinstance(store.fs, LocalFileSystem) else (),
    )
    record = job_record(job, time_limit(cfg.launcher, stage.section))
    lease.record_job(asdict(record))
    log(f"{name} {fp}: submitted {record.launcher} job {record.job_id}, log {record.stdout}")
    return job, record, True


def keeps_optimizer(stage: Stage) -> bool:
    """Whether `stage`'s commit keeps its final training checkpoint (`checkpoint.keep_optimizer`)."""
    return stage.spec.resumable and stage.section.checkpoint.keep_optimizer


def headline_first(metrics: dict, headline: tuple[str, ...]) -> dict:
    """The metrics with the kind's headline ones first (fnmatch patterns, in their order)."""
    lead = [k for pattern in headline for k in metrics if fnmatch(k, pattern)]
    return {k: metrics[k] for k in lead} | metrics


def _by_role(stage: Stage, by_name: dict) -> dict:
    """Role -> the upstream value (fingerprint, URI) of the stage(s) the pipeline wires to it."""
    return {role: by_name[names] if isinstance(names, str) else [by_name[n] for n in names] for role, names in stage.inputs.items()}


def _result(store: Store, stage: str, fp: str, manifest: dict, cached: bool) -> StageResult:
    return StageResult(stage, fp, store.uri(store.output_path(stage, fp)), manifest.get("metrics", {}), cached, manifest.get("job"))
