"""A warm process that local jobs are forked from: torch, Megatron-Core, transformers and the
stages imported once, not once per rank.

A rank started cold (`python -m submitit.core._submit`) spends 6-9 s of a core importing what
every rank imports, most of it Megatron-Core; a pipeline of seven stages on two ranks pays that
fourteen times. This server imports it once. On request (`alignflow.orchestrator.warm_jobs`)
it forks a job's controller, which runs submitit's local `Controller` but forks its ranks
instead of starting fresh interpreters. Each rank is still a process of its own with the
environment, working folder, arguments, signal handlers, stdout and stderr a cold one gets, and
runs `submitit.core.submission.process_job` as `submitit.core._submit` does.

What keeps a forked rank the same as a fresh one:
- the client keys a server by the interpreter, working folder and the environment variables
  read at start-up or import that it would start a cold job with (so `sys.path` and whatever a
  module read from the environment at import agree), and by what a child inherits besides (its
  cgroup and memory limit, namespaces, resource limits, CPUs; `alignflow.orchestrator.warm_jobs`);
- before each fork the server checks that no file it imported changed since (modification time,
  size, inode): an edited checkout or a reinstalled package retires the server, and the next
  job starts a fresh one, so a job never runs code its run did not fingerprint;
- it imports what a cold job imports in a cold job's order (`preload`), and a job's environment
  is its submitter's plus what those imports set (as a cold job's imports would set it); a job
  whose environment gives one of those another value is refused (it starts cold). What one
  stage's imports set reaches every warm job: the benchmark's HF_HUB_OFFLINE and
  HF_DATASETS_OFFLINE (no stage reads a hub at run time);
- the children drop the server's exit handlers and signal handlers, and exit as Python does
  (exit code, SystemExit, an uncaught KeyboardInterrupt as SIGINT).

Its life: it runs in a session of its own, which the orphan watcher of the run that starts it
leaves alone (its jobs outlive that run, and a rerun adopts them, as with cold jobs), serves
only its own user (the socket's folder is 0700 and
each peer's uid is checked), records each controller's exit status beside its job's files
(`{folder}/{pid}_controller_exit`, read by `alignflow.orchestrator.warm_jobs.Controller`) and
exits after IDLE_S without a job or a request. Jobs with GPUs start cold: a CUDA context does not
survive a fork, and their import time is small beside their work.

    python -u -m alignflow.job.forkserver SOCKET
"""

import atexit
import importlib
import json
import logging
import os
import pkgutil
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, NoReturn

from submitit.core import _submit, utils
from submitit.core.submission import process_job
from submitit.local import _local
from submitit.local.local import Controller

IDLE_S = 600.0  # without a job or a request this long, the server exits
POLL_S = 1.0
MAX_REQUEST_BYTES = 8 << 20
EXIT_FILE = "{pid}_controller_exit"  # in the job's submitit folder

# What every rank imports besides its stage module, loaded once here (`preload`).
PRELOAD = ("torch", "torch.distributed", "megatron.core", "transformers")


def main(path: str) -> None:
    before = dict(os.environ)
    preload()
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}  # e.g. benchmark's HF_HUB_OFFLINE
    imported, handlers = _imported_files(), _handlers()
    (listener, ours), wakeup = _listen(path), _wake_on_sigchld()
    jobs: dict[int, str] = {}  # controller pid -> its submitit folder
    idle_since = time.monotonic()
    while listener is not None or jobs:
        ready, _, _ = select.select([s for s in (listener, wakeup[0]) if s is not None], [], [], POLL_S)
        if wakeup[0] in ready:
            wakeup[0].recv(4096)
        _reap(jobs)
        if listener is not None and listener in ready:
            connection, _ = listener.accept()
            with connection:
                stale = _serve(connection, imported, handlers, set_by_imports, jobs, (listener, *wakeup), lambda: _unlink(path, ours))
            if stale:
                listener = _retire(listener, path, ours)
            idle_since = time.monotonic()
        if jobs:
            idle_since = time.monotonic()
        elif listener is not None and time.monotonic() - idle_since > IDLE_S:
            listener = _retire(listener, path, ours)


