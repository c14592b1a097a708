"""Submit a stage's job with submitit and wait for it, streaming its log and its state.

`launcher=local` runs the ranks as local processes (submitit's LocalExecutor);
`launcher=slurm` runs them as the tasks of one sbatch job. Either way each rank gets the
torch.distributed environment from `alignflow.job.worker`, and job stdout/stderr are
forwarded line by line to the caller's logger (the Prefect run logger in a flow), with the
job's state transitions (PENDING -> RUNNING -> REQUEUED -> ... -> COMPLETED).

GPUs: every rank gets one GPU of its own. A job gets as many GPUs per node as it has ranks per
node (`resources.tasks_per_node`), out of `launcher.gpus_per_node`; each of its ranks sees all
of them and takes the one of its LOCAL_RANK (`alignflow.job.worker`), as torchrun and Megatron
expect (a rank that saw only its own GPU would keep NCCL from reaching its peers' memory by
CUDA IPC). Slurm is asked for them (`--gpus-per-node`) and sets CUDA_VISIBLE_DEVICES; a local
job's are this machine's first ones, found without torch (`local_gpus`).

Failures: a job that raised fails with the tail of its error (`StageFailed`, not retried);
a job that died without a result (killed, cancelled, node lost, out of requeues) is an
`InfrastructureError` and may be retried. Preemption and timeouts are handled by Slurm
requeue: the submitted callable is a submitit `Checkpointable` (`Attempt`) whose
`checkpoint()` resubmits itself, so a requeued training stage resumes from the latest
checkpoint in its output (the engine finds it; nothing is saved in the signal handler).

Cancellation: a cancelled flow run is told by SIGTERM, which Prefect turns into a
`TerminationSignal` in the main thread only, while stage tasks wait in worker threads.
`cancel_jobs_on_interrupt()` around the flow body therefore scancels every job submitted
under it (the tasks inherit its context), and the waiting threads then stop.
"""

import logging
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from itertools import takewhile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import psutil
import submitit
import submitit.local.local
from omegaconf import DictConfig

from alignflow.orchestrator.config.schema import LauncherConfig, LauncherName
from alignflow.orchestrator.cgroup import oom_kills
from alignflow.orchestrator.lease import this_process
from alignflow.orchestrator.orphans import end, reap_on_exit
from alignflow.orchestrator.warm_jobs import Controller, WarmLocalExecutor

ERROR_TAIL_LINES = 40
STATE_POLL_S = 2.0  # sacct at most this often per job: submitit's own watcher waits up to 600 s
SLURM_LOG_QUIET_S = 2.0  # a Slurm job's logs are complete once they stayed quiet this long after its end
# Rank 0's rendezvous port (torch.distributed's TCPStore) is below Linux's ephemeral range
# (32768-60999): a port there may be held by any client connection on the node, which makes the
# store's bind fail (EADDRINUSE); submitit's default draws from 20000-60000. A local job's is
# drawn free here; a Slurm job's follows from its id (`slurm_rendezvous_port`).
RENDEZVOUS_PORTS = (20000, 32767)
NOT_VISIBLE = "is not visible from node"  # the shared-path check's message (`_visible_on_every_node`)
NO_TIME_LIMIT_MIN = 60 * 24 * 365  # submitit's local jobs always have one
NOT_REQUEUED = "Job not requeued because"  # submitit's message when it gives up on a preempted/timed-out job

_log = logging.getLogger("alignflow.orchestrator.launch")


class JobError(RuntimeError):
    """A stage's job ended badly; `job` is its record (id, state, log paths) when known."""

    def __init__(self, message: str, job: dict | None = None):
        super().__init__(message)
        self.job = job


class StageFailed(JobError):
    """The stage's code raised: retrying will not help."""


class InfrastructureError(JobError):
    """The job died without a result (preemption, node loss, timeout, SIGKILL): retry."""


class JobCancelled(JobError):
    """The job was cancelled because its flow run was (SIGTERM, Ctrl-C): not retried."""


