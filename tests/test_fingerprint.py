"""Fingerprints change with everything that changes an output, and with nothing else."""

import json

import pytest

from alignflow.config import compose
from alignflow.fingerprint import canonical_json, source_identity
from alignflow.runner import plan, stage_fingerprint


def fp(overrides, stage="prep", upstream=None):
    return stage_fingerprint(compose("sft_dpo", overrides), stage, upstream or {})


def test_canonical_json_is_order_independent_and_refuses_unknown_types():
    assert canonical_json({"b": 1, "a": [1, 2]}) == canonical_json({"a": [1, 2], "b": 1})
    with pytest.raises(TypeError, match="cannot fingerprint"):
        canonical_json({"x": object()})
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_prep_identity_follows_its_config_slice(base_overrides):
    base = fp(base_overrides)
    assert fp(base_overrides) == base
    assert fp([*base_overrides, "data.seq_length=128"]) != base
    assert fp([*base_overrides, "prep.skip_bad_rows=true"]) != base
    assert fp([*base_overrides, "prep.retries=5"]) == base  # marked not-identity
    assert fp([*base_overrides, "launcher=slurm"]) == base  # where it runs is not what it is
    assert fp([*base_overrides, "sft.optim.lr=1.0"]) == base  # another stage's section


def test_training_identity_ignores_log_interval_but_not_lr(base_overrides):
    base = fp(base_overrides, "sft", {"prep": "a", "convert": "b"})
    assert fp([*base_overrides, "sft.trainer.log_every_n_steps=1"], "sft", {"prep": "a", "convert": "b"}) == base
    assert fp([*base_overrides, "sft.optim.lr=1e-3"], "sft", {"prep": "a", "convert": "b"}) != base
    assert fp(base_overrides, "sft", {"prep": "a", "convert": "c"}) != base


def test_a_changed_source_file_changes_the_fingerprint(base_overrides, demo_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_bytes((demo_dir / "data" / "sft_train.jsonl").read_bytes())
    overrides = [*base_overrides, f"data.sft.train={data}"]
    before = fp(overrides)
    with open(data, "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1"}]}) + "\n")
    assert fp(overrides) != before


def test_source_identity_covers_directories_and_globs(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("1")
    (tmp_path / "d" / "b.jsonl").write_text("2")
    assert set(source_identity(str(tmp_path / "d"))) == {"a.jsonl", "b.jsonl"}
    assert set(source_identity(str(tmp_path / "d" / "*.jsonl"))) == {"a.jsonl", "b.jsonl"}
    with pytest.raises(FileNotFoundError):
        source_identity(str(tmp_path / "missing"))


def test_upstream_change_propagates_down_the_dag(base_overrides):
    a = {p.stage: p.fingerprint for p in plan(compose("sft_dpo", base_overrides))}
    b = {p.stage: p.fingerprint for p in plan(compose("sft_dpo", [*base_overrides, "data.seq_length=128"]))}
    assert a["prep"] != b["prep"] and a["sft"] != b["sft"] and a["dpo"] != b["dpo"]
    assert a["convert"] == b["convert"]  # does not read data
