"""The nightly gate (`alignflow.orchestrator.gate`): standard errors as lm-eval reports them, the verdict on
worked numbers, the baseline a series picks, and nights played through the flow."""

import asyncio
import json
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from alignflow import PROJECT_ROOT
from alignflow.orchestrator import gate, runs
from alignflow.orchestrator.store import Store

# lm-eval 0.4 output published in tiebreaker4869/alpaca-lora results/mmlu_result.md (its arithmetic
# tasks have 2000 problems each): | arithmetic_1dc | acc | 0.8725 | ± | 0.0075 | and
# | arithmetic_2dm | acc | 0.7985 | ± | 0.0090 |
LM_EVAL = {"arithmetic_1dc": (0.8725, 0.0075), "arithmetic_2dm": (0.7985, 0.0090)}
N = 2000


def test_stderr_is_lm_evals_sample_standard_deviation_over_sqrt_n():
    """lm-eval's `mean_stderr` is `sample_stddev(arr) / sqrt(len(arr))`, n - 1 in the variance:
    Python's statistics.stdev on the 0/1 outcomes, and lm-eval's published numbers at 4 digits."""
    from alignflow.job.stages.eval import binomial_stderr

    for accuracy, stderr in LM_EVAL.values():
        outcomes = [1.0] * round(accuracy * N) + [0.0] * (N - round(accuracy * N))
        assert binomial_stderr(accuracy, N) == pytest.approx(statistics.stdev(outcomes) / math.sqrt(N), rel=1e-12)
        assert round(binomial_stderr(accuracy, N), 4) == stderr
    small = [1.0, 1.0, 0.0]  # where n - 1 and n differ: sqrt(2/9 / 2) = 1/3, not sqrt(2/9 / 3)
    assert binomial_stderr(2 / 3, 3) == pytest.approx(statistics.stdev(small) / math.sqrt(3)) == pytest.approx(1 / 3)


def record(name: str, metrics: dict, deployment: str | None = None, pipeline: str = "demo", state: str = "Completed", **extra) -> dict:
    return {
        "name": name,
        "pipeline": pipeline,
        "deployment": deployment,
        "stages": [{"name": "eval", "kind": "eval", "state": state, "metrics": metrics}],
        **extra,
    }


def night(task: str) -> dict:
    accuracy, stderr = LM_EVAL[task]
    return {"sft.accuracy": accuracy, "sft.accuracy_stderr": stderr}


@pytest.mark.parametrize("sigmas, regressed", [(2.0, True), (7.0, False)])
def test_a_drop_counts_beyond_its_threshold_and_sigmas_standard_errors_of_the_difference(sigmas, regressed):
    """0.8725 +- 0.0075 -> 0.7985 +- 0.0090: a drop of 0.074, the difference's standard error
    sqrt(0.0075^2 + 0.009^2) = 0.011715; 2 of them (0.0234) are below the drop, 7 (0.0820) above."""
    verdict = gate.judge({"eval.*.accuracy": 0.05}, sigmas, record("b", night("arithmetic_2dm")), record("a", night("arithmetic_1dc")))
    [check] = verdict.checks
    assert (check.metric, check.baseline, check.value, check.threshold) == ("eval.sft.accuracy", 0.8725, 0.7985, 0.05)
    assert check.drop == pytest.approx(0.074) and check.stderr == pytest.approx(0.011715, abs=1e-6)
    assert check.regressed is regressed and verdict.state == ("Regressed" if regressed else "Completed")
    assert ("**regressed**" if regressed else "within noise") in verdict.markdown()
    assert verdict.baseline == "a" and verdict.unmatched == []


def test_losses_regress_when_they_rise_and_a_metric_without_stderr_by_its_threshold_alone():
    before, after = record("a", {"sft.val_loss": 4.93, "sft.perplexity": 138.0}), record("b", {"sft.val_loss": 6.0, "sft.perplexity": 403.0})
    verdict = gate.judge({"eval.sft.val_loss": 0.1, "eval.sft.perplexity": 300.0}, 2.0, after, before)
    assert [(c.metric, round(c.drop, 2), c.stderr, c.regressed) for c in verdict.checks] == [
        ("eval.sft.val_loss", 1.07, None, True),
        ("eval.sft.perplexity", 265.0, None, False),
    ]
    assert verdict.message().startswith("gate: regressed against run 'a': eval.sft.val_loss 4.93 -> 6")
    assert not gate.judge({"eval.sft.val_loss": 0.1}, 2.0, before, after).regressed  # it fell: better