@dataclass
class JobRecord:
    """A submitted job as the manifest, the UI and the lease keep it: enough for a rerun to find
    it again (`reattach`) when the run that submitted it is gone."""

    job_id: str
    launcher: str
    stdout: str
    stderr: str
    state: str = "SUBMITTED"
    folder: str = ""  # submitit's job folder: pickles, logs, results
    tasks: int = 1
    process: list | None = None  # a local job's controller: [host, boot id, pid, start time]
    time_limit_min: float | None = None
    submitted: float = 0.0  # epoch seconds
    oom_kills: int | None = None  # the OOM killer's count in our memory cgroup when a local job started


# ----------------------------------------------------------------------------- submission

_SLURM_PARAMETERS = {  # submitit SlurmExecutor parameter (sbatch option) <- LauncherConfig key
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "cpus_per_task": "cpus_per_task",
}


def _slurm_parameters(launcher: LauncherConfig, resources: DictConfig, time_min: float) -> dict:
    """Our launcher keys -> submitit's SlurmExecutor parameters (sbatch's names), as data."""
    params = {name: getattr(launcher, key) for name, key in _SLURM_PARAMETERS.items()}
    params |= {
        "nodes": resources.nodes,
        "ntasks_per_node": resources.tasks_per_node,
        "gpus_per_node": resources.tasks_per_node if gpus_per_node(launcher) else None,  # one per rank
        "mem": f"{launcher.mem_gb}GB" if launcher.mem_gb else None,
        "time": math.ceil(time_min),
        "setup": list(launcher.setup) or None,
        "additional_parameters": dict(launcher.sbatch_extra) or None,
    }
    if launcher.container_image:
        mounts = f" --container-mounts={launcher.container_mounts}" if launcher.container_mounts else ""
        params["srun_args"] = [f"--container-image={launcher.container_image}{mounts}"]
    return {k: v for k, v in params.items() if v is not None}


def make_executor(launcher: LauncherConfig, section: DictConfig, job_name: str, shared: tuple[str, ...] = (), devices: str = "") -> submitit.Executor:
    """A fresh submitit folder per submission, so no run reads another's pickles. A Slurm job
    first checks on each of its nodes that it sees that folder and `shared`. A local job on the
    CPU starts warm (`alignflow.orchestrator.warm_jobs`) unless `launcher.warm_start` is off;
    one with GPUs (`devices`) starts cold."""
    folder = Path(launcher.folder).absolute() / job_name / uuid.uuid4().hex[:12]
    limit = time_limit(launcher, section)
    if launcher.name == LauncherName.local:
        local = WarmLocalExecutor if launcher.warm_start and not devices else submitit.LocalExecutor
        executor = local(folder=folder, max_num_timeout=launcher.max_requeues)
        executor.update_parameters(
            nodes=1, tasks_per_node=section.resources.tasks_per_node, timeout_min=limit if limit is not None else NO_TIME_LIMIT_MIN
        )
    else:
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=launcher.max_requeues)
        params = _slurm_parameters(launcher, section.resources, limit)
        params["setup"] = [_visible_on_every_node(str(folder), *shared), *params.get("setup", ())]
        executor.update_parameters(job_name=job_name, **params)
    return executor


def _visible_on_every_node(*paths: str) -> str:
    """The batch script's line that fails the job unless every node of it sees `paths` (the job
    folder, the store's output folder), before any rank starts: a node's own copy of a
    node-local path (/tmp) would let the ranks there read nothing and write what neither the
    other nodes nor the submitting host see. Its message lands in rank 0's error log, which the
    batch script's node writes."""
    check = f'for p; do [ -e "$p" ] || {{ echo "$p {NOT_VISIBLE} $(hostname): it must be on a filesystem every node mounts" >&2; exit 1; }}; done'
    one_task_a_node = "--nodes=$SLURM_JOB_NUM_NODES --ntasks=$SLURM_JOB_NUM_NODES --ntasks-per-node=1 --cpus-per-task=1"
    return f"srun {one_task_a_node} /bin/sh -c {shlex.quote(check)} sh {shlex.join(paths)} || exit 1"


