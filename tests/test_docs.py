"""Every command README and deployments/prefect.yaml tell users to type has a test that runs it,
so the documentation cannot drift from what works. (The keys those commands set are composed by
test_config's `test_every_documented_command_composes`.)"""

import ast
import os
import re
import shlex
import subprocess
from pathlib import Path

import fsspec

from alignflow import PROJECT_ROOT
from flows.cli import main

# a documented command (a regex over its normalized form: no env assignments, no `.venv/bin/`,
# no `bash `) -> (the file that runs it, the test or fixture there, a string that test holds)
RUN_BY = {
    r"make test": (".ci/run", None, "make test"),
    r"make demo": ("tests/test_docs.py", "test_make_demo_runs_the_documented_demo_commands", '"-n", "demo"'),
    r"align demo": ("tests/test_docs.py", "test_make_demo_runs_the_documented_demo_commands", 'main(["demo"'),
    r"align plan ": ("tests/test_flow.py", "test_plan_marks_committed_stages", 'main(["plan"'),
    r"align config ": ("tests/test_config.py", "test_secret_from_env_is_masked_and_never_resolved_for_jobs", 'main(["config"'),
    r"align run ": ("tests/test_flow.py", "test_demo_pipeline_runs_then_hits_the_cache", '"force=[eval]"'),
    r"align compare ": ("tests/test_flow.py", "test_changed_input_config_reruns_and_force_reruns_and_compare_says_why", 'main(["compare"'),
    r"align gc$": ("tests/test_gc.py", "test_gc_on_a_local_store", "check_gc("),  # -> main(["gc", ...])
    r"infra/prefect-server\.sh worker": ("tests/integration/conftest.py", "prefect_stack", "prefect-server.sh"),
    r"prefect deploy --all --prefect-file deployments/prefect\.yaml": ("tests/integration/conftest.py", "prefect_stack", '"deploy", "--all"'),
    r"prefect deployment run align/": (
        "tests/integration/test_deployments.py",
        "test_a_cancelled_run_shows_its_stages_cancelled",
        '"deployment", "run"',
    ),
    r"prefect deployment inspect align/nightly": ("tests/integration/test_deployments.py", "test_nightly_is_scheduled_at_two_utc", '"inspect"'),
    r"prefect flow-run ls --state Scheduled": ("tests/integration/test_deployments.py", "test_nightly_is_scheduled_at_two_utc", '"ls", "--state"'),
    r"prefect automation create --from-file deployments/automations\.yaml": (
        "tests/test_gate.py",
        "test_a_redeployed_nightly_keeps_its_baseline_and_its_regression_fires_the_documented_automation",
        '"automation", "create", "--from-file"',
    ),
    r"infra/slurm\.sh up": ("tests/conftest.py", "slurm_cluster", '"up"'),
    r"infra/s3\.sh up": ("tests/test_docs.py", "test_infra_s3_up_serves_the_bucket_it_prints", "s3.sh"),
    r"python3 bench/gpu\.py": ("tests/test_bench_gpu.py", "gpu_bench", "bench/gpu.py"),
    r"align run pipeline=sft_bench": ("tests/test_benchmark.py", "bench", 'align(pipeline="sft_bench"'),
    r"lm_eval --model hf ": ("tests/test_benchmark.py", "test_the_numbers_are_lm_evals_own_cli_on_the_exported_model", '"--include_path"'),
    r"python3 -m flows\.cli (demo|run)": ("tests/test_docs.py", "test_make_demo_runs_the_documented_demo_commands", "flows.cli"),
}
# documented commands no test here can run, and why
BY_HAND = {
    r"export PREFECT_API_URL=": "sets the environment the next commands read (the prefect_stack fixture sets it)",
}
PROGRAMS = re.compile(r"(make|align|prefect|infra/[\w-]+\.sh|python3|export|lm_eval) ")