def preload() -> None:
    """What a cold job imports, in its order: the job entry point (what unpickling its callable
    imports), then the stage modules, so that a stage's settings made before its imports (the
    benchmark's offline switches) precede the libraries, as in a cold job of that stage."""
    for name in ("alignflow.job.worker", *_stage_modules(), *PRELOAD):
        importlib.import_module(name)


def _stage_modules() -> list[str]:
    import alignflow.job.stages as stages

    return [f"{stages.__name__}.{module.name}" for module in pkgutil.iter_modules(stages.__path__)]


def _imported_files() -> dict[str, tuple[int, int, int]]:
    found = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and (stat := _stat(file)) is not None:
            found[file] = stat
    return found


def _stat(file: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(file)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def changed(imported: dict[str, tuple[int, int, int]]) -> str | None:
    """A file imported here that is no longer what was imported, if any."""
    return next((file for file, stat in imported.items() if _stat(file) != stat), None)


def _listen(path: str) -> tuple[socket.socket, tuple[int, int]]:
    """The listening socket, bound under a temporary name and renamed into place (a client that
    finds the file finds it listening), and the file's identity (device, inode)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    temporary = f"{path}.{os.getpid()}"
    listener.bind(temporary)
    listener.listen(64)
    st = os.stat(temporary)
    os.replace(temporary, path)
    return listener, (st.st_dev, st.st_ino)


def _retire(listener: socket.socket, path: str, ours: tuple[int, int]) -> None:
    """Stop taking requests (the jobs already forked run on)."""
    _unlink(path, ours)
    listener.close()
    return None


def _unlink(path: str, ours: tuple[int, int]) -> None:
    """The socket's file goes, unless another server's has replaced it."""
    try:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == ours:
            os.unlink(path)
    except OSError:
        pass


def _wake_on_sigchld() -> tuple[socket.socket, socket.socket]:
    """A socket pair whose reader becomes readable when a child ends: select() wakes to reap it."""
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return reader, writer


def _handlers() -> dict:
    """The signal handlers as the preloaded interpreter has them, before this server sets its own."""
    return {signum: signal.getsignal(signum) for signum in signal.valid_signals() if signum not in (signal.SIGKILL, signal.SIGSTOP)}


def _reap(jobs: dict[int, str]) -> None:
    """Record each ended controller's exit status in its job's folder (as Popen.returncode)."""
    for pid, folder in list(jobs.items()):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            del jobs[pid]
            _write(Path(folder) / EXIT_FILE.format(pid=pid), str(os.waitstatus_to_exitcode(status)))


def _write(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    except OSError as err:
        print(f"forkserver: cannot record {path}: {err}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- one request


def _serve(
    connection: socket.socket, imported: dict, handlers: dict, set_by_imports: dict, jobs: dict[int, str], inherited: tuple, unlink: Callable
) -> bool:
    """Fork the controller a request asks for and answer its pid and start time, or refuse;
    True when this server is stale and must retire (its socket's file is gone before it says so:
    the client's retry then starts a fresh server instead of queueing at this one)."""
    fds: list[int] = []
    try:
        _check_peer(connection)
        request, fds = _receive(connection)
        if (file := changed(imported)) is not None:
            unlink()
            _answer(connection, refused=f"stale: {file} changed since this server imported it")
            return True
        if differ := [f"{k}={request['env'][k]!r} (its imports set {v!r})" for k, v in set_by_imports.items() if request["env"].get(k, v) != v]:
            raise ValueError(f"the job's environment has {', '.join(differ)}: a cold job's imports would read that")
        pid = os.fork()
        if pid == 0:
            for sock in (connection, *inherited):
                sock.close()
            request["env"] = {**set_by_imports, **request["env"]}  # what the job's own imports would have set
            _run_as_main(lambda: _controller(request, fds, handlers))
        jobs[pid] = request["folder"]
        _answer(connection, pid=pid, started=_start_time(pid))
    except (OSError, ValueError, KeyError) as err:
        _answer(connection, refused=f"{type(err).__name__}: {err}")
    finally:
        for fd in fds:
            os.close(fd)
    return False


def _check_peer(connection: socket.socket) -> None:
    _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        raise PermissionError(f"uid {uid} is not this server's user")


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    """A request: 4 bytes of length, then JSON; the client's stdin, stdout and stderr ride along."""
    connection.settimeout(30)
    data, fds, _, _ = socket.recv_fds(connection, 65536, 3)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        if len(data) > MAX_REQUEST_BYTES or not (chunk := connection.recv(65536)):
            for fd in fds:
                os.close(fd)
            raise ValueError("a truncated request")
        data += chunk
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a request with {len(fds)} file descriptors, not 3")
    return json.loads(data[4:]), fds


def _answer(connection: socket.socket, **reply) -> None:
    try:
        connection.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        pass  # the client is gone; a controller it asked for runs, and nobody waits on it: as a cold job whose run died


def _start_time(pid: int) -> float:
    import psutil

    return psutil.Process(pid).create_time()


# ----------------------------------------------------------------------------- in the children


def _as_fresh(handlers: dict) -> None:
    """The state a fresh interpreter runs a job in: none of this server's signal or exit handlers."""
    signal.set_wakeup_fd(-1)
    for signum, handler in handlers.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
    atexit._clear()


def _controller(request: dict, fds: list[int], handlers: dict) -> None:
    """submitit's local controller (`python -m submitit.local._local FOLDER`), its ranks forked."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    _as_fresh(handlers)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [_local.__file__, request["folder"]]
    ForkingController(Path(request["folder"]), handlers).run()


class ForkingController(Controller):
    """submitit's local `Controller`, whose tasks are forked from this warm process, not started fresh."""

    def __init__(self, folder: Path, handlers: dict):
        super().__init__(folder)
        self.handlers = handlers

    def start_tasks(self) -> None:  # submitit's, with `_Task.fork` for its Popen
        self.folder.mkdir(exist_ok=True)
        paths = [utils.JobPaths(self.folder, self.pid, k) for k in range(self.ntasks)]
        self.stdouts = [p.stdout.open("a") for p in paths]
        self.stderrs = self.stdouts if self.stderr_to_stdout else [p.stderr.open("a") for p in paths]
        for k in range(self.ntasks):
            self.tasks.append(_Task.fork(self._task, k))

    def _task(self, k: int) -> None:
        """Rank k: `python -u -m submitit.core._submit FOLDER` with its stdout and stderr."""
        _as_fresh(self.handlers)
        os.environ.update(SUBMITIT_LOCAL_LOCALID=str(k), SUBMITIT_LOCAL_GLOBALID=str(k), SUBMITIT_LOCAL_JOB_ID=self.pid)
        os.dup2(self.stdouts[k].fileno(), 1)
        os.dup2(self.stderrs[k].fileno(), 2)
        for f in {*self.stdouts, *self.stderrs}:  # a fresh rank holds no other rank's log
            f.close()
        sys.argv = [_submit.__file__, str(self.folder)]
        process_job(self.folder)


class _Task:
    """A forked rank, as the part of `subprocess.Popen` that submitit's Controller uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    @classmethod
    def fork(cls, body: Callable[..., None], *args) -> "_Task":
        pid = os.fork()
        if pid == 0:
            _run_as_main(lambda: body(*args))
        return cls(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def _run_as_main(body: Callable[[], None]) -> NoReturn:
    """Run `body` as a script's main and exit as the interpreter would, never returning into
    the server: SystemExit's code, 1 with the traceback for an error, death by SIGINT for an
    uncaught KeyboardInterrupt; non-daemon threads joined and exit handlers run first."""
    code = 0
    try:
        body()
    except SystemExit as exit:
        if isinstance(exit.code, int) or exit.code is None:
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - what an interpreter does with any uncaught exception
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1])
