"""A stage task and its job: only infrastructure failures are retried; job log lines become artifacts."""

from prefect.states import Completed, Failed

from alignflow.launch import InfrastructureError, StageFailed
from tasks.stage import _infrastructure_failure


def test_only_infrastructure_failures_are_retried():
    assert _infrastructure_failure(None, None, Failed(data=InfrastructureError("job 12 ended without a result (PREEMPTED)")))
    assert not _infrastructure_failure(None, None, Failed(data=StageFailed("line 17: field 'messages'")))
    assert not _infrastructure_failure(None, None, Failed(data=ValueError("config")))
    assert not _infrastructure_failure(None, None, Completed(data=1))


def test_job_log_watcher_forwards_lines_and_reads_progress_and_wandb_links():
    from tasks.stage import JobLogWatcher

    assert JobLogWatcher.STEP.search("[rank 0] 2026-11-22 10:00:00,000 alignflow.train: step 40/300: loss 1.2").groups() == ("40", "300")
    assert not JobLogWatcher.STEP.search("resumed from /x/checkpoints/step-00000003 (step 3 of 8)")
    prep = "[rank 0] 2026-11-22 10:00:00,000 alignflow.prep: 42.5% done, 12,000 rows read, 4,000 rows/s, 3.1M tokens, ETA 4 s"
    assert JobLogWatcher.DONE.search(prep).group(1) == "42.5"
    assert not JobLogWatcher.DONE.search("[rank 0] alignflow.train: step 40/300: loss 1.2")
    url = "https://wandb.ai/team/alignflow/runs/ab12cd34"
    assert JobLogWatcher.WANDB.search(f"[rank 0] alignflow.train: wandb run {url}").group(1) == url
