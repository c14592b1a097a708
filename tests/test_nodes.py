"""Jobs across the nodes of the real 2-node cluster (infra/slurm.sh, `slurm_cluster`): each node
a slurmd in its own network, UTS and mount namespace. Ranks meet at the first node's address
over the interface that routes there, training at DP2 and PP2 with one rank per node gives
the single-node run's losses, a store a node cannot see is refused before any rank starts, and
a flow run whose training job loses a node mid-training retries the stage, which resumes from its
checkpoint, each node with its own scratch in a node-local `store.cache_dir`."""

import json
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import cloudpickle
import fsspec
import pytest
from omegaconf import OmegaConf

from alignflow.orchestrator.config.compose import compose
from alignflow.orchestrator.config.schema import LauncherConfig
from alignflow.orchestrator.launch import StageFailed, submit, wait
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import run_stage

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import assert_same_steps, convert_demo, prep_demo, sft_cfg, stage_cfg  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # jobs run this file's functions by value
# every test here runs on the Slurm cluster, whose start alone takes ~35 s of a loaded machine
pytestmark = [pytest.mark.usefixtures("slurm_cluster"), pytest.mark.slow]
SLURM_STATE = Path("/var/lib/alignflow-slurm")  # infra/slurm.sh's state: the slurmds' pid files
NODE_LOCAL = SLURM_STATE / "node-local"  # each node's own tmpfs there (infra/slurm.sh); the host's folder is another


@pytest.fixture(scope="module", autouse=True)
def two_nodes(slurm_cluster):
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout.split()
    if len(nodes) < 2:
        pytest.skip(f"the cluster has {len(nodes)} node(s) (SLURM_NODES=1)")
    return nodes


def launcher(tmp_path, name="slurm"):
    return OmegaConf.merge(
        OmegaConf.structured(LauncherConfig), {"name": name, "partition": "debug", "folder": str(tmp_path / "jobs"), "time_min": 30}
    )


def section(nodes: int, tasks: int):
    return OmegaConf.create({"resources": {"nodes": nodes, "tasks_per_node": tasks}, "timeout_min": 20})


def where_am_i() -> dict:
    import os
    import socket

    import torch
    import torch.distributed as dist

    from alignflow.job.worker import _setup_rank

    rank = _setup_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "sum": value.item(),
        "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
        "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
        "nodelist": os.environ["SLURM_JOB_NODELIST"],
    }


def test_ranks_on_two_nodes_meet_at_the_first_node_over_the_nodes_network(tmp_path, two_nodes):
    jobs = [submit(launcher(tmp_path), section(2, 1), "where", where_am_i) for _ in range(2)]
    results = [(wait(job, lambda _: None), job.results()) for job in jobs]
    for _, ranks in results:
        first = subprocess.run(["scontrol", "show", "hostnames", ranks[0]["nodelist"]], capture_output=True, text=True).stdout.split()[0]
        assert sorted(r["host"] for r in ranks) == sorted(two_nodes) and [r["sum"] for r in ranks] == [3.0, 3.0]
        assert {r["master"] for r in ranks} == {(first, ranks[0]["master"][1])}  # Slurm's first node, one port
        assert [r["gloo"] for r in ranks] == ["eth0", "eth0"]  # each node's own address on the bridge, not loopback
    assert results[0][1][0]["master"][1] != results[1][1][0]["master"][1]  # two jobs, two ports


