"""The benchmark stage: lm-eval on each model of a pipeline, offline and cached, with the numbers
of lm-eval's own CLI on the exported model (`alignflow.job.stages.benchmark`).

One run of pipeline sft_bench (SFT cut to 2 steps) serves every test of this module."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from alignflow import PROJECT_ROOT
from alignflow.orchestrator.config.compose import build
from alignflow.orchestrator.launch import StageFailed
from alignflow.orchestrator.runner import plan, run_stage
from flows.align import align

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]
FAST = ["sft.trainer.max_steps=2", "sft.optim.warmup_steps=1", "sft.trainer.val_check_interval=1", "sft.trainer.limit_val_batches=1"]
TASKS = ("arithmetic_demo", "gsm8k_demo")
OFFLINE_GUARD = PROJECT_ROOT / "tests" / "offline"  # its sitecustomize refuses and logs any non-local connection


@pytest.fixture(scope="module")
def bench(demo_dir, tmp_path_factory):
    """The run's results, its overrides, its task folder (a copy of the demo's) and the network log of its jobs."""
    work = tmp_path_factory.mktemp("bench")
    tasks = shutil.copytree(demo_dir / "benchmarks", work / "tasks")
    network = work / "network.log"
    overrides = [
        f"paths.demo={demo_dir}",
        f"store.root={work / 'store'}",
        f"launcher.folder={work / 'jobs'}",
        f"benchmark.include_path={tasks}",
        *FAST,
    ]
    guarded = {
        "PYTHONPATH": os.pathsep.join([str(OFFLINE_GUARD), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "ALIGNFLOW_NETWORK_LOG": str(network),
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in guarded.items():
            patch.setenv(key, value)
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # the stage sets them itself
            patch.delenv(key, raising=False)
        results = align(pipeline="sft_bench", overrides=overrides)
    return results, overrides, tasks, network, work


def test_the_guard_refuses_and_logs_a_connection_out(tmp_path):
    log = tmp_path / "network.log"
    code = "import socket\ntry:\n    socket.create_connection(('10.255.255.1', 80), timeout=2)\nexcept OSError as err:\n    print(err)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(OFFLINE_GUARD), "ALIGNFLOW_NETWORK_LOG": str(log)},
        capture_output=True,
        text=True,
    )
    assert "refused by the test's offline guard" in out.stdout and "10.255.255.1" in log.read_text()


def test_benchmark_runs_offline_then_a_rerun_does_no_work(bench):
    results, overrides, _, network, work = bench
    first = results["benchmark"]
    assert not first.cached and not network.exists()  # no job of the run connected anywhere but this machine
    for model in ("convert", "sft"):
        for metric in (
            "arithmetic_demo.acc",
            "arithmetic_demo.perplexity",
            "gsm8k_demo.exact_match@strict-match",
            "gsm8k_demo.exact_match@flexible-extract",
        ):
            assert f"{model}.{metric}" in first.metrics and f"{model}.{metric}_stderr" in first.metrics
    summary = json.loads((Path(first.uri) / "benchmark.json").read_text())
    assert summary["lm_eval"] == "0.4.13" and summary["models"]["sft"]["tasks"]["gsm8k_demo"]["n_samples"] == {"original": 50, "effective": 50}
    jobs = sorted((work / "jobs").iterdir())
    again = align(pipeline="sft_bench", overrides=overrides)
    assert all(r.cached for r in again.values()) and again["benchmark"].fingerprint == first.fingerprint
    assert sorted((work / "jobs").iterdir()) == jobs  # no job submitted


def test_an_edited_task_yaml_reruns_the_benchmark_alone(bench):
    _, overrides, tasks, _, _ = bench
    yaml = tasks / "gsm8k_demo.yaml"
    before = yaml.read_text()
    try:
        yaml.write_text(before.replace("max_gen_toks: 16", "max_gen_toks: 12"))
        planned = {p.stage: p for p in plan(build("sft_bench", overrides))}
    finally:
        yaml.write_text(before)
    assert planned["benchmark"].status == "run" and "gsm8k_demo.yaml" in planned["benchmark"].reason
    assert all(p.status == "committed" for name, p in planned.items() if name != "benchmark")


def test_the_numbers_are_lm_evals_own_cli_on_the_exported_model(bench, tmp_path):
    results, _, tasks, _, _ = bench
    export = results["export"].uri
    command = [
        str(Path(sys.executable).with_name("lm_eval")),
        "--model", "hf",
        "--model_args", f"pretrained={export},dtype=float32",
        "--tasks", ",".join(TASKS),
        "--include_path", str(tasks),
        "--apply_chat_template",
        "--batch_size", "16",
        "--device", "cpu",
        "--output_path", str(tmp_path / "cli"),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(command, env=env, check=True, capture_output=True, cwd=tmp_path)
    cli = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())["results"]
    ours = json.loads((Path(results["benchmark"].uri) / "lm_eval" / "sft.json").read_text())["results"]
    for task in TASKS:
        numbers = {key: value for key, value in cli[task].items() if "," in key}
        assert numbers and {key: ours[task][key] for key in numbers} == numbers  # equal, not within a tolerance
    metrics = results["benchmark"].metrics
    assert metrics["sft.arithmetic_demo.perplexity"] == cli["arithmetic_demo"]["perplexity,none"] > 1
    assert metrics["sft.gsm8k_demo.exact_match@flexible-extract_stderr"] == cli["gsm8k_demo"]["exact_match_stderr,flexible-extract"]


def test_a_task_whose_hub_dataset_is_not_cached_fails_at_job_start_naming_the_key(bench, tmp_path):
    results, overrides, _, _, _ = bench
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub.yaml").write_text(
        "task: hub_only\ndataset_path: nonexistent-org/no-such-dataset\noutput_type: loglikelihood\ntest_split: test\n"
        "doc_to_text: '{{context}}'\ndoc_to_target: '{{completion}}'\n"
    )
    committed = sorted(Path(results["benchmark"].uri).parent.glob("*/_SUCCESS.json"))
    stage = build("sft_bench", [*overrides, f"benchmark.include_path={tmp_path / 'tasks'}", "benchmark.tasks=[hub_only]"])["benchmark"]
    with pytest.raises(StageFailed) as err:
        run_stage(stage, {name: results[name] for name in ("convert", "sft")}, log=lambda line: None)
    assert "benchmark.tasks: hub_only: a task's data could not be read offline" in str(err.value).splitlines()[0]
    assert sorted(Path(results["benchmark"].uri).parent.glob("*/_SUCCESS.json")) == committed  # nothing committed
