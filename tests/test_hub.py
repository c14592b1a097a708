"""Hugging Face Hub ids as `model.source`, resolved from a local HF cache without network: a
cache laid out as huggingface_hub lays it out (blobs, snapshots of symlinks, refs), checked
by huggingface_hub's own `scan_cache_dir`, with the demo's tiny model inside."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir

from alignflow import PROJECT_ROOT

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_with(cache: Path, repo: str, folder: Path, commit: str = COMMIT, branch: str = "main") -> Path:
    """`folder`'s files as huggingface_hub stores a download of `repo` at `commit` (`branch` names it)."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    for file in folder.iterdir():
        blob = repo_dir / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        (snapshot / file.name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / branch).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(demo_dir, tmp_path_factory):
    """An HF_HOME whose hub cache holds `tiny/llama` (the demo's model and tokenizer in one repo)."""
    home = tmp_path_factory.mktemp("hf-home")
    both = tmp_path_factory.mktemp("repo")
    for part in ("tiny-llama", "tokenizer"):
        for file in (demo_dir / part).iterdir():
            shutil.copyfile(file, both / file.name)
    cache_with(home / "hub", "tiny/llama", both)
    (repo,) = scan_cache_dir(home / "hub").repos  # huggingface_hub reads it as one of its own
    assert repo.repo_id == "tiny/llama" and {r.commit_hash for r in repo.revisions} == {COMMIT}
    return home


def align(*args: str, hf_home: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "0"}  # offline or not, nothing is asked of the network
    env.pop("HF_HUB_CACHE", None)
    run = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 or not check, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_a_hub_id_resolves_to_its_cached_snapshot(hf_home, base_overrides):
    snapshot = hf_home / "hub" / "models--tiny--llama" / "snapshots" / COMMIT
    shown = align("config", "pipeline=convert", *base_overrides, "model.source=tiny/llama", "model.tokenizer=tiny/llama", hf_home=hf_home).stdout
    assert f"source: {snapshot}\n" in shown and f"tokenizer: {snapshot}\n" in shown
    by_id = json.loads(align("plan", "--json", "pipeline=convert", *base_overrides, "model.source=tiny/llama", hf_home=hf_home).stdout)
    by_path = json.loads(align("plan", "--json", "pipeline=convert", *base_overrides, f"model.source={snapshot}", hf_home=hf_home).stdout)
    assert [s["fingerprint"] for s in by_id["stages"]] == [s["fingerprint"] for s in by_path["stages"]]  # the very same source


def test_a_revision_picks_its_snapshot_and_an_unknown_one_is_refused(hf_home, base_overrides):
    snapshot = hf_home / "hub" / "models--tiny--llama" / "snapshots" / COMMIT
    shown = align("config", "pipeline=convert", *base_overrides, f"model.source=tiny/llama@{COMMIT}", hf_home=hf_home).stdout
    assert f"source: {snapshot}\n" in shown
    refused = align("plan", "pipeline=convert", *base_overrides, "model.source=tiny/llama@v2", hf_home=hf_home, check=False)
    assert refused.returncode == 2 and "model.source: tiny/llama@v2 is not in the local Hugging Face cache" in refused.stdout
    assert "hf download tiny/llama --revision v2" in refused.stdout


def test_a_model_not_in_the_cache_is_refused_naming_the_id_and_the_cache(hf_home, base_overrides):
    run = align(
        "plan", "pipeline=convert", *base_overrides, "model.source=Qwen/Qwen3-8B", "model.tokenizer=Qwen/Qwen3-8B", hf_home=hf_home, check=False
    )
    assert run.returncode == 2
    said = " ".join(run.stdout.split())  # rich wraps long lines
    assert f"model.source: Qwen/Qwen3-8B is not in the local Hugging Face cache {hf_home / 'hub'} (HF_HUB_CACHE / HF_HOME)" in said
    assert "run `hf download Qwen/Qwen3-8B`" in said and "model.tokenizer" not in said  # the tokenizer is the source: said once


def test_a_preset_s_numbers_must_agree_with_the_cached_checkpoint(hf_home, base_overrides):
    """Once a preset's checkpoint is in the cache its config.json sizes it, and a preset that
    describes another model is refused."""
    run = align("plan", *base_overrides, "model=qwen3_8b", "model.source=tiny/llama", "launcher.gpu_memory_gib=null", hf_home=hf_home, check=False)
    said = " ".join(run.stdout.split())
    assert run.returncode == 2 and "model.architecture.hidden_size: 4096, but" in said and "says 64" in said
    agreed = align(
        "plan",
        "--json",
        *base_overrides,
        "model=qwen3_8b",
        "model.source=tiny/llama",
        "model.architecture=null",
        "launcher.gpu_memory_gib=null",
        hf_home=hf_home,
    )
    memory = json.loads(agreed.stdout)["memory"]
    assert memory["sft"]["shape_from"] == "config.json" and memory["sft"]["total"] < 1


def test_a_path_that_exists_is_never_taken_for_a_hub_id(tmp_path, monkeypatch):
    from alignflow.orchestrator.config.hub import is_hub_id

    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("Qwen/Qwen3-8B@main")
    (tmp_path / "Qwen" / "Qwen3-8B").mkdir(parents=True)
    assert not is_hub_id("Qwen/Qwen3-8B")
    assert not any(map(is_hub_id, ("/models/x", "s3://bucket/model", "./a/b", "a/b/c", "../a/b")))
