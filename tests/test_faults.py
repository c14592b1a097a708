"""Faults injected for real, each with the run's outcome asserted.

- The Prefect server dies mid-training (the ephemeral one of `align run`, and a real one from
  infra/prefect-server.sh, both in one test: their outages overlap) and comes back 90 s later:
  each run completes, with the same weights as an undisturbed run.
- `align run` is SIGKILLed mid-training and run again: the rerun adopts the running job; no
  training step runs twice.
- `align run` gets SIGTERM, SIGINT or SIGHUP: it exits within 10 s and leaves no process behind.
- An empty or torn lease file (a crash between creating it and writing it) is taken over after
  its ttl.
- The store fails for a while during a lease's heartbeats (an S3 endpoint behind a connection
  that is cut): the holder keeps its lease and commits.
- A queued Slurm job of a dead run: cancelled when a rerun takes over; released anyway, it
  touches nothing.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from alignflow.orchestrator.config.compose import compose
from alignflow.orchestrator.lease import JOB_SUFFIX
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import plan, run_stage

REPO = Path(__file__).resolve().parents[1]
ALIGN = [sys.executable, "-m", "flows.cli", "run"]
PIPELINE = ["pipeline=demo", "~pipeline.stages.eval", "~pipeline.stages.export"]  # prep -> convert -> sft
SFT = [
    "sft.trainer.max_steps=40",
    "sft.checkpoint.every_n_steps=10",
    "sft.trainer.log_every_n_steps=1",
    "sft.optim.warmup_steps=1",
    "sft.trainer.val_check_interval=20",
    "sft.trainer.limit_val_batches=1",
    "store.lease_ttl_s=8",
    "store.poll_interval_s=0.5",
]
OUTAGE_S = 90.0


def overrides(base_overrides) -> list[str]:
    return [*base_overrides, *PIPELINE, *SFT]


@pytest.fixture(scope="module")
def upstream(demo_dir, tmp_path_factory) -> Path:
    """prep and convert committed once for the module: each test's store starts with them."""
    root = tmp_path_factory.mktemp("upstream")
    cfg = compose(None, [f"paths.demo={demo_dir}", f"store.root={root / 'store'}", f"launcher.folder={root / 'jobs'}", *PIPELINE, *SFT])
    stages = Pipeline.build(cfg)
    results = {name: run_stage(stages[name], {}, log=lambda line: None) for name in ("prep", "convert")}
    assert not any(r.cached for r in results.values())
    return root / "store"


@pytest.fixture
def seeded(upstream, base_overrides, tmp_path) -> list[str]:
    """This test's store holding prep's and convert's outputs (cache hits: the sft job comes at once)."""
    shutil.copytree(upstream, tmp_path / "store", ignore=shutil.ignore_patterns("_leases", "_staging"))
    return overrides(base_overrides)


@pytest.fixture(scope="module")
def reference(upstream, demo_dir, tmp_path_factory) -> dict:
    """The sft weights of an undisturbed run."""
    root = tmp_path_factory.mktemp("reference")
    shutil.copytree(upstream, root / "store", ignore=shutil.ignore_patterns("_leases", "_staging"))
    cfg = compose(None, [f"paths.demo={demo_dir}", f"store.root={root / 'store'}", f"launcher.folder={root / 'jobs'}", *PIPELINE, *SFT])
    stages = Pipeline.build(cfg)
    results = {}
    for stage in stages:
        results[stage.name] = run_stage(stage, {up: results[up] for up in stage.upstream()}, log=lambda line: None)
    return weights(Path(results["sft"].uri))