class Attempt(submitit.helpers.Checkpointable):
    """The submitted callable: `fn(*args)`, requeued at most `requeues` times on preemption or
    timeout (Slurm USR2). Only rank 0 runs `checkpoint()`; it resubmits this object with one
    requeue less, so the count survives requeues. A stage that cannot resume gets 0: it is not
    requeued but fails as an infrastructure error, and a retry starts it clean. `devices` is a
    local job's CUDA_VISIBLE_DEVICES (None on Slurm, which sets it); `master_port` a local job's
    rendezvous port (None on Slurm: `slurm_rendezvous_port`)."""

    def __init__(self, fn: Callable, requeues: int, master_port: int | None, devices: str | None = None):
        self.fn, self.requeues, self.master_port, self.devices = fn, requeues, master_port, devices

    def __call__(self, *args: Any) -> Any:
        port = self.master_port if self.master_port is not None else slurm_rendezvous_port(os.environ["SLURM_JOB_ID"])
        os.environ["MASTER_PORT"] = str(port)  # read by alignflow.job.worker's rank set-up
        if self.devices is not None:  # a local job's GPUs (`local_devices`): CUDA reads them at its first call, later
            os.environ["CUDA_VISIBLE_DEVICES"] = self.devices
        env = submitit.JobEnvironment()
        # A previous attempt of this job id may have left this rank's error result behind (a rank
        # != 0 whose peer left at the requeue): the orchestrator must not read it as this attempt's.
        env.paths.result_pickle.unlink(missing_ok=True)
        if env.global_rank != 0:
            _end_with_the_requeue()
        return self.fn(*args)

    def checkpoint(self, *args: Any) -> submitit.helpers.DelayedSubmission | None:
        if self.requeues <= 0:
            return None  # submitit: "Job not requeued because: checkpoint function returned None"
        return submitit.helpers.DelayedSubmission(Attempt(self.fn, self.requeues - 1, self.master_port, self.devices), *args)


def _end_with_the_requeue() -> None:
    """submitit makes every rank ignore SIGTERM, so after rank 0 has requeued the job the other
    ranks would linger until Slurm's KillWait (30 s or more) before the requeued attempt can
    start. Once the preemption signal has come, let the SIGTERM of the requeue end them."""
    preemption = getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG)
    submitit_handler = signal.getsignal(preemption)

    def on_preemption(signum, frame):
        signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
        if callable(submitit_handler):
            submitit_handler(signum, frame)

    signal.signal(preemption, on_preemption)


@dataclass
class _Scope:
    """The jobs submitted under one `cancel_jobs_on_interrupt` block, from any thread."""

    jobs: set = field(default_factory=set)
    cancelled: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Cancel every job, and wait (at most CANCEL_WAIT_S) until the local ones' processes are
        gone: a stopped `align run` leaves none behind."""
        with self.lock:
            self.cancelled.set()
            jobs = list(self.jobs)
        for job in jobs:
            job.cancel(check=False)
        _end_local(job for job in jobs if not isinstance(job, submitit.SlurmJob))


CANCEL_WAIT_S = 5.0


def _end_local(jobs: Iterable[submitit.Job]) -> None:
    """End cancelled local jobs' controllers and ranks within CANCEL_WAIT_S."""
    processes = []
    for job in jobs:
        try:
            controller = psutil.Process(int(job.job_id))
            processes += [controller, *controller.children(recursive=True)]
        except psutil.Error:
            continue
    end(processes, CANCEL_WAIT_S)


_scope: ContextVar[_Scope | None] = ContextVar("alignflow_launch_scope", default=None)


