"""The `align` flow end to end on the demo data, through Prefect and the local launcher."""

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import ArtifactSort
from prefect.settings import PREFECT_API_URL

from alignflow.orchestrator.config import compose as compose_module
from alignflow.orchestrator.config.compose import build
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import run_stage
from flows.align import align
from flows.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]
FAST = [
    "sft.trainer.max_steps=2",
    "sft.optim.warmup_steps=1",
    "sft.trainer.val_check_interval=1",
    "sft.trainer.limit_val_batches=1",
    "eval.num_generation_samples=4",
    "eval.limit_batches=1",
]
STAGES = ["prep", "convert", "sft", "eval", "export"]
PROGRESS = re.compile(r"% done|: step \d+/\d+")


@pytest.fixture
def base_overrides(base_overrides):
    return [*base_overrides, *FAST]


@pytest.fixture(scope="module")
def upstream(demo_dir, tmp_path_factory) -> Path:
    """prep, convert and sft committed once for the module (the stages every pipeline here starts with)."""
    root = tmp_path_factory.mktemp("upstream")
    stages = build("demo", [f"paths.demo={demo_dir}", f"store.root={root / 'store'}", f"launcher.folder={root / 'jobs'}", *FAST])
    results = {}
    for name in ("prep", "convert", "sft"):
        results[name] = run_stage(stages[name], {up: results[up] for up in stages[name].upstream()}, log=lambda line: None)
    assert not any(r.cached for r in results.values())
    return root / "store"


@pytest.fixture
def seeded(upstream, tmp_path) -> None:
    """This test's store starting with prep's, convert's and sft's outputs: cache hits, no job."""
    shutil.copytree(upstream, tmp_path / "store", ignore=shutil.ignore_patterns("_leases", "_staging"))


def jobs_submitted(tmp_path) -> int:
    jobs = tmp_path / "jobs"
    return len(list(jobs.glob("*/*"))) if jobs.exists() else 0


async def artifact(key: str):
    async with get_client() as client:
        found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC)
    return found[0] if found else None


async def flow_log_lines_per_task(flow_run_id) -> dict[str, list[str]]:
    """The flow run's Prefect log lines by task run name, progress lines left out."""
    async with get_client() as client:
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
    names = {t.id: t.name for t in tasks}
    lines: dict[str, list[str]] = {}
    for log in logs:
        if log.task_run_id is not None and not PROGRESS.search(log.message):
            lines.setdefault(names[log.task_run_id], []).append(log.message)
    return lines


def test_demo_pipeline_runs_then_hits_the_cache(base_overrides, tmp_path, monkeypatch):
    state = align(pipeline="demo", overrides=base_overrides, return_state=True)
    results = state.result()
    assert list(results) == STAGES
    first = results["prep"]
    assert not any(r.cached for r in results.values()) and first.job["launcher"] == "local"
    manifest = json.loads((tmp_path / "store" / "prep" / first.fingerprint / "_SUCCESS.json").read_text())
    assert manifest["fingerprint"] == first.fingerprint and manifest["metrics"] == first.metrics
    assert {f["path"] for f in manifest["files"]} >= {"metadata.json", "sft/train-00000.parquet"}
    export_manifest = json.loads((tmp_path / "store" / "export" / results["export"].fingerprint / "_SUCCESS.json").read_text())
    assert export_manifest["inputs"]["sft"]["uri"] == results["sft"].uri
    assert jobs_submitted(tmp_path) == 5
    # quiet: per stage its submission, the job's state changes, what the stage itself says
    # (eval: a line per model), the commit and Prefect's final state; no file-level detail
    lines = asyncio.run(flow_log_lines_per_task(state.state_details.flow_run_id))
    assert set(lines) == set(STAGES) and all(len(v) <= 6 for k, v in lines.items() if k != "eval"), lines
    assert len(lines["eval"]) <= 6 + 2, lines
    assert not [m for v in lines.values() for m in v if "_staging" in m or "checkpoint" in m]

    again = align(pipeline="demo", overrides=base_overrides)
    assert all(r.cached for r in again.values())
    assert [r.uri for r in again.values()] == [r.uri for r in results.values()]
    assert jobs_submitted(tmp_path) == 5  # cache hits submit no job

    summary = asyncio.run(artifact("align-demo"))
    for stage, result in results.items():  # a cache hit shows as Prefect's Cached state
        assert f"| {stage} | {stage} | Cached | `{result.fingerprint}`" in summary.data
    table = asyncio.run(artifact("stage-prep"))
    assert first.uri in json.dumps(table.data)
    report = summary.data.split("report: `")[1].split("`")[0]
    assert (tmp_path / "store" / "_reports") in Path(report).parents and f"{results['sft'].uri}/report.html" in Path(report).read_text()
    sft_report = Path(results["sft"].uri, "report.html").read_text()
    assert sft_report.count("<svg") >= 3 and 'aria-label="loss"' in sft_report
    assert "<script" not in sft_report and "src=" not in sft_report and "<link" not in sft_report  # nothing to fetch: opens offline
    curves = asyncio.run(artifact("curves-sft")).data
    assert "| loss |" in curves and any(block in curves for block in "▁▂▃▄▅▆▇█")
    models = asyncio.run(artifact("models-eval")).data
    rows = json.loads(models) if isinstance(models, str) else models
    assert {row["model"] for row in rows} == {"sft", "convert"} and {"accuracy", "val_loss", "perplexity"} <= set(rows[0])

    hydra_calls, builds, hydra, build = [], [], compose_module._hydra, Pipeline.build  # counted; each still runs
    monkeypatch.setattr(compose_module, "_hydra", lambda overrides: hydra_calls.append(overrides) or hydra(overrides))
    monkeypatch.setattr(Pipeline, "build", classmethod(lambda cls, cfg: builds.append(cfg) or build(cfg)))
    assert main(["run", "pipeline=demo", *base_overrides]) == 0  # `align run`, every stage a cache hit
    assert (len(hydra_calls), len(builds)) == (1, 1)  # one composition, one pipeline: the CLI's, the flow's and the tasks'
    assert main(["run", "pipeline=demo", *base_overrides, "force=[eval]"]) == 0  # README's `align run ... force=[eval]`
    assert jobs_submitted(tmp_path) == 6  # eval alone ran again


