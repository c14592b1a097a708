"""The store, inputs and stage outputs on a real S3 protocol endpoint (moto server on loopback)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
import torch

from alignflow import PROJECT_ROOT
from alignflow.orchestrator.config.compose import compose
from alignflow.job.worker import typed
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import plan, run_stage

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import convert_demo, metrics_lines, prep_demo, sft_cfg  # noqa: E402


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from alignflow.job.model_files.dist_io import DistCheckpointReader

    reader = DistCheckpointReader(str(model_dir))
    return {key: reader.read(key) for key in reader.keys()}


def test_an_input_model_is_downloaded_once_per_commit(s3_endpoint, tmp_path, monkeypatch):
    """A model stage output on S3 becomes a local folder (model/, hf/, tokenizer/; not its
    checkpoints) in the cache; the same commit is served from there, a new commit is fetched anew."""
    from alignflow.job.forward.models import local_model

    monkeypatch.setitem(fsspec.config.conf, "s3", {"client_kwargs": {"endpoint_url": s3_endpoint}})
    fs, root, cache = fsspec.filesystem("s3"), "test/inputs/sft/abc", tmp_path / "cache"
    for name in ("model/.metadata", "hf/config.json", "tokenizer/tokenizer.json", "checkpoints/step-00000001/complete"):
        fs.pipe(f"{root}/{name}", b"v1")
    fs.pipe(f"{root}/_SUCCESS.json", b'{"committed_at": 1}')
    first = Path(local_model(f"s3://{root}", cache).uri)
    assert first.parent == cache / "inputs" / "s3" / root
    assert sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file()) == [
        "hf/config.json",
        "model/.metadata",
        "tokenizer/tokenizer.json",
    ]
    fs.pipe(f"{root}/model/.metadata", b"v2")
    assert Path(local_model(f"s3://{root}", cache).uri) == first and (first / "model" / ".metadata").read_bytes() == b"v1"
    fs.pipe(f"{root}/_SUCCESS.json", b'{"committed_at": 2}')  # e.g. a forced re-run committed again
    second = Path(local_model(f"s3://{root}", cache).uri)
    assert second != first and (second / "model" / ".metadata").read_bytes() == b"v2"
    assert not list(second.parent.glob(".tmp-*"))


@pytest.mark.slow
def test_prep_reads_and_commits_on_s3(s3_endpoint, demo_dir, base_overrides):
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    fs = fsspec.filesystem("s3", **options)
    fs.put(str(demo_dir / "data" / "sft_train.jsonl"), "test/in/sft_train.jsonl")
    overrides = [
        *base_overrides,
        "store.root=s3://test/store",
        f"+store.storage_options.client_kwargs.endpoint_url={s3_endpoint}",
        "data.sft.train=s3://test/in/sft_train.jsonl",
        "data.sft.val=null",
        "data.sft.val_fraction=0.1",
    ]
    cfg = compose("convert", [*overrides, "+pipeline.stages.prep={}"])
    first = run_stage(Pipeline.build(cfg)["prep"], {}, log=print)
    assert first.uri == f"s3://test/store/prep/{first.fingerprint}" and not first.cached
    manifest = json.loads(fs.cat_file(f"test/store/prep/{first.fingerprint}/_SUCCESS.json"))
    assert manifest["metrics"] == first.metrics
    with fs.open(f"test/store/prep/{first.fingerprint}/sft/train-00000.parquet", "rb") as f:
        assert pq.read_table(f).num_rows > 0
    assert not fs.exists(f"test/store/prep/_staging/{first.fingerprint}")
    assert "test-secret-value" not in json.dumps(manifest)

    assert run_stage(Pipeline.build(cfg)["prep"], {}, log=print).cached


@pytest.mark.slow
def test_convert_and_export_through_s3(s3_endpoint, demo_dir, base_overrides):
    """HF source on S3 -> torch_dist in an S3 store -> HF export published to an S3 destination."""
    from safetensors.torch import load_file, load

    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    fs = fsspec.filesystem("s3", **options)
    fs.put(str(demo_dir / "tiny-llama"), "test/models/tiny-llama", recursive=True)
    overrides = [
        *base_overrides,
        "store.root=s3://test/store2",
        f"+store.storage_options.client_kwargs.endpoint_url={s3_endpoint}",
        "model.source=s3://test/models/tiny-llama",
        "export.destination=s3://test/published/tiny-llama",
    ]
    cfg = compose("convert", overrides)
    assert [p.status for p in plan(Pipeline.build(cfg))] == ["run", "run"]
    converted = run_stage(Pipeline.build(cfg)["convert"], {}, log=print)
    assert fs.exists(f"test/store2/convert/{converted.fingerprint}/model/.metadata")
    exported = run_stage(Pipeline.build(cfg)["export"], {"convert": converted}, log=print)
    assert [p.status for p in plan(Pipeline.build(cfg))] == ["committed", "committed"]
    assert exported.uri.startswith("s3://test/store2/export/")
    source = load_file(demo_dir / "tiny-llama" / "model.safetensors")
    for root in (exported.uri.removeprefix("s3://"), "test/published/tiny-llama"):
        back = load(fs.cat_file(f"{root}/model.safetensors"))
        assert set(back) == set(source) and all(back[k].equal(source[k]) for k in source)
        assert fs.exists(f"{root}/config.json") and fs.exists(f"{root}/tokenizer.json")


FAST = [
    "sft.trainer.max_steps=2",
    "sft.optim.warmup_steps=1",
    "sft.trainer.val_check_interval=1",
    "sft.trainer.limit_val_batches=1",
    "sft.checkpoint.every_n_steps=1",
    "sft.checkpoint.save_top_k=0",
    "eval.num_generation_samples=4",
    "eval.limit_batches=1",
]


@pytest.mark.slow
def test_demo_pipeline_with_everything_on_s3(s3_endpoint, demo_dir, base_overrides, tmp_path):
    """pipeline=demo with the data, model source, store and export destination on S3: sft
    trains in a local scratch and its checkpoints and outputs land in the store; eval and
    export read its model from there."""
    from alignflow.job.model_files.dist_io import DistCheckpointReader

    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    fs = fsspec.filesystem("s3", **options)
    fs.put(f"{demo_dir}/", "test/demo/", recursive=True)
    overrides = [
        *base_overrides,
        *FAST,
        "paths.demo=s3://test/demo",
        "data.preference=null",  # the demo pipeline does not train on it; eval would score it (slow)
        "store.root=s3://test/store3",
        f"+store.storage_options.client_kwargs.endpoint_url={s3_endpoint}",
        f"store.cache_dir={tmp_path / 'cache'}",
        "export.destination=s3://test/published/demo",
    ]
    cfg = compose("demo", overrides)
    results = {}
    for stage in Pipeline.build(cfg):  # the flow's order and wiring, without Prefect
        results[stage.name] = run_stage(stage, {name: results[name] for name in stage.upstream()}, log=print)

    sft = results["sft"]
    root = f"test/store3/sft/{sft.fingerprint}"
    assert sft.uri == f"s3://{root}" and sft.metrics["steps"] == 2
    manifest = json.loads(fs.cat_file(f"{root}/_SUCCESS.json"))
    listed = {f["path"] for f in manifest["files"]}
    assert listed >= {"model/.metadata", "hf/config.json", "tokenizer/tokenizer.json", "metrics.jsonl"}
    assert not any(p.startswith("checkpoints/") for p in listed) and not fs.exists(f"{root}/checkpoints")  # left in staging, removed with it
    assert [json.loads(line)["step"] for line in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()] == [1, 2]
    assert not fs.exists(f"test/store3/sft/_staging/{sft.fingerprint}")
    fsspec.config.conf.setdefault("s3", {}).update(options)
    final = DistCheckpointReader(f"s3://{root}/model")
    assert all(torch.isfinite(final.read(k)).all() for k in final.keys())

    evaluated = json.loads(fs.cat_file(f"test/store3/eval/{results['eval'].fingerprint}/eval.json"))
    assert {"sft.val_loss", "convert.val_loss"} <= set(evaluated["metrics"])
    assert (tmp_path / "cache" / "inputs" / "s3" / root).is_dir()  # eval's copy of the sft model
    export_manifest = json.loads(fs.cat_file(f"test/store3/export/{results['export'].fingerprint}/_SUCCESS.json"))
    assert export_manifest["inputs"]["sft"]["uri"] == sft.uri
    assert fs.exists("test/published/demo/model.safetensors") and fs.exists("test/published/demo/config.json")


JOB = """
import json, sys, time