def normalized(command: str) -> str:
    command = re.sub(r"^(\w+=\S+ )+", "", command.split("#")[0].strip())
    return command.removeprefix("bash ").replace(".venv/bin/", "").strip()


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every command line in README's code blocks and in the comments of
    deployments/prefect.yaml (not the `$ ` lines that show an error, not code)."""
    found = []
    for path, pattern in ((PROJECT_ROOT / "README.md", r"(.*)"), (PROJECT_ROOT / "deployments" / "prefect.yaml", r"#   (.*)")):
        block = path.suffix != ".md"
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                block = not block
                continue
            if block and (m := re.fullmatch(pattern, line)):
                for command in map(normalized, m.group(1).split("&&")):
                    if PROGRAMS.match(command + " "):
                        found.append((f"{path.name}:{n}", command))
    return found


def test_every_documented_command_has_a_test_that_runs_it():
    commands = documented_commands()
    assert len(commands) > 25, commands
    used = set()
    for where, command in commands:
        matched = [p for p in (*RUN_BY, *BY_HAND) if re.match(p, command)]
        assert matched, f"{where}: `{command}` has no test that runs it (add one, and its row to RUN_BY)"
        used.update(matched)
    assert used == set(RUN_BY) | set(BY_HAND), f"rows no documented command uses: {set(RUN_BY) | set(BY_HAND) - used}"
    for pattern, (file, name, needle) in RUN_BY.items():
        source = (PROJECT_ROOT / file).read_text()
        if name is not None:
            [node] = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name] or [None]
            assert node is not None, f"{pattern}: {file} has no {name}"
            source = ast.get_source_segment(source, node)
        assert needle in source, f"{pattern}: {file}::{name} does not run it ({needle!r} not in its source)"


def test_make_demo_runs_the_documented_demo_commands(demo_dir, tmp_path):
    """`make demo` (README's first command) installs, then runs `align demo` (here, into another
    folder: the same files as the tests' demo) and `align run pipeline=sft_dpo` (test_flow runs
    `align run`; test_families_pipeline the sft_dpo pipeline)."""
    assert main(["demo", f"paths.demo={tmp_path}"]) == 0
    built = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert built == sorted(str(p.relative_to(demo_dir)) for p in Path(demo_dir).rglob("*") if p.is_file())
    same = lambda name: (tmp_path / name).read_bytes().replace(bytes(tmp_path), bytes(Path(demo_dir))) == (Path(demo_dir) / name).read_bytes()  # noqa: E731
    assert all(map(same, built))  # the benchmark task YAMLs name their data files by absolute path
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # CI runs this under `make test`
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "demo"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert recipe == ["./install.sh", ".venv/bin/align demo", ".venv/bin/align run pipeline=sft_dpo"], recipe
    gpu = [command for _, command in documented_commands() if command.startswith("python3 -m flows.cli")]
    assert gpu == ["python3 -m flows.cli demo", "python3 -m flows.cli run pipeline=sft_dpo"], gpu  # the same two, without the script


def test_infra_s3_up_serves_the_bucket_it_prints(tmp_path):
    """infra/s3.sh up, as README's Slurm section runs it: an S3 endpoint with the bucket, reachable
    with the credentials it prints; `down` stops it. (A copy of the script, on another port and
    bucket, keeps its state apart from a developer's running endpoint.)"""
    import shutil
    import socket

    venv = PROJECT_ROOT / ".venv"
    assert (venv / "bin" / "moto_server").exists(), "infra/s3.sh runs .venv/bin/moto_server: `make install-dev` installs it"
    (tmp_path / "infra").mkdir()
    script = shutil.copy(PROJECT_ROOT / "infra" / "s3.sh", tmp_path / "infra" / "s3.sh")
    (tmp_path / ".venv").symlink_to(venv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PATH": "/usr/bin:/bin", "S3_PORT": str(port), "S3_BUCKET": "docs-test"}
    up = subprocess.run([script, "up"], env=env, capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = dict(a.split("=", 1) for a in shlex.split(up.stdout.splitlines()[1].removeprefix("export ")))
        fs = fsspec.filesystem(
            "s3",
            key=exports["AWS_ACCESS_KEY_ID"],
            secret=exports["AWS_SECRET_ACCESS_KEY"],
            skip_instance_cache=True,
            client_kwargs={"endpoint_url": exports["AWS_ENDPOINT_URL"], "region_name": "us-east-1"},
        )
        fs.pipe("docs-test/hello.txt", b"hi")
        assert fs.cat("docs-test/hello.txt") == b"hi"
    finally:
        down = subprocess.run([script, "down"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and "S3 down" in down.stdout
    assert not (tmp_path / ".infra" / "s3.pid").exists()