def test_up_brings_the_cluster_back_on_a_machine_restarted_from_its_disk(two_nodes):
    """A machine restarted from its disk (as a CI machine from a snapshot) keeps /run/netns's files
    without their namespaces, pid files that name other processes, and a controller's state with
    jobs running whose processes are gone: `up` starts it all again, those jobs cancelled."""
    script = Path(__file__).parents[1] / "infra" / "slurm.sh"
    job = subprocess.run(
        ["sbatch", "--parsable", "-N1", "-o", "/dev/null", "--wrap", "sleep 601"], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        deadline = time.time() + 300  # launched, as the controller knows (the nodes may be finishing an earlier test's jobs)
        while f"{job}.batch" not in subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True).stdout:
            assert time.time() < deadline, f"job {job} never started"
            time.sleep(0.5)
        restart_from_disk(two_nodes)
        up = subprocess.run([str(script), "up"], capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["scancel", job])
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    hosts = subprocess.run(["srun", "-N2", "-n2", "hostname"], capture_output=True, text=True, timeout=120)
    assert sorted(hosts.stdout.split()) == sorted(two_nodes), hosts.stdout + hosts.stderr
    assert f"job {job}: restored as running, no process left: cancelled" in up.stdout


def restart_from_disk(nodes: list[str]) -> None:
    """What a machine restarted from its disk has: the controller's saved state, no process, the
    nodes' namespace files without namespaces, pid files naming other processes."""
    subprocess.run(["scontrol", "shutdown", "slurmctld"], check=True)  # its state saved with the job running, then it exits
    while subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0:
        time.sleep(0.2)
    subprocess.run(["pkill", "-9", "-f", "^sleep 601$"])  # the job's process, no other sleep on the machine
    for daemon in ("slurmstepd", "slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"):
        subprocess.run(["pkill", "-9", "-x", daemon])
    for node in nodes:
        subprocess.run(["umount", f"/run/netns/{node}"], check=True)  # the file stays, the namespace is gone
        subprocess.run(["ip", "link", "del", f"v-{node}"], capture_output=True)
        (SLURM_STATE / f"slurmd-{node}.pid").write_text("1\n")  # pid 1 lives, and is no slurmd
    subprocess.run(["ip", "link", "del", "afslurm0"], capture_output=True)
    Path("/run/munge/munged.pid").write_text("1\n")


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    """Demo data (with preference pairs), the demo model, and its reference log-probs for DPO."""
    from alignflow.job.stages import eval as eval_stage
    from alignflow.job.stages import ref_logprobs
    from alignflow.job.worker import typed

    root = tmp_path_factory.mktemp("nodes-inputs")
    data, model = str(prep_demo(demo_dir, root / "data", preference=True)), str(convert_demo(demo_dir, root / "model"))
    ref_logprobs.run(
        typed(
            {
                "ref_logprobs": {"micro_batch_size": 8, "parallel": eval_stage.SINGLE_RANK, "precision": "fp32"},
                "model": {"make_vocab_size_divisible_by": 128},
            }
        ),
        {"data": data, "model": model},
        str(root / "ref"),
    )
    return {"data": data, "model": model, "ref_logprobs": str(root / "ref")}


def one_and_two_nodes(tmp_path, kind: str, cfg: dict, inputs: dict) -> tuple[Path, Path]:
    """`cfg`'s stage on 2 local ranks (one machine) and on 2 Slurm nodes of one rank each, at once."""
    from alignflow.job.worker import run_stage_job

    jobs = {}
    for where, nodes, tasks in (("local", 1, 2), ("slurm", 2, 1)):
        stage_cfg_ = {**cfg, kind: {**cfg[kind], "resources": {"nodes": nodes, "tasks_per_node": tasks}}}
        out = tmp_path / where
        jobs[out] = submit(
            launcher(tmp_path, where), section(nodes, tasks), kind, run_stage_job, kind, stage_cfg_, inputs, str(out), {}, shared=(str(tmp_path),)
        )
    lines = []
    for job in jobs.values():
        wait(job, lines.append)
    return tuple(jobs)


def test_sft_at_dp2_across_two_nodes_has_the_single_node_losses(demo_dir, inputs, tmp_path):
    one, two = one_and_two_nodes(tmp_path, "sft", sft_cfg(demo_dir, resources={"tasks_per_node": 2}), inputs)
    assert_same_steps(one, two, 1e-6)


