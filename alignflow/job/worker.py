"""The one job entry point: set up the rank, run a stage, return its metrics.

Every rank checks its run's lease before it touches anything and then watches it: it stops
once the lease is held by a run that does not own the job, or released, and takes the
processes it started down with it, also when it is killed itself (`alignflow.orchestrator.orphans`). It
does not stop when its run dies: a rerun adopts it (`alignflow.orchestrator.lease`).

Runs inside a submitit job (local process or Slurm task). Never imports prefect. Each
rank gets the torch.distributed environment (MASTER_ADDR, RANK, WORLD_SIZE, LOCAL_RANK) from
submitit's job environment (on Slurm MASTER_ADDR is the job's first node) and MASTER_PORT from
its submission (`alignflow.orchestrator.launch.Attempt`); ranks on several nodes talk over the interface
that routes to rank 0's node;
with more than one rank the default process group is initialised here
(`alignflow.job.device.init_process_group`: gloo on CPU, nccl on this rank's GPU).
"""

import importlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import traceback
import warnings

import fsspec
import psutil
from omegaconf import DictConfig, OmegaConf

from alignflow.orchestrator.fingerprint import code_identity, package_versions
from alignflow.orchestrator.lease import holds, watch
from alignflow.orchestrator.orphans import reap_on_exit
from alignflow.orchestrator.kinds import AlignConfig, job_paths, user_imports, worker_module
from alignflow.job.usage import job_usage

FENCED_EXIT_CODE = 75  # EX_TEMPFAIL: the job was stopped because its run is gone; nothing of it is committed


# Library warnings that say nothing about the user's run, kept out of the Prefect logs.
EXPECTED_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # on CPU
    "Apex is not installed",  # idem
    "full scope is deprecated",  # Megatron's own TransformerConfig default
    "Please use DTensor instead and we are deprecating ShardedTensor",  # Megatron's torch_dist strategy
    "`load_state_dict` is deprecated",  # idem
)


def run_stage_job(
    kind: str, cfg: dict, inputs: dict, out: str, storage_options: dict, fence: dict | None = None, identity: dict | None = None
) -> dict:
    """Run `alignflow.job.stages.<kind>.run` on this rank; every rank returns its metrics, with
    the job's wall time, hardware and device-hours (`alignflow.job.usage`).

    `fence` is the lease of the run that submitted the job: the job starts only while that run
    or one that adopted the job holds it, and stops once neither does (`alignflow.orchestrator.lease`).
    `identity` is what the run fingerprinted (`alignflow.orchestrator.fingerprint`): the job refuses to run
    other code (the checkout or the user's reward module changed in between, or another one is
    on this job's Python path) or under other versions of the numeric packages (a Slurm job may
    run in another environment), before it reads or writes anything. Both are None only for a
    job submitted by hand (tests), outside any run."""
    reap_on_exit()  # a killed job leaves none of its helpers (Megatron's checkpoint writer) behind
    rank = _setup_rank()
    _log_to_stdout(rank)
    for message in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    _configure_storage(out, storage_options)
    if fence is not None:  # the lease is in the store, whose options are fsspec's defaults now
        _check_fence(fence)
    config = typed(cfg, kind)
    if identity is not None:
        _check_code(kind, config[kind], identity["code"])
        _check_packages(identity["packages"])
    module = importlib.import_module(worker_module(kind))
    logging.getLogger("alignflow.job.worker").debug("stage %s -> %s", kind, out)
    try:
        metrics = module.run(config, inputs, out)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        raise StageError(_cause_first(err, out)) from err
    sys.stdout.flush()
    return {**metrics, **job_usage(psutil.Process().create_time())}


class StageError(RuntimeError):
    """The stage's failure as an `Exception` (submitit records only those as a job's result),
    its first line the real cause."""


def _cause_first(err: BaseException, out: str) -> str:
    """The innermost exception line first (what a person must fix), then the exception itself;
    a full disk is said as such, with the path (torch reports one as "unexpected pos ...")."""
    text = "".join(traceback.format_exception_only(err)).strip()
    lines = [line.strip() for line in text.splitlines() if _EXCEPTION_LINE.match(line.strip())]
    cause = lines[-1] if lines else text.splitlines()[0]
    if (full := _full_disk(out)) is not None:
        cause = f"no space left on the device of {full}: " + cause
    return cause if cause == text else f"{cause}\n{text}"


_EXCEPTION_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Exit|Interrupt)\b(: .*)?$")


def _full_disk(out: str, reserve: int = 16 << 20) -> str | None:
    """The local folder whose filesystem has (almost) no space left, if `out` is on one."""
    if fsspec.core.split_protocol(out)[0] not in (None, "file", "local"):
        return None
    path = out.removeprefix("file://")
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path if path and shutil.disk_usage(path).free < reserve else None


def typed(cfg: dict, kind: str | None = None) -> DictConfig:
    """The job's config slice typed by the schema (enums intact) and read-only; secrets are still
    `${oc.env:...}` here and resolve from this job's environment. With `kind`, only the paths the
    kind declares are there (`alignflow.orchestrator.kinds.job_paths`, schema defaults filled in) and reading
    any other raises (OmegaConf's ConfigAttributeError, naming the key); without, every section."""
    config = OmegaConf.merge(OmegaConf.structured(AlignConfig), cfg)
    if kind is not None:
        declared: dict = {}
        for path in job_paths(kind):
            *parents, key = path.split(".")
            target = declared
            for part in parents:
                target = target.setdefault(part, {})
            target[key] = OmegaConf.select(config, path)
        config = OmegaConf.create(declared, flags={"struct": True})
    OmegaConf.set_readonly(config, True)
    return config


