"""deployments/prefect.yaml on a real Prefect server and process worker, driven by the CLI a user types.

prefect deploy --all --prefect-file deployments/prefect.yaml          (the prefect_stack fixture)
prefect deployment run align/sft-dpo --param 'overrides=[...]' --watch
"""

import json
import os
import re
import subprocess
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort

from alignflow.orchestrator import runs

from .conftest import SECRETS, WORKER_AWS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SFT_DPO = ["prep", "convert", "sft", "ref_logprobs", "dpo", "eval", "export"]


def summary(stack, flow_run_id: str) -> str:
    """The flow's markdown artifact `align-sft-dpo` of that flow run."""
    with stack.client() as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["align-sft-dpo"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    assert found, f"no align-sft-dpo artifact for flow run {flow_run_id}"
    return found[0].data


def test_sft_dpo_deployment_runs_on_slurm_with_outputs_on_s3_then_hits_the_cache(prefect_stack, first_run, cached_run, workdir, store):
    assert first_run.returncode == 0 and "finished successfully in 'Completed'" in first_run.output, first_run.output[-4000:]
    with prefect_stack.client() as client:
        flow_run = client.read_flow_run(first_run.flow_run_id)
        deployment = client.read_deployment(flow_run.deployment_id)
    assert flow_run.state.type == StateType.COMPLETED and deployment.name == "sft-dpo"
    assert flow_run.parameters["pipeline"] == "sft_dpo" and "dpo.loss.beta=0.2" in flow_run.parameters["overrides"]
    assert flow_run.name.startswith("sft_dpo · slurm · s3 · "), flow_run.name  # the pipeline and where it runs
    # `--watch` shows the run's log lines (each stage's submission), not only artifact events
    watched = first_run.output
    assert all(f"{stage} " in watched and "submitted slurm job" in watched for stage in SFT_DPO), watched[-4000:]
    print(f"--watch: {len(watched.splitlines())} lines, {watched.count('prefect.artifact')} of them artifact events")

    first = summary(prefect_stack, first_run.flow_run_id)
    for stage in SFT_DPO:
        row = next(line for line in first.splitlines() if line.startswith(f"| {stage} |"))
        assert f"| {stage} | Completed |" in row, row
        fingerprint = row.split("`")[1]
        manifest = store.manifest(stage, fingerprint)
        assert manifest["fingerprint"] == fingerprint and manifest["job"]["launcher"] == "slurm", manifest["job"]
    record = json.loads(store.fs.cat(f"{store.root}/_runs/{runs.slug(flow_run.name)}.json"))  # what `align compare` reads
    assert [s["name"] for s in record["stages"]] == SFT_DPO and all(s["uri"].startswith(f"{store.root}/{s['name']}/") for s in record["stages"])
    assert store.glob("export/*/model*.safetensors") and not store.glob("dpo/*/checkpoints")  # committed without them
    jobs = len(list((workdir / "jobs").glob("*/*")))
    assert jobs == len(SFT_DPO)

    assert cached_run.returncode == 0, cached_run.output[-4000:]
    second = summary(prefect_stack, cached_run.flow_run_id)
    for stage in SFT_DPO:
        assert f"| {stage} | {stage} | Cached |" in second, second
    assert len(list((workdir / "jobs").glob("*/*"))) == jobs  # cache hits submit no job


def test_the_ui_shows_curves_and_cached_stages(prefect_stack, first_run, cached_run, tmp_path_factory):
    """Screenshots: the sft stage's curves artifact renders as a table of sparklines, and the
    cached run's stages are Cached (Prefect's own state name, in the task run list)."""
    from PIL import Image

    out = tmp_path_factory.mktemp("screenshots")
    with prefect_stack.client() as client:
        curves = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["curves-sft"]), flow_run_id=ArtifactFilterFlowRunId(any_=[first_run.flow_run_id])
            )
        )
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[cached_run.flow_run_id])))
    assert curves, "no curves-sft artifact"
    png, dom = prefect_stack.screenshot(f"/artifacts/artifact/{curves[0].id}", out)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", dom, flags=re.S)  # the markdown table, rendered
    assert any(re.sub(r"<[^>]+>", "", c).strip() == "loss" for c in cells), dom[-3000:]
    assert any(re.search("[▁▂▃▄▅▆▇█]{2,}", c) for c in cells), "no sparkline rendered"
    image = Image.open(png).convert("RGB")
    dark = sum(1 for r, g, b in image.getdata() if r + g + b < 200)
    assert dark > 2000, f"{png}: almost no text drawn ({dark} dark pixels)"

    assert sorted((t.name, t.state.name) for t in task_runs) == sorted((s, "Cached") for s in SFT_DPO)
    _, dom = prefect_stack.screenshot(f"/runs/flow-run/{cached_run.flow_run_id}", out)
    assert "Cached" in dom, "the flow run page does not show the Cached state"


