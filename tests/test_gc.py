"""`align gc` reclaims exactly what nothing needs and nothing else: never a path that is not
alignflow's, never a live run's staging, never an output a kept run (or a kept output) needs;
its dry run changes no byte; `align plan` shows the store's size. On a local store and on S3.

The stores hold real outputs (prep's Parquet, convert's torch_dist model, a training output
with checkpoints) committed through `Store.commit` (so verified), one prep committed by the
real runner, run records written by `alignflow.orchestrator.runs`, and a lease held by a live heartbeat."""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import fsspec
import pytest
import torch
from rich.filesize import decimal

from alignflow.orchestrator import runs
from alignflow.job.model_files.dist_io import DistCheckpointReader
from alignflow.orchestrator.config.compose import compose
from alignflow.job.data.prepared import Prepared
from alignflow.orchestrator.gc import CATEGORIES
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import plan, run_stage
from alignflow.orchestrator.kinds import OUTPUTS
from alignflow.orchestrator.store import TRAINING_STATE, Store
from flows.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import convert_demo, prep_demo  # noqa: E402

TTL_S = 2.0
DAY_S = 86400.0


def fp(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


P_OLD, C, C_OLD, S, S_OLD, DEAD, RECENT, LIVE, HALF = (fp(n) for n in ("p_old", "c", "c_old", "s", "s_old", "dead", "recent", "live", "half"))


@pytest.fixture(scope="module")
def assets(demo_dir, tmp_path_factory):
    """Real outputs to copy into the stores: prep's (Parquet) and convert's (torch_dist)."""
    root = tmp_path_factory.mktemp("assets")
    return {"prep": prep_demo(demo_dir, root / "prep"), "model": convert_demo(demo_dir, root / "model")}


def stamp(days_ago: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - days_ago * DAY_S))


def put(store: Store, source: Path, dest: str) -> None:
    store.fs.put(f"{source}/", f"{dest}/", recursive=True)


def commit(
    store: Store,
    stage: str,
    key: str,
    source: Path,
    output: str,
    days_ago: float,
    inputs: dict,
    checkpoints: bool = False,
    training_state: bool = False,
) -> None:
    """`source` committed as `stage`'s output `key` (a training output's with a checkpoint of its
    model, as commits before #22 kept them, or as the one its config asked to keep)."""
    staging = store.staging_path(stage, key)
    put(store, source, staging)
    if checkpoints:
        put(store, source / "model", f"{staging}/checkpoints/step-00000002/model")
        store.fs.pipe(f"{staging}/checkpoints/step-00000002/trainer.json", b'{"step": 2}')
        store.fs.pipe(f"{staging}/checkpoints/step-00000002/complete", b"")
    manifest = {
        "stage": stage,
        "fingerprint": key,
        "inputs": {up: {"fingerprint": f} for up, f in inputs.items()},
        "files": store.staged_files(stage, key),
        "committed_at": stamp(days_ago),
    }
    if training_state:
        manifest[TRAINING_STATE] = "checkpoints/step-00000002"
    store.commit(stage, key, manifest, OUTPUTS[output])


def build(store: Store, assets: dict, prep: str) -> None:
    """What both stores hold besides the runner's prep output `prep` (see the module doc)."""
    fs = store.fs
    commit(store, "prep", P_OLD, assets["prep"], "prep", 30, {})
    commit(store, "convert", C, assets["model"], "model", 30, {})
    commit(store, "convert", C_OLD, assets["model"], "model", 30, {})
    commit(store, "sft", S, assets["model"], "model", 30, {"prep": prep, "convert": C}, checkpoints=True)
    commit(store, "sft", S_OLD, assets["model"], "model", 30, {"prep": P_OLD, "convert": C_OLD}, checkpoints=True)
    for key in (DEAD, LIVE):  # a dead run's staging, and a live one's: checkpoints both
        put(store, assets["model"] / "model", f"{store.staging_path('sft', key)}/checkpoints/step-00000001/model")
    put(store, assets["prep"] / "sft", f"{store.staging_path('prep', prep)}/sft")  # a committed fingerprint's staging left behind
    put(store, assets["model"] / "hf", f"{store.output_path('sft', HALF)}/hf")  # an output whose commit (or deletion) was cut short
    for rel, text in (
        ("notes.txt", b"the user's own notes"),
        ("datasets/raw.jsonl", b'{"text": "the user\'s data"}\n'),
        ("sft/README.md", b"the user's note beside alignflow's outputs"),
        (f"{runs.RUNS}/notes.txt", b"not a run record"),
        (f"cache/{fp('a user')}/blob", b"a hash-named folder of the user's"),
    ):
        fs.makedirs(store.path(rel).rsplit("/", 1)[0], exist_ok=True)
        fs.pipe(store.path(rel), text)
    runs.write(store, "old run", {"stages": [{"name": "prep", "fingerprint": P_OLD}, {"name": "sft", "fingerprint": S_OLD}]})


