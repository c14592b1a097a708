"""An export never destroys: it publishes only into an absent or empty folder or over its own
previous export (named by the marker it writes), deletes nothing but the files that marker
lists, and never publishes over or into the store, a source, the launcher folder or another
export's destination. Refusals come at compose time naming the key, and again in the job."""

import json
import os

import fsspec
import pytest

from alignflow.orchestrator.config.compose import ConfigError, build, compose
from alignflow.orchestrator.config.destinations import MARKER, DestinationError
from alignflow.orchestrator.launch import StageFailed
from alignflow.orchestrator.runner import run_stage
from alignflow.job.stages.export import publish
from flows.cli import main

ORIGIN = {"instance": "export", "fingerprint": "f00d", "model": "/store/sft/beef"}


def an_export(root, tag: str, shards: int = 1) -> None:
    """An export folder as the export stage writes it: shards, config.json, tokenizer files."""
    root.mkdir(parents=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)] if shards > 1 else ["model.safetensors"]
    for name in names:
        (root / name).write_bytes(f"{tag} weights".encode())
    (root / "config.json").write_text(json.dumps({"tag": tag}))
    (root / "tokenizer.json").write_text(tag)


def files(root) -> dict[str, bytes]:
    """Every file under `root` (local) and its bytes."""
    root = str(root)
    return {os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read() for d, _, names in os.walk(root) for n in names}


def marker(fs, root: str) -> dict:
    return json.loads(fs.cat_file(f"{root}/{MARKER}"))


# ----------------------------------------------------------------------------- publish, local


def test_an_absent_or_empty_destination_gets_the_export_and_a_marker_listing_it(tmp_path):
    an_export(tmp_path / "a", "first", shards=3)
    for dest in (tmp_path / "absent" / "model", tmp_path / "empty"):
        if dest.name == "empty":
            dest.mkdir()
        publish(str(tmp_path / "a"), str(dest), "export.destination", ORIGIN)
        published = files(dest)
        written = json.loads(published.pop(MARKER))
        assert published == files(tmp_path / "a")
        assert sorted(written["files"]) == sorted(published) and {k: written[k] for k in ORIGIN} == ORIGIN
        assert written["published_at"].endswith("Z")


def test_a_previous_export_is_replaced_file_for_file_and_what_is_beside_it_survives(tmp_path):
    an_export(tmp_path / "a", "first", shards=3)
    an_export(tmp_path / "b", "second")
    parent = tmp_path / "published"
    (parent / "other-model").mkdir(parents=True)
    (parent / "other-model" / "model.safetensors").write_bytes(b"theirs")
    (parent / "model.txt").write_text("a note that shares the destination's name as a prefix")
    beside = files(parent)
    publish(str(tmp_path / "a"), str(parent / "model"))
    publish(str(tmp_path / "b"), str(parent / "model"), "export.destination", ORIGIN)
    published = files(parent / "model")
    assert json.loads(published.pop(MARKER))["files"] == sorted(files(tmp_path / "b"))
    assert published == files(tmp_path / "b")  # no shard of the first export is left
    assert {name: data for name, data in files(parent).items() if not name.startswith("model/")} == beside
    assert sorted(os.listdir(parent)) == ["model", "model.txt", "other-model"]  # no temp folder left


def test_a_file_added_into_an_export_makes_it_not_only_ours_and_nothing_is_touched(tmp_path):
    an_export(tmp_path / "a", "first", shards=2)
    an_export(tmp_path / "b", "second")
    dest = tmp_path / "published" / "model"
    publish(str(tmp_path / "a"), str(dest))
    (dest / "NOTES.md").write_text("mine")
    (dest / "eval").mkdir()
    (dest / "eval" / "results.json").write_text("{}")
    before = files(tmp_path / "published")
    with pytest.raises(DestinationError) as err:
        publish(str(tmp_path / "b"), str(dest), "pipeline.stages.export_hf.destination")
    assert str(err.value).startswith(
        f"pipeline.stages.export_hf.destination: {dest} holds a previous export and files it did not publish (NOTES.md, eval/)"
    )
    assert "no longer alignflow's alone" in str(err.value)
    assert files(tmp_path / "published") == before and os.listdir(tmp_path / "published") == ["model"]


