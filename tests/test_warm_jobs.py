"""Local jobs forked from the warm server (alignflow.job.forkserver) against submitit's own cold
start as the reference: the same environment, arguments, signal handlers and exit states, the
same trained weights; a server whose imported files changed is never used; any failure to start
warm starts the job cold."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import cloudpickle
import psutil
import pytest
from omegaconf import OmegaConf

from alignflow import PROJECT_ROOT
from alignflow.orchestrator import warm_jobs
from alignflow.orchestrator.config.schema import LauncherConfig
from alignflow.orchestrator.launch import InfrastructureError, make_executor, submit, wait
from alignflow.orchestrator.warm_jobs import Controller, WarmLocalExecutor

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import convert_demo, prep_demo, sft_cfg, weights  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # jobs run this file's functions by value


def launcher(tmp_path: Path, warm: bool) -> LauncherConfig:
    return OmegaConf.merge(OmegaConf.structured(LauncherConfig), {"folder": str(tmp_path / "jobs"), "warm_start": warm})


def section(tasks: int = 1):
    return OmegaConf.create({"resources": {"nodes": 1, "tasks_per_node": tasks}, "timeout_min": None})


def what_a_rank_sees(imports: bool = True) -> dict:
    """After importing what the server imports (a cold rank imports it then; a warm one has)."""
    import submitit

    from alignflow.job import forkserver

    if imports:
        forkserver.preload()
    env = submitit.JobEnvironment()
    handlers = {int(s): repr(signal.getsignal(s)) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)}
    return {
        "env": {k: v for k, v in os.environ.items() if k not in ("SUBMITIT_LOCAL_JOB_ID", "MASTER_PORT", "PYTEST_CURRENT_TEST")},
        "rank": env.global_rank,
        "cwd": os.getcwd(),
        "argv": sys.argv[1:],
        "path": sys.path,
        "handlers": handlers,
        "parent_is_the_controller": os.getppid() == int(env.job_id),
        "stdin_is_the_submitters": os.path.samestat(os.fstat(0), os.stat(f"/proc/{os.getppid()}/fd/0")),
        "server": psutil.Process(os.getppid()).ppid(),
    }


def run_job(tmp_path: Path, warm: bool, fn, *args, tasks: int = 1):
    job = submit(launcher(tmp_path, warm), section(tasks), "probe", fn, *args)
    return job, job.results()


@pytest.fixture
def own_server(monkeypatch):
    """A server key of this test's own (an environment variable), so no other test's server serves it."""
    monkeypatch.setenv("ALIGNFLOW_TEST_SERVER", uuid.uuid4().hex)


@pytest.mark.slow
def test_a_warm_rank_sees_what_a_cold_rank_sees(tmp_path, own_server):
    (cold_job, cold), (warm_job, warm) = run_job(tmp_path, False, what_a_rank_sees, tasks=2), run_job(tmp_path, True, what_a_rank_sees, tasks=2)
    assert isinstance(warm_job._process, Controller) and not isinstance(cold_job._process, Controller)

    def seen(rank: dict, job) -> str:  # the job's own folder and objects' addresses aside
        text = json.dumps({**rank, "server": None}, sort_keys=True).replace(str(job.paths.folder), "FOLDER")
        return re.sub(r" at 0x[0-9a-f]+", "", text)

    assert len(cold) == len(warm) == 2
    for one, other in zip(cold, warm):
        assert seen(one, cold_job) == seen(other, warm_job)
    assert warm[0]["parent_is_the_controller"] and warm[0]["stdin_is_the_submitters"]
    assert warm[0]["server"] != os.getpid() and cold[0]["server"] == os.getpid()  # cold: the controller is our child


def test_a_warm_sft_job_trains_the_weights_of_a_cold_one(demo_dir, tmp_path):
    from alignflow.job.worker import run_stage_job

    inputs = {"data": str(prep_demo(demo_dir, tmp_path / "data")), "model": str(convert_demo(demo_dir, tmp_path / "model"))}
    cfg = sft_cfg(demo_dir, trainer={"max_steps": 3, "val_check_interval": 3})
    trained = {}
    for warm in (False, True):
        out = tmp_path / f"out-{warm}"
        job = submit(launcher(tmp_path, warm), OmegaConf.create(cfg["sft"]), "sft", run_stage_job, "sft", cfg, inputs, str(out), {})
        metrics = wait(job, lambda line: None)
        trained[warm] = (weights(out / "model"), {k: v for k, v in metrics.items() if k.startswith(("train_loss", "val_loss"))})
    (cold_weights, cold_losses), (warm_weights, warm_losses) = trained[False], trained[True]
    assert cold_losses and cold_losses == warm_losses
    assert cold_weights.keys() == warm_weights.keys() and all((cold_weights[k] == warm_weights[k]).all() for k in cold_weights)


def sleep_then_return(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def test_a_killed_warm_job_ends_interrupted_and_is_retried_as_infrastructure(tmp_path, own_server):
    job = submit(launcher(tmp_path, True), section(), "probe", sleep_then_return, 600)
    while not job.paths.stdout.exists():
        time.sleep(0.1)
    os.kill(int(job.job_id), signal.SIGKILL)
    with pytest.raises(InfrastructureError):
        wait(job, lambda line: None, poll_s=0.2)
    assert job.state == "INTERRUPTED"  # as submitit says of a cold job whose controller a signal ended
    assert (job.paths.folder / warm_jobs.EXIT_FILE.format(pid=job.job_id)).read_text() == str(-signal.SIGKILL)


def server_pid(tmp_path: Path) -> int:
    return run_job(tmp_path, True, what_a_rank_sees, False)[1][0]["server"]


def ended(pid: int, timeout: float) -> bool:
    """Whether `pid` ends within `timeout` s. A zombie has ended: the server is not our child, and
    the process that reaps it (its starter, or a container's PID 1) may never do so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_server_whose_imported_files_changed_serves_no_job(tmp_path, monkeypatch):
    """A file the server imported at its start (here a sitecustomize on its PYTHONPATH) edited:
    the next job starts in a fresh server, which imported the edited file."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("VERSION = 1\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    def version() -> int:
        import sitecustomize

        return sitecustomize.VERSION

    first = server_pid(tmp_path)
    assert server_pid(tmp_path) == first
    (site / "sitecustomize.py").write_text("VERSION = 2\n")
    job, versions = run_job(tmp_path, True, version)
    assert versions == [2] and isinstance(job._process, Controller)  # warm, in a fresh server
    assert server_pid(tmp_path) != first
    assert ended(first, timeout=30)  # the stale one retired: it had no job left


def test_a_server_killed_without_retiring_is_replaced(tmp_path, own_server):
    """SIGKILL leaves the server's socket file behind, refusing connections: the next job
    starts a new server and runs warm, not cold."""
    first = server_pid(tmp_path)
    psutil.Process(first).kill()
    assert ended(first, timeout=30)
    job, [seen] = run_job(tmp_path, True, what_a_rank_sees, False)
    assert isinstance(job._process, Controller) and seen["server"] != first


def test_a_retiring_server_takes_its_socket_file_but_not_a_successors(tmp_path):
    from alignflow.job import forkserver

    path = str(tmp_path / "s.sock")
    listener, ours = forkserver._listen(path)
    forkserver._retire(listener, path, ours)
    assert not os.path.exists(path)
    listener, ours = forkserver._listen(path)
    successor, _ = forkserver._listen(path)  # a new server's file in its place
    forkserver._retire(listener, path, ours)
    assert os.path.exists(path)
    successor.close()


def test_a_job_that_cannot_start_warm_starts_cold_and_says_why(tmp_path, monkeypatch, caplog):
    """A server whose preload fails (a `megatron` package on its path that raises) exits while
    starting; the job runs all the same, cold, with a warning naming the cause."""
    broken = tmp_path / "broken" / "megatron"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this megatron is broken on purpose')\n")
    monkeypatch.setenv("PYTHONPATH", f"{broken.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    job, results = run_job(tmp_path, True, sleep_then_return, 0)
    assert results == ["done"] and not isinstance(job._process, Controller)
    assert "starts cold" in caplog.text and "this megatron is broken on purpose" in caplog.text


def test_a_socket_folder_others_can_reach_is_not_used(tmp_path, monkeypatch, caplog):
    runtime = tmp_path / "runtime"
    (runtime / f"alignflow-forkserver-{os.getuid()}").mkdir(parents=True, mode=0o777)
    os.chmod(runtime / f"alignflow-forkserver-{os.getuid()}", 0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    job, results = run_job(tmp_path, True, sleep_then_return, 0)
    assert results == ["done"] and not isinstance(job._process, Controller)
    assert "is not this user's alone" in caplog.text


def test_jobs_with_gpus_or_warm_start_off_start_cold(tmp_path):
    assert isinstance(make_executor(launcher(tmp_path, True), section(), "j"), WarmLocalExecutor)
    assert not isinstance(make_executor(launcher(tmp_path, True), section(), "j", devices="0"), WarmLocalExecutor)
    assert not isinstance(make_executor(launcher(tmp_path, False), section(), "j"), WarmLocalExecutor)


def test_a_servers_key_is_what_start_up_and_imports_read_less_what_jobs_set():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/src", "HF_HOME": "/hf"}
    key = warm_jobs.server_key(env, "/work")
    same = {"PYTEST_CURRENT_TEST": "t", "SUBMITIT_LOCAL_NTASKS": "2", "CUDA_VISIBLE_DEVICES": "", "AWS_SECRET_ACCESS_KEY": "s", "PATH": "/x"}
    assert warm_jobs.server_key({**env, **same, **dict.fromkeys(warm_jobs.SET_BY_JOBS, "1")}, "/work") == key
    for name, value in (("OMP_NUM_THREADS", "2"), ("PYTHONPATH", "/other"), ("HF_HOME", "/elsewhere"), ("LD_PRELOAD", "x.so")):
        assert warm_jobs.server_key({**env, name: value}, "/work") != key, name
    assert warm_jobs.server_key(env, "/elsewhere") != key


def test_what_the_servers_imports_set_is_named_as_set_by_jobs():
    """The variables the preload sets are left out of the key: a new one must be named there.
    The probe starts from a bare environment, since imports earlier in this worker may have set them."""
    probe = "import os; before = dict(os.environ); from alignflow.job import forkserver; forkserver.preload(); "
    probe += "print(sorted(k for k, v in os.environ.items() if before.get(k) != v))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "PYTHONPATH": str(PROJECT_ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    set_by_imports = json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))
    assert set_by_imports and set(set_by_imports) <= set(warm_jobs.SET_BY_JOBS)


def test_a_job_whose_environment_contradicts_the_servers_imports_starts_cold(tmp_path, own_server, monkeypatch, caplog):
    server_pid(tmp_path)  # a server whose imports set HF_HUB_OFFLINE=1 (the benchmark stage's)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # not a key: the same server is asked
    job, results = run_job(tmp_path, True, sleep_then_return, 0)
    assert results == ["done"] and not isinstance(job._process, Controller)
    assert "HF_HUB_OFFLINE='0' (its imports set '1')" in caplog.text