def _check_code(stage: str, section: DictConfig, planned: dict) -> None:
    """The code this job imports, alignflow's and the user code its config names, must be the
    code its run fingerprinted."""
    here = code_identity(worker_module(stage), user_imports(stage, section))
    changed = [
        f"{path}: {_CODE_CHANGE[path in planned, path in here]}"
        for path in sorted(planned.keys() | here.keys())
        if planned.get(path) != here.get(path)
    ]
    if changed:
        raise RuntimeError(
            f"the code of stage {stage} changed since its run fingerprinted it ({'; '.join(changed)}): run the "
            "pipeline again so its fingerprint covers the code that runs (a job imports user code from its own "
            "Python path: PYTHONPATH, launcher.setup)"
        )


_CODE_CHANGE = {(True, True): "changed", (True, False): "not found here", (False, True): "new here"}


def _check_packages(planned: dict) -> None:
    """The packages its run fingerprinted (the numeric ones, and its kind's) must be those versions here."""
    here = package_versions(tuple(planned))
    differ = [
        f"{name} {here.get(name)} here, {planned.get(name)} in the run"
        for name in sorted(planned.keys() | here.keys())
        if here.get(name) != planned.get(name)
    ]
    if differ:
        raise RuntimeError(
            f"this job runs under other package versions than its run fingerprinted ({'; '.join(differ)}): install "
            "the run's versions in the job's environment (launcher.setup, launcher.container_image) or run the "
            "pipeline from an environment with the job's versions, so that the fingerprint names what computes the output"
        )


def _check_fence(fence: dict) -> None:
    """Touch nothing unless this job's run (or a run that adopted it) holds the lease: a queued
    job of a dead run may start long after another run took over. Then watch it."""
    import submitit

    job_id = submitit.JobEnvironment().job_id
    if (reason := holds(fence, job_id)) is not None:
        _stop_fenced_job(f"not starting: {reason}")
    watch(fence, job_id, _stop_fenced_job)


def _stop_fenced_job(reason: str) -> None:
    """Stop this rank now, and every process it started: another run owns this output."""
    logging.getLogger("alignflow.job.worker").error("stopping: %s", reason)
    sys.stdout.flush()
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(FENCED_EXIT_CODE)


def _configure_storage(out: str, storage_options: dict) -> None:
    """Make the store's options (endpoint, credentials from this job's env) fsspec's defaults
    for its protocol, so stages open any URI of the store with plain fsspec calls."""
    protocol = fsspec.core.split_protocol(out)[0]
    if protocol and storage_options:
        resolved = OmegaConf.to_container(OmegaConf.create(storage_options), resolve=True)
        fsspec.config.conf.setdefault(protocol, {}).update(resolved)


class JobRecords(logging.Formatter):
    """alignflow's records in the job log, one JSON object a line: rank, time, level, logger,
    message, and the record's `event` where it has one (`extra={"event": {...}}`: a training
    step's `step`/`total`/`loss`, prep's `percent`, a `link`), which the orchestrator reads
    as data (`job_record`), never out of the message's text. Submitit's lines, library
    warnings and prints stay plain text beside them."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        line = {"rank": self.rank, "time": self.formatTime(record), "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        return json.dumps(line | ({"event": record.event} if hasattr(record, "event") else {}))


def job_record(line: str) -> dict | None:
    """One of alignflow's records in a job log line, or None for any other line."""
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and str(record.get("logger", "")).startswith("alignflow") else None


def _log_to_stdout(rank: int) -> None:
    """alignflow's loggers to stdout with the rank, which the orchestrator forwards to Prefect."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JobRecords(rank))
    logger = logging.getLogger("alignflow")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG)


def _talk_by_the_route_to(master: str) -> None:
    """gloo and nccl bind the address of this node by which it reaches rank 0's (unless the user
    named an interface): left to themselves they take whatever the node's hostname resolves to,
    which may be loopback or a network the other nodes cannot reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, 9))  # UDP: nothing is sent, the kernel only picks the route and source address
        address = probe.getsockname()[0]
    interface = next((name for name, addresses in psutil.net_if_addrs().items() if any(a.address == address for a in addresses)), None)
    if interface is None:
        raise RuntimeError(f"no network interface of node {socket.gethostname()} has {address}, its address towards rank 0's node {master}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def _share_the_cores(local_ranks: int) -> None:
    """The ranks of a node share its cores, as torchrun has them do, instead of each computing on
    all of them (2 ranks on 2 cores then took 2-3x as long a step: bench/memory.py); a user's
    OMP_NUM_THREADS stays. Set before the stage's first op: torch sizes its pool then."""
    if local_ranks <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(len(os.sched_getaffinity(0)) // local_ranks, 1)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for torch if it is imported later, and what the rank starts
    if (torch := sys.modules.get("torch")) is not None:
        torch.set_num_threads(threads)


def _setup_rank() -> int:
    import submitit

    try:
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    except RuntimeError:  # not inside a submitit job (e.g. called directly in a test)
        return int(os.environ.get("RANK", 0))
    _share_the_cores(env.local_world_size)
    if env.world_size > env.local_world_size:  # ranks on other nodes too
        _talk_by_the_route_to(env.master_addr)
    if env.world_size > 1:
        from alignflow.job.device import init_process_group

        init_process_group()
    return env.rank