def test_a_foreign_folder_is_refused_and_every_file_stays(tmp_path):
    an_export(tmp_path / "a", "first")
    dest = tmp_path / "models"
    (dest / "other").mkdir(parents=True)
    (dest / "other" / "sentinel").write_bytes(b"\x00precious")
    with pytest.raises(DestinationError, match=r"^export\.destination: .* holds files alignflow did not publish \(other/\) and no "):
        publish(str(tmp_path / "a"), str(dest))
    assert files(dest) == {"other/sentinel": b"\x00precious"} and sorted(os.listdir(tmp_path)) == ["a", "models"]


def test_a_marker_that_lists_paths_outside_its_folder_is_not_trusted(tmp_path):
    an_export(tmp_path / "a", "first")
    (tmp_path / "victim").write_text("not the export's")
    dest = tmp_path / "models"
    dest.mkdir()
    (dest / MARKER).write_text(json.dumps({"files": ["../victim"]}))
    with pytest.raises(DestinationError, match=f"{MARKER} is not a marker alignflow wrote"):
        publish(str(tmp_path / "a"), str(dest))
    assert (tmp_path / "victim").read_text() == "not the export's" and os.listdir(dest) == [MARKER]


def test_a_file_as_destination_is_refused(tmp_path):
    an_export(tmp_path / "a", "first")
    (tmp_path / "model.bin").write_bytes(b"data")
    with pytest.raises(DestinationError, match=r"model\.bin is a file; an export publishes a folder"):
        publish(str(tmp_path / "a"), str(tmp_path / "model.bin"))
    assert (tmp_path / "model.bin").read_bytes() == b"data"


# ----------------------------------------------------------------------------- publish, S3


@pytest.fixture
def s3(s3_endpoint):
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    fsspec.config.conf["s3"] = options  # what the job's fsspec defaults are (alignflow.job.worker)
    yield fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **options)
    fsspec.config.conf.pop("s3")


def objects(fs, root: str) -> dict[str, bytes]:
    return {path[len(root) + 1 :]: fs.cat_file(path) for path in fs.find(root)}


def test_s3_publishes_with_a_marker_and_replaces_only_the_keys_it_listed(s3, tmp_path):
    an_export(tmp_path / "a", "first", shards=3)
    an_export(tmp_path / "b", "second")
    root = f"test/pub-{tmp_path.name}"
    s3.pipe({f"{root}/model-2/model.safetensors": b"theirs", f"{root}/model.txt": b"a neighbour by name", f"{root}/modelx": b"another"})
    neighbours = objects(s3, root)
    publish(str(tmp_path / "a"), f"s3://{root}/model", "export.destination", ORIGIN)
    assert {k: v for k, v in objects(s3, f"{root}/model").items() if k != MARKER} == files(tmp_path / "a")
    assert sorted(marker(s3, f"{root}/model")["files"]) == sorted(files(tmp_path / "a"))
    publish(str(tmp_path / "b"), f"s3://{root}/model", "export.destination", ORIGIN)
    published = objects(s3, f"{root}/model")
    assert json.loads(published.pop(MARKER))["files"] == sorted(files(tmp_path / "b"))
    assert published == files(tmp_path / "b")
    assert {k: v for k, v in objects(s3, root).items() if not k.startswith("model/")} == neighbours


def test_s3_refuses_a_foreign_prefix_and_a_key_added_into_an_export(s3, tmp_path):
    an_export(tmp_path / "a", "first")
    root = f"test/pub-{tmp_path.name}"
    s3.pipe(f"{root}/theirs/data/part-0.parquet", b"rows")
    with pytest.raises(DestinationError, match=r"^export\.destination: s3://.* holds files alignflow did not publish \(data/\)"):
        publish(str(tmp_path / "a"), f"s3://{root}/theirs")
    publish(str(tmp_path / "a"), f"s3://{root}/ours")
    s3.pipe(f"{root}/ours/card.md", b"mine")
    before = objects(s3, root)
    with pytest.raises(DestinationError, match=r"holds a previous export and files it did not publish \(card\.md\)"):
        publish(str(tmp_path / "a"), f"s3://{root}/ours")
    assert objects(s3, root) == before


# ----------------------------------------------------------------------------- at compose time