def test_a_threshold_that_matches_no_metric_is_said_and_the_first_run_has_no_baseline():
    verdict = gate.judge({"eval.sft.acuracy": 0.1, "eval.*.accuracy": 0.1}, 2.0, record("a", night("arithmetic_1dc")), None)
    assert verdict.unmatched == ["eval.sft.acuracy"] and verdict.baseline is None and verdict.checks == []
    assert verdict.state == "Failed" and verdict.message().startswith("gate.thresholds: eval.sft.acuracy matches no metric of this run")
    assert "no baseline run yet" in verdict.message()
    assert gate.judge({"eval.*.accuracy": 0.1}, 2.0, record("a", night("arithmetic_1dc")), None).state == "Completed"


def test_the_last_baseline_is_the_last_successful_run_of_the_same_deployment_or_pipeline(tmp_path):
    store = Store(str(tmp_path / "store"), {})
    written = [
        record("n1", {}, "align/nightly"),
        record("other", {}, None),
        record("n2", {}, "align/nightly", state="Failed"),
        record("n3", {}, "align/nightly", gate={"state": "Regressed"}),
        record("p1", {}, None, pipeline="sft_dpo"),
        record("o2", {}, "align/sft-dpo"),
    ]
    for r in written:
        runs.write(store, r["name"], r)
    tonight = record("n4", {}, "align/nightly")
    assert gate.baseline_of(store, "last", tonight)["name"] == "n1"  # n2 failed, n3 regressed
    assert gate.baseline_of(store, "last", record("local", {}))["name"] == "other"  # no deployment: the same pipeline
    assert gate.baseline_of(store, "last", record("x", {}, pipeline="sft_grpo")) is None
    assert gate.baseline_of(store, "o2", tonight)["name"] == "o2"  # pinned, whatever its series
    assert [r["name"] for r in gate.series(store, tonight)] == ["n1", "n2", "n3"]


# Nights on the demo through the flow, gated on the SFT model's held-out task accuracy (greedy
# exact match, with its standard error). Night A trains SFT far enough to answer some held-out
# problems; night B trains much less and answers none: a drop beyond the threshold and 2
# standard errors; night C differs from A only by SFT's seed: a real drop, within the noise.
# One store: prep and convert run once, every night after reruns only the stages that differ.
# No export, no baseline model in eval (the gate reads the SFT model's accuracy).
NIGHT = [
    "~pipeline.stages.export",
    "~pipeline.stages.eval.inputs.baselines",
    "sft.trainer.limit_val_batches=1",
    "eval.limit_batches=1",
    "eval.num_generation_samples=200",
]
GATE = "+gate.thresholds={eval.sft.accuracy: 0.0}"
A = ["sft.trainer.max_steps=100"]
B = ["sft.trainer.max_steps=10", "sft.optim.warmup_steps=2"]
C = [*A, "sft.trainer.seed=7"]


@dataclass
class Night:
    state: object  # the flow run's final prefect State
    record: dict  # its run record (`alignflow.orchestrator.runs`)

    @property
    def accuracy(self) -> float:
        return gate.metrics_of(self.record)["eval.sft.accuracy"]


def last_record(store_root: Path) -> dict:
    return runs.history(Store(str(store_root), {}))[-1]


@pytest.fixture(scope="module")
def nights(prefect_server, demo_dir, tmp_path_factory) -> tuple[list[str], dict[str, Night]]:
    """Nights A, B and C played in this order through the flow in one store; the overrides they share."""
    from flows.align import align

    root = tmp_path_factory.mktemp("nights")
    shared = [f"paths.demo={demo_dir}", f"store.root={root / 'store'}", f"launcher.folder={root / 'jobs'}", *NIGHT]
    played = {}
    for name, extra in (("A", A), ("B", B), ("C", C)):
        state = align(pipeline="demo", overrides=[*shared, GATE, *extra], return_state=True)
        played[name] = Night(state, last_record(root / "store"))
    return shared, played


