"""Jobs across the nodes of the real 2-node cluster (infra/slurm.sh, `slurm_cluster`): each node
a slurmd in its own network, UTS and mount namespace. Ranks meet at the first node's address
over the interface that routes there, training at DP2 and PP2 with one rank per node gives
the single-node run's losses, and a store a node cannot see is refused before any rank starts."""

import subprocess
import sys
import time
import uuid
from pathlib import Path

import cloudpickle
import pytest
from omegaconf import OmegaConf

from alignflow.orchestrator.config.compose import compose
from alignflow.orchestrator.config.schema import LauncherConfig
from alignflow.orchestrator.launch import StageFailed, submit, wait
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import run_stage

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import assert_same_steps, convert_demo, metrics_lines, prep_demo, sft_cfg, stage_cfg  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # jobs run this file's functions by value
pytestmark = pytest.mark.usefixtures("slurm_cluster")
NODE_LOCAL = Path("/var/lib/alignflow-slurm/node-local")  # each node's own tmpfs there (infra/slurm.sh); the host's folder is another


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


@pytest.mark.slow
def test_sft_at_dp2_across_two_nodes_has_the_single_node_losses(demo_dir, inputs, tmp_path):
    one, two = one_and_two_nodes(tmp_path, "sft", sft_cfg(demo_dir, resources={"tasks_per_node": 2}), inputs)
    assert_same_steps(one, two, 1e-6)


@pytest.mark.slow
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


def pausing_rank_1_after_a_checkpoint(pid_file: str, *args):
    """`run_stage_job` whose rank 1 writes its pid to `pid_file` after its first checkpoint and
    sleeps, for the test to kill it there; once that file exists (a later attempt), plain."""
    import os
    import time

    from alignflow.job.train import checkpointing
    from alignflow.job.worker import run_stage_job

    if os.environ["SLURM_PROCID"] == "1" and not os.path.exists(pid_file):
        save = checkpointing.save

        def save_then_sleep(*a, **kw):
            path = save(*a, **kw)
            Path(pid_file).write_text(str(os.getpid()))
            time.sleep(120)
            return path

        checkpointing.save = save_then_sleep
    return run_stage_job(*args)


@pytest.mark.slow
def test_a_rank_killed_on_its_node_fails_the_job_for_a_retry_that_resumes_from_the_checkpoint(demo_dir, inputs, tmp_path):
    """Rank 1's process on the second node is killed (SIGKILL) after the step-3 checkpoint: rank 0
    fails on its lost peer, and the job fails as an infrastructure error (retried), not as the
    stage's; the retry (a new job on the same output, as the runner submits it) resumes from step
    3 and completes, each step once in metrics.jsonl."""
    import os
    import signal

    from alignflow.orchestrator.launch import InfrastructureError

    cfg = sft_cfg(
        demo_dir, resources={"nodes": 2, "tasks_per_node": 1}, trainer={"max_steps": 6, "val_check_interval": 3}, checkpoint={"every_n_steps": 3}
    )
    out, pid_file, lines = tmp_path / "out", tmp_path / "rank1.pid", []
    args = (str(pid_file), "sft", cfg, inputs, str(out), {})
    job = submit(launcher(tmp_path), section(2, 1), "sft", pausing_rank_1_after_a_checkpoint, *args, resumable=True)
    deadline = time.time() + 300
    while not pid_file.exists() and time.time() < deadline and not job.done():
        time.sleep(0.5)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    with pytest.raises(InfrastructureError, match=rf"job {job.job_id} lost rank\(s\) 1 \(killed, or their node failed\), then rank 0 failed"):
        wait(job, lines.append)
    retry = submit(launcher(tmp_path), section(2, 1), "sft", pausing_rank_1_after_a_checkpoint, *args, resumable=True)
    retried = []
    assert wait(retry, retried.append)["steps"] == 6
    assert any(f"resumed from {out / 'checkpoints' / 'step-00000003'} (step 3 of 6)" in line for line in retried), retried[-30:]
    assert [line["step"] for line in metrics_lines(out)] == [1, 2, 3, 4, 5, 6]