def refused(base_overrides, *overrides, pipeline="demo", check_paths=True) -> str:
    with pytest.raises(ConfigError) as err:
        compose(pipeline, [*base_overrides, *overrides], check_paths=check_paths)
    return str(err.value)


def nothing_written(tmp_path) -> bool:
    return not (tmp_path / "store").exists() and not (tmp_path / "jobs").exists()


def test_align_run_refuses_a_destination_holding_other_files(base_overrides, tmp_path, capsys):
    """The issue's case: `align run pipeline=demo export.destination=$W/models` with $W/models/other/sentinel."""
    (tmp_path / "models" / "other").mkdir(parents=True)
    (tmp_path / "models" / "other" / "sentinel").write_text("precious")
    assert main(["run", "pipeline=demo", *base_overrides, f"export.destination={tmp_path / 'models'}"]) == 2
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert f"export.destination: {tmp_path / 'models'} holds files alignflow did not publish (other/)" in out
    assert files(tmp_path / "models") == {"other/sentinel": b"precious"} and nothing_written(tmp_path)


def test_compose_refuses_a_previous_export_with_a_file_added_into_it(base_overrides, tmp_path):
    an_export(tmp_path / "a", "first")
    publish(str(tmp_path / "a"), str(tmp_path / "models"))
    (tmp_path / "models" / "NOTES.md").write_text("mine")
    before = files(tmp_path / "models")
    message = refused(base_overrides, f"export.destination={tmp_path / 'models'}")
    assert f"export.destination: {tmp_path / 'models'} holds a previous export and files it did not publish (NOTES.md)" in message
    assert files(tmp_path / "models") == before and nothing_written(tmp_path)
    compose("demo", [*base_overrides, f"export.destination={tmp_path / 'models'}"], check_paths=False)  # `align config` reads nothing


@pytest.mark.parametrize(
    "destination, overlap",
    [
        ("{tmp}/store/published", "is inside store.root ({tmp}/store)"),
        ("{tmp}", "contains store.root ({tmp}/store)"),
        ("{tmp}/jobs/model", "is inside launcher.folder ({tmp}/jobs)"),
        ("{tmp}/cache", "is store.cache_dir ({tmp}/cache)"),
        ("{demo}/tiny-llama", "is model.source ({demo}/tiny-llama)"),
        ("{demo}/tokenizer/exported", "is inside model.tokenizer ({demo}/tokenizer)"),
        ("{demo}/data", "contains data.sft.train ({demo}/data/sft_train.jsonl)"),
        ("{tmp}/link/published", "is inside store.root ({tmp}/store)"),  # a symlink to the store is the store
    ],
)
def test_a_destination_overlapping_what_the_pipeline_reads_or_writes_is_refused(base_overrides, demo_dir, tmp_path, destination, overlap):
    (tmp_path / "link").symlink_to(tmp_path / "store")  # dangling until something makes the store
    destination = destination.format(tmp=tmp_path, demo=demo_dir)
    before = files(demo_dir)
    message = refused(base_overrides, f"export.destination={destination}", f"store.cache_dir={tmp_path / 'cache'}")
    assert f"export.destination: {destination} {overlap.format(tmp=tmp_path, demo=demo_dir)}" in message
    assert "an export needs a folder of its own" in message
    assert nothing_written(tmp_path) and files(demo_dir) == before


def test_an_instance_source_and_another_export_instance_are_named_by_their_keys(base_overrides, demo_dir, tmp_path):
    student = demo_dir / "tiny-llama-student"
    message = refused(
        base_overrides,
        "pipeline.stages.export={inputs: {model: distillation}}",
        f"export.destination={student}",
        pipeline="distill",
        check_paths=False,
    )
    assert f"export.destination: {student} is pipeline.stages.convert_student.model.source ({student})" in message
    dest = tmp_path / "published"
    message = refused(
        base_overrides,
        f"export.destination={dest}",
        f"pipeline.stages.export_hf={{kind: export, inputs: {{model: convert}}, destination: {dest}/hf}}",
    )
    assert f"export.destination: {dest} contains pipeline.stages.export_hf.destination ({dest}/hf)" in message
    message = refused(base_overrides, f"export.destination={dest}", "pipeline.stages.export_hf={kind: export, inputs: {model: convert}}")
    assert f"export.destination: {dest} is pipeline.stages.export_hf.destination ({dest})" in message  # it takes export's
    assert nothing_written(tmp_path) and not dest.exists()