def write_new_run(store: Store, prep: str) -> None:
    runs.write(
        store,
        "new run",
        {
            "stages": [
                {"name": "prep", "fingerprint": prep},
                {"name": "sft", "fingerprint": S},
                {"name": "eval", "state": "Failed", "fingerprint": ""},
            ]
        },
    )


def snapshot(store: Store, skip: str) -> dict[str, bytes]:
    """Every file under the root (relative path -> content), but `skip` (a live lease, which beats)."""
    fs, root = store.fs, store.path()
    fs.invalidate_cache()
    files = [p for p in fs.find(root) if p != skip]
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in files}


def under(tree: dict[str, bytes], rel: str) -> dict[str, bytes]:
    return {p: b for p, b in tree.items() if p == rel or p.startswith(f"{rel}/")}


def gc(capsys, overrides: list[str], *flags: str) -> dict:
    capsys.readouterr()
    assert main(["gc", "--json", *flags, *overrides]) == 0
    return json.loads(capsys.readouterr().out)


def check_gc(capsys, store: Store, overrides: list[str], expected: dict[str, set[str]], foreign: set[str]) -> dict:
    """The dry run lists `expected` (category -> paths relative to the root) with their sizes and
    changes nothing; `--yes` deletes exactly those, rewriting sft S's manifest; returns the dry run."""
    live_lease = store.lease_path("sft", LIVE)
    before = snapshot(store, live_lease)
    dry = gc(capsys, overrides)
    assert snapshot(store, live_lease) == before  # byte for byte
    root = store.path()
    listed = {c: {i["path"][len(root) + 1 :]: i["bytes"] for i in dry["reclaim"][c]["items"]} for c in CATEGORIES}
    assert {c: set(paths) for c, paths in listed.items()} == expected
    for category, paths in listed.items():
        for rel, nbytes in paths.items():
            assert nbytes == sum(len(b) for b in under(before, rel).values()) > 0, rel
        assert dry["reclaim"][category]["bytes"] == sum(paths.values())
    assert set(dry["foreign"]) == foreign and dry["dry_run"] and not dry["deleted"]
    assert dry["reclaim_bytes"] == sum(sum(paths.values()) for paths in listed.values())

    done = gc(capsys, overrides, "--yes")
    after = snapshot(store, live_lease)
    gone = {p for rels in expected.values() for rel in rels for p in under(before, rel)}
    assert set(after) == set(before) - gone
    manifest_path = f"sft/{S}/_SUCCESS.json"
    assert {p for p in after if after[p] != before[p]} == {manifest_path}
    old, new = (json.loads(tree[manifest_path]) for tree in (before, after))
    dropped = [f for f in old["files"] if f["path"].startswith("checkpoints/")]
    assert dropped and new["files"] == [f for f in old["files"] if f not in dropped]
    assert new["reclaimed"]["checkpoints/"]["bytes"] == sum(len(b) for b in under(before, f"sft/{S}/checkpoints").values())
    assert {k: v for k, v in new.items() if k not in ("files", "reclaimed")} == {k: v for k, v in old.items() if k != "files"}
    assert sorted(done["deleted"]) == sorted(i["path"] for c in CATEGORIES for i in dry["reclaim"][c]["items"])
    for rel in foreign:
        assert under(after, rel) == under(before, rel) != {}
    assert under(after, f"sft/_staging/{LIVE}") == under(before, f"sft/_staging/{LIVE}") != {}

    again = gc(capsys, overrides)
    assert again["reclaim_bytes"] == 0 and again["outputs"] == dry["outputs"] - len(expected["outputs"])
    return dry


def same_weights(a: str, b: str) -> bool:
    first, second = DistCheckpointReader(a), DistCheckpointReader(b)
    return set(first.keys()) == set(second.keys()) and all(torch.equal(first.read(k), second.read(k)) for k in first.keys())


def age(path: Path, days: float) -> None:
    """Set the mtime of `path` and everything in it `days` back."""
    then = time.time() - days * DAY_S
    for item in [path, *path.rglob("*")]:
        os.utime(item, (then, then))


