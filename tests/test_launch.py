"""The local launcher runs real processes: ranks get torch.distributed, failures surface."""

import os
import sys
import time

import cloudpickle
import pytest
from omegaconf import OmegaConf

from alignflow.config.schema import LauncherConfig
from alignflow.launch import RENDEZVOUS_PORTS, InfrastructureError, StageFailed, make_executor, submit, wait

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