@pytest.mark.slow
def test_a_night_whose_accuracy_drops_beyond_threshold_and_noise_ends_regressed_one_within_the_noise_completes(nights, capsys):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    from flows.cli import main

    shared, played = nights
    a, b, c = played["A"], played["B"], played["C"]
    assert a.state.is_completed() and "no baseline run yet" in a.state.message and a.record["gate"]["state"] == "Completed"
    assert a.accuracy >= 0.04 and b.accuracy == 0.0  # A answers some held-out problems, B none

    assert b.state.type == StateType.FAILED and b.state.name == "Regressed"
    [dropped] = b.record["gate"]["checks"]
    assert dropped["drop"] == pytest.approx(a.accuracy) and dropped["drop"] > 2 * dropped["stderr"] > 0 and dropped["regressed"]
    assert b.state.message.startswith(f"gate: regressed against run '{a.record['name']}': eval.sft.accuracy {a.accuracy:.4g} -> 0")
    flow_run_id = b.state.state_details.flow_run_id
    regressed = regressed_event(flow_run_id)  # what deployments/automations.yaml's trigger expects
    assert {"prefect.resource.role": "flow", "prefect.resource.name": "align"}.items() <= regressed["related"][0].items()
    with get_client(sync_client=True) as client:  # what the UI and an automation see
        shown = client.read_flow_run(flow_run_id).state
    assert (shown.type, shown.name) == (StateType.FAILED, "Regressed")
    table = asyncio.run(artifact_of(flow_run_id, "regression")).data
    row = f"| eval.sft.accuracy | {a.accuracy:.4g} | 0 | {a.accuracy:+.4g} | 0 | {dropped['stderr']:.4g} | **regressed** |"
    assert row in table, table

    assert c.state.is_completed() and f"against run '{a.record['name']}'" in c.state.message  # the regressed night is no baseline
    [noisy] = c.record["gate"]["checks"]
    assert (noisy["baseline"], noisy["value"]) == (a.accuracy, c.accuracy)
    assert noisy["threshold"] < noisy["drop"] <= 2 * noisy["stderr"] and not noisy["regressed"], noisy  # a real drop, within the noise

    trend = asyncio.run(artifact_of(c.state.state_details.flow_run_id, "trend-demo")).data
    assert [line.split(" | ")[0].lstrip("| ") for line in trend.splitlines()[4:7]] == [n.record["name"] for n in (a, b, c)], trend
    store = Store(shared[1].removeprefix("store.root="), {})
    report = Path(store.root, runs.REPORTS, f"{runs.slug(c.record['name'])}.html").read_text()
    assert report.count("<svg") == 1 and 'aria-label="eval.sft.accuracy"' in report and all(n.record["name"] in report for n in (a, b, c))

    assert main(["run", "pipeline=demo", *shared, GATE, *B]) == 1  # cache hits; the baseline: C, the last successful night
    out = capsys.readouterr().out
    assert f"Regressed gate: regressed against run '{c.record['name']}'" in out and "| eval.sft.accuracy |" in out

    from flows.align import align

    typo = align(pipeline="demo", overrides=[*shared, "+gate.thresholds={eval.sft.acuracy: 0.0}", *A], return_state=True)
    assert typo.type == StateType.FAILED and typo.name == "Failed" and typo.message.startswith("gate.thresholds: eval.sft.acuracy matches no metric")


async def artifact_of(flow_run_id, key: str):
    """The flow run's artifact `key`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async with get_client() as client:
        [found] = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return found


def regressed_event(flow_run_id) -> dict:
    """The flow run's `prefect.flow-run.Regressed` event, as the server recorded it (events reach it within seconds)."""
    from prefect.client.orchestration import get_client

    query = {"filter": {"event": {"name": ["prefect.flow-run.Regressed"]}, "any_resource": {"id": [f"prefect.flow-run.{flow_run_id}"]}}}
    with get_client(sync_client=True) as client:
        for _ in range(30):
            if found := client._client.post("/events/filter", json=query).json()["events"]:
                return found[0]
            time.sleep(1)
    raise AssertionError(f"no prefect.flow-run.Regressed event for flow run {flow_run_id}")