from alignflow.job.train import engine
from alignflow.job.worker import run_stage_job


def pause_after_checkpoints(seconds):
    save = engine.save_checkpoint

    def paused(run):
        save(run)
        print("checkpoint saved and uploaded", flush=True)
        time.sleep(seconds)

    engine.save_checkpoint = paused


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    pause_after_checkpoints(job.pop("pause"))
    print(json.dumps(run_stage_job(**job)))
"""


@pytest.mark.slow
def test_killed_job_resumes_from_the_s3_checkpoint_on_another_node(s3_endpoint, demo_dir, tmp_path):
    """A job whose output is on S3 is killed (SIGKILL) after its first checkpoint was uploaded;
    the retry, with another (empty) cache as on another node, downloads that checkpoint and
    ends with weights bit-identical to an uninterrupted run on a local output, and the same
    metrics (dropout on, so the RNG states must travel too). A half-uploaded later checkpoint
    and a metrics line logged after the checkpoint are left in the store, as a kill leaves them."""
    from alignflow.job.stages import sft

    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    fs = fsspec.filesystem("s3", **options)
    local = {"data": str(prep_demo(demo_dir, tmp_path / "data")), "model": str(convert_demo(demo_dir, tmp_path / "model"))}
    for role, path in local.items():
        fs.put(f"{path}/", f"test/resume/{role}/", recursive=True)
    inputs = {role: f"s3://test/resume/{role}" for role in local}
    cfg = sft_cfg(
        demo_dir,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        trainer={"max_steps": 8, "val_check_interval": 2, "log_every_n_steps": 1},
        checkpoint={"every_n_steps": 3, "save_top_k": 1},
    )
    reference = tmp_path / "uninterrupted"
    sft.run(typed(cfg), local, str(reference))

    out, staging = "s3://test/resume/out", "test/resume/out"
    script = tmp_path / "job.py"
    script.write_text(JOB)

    def job(node: str, pause: float) -> subprocess.Popen:
        spec = {
            "kind": "sft",
            "cfg": cfg | {"store": {"cache_dir": str(tmp_path / node)}},
            "inputs": inputs,
            "out": out,
            "storage_options": options,
            "pause": pause,
        }
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        return subprocess.Popen(
            [sys.executable, str(script), json.dumps(spec)],
            cwd=PROJECT_ROOT,
            env=env | {"PYTHONPATH": str(PROJECT_ROOT)},
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = job("node-a", pause=60)
    marker, deadline = f"{staging}/checkpoints/step-00000003/complete", time.time() + 180
    while not fs.exists(marker) and first.poll() is None and time.time() < deadline:
        time.sleep(0.5)
        fs.invalidate_cache()
    os.killpg(first.pid, signal.SIGKILL)  # the job and the checkpoint writer it may have spawned
    first.wait(timeout=30)
    assert fs.exists(marker) and first.returncode == -signal.SIGKILL, first.stdout.read()[-3000:]
    assert not fs.exists(f"{staging}/model")
    fs.pipe(f"{staging}/checkpoints/step-00000006/model/.metadata", b"half uploaded")  # no `complete`: not a checkpoint
    fs.pipe(f"{staging}/metrics.jsonl", fs.cat_file(f"{staging}/metrics.jsonl") + json.dumps({"step": 4, "loss": 0.0}).encode() + b"\n")

    retry = job("node-b", pause=0)
    log, _ = retry.communicate(timeout=300)
    assert retry.returncode == 0, log[-3000:]
    assert f"downloaded checkpoint s3://{staging}/checkpoints/step-00000003" in log
    assert "(step 3 of 8)" in log and json.loads([line for line in log.splitlines() if line.startswith("{")][-1])["steps"] == 8

    fs.get(f"{staging}/model/", f"{tmp_path / 'resumed'}/", recursive=True)
    expected, got = weights(reference / "model"), weights(tmp_path / "resumed")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    (tmp_path / "resumed-metrics").mkdir()
    fs.get_file(f"{staging}/metrics.jsonl", str(tmp_path / "resumed-metrics" / "metrics.jsonl"))
    strip = lambda lines: [{k: v for k, v in line.items() if k != "tokens_per_s"} for line in lines]  # noqa: E731
    assert strip(metrics_lines(tmp_path / "resumed-metrics")) == strip(metrics_lines(reference))
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{staging}/checkpoints")) == sorted(p.name for p in (reference / "checkpoints").iterdir())


def test_s3_leases_are_compare_and_swap(s3_endpoint, tmp_path):
    """On S3 the lease is created with If-None-Match and beaten and taken over with If-Match:
    one creator wins, a holder frozen past the ttl is taken over once, and then it cannot commit."""
    from alignflow.orchestrator.lease import Lease, LeaseLost

    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    path = f"test/leases/{tmp_path.name}/f1.json"
    first, second = Lease(fs, path, ttl_s=1.0), Lease(fs, path, ttl_s=1.0)
    assert first.try_acquire() and not second.try_acquire()
    time.sleep(1.5)
    assert not second.try_acquire()  # first keeps beating: its ETag moves
    first._stop.set()
    first._thread.join()  # frozen
    deadline = time.monotonic() + 10
    while not second.try_acquire():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with pytest.raises(LeaseLost):
        first.check()
    second.check()
    second.release()
    assert not fs.exists(path)