@pytest.mark.usefixtures("seeded")
def test_changed_input_config_reruns_and_force_reruns_and_compare_says_why(base_overrides, tmp_path, capsys):
    first = align(pipeline="demo", overrides=base_overrides)
    shorter = align(pipeline="demo", overrides=[*base_overrides, "data.seq_length=128"])
    assert shorter["prep"].fingerprint != first["prep"].fingerprint and not shorter["prep"].cached
    assert shorter["convert"].cached  # it does not read the data
    assert not shorter["sft"].cached and shorter["sft"].fingerprint != first["sft"].fingerprint  # downstream of prep
    forced = align(pipeline="demo", overrides=base_overrides, force=["prep"])
    assert forced["prep"].fingerprint == first["prep"].fingerprint and not forced["prep"].cached
    assert all(forced[s].cached for s in STAGES[1:])
    assert jobs_submitted(tmp_path) == 2 + 4 + 1  # eval and export; prep, sft, eval, export; prep

    records = sorted((tmp_path / "store" / "_runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    assert len(records) == 3
    names = [json.loads(p.read_text())["name"] for p in records[:2]]
    assert main(["compare", "--json", *names, *base_overrides]) == 0
    rows = {row["stage"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["convert"]["same"] and not rows["prep"]["same"] and not rows["sft"]["same"]
    assert "config data.seq_length: 256 -> 128" in rows["prep"]["why"]
    assert any(why.startswith("input data: changed") for why in rows["sft"]["why"]), rows["sft"]["why"]
    assert main(["compare", names[0], "no-such-run", *base_overrides]) == 2
    assert "no run 'no-such-run'" in capsys.readouterr().out


@pytest.mark.usefixtures("seeded")
def test_waiting_stages_show_in_the_ui_by_name_from_the_start(base_overrides):
    """While sft trains, eval and export (waiting on it) are already task runs named eval and
    export, not Prefect's `eval-3fa` placeholder. `align run` is stopped once that is seen."""
    overrides = [*base_overrides, "sft.trainer.max_steps=60"]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    run = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", "pipeline=demo", *overrides],
        cwd=Path(__file__).parents[1],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    seen, deadline = None, time.time() + 600
    try:
        with get_client(sync_client=True) as client:
            while seen is None and run.poll() is None and time.time() < deadline:
                for flow_run in client.read_flow_runs():
                    if flow_run.parameters.get("overrides") != overrides:
                        continue
                    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
                    states = {t.name: t.state.type if t.state else None for t in tasks}
                    if states.get("sft") == StateType.RUNNING and set(states) == set(STAGES):  # each renamed by then
                        seen = states
                time.sleep(0.5)
    finally:
        run.send_signal(signal.SIGTERM)  # a stopped run leaves no process (tests/test_faults.py)
        run.wait(timeout=60)
    assert seen is not None, "never saw sft running with every stage's task run"
    assert seen["eval"] == seen["export"] == StateType.PENDING, seen


@pytest.mark.usefixtures("seeded")
def test_plan_marks_committed_stages(base_overrides, capsys):
    assert main(["plan", "pipeline=sft_grpo", *base_overrides]) == 0
    out = capsys.readouterr().out
    for stage in ("prep", "convert", "sft", "grpo", "eval", "export"):
        assert stage in out
    assert main(["plan", "pipeline=demo", *base_overrides]) == 0
    assert "committed" in capsys.readouterr().out


@pytest.mark.usefixtures("seeded")
def test_sft_grpo_pipeline_publishes_per_step_rewards(base_overrides):
    grpo_fast = [
        "grpo.trainer.max_steps=3",
        "grpo.optim.warmup_steps=1",
        "grpo.num_prompts_per_step=4",
        "grpo.micro_batch_size=16",
        "grpo.generation_batch_size=32",
        "grpo.trainer.log_every_n_steps=1",
    ]
    results = align(pipeline="sft_grpo", overrides=[*base_overrides, *grpo_fast])
    assert list(results) == ["prep", "convert", "sft", "grpo", "eval", "export"]
    assert {"reward_first_tenth", "reward_last_tenth", "accuracy", "steps"} <= set(results["grpo"].metrics) and "grpo.accuracy" in results[
        "eval"
    ].metrics
    steps = asyncio.run(artifact("steps-grpo")).data
    rows = json.loads(steps) if isinstance(steps, str) else steps
    assert [row["step"] for row in rows] == ["1", "2", "3"]
    assert {"reward_mean", "reward_std", "accuracy", "kl", "clip_fraction", "response_length", "truncation_rate", "tokens_per_s"} <= set(rows[0])
    assert asyncio.run(artifact("steps-sft")) is not None
    assert asyncio.run(artifact("progress-grpo")).data == 100.0  # moved with the job's step lines


def test_iterative_dpo_runs_two_rounds_and_evaluates_every_model(base_overrides):
    dpo_fast = [
        "dpo.trainer.max_steps=2",
        "dpo.optim.warmup_steps=1",
        "dpo.trainer.val_check_interval=1",
        "dpo.trainer.limit_val_batches=1",
        "data.preference.dev_choose_samples=64",  # its reference passes and eval read every pair
    ]
    results = align(pipeline="iterative_dpo", overrides=[*base_overrides, *dpo_fast])
    assert list(results) == ["prep", "convert", "sft", "ref_round1", "dpo_round1", "ref_round2", "dpo_round2", "eval", "export"]
    assert results["dpo_round1"].fingerprint != results["dpo_round2"].fingerprint
    assert results["dpo_round2"].uri.rstrip("/").split("/")[-2] == "dpo_round2"  # the store folder is the instance's
    for model in ("convert", "sft", "dpo_round1", "dpo_round2"):
        assert {f"{model}.accuracy", f"{model}.preference_accuracy", f"{model}.val_loss"} <= set(results["eval"].metrics), model


def test_a_run_left_on_the_cpu_of_a_gpu_machine_says_so_at_warning(base_overrides, demo_dir, tmp_path, monkeypatch):
    """On a machine where nvidia-smi lists GPUs, launcher.gpus_per_node=0 runs the ranks on the
    CPU (CUDA_VISIBLE_DEVICES=""): the flow run's log says so at WARNING, before any stage."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_launch import nvidia_smi

    nvidia_smi(tmp_path, monkeypatch)
    state = align(
        pipeline="convert", overrides=[*base_overrides, f"model.tokenizer={demo_dir / 'tokenizer'}", "launcher.gpus_per_node=0"], return_state=True
    )
    assert state.is_completed()

    async def flow_logs():
        async with get_client() as client:
            return await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))

    warnings = [log.message for log in asyncio.run(flow_logs()) if log.level == 30 and log.task_run_id is None]
    assert warnings == [
        "launcher.gpus_per_node is 0: every stage's ranks run on the CPU, though this machine has 4 GPU(s) (nvidia-smi -L); "
        "leave it unset (null) to give each rank one of them"
    ], warnings