class Webhook(ThreadingHTTPServer):
    """A local HTTP endpoint that keeps the JSON bodies POSTed to it: where the notification block sends."""

    def __init__(self):
        self.received: "queue.Queue[dict]" = queue.Queue()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(handler):
                self.received.put(json.loads(handler.rfile.read(int(handler.headers["Content-Length"]))))
                handler.send_response(200)
                handler.end_headers()

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/alerts"


async def deployment_run(name: str, overrides: list[str]):
    """A flow run of deployment `align/<name>` as a Prefect runner (what `flow.serve` and workers
    use) executes it, in its own process; the run once final, and its deployment's id."""
    from prefect.client.orchestration import get_client
    from prefect.runner import Runner

    from flows.align import align

    runner = Runner(name=f"gate-{name}", query_seconds=1)
    deployment_id = await runner.aadd_flow(align, name=name, parameters={"pipeline": "demo", "overrides": overrides})
    sigterm = signal.getsignal(signal.SIGTERM)  # the runner takes SIGTERM for itself; the test session gets it back
    serving = asyncio.create_task(runner.start())
    try:
        async with get_client() as client:
            run = await client.create_flow_run_from_deployment(deployment_id)
            deadline = time.time() + 300
            while not (run := await client.read_flow_run(run.id)).state.is_final() and time.time() < deadline:
                await asyncio.sleep(0.5)
            return run, deployment_id
    finally:
        await runner.astop()
        serving.cancel()
        signal.signal(signal.SIGTERM, sigterm)


@pytest.mark.slow
def test_a_redeployed_nightly_keeps_its_baseline_and_its_regression_fires_the_documented_automation(nights, tmp_path):
    """deployments/automations.yaml, its block id filled in as README says (a webhook block to a
    local endpoint), created with README's `prefect automation create --from-file`; the nightly
    deployment run twice, recreated in between by its name (a new id, as `prefect deploy` after
    a delete gives): the second night's baseline is the first, by the deployment's name, and its
    regression reaches the endpoint through the server's trigger and action."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    shared, played = nights
    hook = Webhook()
    block_id = CustomWebhookNotificationBlock(name="nightly-alerts", url=hook.url, json_data={"subject": "{{subject}}", "body": "{{body}}"}).save(
        "nightly-alerts", overwrite=True
    )
    filled = tmp_path / "automations.yaml"
    filled.write_text(
        (PROJECT_ROOT / "deployments" / "automations.yaml").read_text().replace("REPLACE-WITH-YOUR-NOTIFICATION-BLOCK-ID", str(block_id))
    )
    created = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "automation", "create", "--from-file", str(filled)],
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert created.returncode == 0, created.stdout + created.stderr

    store = shared[1].removeprefix("store.root=")
    first, first_id = asyncio.run(deployment_run("nightly", [*shared, GATE, *A]))  # cache hits: night A's stages
    tonight = last_record(Path(store))
    assert first.state.name == "Completed" and (tonight["deployment"], tonight["gate"]["baseline"]) == ("align/nightly", None)
    assert hook.received.empty()
    with get_client(sync_client=True) as client:
        client.delete_deployment(first_id)
    second, second_id = asyncio.run(deployment_run("nightly", [*shared, GATE, *B]))  # cache hits: night B's stages
    regressed = last_record(Path(store))
    assert second_id != first_id and regressed["deployment"] == "align/nightly"
    assert second.state.name == "Regressed" and regressed["gate"]["baseline"] == tonight["name"], second.state.message

    alert = hook.received.get(timeout=60)
    assert alert["subject"] == f"align/nightly regressed: {second.name}", alert
    assert f"gate: regressed against run '{tonight['name']}'" in alert["body"] and "| eval.sft.accuracy |" in alert["body"], alert
    assert hook.received.empty()  # once, for the regressed night only
