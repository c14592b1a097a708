"""The slurm launcher on the real cluster (infra/slurm.sh, `slurm_cluster` fixture), one node a job:
ranks are Slurm tasks with torch.distributed, a USR2-preempted training job is requeued and
resumes from its checkpoint to the uninterrupted weights, and a cancelled flow run leaves no
Slurm job behind. A node has 2 CPUs: a 2-task job (cpus_per_task=1) fills it (tests/test_nodes.py:
jobs across nodes)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
from omegaconf import OmegaConf
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import StateType

from alignflow import PROJECT_ROOT
from alignflow.orchestrator.config.schema import LauncherConfig
from alignflow.orchestrator.launch import InfrastructureError, job_record, slurm_rendezvous_port, submit, wait

sys.path.insert(0, str(Path(__file__).parent))
from test_launch import all_reduce_rank, sleep_long  # noqa: E402
from train_ranks import convert_demo, prep_demo, sft_cfg  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # jobs run this file's functions by value
# every test here runs on the Slurm cluster, whose start alone takes ~35 s of a loaded machine
pytestmark = [pytest.mark.usefixtures("slurm_cluster"), pytest.mark.slow]


def slurm(tmp_path):
    return OmegaConf.merge(
        OmegaConf.structured(LauncherConfig), {"name": "slurm", "partition": "debug", "folder": str(tmp_path / "jobs"), "time_min": 30}
    )


def section(tasks: int, timeout_min: int = 10):
    return OmegaConf.create({"resources": {"nodes": 1, "tasks_per_node": tasks}, "timeout_min": timeout_min})


def sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True).stdout
    return out.splitlines()[-1].split()[0] if out.strip() else ""  # "CANCELLED by 0" -> "CANCELLED"


def squeue(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def test_two_slurm_tasks_get_a_gloo_process_group_and_their_states_are_logged(tmp_path):
    job = submit(slurm(tmp_path), section(2), "probe", all_reduce_rank)
    lines, record = [], job_record(job)
    result = wait(job, lines.append, poll_s=0.5, record=record)
    assert result.pop("port") == slurm_rendezvous_port(job.job_id)
    assert result == {"rank": 0, "world": 2, "sum": 3.0, "backend": "gloo"}
    assert [r["rank"] for r in job.results()] == [0, 1]
    assert any("hello from rank 0" in line for line in lines), lines  # the last output too, once the job ended
    states = [line.split(": ")[1] for line in lines if line.startswith(f"job {job.job_id}: ")]
    # sacct is read every 2 s: a one-second job may be seen only as done
    assert states[-1] == "COMPLETED" and set(states) <= {"PENDING", "RUNNING", "COMPLETED"} and record.state == "COMPLETED", lines
    assert record.launcher == "slurm" and record.stdout.endswith(f"{job.job_id}_0_log.out")


# ----------------------------------------------------------------------------- requeue


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-inputs")
    return {"data": str(prep_demo(demo_dir, root / "data")), "model": str(convert_demo(demo_dir, root / "model"))}


def pausing_after_checkpoints(*args):
    """`run_stage_job` whose first attempt sleeps after each checkpoint, so that the test can
    preempt it between two checkpoints; a requeued attempt (SLURM_RESTART_COUNT) does not."""
    from alignflow.job.train import checkpoints
    from alignflow.job.worker import run_stage_job

    if not int(os.environ.get("SLURM_RESTART_COUNT", "0")):
        save = checkpoints.save

        def slow_save(*a, **kw):
            path = save(*a, **kw)
            time.sleep(60)
            return path

        checkpoints.save = slow_save
    return run_stage_job(*args)


def test_a_gpu_job_asks_slurm_for_one_gpu_per_rank(tmp_path):
    """Read back from the sbatch script submitit wrote. This cluster's node has no GPUs (no gres),
    so sbatch refuses the job at submission, as a partition without GPUs would."""
    import submitit

    with pytest.raises(submitit.core.utils.FailedJobError, match="Invalid generic resource"):
        submit(OmegaConf.merge(slurm(tmp_path), {"gpus_per_node": 8}), section(2), "gpus", all_reduce_rank)
    script = next((tmp_path / "jobs" / "gpus").glob("*/.submission_file_*.sh")).read_text().splitlines()
    assert "#SBATCH --gpus-per-node=2" in script and "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --nodes=1" in script


def test_a_preempted_training_job_is_requeued_and_resumes_to_the_uninterrupted_weights(demo_dir, inputs, tmp_path):
    """DP2 on 2 Slurm tasks, dropout on. `scancel --signal=USR2` after the first checkpoint:
    rank 0's checkpoint() resubmits the job, Slurm requeues it, the engine resumes from step 3,
    and the final weights equal those of an uninterrupted 2-rank run (local launcher, run
    meanwhile) bit for bit."""
    from test_sft import weights

    from alignflow.job.worker import run_stage_job

    cfg = sft_cfg(
        demo_dir,
        hidden_dropout=0.1,
        resources={"tasks_per_node": 2},
        trainer={"max_steps": 6, "val_check_interval": 3, "log_every_n_steps": 1},
        checkpoint={"every_n_steps": 3},
    )
    stage = OmegaConf.create({**cfg["sft"], "timeout_min": 30})  # > 10 min: submitit counts a USR2 as a preemption
    started = time.time()
    local = OmegaConf.merge(OmegaConf.structured(LauncherConfig), {"folder": str(tmp_path / "jobs")})
    reference = submit(local, stage, "sft", run_stage_job, "sft", cfg, inputs, str(tmp_path / "uninterrupted"), {}, resumable=True)

    out, lines, outcome = tmp_path / "preempted", [], {}
    job = submit(slurm(tmp_path), stage, "sft", pausing_after_checkpoints, "sft", cfg, inputs, str(out), {}, resumable=True)
    record = job_record(job)
    waiter = threading.Thread(target=lambda: outcome.update(metrics=wait(job, lines.append, poll_s=0.5, record=record)))
    waiter.start()
    first = out / "checkpoints" / "step-00000003" / "complete"
    while not first.exists() and waiter.is_alive() and time.time() < started + 240:
        time.sleep(0.2)
    assert first.exists(), lines[-30:]
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True)
    waiter.join(timeout=300)
    wait(reference, lambda _: None)
    print(f"preempted, requeued and completed on 2 Slurm tasks, uninterrupted run on 2 local ranks: {time.time() - started:.1f} s")

    states = [line.split(": ")[1] for line in lines if line.startswith(f"job {job.job_id}: ")]
    assert outcome.get("metrics", {}).get("steps") == 6, lines[-40:]
    text = "\n".join(lines)
    assert "this job is preempted" in text and f"Requeued job {job.job_id}" in text
    assert f"resumed from {out / 'checkpoints' / 'step-00000003'} (step 3 of 6)" in text, text[-4000:]
    assert "REQUEUED" in states or "PENDING" in states[states.index("RUNNING") :], states
    assert states[-1] == "COMPLETED" == record.state, states
    expected, got = weights(tmp_path / "uninterrupted" / "model"), weights(out / "model")
    assert expected.keys() == got.keys() and all(expected[k].equal(got[k]) for k in expected)


def test_a_preempted_job_that_cannot_resume_is_not_requeued_but_retried(tmp_path):
    """Not resumable (or out of requeues): submitit's handler gives up on USR2, and the job
    fails as an infrastructure error, so the Prefect retry starts the stage clean."""
    job = submit(slurm(tmp_path), section(1), "sleepy", sleep_long)

    def log(line):
        if "sleeping" in line:
            subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True)

    with pytest.raises(InfrastructureError, match="Job not requeued because: checkpoint function returned None"):
        wait(job, log, poll_s=0.5)


# ----------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_cancelled_flow_run_leaves_no_slurm_job(prefect_server, base_overrides, tmp_path, signum):
    """`align run` on Slurm gets SIGTERM (how a Prefect worker cancels a flow run: the engine
    raises TerminationSignal in the main thread) or SIGINT (Ctrl-C) while its first stage's job
    runs (a `setup` line keeps it busy): the job is scancelled and the process exits."""
    from prefect.settings import PREFECT_API_URL

    overrides = [*base_overrides, "launcher=slurm", "launcher.partition=debug", "launcher.setup=['sleep 300']"]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(PROJECT_ROOT)}
    flow = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", "pipeline=demo", *overrides],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 180
    while not (submitted := list((tmp_path / "jobs").glob("prep-*/*/*_submission.sh"))) and flow.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert submitted, flow.communicate(timeout=60)[0][-3000:] if flow.poll() is not None else "no job submitted"
    job_id = submitted[0].name.split("_")[0]
    while squeue(job_id) != "RUNNING" and time.time() < deadline:
        time.sleep(0.5)
    flow.send_signal(signum)
    started = time.time()
    output = flow.communicate(timeout=60)[0]
    print(f"{signum.name}: flow process ended in {time.time() - started:.1f} s, rc {flow.returncode}")
    job_ids = [path.name.split("_")[0] for path in (tmp_path / "jobs").glob("*/*/*_submission.sh")]  # prep's and convert's
    while any(squeue(j) for j in job_ids) and time.time() < started + 30:
        time.sleep(0.5)
    assert [squeue(j) for j in job_ids] == [""] * len(job_ids), output[-3000:]
    assert [sacct_state(j) for j in job_ids] == ["CANCELLED"] * len(job_ids), output[-3000:]
    assert f"job {job_id}: CANCELLED" in output and flow.returncode != 0
    with get_client(sync_client=True) as client:  # every stage Cancelled: the running one and those waiting on it
        flow_run = next(r for r in client.read_flow_runs() if r.parameters.get("overrides") == overrides)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    assert sorted((t.name, t.state.type) for t in tasks) == sorted((s, StateType.CANCELLED) for s in ("prep", "convert", "sft", "eval", "export"))


def test_a_job_cancelled_outside_is_noticed_within_seconds_and_may_be_retried(tmp_path):
    """An admin's `scancel`: the state is seen within STATE_POLL_S, and after submitit's grace
    for a late result file (15 s) the stage fails as an infrastructure error (retried)."""
    job = submit(slurm(tmp_path), section(1), "sleepy", sleep_long)
    seen = {}

    def log(line):
        seen.setdefault(line, time.time())
        if "sleeping" in line:
            subprocess.run(["scancel", job.job_id], check=True)

    with pytest.raises(InfrastructureError, match=f"job {job.job_id} was cancelled outside alignflow \\(CANCELLED\\)"):
        wait(job, log, poll_s=0.5)
    cancelled = min(t for line, t in seen.items() if "sleeping" in line)
    print(f"CANCELLED logged {seen[f'job {job.job_id}: CANCELLED'] - cancelled:.1f} s after scancel; raised after {time.time() - cancelled:.1f} s")
    assert seen[f"job {job.job_id}: CANCELLED"] - cancelled < 5


def test_cancelling_the_flow_run_in_prefect_cancels_its_slurm_jobs(prefect_server, base_overrides, tmp_path):
    """The real path: a Prefect runner (what a process worker uses) runs the flow in a child
    process; the run is set Cancelling; the runner signals the cancel intent and SIGTERMs the
    child, whose engine raises TerminationSignal in the flow's thread. Every Slurm job ends
    CANCELLED, the stage tasks end Cancelled (not retried) and the run ends Cancelled."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.runner import Runner
    from prefect.states import Cancelling

    from flows.align import align

    overrides = [*base_overrides, "launcher=slurm", "launcher.partition=debug", "launcher.setup=['sleep 300']"]
    jobs = tmp_path / "jobs"

    async def cancel_while_the_jobs_run():
        runner = Runner(name="slurm-cancel", query_seconds=1)
        deployment = await runner.aadd_flow(align, name="slurm-cancel", parameters={"pipeline": "demo", "overrides": overrides})
        serving = asyncio.create_task(runner.start())
        try:
            async with get_client() as client:
                run = await client.create_flow_run_from_deployment(deployment)
                deadline = time.time() + 180
                while not (ids := [p.name.split("_")[0] for p in jobs.glob("*/*/*_submission.sh")]) and time.time() < deadline:
                    await asyncio.sleep(0.5)
                while not any(squeue(j) == "RUNNING" for j in ids) and time.time() < deadline:
                    await asyncio.sleep(0.5)
                await client.set_flow_run_state(run.id, Cancelling(), force=True)
                while not (run := await client.read_flow_run(run.id)).state.is_final() and time.time() < deadline + 60:
                    await asyncio.sleep(0.5)
                this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))  # the session's server holds other tests' logs
                logs = [log.message for log in await client.read_logs(log_filter=this_run, limit=200)]
                return run.state.name, [p.name.split("_")[0] for p in jobs.glob("*/*/*_submission.sh")], logs
        finally:
            await runner.astop()
            serving.cancel()

    state, job_ids, logs = asyncio.run(cancel_while_the_jobs_run())
    assert state == "Cancelled" and job_ids, logs[-20:]
    deadline = time.time() + 30
    while any(squeue(j) for j in job_ids) and time.time() < deadline:
        time.sleep(0.5)
    assert [(squeue(j), sacct_state(j)) for j in job_ids] == [("", "CANCELLED")] * len(job_ids)
    for j in job_ids:
        assert f"job {j}: CANCELLED" in logs and any(f"Cancelled('job {j} cancelled with its flow run')" in m for m in logs), logs[-20:]
