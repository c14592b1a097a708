"""Local jobs started warm: their controller and ranks forked from a process that has imported
torch, Megatron-Core, transformers and the stages once (`alignflow.job.forkserver`), instead of
fresh interpreters that import them once per rank.

`WarmLocalExecutor` is submitit's LocalExecutor with that one difference: where submitit's
`start_controller` would start `python -m submitit.local._local FOLDER`, it asks the server
keyed by this interpreter, working folder, environment and process traits (`server_key`) to fork that
controller, and starts the server first if none runs (one at a time: a lock file). A job it
cannot start warm (the server fails to start, or refuses; a memory cgroup too small to hold a
server beside its jobs) starts cold, and the warning says why.
The job is the same either way: its id is its controller's pid, it outlives this process and a
rerun adopts it (`alignflow.orchestrator.lease`), and cancelling it signals its controller.

`Controller` is such a controller seen from a process that is not its parent (a warm job's,
or a dead run's job found again by `alignflow.orchestrator.launch.reattach`).

Nothing here imports torch: the server is another process, spoken to over a Unix socket.
"""

import fcntl
import hashlib
import json
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import submitit
from submitit.local.local import LocalJob

from alignflow.orchestrator.cgroup import memory_limit

SERVER_MODULE = "alignflow.job.forkserver"
EXIT_FILE = "{pid}_controller_exit"  # what the server writes when a controller it forked ends
START_TIMEOUT_S = 300.0  # the server's imports: ~14 s of a core here, more on a loaded machine
REPLY_TIMEOUT_S = 60.0
ATTEMPTS = 5
SERVER_NEEDS_BYTES = 600 << 20  # a server's resident memory here (torch, Megatron-Core, transformers, the stages)
# A server is keyed by the variables read when an interpreter starts or a module is imported
# (the interpreter's and the loader's, torch's, CUDA's, Hugging Face's, ...): any other is read
# when used, and a job gets every variable exactly, in its own environment. Not keyed: the job's
# GPUs (set per job), and what the job side sets itself, at import or when it runs, which a
# process that ran job-side code (a test, a notebook) has inherited; the server refuses a job
# whose value of one its own imports set differs (`alignflow.job.forkserver`).
KEYED_PREFIXES = ("PYTHON", "LD_", "TORCH", "PYTORCH", "CUDA", "NCCL", "NVTE_", "OMP_", "MKL_", "KMP_", "GOMP_", "HF_", "HUGGINGFACE_")
KEYED_PREFIXES += ("TRANSFORMERS_", "TOKENIZERS_", "MEGATRON_", "TRITON_", "XDG_")
KEYED = ("HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE")
UNKEYED = ("CUDA_VISIBLE_DEVICES",)
SET_BY_JOBS = (
    "HF_HUB_OFFLINE",  # the benchmark stage's imports (and so the server's)
    "HF_DATASETS_OFFLINE",
    "HF_XET_HIGH_PERFORMANCE",  # huggingface_hub's import
    "TORCHINDUCTOR_CACHE_DIR",  # torch._inductor's import
    "TORCH_FORCE_WEIGHTS_ONLY_LOAD",  # alignflow.job.model_files.untrusted, when it loads
    "NVTE_FLASH_ATTN",  # Megatron-Core's model build
    "NVTE_FUSED_ATTN",
    "NVTE_UNFUSED_ATTN",
)

_log = logging.getLogger("alignflow.orchestrator.warm_jobs")


class WarmStartUnavailable(RuntimeError):
    """No warm server could fork this job's controller; the job starts cold."""


class Controller:
    """A local job's controller that is not our child: the part of `subprocess.Popen` that
    submitit's LocalJob uses, by pid, its start time guarding against a recycled pid; its exit
    status is the server's record in `folder`, where there is one (else 0)."""

    ZOMBIE_S = 5.0  # a zombie not reaped this long (its reaper gone) counts as ended

    def __init__(self, pid: int, started: float, folder: str | Path | None = None):
        self.pid, self.started = pid, started
        self.exit_file = Path(folder) / EXIT_FILE.format(pid=pid) if folder is not None else None
        self.zombie_since: float | None = None

    def _process(self) -> psutil.Process | None:
        try:
            process = psutil.Process(self.pid)
            return process if abs(process.create_time() - self.started) < 0.01 else None
        except psutil.NoSuchProcess:
            return None

    def poll(self) -> int | None:
        process = self._process()
        if process is not None:
            try:
                zombie = process.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                zombie = True
            if not zombie:
                return None
            self.zombie_since = self.zombie_since or time.monotonic()
            if time.monotonic() - self.zombie_since < self.ZOMBIE_S and not self._recorded():
                return None  # ended, and its parent is about to record how
        code = self._recorded()
        return int(code) if code is not None else 0

    def _recorded(self) -> str | None:
        try:
            return self.exit_file.read_text().strip() if self.exit_file is not None else None
        except OSError:
            return None

    def send_signal(self, signum: int) -> None:
        if (process := self._process()) is not None:
            process.send_signal(signum)


class WarmLocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor whose controllers are forked by the warm server."""

    def _submit_command(self, command: str) -> LocalJob:
        ntasks = self.parameters.get("tasks_per_node", 1)
        try:
            pid, started = fork_controller(str(self.folder), controller_env(self.parameters, command), os.getcwd())
        except WarmStartUnavailable as err:
            _log.warning("this job starts cold (its ranks import torch and Megatron-Core themselves): %s", err)
            return super()._submit_command(command)
        return LocalJob(folder=self.folder, job_id=str(pid), process=Controller(pid, started, self.folder), tasks=list(range(ntasks)))


def controller_env(parameters: dict, command: str) -> dict[str, str]:
    """The environment submitit's `start_controller` gives a controller, with its defaults."""
    gpus = parameters.get("gpus_per_node", 0)
    visible = parameters.get("visible_gpus", ())
    return {
        **os.environ,
        "SUBMITIT_LOCAL_NTASKS": str(parameters.get("tasks_per_node", 1)),
        "SUBMITIT_LOCAL_COMMAND": command,
        "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * parameters.get("timeout_min", 2.0))),
        "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(parameters.get("signal_delay_s", 30))),
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_STDERR_TO_STDOUT": "1" if parameters.get("stderr_to_stdout", False) else "",
        "SUBMITIT_EXECUTOR": "local",
        "CUDA_VISIBLE_DEVICES": ",".join(str(k) for k in (range(gpus) if visible == () else visible[:gpus])),
        "SUBMITIT_LOCAL_WITH_SHELL": "",
    }


def server_key(env: dict[str, str], cwd: str) -> str:
    """What a server must share with a job for the job to run in it as in a fresh interpreter:
    the interpreter, the working folder, the keyed variables, and what a child inherits of this
    process besides (`inherited`)."""
    keyed = {k: v for k, v in env.items() if (k in KEYED or k.startswith(KEYED_PREFIXES)) and k not in (*UNKEYED, *SET_BY_JOBS)}
    return hashlib.sha256(json.dumps([sys.executable, cwd, sorted(keyed.items()), inherited()]).encode()).hexdigest()[:20]


def inherited() -> dict:
    """What a process started from here inherits and a forked one would take from its server
    instead: its cgroup (a memory limit, the OOM count `cgroup.oom_kills` reads), namespaces,
    resource limits, CPUs, niceness, umask and ids."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {
        "cgroup": Path("/proc/self/cgroup").read_text(),
        "namespaces": {
            ns: os.readlink(f"/proc/self/ns/{ns}")
            for ns in ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts")
            if os.path.exists(f"/proc/self/ns/{ns}")
        },
        "limits": {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")},
        "cpus": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "umask": status.get("Umask", "").strip(),
        "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
    }


def runtime_dir() -> Path:
    """This user's folder of server sockets, readable by no one else."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    folder = Path(base) / f"alignflow-forkserver-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise WarmStartUnavailable(f"{folder} is not this user's alone (owner {st.st_uid}, mode {oct(st.st_mode & 0o777)})")
    return folder


def fork_controller(folder: str, env: dict[str, str], cwd: str) -> tuple[int, float]:
    """(pid, start time) of the controller the warm server forked for the job in `folder`."""
    if (limit := memory_limit()) is not None and limit < SERVER_NEEDS_BYTES * 4:
        raise WarmStartUnavailable(f"this memory cgroup allows {limit >> 20} MiB: a warm server would hold {SERVER_NEEDS_BYTES >> 20} MiB of it")
    key = server_key(env, cwd)
    path = runtime_dir() / f"{key}.sock"
    request = json.dumps({"folder": folder, "env": env, "cwd": cwd}).encode()
    reason = "no server answered"
    for _ in range(ATTEMPTS):  # a server may retire (stale, idle) between our connect and its answer
        try:
            reply = _ask(path, request)
        except (FileNotFoundError, ConnectionRefusedError):
            _start(path, env, cwd)
            continue
        except OSError as err:
            reason = f"{type(err).__name__}: {err}"
            time.sleep(0.2)
            continue
        if "pid" in reply:
            return reply["pid"], reply["started"]
        reason = reply.get("refused", repr(reply))
        if not reason.startswith("stale"):
            break
    raise WarmStartUnavailable(f"the warm server at {path} could not fork it: {reason}")


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
            return True  # the server sees a request that says nothing, and answers it with a refusal
        except OSError:
            return False


def _ask(path: Path, request: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REPLY_TIMEOUT_S)
        sock.connect(str(path))
        message = struct.pack("!I", len(request)) + request
        sent = socket.send_fds(sock, [message], [0, 1, 2])  # the controller's stdin, stdout, stderr: ours, as Popen gives them
        sock.sendall(message[sent:])
        answer = b""
        while not answer.endswith(b"\n"):
            if not (chunk := sock.recv(65536)):
                raise ConnectionResetError("the server closed the connection without an answer")
            answer += chunk
    return json.loads(answer)


def _start(path: Path, env: dict[str, str], cwd: str) -> None:
    """Start the server of `path` unless another process just did; return once it listens."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _listening(path):
            return
        path.unlink(missing_ok=True)  # a server killed without retiring left its file behind
        log = path.with_suffix(".log")
        with open(log, "w") as err:
            server = subprocess.Popen(
                [sys.executable, "-u", "-m", SERVER_MODULE, str(path)],
                # without what job-side code sets (inherited from a test, say): its imports set them as a cold job's do, and it knows which
                env={k: v for k, v in env.items() if not k.startswith("SUBMITIT_") and k not in SET_BY_JOBS},
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,  # outlives this process, as its jobs do; no Ctrl-C of ours reaches it
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not path.exists():
            if server.poll() is not None:
                raise WarmStartUnavailable(f"the warm server exited ({server.returncode}) while starting: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                server.kill()
                raise WarmStartUnavailable(f"the warm server did not start within {START_TIMEOUT_S:.0f} s (its log: {log})")
            time.sleep(0.1)
