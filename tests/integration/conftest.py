"""Integration fixtures: the real stack a user runs, not Prefect's test harness.

`prefect_stack` brings up a Prefect server and a process worker with infra/prefect-server.sh
(on port 4300, or a free port when 4300 is taken, with its own state dir, SQLite database and
PREFECT_HOME, so it clashes neither with a developer's server on 4200 nor with the test
harness of tests/test_flow.py), deploys deployments/prefect.yaml with `prefect deploy`, and
tears it all down at the end of the module. The worker's environment holds fake secrets
(`SECRETS`), as a real worker holds WANDB_API_KEY and AWS keys; tests check they never leak.
Deployment runs send every stage to the real Slurm cluster (`slurm_cluster`, infra/slurm.sh)
and keep every output on the S3 endpoint (`s3_endpoint`, a moto server): `store`.
"""

import json
import os
import re
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
PORT = int(os.environ.get("ALIGNFLOW_IT_PREFECT_PORT", "4300"))

# Distinctive fake secrets, fresh per session, in the worker's environment only.
SECRETS = {
    "WANDB_API_KEY": "wandbfake" + secrets.token_hex(16),  # 40 characters, like a real key
    "AWS_SECRET_ACCESS_KEY": "awsfake" + secrets.token_hex(12),
}

# Not secret, but what the jobs' S3 client needs besides the key (moto accepts any key).
WORKER_AWS = {"AWS_ACCESS_KEY_ID": "alignflow-integration", "AWS_DEFAULT_REGION": "us-east-1"}