STOP_S = 9.0  # a stopped run has exited this long after the signal, whatever Prefect's API does
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def cancel_jobs_on_interrupt() -> Iterator[None]:
    """A deliberate stop cancels the jobs; a crash does not.

    Every job submitted in this block (by this thread or threads started with its context:
    Prefect tasks) is cancelled when the block ends by SIGINT (Ctrl-C), SIGTERM (a cancelled
    flow run, `kill`) or SIGHUP (a closed terminal), and the process exits within STOP_S
    seconds of the signal, even if what runs after it hangs (an unreachable Prefect API). A
    block that ends by an error, or a process that is killed (SIGKILL, the OOM killer, a lost
    machine), leaves its jobs running: a rerun adopts them (`alignflow.orchestrator.lease`). Signals reach
    the main thread only; outside it, this only tracks the jobs."""
    scope = _Scope()
    token = _scope.set(scope)
    previous = _on_stop_signals(scope)
    try:
        yield
    except Exception:
        raise
    except BaseException as stop:  # KeyboardInterrupt, Prefect's TerminationSignal, SystemExit
        signum = getattr(stop, "signal", None)  # Prefect's SIGTERM; the handlers below began the others' stop
        if signum is not None and not scope.cancelled.is_set():
            _begin_stop(scope, signum)
        scope.cancel()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _scope.reset(token)


def _on_stop_signals(scope: _Scope) -> dict:
    """Install the stop handlers (main thread only); returns the handlers they replace, which
    they call in turn: Python's SIGINT handler raises KeyboardInterrupt; SIGHUP, whose default
    would end the process on the spot, raises KeyboardInterrupt. A SIGTERM handler already in
    place stays: it is Prefect's, which raises TerminationSignal (ending the block, which then
    stops) and must stay installed for its runner's cancel to be acknowledged (a flow run
    cancelled from the UI would otherwise end Crashed)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    if callable(previous[signal.SIGTERM]):
        del previous[signal.SIGTERM]

    def stop(signum, frame):
        if not scope.cancelled.is_set():
            _begin_stop(scope, signum)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    for signum in previous:
        signal.signal(signum, stop)
    return previous


def _begin_stop(scope: _Scope, signum: int) -> None:
    """Cancel the scope's jobs now, and end the process STOP_S after the signal if it still runs."""
    deadline = time.monotonic() + STOP_S

    def stop() -> None:
        scope.cancel()
        time.sleep(max(deadline - time.monotonic(), 0.0))
        _log.warning("still running %.0f s after %s: exiting now (the jobs were cancelled)", STOP_S, signal.Signals(signum).name)
        os._exit(128 + signum)

    scope.cancelled.set()
    threading.Thread(target=stop, name="stop", daemon=True).start()


def submit(
    launcher: LauncherConfig, section: DictConfig, job_name: str, fn: Callable, *args: Any, resumable: bool = False, shared: tuple[str, ...] = ()
) -> submitit.Job:
    """Submit `fn(*args)` as `section`'s job; requeued on preemption/timeout only if `resumable`.
    `shared`: local paths every node of a Slurm job must see (`make_executor`).
    Local jobs end with this process, however it ends (`alignflow.orchestrator.orphans`)."""
    reap_on_exit()
    local = launcher.name == LauncherName.local
    devices = local_devices(launcher, section.resources.tasks_per_node) if local else None
    executor = make_executor(launcher, section, job_name, shared, devices or "")
    attempt = Attempt(fn, launcher.max_requeues if resumable else 0, rendezvous_port() if local else None, devices)
    scope = _scope.get()
    if scope is None:
        return executor.submit(attempt, *args)
    with scope.lock:
        if scope.cancelled.is_set():
            raise JobCancelled(f"{job_name}: not submitted, the flow run is being cancelled")
        job = executor.submit(attempt, *args)
        scope.jobs.add(job)
    return job


# ----------------------------------------------------------------------------- GPUs

PROC_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the NVIDIA driver has
# What CUDA takes in CUDA_VISIBLE_DEVICES: an index or a GPU/MIG UUID; it reads up to the first
# entry that is neither (`-1` hides every GPU).
CUDA_DEVICE = re.compile(r"\d+|(?:GPU|MIG)-[\w/-]+")
NVIDIA_SMI_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Gpus:
    """The GPUs local jobs can be given, as CUDA_VISIBLE_DEVICES names them, and where that
    was read (said in messages)."""

    ids: tuple[str, ...]
    source: str


