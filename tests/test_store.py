"""The store commits atomically, never serves a half output, and lets one run produce a fingerprint;
a commit first checks that the output holds what its format declares."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import pytest

from alignflow.orchestrator.lease import LeaseLost, watch
from alignflow.orchestrator.kinds import OUTPUTS
from alignflow.orchestrator.store import MANIFEST, Store
from alignflow.orchestrator.verify import IncompleteOutput, OutputFormat

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import convert_demo, prep_demo  # noqa: E402

ANY = OutputFormat("any files")  # these tests are about atomicity, not formats: a fake shard will do


def stage_files(store: Store, fp: str, payload: str) -> None:
    staging = store.staging_path("prep", fp)
    store.fs.makedirs(f"{staging}/sft", exist_ok=True)
    store.fs.pipe(f"{staging}/sft/train-00000.parquet", payload.encode())


def test_output_without_manifest_does_not_exist(tmp_path):
    store = Store(str(tmp_path), {})
    stage_files(store, "f1", "x")
    assert store.read_manifest("prep", "f1") is None
    uri = store.commit("prep", "f1", {"metrics": {"rows": 1}}, ANY)
    assert store.read_manifest("prep", "f1") == {"metrics": {"rows": 1}}
    assert (tmp_path / "prep" / "f1" / "sft" / "train-00000.parquet").read_text() == "x"
    assert uri == str(tmp_path / "prep" / "f1")
    assert not (tmp_path / "prep" / "_staging" / "f1").exists()


def test_forced_commit_replaces_the_old_output_whole(tmp_path):
    store = Store(str(tmp_path), {})
    stage_files(store, "f1", "old")
    store.commit("prep", "f1", {"n": 1}, ANY)
    stage_files(store, "f1", "new")
    store.commit("prep", "f1", {"n": 2}, ANY)
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
            store.commit("prep", "f1", {"by": "producer"}, ANY)

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
from alignflow.orchestrator.store import Store
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
    path.write_text(json.dumps({"owner": "node7:4242:0123456789ab", "beat": 0, "host": "node7", "boot": "b-7", "pid": 4242, "started": 1.0}))
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
    contender = threading.Thread(
        target=lambda: got.append(Store(str(tmp_path), {}).lease("prep", "f1", ttl_s=1.0, poll_s=0.05, log=lambda _: None).__enter__())
    )
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


def replace(path, record: dict) -> None:
    """Write a lease record as the lease code does, atomically: a plain write_text truncates the
    file first, and a watcher polling every 50 ms then reads an empty, unreadable record."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


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
        replace(tmp_path / "prep" / "_leases" / "f1.job.json", {**record, "owners": [*record["owners"], "adopting-run"]})
        replace(path, adopter)
        time.sleep(0.5)
        assert not heard  # the adopter owns the job
        replace(path, {"owner": "another-run"})
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
    store.commit("prep", "f1", {}, ANY)
    assert (tmp_path / "prep" / "f1" / MANIFEST).exists()


# ----------------------------------------------------------------------------- verified commits


@pytest.fixture(scope="module")
def real_outputs(demo_dir, tmp_path_factory):
    """One real output per format the tests break: prep's Parquet, convert's torch_dist model, an HF folder."""
    root = tmp_path_factory.mktemp("outputs")
    return {"prep": prep_demo(demo_dir, root / "prep"), "model": convert_demo(demo_dir, root / "model"), "hf": demo_dir / "tiny-llama"}


