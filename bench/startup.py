"""Stage start-up of a local job: from the stage's start to its job's first log line, cold
(fresh interpreters: `launcher.warm_start=false`) against warm (forked from the preloaded server,
`alignflow.orchestrator.warm_jobs`), the server's own start counted once.

The demo's prep and convert are committed once; then the sft stage (one step, on 1 and 2 ranks)
runs again and again through the real runner (`alignflow.orchestrator.runner.run_stage`:
fingerprint, lease, submit, wait), forced each time. A stage's start-up is the time from the
runner's call to the first of alignflow's records in the job's output (the worker's first line,
written once its stage module is imported and its rank set up: what a user waits for before
anything happens). `warm, first` is a server's first job (its own imports included: a fresh
server key), `warm` a job of a server already up. Medians of `--repeats`.

Run: .venv/bin/python bench/startup.py [--repeats 5] [--tiny]
"""

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from alignflow.orchestrator.config.compose import build
from alignflow.orchestrator.demo import build as build_demo
from alignflow.orchestrator.runner import run_stage
from alignflow.job.worker import job_record

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--tiny", action="store_true", help="one repeat of each, one rank: the whole path, for CI")
args = parser.parse_args()
repeats, ranks = (1, (1,)) if args.tiny else (args.repeats, (1, 2))

work = Path(tempfile.mkdtemp(prefix="alignflow-bench-startup-"))
demo = build_demo(work / "demo")
base = [
    f"paths.demo={demo}",
    f"store.root={work / 'store'}",
    f"launcher.folder={work / 'jobs'}",
    "sft.trainer.max_steps=1",
    "sft.optim.warmup_steps=0",
    "sft.trainer.val_check_interval=1",
]
pipeline = build("demo", base)
upstream = {name: run_stage(pipeline[name], {}, log=lambda line: None) for name in ("prep", "convert")}


def startup(warm: bool, tasks: int) -> float:
    """Seconds from the sft stage's start to its job's first alignflow record."""
    overrides = [*base, f"launcher.warm_start={str(warm).lower()}", f"sft.resources.tasks_per_node={tasks}", "force=[sft]"]
    stage, first = build("demo", overrides)["sft"], []
    started = time.monotonic()

    def output(line: str) -> None:
        if not first and job_record(line) is not None:
            first.append(time.monotonic() - started)

    run_stage(stage, upstream, log=lambda line: None, output=output)
    return first[0]


print(f"{'ranks':>5}  {'mode':<12}{'median s':>9}  each")
for tasks in ranks:
    os.environ["ALIGNFLOW_BENCH_SERVER"] = uuid.uuid4().hex  # a server key of its own: its first job starts it
    measured = {"cold": [startup(False, tasks) for _ in range(repeats)], "warm, first": [startup(True, tasks)]}
    measured["warm"] = [startup(True, tasks) for _ in range(repeats)]
    for mode, seconds in measured.items():
        print(f"{tasks:>5}  {mode:<12}{statistics.median(seconds):>9.2f}  {' '.join(f'{s:.2f}' for s in seconds)}")