def test_a_cancelled_run_shows_its_stages_cancelled(prefect_stack, first_run, run_overrides, tmp_path_factory):
    """`prefect flow-run cancel` while sft trains on Slurm: sft and every stage after it end
    Cancelled (not Failed, not Pending for ever), and the flow run page says so."""
    assert first_run.returncode == 0, first_run.output[-2000:]
    overrides = [*run_overrides, "dpo.loss.beta=0.2", "sft.trainer.max_steps=2000"]
    started = prefect_stack.prefect("deployment", "run", "align/sft-dpo", "--param", f"overrides={json.dumps(overrides)}")
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)

    def stage_states() -> dict:
        with prefect_stack.client() as client:
            return {t.name: t.state for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))}

    deadline = time.monotonic() + 300
    while (states := stage_states()).get("sft") is None or not states["sft"].is_running():
        assert time.monotonic() < deadline, {k: v.name for k, v in states.items()}
        time.sleep(1)
    time.sleep(10)  # its Slurm job submitted and training
    cancel = prefect_stack.prefect("flow-run", "cancel", flow_run_id)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    deadline = time.monotonic() + 180
    while True:
        states = stage_states()
        if len(states) == len(SFT_DPO) and all(state.is_final() for state in states.values()):
            break
        assert time.monotonic() < deadline, {k: v.name for k, v in states.items()}
        time.sleep(2)
    assert {k: v.name for k, v in states.items()} == {"prep": "Cached", "convert": "Cached", **{s: "Cancelled" for s in SFT_DPO[2:]}}
    _, dom = prefect_stack.screenshot(f"/runs/flow-run/{flow_run_id}", tmp_path_factory.mktemp("cancelled"))
    assert "Cancelled" in dom, "the flow run page does not show the Cancelled state"


def test_nightly_is_scheduled_at_two_utc(prefect_stack):
    def upcoming(deployment_id, at_least: int = 3, wait_s: float = 90):
        deadline = time.monotonic() + wait_s
        while True:
            with prefect_stack.client() as client:
                scheduled = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                    flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))),
                    sort=FlowRunSort.EXPECTED_START_TIME_ASC,
                )
            if len(scheduled) >= at_least or time.monotonic() > deadline:
                return [run.expected_start_time.astimezone(timezone.utc) for run in scheduled]
            time.sleep(2)

    with prefect_stack.client() as client:
        nightly = client.read_deployment_by_name("align/nightly")
    assert nightly.parameters["pipeline"] == "sft_dpo" and nightly.work_pool_name == "align-process"
    [schedule] = nightly.schedules
    assert schedule.active and schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "UTC"
    times = upcoming(nightly.id)
    now = datetime.now(timezone.utc)
    assert len(times) >= 3, times
    assert all((t.hour, t.minute, t.second) == (2, 0, 0) and t > now for t in times), times
    assert times[0] - now <= timedelta(days=1) and all(b - a == timedelta(days=1) for a, b in zip(times, times[1:])), times
    inspected = prefect_stack.prefect("deployment", "inspect", "align/nightly")  # README's commands
    assert inspected.returncode == 0 and "0 2 * * *" in inspected.stdout, inspected.stdout + inspected.stderr
    listed = prefect_stack.prefect("flow-run", "ls", "--state", "Scheduled", "--limit", "20")
    assert listed.returncode == 0 and sum(line.count("SCHEDULED") for line in listed.stdout.splitlines()) >= 3, listed.stdout

    # the schedule is configurable at deploy time; a re-deploy replaces the upcoming runs
    moved = prefect_stack.prefect(
        "deploy", "--name", "nightly", "--prefect-file", "deployments/prefect.yaml", env={"ALIGNFLOW_NIGHTLY_CRON": "30 3 * * 1"}
    )
    assert moved.returncode == 0, moved.stdout + moved.stderr
    try:
        with prefect_stack.client() as client:
            assert client.read_deployment_by_name("align/nightly").schedules[0].schedule.cron == "30 3 * * 1"
        deadline = time.monotonic() + 90
        while True:
            times = upcoming(nightly.id, wait_s=30)
            if times and all((t.weekday(), t.hour, t.minute) == (0, 3, 30) for t in times) or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert times and all((t.weekday(), t.hour, t.minute) == (0, 3, 30) for t in times), times
    finally:
        back = prefect_stack.prefect("deploy", "--name", "nightly", "--prefect-file", "deployments/prefect.yaml")
        assert back.returncode == 0, back.stdout + back.stderr


