"""A pipeline: named instances of stage kinds, wired by input roles, in run order.

`Pipeline.build(cfg)` turns `pipeline.stages` into this object once per composed config, and
refuses what cannot run (unknown kind, role or upstream, a missing role, a list where one
stage is expected, an upstream of the wrong output format, a cycle, an unknown setting, a
name outside `NAME`), naming the stage and key. Validation, `align plan`, the runner and the flow all walk it.

    pipeline:
      stages:
        prep: {}                                    # the name is the kind
        sft: {inputs: {data: prep, model: convert}}
        dpo_round2:
          kind: dpo
          inputs: {data: prep, model: dpo_round1, ref_logprobs: ref_round2}
          loss: {beta: 0.2}                         # overrides of the dpo section
        prep_code:
          kind: prep
          data: {sft: {train: /data/code.jsonl}}    # overrides of what prep reads

An instance's effective config: the kind's schema defaults < the root section of its kind
(`dpo:`) < the instance's overrides; likewise for the config it reads (`data`, `model`). It is
the root config as the instance sees it (`Stage.cfg`, read-only), so its kind's section there
is its own. On the command line: `pipeline.stages.dpo_round2.loss.beta=0.2`. Its `precision: auto`
is resolved there, to bf16 when `launcher.gpus_per_node` gives its ranks GPUs and fp32 otherwise.
"""

import re
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from alignflow.orchestrator.config.schema import Precision, resolved_precision
from alignflow.orchestrator.launch import gpus_per_node
from alignflow.orchestrator.kinds import STAGES, StageKind, as_names

RESERVED = ("kind", "inputs")
# Instance and pipeline names: they name store folders, job names and submitit folders, and
# Prefect artifact keys (`stage-<name>` with `_` as `-`: lowercase letters, digits and dashes
# only). No `-` in names, so two names never share an artifact key.
NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
NAME_RULE = "lowercase letters, digits and _, starting with a letter, at most 64 characters"


