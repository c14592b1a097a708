"""What a job held, for how long, and on what: every stage's wall time and device-hours.

`job_usage(started)` at the end of a job (`alignflow.job.worker`, every kind):
- `wall_s`: from the start of this rank's process (Python's start-up and imports included, as a
  cluster bills them) to the stage's return; a requeued job reports its last attempt only;
- `hardware`: the device's name on GPU (`torch.cuda.get_device_name`), else the CPU's model
  name with the intra-op threads each rank computes on (a CPU's throughput depends on them);
- `devices` and `device_hours` = devices x wall_s / 3600, in `device_hours_of`: on GPU the
  ranks (one GPU each: GPU-hours); on CPU the cores the job held (core-hours): on each node the
  ranks x their threads, at most the CPUs its processes may run on, times the nodes. A rank's
  threads are torch's intra-op threads where the stage imported torch, else its share of the
  node's CPUs (prep's tokenizer threads are sized so).

No torch import here: a stage that never imported it (prep) is not made to pay for it.
"""

import os
import sys
import time
from pathlib import Path

GPU_HOURS, CORE_HOURS = "GPU-hours", "core-hours"


def job_usage(started: float) -> dict:
    """This job's wall time since `started` (epoch seconds), its hardware and device-hours."""
    wall = time.time() - started
    ranks, per_node = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        hardware, devices, unit = torch.cuda.get_device_name(), ranks, GPU_HOURS
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = torch.get_num_threads() if torch is not None else max(cpus // per_node, 1)
        hardware = f"{cpu_model()} ({threads} threads a rank)"
        devices, unit = min(per_node * threads, cpus) * max(ranks // per_node, 1), CORE_HOURS
    return {
        "wall_s": round(wall, 3),
        "hardware": hardware,
        "devices": devices,
        "device_hours": round(devices * wall / 3600, 6),
        "device_hours_of": unit,
    }


def cpu_model() -> str:
    """The CPU's model name as Linux reports it (`/proc/cpuinfo`), else the machine type."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()