def test_flow_run_page_renders_the_stage_graph(prefect_stack, first_run, tmp_path_factory):
    from PIL import Image

    assert first_run.returncode == 0, first_run.output[-2000:]
    out = tmp_path_factory.mktemp("screenshots")
    png, dom = out / "flow-run.png", out / "flow-run.html"
    url = f"{prefect_stack.ui}/runs/flow-run/{first_run.flow_run_id}"
    shot = subprocess.run(
        [str(REPO / "infra" / "chromium.sh"), "shot", url, str(png), str(dom)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ALIGNFLOW_INFRA_DIR": str(prefect_stack.state)},
    )
    assert shot.returncode == 0 and png.exists(), shot.stdout + shot.stderr
    print(f"\nscreenshot of {url}: {png}")

    image = Image.open(png).convert("RGB")
    assert image.size == (1400, 1000)
    colors = Counter(image.getdata())
    assert len(colors) > 500 and colors.most_common(1)[0][1] < 0.8 * image.width * image.height  # not blank
    # the graph is drawn on a canvas: Completed task nodes are Prefect's green
    green = sum(n for (r, g, b), n in colors.items() if abs(r - 33) < 24 and abs(g - 157) < 24 and abs(b - 75) < 24)
    assert green > 5000, f"no completed stage nodes drawn in {png} ({green} green pixels)"
    html = dom.read_text(errors="replace")
    with prefect_stack.client() as client:
        flow_run_name = client.read_flow_run(first_run.flow_run_id).name
    assert flow_run_name in html and "sft-dpo" in html and "align-process" in html
    for stage in ("prep", "sft"):  # the first page of the logs list names the first stages (the graph is a canvas)
        assert stage in html, stage
    with prefect_stack.client() as client:  # the graph's nodes: one task run per stage, all Completed
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[first_run.flow_run_id])))
    assert sorted((t.name, t.state.type) for t in task_runs) == sorted((s, StateType.COMPLETED) for s in SFT_DPO)


