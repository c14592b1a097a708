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

from alignflow.orchestrator.config.schema import LauncherConfig
from alignflow.orchestrator.launch import (
    RENDEZVOUS_PORTS,
    Gpus,
    InfrastructureError,
    StageFailed,
    cpu_warning,
    job_record,
    local_gpus,
    make_executor,
    submit,
    wait,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the job imports this file's functions by value


def launcher(tmp_path, **settings):
    """A local launcher; on the CPU unless `settings` say otherwise (these tests' ranks use gloo)."""
    return OmegaConf.merge(OmegaConf.structured(LauncherConfig), {"folder": str(tmp_path / "jobs"), "gpus_per_node": 0, **settings})


def section(tasks: int = 1, timeout_min: int = 5):
    return OmegaConf.create({"resources": {"nodes": 1, "tasks_per_node": tasks}, "timeout_min": timeout_min})


def all_reduce_rank() -> dict:
    from alignflow.job.worker import _setup_rank
    import torch
    import torch.distributed as dist

    rank = _setup_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"hello from rank {rank}", flush=True)
    return {
        "rank": rank,
        "world": int(os.environ["WORLD_SIZE"]),
        "sum": value.item(),
        "backend": dist.get_backend(),
        "port": int(os.environ["MASTER_PORT"]),
    }


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
    from alignflow.orchestrator.launch import _slurm_parameters

    cfg = OmegaConf.merge(
        launcher(tmp_path),
        {
            "name": "slurm",
            "partition": "gpu",
            "account": "a1",
            "gpus_per_node": 8,
            "mem_gb": 64,
            "container_image": "nvcr.io/x",
            "sbatch_extra": {"exclusive": True},
        },
    )
    params = _slurm_parameters(cfg, section(tasks=8).resources, 30)
    assert params == {
        "partition": "gpu",
        "account": "a1",
        "cpus_per_task": 1,
        "nodes": 1,
        "ntasks_per_node": 8,
        "gpus_per_node": 8,
        "mem": "64GB",
        "time": 30,
        "additional_parameters": {"exclusive": True},
        "srun_args": ["--container-image=nvcr.io/x"],
    }


def test_only_resumable_stages_are_requeued_and_at_most_max_requeues_times():
    from alignflow.orchestrator.launch import Attempt

    attempt = Attempt(print, requeues=2, master_port=23456, devices="0,1")
    again = attempt.checkpoint("x").function
    assert again.requeues == 1 and again.checkpoint("x").function.requeues == 0
    assert again.master_port == 23456 and again.devices == "0,1"  # the requeued ranks meet where the first attempt's did, on its GPUs
    assert Attempt(print, requeues=0, master_port=23456).checkpoint("x") is None  # submitit then fails the job: "Job not requeued because ..."


def sleep_long() -> None:
    print("sleeping", flush=True)
    time.sleep(300)


def test_an_interrupted_block_cancels_the_jobs_its_threads_wait_on(tmp_path):
    """What a cancelled flow run does: the signal lands in the main thread, the tasks wait in others."""
    import contextvars
    import threading

    from alignflow.orchestrator.launch import JobCancelled, cancel_jobs_on_interrupt, submit

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


@pytest.mark.slow
def test_a_job_killed_by_its_time_limit_is_reported_as_such(tmp_path):
    job = submit(launcher(tmp_path), section(timeout_min=0.1), "slow", sleep_long)  # 6 s
    with pytest.raises(InfrastructureError) as err:
        wait(job, lambda _: None, poll_s=0.2, record=job_record(job, 0.1))
    assert str(err.value).startswith(f"job {job.job_id} was killed by its time limit (0.1 min)")
    assert err.value.job["state"] == "TIMEOUT"


HOG = """
import json, sys
from omegaconf import OmegaConf
from alignflow.orchestrator.config.schema import LauncherConfig
from alignflow.orchestrator.launch import InfrastructureError, job_record, submit, wait

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


@pytest.mark.slow
def test_a_job_killed_for_memory_is_reported_as_such(tmp_path):
    """A real OOM kill: the submitting process runs in a memory cgroup of 400 MB with its local
    job, whose rank allocates until the kernel kills it."""
    group = memory_cgroup(400 << 20)
    if group is None:
        pytest.skip("cannot make a memory cgroup here (root and a memory controller are needed; CI has both)")
    try:
        enter = lambda: (group / "cgroup.procs").write_text("0")  # noqa: E731 - this child, before it execs
        done = subprocess.run(
            [sys.executable, "-c", HOG, str(tmp_path / "jobs")],
            preexec_fn=enter,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).parents[1],
        )
        outcome = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for process in (group / "cgroup.procs").read_text().split():
            os.kill(int(process), 9)
        time.sleep(0.5)
        group.rmdir()
    assert outcome["state"] == "OUT_OF_MEMORY", outcome
    assert "was killed for running out of memory" in outcome["error"]
    assert "this memory cgroup allows 400 MiB" in done.stderr  # no warm server squeezed in beside the job: it started cold


# ----------------------------------------------------------------------------- GPUs

# What `nvidia-smi -L` prints on a machine with 4 GPUs, the last one split into MIG instances.
NVIDIA_SMI_L = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1b0a9ef5-5d51-7e53-3a2e-3c3c1e7a0f10)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2c1b0f06-6e62-8f64-4b3f-4d4d2f8b1021)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-3d2c1017-7f73-9075-5c40-5e5e309c2132)
GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-4e3d2128-8084-a186-6d51-6f6f41ad3243)
  MIG 3g.40gb     Device  0: (UUID: MIG-5f4e3239-9195-b297-7e62-7070520e4354)
  MIG 3g.40gb     Device  1: (UUID: MIG-605f434a-a2a6-c3a8-8f73-8181631f5465)
"""
DRIVER_DOWN = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


