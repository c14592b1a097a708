"""The store commits atomically, never serves a half output, and lets one run produce a fingerprint."""

import json
import subprocess
import sys
import threading
import time

import pytest

from alignflow.lease import LeaseLost, watch
from alignflow.store import MANIFEST, Store


def stage_files(store: Store, fp: str, payload: str) -> None:
    staging = store.staging_path("prep", fp)
    store.fs.makedirs(f"{staging}/sft", exist_ok=True)
    store.fs.pipe(f"{staging}/sft/train-00000.parquet", payload.encode())


def test_output_without_manifest_does_not_exist(tmp_path):
    store = Store(str(tmp_path), {})
    stage_files(store, "f1", "x")
    assert store.read_manifest("prep", "f1") is None
    uri = store.commit("prep", "f1", {"metrics": {"rows": 1}})
    assert store.read_manifest("prep", "f1") == {"metrics": {"rows": 1}}
    assert (tmp_path / "prep" / "f1" / "sft" / "train-00000.parquet").read_text() == "x"
    assert uri == str(tmp_path / "prep" / "f1")
    assert not (tmp_path / "prep" / "_staging" / "f1").exists()


def test_forced_commit_replaces_the_old_output_whole(tmp_path):
    store = Store(str(tmp_path), {})
    stage_files(store, "f1", "old")
    store.commit("prep", "f1", {"n": 1})
    stage_files(store, "f1", "new")
    store.commit("prep", "f1", {"n": 2})
    assert store.read_manifest("prep", "f1") == {"n": 2}
    assert (tmp_path / "prep" / "f1" / "sft" / "train-00000.parquet").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "prep").iterdir()) == ["_staging", "f1"]


def test_second_contender_waits_and_sees_the_commit(tmp_path):
    store = Store(str(tmp_path), {})
    log, order = [], []

    def producer():
        with store.lease("prep", "f1", ttl_s=30, poll_s=0.05, log=log.append) as lease:
            order.append(("producer", lease is not None))
            time.sleep(0.5)
            stage_files(store, "f1", "x")
            lease.check()
            store.commit("prep", "f1", {"by": "producer"})

    first = threading.Thread(target=producer)
    first.start()
    time.sleep(0.1)
    with store.lease("prep", "f1", ttl_s=30, poll_s=0.05, log=log.append) as lease:
        order.append(("waiter", lease is not None))
    first.join()
    assert order == [("producer", True), ("waiter", False)]
    assert any("another run holds the lease" in line for line in log)


HOLD = """
import sys, time
from alignflow.store import Store
with Store(sys.argv[1], {}).lease("prep", "f1", ttl_s=float(sys.argv[2]), poll_s=0.05, log=print) as lease:
    print("holding", flush=True)
    time.sleep(600)
"""


def hold_in_a_process(root, ttl_s: float) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root), str(ttl_s)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_dead_holder_of_this_machine_is_taken_over_at_once(tmp_path):
    holder = hold_in_a_process(tmp_path, ttl_s=30.0)
    holder.kill()
    holder.wait()
    started = time.monotonic()
    with Store(str(tmp_path), {}).lease("prep", "f1", ttl_s=30.0, poll_s=0.05, log=lambda _: None) as lease:
        waited = time.monotonic() - started
        assert lease is not None and json.loads((tmp_path / "prep" / "_leases" / "f1.json").read_text())["owner"] == lease.owner
    assert waited < 5.0  # its process is gone: no need to watch the lease stand still for 30 s
    assert not (tmp_path / "prep" / "_leases" / "f1.json").exists()


