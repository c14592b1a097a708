"""The store commits atomically, never serves a half output, and lets one run produce a fingerprint."""

import json
import threading
import time

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
        with store.lease("prep", "f1", ttl_s=30, poll_s=0.05, log=log.append) as acquired:
            order.append(("producer", acquired))
            time.sleep(0.5)
            stage_files(store, "f1", "x")
            store.commit("prep", "f1", {"by": "producer"})

    first = threading.Thread(target=producer)
    first.start()
    time.sleep(0.1)
    with store.lease("prep", "f1", ttl_s=30, poll_s=0.05, log=log.append) as acquired:
        order.append(("waiter", acquired))
    first.join()
    assert order == [("producer", True), ("waiter", False)]
    assert any("another run holds the lease" in line for line in log)


def test_stale_lease_of_a_dead_run_is_taken_over(tmp_path):
    store = Store(str(tmp_path), {})
    lease = tmp_path / "prep" / "_leases" / "f1.json"
    lease.parent.mkdir(parents=True)
    lease.write_text(json.dumps({"owner": "dead-host:1:x", "heartbeat": time.time() - 120}))
    with store.lease("prep", "f1", ttl_s=10, poll_s=0.05, log=print) as acquired:
        assert acquired
        assert json.loads(lease.read_text())["owner"] != "dead-host:1:x"
    assert not lease.exists()


def test_heartbeat_keeps_a_long_run_alive(tmp_path):
    store = Store(str(tmp_path), {})
    got = []
    with store.lease("prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None):
        def contender():
            with store.lease("prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None) as acquired:
                got.append((time.time(), acquired))

        t = threading.Thread(target=contender)
        started = time.time()
        t.start()
        time.sleep(3.0)  # three TTLs: without heartbeats the contender would have taken over
        assert not got
        released = time.time()
    t.join()
    assert got and got[0][0] >= released and got[0][1] is True
    assert released - started >= 3.0


def test_manifest_is_inside_when_the_directory_appears(tmp_path):
    store = Store(str(tmp_path), {})
    stage_files(store, "f1", "x")
    store.commit("prep", "f1", {})
    assert (tmp_path / "prep" / "f1" / MANIFEST).exists()