@pytest.mark.slow
def test_gc_on_a_local_store(capsys, base_overrides, assets, tmp_path):
    overrides = [*base_overrides, f"store.lease_ttl_s={TTL_S}", "store.retention.keep_runs=1"]
    cfg = compose("demo", overrides)
    store = Store(cfg.store.root, {})
    prep = run_stage(Pipeline.build(cfg)["prep"], {}, log=lambda line: None).fingerprint  # the real runner's commit
    build(store, assets, prep)
    root = Path(store.path())
    age(root / runs.RUNS, 30)
    write_new_run(store, prep)
    put(store, assets["model"] / "model", f"{store.staging_path('sft', RECENT)}/checkpoints/step-00000001/model")
    for key, days in ((DEAD, 20), (LIVE, 20), (RECENT, 1)):
        age(root / "sft" / "_staging" / key, days)
    put(store, root / "sft" / S, str(root / "sft" / f"{S}.replaced-0badc0de"))  # an interrupted forced commit's old output
    (root / "sft" / "_leases").mkdir(parents=True, exist_ok=True)
    (root / "sft" / "_leases" / f"{HALF}.json.stale-0badc0de").write_text('{"owner": "a dead run"}')  # an interrupted takeover's
    time.sleep(TTL_S + 0.5)  # leftovers are judged after a lease ttl
    with store.lease("sft", LIVE, ttl_s=TTL_S, poll_s=0.1, log=lambda line: None) as lease:
        assert lease is not None
        dry = check_gc(
            capsys,
            store,
            overrides,
            {
                "staging": {f"sft/_staging/{DEAD}", f"prep/_staging/{prep}"},
                "leftovers": {f"sft/{HALF}", f"sft/{S}.replaced-0badc0de", f"sft/_leases/{HALF}.json.stale-0badc0de"},
                "checkpoints": {f"sft/{S}/checkpoints"},
                "outputs": {f"prep/{P_OLD}", f"convert/{C_OLD}", f"sft/{S_OLD}"},
            },
            foreign={"notes.txt", "datasets", "cache", "sft/README.md", "_runs/notes.txt"},
        )
        assert dry["kept"] == {
            "named by one of the newest 1 runs": 2,
            "upstream of a kept output": 1,
            "its lease is live (a run is producing it)": 1,
            "a dead run's, changed within 14 days (a rerun resumes from it)": 1,
        }
    assert [row.status for row in plan(Pipeline.build(cfg)) if row.stage == "prep"] == ["committed"]  # still a cache hit
    assert Prepared(store.output_path("prep", prep)).require("sft").num_rows > 0
    assert same_weights(f"{store.output_path('sft', S)}/model", f"{assets['model']}/model")
    assert store.read_manifest("convert", C) is not None and store.read_manifest("convert", C_OLD) is None


