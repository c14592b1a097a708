"""Everything that shapes an output is in its fingerprint, and a job computes with nothing else:
values read from the environment, the user's reward module and what it imports, the job's own
package versions.

The stages prep, convert, sft (max_steps read from $STEPS) and grpo (a reward of the user's,
imported by path, with an api key read from $JUDGE_API_KEY) of sft_grpo are committed once by
real local jobs; `align plan` then runs in this process under other environments."""

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import submitit

from alignflow.orchestrator.config.compose import build
from alignflow.orchestrator.fingerprint import fingerprint, package_versions
from alignflow.orchestrator.launch import StageFailed
from alignflow.orchestrator.runner import StageResult, run_stage, stage_identity
from alignflow.orchestrator.store import store_of
from flows.cli import main

pytestmark = pytest.mark.slow

REWARDS = '''"""The user's reward: partial credit for a number near the answer."""
from reward_helpers import first_number


def near(prompt, completion, answer, api_key=None, **_):
    found = first_number(completion)
    return 0.0 if found is None else max(0.0, 1.0 - abs(found - float(answer)) / 10)
'''
HELPERS = """import re


def first_number(text):
    found = re.search(r"-?\\d+", text)
    return None if found is None else float(found.group())
"""
FAST = [
    "sft.trainer.max_steps=${oc.env:STEPS}",
    "sft.optim.warmup_steps=1",
    "sft.trainer.val_check_interval=1",
    "sft.trainer.limit_val_batches=1",
    "grpo.trainer.max_steps=1",
    "grpo.optim.warmup_steps=0",
    "grpo.num_prompts_per_step=4",
    "grpo.micro_batch_size=16",
    "grpo.generation_batch_size=32",
    "grpo.environment=[{name: 'my_rewards:near', kwargs: {api_key: '${oc.env:JUDGE_API_KEY}'}}]",
]
TRAINED = ("prep", "convert", "sft", "grpo")
ENV = {"STEPS": "2", "JUDGE_API_KEY": "judge-7f3a9c1e5b", "WANDB_API_KEY": "wandb-c0ffee4242"}


@dataclass
class Committed:
    overrides: list[str]
    rewards: Path  # the folder of my_rewards.py on the Python path
    results: dict[str, StageResult]
    submitted: list[Path]  # submitit's pickles of the calls the runner submitted
    files: list[Path]  # every file the jobs and the store hold


