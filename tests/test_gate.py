"""The nightly gate (`alignflow.orchestrator.gate`): standard errors as lm-eval reports them, the verdict on
worked numbers, the baseline a series picks, and nights played through the flow."""

import asyncio
import math
import os
import statistics
import subprocess
import sys
import time
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


# Nights on the demo through the flow. The demo's task accuracy is 0 at any step count a CPU test
# can afford, so the night that regresses does so on its validation loss (2 SFT steps instead
# of 8: a real, higher loss), and the night within the noise on its preference accuracy (another
# SFT seed: a real drop, smaller than 2 standard errors of the difference). No export: the gate reads eval.
NIGHT = [
    "~pipeline.stages.export",
    "sft.optim.warmup_steps=1",
    "sft.trainer.val_check_interval=1",
    "sft.trainer.limit_val_batches=1",
    "eval.num_generation_samples=4",
    "eval.limit_batches=1",
]
GATE = "+gate.thresholds={eval.sft.val_loss: 0.3, eval.sft.preference_accuracy: 0.0}"


def last_record(store_root: Path) -> dict:
    return runs.history(Store(str(store_root), {}))[-1]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_night_that_drops_beyond_threshold_and_noise_ends_regressed_one_within_the_noise_completes(base_overrides, tmp_path, capsys):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    from flows.align import align
    from flows.cli import main

    sys.path.insert(0, str(Path(__file__).parent))
    from test_flow import artifact

    def night(*extra: str):
        state = align(pipeline="demo", overrides=[*base_overrides, *NIGHT, *extra], return_state=True)
        return state, last_record(tmp_path / "store")

    first, r1 = night(GATE, "sft.trainer.max_steps=8")
    assert first.is_completed() and "no baseline run yet" in first.message and r1["gate"]["state"] == "Completed"

    worse, r2 = night(GATE, "sft.trainer.max_steps=2")
    before, after = (gate.metrics_of(r)["eval.sft.val_loss"] for r in (r1, r2))
    assert after - before > 0.3  # fewer steps: a real rise of the validation loss
    assert worse.type == StateType.FAILED and worse.name == "Regressed"
    regressed = regressed_event(worse.state_details.flow_run_id)  # what deployments/automations.yaml's trigger expects
    assert {"prefect.resource.role": "flow", "prefect.resource.name": "align"}.items() <= regressed["related"][0].items()
    assert worse.message.startswith(f"gate: regressed against run '{r1['name']}': eval.sft.val_loss {before:.4g} -> {after:.4g}")
    with get_client(sync_client=True) as client:  # what the UI and an automation see
        shown = client.read_flow_run(worse.state_details.flow_run_id).state
    assert (shown.type, shown.name) == (StateType.FAILED, "Regressed")
    table = asyncio.run(artifact("regression")).data
    assert f"| eval.sft.val_loss | {before:.4g} | {after:.4g} | {after - before:+.4g} | 0.3 | - | **regressed** |" in table, table

    noisy, r3 = night(GATE, "sft.trainer.max_steps=8", "sft.trainer.seed=7")
    assert noisy.is_completed() and f"against run '{r1['name']}'" in noisy.message  # the regressed night is no baseline
    [check] = [c for c in r3["gate"]["checks"] if c["metric"] == "eval.sft.preference_accuracy"]
    now, then = gate.metrics_of(r3), gate.metrics_of(r1)
    assert (check["baseline"], check["value"]) == (then["eval.sft.preference_accuracy"], now["eval.sft.preference_accuracy"])
    assert now["eval.sft.preference_accuracy_stderr"] > 0 and then["eval.sft.preference_accuracy_stderr"] > 0
    assert check["threshold"] < check["drop"] <= 2 * check["stderr"] and not check["regressed"], check  # a real drop, within the noise

    trend = asyncio.run(artifact("trend-demo")).data
    assert [line.split(" | ")[0].lstrip("| ") for line in trend.splitlines()[4:7]] == [r1["name"], r2["name"], r3["name"]], trend
    report = Path(tmp_path / "store" / runs.REPORTS / f"{runs.slug(r3['name'])}.html").read_text()
    assert report.count("<svg") == 2 and 'aria-label="eval.sft.val_loss"' in report and all(r["name"] in report for r in (r1, r2, r3))

    assert main(["run", "pipeline=demo", *base_overrides, *NIGHT, GATE, "sft.trainer.max_steps=2"]) == 1  # cache hits; baseline: r3
    out = capsys.readouterr().out
    assert f"Regressed gate: regressed against run '{r3['name']}'" in out and "| eval.sft.val_loss |" in out

    typo, _ = night("+gate.thresholds={eval.sft.val_los: 0.3}", "sft.trainer.max_steps=8")
    assert typo.type == StateType.FAILED and typo.name == "Failed" and typo.message.startswith("gate.thresholds: eval.sft.val_los matches no metric")


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


@pytest.mark.usefixtures("prefect_server")
def test_the_documented_automation_notifies_on_the_nightlys_regressed_state(tmp_path):
    """deployments/automations.yaml, its block id filled in as README says, created with README's
    `prefect automation create --from-file`: the trigger the Regressed state's event matches."""
    from prefect.blocks.notifications import SlackWebhook
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    block_id = SlackWebhook(url="https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX").save(
        "nightly-alerts", overwrite=True
    )
    text = (PROJECT_ROOT / "deployments" / "automations.yaml").read_text()
    filled = tmp_path / "automations.yaml"
    filled.write_text(text.replace("REPLACE-WITH-YOUR-NOTIFICATION-BLOCK-ID", str(block_id)))
    created = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "automation", "create", "--from-file", str(filled)],
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert created.returncode == 0, created.stdout + created.stderr
    with get_client(sync_client=True) as client:
        [automation] = client.read_automations_by_name("align-nightly-regressed")
    trigger, [action] = automation.trigger, automation.actions
    assert trigger.expect == {"prefect.flow-run.Regressed"} and trigger.posture == "Reactive"
    assert [dict(spec.items()) for spec in trigger.match_related] == [
        {"prefect.resource.role": ["flow"], "prefect.resource.name": ["align"]},
        {"prefect.resource.role": ["deployment"], "prefect.resource.name": ["nightly"]},
    ]
    assert (action.type, action.block_document_id) == ("send-notification", block_id) and "{{ flow_run.state.message }}" in action.body
