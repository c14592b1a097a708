"""The stage registry: one entry per stage kind, pure data, importable without torch.

The same word names a kind everywhere: this table, its config section and schema class, and
its worker module `alignflow.stages.<kind>`. A pipeline holds named *instances* of kinds
(`alignflow.pipeline`); the instance name is what the flow, the store and the UI show.

- `schema`: the kind's config dataclass (`alignflow.config.schema`); the root config
  (`AlignConfig`) gets one section of it per kind, and each instance's effective config is
  typed by it.
- `output`: the format of its output (`OUTPUTS`), read by one reader beside its writer, and
  what a commit checks is in it.
- `inputs`: the input roles it takes, each with the output format it expects, required or
  optional, one upstream stage or a list; a pipeline is checked against them at compose time,
  and the fingerprint hashes `{role: upstream fingerprint}`. (Which version of the code made an
  output is not declared here: `alignflow.fingerprint` digests the source of its modules.)
- `headline`: the metrics its summary and artifact lead with (fnmatch patterns).
- `reads`: the config paths it reads besides its own section; they form its config slice,
  hence its identity, and an instance may override them (e.g. a second prep's `data`).
- `context`: config paths the job also receives but that never change its output (logging,
  wandb, the local cache for object-store inputs), so they stay out of its identity.
- `sources`: config paths holding URIs of external inputs (data files, checkpoints,
  tokenizers); their content identity is part of the fingerprint.
- `resumable`: training stages checkpoint in their staging area and resume from it when
  retried, so their staging is kept between attempts; other stages start clean.
- `imports`: paths in its section that may name user code by import path (`module:function`,
  e.g. a reward function; `*` steps through a list); its code identity covers those modules
  and the user modules they import (`user_imports`, `alignflow.fingerprint.code_identity`).

Adding a kind: its module `alignflow/stages/<kind>.py` with `run(cfg, inputs, out)`, its
schema class, and one entry here.
"""

from dataclasses import dataclass, field, make_dataclass

from alignflow.config import schema
from alignflow.verify import Need, OutputFormat, json_file, nonempty, parquet, safetensors, torch_dist

# Output formats (README "Stages and the store"): where each is written and read, and what a
# commit checks is in it (`alignflow.verify`: each glob must match, and each match must open).
OUTPUTS = {
    "prep": OutputFormat("Parquet token tables + metadata.json (alignflow.data.prepared)",
                         (Need("metadata.json", json_file), Need("*/*.parquet", parquet))),
    "model": OutputFormat("Megatron torch_dist model/ (LoRA: adapter/ + lora.json naming the base) + hf/ + tokenizer/ (alignflow.checkpoint); "
                          "with checkpoint.keep_optimizer the final training checkpoint (alignflow.train.checkpointing)",
                          (Need("hf/config.json", json_file), Need("tokenizer/*", nonempty),
                           *(Need(f"checkpoints/step-*/{part}", check, required=False)
                             for part, check in (("model", torch_dist), ("optimizer", torch_dist), ("trainer.json", json_file)))),
                          one_of=((Need("model", torch_dist),), (Need("adapter", torch_dist), Need("lora.json", json_file)))),
    "ref_logprobs": OutputFormat("Parquet per-pair reference log-probs (alignflow.stages.ref_logprobs)",
                                 (Need("train-*.parquet", parquet), Need("val-*.parquet", parquet, required=False))),
    "teacher_logprobs": OutputFormat("Parquet per-row teacher top-k token ids and log-probs at the loss positions (alignflow.data.teacher_topk)",
                                     (Need("train-*.parquet", parquet), Need("val-*.parquet", parquet, required=False))),
    "reward_model": OutputFormat("Megatron torch_dist model/ with the scalar head rm_head.weight + hf/ (config.json: the "
                                 "...ForSequenceClassification, one label, pad_token_id) + tokenizer/ (alignflow.stages.reward_model)",
                                 (Need("hf/config.json", json_file), Need("tokenizer/*", nonempty), Need("model", torch_dist),
                                  *(Need(f"checkpoints/step-*/{part}", check, required=False)
                                    for part, check in (("model", torch_dist), ("optimizer", torch_dist), ("trainer.json", json_file))))),
    "eval": OutputFormat("eval.json: metrics per model and samples (alignflow.stages.eval)", (Need("eval.json", json_file),)),
    "hf": OutputFormat("HF safetensors shards + config + tokenizer, + adapter/ (HF PEFT) for LoRA (alignflow.stages.export)",
                       (Need("config.json", json_file), Need("*.safetensors", safetensors), Need("*.index.json", json_file, required=False),
                        Need("adapter/*.safetensors", safetensors, required=False), Need("adapter/*.json", json_file, required=False))),
}


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


