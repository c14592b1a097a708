"""The Prefect UI is best effort: a dashboard that is down never fails, stops or slows a stage.

Every call alignflow makes to Prefect's API for the UI (artifacts, progress, task run names
and states) goes through `call(key, fn)`, which queues it and returns: one background thread
makes the calls in order, so no stage ever waits on the API (Prefect's client retries a lost
connection for a minute and more). A call that fails (a server restart, an upgrade, a network
blip longer than the client's retries, an ephemeral server that died) stays queued, the latest
per key, and is replayed with backoff until the API is back: the UI catches up. Each call runs
in the context (settings, run ids) of the thread that made it. `drain` at the end of a flow
run waits for the queue a bounded time and says what the UI missed if the API never came back.

Orchestrator side: imports prefect, never torch.
"""

import contextvars
import logging
import threading
import time
from typing import Any, Callable
from uuid import UUID

from prefect.artifacts import LinkArtifact, MarkdownArtifact, ProgressArtifact, TableArtifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.context import SyncClientContext
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from prefect.utilities.context import get_task_and_flow_run_ids

log = logging.getLogger("alignflow.dashboard")

RETRY_S = (1.0, 2.0, 5.0, 10.0, 15.0)  # backoff between replays of a failed call


class _Queue:
    """Calls to make, the latest per key, in the order first queued, made by one daemon thread."""

    def __init__(self):
        self.pending: dict[str, Callable[[], Any]] = {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.thread: threading.Thread | None = None
        self.down = False

    def add(self, key: str, fn: Callable[[], Any]) -> None:
        with self.lock:
            self.pending[key] = fn
            self.changed.notify_all()
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="dashboard", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        failures = 0
        while True:
            with self.lock:
                while not self.pending:
                    self.changed.wait()
                key, fn = next(iter(self.pending.items()))
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - the API is down: keep the call, try again later
                failures += 1
                self._went_down(err)
                time.sleep(RETRY_S[min(failures - 1, len(RETRY_S) - 1)])
                continue
            failures = 0
            with self.lock:
                if self.pending.get(key) is fn:
                    del self.pending[key]
                if self.down:
                    self.down = False
                    log.warning("the Prefect API is back: the UI is catching up")
                self.changed.notify_all()

    def _went_down(self, err: Exception) -> None:
        if not self.down:
            self.down = True
            log.warning(
                "the Prefect API is unreachable (%s: %s); the stages go on, and the UI will catch up when it is back", type(err).__name__, err
            )

    def drain(self, timeout_s: float) -> list[str]:
        """Wait up to `timeout_s` for every queued call to be made; the keys still pending."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self.pending and (left := deadline - time.monotonic()) > 0:
                self.changed.wait(timeout=min(left, 1.0))
            return list(self.pending)


_queue = _Queue()


def call(key: str, fn: Callable[[], Any]) -> None:
    """Make `fn()` soon, in this thread's context, replacing a call of the same key still queued.
    The client does not retry it (its retries would hold the queue a minute per call while the
    API is down): the queue's backoff does."""
    context = contextvars.copy_context()
    _queue.add(key, lambda: context.copy().run(_once, fn))


def _once(fn: Callable[[], Any]) -> Any:
    """`fn()` with a client of its own: the run's may be closed by now (a replay after its end)."""
    SyncClientContext.__var__.set(None)
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}), SyncClientContext():
        return fn()


def drain(timeout_s: float) -> list[str]:
    return _queue.drain(timeout_s)


def api_down() -> bool:
    """Whether the last call to the API failed (and no later one has reached it)."""
    return _queue.down


def _ids() -> dict:
    task_run_id, flow_run_id = get_task_and_flow_run_ids()
    return {"task_run_id": task_run_id, "flow_run_id": flow_run_id}


def table(key: str, rows: list[dict], description: str) -> None:
    artifact = TableArtifact(key=key, table=rows, description=description, **_ids())
    call(key, lambda: artifact.create(_sync=True))


def markdown(key: str, text: str, description: str) -> None:
    artifact = MarkdownArtifact(key=key, markdown=text, description=description, **_ids())
    call(key, lambda: artifact.create(_sync=True))


def link(key: str, url: str, text: str, description: str) -> None:
    artifact = LinkArtifact(key=key, link=url, link_text=text, description=description, **_ids())
    call(key, lambda: artifact.create(_sync=True))


class Progress:
    """A progress artifact that keeps its latest value: created by the first call that reaches
    the API, updated by the later ones; a replay sends the latest value only."""

    def __init__(self, key: str | None, description: str):
        self.key, self.ids, self.id = key, _ids(), None
        self.percent, self.description = 0.0, description
        self._name = f"progress:{key or description}"

    def set(self, percent: float, description: str | None = None) -> None:
        self.percent, self.description = percent, description or self.description
        call(self._name, self._sync)

    def _sync(self) -> None:
        if self.id is None:
            artifact = ProgressArtifact(key=self.key, progress=self.percent, description=self.description, **self.ids)
            self.id = artifact.create(_sync=True).id
            return
        with get_client(sync_client=True) as client:
            client.update_artifact(artifact_id=self.id, artifact=ArtifactUpdate(data=self.percent, description=self.description))


def set_task_run_name(task_run_id: UUID, name: str, wait_s: float) -> None:
    """Name a task run, waiting up to `wait_s` for the server to have recorded it."""
    import httpx

    def rename() -> None:
        deadline = time.monotonic() + wait_s
        with get_client(sync_client=True) as client:
            while True:  # the run exists once the server has recorded its first state
                try:
                    client.set_task_run_name(task_run_id, name)
                    return
                except httpx.HTTPStatusError as err:
                    if err.response.status_code != 404 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    call(f"name:{task_run_id}", rename)
