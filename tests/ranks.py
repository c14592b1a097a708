"""Run a test script on N gloo ranks, as `torchrun --standalone --nproc-per-node N script ...` would,
but forked from a server that has already imported torch, Megatron-Core and the job's stages.

A rank started by torchrun spends 10-20 s of a 2-core machine importing what every rank imports,
for a second or two of work; the suite starts ~60 of them. Forked from a preloaded server, a rank
starts in a fraction of a second. Each rank is still its own process with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, one OpenMP thread) and
its own process group, so what the ranks compute and exchange is what they would under torchrun.
This is how PyTorch's own distributed tests run their ranks (`MultiProcessTestCase`).
"""

import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from alignflow import PROJECT_ROOT

# What every rank would import: loaded once, in the server the ranks are forked from.
PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core",
    "transformers",
    *(
        f"alignflow.job.stages.{stage}"
        for stage in ("sft", "dpo", "grpo", "eval", "ref_logprobs", "teacher_logprobs", "distillation", "reward_model", "convert", "export")
    ),
]
_context = None


def forkserver():
    """The session's multiprocessing context whose server holds PRELOAD (started on first use)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run_ranks(nproc: int, script: Path, *args: str, timeout: float = 300, cwd: Path = PROJECT_ROOT) -> subprocess.CompletedProcess:
    """`script args` on `nproc` ranks; its return code (the first failing rank's), and the ranks'
    stdout and stderr, each rank's in rank order. When a rank fails the others are stopped, as
    torchrun stops them; past `timeout` every rank is killed and the return code is -9."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base |= {"PYTHONPATH": str(PROJECT_ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    base |= {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        outputs = [(Path(logs) / f"{rank}.out", Path(logs) / f"{rank}.err") for rank in range(nproc)]
        ranks = [
            forkserver().Process(
                target=_rank,
                args=(str(script), list(args), {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}, str(cwd), *map(str, outputs[rank])),
            )
            for rank in range(nproc)
        ]
        for rank in ranks:
            rank.start()
        code = _wait(ranks, timeout)
        stdout, stderr = ("".join(path.read_text(errors="replace") for path in paths) for paths in zip(*outputs))
    return subprocess.CompletedProcess([str(script), *args], code, stdout, stderr)


def _wait(ranks: list, timeout: float) -> int:
    """0 when every rank succeeds, else the first failure's code (-9: killed at the timeout).
    Once a rank has failed, the others get 5 s to end before they are killed, as under torchrun."""
    deadline = time.monotonic() + timeout
    while any(rank.is_alive() for rank in ranks) and time.monotonic() < deadline:
        if any(rank.exitcode not in (None, 0) for rank in ranks):
            deadline = min(deadline, time.monotonic() + 5)
        time.sleep(0.05)
    for rank in ranks:
        rank.kill()
        rank.join()
    codes = [rank.exitcode for rank in ranks if rank.exitcode != 0]
    return next((code for code in codes if code != -9), codes[0] if codes else 0)


def _rank(script: str, args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """One rank: torchrun's environment, then the script as `__main__`, its output to files."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(1)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv, sys.path[0:0] = [script, *args], [str(Path(script).parent)]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