def test_secrets_in_the_worker_environment_never_leak(prefect_stack, first_run, run_overrides, workdir, store):
    """wandb on, training stages forced to re-run with WANDB_API_KEY / AWS_SECRET_ACCESS_KEY in the
    worker's environment: no parameter, log, artifact, store output or job file holds them."""
    assert first_run.returncode == 0, first_run.output[-2000:]
    run = prefect_stack.run_deployment(
        "align/sft-dpo",
        {
            "overrides": [*run_overrides, "dpo.loss.beta=0.2", "logging.wandb.enabled=true", "logging.wandb.mode=offline"],  # a fake key: offline
            "force": ["sft", "dpo"],
        },
    )
    assert run.returncode == 0, run.output[-4000:]
    rows = {line.split("|")[1].strip(): line for line in summary(prefect_stack, run.flow_run_id).splitlines() if line.startswith("| ")}
    assert "| Completed |" in rows["sft"] and "| Completed |" in rows["dpo"] and "| Cached |" in rows["eval"], rows

    # the secret reached the flow run (the saved config shows it is set, masked) and wandb ran in the jobs
    for stage in ("sft", "dpo"):
        manifest = store.manifest(stage, rows[stage].split("`")[1])
        assert manifest["config"]["logging"]["wandb"] == {**manifest["config"]["logging"]["wandb"], "enabled": True, "api_key": "***"}
    assert store.glob("sft/*/wandb") and store.glob("dpo/*/wandb"), "wandb did not run"

    texts: dict[str, str] = {"cli output": run.output + first_run.output}
    with prefect_stack.client() as client:
        for flow_run in client.read_flow_runs():
            texts[f"flow run {flow_run.name} parameters/job variables"] = json.dumps(
                [flow_run.parameters, flow_run.job_variables, flow_run.model_dump(mode="json")], default=str
            )
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])), limit=200)
            offset = len(logs)
            while True:  # page through every log line
                more = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])), limit=200, offset=offset)
                if not more:
                    break
                logs += more
                offset += len(more)
            texts[f"logs of {flow_run.name}"] = "\n".join(log.message for log in logs)
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
            texts[f"artifacts of {flow_run.name}"] = json.dumps([a.model_dump(mode="json") for a in artifacts], default=str)
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
            texts[f"task runs of {flow_run.name}"] = json.dumps([t.model_dump(mode="json") for t in task_runs], default=str)
        deployments = client.read_deployments()
        texts["deployments"] = json.dumps([d.model_dump(mode="json") for d in deployments], default=str)
    assert any("logs of" in k and "sft" in v for k, v in texts.items())  # the logs were read

    leaks = [f"{where} holds {name}" for where, text in texts.items() for name, value in prefect_stack.secrets.items() if value in text]
    objects = store.objects()  # every output, checkpoint and manifest the runs wrote to S3
    leaks += [f"{key} holds {name}" for key, data in objects.items() for name, value in prefect_stack.secrets.items() if value.encode() in data]
    assert len(objects) > 20
    files = [p for folder in (workdir / "cache", workdir / "jobs") for p in folder.rglob("*") if p.is_file()]
    # the worker's and the server's own logs, and the server's database (parameters, logs, artifacts, events)
    files += [p for pattern in ("*.log", "prefect.db*") for p in prefect_stack.state.glob(pattern)]
    assert len(files) > 20
    # the scan would see a secret passed as a parameter: the database holds parameters as plain text
    assert any(b"logging.wandb.enabled=true" in p.read_bytes() for p in files if p.name.startswith("prefect.db"))
    for path in files:
        data = path.read_bytes()
        leaks += [f"{path} holds {name}" for name, value in prefect_stack.secrets.items() if value.encode() in data]
    assert not leaks, "\n".join(leaks)


def test_the_worker_is_restarted_when_its_credentials_change(prefect_stack):
    """The whole-stack block run again from a shell with other credentials does not keep the
    worker that lacks them (its flow runs would fail with NoCredentialsError); the same
    credentials keep it."""
    script, pidfile = str(REPO / "infra" / "prefect-server.sh"), prefect_stack.state / "prefect-worker.pid"
    with_secrets = {**prefect_stack.env, **WORKER_AWS, **SECRETS}

    def worker(env: dict) -> str:
        run = subprocess.run([script, "worker"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        return run.stdout

    first = pidfile.read_text()
    assert "restarting" not in worker(with_secrets) and pidfile.read_text() == first
    assert "restarting the worker: it runs with other credentials (none set)" in worker(prefect_stack.env)
    assert pidfile.read_text() != first
    out = worker(with_secrets)  # back as the stack started it
    assert "restarting the worker" in out and "AWS_SECRET_ACCESS_KEY" in out and "WANDB_API_KEY" in out, out
    assert not any(value in (prefect_stack.state / "prefect-worker.secrets").read_text() for value in SECRETS.values())
