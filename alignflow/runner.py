"""The stage runner: fingerprint -> cache check -> lease -> submit job -> commit.

Orchestrator side (no torch, no prefect): the Prefect task in `tasks/` is a thin adapter
around `run_stage`, and `align plan` uses `plan` to show the same decisions without
running anything.
"""

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from alignflow import __version__
from alignflow.config.slices import for_job, identity, masked, stage_paths
from alignflow.fingerprint import code_identity, differences, digest, fingerprint, package_versions, source_identity
from alignflow.launch import job_record, submit, wait
from alignflow.lease import Lease
from alignflow.stages import STAGES, worker_module
from alignflow.store import Store, options_for, store_of
from alignflow.worker import run_stage_job

_RECORDED_PACKAGES = ("torch", "megatron-core", "transformers", "tokenizers", "pyarrow", "submitit")
_log = logging.getLogger("alignflow.runner")


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
    fingerprint: str
    uri: str
    status: str  # "committed", "run", "forced"
    reason: str


def stage_identity(cfg: DictConfig, stage: str, upstream: dict[str, str]) -> dict:
    """What makes `stage`'s output what it is (`alignflow.fingerprint`), given its upstream
    stages' fingerprints (name -> fingerprint)."""
    spec = STAGES[stage]
    sources = {}
    for path in spec.sources:
        uri = OmegaConf.select(cfg, path)
        if uri is not None:
            sources[path] = digest(source_identity(uri, options_for(uri, cfg)))
    return {
        "kind": stage,
        "code": code_identity(worker_module(stage)),
        "packages": package_versions(),
        "config": identity(cfg, stage_paths(stage, spec.reads)),
        "sources": sources,
        "inputs": _by_role(cfg, stage, upstream),
    }


def stage_fingerprint(cfg: DictConfig, stage: str, upstream: dict[str, str]) -> str:
    return fingerprint(stage_identity(cfg, stage, upstream))


def plan(cfg: DictConfig) -> list[PlannedStage]:
    """Every stage of the pipeline with its fingerprint, output URI and what a run would do, and why."""
    store, fps, planned = store_of(cfg), {}, []
    for stage in cfg.pipeline.stages:
        ident = stage_identity(cfg, stage, fps)
        fps[stage] = fp = fingerprint(ident)
        uri = store.uri(store.output_path(stage, fp))
        if stage in cfg.force:
            status, reason = "forced", "listed in force"
        elif store.read_manifest(stage, fp) is not None:
            status, reason = "committed", "output committed: cache hit, no job"
        else:
            status, reason = "run", _why_not_committed(store, stage, ident)
        planned.append(PlannedStage(stage, fp, uri, status, reason))
    return planned


def _why_not_committed(store: Store, stage: str, ident: dict) -> str:
    previous = store.latest_manifest(stage)
    if previous is None or "identity" not in previous:
        return f"no committed output of {stage} yet"
    changes = differences(ident, previous["identity"])
    return f"since {previous['fingerprint']}: " + "; ".join(changes or ["(no difference recorded)"])


def run_stage(cfg: DictConfig, stage: str, upstream: dict[str, StageResult], log: Callable[[str], None] = _log.info) -> StageResult:
    """Produce `stage`'s output, or return the committed one (a cache hit submits no job)."""
    spec, store = STAGES[stage], store_of(cfg)
    ident = stage_identity(cfg, stage, {name: r.fingerprint for name, r in upstream.items()})
    fp = fingerprint(ident)
    forced = stage in cfg.force
    if not forced and (manifest := store.read_manifest(stage, fp)) is not None:
        log(f"{stage} {fp}: cache hit at {store.uri(store.output_path(stage, fp))}")
        return _result(store, stage, fp, manifest, cached=True)
    with store.lease(stage, fp, cfg.store.lease_ttl_s, cfg.store.poll_interval_s, log, take_committed=not forced) as lease:
        manifest = store.read_manifest(stage, fp)
        if lease is None or (manifest is not None and not forced):
            log(f"{stage} {fp}: committed by a concurrent run")
            return _result(store, stage, fp, manifest, cached=True)
        if forced or not spec.resumable:
            store.clear_staging(stage, fp)
        return _execute(cfg, store, stage, ident, upstream, lease, log)


def _execute(cfg: DictConfig, store: Store, stage: str, ident: dict, upstream: dict[str, StageResult], lease: Lease,
             log: Callable[[str], None]) -> StageResult:
    spec, started, fp = STAGES[stage], time.time(), fingerprint(ident)
    inputs = _by_role(cfg, stage, {name: r.uri for name, r in upstream.items()})
    staging = store.uri(store.staging_path(stage, fp))
    store.fs.makedirs(store.staging_path(stage, fp), exist_ok=True)
    paths = (*stage_paths(stage, spec.reads), *spec.context)
    storage_options = for_job(cfg, ("store.storage_options",))["store"]["storage_options"]
    job = submit(cfg.launcher, cfg[stage], f"{stage}-{fp}", run_stage_job, stage, for_job(cfg, paths), inputs, staging,
                 storage_options, lease.fence(), ident["code"], resumable=spec.resumable)
    record = job_record(job)
    log(f"{stage} {fp}: submitted {record.launcher} job {record.job_id}; stdout {record.stdout}; stderr {record.stderr}")
    metrics = wait(job, log, poll_s=min(cfg.store.poll_interval_s, 1.0), record=record)
    manifest = {
        "stage": stage,
        "fingerprint": fp,
        "metrics": metrics,
        "identity": ident,
        "config": masked(cfg, paths),
        "inputs": {name: {"uri": r.uri, "fingerprint": r.fingerprint} for name, r in upstream.items()},
        "input_roles": inputs,
        "versions": {"alignflow": __version__, **package_versions(_RECORDED_PACKAGES)},
        "job": asdict(record),
        "seconds": round(time.time() - started, 3),
        "files": store.staged_files(stage, fp),
        "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    lease.check()  # a run whose lease was taken over commits nothing
    uri = store.commit(stage, fp, manifest)
    log(f"{stage} {fp}: committed {uri}")
    return _result(store, stage, fp, manifest, cached=False)


def _by_role(cfg: DictConfig, stage: str, by_name: dict) -> dict:
    """Role -> the upstream value (fingerprint, URI) of the stage(s) the pipeline wires to it."""
    wiring = cfg.pipeline.stages[stage] or {}
    return {role: by_name[names] if isinstance(names, str) else [by_name[n] for n in names] for role, names in wiring.items()}


def _result(store: Store, stage: str, fp: str, manifest: dict, cached: bool) -> StageResult:
    return StageResult(stage, fp, store.uri(store.output_path(stage, fp)), manifest.get("metrics", {}), cached, manifest.get("job"))
