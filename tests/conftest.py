"""Shared fixtures: offline demo assets and one Prefect test server per session."""

import os
import sys

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

# Each pytest-xdist worker's processes get their share of the cores, as torchrun gives a node's
# ranks theirs (alignflow.job.worker._share_the_cores): two workers' jobs with a 2-thread OpenMP
# pool each on 2 cores spin against each other (a small training loop run twice at once, 2026-12-02:
# 19.9 s each with 2 threads, 5.5 s with 1; 3.1 s alone). Set before torch starts its pool.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if XDIST_WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // XDIST_WORKERS))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The GPU subset (`pytest -m gpu`, which bench/gpu.py runs on a GPU machine): one-process tests
# whose code takes the CUDA path there (bf16 by `auto`, CUDA RNG states, kernels, generation).
# Tests of two or more ranks need a GPU per rank (NCCL), so they stay out on a one-GPU machine.
GPU_TESTS = (
    "tests/test_sft.py::test_sft_writes_the_model_layout_and_metrics",
    "tests/test_sft.py::test_unsupported_settings_fail_before_training",
    "tests/test_sft.py::test_killed_job_resumes_to_the_uninterrupted_weights",
    "tests/test_scale.py::test_bf16_tracks_fp32_for_20_steps",
    "tests/test_scale.py::test_activation_recompute_gives_the_same_steps",
    "tests/test_train.py::test_packed_row_loss_equals_documents_one_by_one",
    "tests/test_megatron_model.py::test_one_rank_logits_match_hf",
    "tests/test_megatron_model.py::test_lean_forward_matches_hf_on_each_document_of_a_packed_row",
    "tests/test_generation.py::test_greedy_generation_equals_hf_generate",
    "tests/test_generation.py::test_sampling_is_reproducible_under_a_seed",
    "tests/test_generation.py::test_logps_are_the_models_and_sampling_logps_the_filtered_tempered_ones",
    "tests/test_eval.py::test_eval_reports_each_model",
    "tests/test_eval.py::test_megatron_greedy_equals_hf_greedy",
    "tests/test_eval.py::test_ref_logprobs_equal_hf_log_probs_of_each_response",
    "tests/test_dpo.py::test_precomputed_reference_equals_an_online_reference",
    "tests/test_dpo.py::test_dpo_fits_its_pairs",
    "tests/test_grpo.py::test_grpo_trains_and_logs_every_metric",
    "tests/test_grpo.py::test_several_optimizer_steps_per_batch_are_off_policy_and_clipped",
    "tests/test_distill.py::test_teacher_topk_equal_hf_transformers_topk",
    "tests/test_distill.py::test_the_students_heldout_kl_to_the_teacher_falls",
    "tests/test_lora.py::test_lora_output_is_the_base_by_reference_and_the_adapter",
)
# The GPU tests with one case per model family: bench/gpu.py runs them in a phase after the others.
GPU_FAMILY_TESTS = (
    "tests/test_megatron_model.py::test_one_rank_logits_match_hf",
    "tests/test_megatron_model.py::test_lean_forward_matches_hf_on_each_document_of_a_packed_row",
)


# Under pytest-xdist (`make test`: `-n 3`) each group of tests runs on one worker, in collection
# order (`pytest_xdist_make_scheduler`): the tests on the real services (the Slurm cluster, which
# they share and some stop the daemons of, and the integration stack on it), and each other file
# (its module fixtures are built once). The groups go out longest first, as measured (the first
# names here), so that the last to finish is a short one. (pytest-xdist's own `xdist_group`
# renames items, which pytest 9 ignores.)
SHARED_GROUP = "slurm"
SHARED = (  # node id prefixes of the tests on the real services; collection fails if one is missing
    "tests/integration/",
    "tests/test_nodes.py",
    "tests/test_slurm.py",
    "tests/test_faults.py::test_a_queued_job_of_a_dead_run_is_cancelled_and_touches_nothing",
)
SHARED_FIXTURES = ("slurm_cluster", "prefect_stack")
LONGEST_FIRST = (
    SHARED_GROUP,
    "tests/test_reward_model.py",
    "tests/test_faults.py",
    "tests/test_engine_stages.py",
    "tests/test_bench_scripts.py",
    "tests/test_gate.py",
    "tests/test_flow.py",
    "tests/test_families_pipeline.py",
    "tests/test_launch.py",
    "tests/test_bench_gpu.py",
    "tests/test_outputs.py",
    "tests/test_plan.py",
)


def group_of(nodeid: str) -> str:
    return SHARED_GROUP if nodeid.startswith(SHARED) else nodeid.split("::")[0]


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return Groups(config, log)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.split("[")[0] in GPU_TESTS:
            item.add_marker(pytest.mark.gpu)
        if set(SHARED_FIXTURES) & set(item.fixturenames) and group_of(item.nodeid) != SHARED_GROUP:
            raise pytest.UsageError(f"{item.nodeid} uses the real services ({', '.join(SHARED_FIXTURES)}): list it in tests/conftest.py SHARED")
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))  # stable: collection order within a group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a test that cannot reach its real dependency fails instead of skipping: CI runs as
    root on Debian, where every dependency (Slurm, S3, Chromium) can be brought up."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"skipped in CI (CI=true), which must run it: {reason}"


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    from alignflow.orchestrator.demo import build

    return build(tmp_path_factory.mktemp("demo"))


@pytest.fixture
def base_overrides(demo_dir, tmp_path):
    """Point the config at the session's demo assets and a fresh store for this test."""
    return [f"paths.demo={demo_dir}", f"store.root={tmp_path / 'store'}", f"launcher.folder={tmp_path / 'jobs'}"]


@pytest.fixture(scope="session")
def prefect_server():
    """One Prefect API for the whole session: its start-up costs 10-16 s on 2 cores."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 protocol endpoint (moto server) with a `test` bucket, on this machine's first
    address (as infra/s3.sh): Slurm jobs on infra/slurm.sh's nodes, each in its own network
    namespace, reach it there, not on loopback."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    host = next((a for a in addresses if ":" not in a), "127.0.0.1")  # the first IPv4 address
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    os.environ.update(AWS_ACCESS_KEY_ID="test-key-id", AWS_SECRET_ACCESS_KEY="test-secret-value", AWS_DEFAULT_REGION="us-east-1")
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", host, "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://{host}:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": url}).mkdir("test")
    yield url
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster with accounting, 2 nodes in namespaces of this machine: `infra/slurm.sh up`
    (idempotent; ~4 s when its Debian packages are installed, which it does itself on a fresh
    root CI machine).

    It is left up after the session, as a running dev cluster is left alone: other sessions may
    be using it, and the next `up` is then instant. `infra/slurm.sh down` stops it."""
    import shutil
    import subprocess
    from pathlib import Path

    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("infra/slurm.sh needs root on Debian (CI runs it there)")
    script = Path(__file__).parents[1] / "infra" / "slurm.sh"
    up = subprocess.run([str(script), "up"], capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    yield


@pytest.fixture(scope="module")
def one_rank():
    """A single-rank Megatron runtime (env, gloo, groups, seeds) for the module; its parallel config."""
    from megatron_ranks import parallel_cfg

    from alignflow.job.model import runtime

    import torch

    parallel = parallel_cfg()
    runtime.init_parallel(parallel)
    torch.set_float32_matmul_precision("highest")  # jobs take TF32 on CUDA; these tests hold fp32 to HF's within 1e-5
    yield parallel
    runtime.teardown()
