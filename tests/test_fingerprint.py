"""Fingerprints change with everything that changes an output (config, code, packages, sources,
inputs by role), and with nothing else."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from alignflow import PROJECT_ROOT
from alignflow.orchestrator.config.compose import ConfigError, build, compose
from alignflow.orchestrator.fingerprint import canonical_json, code_identity, differences, fingerprint, source_identity
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import plan, stage_identity


def fp(overrides, stage="prep", upstream=None):
    """Without the compose checks of paths and tools (launcher=slurm needs no sbatch here)."""
    return fingerprint(stage_identity(build("sft_dpo", overrides, check_paths=False)[stage], upstream or {}))


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


def test_the_layout_is_not_identity_but_the_distributed_optimizer_is(base_overrides):
    """A stage re-run at another TP/PP/DP size keeps its fingerprint, so it resumes its checkpoints resharded."""
    base = fp(base_overrides, "sft", {"prep": "a", "convert": "b"})
    relaid = [
        "sft.resources.tasks_per_node=4",
        "sft.parallel.tensor_model_parallel_size=2",
        "sft.parallel.pipeline_model_parallel_size=2",
        "sft.recompute_granularity=full",
    ]
    assert fp([*base_overrides, *relaid], "sft", {"prep": "a", "convert": "b"}) == base
    assert fp([*base_overrides, "sft.parallel.use_distributed_optimizer=true"], "sft", {"prep": "a", "convert": "b"}) != base


@pytest.mark.parametrize("stage", ["sft", "ref_logprobs"])
def test_precision_auto_is_hashed_as_the_precision_it_resolves_to(base_overrides, stage):
    """`auto` on a launcher that declares GPUs is bf16, on CPU fp32: a CPU output is never
    served for a GPU request, and `auto` on GPU is the same output as an explicit `bf16`."""
    upstream = {"prep": "a", "convert": "b", "sft": "c"}
    gpu = ["launcher=slurm", "launcher.gpus_per_node=1"]
    of = lambda *overrides: fp([*base_overrides, *overrides], stage, upstream)  # noqa: E731
    on_cpu, on_gpu = of(), of(*gpu)
    assert on_cpu != on_gpu
    assert on_gpu == of(*gpu, f"{stage}.precision=bf16") == of(f"{stage}.precision=bf16")
    assert on_cpu == of(f"{stage}.precision=fp32") == of(*gpu, f"{stage}.precision=fp32")
    assert of("launcher=slurm") == on_cpu  # where it runs is not what it is, at the same precision
    sections = [build("sft_dpo", [*base_overrides, *extra], check_paths=False)[stage].section for extra in ([], gpu)]
    assert [s.precision for s in sections] == ["fp32", "bf16"]  # the job computes in what was hashed


def test_an_instance_precision_auto_is_resolved_too(base_overrides):
    gpu = ["launcher=slurm", "launcher.gpus_per_node=1"]
    auto = ["sft.precision=fp32", "pipeline.stages.sft.precision=auto"]
    assert build("sft_dpo", [*base_overrides, *gpu, *auto], check_paths=False)["sft"].section.precision == "bf16"
    assert build("sft_dpo", [*base_overrides, *auto], check_paths=False)["sft"].section.precision == "fp32"


def test_keeping_the_optimizer_state_is_identity(base_overrides):
    """An output committed without its optimizer state is not served to a config that asks for it."""
    upstream = {"prep": "a", "convert": "b"}
    assert fp([*base_overrides, "sft.checkpoint.keep_optimizer=true"], "sft", upstream) != fp(base_overrides, "sft", upstream)


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
    a = {p.stage: p.fingerprint for p in plan(build("sft_dpo", base_overrides))}
    b = {p.stage: p.fingerprint for p in plan(build("sft_dpo", [*base_overrides, "data.seq_length=128"]))}
    assert a["prep"] != b["prep"] and a["sft"] != b["sft"] and a["dpo"] != b["dpo"]
    assert a["convert"] == b["convert"]  # does not read data


def test_swapping_two_input_roles_changes_the_fingerprint(base_overrides):
    def wired(model, ref):
        return compose("sft_grpo", [*base_overrides, f"pipeline.stages.grpo.inputs.model={model}", f"pipeline.stages.grpo.inputs.ref_model={ref}"])

    upstream = {"prep": "p", "convert": "c", "sft": "s"}
    assert fingerprint(stage_identity(Pipeline.build(wired("sft", "convert"))["grpo"], upstream)) != fingerprint(
        stage_identity(Pipeline.build(wired("convert", "sft"))["grpo"], upstream)
    )


USER_PIPELINE = """# @package _global_
pipeline:
  name: mine
  stages:
{stages}
"""
WIRED = {
    "prep": "{}",
    "convert": "{}",
    "sft": "{inputs: {data: prep, model: convert}}",
    "ref_logprobs": "{inputs: {data: prep, model: sft}}",
    "dpo": "{inputs: {data: prep, model: sft, ref_logprobs: ref_logprobs}}",
}


@pytest.mark.parametrize(
    "changed, message",
    [
        (
            {"dpo": "{inputs: {data: prep, modle: sft, ref_logprobs: ref_logprobs}}"},
            r"pipeline\.stages\.dpo\.inputs\.modle: stage kind dpo has no input role 'modle'; it takes data",
        ),
        (
            {"dpo": "{inputs: {data: prep, modle: sft, ref_logprobs: ref_logprobs}}"},
            r"pipeline\.stages\.dpo\.inputs: missing input role 'model' \(required, one model output\)",
        ),
        (
            {"dpo": "{inputs: {data: prep, model: [sft, convert], ref_logprobs: ref_logprobs}}"},
            r"pipeline\.stages\.dpo\.inputs\.model: takes one upstream stage, got \['sft', 'convert'\]",
        ),
        (
            {"dpo": "{inputs: {data: prep, model: stf, ref_logprobs: ref_logprobs}}"},
            r"pipeline\.stages\.dpo\.inputs\.model: 'stf' is not a stage of this pipeline",
        ),
        (
            {"dpo": "{inputs: {data: convert, model: sft, ref_logprobs: ref_logprobs}}"},
            r"pipeline\.stages\.dpo\.inputs\.data: expects a prep output; 'convert' \(convert\) gives a model output",
        ),
        ({"sft": "{inputs: {data: prep, model: dpo}}"}, r"pipeline\.stages: a cycle: (sft -> dpo -> sft|dpo -> sft -> dpo)"),
        ({"dpo_again": "{inputs: {data: prep, model: sft}}"}, r"pipeline\.stages\.dpo_again: unknown stage kind 'dpo_again'"),
        (
            {"dpo": "{inputs: {data: prep, model: sft, ref_logprobs: ref_logprobs}, betta: 0.2}"},
            r"pipeline\.stages\.dpo\.betta: not a setting of stage kind dpo",
        ),
        (
            {"dpo": "{inputs: {data: prep, model: sft, ref_logprobs: ref_logprobs}, loss: {betta: 0.2}}"},
            r"pipeline\.stages\.dpo\.loss\.betta: Key 'betta' not in 'DPOLossConfig'",
        ),
    ],
)
def test_a_wrong_pipeline_fails_at_compose_naming_the_stage(base_overrides, tmp_path, changed, message):
    """A user's own pipeline file (found through Hydra's search path) is refused before any job."""
    stages = "\n".join(f"    {name}: {body}" for name, body in {**WIRED, **changed}.items())
    (tmp_path / "conf" / "pipeline").mkdir(parents=True)
    (tmp_path / "conf" / "pipeline" / "mine.yaml").write_text(USER_PIPELINE.format(stages=stages))
    with pytest.raises(ConfigError, match=message):
        compose("mine", [*base_overrides, f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])


def write_module(root, name: str, text: str):
    path = root.joinpath(*name.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for package in [path.parent, *path.parent.parents][: name.count(".")]:
        (package / "__init__.py").touch()
    path.write_text(text)


def test_code_identity_follows_formulas_not_docstrings_or_comments(tmp_path):
    write_module(
        tmp_path,
        "alignflow.job.stages.toy",
        '"""A toy stage."""\nfrom alignflow.job.losses.toy import loss\nfrom alignflow.orchestrator.store import MANIFEST\n\n'
        "def run(cfg, inputs, out):\n    return loss(2.0)\n",
    )
    write_module(tmp_path, "alignflow.job.losses.toy", '"""The loss."""\n\ndef loss(x):\n    """Doubles."""\n    return 2 * x  # twice\n')
    write_module(tmp_path, "alignflow.orchestrator.store", "MANIFEST = '_SUCCESS.json'\nimport alignflow.orchestrator.lease\n")
    write_module(tmp_path, "alignflow.orchestrator.lease", "")
    before = code_identity("alignflow.job.stages.toy", root=tmp_path)
    assert set(before) == {"alignflow/job/stages/toy.py", "alignflow/job/losses/toy.py", "alignflow/job/losses/__init__.py"}  # not the store's

    loss_file = tmp_path / "alignflow" / "job" / "losses" / "toy.py"
    loss_file.write_text(
        '"""The loss, reworded."""\n\n# a new comment\ndef loss(x):\n    """Doubles its input."""\n    return 2 * x  # twice, said again\n'
    )
    assert code_identity("alignflow.job.stages.toy", root=tmp_path) == before

    loss_file.write_text('"""The loss."""\n\ndef loss(x):\n    """Doubles."""\n    return 3 * x\n')
    after = code_identity("alignflow.job.stages.toy", root=tmp_path)
    assert [path for path in before if after[path] != before[path]] == ["alignflow/job/losses/toy.py"]
    assert differences({"code": after}, {"code": before}) == ["code alignflow/job/losses/toy.py: changed"]


def test_package_versions_are_part_of_identity(base_overrides):
    cfg = compose("sft_dpo", base_overrides)
    ident = stage_identity(Pipeline.build(cfg)["sft"], {"prep": "a", "convert": "b"})
    assert set(ident["packages"]) == {"torch", "megatron-core", "transformers", "tokenizers"}
    bumped = {**ident, "packages": {**ident["packages"], "torch": "9.9.9"}}
    assert fingerprint(bumped) != fingerprint(ident)
    assert differences(bumped, ident) == [f"package torch: {ident['packages']['torch']} -> 9.9.9"]


def test_an_instance_override_changes_that_instance_and_its_downstream_only(base_overrides):
    before = {p.stage: p.fingerprint for p in plan(build("iterative_dpo", base_overrides))}
    after = {p.stage: p.fingerprint for p in plan(build("iterative_dpo", [*base_overrides, "pipeline.stages.dpo_round2.loss.beta=0.3"]))}
    assert before["dpo_round1"] != before["dpo_round2"] and before["ref_round1"] != before["ref_round2"]
    assert {s for s in before if before[s] != after[s]} == {"dpo_round2", "eval", "export"}
    pipeline = build("iterative_dpo", [*base_overrides, "pipeline.stages.dpo_round2.loss.beta=0.3"])
    assert (pipeline["dpo_round1"].section.loss.beta, pipeline["dpo_round2"].section.loss.beta) == (0.1, 0.3)


def test_a_value_read_from_the_environment_is_identity_by_its_digest(base_overrides, monkeypatch):
    overrides = [*base_overrides, "sft.trainer.max_steps=${oc.env:STEPS}"]
    upstream = {"prep": "a", "convert": "b"}
    sft = lambda: stage_identity(build("sft_dpo", overrides)["sft"], upstream)  # noqa: E731
    monkeypatch.setenv("STEPS", "20")
    twenty = sft()
    assert fingerprint(sft()) == fingerprint(twenty)
    monkeypatch.setenv("STEPS", "40")
    forty = sft()
    assert fingerprint(forty) != fingerprint(twenty)
    tag = lambda value: "env:STEPS sha256:" + hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]  # noqa: E731
    assert differences(forty, twenty) == [f"config sft.trainer.max_steps: {tag(20)} -> {tag(40)}"]
    assert fingerprint(stage_identity(build("sft_dpo", [*base_overrides, "sft.trainer.max_steps=40"])["sft"], upstream)) != fingerprint(
        forty
    )  # the value written out is another config: no value is taken for another


def test_a_secret_read_from_the_environment_changes_no_fingerprint(base_overrides, monkeypatch):
    overrides = [*base_overrides, "grpo.environment=[{name: exact_match, kwargs: {api_key: '${oc.env:JUDGE_API_KEY}'}}]"]
    upstream = {"prep": "p", "sft": "s"}
    grpo = lambda: fingerprint(stage_identity(build("sft_grpo", overrides)["grpo"], upstream))  # noqa: E731
    monkeypatch.setenv("JUDGE_API_KEY", "one")
    first = grpo()
    monkeypatch.setenv("JUDGE_API_KEY", "two")
    assert grpo() == first


def test_grpo_loss_type_is_identity(base_overrides):
    """Its ancestor token_level_loss (a name holding "token") was once mistaken for a secret's
    and left out of the fingerprint; its value "token" (importance_sampling_level) must count too."""
    upstream = {"prep": "p", "sft": "s"}
    grpo = lambda *o: fingerprint(stage_identity(build("sft_grpo", [*base_overrides, *o])["grpo"], upstream))  # noqa: E731
    assert len({grpo(), grpo("grpo.loss.loss_type=grpo"), grpo("grpo.loss.importance_sampling_level=sequence")}) == 3


REWARDS = '''"""A user's rewards."""
import hashlib
import json
import math

