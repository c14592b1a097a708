"""Fingerprints change with everything that changes an output (config, code, packages, sources,
inputs by role), and with nothing else."""

import json

import pytest

from alignflow.config import ConfigError, compose
from alignflow.fingerprint import canonical_json, code_identity, differences, fingerprint, source_identity
from alignflow.runner import plan, stage_fingerprint, stage_identity


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


def test_swapping_two_input_roles_changes_the_fingerprint(base_overrides):
    wired = lambda model, ref: compose("sft_grpo", [*base_overrides, f"pipeline.stages.grpo={{data:prep,model:{model},ref_model:{ref}}}"])  # noqa: E731
    upstream = {"prep": "p", "convert": "c", "sft": "s"}
    assert stage_fingerprint(wired("sft", "convert"), "grpo", upstream) != stage_fingerprint(wired("convert", "sft"), "grpo", upstream)


USER_PIPELINE = """# @package _global_
pipeline:
  name: mine
  stages:
    prep: {{}}
    convert: {{}}
    sft: {{data: prep, model: convert}}
    ref_logprobs: {{data: prep, model: sft}}
    dpo: {dpo}
"""


@pytest.mark.parametrize("dpo, message", [
    ("{data: prep, modle: sft, ref_logprobs: ref_logprobs}", r"pipeline\.stages\.dpo\.modle: stage dpo has no input role 'modle'; it takes data"),
    ("{data: prep, modle: sft, ref_logprobs: ref_logprobs}", r"pipeline\.stages\.dpo: missing input role 'model' \(required, one stage\)"),
    ("{data: prep, model: [sft, convert], ref_logprobs: ref_logprobs}", r"pipeline\.stages\.dpo\.model: takes one upstream stage, got \['sft', 'convert'\]"),
])
def test_a_wrong_input_role_fails_at_compose_naming_it(base_overrides, tmp_path, dpo, message):
    """In a user's own pipeline file (found through Hydra's search path), before any job."""
    (tmp_path / "conf" / "pipeline").mkdir(parents=True)
    (tmp_path / "conf" / "pipeline" / "mine.yaml").write_text(USER_PIPELINE.format(dpo=dpo))
    with pytest.raises(ConfigError, match=message):
        compose("mine", [*base_overrides, f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])


def write_module(root, name: str, text: str):
    path = root.joinpath(*name.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for package in [path.parent, *path.parent.parents][: name.count(".")]:
        (package / "__init__.py").touch()
    path.write_text(text)


def test_code_identity_follows_formulas_not_docstrings_or_comments(tmp_path):
    write_module(tmp_path, "alignflow.stages.toy", '"""A toy stage."""\nfrom alignflow.losses.toy import loss\nfrom alignflow.store import MANIFEST\n\n'
                                                   'def run(cfg, inputs, out):\n    return loss(2.0)\n')
    write_module(tmp_path, "alignflow.losses.toy", '"""The loss."""\n\ndef loss(x):\n    """Doubles."""\n    return 2 * x  # twice\n')
    write_module(tmp_path, "alignflow.store", "MANIFEST = '_SUCCESS.json'\nimport alignflow.lease\n")
    write_module(tmp_path, "alignflow.lease", "")
    before = code_identity("alignflow.stages.toy", root=tmp_path)
    assert set(before) == {"alignflow/stages/toy.py", "alignflow/losses/toy.py", "alignflow/losses/__init__.py"}  # not the store's

    loss_file = tmp_path / "alignflow" / "losses" / "toy.py"
    loss_file.write_text('"""The loss, reworded."""\n\n# a new comment\ndef loss(x):\n    """Doubles its input."""\n    return 2 * x  # twice, said again\n')
    assert code_identity("alignflow.stages.toy", root=tmp_path) == before

    loss_file.write_text('"""The loss."""\n\ndef loss(x):\n    """Doubles."""\n    return 3 * x\n')
    after = code_identity("alignflow.stages.toy", root=tmp_path)
    assert [path for path in before if after[path] != before[path]] == ["alignflow/losses/toy.py"]
    assert differences({"code": after}, {"code": before}) == ["code alignflow/losses/toy.py: changed"]


def test_package_versions_are_part_of_identity(base_overrides):
    cfg = compose("sft_dpo", base_overrides)
    ident = stage_identity(cfg, "sft", {"prep": "a", "convert": "b"})
    assert set(ident["packages"]) == {"torch", "megatron-core", "transformers", "tokenizers"}
    bumped = {**ident, "packages": {**ident["packages"], "torch": "9.9.9"}}
    assert fingerprint(bumped) != fingerprint(ident)
    assert differences(bumped, ident) == [f"package torch: {ident['packages']['torch']} -> 9.9.9"]
