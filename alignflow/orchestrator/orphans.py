"""No orphans: the helper processes a process starts die with it, even when it is SIGKILLed;
its local jobs do not.

`reap_on_exit()` starts (once per process) a small watcher process in its own session. It
lists its parent's descendants twice a second; once the parent is gone, it sends those of the
last list SIGTERM, then SIGKILL to those still alive 5 s later, and exits. (A daemon that
left the tree, e.g. a Slurm daemon started by an infra script, is in no list; nor is a helper
started less than a poll before its parent was killed.) Used on
both sides: the flow process (its Prefect ephemeral server) and each job (the processes
Megatron's checkpoint writer spawns). psutil checks a process's start time before signalling
it, so a recycled PID is never hit.

A local job (submitit's controller, `submitit.local._local`, and its ranks) is no helper: like
a Slurm job it outlives a flow process that dies, and a rerun adopts it (`alignflow.orchestrator.lease`).
Nor is the warm server that local jobs are forked from (`alignflow.job.forkserver`), nor its jobs.
A flow process that is stopped (SIGINT, SIGTERM, SIGHUP) cancels its jobs itself
(`alignflow.orchestrator.launch.cancel_jobs_on_interrupt`).

    python -m alignflow.orchestrator.orphans PID     the watcher itself
"""

import os
import subprocess
import sys
import threading
import time

import psutil

POLL_S = 0.5
GRACE_S = 5.0
_started: dict[int, subprocess.Popen] = {}
_lock = threading.Lock()


def reap_on_exit() -> None:
    """Kill this process's descendants when it exits, however it exits (idempotent)."""
    with _lock:
        if os.getpid() in _started:
            return
        _started[os.getpid()] = subprocess.Popen(
            [sys.executable, "-m", "alignflow.orchestrator.orphans", str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the parent's group must not end the watcher first
        )


def watch(parent_pid: int) -> None:
    """The watcher's loop: the parent's descendants as last seen while it lived get ended."""
    me, last = os.getpid(), []
    try:
        parent = psutil.Process(parent_pid)
        while parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE:
            last = _helpers(parent, me)
            time.sleep(POLL_S)
    except psutil.Error:
        pass
    end(last)


# In the command line of a local job's controller, and of the warm server that forks warm ones
# (`alignflow.orchestrator.warm_jobs`): neither is a helper, and what they start is not either.
LOCAL_JOBS = ("submitit.local._local", "alignflow.job.forkserver")


def _helpers(parent: psutil.Process, me: int) -> list[psutil.Process]:
    """The parent's descendants but this watcher and its local jobs' process trees (daemons
    that left the tree are not ours either). One pass over the process table: `children()`
    per process would read every process's stat file once per descendant, twice a second."""
    found, skipped = [], {me}
    for process in parent.children(recursive=True):  # parents before their children
        try:
            if process.ppid() in skipped or process.pid == me or any(marker in part for part in process.cmdline() for marker in LOCAL_JOBS):
                skipped.add(process.pid)
                continue
        except psutil.Error:
            continue
        found.append(process)
    return found


def end(processes: list[psutil.Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM, then SIGKILL to those still alive after `grace_s`."""
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]))
