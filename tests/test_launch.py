"""The local launcher runs real processes: ranks get torch.distributed, failures surface."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from omegaconf import OmegaConf

from alignflow.config.schema import LauncherConfig
from alignflow.launch import RENDEZVOUS_PORTS, InfrastructureError, StageFailed, job_record, make_executor, submit, wait

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the job imports this file's functions by value


def launcher(tmp_path):
    return OmegaConf.merge(OmegaConf.structured(LauncherConfig), {"folder": str(tmp_path / "jobs")})


def section(tasks: int = 1, timeout_min: int = 5):
    return OmegaConf.create({"resources": {"nodes": 1, "tasks_per_node": tasks}, "timeout_min": timeout_min})


def all_reduce_rank() -> dict:
    from alignflow.worker import _setup_rank
    import torch
    import torch.distributed as dist

    rank = _setup_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"hello from rank {rank}", flush=True)
    return {"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "sum": value.item(), "backend": dist.get_backend(),
            "port": int(os.environ["MASTER_PORT"])}


def raise_bad_row() -> None:
    print("reading rows", flush=True)
    raise ValueError("data.sft.train: /x.jsonl line 17: field 'messages': expected a list")


def die_hard() -> None:
    os.kill(os.getpid(), 9)


def test_two_local_ranks_get_a_gloo_process_group(tmp_path):
    job = submit(launcher(tmp_path), section(tasks=2), "probe", all_reduce_rank)
    lines = []
    result = wait(job, lines.append, poll_s=0.2)
    port = result.pop("port")
    assert result == {"rank": 0, "world": 2, "sum": 3.0, "backend": "gloo"}
    assert [r["rank"] for r in job.results()] == [0, 1]
    assert RENDEZVOUS_PORTS[0] <= port <= RENDEZVOUS_PORTS[1]  # below the ephemeral range: no client connection holds it
    assert any("hello from rank 0" in line for line in lines)  # job output reaches the caller's log


def test_exception_in_job_fails_with_its_cause_first_then_its_tail(tmp_path):
    job = make_executor(launcher(tmp_path), section(), "bad").submit(raise_bad_row)
    with pytest.raises(StageFailed) as failed:
        wait(job, lambda _: None, poll_s=0.2)
    headline, *tail = str(failed.value).splitlines()
    assert headline == f"job {job.job_id} failed: ValueError: data.sft.train: /x.jsonl line 17: field 'messages': expected a list"
    assert any("in raise_bad_row" in line for line in tail)


def test_killed_job_is_an_infrastructure_failure(tmp_path):
    job = make_executor(launcher(tmp_path), section(), "killed").submit(die_hard)
    with pytest.raises(InfrastructureError):
        wait(job, lambda _: None, poll_s=0.2)


def test_slurm_parameters_are_a_table(tmp_path):
    from alignflow.launch import _slurm_parameters

    cfg = OmegaConf.merge(launcher(tmp_path), {"name": "slurm", "partition": "gpu", "account": "a1", "gpus_per_node": 8, "mem_gb": 64,
                                              "container_image": "nvcr.io/x", "sbatch_extra": {"exclusive": True}})
    params = _slurm_parameters(cfg, section(tasks=8).resources, 30)
    assert params == {"partition": "gpu", "account": "a1", "cpus_per_task": 1, "nodes": 1, "ntasks_per_node": 8, "gpus_per_node": 8,
                      "mem": "64GB", "time": 30, "additional_parameters": {"exclusive": True}, "srun_args": ["--container-image=nvcr.io/x"]}


def test_only_resumable_stages_are_requeued_and_at_most_max_requeues_times():
    from alignflow.launch import Attempt

    attempt = Attempt(print, requeues=2, master_port=23456)
    again = attempt.checkpoint("x").function
    assert again.requeues == 1 and again.checkpoint("x").function.requeues == 0
    assert again.master_port == 23456  # the requeued ranks meet where the first attempt's did
    assert Attempt(print, requeues=0, master_port=23456).checkpoint("x") is None  # submitit then fails the job: "Job not requeued because ..."


def sleep_long() -> None:
    print("sleeping", flush=True)
    time.sleep(300)


def test_an_interrupted_block_cancels_the_jobs_its_threads_wait_on(tmp_path):
    """What a cancelled flow run does: the signal lands in the main thread, the tasks wait in others."""
    import contextvars
    import threading

    from alignflow.launch import JobCancelled, cancel_jobs_on_interrupt, submit

    outcome, lines = {}, []

    def task():
        job = submit(launcher(tmp_path), section(), "sleepy", sleep_long)
        outcome["job"] = job
        try:
            wait(job, lines.append, poll_s=0.2)
        except JobCancelled as err:
            outcome["error"] = err

    with pytest.raises(KeyboardInterrupt):
        with cancel_jobs_on_interrupt():
            thread = threading.Thread(target=contextvars.copy_context().run, args=(task,))
            thread.start()
            while not any("sleeping" in line for line in lines):
                time.sleep(0.1)
            raise KeyboardInterrupt
    thread.join(timeout=30)
    assert not thread.is_alive() and outcome["error"].job["state"] == "CANCELLED"
    deadline = time.time() + 20
    while outcome["job"].state == "RUNNING" and time.time() < deadline:
        time.sleep(0.2)
    assert outcome["job"].state != "RUNNING"  # the local job's processes are gone


def test_a_job_killed_by_its_time_limit_is_reported_as_such(tmp_path):
    job = submit(launcher(tmp_path), section(timeout_min=0.1), "slow", sleep_long)  # 6 s
    with pytest.raises(InfrastructureError) as err:
        wait(job, lambda _: None, poll_s=0.2, record=job_record(job, 0.1))
    assert str(err.value).startswith(f"job {job.job_id} was killed by its time limit (0.1 min)")
    assert err.value.job["state"] == "TIMEOUT"


HOG = """
import json, sys
from omegaconf import OmegaConf
from alignflow.config.schema import LauncherConfig
from alignflow.launch import InfrastructureError, job_record, submit, wait

