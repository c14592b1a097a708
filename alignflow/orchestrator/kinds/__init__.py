"""The stage kinds, orchestrator side: one module per kind, importable without torch.

The same word names a kind everywhere: its module here (`alignflow.orchestrator.kinds.<kind>`, its `KIND`
entry: schema, output format, input roles, the config it reads, its compose-time checks, its
memory rows, its UI table; `alignflow.orchestrator.kinds.spec.StageKind` says what each field means), its
config section and schema class, and its worker module `alignflow.job.stages.<kind>` (the job side,
torch). A pipeline holds named *instances* of kinds (`alignflow.orchestrator.pipeline`); the instance name is
what the flow, the store and the UI show. Central code (compose, validate, the memory estimate,
the task, the flow) loops over `STAGES` and calls a kind's functions without naming one.

Adding a kind: its module here with its `KIND`, its worker module, its schema class, and its name in `KINDS`.
"""

from dataclasses import field, make_dataclass
from importlib import import_module

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.kinds.spec import MODEL, StageKind

# The kinds, in the order `align` lists them and the root config holds their sections.
KINDS = (
    "prep",
    "convert",
    "ref_logprobs",
    "sft",
    "dpo",
    "grpo",
    "teacher_logprobs",
    "distillation",
    "eval",
    "benchmark",
    "reward_model",
    "generate",
    "score",
    "export",
)
STAGES: dict[str, StageKind] = {kind: import_module(f"alignflow.orchestrator.kinds.{kind}").KIND for kind in KINDS}

# Output formats (README "Stages and the store"): where each is written and read, and what a
# commit checks is in it (`alignflow.orchestrator.verify`: each glob must match, and each match must open).
OUTPUTS = {"model": MODEL, **{spec.output: spec.output_format for spec in STAGES.values() if spec.output_format is not None}}
if unknown := [f"{kind}: {spec.output}" for kind, spec in STAGES.items() if spec.output not in OUTPUTS]:
    raise TypeError(f"stage kinds whose output format no kind declares (output_format=): {', '.join(unknown)}")

# The root config's schema: the shared sections plus one section per kind, typed by its schema.
AlignConfig = make_dataclass(
    "AlignConfig", [(kind, spec.schema, field(default_factory=spec.schema)) for kind, spec in STAGES.items()], bases=(schema.AlignBase,)
)


def worker_module(kind: str) -> str:
    return f"alignflow.job.stages.{kind}"


def job_paths(kind: str) -> tuple[str, ...]:
    """The config a job of `kind` receives: its section, what it `reads` (in its fingerprint) and
    its `context` (not): nothing else, so a setting read but not declared fails, never silently
    defaults outside the fingerprint."""
    spec = STAGES[kind]
    return (kind, *spec.reads, *spec.context)


def user_imports(kind: str, section) -> list[str]:
    """The `module:function` import paths that `kind`'s `imports` paths hold in its config
    `section` (a name without a colon is one of alignflow's own)."""
    found = []
    for path in STAGES[kind].imports:
        values = [section]
        for part in path.split("."):
            values = [item for value in values for item in value] if part == "*" else [value[part] for value in values]
        found += [value for value in values if isinstance(value, str) and ":" in value]
    return found


def as_names(upstream) -> list[str]:
    """A pipeline input role maps to one upstream stage or a list of them."""
    return [upstream] if isinstance(upstream, str) else list(upstream)