def weights(output: Path) -> dict:
    """Every tensor of a model output's torch_dist `model/`."""
    from alignflow.job.model_files.dist_io import DistCheckpointReader

    reader = DistCheckpointReader(str(output / "model"))
    return {key: reader.read(key) for key in reader.keys()}


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class AlignRun:
    """`align run` as a user starts it, in its own session, its output in a log file."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log = log
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}, **(env or {})}  # ephemeral unless told
        with open(log, "w") as out:
            self.process = subprocess.Popen([*ALIGN, *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_until(self, done, timeout: float = 300, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert self.process.poll() is None, f"align run ended ({self.process.returncode}) before {what}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.text()[-4000:]}"
            time.sleep(0.2)

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def finish(self, timeout: float = 600) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)


def training(store: Path, steps: int = 1):
    """A predicate: the sft job has logged `steps` steps in its staging folder."""

    def done() -> bool:
        return any(len(m.read_text().splitlines()) >= steps for m in (store / "sft" / "_staging").glob("*/metrics.jsonl"))

    return done


def committed_sft(store: Path) -> Path:
    (output,) = [m.parent for m in (store / "sft").glob("*/_SUCCESS.json")]
    return output


def steps_of(output: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()]


def sft_jobs(tmp_path: Path) -> int:
    return len(list((tmp_path / "jobs").glob("sft-*/*")))


def job_processes(store: Path) -> list[psutil.Process]:
    """The sft job's controller and ranks, found by the job record beside its lease: a warm job
    (alignflow.orchestrator.warm_jobs) is forked by its server, no descendant of its run."""
    found = []
    for record in (store / "sft" / "_leases").glob(f"*{JOB_SUFFIX}"):
        _, _, pid, started = json.loads(record.read_text())["job"]["process"]
        try:
            controller = psutil.Process(pid)
            if abs(controller.create_time() - started) < 0.01:
                found += [controller, *controller.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return found


def alive(processes: list[psutil.Process]) -> list[str]:
    running = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                running.append(" ".join(p.cmdline())[:160])
        except psutil.NoSuchProcess:
            pass
    return running


# ----------------------------------------------------------------------------- the Prefect server dies


@pytest.mark.slow
def test_the_prefect_server_dies_mid_training_and_comes_back(upstream, demo_dir, reference, tmp_path):
    """Two runs, each with its server SIGKILLed mid-training and started again on the same port and
    database at least 90 s later: one `align run` on its ephemeral server, one on
    infra/prefect-server.sh's server (killed with its process group). Both outages at once: the
    90 s are a wait, shared."""
    ephemeral, real = tmp_path / "ephemeral", tmp_path / "real"
    for folder in (ephemeral, real):
        shutil.copytree(upstream, folder / "store", ignore=shutil.ignore_patterns("_leases", "_staging"))
    port = free_port()
    infra = {**os.environ, "ALIGNFLOW_INFRA_DIR": str(real / "infra"), "PREFECT_SERVER_PORT": str(port), "PREFECT_HOME": str(real / "prefect-home")}
    script = str(REPO / "infra" / "prefect-server.sh")
    subprocess.run([script, "up"], env=infra, check=True, capture_output=True, timeout=300)
    api = {"PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_HOME": str(real / "prefect-home")}
    runs = {folder: AlignRun(own_store(demo_dir, folder), folder / "run.log", env=api if folder == real else None) for folder in (ephemeral, real)}
    restarted, killed, deadline = None, set(), time.monotonic() + 300
    try:
        while killed != set(runs):  # each server killed as its run trains: the ephemeral run starts later (its own server first)
            for folder in set(runs) - killed:
                what = f"sft's first step ({folder.name} server)"
                assert runs[folder].process.poll() is None, f"align run ended before {what}:\n{runs[folder].text()[-4000:]}"
                assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{runs[folder].text()[-4000:]}"
                if not training(folder / "store")():
                    continue
                if folder == ephemeral:
                    (server,) = [p for p in runs[ephemeral].descendants() if "uvicorn" in " ".join(p.cmdline())]
                    argv, env, cwd = server.cmdline(), server.environ(), server.cwd()
                    server.kill()
                else:
                    os.killpg(int((real / "infra" / "prefect-server.pid").read_text()), signal.SIGKILL)
                killed.add(folder)
            time.sleep(0.2)
        time.sleep(OUTAGE_S)  # from the second kill: each outage lasts at least this
        restarted = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        subprocess.run([script, "up"], env=infra, check=True, capture_output=True, timeout=300)
        for folder, run in runs.items():
            assert run.finish() == 0, f"{folder.name}: " + run.text()[-4000:]
        caught_up(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/api", ephemeral / "store")
        caught_up(api["PREFECT_API_URL"], real / "store")
    finally:
        for run in runs.values():
            run.finish(timeout=1)
        if restarted is not None:
            restarted.terminate()
            restarted.wait(timeout=30)
        subprocess.run([script, "down"], env=infra, capture_output=True, timeout=120)
    for folder in (ephemeral, real):
        output = committed_sft(folder / "store")
        assert same_weights(weights(output), reference), folder.name
        assert steps_of(output) == list(range(1, 41)) and sft_jobs(folder) == 1, folder.name


def own_store(demo_dir, folder: Path) -> list[str]:
    """`align run`'s overrides for a store and job folder under `folder`."""
    return [f"paths.demo={demo_dir}", f"store.root={folder / 'store'}", f"launcher.folder={folder / 'jobs'}", *PIPELINE, *SFT]