class PipelineError(ValueError):
    """A pipeline that cannot run; `problems` names each stage and key."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Stage:
    name: str
    kind: str
    inputs: dict[str, Any]  # role -> upstream instance name, or a tuple of them for a list role
    cfg: DictConfig  # the root config as this instance sees it (read-only)

    @property
    def spec(self) -> StageKind:
        return STAGES[self.kind]

    @property
    def section(self) -> DictConfig:
        return self.cfg[self.kind]

    def upstream(self) -> list[str]:
        return [name for names in self.inputs.values() for name in as_names(names)]


@dataclass(frozen=True)
class Pipeline:
    name: str
    stages: dict[str, Stage]  # in run order: every stage after its upstream stages
    cfg: DictConfig  # the root config it was built from

    def __iter__(self):
        return iter(self.stages.values())

    def __getitem__(self, name: str) -> Stage:
        return self.stages[name]

    @classmethod
    def build(cls, cfg: DictConfig) -> "Pipeline":
        problems = name_problems("pipeline.name", cfg.pipeline.name, "a pipeline")
        if not cfg.pipeline.stages:
            problems.append("pipeline.stages: empty pipeline")
        stages, on_gpu = {}, gpus_per_node(cfg.launcher) > 0
        for name, entry in cfg.pipeline.stages.items():
            stage = _instance(cfg, name, OmegaConf.to_container(entry) if entry is not None else {}, on_gpu, problems)
            if stage is not None:
                stages[name] = stage
        problems += _check_wiring(stages, list(cfg.pipeline.stages))
        for name in cfg.force:
            if name not in cfg.pipeline.stages:
                problems.append(f"force: {name!r} is not a stage of pipeline '{cfg.pipeline.name}' ({', '.join(cfg.pipeline.stages)})")
        order = _run_order(stages, problems) if not problems else []
        if problems:
            raise PipelineError(problems)
        return cls(cfg.pipeline.name, {name: stages[name] for name in order}, cfg)


def name_problems(key: str, name, what: str) -> list[str]:
    """`name` against NAME, said with its key."""
    if isinstance(name, str) and NAME.fullmatch(name):
        return []
    return [f"{key}: {what} name must be {NAME_RULE} (it names store folders, jobs and Prefect artifact keys), got {name!r}"]


def _instance(cfg: DictConfig, name: str, entry: dict, on_gpu: bool, problems: list[str]) -> Stage | None:
    key = f"pipeline.stages.{name if str(name).isprintable() else repr(name)[1:-1]}"
    problems += name_problems(key, name, "an instance")
    kind = entry.get("kind", name)
    if kind not in STAGES:
        problems.append(f"{key}: unknown stage kind '{kind}' (known: {', '.join(STAGES)}); an instance named otherwise says its kind with `kind:`")
        return None
    spec, inputs = STAGES[kind], entry.get("inputs") or {}
    if not isinstance(inputs, dict):
        problems.append(f"{key}.inputs: a mapping of input role to upstream stage(s), got {inputs!r}")
        return None
    problems += _check_roles(key, kind, inputs)
    overrides = {k: v for k, v in entry.items() if k not in RESERVED}
    section_keys = {f.name for f in fields(spec.schema)}
    read_roots = {path.split(".")[0] for path in spec.reads}
    for setting in overrides:
        if setting not in section_keys and setting not in read_roots:
            problems.append(
                f"{key}.{setting}: not a setting of stage kind {kind} (the `{kind}` section) "
                f"nor of what it reads ({', '.join(sorted(read_roots)) or 'nothing'})"
            )
    section = {k: v for k, v in overrides.items() if k in section_keys}
    merged = {kind: section | _resolved(cfg, kind, section, on_gpu), **{k: v for k, v in overrides.items() if k in read_roots}}
    try:
        view = OmegaConf.merge(cfg, merged) if any(merged.values()) else cfg.copy()
        OmegaConf.to_container(view[kind], resolve=True)  # surface interpolation errors now
    except OmegaConfBaseException as err:
        full_key = str(getattr(err, "full_key", "") or "")
        where = f"{key}.{full_key.removeprefix(kind + '.')}" if full_key else key
        problems.append(f"{where}: {str(err).splitlines()[0]}")
        return None
    OmegaConf.set_readonly(view, True)
    wiring = {role: names if isinstance(names, str) else tuple(names) for role, names in inputs.items()}
    wiring |= {role: () for role, r in spec.inputs.items() if r.many and role not in wiring}
    return Stage(name, kind, wiring, view)


def _resolved(cfg: DictConfig, kind: str, section: dict, on_gpu: bool) -> dict:
    """`precision: auto` (the root's or the instance's) as the precision the instance's ranks
    compute in (`resolved_precision`): its identity, its job and its manifest hold that."""
    precision = section.get("precision", cfg[kind].precision) if "precision" in cfg[kind] else None
    if precision != Precision.auto:
        return {}
    return {"precision": resolved_precision(precision, on_gpu=on_gpu)}


def _check_roles(key: str, kind: str, wiring: dict) -> list[str]:
    declared, problems = STAGES[kind].inputs, []
    takes = ", ".join(f"{role} ({spec.describe()})" for role, spec in declared.items()) or "no inputs"
    for role, upstream in wiring.items():
        if role not in declared:
            problems.append(f"{key}.inputs.{role}: stage kind {kind} has no input role '{role}'; it takes {takes}")
        elif not declared[role].many and not isinstance(upstream, str):
            problems.append(f"{key}.inputs.{role}: takes one upstream stage, got {upstream}")
    for role, spec in declared.items():
        if spec.required and role not in wiring:
            problems.append(f"{key}.inputs: missing input role '{role}' ({spec.describe()}); stage kind {kind} takes {takes}")
    return problems


def _check_wiring(stages: dict[str, Stage], names: list[str]) -> list[str]:
    problems = []
    for stage in stages.values():
        for role, upstream in stage.inputs.items():
            expected = stage.spec.inputs.get(role)
            for up in as_names(upstream):
                key = f"pipeline.stages.{stage.name}.inputs.{role}"
                if up not in names:
                    problems.append(f"{key}: '{up}' is not a stage of this pipeline ({', '.join(names)})")
                elif up == stage.name:
                    problems.append(f"{key}: a stage cannot be its own input")
                elif expected is not None and up in stages and stages[up].spec.output not in expected.outputs:
                    problems.append(
                        f"{key}: expects a {' or '.join(expected.outputs)} output; '{up}' ({stages[up].kind}) gives a {stages[up].spec.output} output"
                    )
    return problems


def _run_order(stages: dict[str, Stage], problems: list[str]) -> list[str]:
    """Every stage after its upstream stages, otherwise in the order the pipeline lists them."""
    order, placed = [], set()
    while len(order) < len(stages):
        ready = [n for n, s in stages.items() if n not in placed and all(u in placed for u in s.upstream())]
        if not ready:
            problems.append(f"pipeline.stages: a cycle: {_cycle(stages, placed)}")
            return []
        order.append(ready[0])
        placed.add(ready[0])
    return order


def _cycle(stages: dict[str, Stage], placed: set[str]) -> str:
    """One cycle among the stages not placed, as 'a -> b -> a'."""
    start = next(n for n in stages if n not in placed)
    path = [start]
    while True:
        nxt = next(u for u in stages[path[-1]].upstream() if u not in placed)
        if nxt in path:
            cycle = path[path.index(nxt) :] + [nxt]
            return " -> ".join(reversed(cycle))
        path.append(nxt)