@pytest.fixture(scope="module")
def committed(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("identity")
    rewards = root / "rewards"
    rewards.mkdir()
    (rewards / "my_rewards.py").write_text(REWARDS)
    (rewards / "reward_helpers.py").write_text(HELPERS)
    overrides = [f"paths.demo={demo_dir}", f"store.root={root / 'store'}", f"launcher.folder={root / 'jobs'}", *FAST]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ENV.items():
            patch.setenv(name, value)
        patch.setenv("PYTHONPATH", str(rewards))  # the jobs' Python path
        patch.syspath_prepend(str(rewards))  # this process's
        pipeline, results = build("sft_grpo", overrides), {}
        for name in TRAINED:
            stage = pipeline[name]
            results[name] = run_stage(stage, {up: results[up] for up in stage.upstream()}, log=lambda line: None)
        files = [path for path in root.rglob("*") if path.is_file() and rewards not in path.parents]
        yield Committed(overrides, rewards, results, sorted((root / "jobs").glob("*/*/*_submitted.pkl")), files)


def planned(overrides: list[str], capsys) -> dict[str, dict]:
    capsys.readouterr()
    assert main(["plan", "--json", "pipeline=sft_grpo", *overrides]) == 0
    return {row["stage"]: row for row in json.loads(capsys.readouterr().out)["stages"] if row["stage"] in TRAINED}


def env_tag(value) -> str:
    import hashlib

    return "env:STEPS sha256:" + hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def test_the_same_environment_is_a_cache_hit_and_another_value_reruns_naming_it(committed, monkeypatch, capsys):
    assert committed.results["sft"].metrics["steps"] == 2  # the job computed with $STEPS
    assert {s: row["status"] for s, row in planned(committed.overrides, capsys).items()} == dict.fromkeys(TRAINED, "committed")
    monkeypatch.setenv("STEPS", "3")
    rows = planned(committed.overrides, capsys)
    assert {s: row["status"] for s, row in rows.items()} == {"prep": "committed", "convert": "committed", "sft": "run", "grpo": "run"}
    assert rows["sft"]["reason"].endswith(f": config sft.trainer.max_steps: {env_tag(2)} -> {env_tag(3)}")
    assert "input model: changed" in rows["grpo"]["reason"]


def test_a_secret_from_the_environment_reruns_nothing(committed, monkeypatch, capsys):
    monkeypatch.setenv("JUDGE_API_KEY", "judge-another-one")
    monkeypatch.setenv("WANDB_API_KEY", "wandb-another-one")
    assert {s: row["status"] for s, row in planned(committed.overrides, capsys).items()} == dict.fromkeys(TRAINED, "committed")


def test_jobs_receive_resolved_values_and_secrets_as_their_env_text(committed):
    """What the runner submitted, read back from submitit's own pickles of the calls."""
    calls = dict(submitit.helpers.DelayedSubmission.load(pickle).args[:2] for pickle in committed.submitted)
    assert set(calls) == set(TRAINED) and len(committed.submitted) == len(TRAINED)
    assert calls["sft"]["sft"]["trainer"]["max_steps"] == 2
    assert calls["sft"]["sft"]["precision"] == calls["grpo"]["grpo"]["precision"] == "fp32"  # auto, as hashed: no GPU declared
    assert calls["sft"]["logging"]["wandb"]["api_key"] == "${oc.env:WANDB_API_KEY,null}"
    assert calls["grpo"]["grpo"]["environment"] == [{"name": "my_rewards:near", "kwargs": {"api_key": "${oc.env:JUDGE_API_KEY}"}, "weight": 1.0}]
    assert len(committed.files) > 50
    for path in committed.files:  # pickles, job logs, outputs, manifests
        data = path.read_bytes()
        assert ENV["JUDGE_API_KEY"].encode() not in data and ENV["WANDB_API_KEY"].encode() not in data, path


def edited_copy(committed, tmp_path, monkeypatch, module: str = "my_rewards", old: str = "", new: str = "") -> Path:
    """The reward folder copied elsewhere, `old` replaced by `new` in `module`, and first on this
    process's Python path (the modules imported from the original forgotten)."""
    copy = tmp_path / "rewards"
    shutil.copytree(committed.rewards, copy)
    path = copy / f"{module}.py"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))
    monkeypatch.syspath_prepend(str(copy))
    for module in ("my_rewards", "reward_helpers"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    return copy


def test_an_edited_reward_module_reruns_grpo_naming_the_file(committed, tmp_path, monkeypatch, capsys):
    edited_copy(committed, tmp_path / "same", monkeypatch)  # the same code elsewhere: its fingerprint stays
    assert {s: row["status"] for s, row in planned(committed.overrides, capsys).items()} == dict.fromkeys(TRAINED, "committed")
    edited_copy(committed, tmp_path / "edited", monkeypatch, "my_rewards", "/ 10", "/ 5")
    rows = planned(committed.overrides, capsys)
    assert {s: row["status"] for s, row in rows.items()} == {"prep": "committed", "convert": "committed", "sft": "committed", "grpo": "run"}
    assert rows["grpo"]["reason"].endswith(": code my_rewards.py: changed")
    edited_copy(committed, tmp_path / "helper", monkeypatch, "reward_helpers", r"-?\d+", r"\d+")  # a module the reward imports
    assert planned(committed.overrides, capsys)["grpo"]["reason"].endswith(": code reward_helpers.py: changed")


def refused_job(stage, upstream: dict[str, StageResult]) -> tuple[str, list[str]]:
    """`stage` run by the runner as a real local job that must refuse to start: its error, and
    what its staging folder holds; no output is committed."""
    store = store_of(stage.cfg)
    fp = fingerprint(stage_identity(stage, {up: r.fingerprint for up, r in upstream.items()}))
    with pytest.raises(StageFailed) as err:
        run_stage(stage, upstream, log=lambda line: None)
    assert store.read_manifest(stage.name, fp) is None
    return str(err.value), store.fs.ls(store.staging_path(stage.name, fp))


def test_a_job_refuses_user_code_other_than_its_run_fingerprinted(committed, tmp_path, monkeypatch):
    """The job's Python path holds another copy of the reward folder (another node, a checkout
    changed in between) than the one the run fingerprinted."""
    copy = edited_copy(committed, tmp_path, monkeypatch, "reward_helpers", "return None", "return 0.0")
    monkeypatch.syspath_prepend(str(committed.rewards))  # the run fingerprints the original
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(copy))
    grpo = build("sft_grpo", [*committed.overrides, "grpo.trainer.max_steps=2"])["grpo"]
    upstream = {name: committed.results[name] for name in grpo.upstream()}
    message, staged = refused_job(grpo, upstream)
    assert "the code of stage grpo changed since its run fingerprinted it (reward_helpers.py: changed): run the pipeline again" in message
    assert staged == []

    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no reward folder at all on the job's path
    message, staged = refused_job(grpo, upstream)
    assert "(my_rewards.py: not found here; reward_helpers.py: not found here)" in message and staged == []


def test_a_job_refuses_package_versions_other_than_its_run_fingerprinted(base_overrides, tmp_path, monkeypatch):
    """The job's environment has another torch (as a Slurm job's container or setup lines may)."""
    site = tmp_path / "site" / "torch-9.9.9.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    message, staged = refused_job(build("demo", base_overrides)["prep"], {})
    torch = package_versions()["torch"]
    assert (
        f"this job runs under other package versions than its run fingerprinted (torch 9.9.9 here, {torch} in the run): install "
        "the run's versions in the job's environment (launcher.setup, launcher.container_image)" in message
    )
    assert staged == []