def truncate(path: Path, keep: int = -100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


BROKEN = {  # (format, how the staged copy of the real output is broken, the file the error must name, why)
    "an empty staging folder": ("prep", lambda out: shutil.rmtree(out) or out.mkdir(), "", "is empty or absent"),
    "a truncated Parquet shard": (
        "prep",
        lambda out: truncate(out / "sft" / "train-00000.parquet"),
        "sft/train-00000.parquet",
        "unreadable: ArrowInvalid",
    ),
    "a missing metadata.json": ("prep", lambda out: (out / "metadata.json").unlink(), "metadata.json", "missing"),
    "no Parquet shard at all": ("prep", lambda out: shutil.rmtree(out / "sft"), "*/*.parquet", "missing"),
    "a truncated safetensors file": ("hf", lambda out: truncate(out / "model.safetensors"), "model.safetensors", "truncated: "),
    "a safetensors header cut short": ("hf", lambda out: truncate(out / "model.safetensors", 20), "model.safetensors", "unreadable"),
    "a config.json that is not JSON": ("hf", lambda out: (out / "config.json").write_text("{"), "config.json", "not JSON"),
    "a model without its .metadata": ("model", lambda out: (out / "model" / ".metadata").unlink(), "model", "no .metadata"),
    "a model without its metadata.json": ("model", lambda out: (out / "model" / "metadata.json").unlink(), "model", "no metadata.json"),
    "a model without its tokenizer": ("model", lambda out: shutil.rmtree(out / "tokenizer"), "tokenizer/*", "missing"),
    "a LoRA output without lora.json": ("model", lambda out: (out / "model").rename(out / "adapter"), "lora.json", "missing"),
    "an empty eval.json": ("eval", lambda out: (out / "eval.json").write_text(""), "eval.json", "not JSON"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_commit_refuses_an_output_that_lacks_a_declared_file_or_one_that_does_not_open(case, real_outputs, tmp_path):
    output, breaks, file, why = BROKEN[case]
    store = Store(str(tmp_path / "store"), {})
    staging = Path(store.staging_path("inst", "f1"))
    if output == "eval":
        staging.mkdir(parents=True)
        (staging / "eval.json").write_text('{"metrics": {}}')
    else:
        shutil.copytree(real_outputs[output], staging)
    breaks(staging)
    before = sorted((p.relative_to(staging), p.read_bytes()) for p in staging.rglob("*") if p.is_file())
    with pytest.raises(IncompleteOutput) as raised:
        store.commit("inst", "f1", {"stage": "inst"}, OUTPUTS[output])
    message = str(raised.value)
    assert message.startswith(f"inst f1: not committed: the output staged at {staging} is incomplete: ")
    assert f"{file}: " in message and why in message, message
    assert store.read_manifest("inst", "f1") is None and not Path(store.output_path("inst", "f1")).exists()
    assert sorted((p.relative_to(staging), p.read_bytes()) for p in staging.rglob("*") if p.is_file()) == before  # kept, to inspect


def test_a_commit_accepts_each_real_output_and_a_lora_one(real_outputs, tmp_path):
    store = Store(str(tmp_path / "store"), {})
    for name, output in (("prep", "prep"), ("convert", "model"), ("export", "hf")):
        shutil.copytree(real_outputs[output], store.staging_path(name, "f1"))
        store.commit(name, "f1", {"stage": name}, OUTPUTS[output])
        assert store.read_manifest(name, "f1") == {"stage": name}
    lora = Path(store.staging_path("sft_lora", "f1"))
    shutil.copytree(real_outputs["model"], lora)
    (lora / "model").rename(lora / "adapter")
    (lora / "lora.json").write_text(json.dumps({"base": store.uri(store.output_path("convert", "f1")), "adapter_dim": 8}))
    store.commit("sft_lora", "f1", {}, OUTPUTS["model"])
    assert store.read_manifest("sft_lora", "f1") == {}


def test_an_s3_commit_is_verified_too(s3_endpoint, real_outputs):
    store = Store("s3://test/verified", {"client_kwargs": {"endpoint_url": s3_endpoint}})
    fs = store.fs
    fs.put(f"{real_outputs['prep']}/", store.staging_path("prep", "f1") + "/", recursive=True)
    shard = f"{store.staging_path('prep', 'f1')}/sft/train-00000.parquet"
    fs.pipe(shard, fs.cat_file(shard)[:-100])
    with pytest.raises(
        IncompleteOutput,
        match=r"prep f1: not committed: the output staged at s3://test/verified/prep/_staging/f1 is "
        r"incomplete: sft/train-00000.parquet: unreadable",
    ):
        store.commit("prep", "f1", {}, OUTPUTS["prep"])
    assert not fs.exists(store.output_path("prep", "f1"))
    fs.rm(store.staging_path("prep", "f1"), recursive=True)
    fs.makedirs(store.staging_path("prep", "f1"), exist_ok=True)  # an empty prefix: nothing to commit
    with pytest.raises(IncompleteOutput, match="is empty or absent"):
        store.commit("prep", "f1", {}, OUTPUTS["prep"])
    assert not fs.exists(store.output_path("prep", "f1"))


# ----------------------------------------------------------------------------- training outputs


def staged_training_output(model: Path, dest: Path) -> None:
    """A training stage's staging folder as a job leaves it: the model output (model/, hf/,
    tokenizer/), metrics.jsonl and its checkpoints: steps 1 and 2 complete (torch_dist model and
    optimizer, trainer.json, a rank file), a step renamed but never marked complete, a
    half-written one, and the wandb run id."""
    shutil.copytree(model, dest)
    (dest / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    checkpoints = dest / "checkpoints"
    for step in (1, 2):
        path = checkpoints / f"step-{step:08d}"
        for part in ("model", "optimizer"):
            shutil.copytree(model / "model", path / part)  # a torch_dist folder (the optimizer's holds other keys)
        (path / "trainer.json").write_text(json.dumps({"step": step}))
        (path / "rank-00000.pt").write_bytes(b"rng states")
        (path / "complete").write_text("")
    shutil.copytree(model / "model", checkpoints / "step-00000003" / "model")
    (checkpoints / ".tmp-step-00000004" / "model").mkdir(parents=True)
    (checkpoints / ".tmp-step-00000004" / "model" / "__0_0.distcp").write_bytes(b"half")
    (checkpoints / "wandb-run-id").write_text("abc123")


def files_under(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, int]:
    fs.invalidate_cache()
    return {p[len(root) + 1 :]: info["size"] for p, info in fs.find(root, detail=True).items()}


@pytest.mark.parametrize("keep", [False, True], ids=["weights-only", "keep-optimizer"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_training_commit_leaves_its_checkpoints_out_or_keeps_only_the_final_one(keep, where, real_outputs, tmp_path, request):
    local = tmp_path / "staged"
    staged_training_output(real_outputs["model"], local)
    store = (
        Store(str(tmp_path / "store"), {})
        if where == "local"
        else Store(f"s3://test/training-{keep}", {"client_kwargs": {"endpoint_url": request.getfixturevalue("s3_endpoint")}})
    )
    store.fs.put(f"{local}/", f"{store.staging_path('sft', 'f1')}/", recursive=True)
    staged = store.staged_files("sft", "f1")

    kept, leave_out = store.committed_checkpoint("sft", "f1", keep_latest=keep)
    assert kept == ("checkpoints/step-00000002" if keep else None)
    assert leave_out == (
        ("checkpoints/.tmp-step-00000004", "checkpoints/step-00000001", "checkpoints/step-00000003", "checkpoints/wandb-run-id")
        if keep
        else ("checkpoints",)
    )
    manifest = {"files": store.staged_files("sft", "f1", leave_out)}
    store.commit("sft", "f1", manifest, OUTPUTS["model"], leave_out)

    output = store.output_path("sft", "f1")
    committed = files_under(store.fs, output)
    expected = {f["path"]: f["size"] for f in staged if not f["path"].startswith("checkpoints/")}
    if keep:
        expected |= {f["path"]: f["size"] for f in staged if f["path"].startswith("checkpoints/step-00000002/")}
    assert {p: s for p, s in committed.items() if p != MANIFEST} == expected
    assert {f["path"]: f["size"] for f in store.read_manifest("sft", "f1")["files"]} == expected
    assert not store.fs.exists(store.staging_path("sft", "f1"))


def test_a_kept_training_checkpoint_is_verified_and_a_left_out_one_is_not(real_outputs, tmp_path):
    store = Store(str(tmp_path / "store"), {})
    staging = Path(store.staging_path("sft", "f1"))
    staged_training_output(real_outputs["model"], staging)
    (staging / "checkpoints" / "step-00000002" / "optimizer" / ".metadata").unlink()  # cut short
    kept, leave_out = store.committed_checkpoint("sft", "f1", keep_latest=True)
    with pytest.raises(IncompleteOutput, match=r"checkpoints/step-00000002/optimizer: no \.metadata"):
        store.commit("sft", "f1", {}, OUTPUTS["model"], leave_out)
    assert store.read_manifest("sft", "f1") is None and (staging / "checkpoints" / "step-00000002").is_dir()

    _, leave_out = store.committed_checkpoint("sft", "f1", keep_latest=False)
    store.commit("sft", "f1", {}, OUTPUTS["model"], leave_out)  # not committed, so not checked
    assert store.read_manifest("sft", "f1") == {} and not (Path(store.output_path("sft", "f1")) / "checkpoints").exists()


def test_keeping_the_final_checkpoint_of_an_output_without_one_is_refused(real_outputs, tmp_path):
    store = Store(str(tmp_path / "store"), {})
    staging = Path(store.staging_path("sft", "f1"))
    shutil.copytree(real_outputs["model"], staging)
    assert store.committed_checkpoint("sft", "f1", keep_latest=False) == (None, ())  # nothing to leave out
    (staging / "checkpoints" / "step-00000002").mkdir(parents=True)
    (staging / "checkpoints" / "step-00000002" / "trainer.json").write_text("{}")  # renamed, never marked complete
    with pytest.raises(
        IncompleteOutput,
        match=re.escape(
            f"sft f1: not committed: its checkpoint.keep_optimizer asks to keep its final "
            f"training checkpoint, but none is complete at {staging}/checkpoints"
        ),
    ):
        store.committed_checkpoint("sft", "f1", keep_latest=True)