def gpus_per_node(launcher: LauncherConfig) -> int:
    """`launcher.gpus_per_node`, null resolved: the GPUs of this machine for the local launcher,
    none for Slurm (the nodes are elsewhere)."""
    if launcher.gpus_per_node is not None:
        return launcher.gpus_per_node
    return len(local_gpus().ids) if launcher.name == LauncherName.local else 0


def local_devices(launcher: LauncherConfig, tasks: int) -> str:
    """A local job's CUDA_VISIBLE_DEVICES: this machine's first `tasks` GPUs, one per rank; ""
    (the CPU) when `launcher.gpus_per_node` is 0. Set by `Attempt` in each rank: submitit's own
    `visible_gpus` takes indices only, not the UUIDs a user or a MIG set-up may give."""
    return ",".join(local_gpus().ids[:tasks]) if gpus_per_node(launcher) > 0 else ""


def local_gpus(proc: Path = PROC_GPUS) -> Gpus:
    """This machine's GPUs, found without torch (the orchestrator never imports it): the
    CUDA_VISIBLE_DEVICES the user set, else those `nvidia-smi -L` lists, else the driver's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = (entry.strip() for entry in visible.split(","))
        return Gpus(tuple(takewhile(CUDA_DEVICE.fullmatch, entries)), f"CUDA_VISIBLE_DEVICES={visible!r}")
    listed = _nvidia_smi()
    if isinstance(listed, Gpus):
        return listed
    if proc.is_dir():
        return Gpus(tuple(str(i) for i in range(len(list(proc.iterdir())))), str(proc))
    return Gpus((), f"CUDA_VISIBLE_DEVICES is unset, {listed}, {proc} does not exist")


def _nvidia_smi() -> Gpus | str:
    """The GPUs `nvidia-smi -L` lists ("GPU 0: NVIDIA H100 ... (UUID: GPU-...)", MIG devices
    indented under theirs), or why it could not tell."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi is not on PATH"
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"nvidia-smi -L failed ({err})"
    if done.returncode != 0:
        return f"nvidia-smi -L failed (exit {done.returncode}: {(done.stdout + done.stderr).strip()[:200]})"
    count = sum(line.startswith("GPU ") for line in done.stdout.splitlines())
    return Gpus(tuple(str(i) for i in range(count)), "nvidia-smi -L")


def cpu_warning(launcher: LauncherConfig) -> str | None:
    """What to say when local jobs will run on the CPU of a machine that has GPUs."""
    if launcher.name != LauncherName.local or gpus_per_node(launcher) != 0:
        return None
    found = local_gpus()
    if not found.ids:
        return None
    return (
        f"launcher.gpus_per_node is 0: every stage's ranks run on the CPU, though this machine has {len(found.ids)} "
        f"GPU(s) ({found.source}); leave it unset (null) to give each rank one of them"
    )


def slurm_rendezvous_port(job_id: str) -> int:
    """A Slurm job's port in RENDEZVOUS_PORTS, from its id: its rank 0's node is known only once
    it runs, and jobs running on one node at once have ids apart by less than the range's size,
    so their ports differ; a requeued job keeps its id, hence its port."""
    low, high = RENDEZVOUS_PORTS
    return low + int(job_id) % (high - low + 1)


