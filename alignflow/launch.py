"""Submit a stage's job with submitit and wait for it, streaming its log.

`launcher=local` runs the ranks as local processes (submitit's LocalExecutor);
`launcher=slurm` runs them as the tasks of one sbatch job. Either way each rank gets the
torch.distributed environment from `alignflow.worker`, and job stdout/stderr are
forwarded line by line to the caller's logger (the Prefect run logger in a flow).
A job that raised fails with the tail of its error; a job that died without a result
(preempted, killed, timed out, node lost) is an infrastructure failure and may be retried.
"""

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import submitit
from omegaconf import DictConfig

from alignflow.config.schema import LauncherConfig, LauncherName

ERROR_TAIL_LINES = 40


class StageFailed(RuntimeError):
    """The stage's code raised: retrying will not help."""


class InfrastructureError(RuntimeError):
    """The job died without a result (preemption, node loss, timeout, SIGKILL): retry."""


@dataclass
class JobRecord:
    job_id: str
    launcher: str
    stdout: str
    stderr: str


def _slurm_parameters(launcher: LauncherConfig, resources: DictConfig, timeout_min: int) -> dict:
    """Our launcher keys -> submitit's slurm parameters, as data."""
    params = {
        "slurm_partition": launcher.partition,
        "slurm_account": launcher.account,
        "slurm_qos": launcher.qos,
        "nodes": resources.nodes,
        "tasks_per_node": resources.tasks_per_node,
        "gpus_per_node": launcher.gpus_per_node or None,
        "cpus_per_task": launcher.cpus_per_task,
        "mem_gb": launcher.mem_gb,
        "timeout_min": min(timeout_min, launcher.time_min),
        "slurm_setup": list(launcher.setup),
        "slurm_additional_parameters": dict(launcher.sbatch_extra),
        "slurm_max_num_timeout": launcher.max_requeues,
    }
    if launcher.container_image:
        mounts = f" --container-mounts={launcher.container_mounts}" if launcher.container_mounts else ""
        params["slurm_srun_args"] = [f"--container-image={launcher.container_image}{mounts}"]
    return {k: v for k, v in params.items() if v is not None}


def make_executor(launcher: LauncherConfig, section: DictConfig, job_name: str) -> submitit.Executor:
    """A fresh submitit folder per submission, so no run reads another's pickles."""
    folder = Path(launcher.folder) / job_name / uuid.uuid4().hex[:12]
    if launcher.name == LauncherName.local:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(
            nodes=1, tasks_per_node=section.resources.tasks_per_node, timeout_min=section.timeout_min
        )
    else:
        executor = submitit.SlurmExecutor(folder=folder)
        executor.update_parameters(job_name=job_name, **_slurm_parameters(launcher, section.resources, section.timeout_min))
    return executor


def wait(job: submitit.Job, log: Callable[[str], None], poll_s: float = 1.0) -> Any:
    """Block until the job ends, forwarding rank 0's output; returns rank 0's result.

    If the caller is interrupted (flow cancelled, Ctrl-C) the job is cancelled too.
    """
    tail = _Tail(job)
    try:
        while not job.done():
            tail.forward(log)
            time.sleep(poll_s)
        tail.forward(log)
        return job.results()[0]
    except submitit.core.utils.FailedJobError as err:
        raise StageFailed(f"job {job.job_id} failed:\n{_last_lines(str(err))}") from None
    except submitit.core.utils.UncompletedJobError as err:
        raise InfrastructureError(f"job {job.job_id} ended without a result ({job.state}):\n{_last_lines(str(err))}") from None
    except BaseException:
        if not job.done():
            job.cancel(check=False)
        raise


def job_record(job: submitit.Job, launcher: str) -> JobRecord:
    return JobRecord(str(job.job_id), launcher, str(job.paths.stdout), str(job.paths.stderr))


def _last_lines(text: str, n: int = ERROR_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


class _Tail:
    """Forwards new lines of rank 0's stdout and stderr since the last call."""

    def __init__(self, job: submitit.Job):
        self.paths = [job.paths.stdout, job.paths.stderr]
        self.offsets = {p: 0 for p in self.paths}
        self.partial = {p: "" for p in self.paths}

    def forward(self, log: Callable[[str], None]) -> None:
        for path in self.paths:
            if not path.exists():
                continue
            with open(path, "r", errors="replace") as f:
                f.seek(self.offsets[path])
                chunk = f.read()
                self.offsets[path] = f.tell()
            lines = (self.partial[path] + chunk).split("\n")
            self.partial[path] = lines.pop()
            for line in lines:
                if line.strip():
                    log(line)
