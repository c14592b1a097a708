"""DESIGN.md's walls and mirrors, checked on the real import graph."""

import ast
import json
import os
import subprocess
import sys
from dataclasses import fields

from alignflow import PROJECT_ROOT
from alignflow.orchestrator.kinds import STAGES, AlignConfig, worker_module

HEAVY = ("torch", "megatron", "transformers")


def imported_after(statement: str, top: bool = True) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PROJECT_ROOT)
    return {m.split(".")[0] if top else m for m in json.loads(out.stdout.strip().splitlines()[-1])}


ORCHESTRATOR = (
    "import flows.align, flows.cli, tasks.stage, alignflow.orchestrator.runner, alignflow.orchestrator.demo, alignflow.orchestrator.config.validate"
)


def test_orchestrator_side_imports_no_worker_stack():
    loaded = imported_after(ORCHESTRATOR)
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_orchestrator_side_imports_no_worker_module():
    """The kinds' declarations are `alignflow.orchestrator.kinds`; `alignflow.job.stages` is the job side's."""
    loaded = imported_after(ORCHESTRATOR, top=False)
    assert "alignflow.orchestrator.kinds" in loaded and not {m for m in loaded if m.startswith("alignflow.job.stages")}


def test_worker_side_imports_no_prefect():
    loaded = imported_after(f"import alignflow.job.worker, {', '.join(worker_module(s) for s in STAGES)}")
    assert "prefect" not in loaded


def test_dependencies_point_one_way():
    for path in (PROJECT_ROOT / "alignflow").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("flows", "tasks") for n in names), f"{path} imports {names}"


def test_every_stage_is_mirrored():
    sections = {f.name for f in fields(AlignConfig)}
    for stage in STAGES:
        assert stage in sections, f"config section {stage} missing"
        assert (PROJECT_ROOT / "alignflow" / "job" / "stages" / f"{stage}.py").exists()
        assert (PROJECT_ROOT / "alignflow" / "orchestrator" / "kinds" / f"{stage}.py").exists()
    pipelines = [p.read_text() for p in (PROJECT_ROOT / "conf" / "pipeline").glob("*.yaml")]
    assert all(text.splitlines()[1].startswith("# align run pipeline=") for text in pipelines)


def test_a_skip_fails_in_ci_and_shows_its_reason_elsewhere(tmp_path):
    (tmp_path / "conftest.py").write_text((PROJECT_ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_needs_a_service.py").write_text("import pytest\n\ndef test_it():\n    pytest.skip('no service here')\n")

    def pytest_in(env_ci: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "CI": env_ci}
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )

    ci = pytest_in("true")
    assert ci.returncode == 1 and "skipped in CI (CI=true), which must run it: Skipped: no service here" in ci.stdout
    local = pytest_in("")
    assert local.returncode == 0 and "SKIPPED [1]" in local.stdout and "no service here" in local.stdout


# What the orchestrator side (and flows/, tasks/) may import from the job side: torch-free
# declarations it needs to refuse bad config before any job, and the job's entry point, which
# it submits by reference.
JOB_DECLARATIONS = {
    "alignflow.job.convert": "the family table's package",
    "alignflow.job.convert.families": "which HF architectures convert, and how (compose-time checks)",
    "alignflow.job.convert.lora": "which modules LoRA targets (schema, memory estimate)",
    "alignflow.job.data.formats": "the data formats prep reads (prep's checks)",
    "alignflow.job.data.prepared": "prep's output format (align plan's token counts)",
    "alignflow.job.rewards": "the reward functions by name (grpo's checks)",
    "alignflow.job.train.utilization": "the hardware metrics' names (report, UI), the FLOPs formula (align plan's cost)",
    "alignflow.job.usage": "the device-hour units' names (align plan's cost, the run summary)",
    "alignflow.job.worker": "the job entry point, submitted by reference",
}


def test_the_orchestrator_side_takes_only_declarations_from_the_job_side():
    for folder in ("alignflow/orchestrator", "flows", "tasks"):
        for path in (PROJECT_ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                )
                for name in names:
                    assert not name.startswith("alignflow.job") or name in JOB_DECLARATIONS, f"{path} imports {name} from the job side"
