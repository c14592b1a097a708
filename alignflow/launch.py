"""Submit a stage's job with submitit and wait for it, streaming its log and its state.

`launcher=local` runs the ranks as local processes (submitit's LocalExecutor);
`launcher=slurm` runs them as the tasks of one sbatch job. Either way each rank gets the
torch.distributed environment from `alignflow.worker`, and job stdout/stderr are
forwarded line by line to the caller's logger (the Prefect run logger in a flow), with the
job's state transitions (PENDING -> RUNNING -> REQUEUED -> ... -> COMPLETED).

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

import os
import random
import signal
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import submitit
from omegaconf import DictConfig

from alignflow.config.schema import LauncherConfig, LauncherName
from alignflow.orphans import reap_on_exit

ERROR_TAIL_LINES = 40
STATE_POLL_S = 2.0  # sacct at most this often per job: submitit's own watcher waits up to 600 s
SLURM_LOG_QUIET_S = 2.0  # a Slurm job's logs are complete once they stayed quiet this long after its end
# Rank 0's rendezvous port (torch.distributed's TCPStore) is drawn below Linux's ephemeral range
# (32768-60999): a port there may be held by any client connection on the node, which makes the
# store's bind fail (EADDRINUSE); submitit's default draws from 20000-60000.
RENDEZVOUS_PORTS = (20000, 32767)
NOT_REQUEUED = "Job not requeued because"  # submitit's message when it gives up on a preempted/timed-out job


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
    job_id: str
    launcher: str
    stdout: str
    stderr: str
    state: str = "SUBMITTED"


# ----------------------------------------------------------------------------- submission

_SLURM_PARAMETERS = {  # submitit SlurmExecutor parameter (sbatch option) <- LauncherConfig key
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "cpus_per_task": "cpus_per_task",
}


def _slurm_parameters(launcher: LauncherConfig, resources: DictConfig, timeout_min: int) -> dict:
    """Our launcher keys -> submitit's SlurmExecutor parameters (sbatch's names), as data."""
    params = {name: getattr(launcher, key) for name, key in _SLURM_PARAMETERS.items()}
    params |= {
        "nodes": resources.nodes,
        "ntasks_per_node": resources.tasks_per_node,
        "gpus_per_node": launcher.gpus_per_node or None,
        "mem": f"{launcher.mem_gb}GB" if launcher.mem_gb else None,
        "time": min(timeout_min, launcher.time_min),
        "setup": list(launcher.setup) or None,
        "additional_parameters": dict(launcher.sbatch_extra) or None,
    }
    if launcher.container_image:
        mounts = f" --container-mounts={launcher.container_mounts}" if launcher.container_mounts else ""
        params["srun_args"] = [f"--container-image={launcher.container_image}{mounts}"]
    return {k: v for k, v in params.items() if v is not None}


def make_executor(launcher: LauncherConfig, section: DictConfig, job_name: str) -> submitit.Executor:
    """A fresh submitit folder per submission, so no run reads another's pickles."""
    folder = Path(launcher.folder) / job_name / uuid.uuid4().hex[:12]
    if launcher.name == LauncherName.local:
        executor = submitit.LocalExecutor(folder=folder, max_num_timeout=launcher.max_requeues)
        executor.update_parameters(
            nodes=1, tasks_per_node=section.resources.tasks_per_node, timeout_min=section.timeout_min
        )
    else:
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=launcher.max_requeues)
        executor.update_parameters(job_name=job_name, **_slurm_parameters(launcher, section.resources, section.timeout_min))
    return executor


class Attempt(submitit.helpers.Checkpointable):
    """The submitted callable: `fn(*args)`, requeued at most `requeues` times on preemption or
    timeout (Slurm USR2). Only rank 0 runs `checkpoint()`; it resubmits this object with one
    requeue less, so the count survives requeues. A stage that cannot resume gets 0: it is not
    requeued but fails as an infrastructure error, and a retry starts it clean."""

    def __init__(self, fn: Callable, requeues: int, master_port: int):
        self.fn, self.requeues, self.master_port = fn, requeues, master_port

    def __call__(self, *args: Any) -> Any:
        os.environ["MASTER_PORT"] = str(self.master_port)  # read by alignflow.worker's rank set-up
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
        return submitit.helpers.DelayedSubmission(Attempt(self.fn, self.requeues - 1, self.master_port), *args)


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
        with self.lock:
            self.cancelled.set()
            jobs = list(self.jobs)
        for job in jobs:
            job.cancel(check=False)


_scope: ContextVar[_Scope | None] = ContextVar("alignflow_launch_scope", default=None)


@contextmanager
def cancel_jobs_on_interrupt() -> Iterator[None]:
    """Cancel every job submitted in this block (by this thread or threads started with its
    context: Prefect tasks) if the block ends by an exception: TerminationSignal when the flow
    run is cancelled, KeyboardInterrupt on Ctrl-C. Signals reach the main thread only."""
    scope = _Scope()
    token = _scope.set(scope)
    try:
        yield
    except BaseException:
        scope.cancel()
        raise
    finally:
        _scope.reset(token)


