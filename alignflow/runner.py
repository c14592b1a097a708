"""The stage runner: fingerprint -> cache check -> lease -> submit job -> commit.

Orchestrator side (no torch, no prefect): the Prefect task in `tasks/` is a thin adapter
around `run_stage`, and `align plan` uses `plan` to show the same decisions without
running anything.
"""

import logging
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from alignflow import __version__
from alignflow.config.slices import for_job, identity, masked, stage_paths
from alignflow.fingerprint import fingerprint, source_identity
from alignflow.launch import job_record, submit, wait
from alignflow.stages import STAGES, as_names
from alignflow.store import Store, options_for, store_of
from alignflow.worker import run_stage_job

_VERSIONED_PACKAGES = ("torch", "megatron-core", "transformers", "tokenizers", "pyarrow", "submitit")
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


def stage_fingerprint(cfg: DictConfig, stage: str, upstream: dict[str, str]) -> str:
    """Identity of `stage` given its upstream stages' fingerprints (name -> fingerprint)."""
    spec = STAGES[stage]
    sources = {}
    for path in spec.sources:
        uri = OmegaConf.select(cfg, path)
        if uri is not None:
            sources[path] = source_identity(uri, options_for(uri, cfg))
    return fingerprint(stage, spec.version, identity(cfg, stage_paths(stage, spec.reads)), sources, upstream)


def plan(cfg: DictConfig) -> list[PlannedStage]:
    """Every stage of the pipeline with its fingerprint, output URI and what a run would do."""
    store, fps, planned = store_of(cfg), {}, []
    for stage, inputs in cfg.pipeline.stages.items():
        upstream = {name: fps[name] for role in (inputs or {}) for name in as_names(inputs[role])}
        fps[stage] = fp = stage_fingerprint(cfg, stage, upstream)
        uri = store.uri(store.output_path(stage, fp))
        if stage in cfg.force:
            status, reason = "forced", "listed in force"
        elif store.read_manifest(stage, fp) is not None:
            status, reason = "committed", "output committed: cache hit, no job"
        else:
            status, reason = "run", "no committed output for this fingerprint"
        planned.append(PlannedStage(stage, fp, uri, status, reason))
    return planned


def run_stage(cfg: DictConfig, stage: str, upstream: dict[str, StageResult], log: Callable[[str], None] = _log.info) -> StageResult:
    """Produce `stage`'s output, or return the committed one (a cache hit submits no job)."""
    spec, store = STAGES[stage], store_of(cfg)
    fp = stage_fingerprint(cfg, stage, {name: r.fingerprint for name, r in upstream.items()})
    forced = stage in cfg.force
    if not forced and (manifest := store.read_manifest(stage, fp)) is not None:
        log(f"{stage} {fp}: cache hit at {store.uri(store.output_path(stage, fp))}")
        return _result(store, stage, fp, manifest, cached=True)
    with store.lease(stage, fp, cfg.store.lease_ttl_s, cfg.store.poll_interval_s, log, take_committed=not forced) as acquired:
        manifest = store.read_manifest(stage, fp)
        if not acquired or (manifest is not None and not forced):
            log(f"{stage} {fp}: committed by a concurrent run")
            return _result(store, stage, fp, manifest, cached=True)
        if forced or not spec.resumable:
            store.clear_staging(stage, fp)
        return _execute(cfg, store, stage, fp, upstream, log)


def _execute(cfg: DictConfig, store: Store, stage: str, fp: str, upstream: dict[str, StageResult], log: Callable[[str], None]) -> StageResult:
    spec, started = STAGES[stage], time.time()
    inputs = _input_uris(cfg, stage, upstream)
    staging = store.uri(store.staging_path(stage, fp))
    store.fs.makedirs(store.staging_path(stage, fp), exist_ok=True)
    paths = (*stage_paths(stage, spec.reads), *spec.context)
    storage_options = for_job(cfg, ("store.storage_options",))["store"]["storage_options"]
    job = submit(cfg.launcher, cfg[stage], f"{stage}-{fp}", run_stage_job, stage, for_job(cfg, paths), inputs, staging,
                 storage_options, resumable=spec.resumable)
    record = job_record(job)
    log(f"{stage} {fp}: submitted {record.launcher} job {record.job_id}; stdout {record.stdout}; stderr {record.stderr}")
    metrics = wait(job, log, poll_s=min(cfg.store.poll_interval_s, 1.0), record=record)
    manifest = {
        "stage": stage,
        "fingerprint": fp,
        "version": spec.version,
        "metrics": metrics,
        "config": masked(cfg, paths),
        "inputs": {name: {"uri": r.uri, "fingerprint": r.fingerprint} for name, r in upstream.items()},
        "input_roles": inputs,
        "versions": _versions(),
        "job": asdict(record),
        "seconds": round(time.time() - started, 3),
        "files": store.staged_files(stage, fp),
        "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    uri = store.commit(stage, fp, manifest)
    log(f"{stage} {fp}: committed {uri}")
    return _result(store, stage, fp, manifest, cached=False)


def _input_uris(cfg: DictConfig, stage: str, upstream: dict[str, StageResult]) -> dict:
    """Role -> URI (or list of URIs) as the pipeline wires it."""
    wiring = cfg.pipeline.stages[stage] or {}
    return {role: upstream[names].uri if isinstance(names, str) else [upstream[n].uri for n in names] for role, names in wiring.items()}


def _result(store: Store, stage: str, fp: str, manifest: dict, cached: bool) -> StageResult:
    return StageResult(stage, fp, store.uri(store.output_path(stage, fp)), manifest.get("metrics", {}), cached, manifest.get("job"))


def _versions() -> dict:
    found = {"alignflow": __version__}
    for package in _VERSIONED_PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found
