"""A stage task and its job: only infrastructure failures are retried; only alignflow's job log lines reach the flow log; progress lines become artifacts."""

import logging

from prefect.states import Completed, Failed

from alignflow.orchestrator.launch import InfrastructureError, StageFailed
from tasks.stage import _infrastructure_failure


def test_only_infrastructure_failures_are_retried():
    assert _infrastructure_failure(None, None, Failed(data=InfrastructureError("job 12 was preempted and not requeued (PREEMPTED)")))
    assert not _infrastructure_failure(None, None, Failed(data=StageFailed("line 17: field 'messages'")))
    assert not _infrastructure_failure(None, None, Failed(data=ValueError("config")))
    assert not _infrastructure_failure(None, None, Completed(data=1))


def test_job_records_carry_their_events_as_data():
    """A job's record reaches the orchestrator as JSON with its event (a step, prep's percent,
    a link); its message is only shown, never parsed, so a message that reads like a step is
    no step."""
    from alignflow.job.worker import JobRecords, job_record

    formatter = JobRecords(rank=1)

    def line(message: str, **extra) -> str:
        record = logging.LogRecord("alignflow.job.train", logging.INFO, __file__, 1, message, None, None)
        record.__dict__.update(extra)
        return formatter.format(record)

    step = job_record(line("step 40/300: loss 1.2, lr 0.0001", event={"step": 40, "total": 300, "loss": 1.2}))
    assert step["rank"] == 1 and step["level"] == "INFO" and step["event"] == {"step": 40, "total": 300, "loss": 1.2}
    assert "event" not in job_record(line("resumed from /x/checkpoints/step-00000003 (step 3 of 8)"))
    assert job_record("step 40/300: loss 1.2") is None and job_record("{not json") is None
    assert job_record('{"logger": "megatron.core", "message": "x"}') is None


def test_only_alignflow_records_reach_the_flow_log_at_their_level():
    """The job's lines as the worker's log format writes them: submitit's, library warnings,
    prints, other libraries' records and alignflow's DEBUG records (where files go) stay in the
    job log."""
    from alignflow.job.worker import JobRecords
    from tasks.stage import JobLogWatcher

    formatter = JobRecords(rank=0)

    def record(name: str, level: int, message: str) -> str:
        return formatter.format(logging.LogRecord(name, level, __file__, 1, message, None, None))

    class Capture(list):
        def info(self, message):
            self.append((logging.INFO, message))

        def log(self, level, message):
            self.append((level, message))

    seen = Capture()
    watcher = JobLogWatcher("sft", seen)
    for line in (
        "submitit INFO (2026-11-23 10:00:00,000) - Starting with JobEnvironment(job_id=1, hostname=a, local_rank=0(1))",
        "/x/torch/distributed/checkpoint/default_planner.py:503: FutureWarning: Please use DTensor instead",
        "    and md.size != obj.size()",
        "hello from a print",
        record("alignflow.sft", logging.WARNING, "validation set has 3 rows"),
        record("megatron.core.models", logging.INFO, "building the model"),
        record("alignflow.job.train.engine", logging.DEBUG, "checkpoint /x/checkpoints/step-00000100"),
        record("alignflow.job.worker", logging.ERROR, "stopping: the run is gone"),
    ):
        watcher.job_output(line)
    watcher("sft ab12: submitted local job 1, log /x/1_0_log.out")
    assert seen == [
        (logging.WARNING, "sft: validation set has 3 rows"),
        (logging.ERROR, "sft: stopping: the run is gone"),
        (logging.INFO, "sft ab12: submitted local job 1, log /x/1_0_log.out"),
    ]