def rendezvous_port() -> int:
    """A local job's port: one in RENDEZVOUS_PORTS that is free here now."""
    for _ in range(100):
        port = random.randint(*RENDEZVOUS_PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {RENDEZVOUS_PORTS} for the job's rendezvous")


def job_record(job: submitit.Job, time_limit_min: float | None = None) -> JobRecord:
    launcher = LauncherName.slurm if isinstance(job, submitit.SlurmJob) else LauncherName.local
    local = launcher == LauncherName.local
    process = [*this_process()[:2], int(job.job_id), _started(job)] if local else None
    return JobRecord(
        str(job.job_id),
        launcher.value,
        str(job.paths.stdout),
        str(job.paths.stderr),
        folder=str(job.paths.folder),
        tasks=job.num_tasks,
        process=process,
        time_limit_min=time_limit_min,
        submitted=time.time(),
        oom_kills=oom_kills() if local else None,
    )


def _started(job: submitit.Job) -> float:
    """A local job's controller's start time (a warm one's as its server saw it: it may have ended already)."""
    controller = getattr(job, "_process", None)
    return controller.started if isinstance(controller, Controller) else psutil.Process(int(job.job_id)).create_time()


def time_limit(launcher: LauncherConfig, section: DictConfig) -> float | None:
    """A stage's job's time limit in minutes: its `timeout_min` (none by default for local jobs),
    and on Slurm at most `launcher.time_min`."""
    if launcher.name == LauncherName.local:
        return section.timeout_min
    return min(section.timeout_min or launcher.time_min, launcher.time_min)


# ----------------------------------------------------------------------------- a dead run's job

_SLURM_RUNNING = ("RUNNING", "COMPLETING", "CONFIGURING", "RESIZING", "SUSPENDED", "STOPPED")


def reattach(record: dict) -> submitit.Job | None:
    """The job of `record` (a `JobRecord` as a dict), submitted by a run that is gone, to wait
    on from here; None when this host cannot reach it (a local job of another machine)."""
    folder, job_id, tasks = record["folder"], str(record["job_id"]), list(range(record.get("tasks", 1)))
    if record["launcher"] == LauncherName.slurm.value:
        return submitit.SlurmJob(folder, job_id, tasks)
    host, boot, pid, started = record["process"]
    if (host, boot) != this_process()[:2]:
        return None
    return submitit.local.local.LocalJob(folder, job_id, tasks, process=Controller(pid, started, folder))


def adoptable(record: dict) -> bool:
    """Whether a rerun should carry on with a dead run's job rather than start another: it runs,
    or it ended with a result. A job still queued is cancelled instead: it would start for
    nobody (and if it starts anyway, it finds the lease is not its run's and touches nothing)."""
    job = reattach(record)
    if job is None:
        return False
    if job.paths.result_pickle.exists():
        return True
    if isinstance(job, submitit.SlurmJob):
        state = _slurm_state(job)
        if state in ("PENDING", "REQUEUED"):
            job.cancel(check=False)
        return state in _SLURM_RUNNING
    return not job.done()


def stop(record: dict, timeout_s: float = 30.0) -> bool:
    """Cancel a dead run's job that is not adopted, and wait until it is gone; False when this
    host cannot tell (the job then stops itself within a fraction of the lease's ttl: fencing)."""
    job = reattach(record)
    if job is None:
        return False
    if not job.done():
        job.cancel(check=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if isinstance(job, submitit.SlurmJob) and _slurm_state(job) not in ("", "PENDING", *_SLURM_RUNNING):
            return True
        if not isinstance(job, submitit.SlurmJob) and job.done():
            return True
        time.sleep(0.5)
    return False


def _slurm_state(job: submitit.SlurmJob) -> str:
    return (job.get_info(mode="force").get("State") or "").split(" ")[0]


# ----------------------------------------------------------------------------- waiting


def wait(
    job: submitit.Job,
    log: Callable[[str], None],
    poll_s: float = 1.0,
    record: JobRecord | None = None,
    output: Callable[[str], None] | None = None,
    from_start: bool = True,
) -> Any:
    """Block until the job ends, forwarding its state changes (kept in `record.state`) to `log`
    and rank 0's output to `output` (default: `log` too; an adopted job's from where it is now,
    `from_start=False`); returns rank 0's result.

    Only a deliberate stop ends the job with the wait: its flow run cancelled (the scope), or
    Ctrl-C in this thread. Nothing else does: `log` and `output` are dashboards, and a failing
    one is skipped; a failing state poll (sacct) is retried. Any other error leaves the job
    running, for a rerun to adopt.
    """
    record = record or job_record(job)
    log, output = _best_effort(log), _best_effort(output or log)
    tail, state, scope = _Tail(job, from_start), _State(job, record, log), _scope.get()
    if scope is not None:
        with scope.lock:
            scope.jobs.add(job)
    try:
        while not (cancelled := scope is not None and scope.cancelled.is_set()) and not state.done():
            tail.forward(output)
            time.sleep(poll_s)
        tail.drain(output, quiet_s=SLURM_LOG_QUIET_S if state.slurm else 0.0)  # a local job's files are complete at its exit
        if cancelled:  # the scope has cancelled the job: its end is no failure to retry
            state.cancel()
            raise JobCancelled(f"job {job.job_id} cancelled with its flow run", asdict(record))
        results = job.results()
        state.set("COMPLETED")  # every rank returned: Slurm's accounting may still say RUNNING for a while
        return results[0]
    except submitit.core.utils.FailedJobError as err:
        state.set("FAILED")
        if lost := _ranks_without_result(job):  # rank 0 raised because a peer was gone: retry, resuming from the checkpoint
            raise InfrastructureError(
                f"job {job.job_id} lost rank(s) {', '.join(map(str, lost))} (killed, or their node failed), then "
                f"rank 0 failed: {_cause(str(err))}\n{_last_lines(str(err))}",
                asdict(record),
            ) from None
        error = InfrastructureError if NOT_REQUEUED in str(err) else StageFailed
        raise error(f"job {job.job_id} failed: {_cause(str(err))}\n{_last_lines(str(err))}", asdict(record)) from None
    except submitit.core.utils.UncompletedJobError as err:
        state.ended_without_result()
        if not_visible := [line for line in str(err).splitlines() if NOT_VISIBLE in line]:  # no retry will see it either
            raise StageFailed(f"job {job.job_id}: {not_visible[0]}\n{_last_lines(str(err))}", asdict(record)) from None
        raise InfrastructureError(f"job {job.job_id} {state.ending()}:\n{_last_lines(str(err))}", asdict(record)) from None
    except Exception:
        raise
    except BaseException:  # Ctrl-C in this thread: a deliberate stop
        state.cancel()
        raise
    finally:
        if scope is not None:
            scope.jobs.discard(job)


def _ranks_without_result(job: submitit.Job) -> list[int]:
    """The ranks of an ended job that left no result: a rank that raised leaves its error, so
    these were killed (by a signal, the OOM killer, their node's loss), not failed by the code."""
    return [rank for rank in range(1, job.num_tasks) if not job.task(rank).paths.result_pickle.exists()]


def _best_effort(callback: Callable[[str], None]) -> Callable[[str], None]:
    """`callback`, whose failures (a dashboard that is down) are logged here once and skipped."""
    failing = []

    def call(line: str) -> None:
        try:
            callback(line)
            failing.clear()
        except Exception as err:  # noqa: BLE001 - a dashboard's failure must never reach the job
            if not failing:
                _log.warning("a log or progress update failed (%s: %s); the job goes on", type(err).__name__, err)
            failing.append(err)

    return call


class _State:
    """The job's state, logged when it changes: Slurm's (PENDING, RUNNING, REQUEUED, ...) while
    it runs, then its outcome. sacct is asked at most every STATE_POLL_S (submitit's watcher
    would wait up to 10 min), so a cancelled or killed job is noticed within seconds; `done()`
    then reads submitit's refreshed cache. A local job runs from its submission."""

    def __init__(self, job: submitit.Job, record: JobRecord, log: Callable[[str], None]):
        self.job, self.record, self.log = job, record, log
        self.slurm = isinstance(job, submitit.SlurmJob)
        self.polled, self.failures = 0.0, 0
        if not self.slurm:
            self.set("RUNNING")

    def update(self, force: bool = False) -> None:
        if self.slurm and (force or time.monotonic() - self.polled >= STATE_POLL_S):
            self.polled = time.monotonic()
            try:
                state = self.job.get_info(mode="force").get("State", "")  # one sacct call
            except Exception as err:  # noqa: BLE001 - sacct down for a moment: the job is not
                self.failures += 1
                if self.failures == 1:
                    self.log(f"job {self.job.job_id}: cannot read its state ({err}); retrying")
                return
            self.failures = 0
            if state:
                self.set(state.split()[0])  # "CANCELLED by 0" -> "CANCELLED"

    def set(self, state: str) -> None:
        if state != self.record.state:
            self.record.state = state
            self.log(f"job {self.job.job_id}: {state}")

    def done(self) -> bool:
        self.update()
        try:
            return self.job.done()
        except Exception:  # noqa: BLE001 - as in update: asked again at the next poll
            return False

    def cancel(self) -> None:
        if not self.job.done():
            self.job.cancel(check=False)
        self.set("CANCELLED")

    def ended_without_result(self) -> None:
        if self.slurm:
            self.update(force=True)  # CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, ...
        elif self.record.oom_kills is not None and (oom_kills() or 0) > self.record.oom_kills:
            self.set("OUT_OF_MEMORY")
        elif self.record.time_limit_min and time.time() - self.record.submitted >= 60 * self.record.time_limit_min - 1:
            self.set("TIMEOUT")
        else:
            self.set(self.job.state)

    def ending(self) -> str:
        """How the job ended, in words, with what to do where there is something to do."""
        return _ENDINGS.get(self.record.state, "ended without a result ({state})").format(state=self.record.state, limit=self.record.time_limit_min)


_ENDINGS = {  # a job's end without a result (Slurm's states; for local jobs, as judged by _State)
    "TIMEOUT": "was killed by its time limit ({limit} min): resumable stages resume from their last checkpoint on retry; "
    "give the stage more time (<stage>.timeout_min, launcher.time_min) or checkpoint more often",
    "OUT_OF_MEMORY": "was killed for running out of memory (OUT_OF_MEMORY): give it more (launcher.mem_gb) or need less "
    "(a smaller micro_batch_size, activation recompute, more ranks)",
    "NODE_FAIL": "lost its node (NODE_FAIL)",
    "PREEMPTED": "was preempted and not requeued (PREEMPTED)",
    "BOOT_FAIL": "could not start on its node (BOOT_FAIL)",
    "CANCELLED": "was cancelled outside alignflow (CANCELLED)",
}


def _cause(text: str) -> str:
    """The exception line of submitit's failure text (its trace sits between two dashed rules),
    to head the message: Prefect shows a failed task's first line."""
    lines = text.strip().splitlines()
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"-"}]
    trace = lines[rules[0] + 1 : rules[1]] if len(rules) >= 2 else lines
    return next((line for line in reversed(trace) if line.strip() and not line.startswith(" ")), "").strip()