@pytest.mark.slow
def test_plan_shows_the_store_size_and_what_gc_would_reclaim(capsys, base_overrides, assets):
    overrides = [*base_overrides, "store.retention.keep_runs=0"]
    store = Store(compose("demo", overrides).store.root, {})
    commit(store, "convert", C, assets["model"], "model", 30, {})
    commit(store, "sft", S, assets["model"], "model", 0, {"convert": C}, checkpoints=True)
    store.fs.pipe(store.path("notes.txt"), b"the user's own notes")
    capsys.readouterr()
    assert main(["plan", "--json", "pipeline=demo", *overrides]) == 0
    shown = json.loads(capsys.readouterr().out)
    files = {p: info["size"] for p, info in store.fs.find(store.path(), detail=True).items()}
    ours = sum(size for p, size in files.items() if not p.endswith("notes.txt"))
    checkpoints = sum(size for p, size in files.items() if f"/{S}/checkpoints/" in p)
    assert {k: shown["store"][k] for k in ("bytes", "outputs", "staging", "reclaim_bytes", "foreign")} == {
        "bytes": ours,
        "outputs": 2,
        "staging": 0,
        "reclaim_bytes": checkpoints,
        "foreign": {"notes.txt": 20},
    }
    assert [row["stage"] for row in shown["stages"]] == ["prep", "convert", "sft", "eval", "export"]
    assert main(["plan", "pipeline=demo", *overrides]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == shown["store"]["line"]
    assert lines[-1].startswith(f"store {store.path()}: {decimal(ours)} in 2 outputs (") and "0 staging folders" in lines[-1]
    assert lines[-1].endswith(f"; 1 path not alignflow's (20 bytes); align gc would reclaim {decimal(checkpoints)}")


@pytest.mark.slow
def test_gc_on_s3(capsys, s3_endpoint, base_overrides, assets, monkeypatch):
    """The same on S3, where no object can be backdated: keep_days=0, so a dead run's staging goes
    at once and only runs and upstreams keep outputs."""
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    monkeypatch.setitem(fsspec.config.conf, "s3", options)  # readers open s3:// URIs with fsspec's defaults
    overrides = [
        *base_overrides,
        "store.root=s3://test/gcstore",
        f"+store.storage_options.client_kwargs.endpoint_url={s3_endpoint}",
        f"store.lease_ttl_s={TTL_S}",
        "store.retention.keep_runs=1",
        "store.retention.keep_days=0",
    ]
    store = Store("s3://test/gcstore", options)
    prep = fp("prep")
    commit(store, "prep", prep, assets["prep"], "prep", 0, {})
    build(store, assets, prep)
    time.sleep(1.1)  # S3 times have a resolution of a second: the new run record is the newest
    write_new_run(store, prep)
    time.sleep(TTL_S + 0.5)
    with store.lease("sft", LIVE, ttl_s=TTL_S, poll_s=0.1, log=lambda line: None) as lease:
        assert lease is not None
        check_gc(
            capsys,
            store,
            overrides,
            {
                "staging": {f"sft/_staging/{DEAD}", f"prep/_staging/{prep}"},
                "leftovers": {f"sft/{HALF}"},
                "checkpoints": {f"sft/{S}/checkpoints"},
                "outputs": {f"prep/{P_OLD}", f"convert/{C_OLD}", f"sft/{S_OLD}"},
            },
            foreign={"notes.txt", "datasets", "cache", "sft/README.md", "_runs/notes.txt"},
        )
    assert Prepared(store.uri(store.output_path("prep", prep))).require("sft").num_rows > 0
    assert same_weights(store.uri(f"{store.output_path('sft', S)}/model"), f"{assets['model']}/model")
    assert store.read_manifest("convert", C) is not None and store.read_manifest("convert", C_OLD) is None


BAD_RETENTION = {
    "store.retention.keep_days=-1": "store.retention.keep_days: must be >= 0, got -1.0",
    "store.retention.keep_runs=-3": "store.retention.keep_runs: must be >= 0, got -3",
    "store.retention.keep_days=nan": "store.retention.keep_days: must be >= 0, got nan",
    "store.retention.keep_runs=2.5": "store.retention.keep_runs=2.5",
    "store.retention.keep_checkpoints=sometimes": "store.retention.keep_checkpoints=sometimes",
    "store.retention.keep_weeks=2": "store.retention.keep_weeks",
}


@pytest.mark.parametrize("override", BAD_RETENTION)
def test_a_bad_retention_is_refused_naming_its_key_and_nothing_is_deleted(override, capsys, base_overrides, assets):
    store = Store(compose(None, base_overrides, check_paths=False).store.root, {})
    commit(store, "sft", S, assets["model"], "model", 30, {}, checkpoints=True)  # gc would reclaim all of it
    before = snapshot(store, skip="")
    capsys.readouterr()
    assert main(["gc", "--yes", *base_overrides, override]) == 2
    assert BAD_RETENTION[override] in capsys.readouterr().out
    assert snapshot(store, skip="") == before


def test_keep_checkpoints_keeps_a_kept_outputs_checkpoints(capsys, base_overrides, assets):
    store = Store(compose(None, base_overrides, check_paths=False).store.root, {})
    commit(store, "sft", S, assets["model"], "model", 0, {}, checkpoints=True)
    assert gc(capsys, base_overrides)["reclaim"]["checkpoints"]["count"] == 1
    assert gc(capsys, [*base_overrides, "store.retention.keep_checkpoints=true"], "--yes")["reclaim_bytes"] == 0
    assert store.fs.exists(f"{store.output_path('sft', S)}/checkpoints/step-00000002/complete")


def test_a_final_checkpoint_its_config_asked_to_keep_stays(capsys, base_overrides, assets):
    """An output committed with `checkpoint.keep_optimizer` (its manifest names its training_state)
    keeps its checkpoint; one committed with its checkpoints before the commit left them out does not."""
    store = Store(compose(None, base_overrides, check_paths=False).store.root, {})
    commit(store, "sft", S, assets["model"], "model", 0, {}, checkpoints=True)
    commit(store, "dpo", S, assets["model"], "model", 0, {}, checkpoints=True, training_state=True)
    done = gc(capsys, base_overrides, "--yes")
    assert [(i["stage"], i["category"]) for c in CATEGORIES for i in done["reclaim"][c]["items"]] == [("sft", "checkpoints")]
    assert store.fs.exists(f"{store.output_path('dpo', S)}/checkpoints/step-00000002/complete")
    assert not store.fs.exists(f"{store.output_path('sft', S)}/checkpoints")