def nvidia_smi(tmp_path, monkeypatch, prints: str = NVIDIA_SMI_L, exit_code: int = 0) -> None:
    """NVIDIA's program as a script first on PATH (the external program, not our code), with no
    CUDA_VISIBLE_DEVICES set: what a GPU machine shows the orchestrator."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\n[ "$1" = -L ] || exit 2\ncat <<"END"\n{prints}END\nexit {exit_code}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize(
    "visible, ids",
    [
        ("2,3", ("2", "3")),
        (" 1, 0 ", ("1", "0")),
        ("", ()),  # every GPU hidden
        ("-1", ()),  # CUDA reads up to the first entry that names no device
        ("1,-1,0", ("1",)),
        (
            "GPU-1b0a9ef5-5d51-7e53-3a2e-3c3c1e7a0f10,MIG-5f4e3239-9195-b297-7e62-7070520e4354",
            ("GPU-1b0a9ef5-5d51-7e53-3a2e-3c3c1e7a0f10", "MIG-5f4e3239-9195-b297-7e62-7070520e4354"),
        ),
    ],
)
def test_the_gpus_a_user_made_visible_are_those_local_jobs_get(tmp_path, monkeypatch, visible, ids):
    nvidia_smi(tmp_path, monkeypatch)  # it lists 4: CUDA_VISIBLE_DEVICES wins
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert local_gpus() == Gpus(ids, f"CUDA_VISIBLE_DEVICES={visible!r}")


def test_gpus_are_found_by_nvidia_smi_then_by_the_driver(tmp_path, monkeypatch):
    nvidia_smi(tmp_path, monkeypatch)
    found = local_gpus(proc=tmp_path / "no-driver")
    assert found.ids == ("0", "1", "2", "3") and found.source == "nvidia-smi -L"  # MIG instances are parts of GPU 3

    driver = tmp_path / "gpus"
    for bus in ("0000:07:00.0", "0000:0f:00.0"):
        (driver / bus).mkdir(parents=True)
    nvidia_smi(tmp_path, monkeypatch, prints=DRIVER_DOWN + "\n", exit_code=9)
    assert local_gpus(proc=driver).ids == ("0", "1")
    none = local_gpus(proc=tmp_path / "no-driver")
    assert none.ids == () and f"nvidia-smi -L failed (exit 9: {DRIVER_DOWN})" in none.source and "no-driver does not exist" in none.source


def rank_devices() -> dict:
    from alignflow.job.worker import _setup_rank

    rank = _setup_rank()
    return {"rank": rank, "local_rank": os.environ["LOCAL_RANK"], "visible": os.environ["CUDA_VISIBLE_DEVICES"]}


@pytest.mark.parametrize(
    "visible, settings, expected",
    [
        (None, {"gpus_per_node": None}, "0,1"),  # nvidia-smi's first two of 4, by default
        ("GPU-aa11,GPU-bb22,GPU-cc33", {"gpus_per_node": 2}, "GPU-aa11,GPU-bb22"),  # the user's, by UUID
        (None, {"gpus_per_node": 0}, ""),  # the CPU, as asked
    ],
)
def test_each_local_rank_sees_its_jobs_gpus_and_takes_the_one_of_its_local_rank(tmp_path, monkeypatch, visible, settings, expected):
    """A real local job of 2 ranks on a machine with 4 GPUs: submitit's local executor gives every
    job CUDA_VISIBLE_DEVICES="" unless told otherwise; each rank must see its job's 2 GPUs."""
    nvidia_smi(tmp_path, monkeypatch)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    job = submit(launcher(tmp_path, **settings), section(tasks=2), "gpus", rank_devices)
    wait(job, lambda _: None, poll_s=0.2)
    assert job.results() == [{"rank": 0, "local_rank": "0", "visible": expected}, {"rank": 1, "local_rank": "1", "visible": expected}]


def test_a_machine_whose_gpus_are_left_idle_is_warned_about(tmp_path, monkeypatch):
    nvidia_smi(tmp_path, monkeypatch)
    warning = cpu_warning(launcher(tmp_path, gpus_per_node=0))
    assert warning.startswith("launcher.gpus_per_node is 0: every stage's ranks run on the CPU, though this machine has 4 GPU(s) (nvidia-smi -L)")
    assert cpu_warning(launcher(tmp_path, gpus_per_node=None)) is None  # they are used
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cpu_warning(launcher(tmp_path, gpus_per_node=0)) is None  # the user hid them


def test_a_slurm_job_asks_for_one_gpu_per_rank(tmp_path):
    from alignflow.orchestrator.launch import _slurm_parameters

    def params(gpus, tasks):
        return _slurm_parameters(OmegaConf.merge(launcher(tmp_path), {"name": "slurm", "gpus_per_node": gpus}), section(tasks=tasks).resources, 30)

    assert params(8, 2)["gpus_per_node"] == 2 and params(8, 2)["ntasks_per_node"] == 2
    assert "gpus_per_node" not in params(0, 2) and "gpus_per_node" not in params(None, 2)  # the CPU: no GPU asked
