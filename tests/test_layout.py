"""DESIGN.md's walls and mirrors, checked on the real import graph."""

import ast
import json
import subprocess
import sys
from dataclasses import fields

from alignflow import PROJECT_ROOT
from alignflow.config.schema import AlignConfig
from alignflow.stages import STAGES, worker_module

HEAVY = ("torch", "megatron", "transformers")


def imported_after(statement: str) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PROJECT_ROOT)
    return {m.split(".")[0] for m in json.loads(out.stdout.strip().splitlines()[-1])}


def test_orchestrator_side_imports_no_worker_stack():
    loaded = imported_after("import flows.align, flows.cli, tasks.stage, alignflow.runner, alignflow.demo")
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_worker_side_imports_no_prefect():
    loaded = imported_after(f"import alignflow.worker, {', '.join(worker_module(s) for s in STAGES)}")
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
        assert (PROJECT_ROOT / "alignflow" / "stages" / f"{stage}.py").exists()
    pipelines = [p.read_text() for p in (PROJECT_ROOT / "conf" / "pipeline").glob("*.yaml")]
    assert all(text.splitlines()[1].startswith("# align run pipeline=") for text in pipelines)
