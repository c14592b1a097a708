"""A kind keeps its own knowledge (STYLE.md): central code never names a kind, and a kind's
declaration cannot be left half done without an error."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from alignflow import PROJECT_ROOT
from alignflow.orchestrator.config import schema

# The data sets a prep output holds (`alignflow.job.data.prepared.DATASETS`): inside alignflow/job/data,
# and beside the other data sets' names, "sft" is one of them, not the kind.
DATASETS = ("sft", "preference", "prompts")


def kind_names(root: Path) -> set[str]:
    """The kinds, from their worker modules on disk (not from the registry under test)."""
    return {path.stem for path in (root / "alignflow" / "job" / "stages").glob("*.py") if path.stem != "__init__"}


def kind_knowledge(root: Path) -> list[str]:
    """Where a central module compares a kind's name (`kind == "grpo"`, `kind in ("dpo", ...)`,
    `kind not in SOME_KINDS` with SOME_KINDS a module's tuple of names), keys a table by it
    (`{"distillation": ...}`) or looks one up by it (`cfg["dpo"]`). A kind's own modules,
    alignflow/orchestrator/kinds/<kind>.py and alignflow/job/stages/<kind>.py, may."""
    kinds, found = kind_names(root), []
    for path in sorted(p for folder in ("flows", "tasks", "alignflow") for p in (root / folder).rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parent.as_posix() in ("alignflow/orchestrator/kinds", "alignflow/job/stages") and path.stem in kinds:
            continue
        names = kinds - set(DATASETS) if relative.parts[:3] == ("alignflow", "job", "data") else kinds
        tree = ast.parse(path.read_text())
        tables = {
            target.id: node.value for node in tree.body if isinstance(node, ast.Assign) for target in node.targets if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                operands += [tables[o.id] for o in operands if isinstance(o, ast.Name) and o.id in tables]
                candidates = [c for o in operands for c in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
            elif isinstance(node, ast.Dict):
                candidates = [k for k in node.keys if k is not None]
            elif isinstance(node, ast.Subscript):
                candidates = [node.slice]
            else:
                continue
            strings = [c for c in candidates if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            if any(c.value in DATASETS and c.value not in kinds for c in strings):  # a table of data sets
                strings = [c for c in strings if c.value not in DATASETS]
            found += [f"{relative}:{c.lineno}: {c.value!r}" for c in strings if c.value in names]
    return found


def test_no_central_module_names_a_kind():
    assert kind_knowledge(PROJECT_ROOT) == []


def test_the_scan_finds_kind_knowledge(tmp_path):
    """What the scan must catch (each form once), and what it must let pass: error messages, a
    data set's name in the data package, a kind's own module."""
    for folder in ("alignflow/job/stages", "alignflow/orchestrator/kinds", "alignflow/job/data", "tasks"):
        (tmp_path / folder).mkdir(parents=True)
    for kind in ("grpo", "dpo", "sft"):
        (tmp_path / "alignflow" / "job" / "stages" / f"{kind}.py").write_text("")
    (tmp_path / "alignflow" / "orchestrator" / "kinds" / "grpo.py").write_text('assert "grpo" == "grpo"\n')
    (tmp_path / "alignflow" / "job" / "data" / "spill.py").write_text('if kind == "sft":\n    pass\n')
    (tmp_path / "alignflow" / "demo.py").write_text('SPLITS = {"sft": 1, "preference": 2}\n')
    (tmp_path / "tasks" / "central.py").write_text(
        'PAIRED = ("dpo", "x")\n'
        'if kind == "grpo" or kind in ("dpo",) or kind not in PAIRED:\n'
        '    raise ValueError("grpo needs sft first")\n'
        'CHECKS = {"sft": print}\n'
        'section = cfg["dpo"]\n'
    )
    assert sorted(kind_knowledge(tmp_path)) == [
        "tasks/central.py:1: 'dpo'",
        "tasks/central.py:2: 'dpo'",
        "tasks/central.py:2: 'grpo'",
        "tasks/central.py:4: 'sft'",
        "tasks/central.py:5: 'dpo'",
    ]


def test_a_kind_must_say_what_a_default_would_get_wrong():
    """Fields where a default would be silently wrong have none; a training kind (its schema has
    `optim`) must say what a micro batch row holds, and only a training kind may."""
    from alignflow.orchestrator.kinds.spec import StageKind, one

    with pytest.raises(TypeError, match="resumable"):
        StageKind(schema=schema.EvalConfig, output="eval", inputs={"data": one("prep")})
    with pytest.raises(TypeError, match="rows.*required of a training kind"):
        StageKind(schema=schema.SFTConfig, output="model", inputs={}, resumable=True)
    with pytest.raises(TypeError, match="rows.*only for a training kind"):
        StageKind(schema=schema.EvalConfig, output="eval", inputs={}, resumable=False, rows=lambda section, data, dp: (1, 1))
    with pytest.raises(TypeError):  # keyword-only: no positional field can land in the wrong slot
        StageKind(schema.EvalConfig, "eval", {}, False)


def test_a_kind_whose_output_format_no_kind_declares_fails_at_import(tmp_path):
    """A kind naming an output format that no kind declares (a typo, or a forgotten
    `output_format`) stops the registry's import, before any config is composed."""
    from test_plan import checkout_copy, edit

    checkout = checkout_copy(tmp_path)
    edit(checkout / "alignflow" / "orchestrator" / "kinds" / "sft.py", 'output="model"', 'output="modle"')
    imported = subprocess.run([sys.executable, "-c", "import alignflow.orchestrator.kinds"], cwd=checkout, capture_output=True, text=True)
    assert imported.returncode == 1
    assert "TypeError: stage kinds whose output format no kind declares (output_format=): sft: modle" in imported.stderr


def test_evals_table_has_a_row_per_model():
    """The UI table eval adds beside its headline one (`tasks.stage` publishes it as `models-<stage>`)."""
    from alignflow.orchestrator.kinds import STAGES

    table = STAGES["eval"].table({"sft.accuracy": 0.5, "sft.val_loss": 1.25, "convert.accuracy": 0.125, "dpo_round1.val_loss": 2.0})
    assert (table.name, table.title) == ("models", "every metric of every model")
    assert table.rows == [
        {"model": "sft", "accuracy": 0.5, "val_loss": 1.25},
        {"model": "convert", "accuracy": 0.125},
        {"model": "dpo_round1", "val_loss": 2.0},
    ]
    assert all(STAGES[kind].table({"train_loss": 1.0}) is None for kind in STAGES if kind != "eval")


def test_no_stage_identity_covers_a_kinds_module():
    """A kind's declaration decides whether and where its job runs, not what it computes: editing
    alignflow/orchestrator/kinds/ (grpo's batch rule, which its trainer also calls) re-runs nothing."""
    from alignflow.orchestrator.fingerprint import code_identity
    from alignflow.orchestrator.kinds import STAGES, worker_module

    covered = {path for kind in STAGES for path in code_identity(worker_module(kind))}
    assert "alignflow/job/stages/grpo.py" in covered and not [path for path in covered if path.startswith("alignflow/orchestrator/kinds/")]