@dataclass(frozen=True)
class StageKind:
    schema: type
    output: str
    inputs: dict[str, Role] = field(default_factory=dict)
    headline: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    context: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    resumable: bool = False
    imports: tuple[str, ...] = ()


_CACHE = ("store.cache_dir",)  # where a job downloads input models from object stores (and trains)
_TRAINING = ("logging", *_CACHE)
_DATA_SOURCES = tuple(f"data.{kind}.{split}" for kind in ("sft", "preference", "prompts") for split in ("train", "val"))
_TRAIN_HEADLINE = ("train_loss", "val_loss", "steps", "tokens_per_s")

STAGES: dict[str, StageKind] = {
    "prep": StageKind(schema.PrepConfig, "prep", headline=("*.train.rows", "*.train.packing_efficiency", "*.train.tokens"),
                      reads=("data", "model.tokenizer", "model.chat_template"), sources=(*_DATA_SOURCES, "model.tokenizer")),
    "convert": StageKind(schema.ConvertConfig, "model", headline=("architecture", "parameters", "megabytes", "mb_per_s"),
                         reads=("model",), sources=("model.source", "model.hf_config", "model.tokenizer")),
    "ref_logprobs": StageKind(schema.RefLogprobsConfig, "ref_logprobs", {"data": one("prep"), "model": one("model")},
                              headline=("train.pairs", "val.pairs", "train.mean_chosen_logp"), reads=("model",), context=_CACHE),
    "sft": StageKind(schema.SFTConfig, "model", {"data": one("prep"), "model": one("model")}, headline=_TRAIN_HEADLINE,
                     reads=("model",), context=_TRAINING, resumable=True),
    "dpo": StageKind(schema.DPOConfig, "model", {"data": one("prep"), "model": one("model"), "ref_logprobs": one("ref_logprobs")},
                     headline=("val_reward_accuracy", *_TRAIN_HEADLINE), reads=("model",), context=_TRAINING, resumable=True),
    "grpo": StageKind(schema.GRPOConfig, "model", {"data": one("prep"), "model": one("model"), "ref_model": one("model"),
                                                   "reward_model": optional("reward_model")},
                      headline=("reward_first_tenth", "reward_last_tenth", "accuracy", "steps"),
                      reads=("model",), context=_TRAINING, resumable=True, imports=("environment.*.name",)),
    "teacher_logprobs": StageKind(schema.TeacherLogprobsConfig, "teacher_logprobs", {"data": one("prep"), "teacher": one("model")},
                                  headline=("train.rows", "train.positions", "val.rows", "train.mean_top1_logp"), reads=("model",),
                                  context=_CACHE),
    "distillation": StageKind(schema.DistillationConfig, "model",
                              {"data": one("prep"), "model": one("model"), "teacher_logprobs": one("teacher_logprobs")},
                              headline=("val_kl", *_TRAIN_HEADLINE), reads=("model",), context=_TRAINING, resumable=True),
    "eval": StageKind(schema.EvalConfig, "eval", {"data": one("prep"), "model": one("model"), "baselines": many("model"),
                                                  "reward_model": optional("reward_model")},
                      headline=("*.accuracy", "*.preference_accuracy", "*.val_loss"), reads=("model",), context=_CACHE),
    "reward_model": StageKind(schema.RewardModelConfig, "reward_model", {"data": one("prep"), "model": one("model", "reward_model")},
                              headline=("val_reward_accuracy", "val_reward_margin", *_TRAIN_HEADLINE), reads=("model",), context=_TRAINING,
                              resumable=True),
    "export": StageKind(schema.ExportConfig, "hf", {"model": one("model", "reward_model")}, headline=("architecture", "dtype", "shards", "destination")),
}


# The root config's schema: the shared sections plus one section per kind, typed by its schema.
AlignConfig = make_dataclass("AlignConfig", [(kind, spec.schema, field(default_factory=spec.schema)) for kind, spec in STAGES.items()],
                             bases=(schema.AlignBase,))


def worker_module(kind: str) -> str:
    return f"alignflow.stages.{kind}"


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
