"""What a stage kind declares (`StageKind`), the defaults of its optional rules, and the pieces
kinds share: the `model` output format, the config a training job reads and its headline.

The hooks are plain functions the central code calls without knowing the kind: `checks` at
compose time (`alignflow.orchestrator.config.validate`), `batch_problems` with the data-parallel size,
`rows` and `frozen_models` for the memory estimate (`alignflow.orchestrator.config.memory.layout_of`),
`table` for the UI (`tasks.stage`).
"""

from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple

from alignflow.job.rewards import SCORE, resolve
from alignflow.job.train.utilization import FORWARD, LORA_TRAINING, Passes
from alignflow.job.train.utilization import TRAINING as TRAINING_PASSES
from alignflow.orchestrator.verify import Need, OutputFormat, json_file, nonempty, torch_dist


@dataclass(frozen=True)
class Role:
    output: str  # the output format it expects
    required: bool = True
    many: bool = False  # a list of upstream stages
    also: tuple[str, ...] = ()  # other formats it takes

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output, *self.also)

    def describe(self) -> str:
        return f"{'required' if self.required else 'optional'}, {'a list of' if self.many else 'one'} {' or '.join(self.outputs)} output{'s' if self.many else ''}"


def one(output: str, *also: str) -> Role:
    return Role(output, also=also)


def optional(output: str) -> Role:
    return Role(output, required=False)


def many(output: str) -> Role:
    return Role(output, required=False, many=True)


def environment_problems(environment, key: str) -> list[str]:
    """A reward kind's `environment`: at least one entry, each a known reward, an importable
    `module:function` or `score`."""
    problems = [] if environment else [f"{key}.environment: needs at least one reward function"]
    for i, reward in enumerate(environment):
        try:
            reward.name == SCORE or resolve(reward.name)
        except ValueError as err:
            problems.append(f"{key}.environment[{i}].name: {err}")
    return problems


def reward_model_use_problems(stage, key: str, role: str) -> list[str]:
    """A reward kind's (grpo's, score's) `score` rewards and its reward model input (`role`) come
    together: one without the other is a reward model never trained against, or a reward that
    cannot be computed."""
    scores = [i for i, reward in enumerate(stage.section.environment) if reward.name == SCORE]
    if scores and role not in stage.inputs:
        return [f"{key}.environment[{scores[0]}].name: {SCORE} needs a {role} input (pipeline.stages.{stage.name}.inputs.{role}: a {role} stage)"]
    if not scores and role in stage.inputs:
        return [
            f"pipeline.stages.{stage.name}.inputs.{role}: no {key}.environment entry uses it; add {{name: {SCORE}}} "
            "(with a weight to mix it with rule rewards) or drop the input"
        ]
    return []


class Table(NamedTuple):
    """A table artifact of a stage's output beside its headline one (`tasks.stage`)."""

    name: str  # its artifact key is `{name}-{stage}`
    title: str  # shown after `{stage}: `
    rows: list[dict]


def no_checks(stage, key: str, check_paths: bool) -> list[str]:
    return []


def global_batch_problems(section, dp: int, key: str) -> list[str]:
    """A step's global_batch_size rows split into micro batches on every data-parallel rank."""
    if "global_batch_size" in section and section.global_batch_size % (section.micro_batch_size * dp):
        return [
            f"{key}.global_batch_size: {section.global_batch_size} is not divisible by micro_batch_size ({section.micro_batch_size}) "
            f"x data-parallel size ({dp})"
        ]
    return []


def one_sequence(section, data, dp: int) -> tuple[int, int]:
    """A micro batch row holds one sequence of up to seq_length tokens; global_batch_size rows a step."""
    return data.seq_length, section.global_batch_size // dp


def pair_rows(section, data, dp: int) -> tuple[int, int]:
    """A row holds at least one pair: its two sequences, each up to seq_length."""
    return 2 * data.seq_length, section.global_batch_size // dp


def no_frozen_models(section, inputs, lora: int | None) -> int:
    return 0


def no_table(metrics: dict) -> Table | None:
    return None


def no_source_files(section) -> list[str]:
    return []


class Work(NamedTuple):
    """Model passes a stage will run, for `align plan` (`alignflow.orchestrator.cost`): `items`
    of a split of prep's `dataset` (packed rows, pairs, prompts; None: all of the split), `repeat`
    times, each through `passes` forward-equivalents; a generated item is one document `extra`
    tokens longer, decoded in batches of `batch` on each data-parallel rank (`extra` steps a
    batch: decoding is step by step, its time not bound by FLOPs)."""

    dataset: str
    split: str
    items: float | None
    passes: Passes
    extra: int = 0
    batch: int = 0  # 0: not generated
    repeat: int = 1


Count = Callable[[str, str], int | None]  # (dataset, split) -> items in prep's output, None where unknown


def no_work(stage, count: Count) -> list[Work]:
    return []


