"""The store, inputs and stage outputs on a real S3 protocol endpoint (moto server on loopback)."""

import json

import fsspec
import pyarrow.parquet as pq
import pytest

from alignflow.config import compose
from alignflow.runner import plan, run_stage

pytestmark = pytest.mark.slow


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
    cfg = compose("convert", [*overrides, "+pipeline.stages.prep={}"])  # training stages need a filesystem store
    first = run_stage(cfg, "prep", {}, log=print)
    assert first.uri == f"s3://test/store/prep/{first.fingerprint}" and not first.cached
    manifest = json.loads(fs.cat_file(f"test/store/prep/{first.fingerprint}/_SUCCESS.json"))
    assert manifest["metrics"] == first.metrics
    with fs.open(f"test/store/prep/{first.fingerprint}/sft/train-00000.parquet", "rb") as f:
        assert pq.read_table(f).num_rows > 0
    assert not fs.exists(f"test/store/prep/_staging/{first.fingerprint}")
    assert "test-secret-value" not in json.dumps(manifest)

    assert run_stage(cfg, "prep", {}, log=print).cached


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
    assert [p.status for p in plan(cfg)] == ["run", "run"]
    converted = run_stage(cfg, "convert", {}, log=print)
    assert fs.exists(f"test/store2/convert/{converted.fingerprint}/model/.metadata")
    exported = run_stage(cfg, "export", {"convert": converted}, log=print)
    assert [p.status for p in plan(cfg)] == ["committed", "committed"]
    assert exported.uri.startswith("s3://test/store2/export/")
    source = load_file(demo_dir / "tiny-llama" / "model.safetensors")
    for root in (exported.uri.removeprefix("s3://"), "test/published/tiny-llama"):
        back = load(fs.cat_file(f"{root}/model.safetensors"))
        assert set(back) == set(source) and all(back[k].equal(source[k]) for k in source)
        assert fs.exists(f"{root}/config.json") and fs.exists(f"{root}/tokenizer.json")