def caught_up(api: str, store: Path) -> None:
    """The server that came back shows the run as it ended: the flow run and every stage
    Completed, and the stages' artifacts (made while it was down, or after)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    (record,) = [json.loads(p.read_text()) for p in (store / "_runs").glob("*.json")]
    this_run = FlowRunFilter(id=FlowRunFilterId(any_=[record["flow_run_id"]]))
    with SyncPrefectClient(api) as client:
        assert client.read_flow_run(record["flow_run_id"]).state.is_completed()
        states = {run.name: run.state.name for run in client.read_task_runs(flow_run_filter=this_run)}
        assert states == {"prep": "Cached", "convert": "Cached", "sft": "Completed"}, states
        keys = {artifact.key for artifact in client.read_artifacts(flow_run_filter=this_run)}
        assert {"stage-sft", "curves-sft", "steps-sft", "progress-sft", "align-demo"} <= keys, keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the orchestrator dies or is stopped


@pytest.mark.slow
def test_a_killed_run_s_job_is_adopted_by_the_rerun(seeded, reference, tmp_path):
    """`align run` SIGKILLed while sft trains: its Prefect server goes with it, its job trains
    on; the rerun carries on with that job (no second job, no step twice) and commits it."""
    first = AlignRun(seeded, tmp_path / "first.log")
    first.wait_until(training(tmp_path / "store", steps=3), what="sft's third step")
    server = [p for p in first.descendants() if "uvicorn" in " ".join(p.cmdline())]
    jobs = job_processes(tmp_path / "store")
    assert server and jobs
    first.process.kill()
    first.process.wait()
    second = AlignRun(seeded, tmp_path / "second.log")
    try:
        assert second.finish() == 0, second.text()[-4000:]
    finally:
        second.finish(timeout=1)
    assert alive(server) == []  # a helper: ended with its process
    assert "carrying on with local job" in second.text()
    output = committed_sft(tmp_path / "store")
    assert steps_of(output) == list(range(1, 41)) and sft_jobs(tmp_path) == 1
    assert same_weights(weights(output), reference)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_stopped_run_exits_within_10_s_and_leaves_no_process(seeded, tmp_path, signum):
    run = AlignRun(seeded, tmp_path / "run.log")
    try:
        run.wait_until(training(tmp_path / "store"), what="sft's first step")
        jobs = job_processes(tmp_path / "store")
        assert jobs
        started = run.descendants() + jobs
        sent = time.monotonic()
        run.process.send_signal(signum)
        run.process.wait(timeout=30)
        assert time.monotonic() - sent < 10, run.text()[-3000:]
        gone, left = psutil.wait_procs(started, timeout=10)
        assert alive(left) == [], run.text()[-3000:]
    finally:
        run.finish(timeout=1)
    assert not list((tmp_path / "store" / "sft").glob("*/_SUCCESS.json"))
    assert not list((tmp_path / "store" / "sft" / "_leases").glob("*.json"))  # released: a rerun need not wait


# ----------------------------------------------------------------------------- leases


@pytest.mark.slow
@pytest.mark.parametrize("record", [b"", b'{"owner": "host:1:ab'], ids=["empty", "torn"])
def test_an_unreadable_lease_file_is_taken_over_after_its_ttl(base_overrides, tmp_path, record):
    cfg = compose("demo", [*base_overrides, "store.lease_ttl_s=2"])
    stage = Pipeline.build(cfg)["prep"]
    (planned,) = [row for row in plan(Pipeline.build(cfg)) if row.stage == "prep"]
    lease = tmp_path / "store" / "prep" / "_leases" / f"{planned.fingerprint}.json"
    lease.parent.mkdir(parents=True)
    lease.write_bytes(record)
    lines, started = [], time.monotonic()
    result = run_stage(stage, {}, log=lines.append)
    assert not result.cached and result.fingerprint == planned.fingerprint
    assert time.monotonic() - started >= 2.0  # one ttl of watching it stand still
    assert any("another run holds the lease (held by <unreadable record>" in line for line in lines)
    assert not lease.exists()


class Link:
    """A TCP forwarder to `upstream` that can be cut (connections reset, new ones refused) and
    restored on the same port: a network fault between a client and its S3 endpoint."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream, self.port, self.connections = upstream, free_port(), []
        self._listen()

    def _listen(self) -> None:
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", self.port))
        self.server.listen(64)
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            remote = socket.create_connection(self.upstream)
            self.connections += [client, remote]
            self._connect(client, remote)

    def _connect(self, client: socket.socket, remote: socket.socket) -> None:
        for a, b in ((client, remote), (remote, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.close()
            except OSError:
                pass

    def cut(self) -> None:
        self.server.close()
        for s in self.connections:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset, not close
                s.close()
            except OSError:
                pass
        self.connections = []

    def restore(self) -> None:
        self._listen()


def test_a_store_that_fails_for_a_while_does_not_lose_the_lease(s3_endpoint, tmp_path):
    """An S3 lease whose endpoint is unreachable for half its ttl (every beat in between fails):
    its holder keeps it, beats again once the store is back, and may commit; a contender on a
    sound connection never takes it over."""
    import fsspec

    from alignflow.orchestrator.lease import Lease

    host, port = s3_endpoint.removeprefix("http://").split(":")
    link = Link((host, int(port)))
    through = fsspec.filesystem(
        "s3",
        client_kwargs={"endpoint_url": f"http://127.0.0.1:{link.port}"},
        skip_instance_cache=True,
        config_kwargs={"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}},
    )
    direct = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    path = f"test/faults/{tmp_path.name}/f1.json"
    holder, contender = Lease(through, path, ttl_s=6.0), Lease(direct, path, ttl_s=6.0)
    assert holder.try_acquire()
    link.cut()
    deadline = time.monotonic() + 3.0  # half the ttl: beats at 1.5 s intervals fail meanwhile
    while time.monotonic() < deadline:
        assert not contender.try_acquire()
        time.sleep(0.2)
    link.restore()
    time.sleep(3.0)
    assert not holder.lost.is_set()
    holder.check()  # it may commit
    assert not contender.try_acquire()
    holder.release()
    assert not direct.exists(path)


# ----------------------------------------------------------------------------- a queued job of a dead run


RUN_HELD = """
import json, sys
from alignflow.orchestrator.config.compose import build
from alignflow.orchestrator.runner import run_stage
run_stage(build("demo", sys.argv[1:])["prep"], {}, log=lambda line: print(line, flush=True))
"""


@pytest.mark.slow
def test_a_queued_job_of_a_dead_run_is_cancelled_and_touches_nothing(slurm_cluster, base_overrides, tmp_path):
    """A run submits prep to Slurm held in the queue, and dies. A rerun takes the lease over and
    cancels that job. Released anyway (a launcher that cannot cancel, or a release racing the
    takeover), a queued job of a dead run finds the lease is not its run's and touches nothing:
    not even prep's scratch folder in the shared staging."""
    held = [*base_overrides, "launcher=slurm", "launcher.partition=debug", "+launcher.sbatch_extra.hold=true", "store.lease_ttl_s=4"]
    first = subprocess.Popen([sys.executable, "-c", RUN_HELD, *held], cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = first.stdout.readline()
    assert "submitted slurm job" in line, line
    job_id = line.split("submitted slurm job ")[1].split(",")[0]
    first.kill()
    first.wait()
    (staging,) = (tmp_path / "store" / "prep" / "_staging").iterdir()
    sentinel = staging / "_prep" / "sentinel"
    sentinel.parent.mkdir()
    sentinel.write_text("a file the queued job must not delete")

    # A run that takes the lease over without cancelling the job (as if it could not), then the job is released.
    from alignflow.orchestrator.store import Store

    store = Store(str(tmp_path / "store"), {})
    with store.lease("prep", staging.name, ttl_s=4.0, poll_s=0.2, log=lambda _: None) as lease:
        assert lease is not None and lease.previous["job"]["job_id"] == job_id
        subprocess.run(["scontrol", "release", job_id], check=True)
        assert wait_for(lambda: slurm_state(job_id) in ("COMPLETED", "FAILED"), 120), slurm_state(job_id)
        assert sentinel.read_text() == "a file the queued job must not delete"
        assert "not starting: the lease" in (tmp_path / "jobs").glob(f"prep-*/*/{job_id}_0_log.out").__next__().read_text()

    # The rerun proper: it takes the dead run's lease over and cancels its queued job.
    second = subprocess.Popen([sys.executable, "-c", RUN_HELD, *held], cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = second.stdout.readline()
    job_id = line.split("submitted slurm job ")[1].split(",")[0]
    second.kill()
    second.wait()
    third = subprocess.run(
        [sys.executable, "-c", RUN_HELD, *base_overrides, "launcher=slurm", "launcher.partition=debug"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert wait_for(lambda: slurm_state(job_id) == "CANCELLED", 60), slurm_state(job_id)
    assert list((tmp_path / "store" / "prep").glob("*/_SUCCESS.json"))


def slurm_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True).stdout.split()
    return out[0] if out else ""


def wait_for(done, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


class Forgetful(Link):
    """An S3 endpoint that ignores conditional writes, as some S3-compatible stores do: a proxy
    that drops the If-Match and If-None-Match headers of every request on its way."""

    DROPPED = (b"if-match:", b"if-none-match:")

    def _connect(self, client: socket.socket, remote: socket.socket) -> None:
        threading.Thread(target=self._requests, args=(client.makefile("rb"), remote), daemon=True).start()
        threading.Thread(target=self._pump, args=(remote, client), daemon=True).start()

    def _requests(self, incoming, remote: socket.socket) -> None:
        """Each request's head without the dropped headers, then its body as it came."""
        try:
            while line := incoming.readline():
                head, length, chunked = [line], 0, False
                while (line := incoming.readline()) not in (b"\r\n", b""):
                    name = line.lower()
                    length = int(line.split(b":", 1)[1]) if name.startswith(b"content-length:") else length
                    chunked |= name.startswith(b"transfer-encoding:") and b"chunked" in name
                    if not name.startswith(self.DROPPED):
                        head.append(line)
                remote.sendall(b"".join(head) + b"\r\n")
                remote.sendall(incoming.read(length) if not chunked else self._chunks(incoming))
        except OSError:
            pass

    @staticmethod
    def _chunks(incoming) -> bytes:
        body = b""
        while True:
            size_line = incoming.readline()
            body += size_line
            size = int(size_line.split(b";")[0], 16)
            body += incoming.read(size + 2)
            if size == 0:
                while (trailer := incoming.readline()) not in (b"\r\n", b""):
                    body += trailer
                return body + b"\r\n" if not body.endswith(b"\r\n\r\n") else body


def test_an_s3_store_without_conditional_writes_is_refused_at_compose(s3_endpoint, base_overrides, tmp_path):
    """Leases on S3 rely on If-None-Match and If-Match: an endpoint that ignores them would let
    two runs produce one output. The real endpoint passes the probe; behind a proxy that drops
    those headers it is refused, naming the key and what failed, and nothing is left behind."""
    import fsspec

    from alignflow.orchestrator.config.compose import ConfigError

    host, port = s3_endpoint.removeprefix("http://").split(":")
    forgetful = Forgetful((host, int(port)))
    root = f"s3://test/conditional/{tmp_path.name}"
    compose("demo", [*base_overrides, f"store.root={root}", f"+store.storage_options.client_kwargs.endpoint_url={s3_endpoint}"])
    with pytest.raises(ConfigError) as err:
        compose(
            "demo", [*base_overrides, f"store.root={root}", f"+store.storage_options.client_kwargs.endpoint_url=http://127.0.0.1:{forgetful.port}"]
        )
    assert f"store.root: {root} cannot hold alignflow's leases, which need S3's conditional writes: it overwrote an object" in str(err.value)
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    assert not fs.exists(root) or fs.find(root) == []
