"""Retries are for infrastructure failures only; a stage's own error is never retried."""

from prefect.states import Completed, Failed

from alignflow.launch import InfrastructureError, StageFailed
from tasks.stage import _infrastructure_failure


def test_only_infrastructure_failures_are_retried():
    assert _infrastructure_failure(None, None, Failed(data=InfrastructureError("job 12 ended without a result (PREEMPTED)")))
    assert not _infrastructure_failure(None, None, Failed(data=StageFailed("line 17: field 'messages'")))
    assert not _infrastructure_failure(None, None, Failed(data=ValueError("config")))
    assert not _infrastructure_failure(None, None, Completed(data=1))