@pytest.mark.parametrize(
    "store, destination, overlap",
    [
        ("s3://test/store", "s3://test", "contains store.root (s3://test/store)"),  # a bucket's root
        ("s3://test/store", "s3a://test/store/models/", "is inside store.root (s3://test/store)"),
        ("s3://test/store/", "s3://test//store", "is store.root (s3://test/store/)"),
    ],
)
def test_object_store_destinations_overlap_by_bucket_and_prefix(base_overrides, store, destination, overlap):
    message = refused(base_overrides, f"store.root={store}", f"export.destination={destination}", check_paths=False)
    assert f"export.destination: {destination} {overlap}" in message


def test_object_store_prefixes_that_only_share_characters_do_not_overlap(base_overrides):
    compose("demo", [*base_overrides, "store.root=s3://test/store", "export.destination=s3://test/store-published"], check_paths=False)
    compose("demo", [*base_overrides, "store.root=s3://test/store", "export.destination=s3://other/store"], check_paths=False)


def test_an_s3_destination_is_read_at_compose(s3, base_overrides, s3_endpoint, tmp_path):
    s3.pipe(f"test/theirs-{tmp_path.name}/weights.bin", b"theirs")
    message = refused(base_overrides, f"export.destination=s3://test/theirs-{tmp_path.name}")
    assert f"export.destination: s3://test/theirs-{tmp_path.name} holds files alignflow did not publish (weights.bin)" in message
    assert s3.cat_file(f"test/theirs-{tmp_path.name}/weights.bin") == b"theirs"


# ----------------------------------------------------------------------------- the real stage, in its job


@pytest.mark.slow
def test_the_export_stage_publishes_twice_and_checks_again_in_its_job(base_overrides, tmp_path):
    """convert -> export to a local destination; again with another dtype (a new fingerprint),
    which replaces it; then a second export instance to the same destination, which the
    destination's owner filled between compose and the job: its job fails with the message
    compose gives, and nothing there changes."""
    dest = tmp_path / "published" / "model"
    (tmp_path / "published").mkdir()
    (tmp_path / "published" / "README.md").write_text("beside the export")
    results = {}
    for dtype in ("float32", "bfloat16"):
        pipeline = build("convert", [*base_overrides, f"export.destination={dest}", f"export.dtype={dtype}"])
        results["convert"] = run_stage(pipeline["convert"], {}, log=print)
        export = run_stage(pipeline["export"], {"convert": results["convert"]}, log=print)
        assert not export.cached
        output = files(tmp_path / "store" / "export" / export.fingerprint)
        output.pop("_SUCCESS.json")
        published = files(dest)
        written = json.loads(published.pop(MARKER))
        assert published == output and dtype in json.loads(published["config.json"]).values()
        assert {k: written[k] for k in ("instance", "fingerprint", "model")} == {
            "instance": "export",
            "fingerprint": export.fingerprint,
            "model": results["convert"].uri,
        }
        assert sorted(written["files"]) == sorted(output)
    assert sorted(os.listdir(tmp_path / "published")) == ["README.md", "model"]

    second = ["export.destination=null", f"pipeline.stages.export_hf={{kind: export, inputs: {{model: convert}}, destination: {dest}}}"]
    pipeline = build("convert", [*base_overrides, *second])  # a previous export: accepted
    (dest / "eval.json").write_text("{}")  # ... and then someone adds a file into it
    before = files(tmp_path / "published")
    with pytest.raises(StageFailed) as err:
        run_stage(pipeline["export_hf"], {"convert": results["convert"]}, log=print)
    expected = refused(base_overrides, *second, pipeline="convert").split("\n  - ")[1]
    assert expected.startswith(f"pipeline.stages.export_hf.destination: {dest} holds a previous export and files it did not publish (eval.json)")
    assert expected in str(err.value).splitlines()[0]
    assert files(tmp_path / "published") == before
    assert not list((tmp_path / "store" / "export_hf").glob("*/_SUCCESS.json"))
