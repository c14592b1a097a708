"""`align plan` says which stages a changed module, package or config re-runs, and why.

The demo's sft_dpo pipeline is committed once; then `align plan` runs in a copy of the project
whose code was edited, as a user's checkout would be after a pull."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from alignflow import PROJECT_ROOT
from flows.align import align

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]
FAST = [
    "sft.trainer.max_steps=2",
    "sft.optim.warmup_steps=1",
    "sft.trainer.val_check_interval=1",
    "sft.trainer.limit_val_batches=1",
    "dpo.trainer.max_steps=2",
    "dpo.optim.warmup_steps=1",
    "dpo.trainer.val_check_interval=1",
    "dpo.trainer.limit_val_batches=1",
    "eval.num_generation_samples=4",
    "eval.limit_batches=1",
    "data.preference.dev_choose_samples=64",
]
IPO_TERM = "(h - 1 / (2 * cfg.beta)) ** 2"


@pytest.fixture(scope="module")
def committed(tmp_path_factory, demo_dir):
    """Overrides under which every stage of sft_dpo is committed."""
    root = tmp_path_factory.mktemp("committed")
    overrides = [f"paths.demo={demo_dir}", f"store.root={root / 'store'}", f"launcher.folder={root / 'jobs'}", *FAST]
    align(pipeline="sft_dpo", overrides=overrides)
    return overrides


def checkout_copy(tmp_path):
    copy = tmp_path / "checkout"
    for part in ("alignflow", "flows", "tasks", "conf"):
        shutil.copytree(PROJECT_ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def plan_in(checkout, overrides, env=None) -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "plan", "--json", "pipeline=sft_dpo", *overrides],
        cwd=checkout,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return {row["stage"]: row for row in json.loads(out.stdout)["stages"]}


def edit(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_an_edited_formula_reruns_its_stage_and_downstream_naming_the_module(committed, tmp_path):
    checkout = checkout_copy(tmp_path)
    assert {s: row["status"] for s, row in plan_in(checkout, committed).items()} == dict.fromkeys(
        ["prep", "convert", "sft", "ref_logprobs", "dpo", "eval", "export"], "committed"
    )
    edit(checkout / "alignflow" / "job" / "losses" / "preference.py", IPO_TERM, IPO_TERM.replace("2 *", "4 *"))
    planned = plan_in(checkout, committed)
    assert [s for s, row in planned.items() if row["status"] == "run"] == ["dpo", "eval", "export"]
    assert "code alignflow/job/losses/preference.py: changed" in planned["dpo"]["reason"]
    assert "input model: changed" in planned["eval"]["reason"] and "input model: changed" in planned["export"]["reason"]


def test_a_docstring_or_comment_edit_reruns_nothing(committed, tmp_path):
    checkout = checkout_copy(tmp_path)
    losses = checkout / "alignflow" / "job" / "losses" / "preference.py"
    edit(losses, '"""DPO-family losses on per-sequence log-probs, with their metrics.', '"""The DPO family of losses, reworded.')
    edit(losses, IPO_TERM + ")\n", IPO_TERM + ")  # IPO's squared distance to 1/(2 beta)\n")
    edit(
        checkout / "alignflow" / "job" / "train" / "engine.py",
        "def every(step: int, interval: int) -> bool:\n",
        'def every(step: int, interval: int) -> bool:\n    """Whether an interval ends at this step."""\n',
    )
    assert {row["status"] for row in plan_in(checkout, committed).values()} == {"committed"}


def test_a_changed_package_version_reruns_every_stage(committed, tmp_path):
    """Another tokenizers on the path (as after an upgrade): every stage hashes it."""
    site = tmp_path / "site" / "tokenizers-99.0.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: tokenizers\nVersion: 99.0.0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    planned = plan_in(PROJECT_ROOT, committed, env=env)
    assert {row["status"] for row in planned.values()} == {"run"}
    assert all("package tokenizers:" in row["reason"] and "-> 99.0.0" in row["reason"] for row in planned.values())


NEW_KIND_MODULE = '''"""A toy stage kind: counts the rows of a prep output's SFT train split."""

import json

from alignflow.job.data.prepared import Prepared


def run(cfg, inputs, out):
    rows = Prepared(inputs["data"]).require("sft").num_rows
    with open(f"{out}/eval.json", "w") as f:  # what its output format ("eval") declares
        json.dump({"metrics": {"rows": rows * cfg.row_count.scale}}, f)
    return {"rows": rows * cfg.row_count.scale}
'''
NEW_KIND_SCHEMA = """

@dataclass
class RowCountConfig(StageBase):
    scale: int = 1
"""
NEW_KIND_DECLARATION = '''"""The `row_count` kind: the rows of a prep output's SFT train split, times `scale`."""

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.kinds.spec import StageKind, one

KIND = StageKind(schema=schema.RowCountConfig, output="eval", inputs={"data": one("prep")}, resumable=False, headline=("rows",))
'''
NEW_KIND_PIPELINE = """# @package _global_
# align run pipeline=count
pipeline:
  name: count
  stages:
    prep: {}
    count: {kind: row_count, inputs: {data: prep}, scale: 3}
"""
RUN_PIPELINE = """
import json, sys
from alignflow.orchestrator.config.compose import build
from alignflow.orchestrator.runner import run_stage
results = {}
for stage in build("count", sys.argv[1:]):
    results[stage.name] = run_stage(stage, {u: results[u] for u in stage.upstream()}, log=print)
print(json.dumps({"count": results["count"].metrics, "packs": results["prep"].metrics["sft.train.packs"]}))
"""


def test_a_new_stage_kind_is_its_two_modules_its_schema_class_and_its_name(base_overrides, tmp_path):
    """What README's "Adding a stage kind" says, done in a copy of the checkout: the kind
    composes, plans and runs as a job, with its instance's setting."""
    checkout = checkout_copy(tmp_path)
    (checkout / "alignflow" / "job" / "stages" / "row_count.py").write_text(NEW_KIND_MODULE)
    (checkout / "alignflow" / "orchestrator" / "kinds" / "row_count.py").write_text(NEW_KIND_DECLARATION)
    with open(checkout / "alignflow" / "orchestrator" / "config" / "schema.py", "a") as f:
        f.write(NEW_KIND_SCHEMA)
    edit(checkout / "alignflow" / "orchestrator" / "kinds" / "__init__.py", '"reward_model", "export")', '"reward_model", "export", "row_count")')
    (checkout / "conf" / "pipeline" / "count.yaml").write_text(NEW_KIND_PIPELINE)
    overrides = [*base_overrides, "data.preference=null", "data.prompts=null"]
    planned = subprocess.run(
        [sys.executable, "-m", "flows.cli", "plan", "--json", "pipeline=count", *overrides], cwd=checkout, capture_output=True, text=True, check=True
    )
    assert [(row["stage"], row["kind"], row["status"]) for row in json.loads(planned.stdout)["stages"]] == [
        ("prep", "prep", "run"),
        ("count", "row_count", "run"),
    ]
    ran = subprocess.run([sys.executable, "-c", RUN_PIPELINE, *overrides], cwd=checkout, capture_output=True, text=True, check=True)
    counted = json.loads(ran.stdout.strip().splitlines()[-1])
    assert counted["count"] == {"rows": 3 * counted["packs"]} and counted["packs"] > 0
