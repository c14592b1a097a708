"""`align plan` says which stages a changed module, package or config re-runs, and why.

The demo's sft_dpo pipeline is committed once; then `align plan` runs in a copy of the project
whose code was edited, as a user's checkout would be after a pull."""

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from alignflow import PROJECT_ROOT
from alignflow.orchestrator import cost
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


def plan_json(overrides, checkout=PROJECT_ROOT, env=None) -> dict:
    """`align plan --json pipeline=sft_dpo ...` run from `checkout`, as printed."""
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "plan", "--json", "pipeline=sft_dpo", *overrides],
        cwd=checkout,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout)


def plan_in(checkout, overrides, env=None) -> dict[str, dict]:
    """Each stage's row of that plan."""
    return {row["stage"]: row for row in plan_json(overrides, checkout, env)["stages"]}


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
    edit(checkout / "alignflow" / "orchestrator" / "kinds" / "__init__.py", '    "export",\n)', '    "export",\n    "row_count",\n)')
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
    assert counted["count"]["rows"] == 3 * counted["packs"] and counted["packs"] > 0
    assert counted["count"]["device_hours"] > 0  # every job's wall time and device-hours (alignflow.job.usage)


SFT_DPO = ["prep", "convert", "sft", "ref_logprobs", "dpo", "eval", "export"]


def committed_manifests(overrides) -> dict[str, dict]:
    """Each stage's manifest in the store of `overrides` (one committed output a stage)."""
    store = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("store.root=")))
    found = {stage: list(store.glob(f"{stage}/*/_SUCCESS.json")) for stage in SFT_DPO}
    assert all(len(paths) == 1 for paths in found.values()), found
    return {stage: json.loads(paths[0].read_text()) for stage, paths in found.items()}


def longest_path(seconds: dict[str, float], manifests: dict[str, dict]) -> float:
    """The run's time through its DAG: a stage starts when its last upstream stage is committed."""
    done: dict[str, float] = {}
    for stage in SFT_DPO:  # in run order
        done[stage] = seconds[stage] + max((done[up] for up in manifests[stage]["inputs"]), default=0.0)
    return max(done.values())


def test_a_forward_stages_flops_are_torchs_count_of_its_passes(committed):
    """ref_logprobs's reported FLOPs against torch's FlopCounterMode on HF's Llama of its model's
    config.json (meta device: shapes only), each chosen and each rejected sequence of every pair
    of prep's train and val splits run on its own; eager attention computes the whole score
    matrix, of which the causal half is what Megatron-LM counts."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    manifests = committed_manifests(committed)
    prep, model = manifests["prep"], manifests["ref_logprobs"]["inputs"]["sft"]["uri"]
    prep_dir = Path(manifests["ref_logprobs"]["inputs"]["prep"]["uri"])
    lengths = [
        n
        for shard in sorted((prep_dir / "preference").glob("*.parquet"))
        for side in ("chosen", "rejected")
        for n in pc.list_value_length(pq.read_table(shard).column(f"{side}_input_ids")).to_pylist()
    ]
    assert len(lengths) == 2 * (prep["metrics"]["preference.train.rows"] + prep["metrics"]["preference.val.rows"])
    config = LlamaConfig(**{**json.loads((Path(model) / "hf" / "config.json").read_text()), "attn_implementation": "eager"})
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    counted = 0
    for n, times in Counter(lengths).items():  # a length's count once, times the sequences of that length
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            llama(torch.zeros(1, n, dtype=torch.long, device="meta"))
        found = counter.get_flop_counts()["Global"]
        counted += times * (found[torch.ops.aten.mm] + found[torch.ops.aten.bmm] / 2)
    assert manifests["ref_logprobs"]["metrics"]["flops"] == counted


def test_plan_predicts_what_the_run_took_per_stage_and_in_total(committed):
    """After the run, `align plan` of the same pipeline with every stage forced predicts from the
    throughput table the run wrote: each stage's time within 25% of what it took (its manifest's
    seconds: submission to commit), the total within 25% of the run's longest path, and each
    model stage's FLOPs within 25% of what its job counted (prep's token counts against the
    batches the job drew)."""
    planned = plan_json([*committed, f"force=[{','.join(SFT_DPO)}]"])
    manifests = committed_manifests(committed)
    predicted = {row["stage"]: row for row in planned["cost"]["stages"]}
    seconds = {stage: m["seconds"] for stage, m in manifests.items()}
    ratios = {stage: predicted[stage]["seconds"] / seconds[stage] for stage in SFT_DPO}
    flops = {stage: predicted[stage]["flops"] / m["metrics"]["flops"] for stage, m in manifests.items() if "flops" in m["metrics"]}
    total = planned["cost"]["total"]["seconds"] / longest_path(seconds, manifests)
    print(f"predicted / measured time: {ratios}, total {total:.3f}; FLOPs: {flops}")
    assert all(predicted[s]["basis"].startswith("measured: 1 job on") for s in SFT_DPO), predicted
    assert all(0.75 <= r <= 1.25 for r in ratios.values()) and 0.75 <= total <= 1.25, (ratios, total)
    assert set(flops) == {"sft", "ref_logprobs", "dpo", "eval"} and all(0.75 <= r <= 1.25 for r in flops.values()), flops
    hours = planned["cost"]["total"]["device_hours"]["core-hours"]
    assert hours == pytest.approx(sum(m["metrics"]["device_hours"] for m in manifests.values()), rel=0.25)


def test_the_run_summary_shows_device_hours_used_and_saved(committed, capsys):
    """A second run with export forced: export's job is what it used, the other stages' recorded
    cost what the cache saved; in the run record, the printed summary and the summary artifact."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from flows.cli import main

    assert main(["run", "pipeline=sft_dpo", *committed, "force=[export]"]) == 0
    manifests, store = committed_manifests(committed), Path(next(o.split("=", 1)[1] for o in committed if o.startswith("store.root=")))
    record = json.loads(max((store / "_runs").glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())
    assert record["compute"]["used"] == {"core-hours": manifests["export"]["metrics"]["device_hours"]}
    saved = sum(m["metrics"]["device_hours"] for stage, m in manifests.items() if stage != "export")
    assert record["compute"]["saved"] == {"core-hours": pytest.approx(saved, rel=1e-9)}
    line = cost.usage_line(record["compute"])
    assert line in capsys.readouterr().out and line.startswith("device-hours: used ")

    async def summary() -> str:
        async with get_client() as client:
            key = ArtifactFilter(key=ArtifactFilterKey(any_=["align-sft-dpo"]))
            return (await client.read_artifacts(artifact_filter=key, sort=ArtifactSort.CREATED_DESC))[0].data

    assert line in asyncio.run(summary())
