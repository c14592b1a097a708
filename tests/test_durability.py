"""What a crash or a second write leaves behind: a torn metrics line is survived, an export
destination is never a mix of two exports."""

import json
import os

import fsspec
import pytest

from alignflow.orchestrator.config.destinations import MARKER
from alignflow.job.stages.export import publish
from alignflow.job.train.metrics import MetricsLog


def test_a_resume_survives_a_torn_last_metrics_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = [json.dumps({"step": step, "loss": 1.0 / step}) for step in (1, 2, 3)]
    path.write_text("\n".join(whole) + '\n{"step": 4, "loss": 0.2')  # the job died writing step 4
    MetricsLog(tmp_path, tmp_path / "checkpoints", resumed_step=3).write({"step": 4, "loss": 0.25}, total_steps=4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    MetricsLog(tmp_path, tmp_path / "checkpoints", resumed_step=2)  # a resume from an earlier checkpoint
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def an_export(root, shards: int, tag: str):
    """An export folder as the export stage writes it: shards, an index when sharded, config.json."""
    root.mkdir(parents=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)] if shards > 1 else ["model.safetensors"]
    for name in names:
        (root / name).write_text(f"{tag} weights")
    if shards > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": names[0]}, "tag": tag}))
    (root / "config.json").write_text(json.dumps({"tag": tag}))
    (root / "tokenizer.json").write_text(tag)
    return {name: (root / name).read_text() for name in os.listdir(root)}


def published(fs, root: str) -> dict[str, str]:
    """The files a publish put at `root`, its marker aside (tests/test_export_destination.py checks that)."""
    return {path[len(root) + 1 :]: fs.cat_file(path).decode() for path in fs.find(root) if path != f"{root}/{MARKER}"}


def test_a_local_destination_is_replaced_whole(tmp_path):
    first, second = an_export(tmp_path / "a", 3, "first"), an_export(tmp_path / "b", 1, "second")
    dest = tmp_path / "published" / "model"
    publish(str(tmp_path / "a"), str(dest))
    assert published(fsspec.filesystem("file"), str(dest)) == first
    publish(str(tmp_path / "b"), str(dest))
    assert published(fsspec.filesystem("file"), str(dest)) == second  # no shard of the first is left
    assert os.listdir(tmp_path / "published") == ["model"]


def test_a_failed_publish_leaves_the_old_export_whole(tmp_path):
    first = an_export(tmp_path / "a", 3, "first")
    an_export(tmp_path / "b", 2, "second")
    broken = tmp_path / "b" / "model-00002-of-00002.safetensors"
    broken.unlink()
    broken.symlink_to(tmp_path / "gone")  # listed, but unreadable halfway through the copy
    dest = tmp_path / "published" / "model"
    publish(str(tmp_path / "a"), str(dest))
    with pytest.raises(OSError):
        publish(str(tmp_path / "b"), str(dest))
    assert published(fsspec.filesystem("file"), str(dest)) == first
    assert os.listdir(tmp_path / "published") == ["model"]


def test_an_s3_destination_holds_only_the_last_export(s3_endpoint, tmp_path):
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True, use_listings_cache=False)
    first, second = an_export(tmp_path / "a", 3, "first"), an_export(tmp_path / "b", 1, "second")
    dest = f"test/published/{tmp_path.name}"
    fsspec.config.conf["s3"] = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    try:
        publish(str(tmp_path / "a"), f"s3://{dest}")
        assert published(fs, dest) == first
        publish(str(tmp_path / "b"), f"s3://{dest}")
        assert published(fs, dest) == second
    finally:
        fsspec.config.conf.pop("s3")