def hog():
    blocks = []
    while True:
        blocks.append(b"\\1" * (32 << 20))  # touched pages, unlike a zeroed bytearray

launcher = OmegaConf.merge(OmegaConf.structured(LauncherConfig), {"folder": sys.argv[1]})
section = OmegaConf.create({"resources": {"nodes": 1, "tasks_per_node": 1}, "timeout_min": 5})
job = submit(launcher, section, "hog", hog)
try:
    wait(job, lambda _: None, poll_s=0.2, record=job_record(job, 5))
except InfrastructureError as err:
    print(json.dumps({"error": str(err).splitlines()[0], "state": err.job["state"]}))
"""


def memory_cgroup(limit: int) -> Path | None:
    """A new memory cgroup under this process's own, holding at most `limit` bytes (no swap):
    cgroup v1's memory controller or v2's unified hierarchy; None where this process may not
    make one (not root, no memory controller)."""
    import uuid

    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, limits = Path(f"/sys/fs/cgroup/memory{path}"), {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
        elif not controllers and Path(f"/sys/fs/cgroup{path}/memory.max").parent.exists():
            base, limits = Path(f"/sys/fs/cgroup{path}"), {"memory.max": limit, "memory.swap.max": 0}
        else:
            continue
        group = base / f"alignflow-test-{uuid.uuid4().hex[:8]}"
        try:
            group.mkdir()
            for name, value in limits.items():
                if (group / name).exists():
                    (group / name).write_text(str(value))
            return group
        except OSError:
            if group.exists():
                group.rmdir()
    return None


def test_a_job_killed_for_memory_is_reported_as_such(tmp_path):
    """A real OOM kill: the submitting process runs in a memory cgroup of 400 MB with its local
    job, whose rank allocates until the kernel kills it."""
    group = memory_cgroup(400 << 20)
    if group is None:
        pytest.skip("cannot make a memory cgroup here (root and a memory controller are needed; CI has both)")
    try:
        enter = lambda: (group / "cgroup.procs").write_text("0")  # noqa: E731 - this child, before it execs
        done = subprocess.run([sys.executable, "-c", HOG, str(tmp_path / "jobs")], preexec_fn=enter, capture_output=True, text=True,
                              timeout=300, cwd=Path(__file__).parents[1])
        outcome = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for process in (group / "cgroup.procs").read_text().split():
            os.kill(int(process), 9)
        time.sleep(0.5)
        group.rmdir()
    assert outcome["state"] == "OUT_OF_MEMORY", outcome
    assert "was killed for running out of memory" in outcome["error"]
