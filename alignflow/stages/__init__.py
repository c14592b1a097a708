"""The stage registry: pure data, importable without torch.

The same word names the stage everywhere: this table, the config section, the worker
module `alignflow.stages.<name>`, the Prefect task and the store prefix `{root}/<name>/`.

- `inputs`: the input roles the stage takes, each required or optional, one upstream stage or
  a list of them; a pipeline is checked against them at compose time, and the fingerprint
  hashes `{role: upstream fingerprint}`. (What version of the code made an output is not
  declared here: `alignflow.fingerprint` digests the source of the stage's modules.)
- `reads`: the config paths the stage reads besides its own section; they form its
  config slice, hence its identity.
- `context`: config paths the job also receives but that never change its output (logging,
  wandb, the local cache for object-store inputs), so they stay out of its identity;
- `sources`: config paths holding URIs of external inputs (data files, checkpoints,
  tokenizers); their content identity is part of the fingerprint, so a changed file is
  never served from cache.
- `resumable`: training stages checkpoint in their staging area and resume from it when
  retried, so their staging is kept between attempts; other stages start clean.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Role:
    required: bool = True
    many: bool = False  # a list of upstream stages

    def describe(self) -> str:
        return f"{'required' if self.required else 'optional'}, {'a list of stages' if self.many else 'one stage'}"


ONE, OPTIONAL, LIST = Role(), Role(required=False), Role(required=False, many=True)


@dataclass(frozen=True)
class StageSpec:
    inputs: dict[str, Role] = field(default_factory=dict)
    reads: tuple[str, ...] = ()
    context: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    resumable: bool = False


_CACHE = ("store.cache_dir",)  # where a job downloads input models from object stores (and trains)
_DATA_SOURCES = tuple(f"data.{kind}.{split}" for kind in ("sft", "preference", "prompts") for split in ("train", "val"))

STAGES: dict[str, StageSpec] = {
    "prep": StageSpec(reads=("data", "model.tokenizer", "model.chat_template"), sources=_DATA_SOURCES + ("model.tokenizer",)),
    "convert": StageSpec(reads=("model",), sources=("model.source", "model.hf_config", "model.tokenizer")),
    "ref_logprobs": StageSpec({"data": ONE, "model": ONE}, reads=("model",), context=_CACHE),
    "sft": StageSpec({"data": ONE, "model": ONE}, reads=("model",), context=("logging", *_CACHE), resumable=True),
    "dpo": StageSpec({"data": ONE, "model": ONE, "ref_logprobs": ONE}, reads=("model",), context=("logging", *_CACHE), resumable=True),
    "grpo": StageSpec({"data": ONE, "model": ONE, "ref_model": OPTIONAL}, reads=("model",), context=("logging", *_CACHE), resumable=True),
    "eval": StageSpec({"data": ONE, "model": ONE, "baselines": LIST}, reads=("model",), context=_CACHE),
    "export": StageSpec({"model": ONE}),
}


def worker_module(stage: str) -> str:
    return f"alignflow.stages.{stage}"


def as_names(upstream) -> list[str]:
    """A pipeline input role maps to one upstream stage or a list of them."""
    return [upstream] if isinstance(upstream, str) else list(upstream)