# Small enough for 2 CPU cores: two optimizer steps per training stage, one val batch.
FAST_SFT = ["sft.trainer.max_steps=2", "sft.optim.warmup_steps=1", "sft.trainer.val_check_interval=1", "sft.trainer.limit_val_batches=1"]
FAST_DPO = ["dpo.trainer.max_steps=2", "dpo.optim.warmup_steps=1", "dpo.trainer.val_check_interval=1", "dpo.trainer.limit_val_batches=1"]
FAST_EVAL = ["eval.num_generation_samples=4", "eval.limit_batches=1"]
FAST_DATA = ["data.preference.dev_choose_samples=64"]  # reference log-probs and eval read every pair


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrefectStack:
    port: int
    state: Path
    env: dict[str, str]  # for `prefect` commands: this server's API, no secrets
    secrets: dict[str, str] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def prefect(self, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run the `prefect` CLI from the repo root against this server."""
        return subprocess.run([PREFECT, *args], cwd=REPO, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)

    def run_deployment(self, name: str, params: dict, timeout: int = 600) -> "DeploymentRun":
        """`prefect deployment run NAME --param k=<json> ... --watch`, as a user types it."""
        args = ["deployment", "run", name, "--watch", "--watch-timeout", str(timeout)]
        for key, value in params.items():
            args += ["--param", f"{key}={json.dumps(value)}"]
        done = self.prefect(*args, timeout=timeout + 60)
        match = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
        assert match, f"no flow run created:\n{done.stdout}\n{done.stderr}"
        output = done.stdout + done.stderr
        if done.returncode != 0:  # the flow run's own output (tracebacks) is in the worker's log
            output += f"\n--- {self.state / 'prefect-worker.log'} ---\n{_tail(self.state / 'prefect-worker.log', 60)}"
        return DeploymentRun(match.group(1), done.returncode, output)

    def screenshot(self, path: str, out: Path) -> tuple[Path, str]:
        """The UI page at `path` (e.g. /runs/flow-run/ID) as a 1400x1000 PNG and its rendered DOM."""
        png, dom = out / f"{path.strip('/').replace('/', '-')}.png", out / f"{path.strip('/').replace('/', '-')}.html"
        shot = subprocess.run(
            [str(REPO / "infra" / "chromium.sh"), "shot", f"{self.ui}{path}", str(png), str(dom)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "ALIGNFLOW_INFRA_DIR": str(self.state)},
        )
        assert shot.returncode == 0 and png.exists(), shot.stdout + shot.stderr
        print(f"\nscreenshot of {self.ui}{path}: {png}")
        return png, dom.read_text(errors="replace")

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.api)


@dataclass
class DeploymentRun:
    flow_run_id: str
    returncode: int
    output: str


@pytest.fixture(scope="module")
def prefect_stack(tmp_path_factory):
    """Server + process worker (pool align-process) + the deployments of deployments/prefect.yaml."""
    state = tmp_path_factory.mktemp("prefect-stack")
    port = PORT if _port_free(PORT) else _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "WANDB_", "AWS_"))}
    env = {
        **base,
        "PREFECT_SERVER_PORT": str(port),
        "ALIGNFLOW_INFRA_DIR": str(state),
        "PREFECT_HOME": str(state / "home"),  # its own profiles, UI build and ~/.prefect
        "PREFECT_DB": "sqlite",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "COLUMNS": "250",  # `prefect` tables, not truncated
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    stack = PrefectStack(port, state, env, dict(SECRETS))
    script = str(REPO / "infra" / "prefect-server.sh")
    try:
        # the worker (and so every flow run and job it starts) gets the secrets; nothing else does
        up = subprocess.run([script, "worker"], cwd=REPO, env={**env, **WORKER_AWS, **SECRETS}, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n{_tail(state / 'prefect-server.log')}\n{_tail(state / 'prefect-worker.log')}"
        deploy = stack.prefect("deploy", "--all", "--prefect-file", "deployments/prefect.yaml", timeout=180)
        assert deploy.returncode == 0, f"{deploy.stdout}\n{deploy.stderr}"
        print(f"\nPrefect server for integration tests: {stack.ui} (state {state})")
        yield stack
    finally:
        subprocess.run([script, "down"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else f"({path} missing)"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One store and one submitit folder for the module: later runs hit the first run's cache."""
    return tmp_path_factory.mktemp("deployment-runs")


@dataclass
class S3Store:
    """The runs' store.root on the S3 endpoint, read back with s3fs."""

    root: str  # s3://bucket/prefix
    endpoint: str

    @property
    def fs(self):
        import s3fs

        # no listings cache: the runs keep writing while the tests read
        return s3fs.S3FileSystem(client_kwargs={"endpoint_url": self.endpoint}, skip_instance_cache=True, use_listings_cache=False)

    def manifest(self, stage: str, fingerprint: str) -> dict:
        return json.loads(self.fs.cat(f"{self.root}/{stage}/{fingerprint}/_SUCCESS.json"))

    def glob(self, pattern: str) -> list[str]:
        return self.fs.glob(f"{self.root}/{pattern}")

    def objects(self) -> dict[str, bytes]:
        return {key: self.fs.cat(key) for key in self.fs.find(self.root)}


@pytest.fixture(scope="module")
def store(s3_endpoint) -> S3Store:
    return S3Store(f"s3://test/integration-{secrets.token_hex(4)}/outputs", s3_endpoint)


@pytest.fixture(scope="module")
def run_overrides(demo_dir, workdir, store, slurm_cluster):
    """Every stage a Slurm job, every output on S3 (local copies of inputs and the training
    scratch in `workdir/cache`, job pickles and logs in `workdir/jobs`)."""
    return [
        f"paths.demo={demo_dir}",
        "launcher=slurm",
        "launcher.partition=debug",
        f"launcher.folder={workdir / 'jobs'}",
        f"store.root={store.root}",
        f"+store.storage_options.client_kwargs.endpoint_url={store.endpoint}",
        f"store.cache_dir={workdir / 'cache'}",
        *FAST_DATA,
        *FAST_SFT,
        *FAST_DPO,
        *FAST_EVAL,
    ]


@pytest.fixture(scope="module")
def first_run(prefect_stack, run_overrides):
    """`prefect deployment run align/sft-dpo --param overrides=[...] --watch` on a fresh store."""
    return prefect_stack.run_deployment("align/sft-dpo", {"overrides": [*run_overrides, "dpo.loss.beta=0.2"]})


@pytest.fixture(scope="module")
def cached_run(prefect_stack, first_run, run_overrides):
    """The same deployment run again: every stage a cache hit."""
    assert first_run.returncode == 0, first_run.output[-2000:]
    return prefect_stack.run_deployment("align/sft-dpo", {"overrides": [*run_overrides, "dpo.loss.beta=0.2"]})