def test_a_holder_on_another_machine_is_taken_over_after_its_lease_stood_still_for_the_ttl(tmp_path):
    """A lease written by a run on another host (its record as that host wrote it), which
    stopped beating: only its standstill on this host's clock tells it is dead."""
    path = tmp_path / "prep" / "_leases" / "f1.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"owner": "node7:4242:0123456789ab", "beat": 0, "host": "node7", "boot": "b-7", "pid": 4242,
                                "started": 1.0}))
    started = time.monotonic()
    with Store(str(tmp_path), {}).lease("prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None) as lease:
        waited = time.monotonic() - started
        assert lease is not None and json.loads(path.read_text())["owner"] == lease.owner
    assert 1.0 <= waited < 5.0  # one ttl of watching it stand still, on this host's clock
    assert not path.exists()


def test_staleness_does_not_read_the_holders_clock(tmp_path):
    """A lease whose record claims a heartbeat an hour old (a skewed clock) but keeps beating is not stale."""
    holder = hold_in_a_process(tmp_path, ttl_s=1.0)
    path = tmp_path / "prep" / "_leases" / "f1.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "heartbeat": time.time() - 3600}))
    got = []
    contender = threading.Thread(target=lambda: got.append(Store(str(tmp_path), {}).lease(
        "prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None).__enter__()))
    contender.start()
    contender.join(timeout=3.0)
    assert contender.is_alive() and not got  # three ttls: the beats keep the lease, whatever the record says
    holder.kill()
    contender.join(timeout=10)
    assert got and got[0] is not None


def test_a_holder_whose_lease_was_taken_over_cannot_commit(tmp_path):
    """The holder stops (SIGSTOP: a long GC pause, a suspended VM) for longer than the ttl; a
    contender takes over; when the holder wakes, its check before committing refuses."""
    store = Store(str(tmp_path), {})
    ctx = store.lease("prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None)
    holder = ctx.__enter__()
    holder._stop.set()  # its heartbeats stop, as if its process froze
    holder._thread.join()
    with Store(str(tmp_path), {}).lease("prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None) as contender:
        assert contender is not None and contender.owner != holder.owner
        with pytest.raises(LeaseLost, match="taken over by another run"):
            holder.check()
        contender.check()  # the new holder may commit
    ctx.__exit__(None, None, None)  # the old holder leaves the lease file alone


def test_heartbeat_keeps_a_long_run_alive(tmp_path):
    store = Store(str(tmp_path), {})
    got = []
    with store.lease("prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None):
        def contender():
            with store.lease("prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None) as lease:
                got.append((time.time(), lease is not None))

        t = threading.Thread(target=contender)
        started = time.time()
        t.start()
        time.sleep(3.0)  # three TTLs: without heartbeats the contender would have taken over
        assert not got
        released = time.time()
    t.join()
    assert got and got[0][0] >= released and got[0][1] is True
    assert released - started >= 3.0


def test_a_job_outlives_its_silent_run_but_stops_for_a_stranger_or_a_release(tmp_path):
    """The job's side of the fence: a run that stopped beating (it died) does not stop its job;
    a run that adopted the job may hold the lease; a run that does not own the job, or a
    released lease, stops it."""
    store = Store(str(tmp_path), {})
    heard = []
    path = tmp_path / "prep" / "_leases" / "f1.json"
    with store.lease("prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None) as lease:
        lease.record_job({"job_id": "job-1", "launcher": "local"})
        watcher = watch(lease.fence(), "job-1", heard.append)
        lease._stop.set()
        lease._thread.join()  # its run froze or died
        time.sleep(1.5)
        assert not heard and watcher.is_alive()
        adopter = {"owner": "adopting-run"}
        record = json.loads((tmp_path / "prep" / "_leases" / "f1.job.json").read_text())
        (tmp_path / "prep" / "_leases" / "f1.job.json").write_text(json.dumps({**record, "owners": [*record["owners"], "adopting-run"]}))
        path.write_text(json.dumps(adopter))
        time.sleep(0.5)
        assert not heard  # the adopter owns the job
        path.write_text(json.dumps({"owner": "another-run"}))
        watcher.join(timeout=5)
        assert heard == [f"the lease {path} is held by another-run, which does not own job job-1"]
        path.unlink()
    heard.clear()
    with store.lease("prep", "f2", ttl_s=1.0, poll_s=0.05, log=lambda _: None) as lease:
        watcher = watch(lease.fence(), "job-2", heard.append)
    watcher.join(timeout=5)
    assert heard and "is gone: the run that submitted this job stopped it" in heard[0]


def test_manifest_is_inside_when_the_directory_appears(tmp_path):
    store = Store(str(tmp_path), {})
    stage_files(store, "f1", "x")
    store.commit("prep", "f1", {})
    assert (tmp_path / "prep" / "f1" / MANIFEST).exists()
