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
    cfg = compose("demo", overrides)
    first = run_stage(cfg, "prep", {}, log=print)
    assert first.uri == f"s3://test/store/prep/{first.fingerprint}" and not first.cached
    manifest = json.loads(fs.cat_file(f"test/store/prep/{first.fingerprint}/_SUCCESS.json"))
    assert manifest["metrics"] == first.metrics
    with fs.open(f"test/store/prep/{first.fingerprint}/sft/train-00000.parquet", "rb") as f:
        assert pq.read_table(f).num_rows > 0
    assert not fs.exists(f"test/store/prep/_staging/{first.fingerprint}")
    assert "test-secret-value" not in json.dumps(manifest)

    assert run_stage(cfg, "prep", {}, log=print).cached
    assert [p.status for p in plan(cfg)] == ["committed"]