def submit(launcher: LauncherConfig, section: DictConfig, job_name: str, fn: Callable, *args: Any,
           resumable: bool = False) -> submitit.Job:
    """Submit `fn(*args)` as `section`'s job; requeued on preemption/timeout only if `resumable`.
    Local jobs end with this process, however it ends (`alignflow.orphans`)."""
    reap_on_exit()
    executor = make_executor(launcher, section, job_name)
    attempt = Attempt(fn, launcher.max_requeues if resumable else 0, rendezvous_port())
    scope = _scope.get()
    if scope is None:
        return executor.submit(attempt, *args)
    with scope.lock:
        if scope.cancelled.is_set():
            raise JobCancelled(f"{job_name}: not submitted, the flow run is being cancelled")
        job = executor.submit(attempt, *args)
        scope.jobs.add(job)
    return job


def rendezvous_port() -> int:
    """A port in RENDEZVOUS_PORTS that is free here now (on Slurm, rank 0's node is likely
    another: there only the range protects it)."""
    for _ in range(100):
        port = random.randint(*RENDEZVOUS_PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {RENDEZVOUS_PORTS} for the job's rendezvous")


def job_record(job: submitit.Job) -> JobRecord:
    launcher = LauncherName.slurm if isinstance(job, submitit.SlurmJob) else LauncherName.local
    return JobRecord(str(job.job_id), launcher.value, str(job.paths.stdout), str(job.paths.stderr))


# ----------------------------------------------------------------------------- waiting


def wait(job: submitit.Job, log: Callable[[str], None], poll_s: float = 1.0, record: JobRecord | None = None,
         output: Callable[[str], None] | None = None) -> Any:
    """Block until the job ends, forwarding its state changes (kept in `record.state`) to `log`
    and rank 0's output to `output` (default: `log` too); returns rank 0's result.

    If the caller is interrupted (Ctrl-C in this thread, or its flow run cancelled) the job is
    cancelled too.
    """
    record = record or job_record(job)
    tail, state, scope, output = _Tail(job), _State(job, record, log), _scope.get(), output or log
    try:
        while not (cancelled := scope is not None and scope.cancelled.is_set()) and not state.done():
            tail.forward(output)
            time.sleep(poll_s)
        tail.drain(output, quiet_s=SLURM_LOG_QUIET_S if state.slurm else 0.0)  # a local job's files are complete at its exit
        if cancelled:  # the scope has scancelled the job: its end is no failure to retry
            state.cancel()
            raise JobCancelled(f"job {job.job_id} cancelled with its flow run", asdict(record))
        results = job.results()
        state.set("COMPLETED")  # every rank returned: Slurm's accounting may still say RUNNING for a while
        return results[0]
    except submitit.core.utils.FailedJobError as err:
        state.set("FAILED")
        error = InfrastructureError if NOT_REQUEUED in str(err) else StageFailed
        raise error(f"job {job.job_id} failed: {_cause(str(err))}\n{_last_lines(str(err))}", asdict(record)) from None
    except submitit.core.utils.UncompletedJobError as err:
        state.ended_without_result()
        raise InfrastructureError(f"job {job.job_id} ended without a result ({record.state}):\n{_last_lines(str(err))}",
                                  asdict(record)) from None
    except BaseException:
        if not job.done():
            state.cancel()
        raise
    finally:
        if scope is not None:
            scope.jobs.discard(job)


class _State:
    """The job's state, logged when it changes: Slurm's (PENDING, RUNNING, REQUEUED, ...) while
    it runs, then its outcome. sacct is asked at most every STATE_POLL_S (submitit's watcher
    would wait up to 10 min), so a cancelled or killed job is noticed within seconds; `done()`
    then reads submitit's refreshed cache. A local job runs from its submission."""

    def __init__(self, job: submitit.Job, record: JobRecord, log: Callable[[str], None]):
        self.job, self.record, self.log = job, record, log
        self.slurm = isinstance(job, submitit.SlurmJob)
        self.polled = 0.0
        if not self.slurm:
            self.set("RUNNING")

    def update(self, force: bool = False) -> None:
        if self.slurm and (force or time.monotonic() - self.polled >= STATE_POLL_S):
            self.polled = time.monotonic()
            state = self.job.get_info(mode="force").get("State", "")  # one sacct call
            if state:
                self.set(state.split()[0])  # "CANCELLED by 0" -> "CANCELLED"

    def set(self, state: str) -> None:
        if state != self.record.state:
            self.record.state = state
            self.log(f"job {self.job.job_id}: {state}")

    def done(self) -> bool:
        self.update()
        return self.job.done()

    def cancel(self) -> None:
        if not self.job.done():
            self.job.cancel(check=False)
        self.set("CANCELLED")

    def ended_without_result(self) -> None:
        if self.slurm:
            self.update(force=True)  # CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, ...
        else:
            self.set(self.job.state)


def _cause(text: str) -> str:
    """The exception line of submitit's failure text (its trace sits between two dashed rules),
    to head the message: Prefect shows a failed task's first line."""
    lines = text.strip().splitlines()
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"-"}]
    trace = lines[rules[0] + 1:rules[1]] if len(rules) >= 2 else lines
    return next((line for line in reversed(trace) if line.strip() and not line.startswith(" ")), "").strip()


def _last_lines(text: str, n: int = ERROR_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


class _Tail:
    """Forwards new lines of rank 0's stdout and stderr since the last call."""

    def __init__(self, job: submitit.Job):
        self.paths = [job.paths.stdout, job.paths.stderr]
        self.offsets = {p: 0 for p in self.paths}
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