def training_steps(section, count: Count, dataset: str) -> int | None:
    """The optimizer steps of a training section: max_steps, else max_epochs of whole global batches."""
    if section.trainer.max_steps > 0:
        return section.trainer.max_steps
    rows = count(dataset, "train")
    return None if rows is None else section.trainer.max_epochs * (rows // section.global_batch_size)


def trained_on(dataset: str) -> Callable[[Any, Count], list[Work]]:
    """The work of a supervised training kind (`alignflow.job.train.loop`) on `dataset`: global
    batches of training passes, and a validation of limit_val_batches micro batches every
    val_check_interval steps and after the last."""

    def work(stage, count: Count) -> list[Work]:
        section = stage.section
        steps = training_steps(section, count, dataset)
        passes = TRAINING_PASSES if section.finetuning_type == "all_weights" else LORA_TRAINING
        work = [Work(dataset, "train", None if steps is None else steps * section.global_batch_size, passes)]
        interval, val = section.trainer.val_check_interval, count(dataset, "val")
        if steps is None or interval <= 0 or val == 0:
            return work
        par, res = section.parallel, section.resources
        dp = max(res.nodes * res.tasks_per_node // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size), 1)
        rows = min(section.trainer.limit_val_batches * section.micro_batch_size, val or 1 << 62)
        rows -= rows % (section.micro_batch_size * dp)  # as `alignflow.job.train.engine.validate`
        return work + [Work(dataset, "val", (steps // interval + bool(steps % interval)) * rows, FORWARD)]

    return work


@dataclass(frozen=True, kw_only=True)
class StageKind:
    """One kind's declaration (README "Adding a stage kind"). Fields without a default must be
    given: a wrong default there would pass silently (a training kind without `rows` sizes its
    memory for the wrong rows, one without `resumable` would lose its checkpoints on a retry).

    - `schema`: its config dataclass (`alignflow.orchestrator.config.schema`); the root config gets one
      section of it per kind, and each instance's effective config is typed by it.
    - `output`: the format of its output (`OUTPUTS`); `output_format`: that format's
      declaration where this kind is the one that writes it (`model` is shared: `MODEL`).
    - `inputs`: the input roles it takes, each with the output format it expects, required or
      optional, one upstream stage or a list; checked at compose time, and the fingerprint
      hashes `{role: upstream fingerprint}`.
    - `headline`: the metrics its summary and artifact lead with (fnmatch patterns).
    - `trend`: the metrics a run's report charts across runs when no gate names them.
    - `reads`: the config paths it reads besides its own section (its config slice, hence its
      identity; an instance may override them, e.g. a second prep's `data`).
    - `context`: config paths the job also receives that never change its output (logging,
      the local cache for object-store inputs), so they stay out of its identity.
    - `sources`: config paths holding URIs of external inputs, whose content identity is part
      of the fingerprint.
    - `source_files(section)`: further external files its config leads to (e.g. the data files a
      task YAML names), whose content identity is part of the fingerprint as `sources`' is.
    - `packages`: installed packages besides `NUMERIC_PACKAGES` whose versions change its output
      (in its fingerprint).
    - `resumable`: a training stage checkpoints in its staging area and resumes from it when
      retried, so its staging is kept between attempts; other stages start clean.
    - `imports`: paths in its section that may name user code by import path
      (`module:function`; `*` steps through a list), covered by its code identity.
    - `checks(stage, key, check_paths)`: its compose-time problems ("key: message").
    - `batch_problems(section, dp, key)`: how its batch splits over the data-parallel ranks.
    - `rows(section, data, dp)`: (tokens a micro batch row holds, rows per step and DP rank);
      required of a training kind (a schema with `optim`), None otherwise.
    - `frozen_models(section, inputs, lora)`: whole frozen models it keeps beside the trained one.
    - `load_balancing`: its objective adds HF's MoE load-balancing loss
      (`alignflow.job.train.objectives.with_load_balancing`).
    - `tokenizer_role`: the input whose tokenizer its output has (up to a kind whose config names it).
    - `same_tokenizer`: two input roles whose outputs must share one vocabulary.
    - `same_upstream`: (role, via, upstream role): its `role` must be the very upstream stage
      that its `via` input was computed on as `upstream role`.
    - `table(metrics)`: a further UI table of its output, or None.
    - `work(stage, count)`: the model passes it will run (`Work`), for `align plan`'s FLOPs.
    """

    schema: type
    output: str
    inputs: dict[str, Role]
    resumable: bool
    output_format: OutputFormat | None = None
    headline: tuple[str, ...] = ()
    trend: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    context: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    source_files: Callable[[Any], list[str]] = no_source_files
    packages: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()
    checks: Callable[[Any, str, bool], list[str]] = no_checks
    batch_problems: Callable[[Any, int, str], list[str]] = global_batch_problems
    rows: Callable[[Any, Any, int], tuple[int, int]] | None = None
    frozen_models: Callable[[Any, Any, int | None], int] = no_frozen_models
    load_balancing: bool = False
    tokenizer_role: str = "model"
    same_tokenizer: tuple[str, str] | None = None
    same_upstream: tuple[tuple[str, str, str], ...] = ()
    table: Callable[[dict], Table | None] = no_table
    work: Callable[[Any, Count], list[Work]] = no_work

    def __post_init__(self):
        trains = "optim" in {f.name for f in fields(self.schema)}
        if trains != (self.rows is not None):
            raise TypeError(
                f"StageKind({self.schema.__name__}): `rows` (what a micro batch row holds, for the memory estimate) "
                f"is {'required of a training kind' if trains else 'only for a training kind (a schema with optim)'}"
            )


# The format the kinds that make a causal LM write (convert and the training kinds).
MODEL = OutputFormat(
    "Megatron torch_dist model/ (LoRA: adapter/ + lora.json naming the base) + hf/ + tokenizer/ (alignflow.job.model_files); "
    "with checkpoint.keep_optimizer the final training checkpoint (alignflow.job.train.checkpoints)",
    (
        Need("hf/config.json", json_file),
        Need("tokenizer/*", nonempty),
        *(
            Need(f"checkpoints/step-*/{part}", check, required=False)
            for part, check in (("model", torch_dist), ("optimizer", torch_dist), ("trainer.json", json_file))
        ),
    ),
    one_of=((Need("model", torch_dist),), (Need("adapter", torch_dist), Need("lora.json", json_file))),
)

CACHE = ("store.cache_dir",)  # where a job downloads input models from object stores (and trains)
TRAINING = ("logging", *CACHE)
TRAIN_HEADLINE = ("train_loss", "val_loss", "steps", "tokens_per_s")
