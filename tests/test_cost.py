"""Compute accounting without a pipeline: a job's device-hours, the time model, a run's use.

(The pipeline-level checks, `align plan`'s predictions against a run and the run summary, are
in tests/test_plan.py, on its committed sft_dpo store.)"""

import os
import time
from pathlib import Path

import pytest
import torch

from alignflow.job.usage import CORE_HOURS, GPU_HOURS, job_usage
from alignflow.orchestrator.cost import DEFAULTS, throughput, usage, usage_line

KEY = {"kind": "sft", "shape": "L2 h64", "layout": "1x1 TP1 PP1", "launcher": "local", "unit": CORE_HOURS}


def job(hardware: str, flops: float, compute_s: float, start_s: float, around_s: float, **key) -> dict:
    """A throughput row of a job that took `start_s` besides `compute_s` of passes, and whose
    stage took `around_s` besides its job."""
    wall = start_s + compute_s
    return KEY | key | {"hardware": hardware, "flops": flops, "compute_s": compute_s, "wall_s": wall, "seconds": wall + around_s, "devices": 2}


def test_a_cpu_jobs_device_hours_are_the_cores_its_threads_held():
    """One rank whose torch computes on `torch.get_num_threads()` threads, at most the CPUs this
    process may run on (its affinity): that many core-hours per hour of wall time."""
    cores = min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    used = job_usage(time.time() - 36.0)
    assert used["device_hours_of"] == CORE_HOURS and used["devices"] == cores
    assert used["device_hours"] == pytest.approx(cores * used["wall_s"] / 3600, rel=1e-3) and 36.0 <= used["wall_s"] < 40.0
    model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    assert used["hardware"] == f"{model} ({torch.get_num_threads()} threads a rank)"


def test_time_is_the_measured_start_up_plus_flops_at_the_measured_rate():
    """Jobs made by start-up s0 + FLOPs / r: the model reads s0 and r back from the latest jobs
    on the latest hardware (not fitted), so a job of other FLOPs is predicted exactly."""
    old = [job("CPU A", 1e9, 10.0, 2.0, 1.0)]  # another machine: left out
    rows = old + [job("CPU B", f, f / 2e9, 6.0, 1.5) for f in (1e9, 4e9, 8e9)] + [job("CPU B", 1e9, 0.5, 6.0, 1.5, shape="L4 h128")]
    model = throughput(rows, KEY, devices=2)
    assert model.rate == pytest.approx(2e9) and model.start_s == pytest.approx(6.0) and model.around_s == pytest.approx(1.5)
    assert model.basis == "measured: 3 jobs on CPU B" and model.devices == 2
    assert model.start_s + 20e9 / model.rate + model.around_s == pytest.approx(6.0 + 10.0 + 1.5)


def test_decoding_is_timed_per_step_and_the_rest_by_flops():
    """Generating jobs: their generation seconds over their decoding steps give the time a step;
    the rest of their compute seconds the FLOP rate."""
    rows = [job("CPU B", 1e9, 0.5 + 0.01 * n, 4.0, 1.0, kind="eval") | {"generation_s": 0.01 * n, "decode_steps": n} for n in (100, 300)]
    model = throughput(rows, KEY | {"kind": "eval"}, devices=2)
    assert model.step_s == pytest.approx(0.01) and model.rate == pytest.approx(2e9 / 1.0) and model.start_s == pytest.approx(4.0)


def test_without_history_the_prediction_says_its_default():
    for unit, devices, rate in ((CORE_HOURS, 2, DEFAULTS[CORE_HOURS].rate), (GPU_HOURS, 8, 8 * DEFAULTS[GPU_HOURS].rate)):
        model = throughput([job("CPU B", 1e9, 1.0, 5.0, 1.0)], KEY | {"unit": unit, "kind": "dpo"}, devices)
        assert model.basis == f"default: {DEFAULTS[unit].source}" and model.rate == rate and model.devices == devices


def test_a_runs_use_is_what_ran_and_its_saving_what_the_cache_hits_had_cost():
    stages = [
        {"metrics": {"device_hours": 0.5, "device_hours_of": GPU_HOURS}, "cached": False},
        {"metrics": {"device_hours": 0.25, "device_hours_of": GPU_HOURS}, "cached": True},
        {"metrics": {"device_hours": 0.125, "device_hours_of": CORE_HOURS}, "cached": True},
        {"metrics": {}, "cached": None},  # failed: no output
    ]
    use = usage(stages)
    assert use == {"used": {GPU_HOURS: 0.5}, "saved": {GPU_HOURS: 0.25, CORE_HOURS: 0.125}}
    assert (
        usage_line(use)
        == "device-hours: used 0.5 GPU-hours, saved 0.25 GPU-hours + 0.125 core-hours (cache hits), total 0.75 GPU-hours + 0.125 core-hours"
    )