def _last_lines(text: str, n: int = ERROR_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


class _Tail:
    """Forwards new lines of rank 0's stdout and stderr since the last call."""

    def __init__(self, job: submitit.Job, from_start: bool = True):
        self.paths = [job.paths.stdout, job.paths.stderr]
        self.offsets = {p: 0 if from_start or not p.exists() else p.stat().st_size for p in self.paths}
        self.partial = {p: "" for p in self.paths}

    def drain(self, log: Callable[[str], None], quiet_s: float, max_s: float = 10.0) -> None:
        """After the job ended: forward what is left, then the unterminated last lines too. On
        Slurm the result can land before the last output reaches the log files (the step
        daemon writes them when the step ends): forward until they stay quiet for `quiet_s`."""
        deadline = quiet_since = time.monotonic()
        deadline += max_s
        while True:
            if self.forward(log):
                quiet_since = time.monotonic()
            if time.monotonic() - quiet_since >= quiet_s or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        for path, rest in self.partial.items():
            if rest.strip():
                log(rest)
            self.partial[path] = ""

    def forward(self, log: Callable[[str], None]) -> bool:
        """Whether there was anything new."""
        new = False
        for path in self.paths:
            if not path.exists():
                continue
            with open(path, "r", errors="replace") as f:
                f.seek(self.offsets[path])
                chunk = f.read()
                self.offsets[path] = f.tell()
            new |= bool(chunk)
            lines = (self.partial[path] + chunk).split("\n")
            self.partial[path] = lines.pop()
            for line in lines:
                if line.strip():
                    log(line)
        return new