def test_dpo_at_pp2_across_two_nodes_has_the_single_node_losses(demo_dir, inputs, tmp_path):
    cfg = stage_cfg("dpo", demo_dir, 1, 2, loss={"beta": 0.1}, trainer={"val_check_interval": 5})
    one, two = one_and_two_nodes(tmp_path, "dpo", cfg, inputs)
    assert_same_steps(one, two, 1e-6, keys=("loss", "reward_margin", "chosen_reward", "val_loss"))


@pytest.mark.parametrize("nodes", [2, 1])
def test_a_store_a_node_cannot_see_is_refused_at_job_start_and_nothing_is_committed(base_overrides, tmp_path, nodes):
    """The store is a folder of this host that the nodes do not mount (there each has its own
    tmpfs at that place): the job fails before any rank starts, naming the path and the node,
    and the stage's output is not committed (a rerun is no cache hit)."""
    store = NODE_LOCAL / f"test-{uuid.uuid4().hex[:8]}" / "store"
    overrides = [
        *base_overrides,
        f"store.root={store}",
        "pipeline.stages={convert: {}}",
        "launcher=slurm",
        "launcher.partition=debug",
        f"convert.resources.nodes={nodes}",
    ]
    try:
        convert = Pipeline.build(compose("demo", overrides))["convert"]
        with pytest.raises(
            StageFailed,
            match=rf"job \d+: {store}/convert/\S+ is not visible from node (afnode1|afnode2): it must be on a "
            "filesystem every node mounts",
        ):
            run_stage(convert, {}, log=print)
        assert not list(store.rglob("_SUCCESS.json"))
        assert not list(store.rglob("*.safetensors")) and not list(store.rglob("*.distcp"))
    finally:
        subprocess.run(["rm", "-rf", str(store.parent)], check=True)


PAUSE_RANK_1 = """\
# sitecustomize of the test's jobs (launcher.setup puts it on PYTHONPATH): rank 1 writes its pid
# to $AF_TEST_PID_FILE after its first checkpoint (saved and uploaded) and sleeps there, for the
# test to kill its node's processes; once that file exists (the retry), nothing.
import importlib.abc, importlib.util, os, sys, time

PID_FILE = os.environ.get("AF_TEST_PID_FILE", "")


class PauseAfterTheFirstCheckpoint(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "alignflow.job.train.engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            save = module.save_checkpoint

            def save_then_sleep(run):
                save(run)  # written and uploaded
                open(PID_FILE, "w").write(str(os.getpid()))
                time.sleep(300)

            module.save_checkpoint = save_then_sleep

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SLURM_PROCID") == "1" and PID_FILE and not os.path.exists(PID_FILE):
    sys.meta_path.insert(0, PauseAfterTheFirstCheckpoint())
"""


def on_node(node: str, command: str) -> str:
    """`command` in `node`'s mount namespace, where its node-local tmpfs is, as its jobs see it."""
    pid = (SLURM_STATE / f"slurmd-{node}.pid").read_text().strip()
    return subprocess.run(["nsenter", "-t", pid, "-m", "sh", "-c", command], capture_output=True, text=True, check=True).stdout


def kill_the_job_on_the_node_of(pid: int) -> tuple[str, list[int]]:
    """SIGKILL every process of pid's Slurm job on pid's node (its rank, the checkpoint writer
    it spawned): as if the node died under the job. The node's name and the pids killed."""
    import psutil

    env = psutil.Process(pid).environ()
    job, node = env["SLURM_JOB_ID"], env["SLURMD_NODENAME"]
    victims = []
    for process in psutil.process_iter():
        try:
            other = process.environ()
        except psutil.Error:
            continue
        if other.get("SLURM_JOB_ID") == job and other.get("SLURMD_NODENAME") == node:
            victims.append(process)
    for process in victims:
        process.kill()
    return node, [p.pid for p in victims]


