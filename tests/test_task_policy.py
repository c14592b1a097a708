"""A stage task and its job: only infrastructure failures are retried; only alignflow's job log lines reach the flow log; progress lines become artifacts."""

import logging

from prefect.states import Completed, Failed

from alignflow.launch import InfrastructureError, StageFailed
from tasks.stage import _infrastructure_failure


def test_only_infrastructure_failures_are_retried():
    assert _infrastructure_failure(None, None, Failed(data=InfrastructureError("job 12 was preempted and not requeued (PREEMPTED)")))
    assert not _infrastructure_failure(None, None, Failed(data=StageFailed("line 17: field 'messages'")))
    assert not _infrastructure_failure(None, None, Failed(data=ValueError("config")))
    assert not _infrastructure_failure(None, None, Completed(data=1))


def test_job_log_watcher_reads_progress_and_wandb_links():
    from tasks.stage import JobLogWatcher

    assert JobLogWatcher.STEP.search("step 40/300: loss 1.2, lr 0.0001").groups() == ("40", "300")
    assert JobLogWatcher.LOSS.search("step 40/300: loss 1.2, lr 0.0001").group(1) == "1.2"
    assert not JobLogWatcher.STEP.search("resumed from /x/checkpoints/step-00000003 (step 3 of 8)")
    assert JobLogWatcher.DONE.search("42.5% done, 12,000 rows read, 4,000 rows/s, 3.1M tokens, ETA 4 s").group(1) == "42.5"
    assert not JobLogWatcher.DONE.search("step 40/300: loss 1.2")
    url = "https://wandb.ai/team/alignflow/runs/ab12cd34"
    assert JobLogWatcher.WANDB.search(f"wandb run {url}").group(1) == url


def test_only_alignflow_records_reach_the_flow_log_at_their_level():
    """The job's lines as the worker's log format writes them: submitit's, library warnings,
    prints, other libraries' records and alignflow's DEBUG records (where files go) stay in the
    job log."""
    from alignflow.worker import LOG_FORMAT
    from tasks.stage import JobLogWatcher

    formatter = logging.Formatter(LOG_FORMAT.format(rank=0))

    def record(name: str, level: int, message: str) -> str:
        return formatter.format(logging.LogRecord(name, level, __file__, 1, message, None, None))

    class Capture(list):
        def info(self, message): self.append((logging.INFO, message))
        def log(self, level, message): self.append((level, message))

    seen = Capture()
    watcher = JobLogWatcher("sft", seen)
    for line in ("submitit INFO (2026-11-23 10:00:00,000) - Starting with JobEnvironment(job_id=1, hostname=a, local_rank=0(1))",
                 "/x/torch/distributed/checkpoint/default_planner.py:503: FutureWarning: Please use DTensor instead",
                 "    and md.size != obj.size()", "hello from a print",
                 record("alignflow.sft", logging.WARNING, "validation set has 3 rows"),
                 record("megatron.core.models", logging.INFO, "building the model"),
                 record("alignflow.train.engine", logging.DEBUG, "checkpoint /x/checkpoints/step-00000100"),
                 record("alignflow.worker", logging.ERROR, "stopping: the run is gone")):
        watcher.job_output(line)
    watcher("sft ab12: submitted local job 1, log /x/1_0_log.out")
    assert seen == [(logging.WARNING, "sft: validation set has 3 rows"), (logging.ERROR, "sft: stopping: the run is gone"),
                    (logging.INFO, "sft ab12: submitted local job 1, log /x/1_0_log.out")]