import numpy

from reward_helpers import first_number


def boxed(prompt, completion, answer, **_):
    """1 for the right number."""
    return float(first_number(completion) == float(answer))
'''
HELPERS = """import math
import re


def first_number(text):
    found = re.search(r"-?\\d+", text)
    return float(found.group()) if found else math.nan
"""


def test_user_code_named_by_import_path_is_code_identity(tmp_path, monkeypatch):
    """The module of a `module:function` reward and the user modules it imports, transitively;
    not the standard library, installed packages or where the files lie."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "my_rewards.py").write_text(REWARDS)
        (tmp_path / folder / "reward_helpers.py").write_text(HELPERS)
    for name in ("my_rewards", "reward_helpers"):  # another test's modules of these names, imported from elsewhere
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    base = code_identity("alignflow.job.stages.grpo")
    with_user = code_identity("alignflow.job.stages.grpo", ["my_rewards:boxed"])
    assert set(with_user) - set(base) == {"my_rewards.py", "reward_helpers.py"}
    assert code_identity("alignflow.job.stages.grpo", ["json:dumps", "numpy.linalg:norm"]) == base  # stdlib, site-packages

    (tmp_path / "a" / "reward_helpers.py").write_text('"""Reworded."""\n' + HELPERS.replace("import re", "import re  # regexes"))
    assert code_identity("alignflow.job.stages.grpo", ["my_rewards:boxed"]) == with_user
    (tmp_path / "a" / "reward_helpers.py").write_text(HELPERS.replace("-?", ""))
    edited = code_identity("alignflow.job.stages.grpo", ["my_rewards:boxed"])
    assert differences({"code": edited}, {"code": with_user}) == ["code reward_helpers.py: changed"]

    monkeypatch.syspath_prepend(str(tmp_path / "b"))  # the unedited copy, elsewhere
    assert code_identity("alignflow.job.stages.grpo", ["my_rewards:boxed"]) == with_user


KINDS = ("prep", "convert", "sft", "dpo", "grpo", "distillation", "reward_model", "ref_logprobs", "teacher_logprobs", "eval", "export")
IDENTITIES = (
    "import json; from alignflow.orchestrator.fingerprint import code_identity; "
    f"print(json.dumps({{k: code_identity('alignflow.job.stages.' + k) for k in {KINDS!r}}}))"
)


def identities_in(checkout) -> dict[str, dict]:
    """Each kind's code identity as a job in `checkout` computes it (its alignflow first on the path)."""
    out = subprocess.run([sys.executable, "-c", IDENTITIES], cwd=checkout, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_an_optimizer_or_training_loop_edit_reruns_training_stages_only(tmp_path):
    """Forward-only stages hash what computes their output, not the optimizer, the LR schedule or
    the training loop: editing those re-runs sft, dpo, grpo, distillation and reward_model, never
    ref_logprobs, teacher_logprobs or eval (whose outputs would be the same)."""
    checkout = tmp_path / "checkout"
    shutil.copytree(PROJECT_ROOT / "alignflow", checkout / "alignflow", ignore=shutil.ignore_patterns("__pycache__"))
    before = identities_in(checkout)
    for path, old, new in (
        ("job/train/engine.py", "    run.optimizer.zero_grad()\n", "    run.optimizer.zero_grad(set_to_none=True)\n"),
        ("job/train/schedule.py", "        return lr * step / warmup_steps", "        return lr * (step + 1) / (warmup_steps + 1)"),
        ("job/train/loop.py", "engine.optimizer_step(run, objective, micro,", "engine.optimizer_step(run, objective, list(micro),"),
    ):
        text = (checkout / "alignflow" / path).read_text()
        assert text.count(old) == 1, (path, old)
        (checkout / "alignflow" / path).write_text(text.replace(old, new))
    after = identities_in(checkout)
    changed = {kind for kind in KINDS if before[kind] != after[kind]}
    assert changed == {"sft", "dpo", "grpo", "distillation", "reward_model"}


def test_no_stage_module_imports_another():
    """A stage's code identity holds its own stage module only: shared code lives outside
    alignflow/job/stages, so editing one kind never re-runs another."""
    for kind in KINDS:
        stages = {path for path in code_identity(f"alignflow.job.stages.{kind}") if path.startswith("alignflow/job/stages/")}
        assert stages == {f"alignflow/job/stages/{kind}.py"}, stages