def test_a_node_killed_mid_training_is_retried_by_the_flow_and_resumes_with_node_local_scratch(
    prefect_server, s3_endpoint, base_overrides, two_nodes, tmp_path
):
    """The flow (`align`, launcher=slurm) runs prep, convert and sft at DP2 over the two nodes,
    the store on S3 and `store.cache_dir` on each node's own tmpfs. After sft's step-3
    checkpoint every process of its job on rank 1's node is killed: rank 0 fails on its lost
    peer, the job fails as an infrastructure error, the stage's task is retried, and its new job
    resumes from step 3 on both nodes and completes, each step once in metrics.jsonl; the flow
    run ends Completed. Each node downloaded the input model into its own cache and keeps it
    there; the training scratch of each node is gone (the killed node's too, emptied by the
    retry), and a file of the user's in the cache is left alone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from flows.align import align

    hook, pid_file, tag = tmp_path / "hook", tmp_path / "rank1.pid", uuid.uuid4().hex[:8]
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PAUSE_RANK_1)
    cache, bucket = NODE_LOCAL / f"cache-{tag}", f"test/nodes-{tag}"
    for node in two_nodes:
        on_node(node, f"mkdir -p {cache} && echo mine > {cache}/users-file")
    overrides = [
        *(o for o in base_overrides if not o.startswith("store.root=")),
        "~pipeline.stages.eval",
        "~pipeline.stages.export",  # prep -> convert -> sft
        "launcher=slurm",
        "launcher.partition=debug",
        f"launcher.setup=['export PYTHONPATH={hook}:$PYTHONPATH AF_TEST_PID_FILE={pid_file}']",
        f"store.root=s3://{bucket}/store",
        f"+store.storage_options.client_kwargs.endpoint_url={s3_endpoint}",
        f"store.cache_dir={cache}",
        "sft.resources.nodes=2",
        "sft.resources.tasks_per_node=1",
        "sft.retries=1",
        "sft.trainer.max_steps=6",
        "sft.optim.warmup_steps=1",
        "sft.trainer.val_check_interval=3",
        "sft.trainer.limit_val_batches=1",
        "sft.trainer.log_every_n_steps=1",
        "sft.checkpoint.every_n_steps=3",
    ]
    killed = {}

    def kill_when_paused():
        deadline = time.time() + 600
        while not pid_file.exists() and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(0.2)  # the pid is written
        killed["node"], killed["pids"] = kill_the_job_on_the_node_of(int(pid_file.read_text()))

    killer = threading.Thread(target=kill_when_paused, daemon=True)
    killer.start()
    started = time.time()
    try:
        state = align(pipeline="demo", overrides=overrides, return_state=True)
        print(f"flow with a node's job killed: {time.time() - started:.1f} s")
        APILogHandler().flush()  # the run's last logs reach the API
        messages = []
        with get_client(sync_client=True) as client:
            this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
            while page := client.read_logs(log_filter=this_run, limit=200, offset=len(messages)):  # the API's most a call
                messages += [log.message for log in page]
        logs = "\n".join(messages)
        assert state.is_completed() and int(pid_file.read_text()) in killed.get("pids", ()), logs[-4000:]
        sft = state.result()["sft"]
        assert re.search(r"job \d+ lost rank\(s\) 1 \(killed, or their node failed\), then rank 0 failed", logs), logs[-4000:]
        assert "(step 3 of 6)" in logs and "resumed from" in logs, logs[-4000:]
        fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_endpoint})
        steps = [json.loads(line)["step"] for line in fs.cat_file(f"{sft.uri}/metrics.jsonl").decode().splitlines()]
        assert steps == [1, 2, 3, 4, 5, 6] and sft.metrics["steps"] == 6
        for node in two_nodes:
            left = on_node(node, f"cd {cache} && find . | sort").split()
            assert "./users-file" in left and on_node(node, f"cat {cache}/users-file") == "mine\n"
            assert not [p for p in left if p.startswith("./scratch/")], (node, left)  # no training scratch left
            assert any(p.startswith("./inputs/s3/") and p.endswith("/model/.metadata") for p in left), (node, left)  # its own copy, kept
    finally:
        for node in two_nodes:
            on_node(node, f"rm -rf {cache}")
