"""The local launcher runs real processes: ranks get torch.distributed, failures surface."""

import os
import sys

import cloudpickle
import pytest
from omegaconf import OmegaConf

from alignflow.config.schema import LauncherConfig
from alignflow.launch import InfrastructureError, StageFailed, make_executor, wait

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
    return {"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "sum": value.item(), "backend": dist.get_backend()}


def raise_bad_row() -> None:
    print("reading rows", flush=True)
    raise ValueError("data.sft.train: /x.jsonl line 17: field 'messages': expected a list")


def die_hard() -> None:
    os.kill(os.getpid(), 9)


def test_two_local_ranks_get_a_gloo_process_group(tmp_path):
    job = make_executor(launcher(tmp_path), section(tasks=2), "probe").submit(all_reduce_rank)
    lines = []
    result = wait(job, lines.append, poll_s=0.2)
    assert result == {"rank": 0, "world": 2, "sum": 3.0, "backend": "gloo"}
    assert [r["rank"] for r in job.results()] == [0, 1]
    assert any("hello from rank 0" in line for line in lines)  # job output reaches the caller's log


def test_exception_in_job_fails_with_its_tail(tmp_path):
    job = make_executor(launcher(tmp_path), section(), "bad").submit(raise_bad_row)
    with pytest.raises(StageFailed, match="line 17: field 'messages'"):
        wait(job, lambda _: None, poll_s=0.2)


def test_killed_job_is_an_infrastructure_failure(tmp_path):
    job = make_executor(launcher(tmp_path), section(), "killed").submit(die_hard)
    with pytest.raises(InfrastructureError):
        wait(job, lambda _: None, poll_s=0.2)


def test_slurm_parameters_are_a_table(tmp_path):
    from alignflow.launch import _slurm_parameters

    cfg = OmegaConf.merge(launcher(tmp_path), {"name": "slurm", "partition": "gpu", "account": "a1", "gpus_per_node": 8,
                                              "container_image": "nvcr.io/x", "sbatch_extra": {"exclusive": True}})
    params = _slurm_parameters(cfg, section(tasks=8).resources, 30)
    assert params["slurm_partition"] == "gpu" and params["tasks_per_node"] == 8 and params["gpus_per_node"] == 8
    assert params["timeout_min"] == 30 and params["slurm_additional_parameters"] == {"exclusive": True}
    assert params["slurm_srun_args"] == ["--container-image=nvcr.io/x"]
    assert "slurm_qos" not in params
