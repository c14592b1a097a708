"""Cross-field checks that run at compose time, before any job is submitted.

Every problem is reported with the config key it is about, all at once, so a user fixes
a config in one round trip instead of one GPU-hour at a time.
"""

import json

import fsspec
from omegaconf import DictConfig, OmegaConf

from alignflow.config.schema import RecomputeGranularity, RecomputeMethod
from alignflow.convert.llama import ModelShape, model_shape
from alignflow.rewards import resolve
from alignflow.stages import STAGES, as_names
from alignflow.store import options_for


class ConfigError(ValueError):
    """A config that cannot run; the message names the offending keys."""


def validate(cfg: DictConfig, check_paths: bool = True) -> None:
    problems: list[str] = []
    problems += _check_pipeline(cfg)
    uses_model = any("parallel" in cfg[stage] for stage in cfg.pipeline.stages if stage in STAGES)
    shape = _model_shape(cfg, problems) if check_paths and uses_model else None
    for stage in cfg.pipeline.stages:
        if stage in STAGES:
            problems += _check_stage(cfg, stage, shape)
    problems += _check_data(cfg, check_paths)
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def _check_pipeline(cfg: DictConfig) -> list[str]:
    problems, seen = [], []
    if not cfg.pipeline.stages:
        problems.append("pipeline.stages: empty pipeline")
    for stage, inputs in cfg.pipeline.stages.items():
        key = f"pipeline.stages.{stage}"
        if stage not in STAGES:
            problems.append(f"{key}: unknown stage; known stages: {', '.join(STAGES)}")
        else:
            problems += _check_roles(key, stage, dict(inputs or {}))
        for role, upstream in (inputs or {}).items():
            for up in as_names(upstream):
                if up not in seen:
                    problems.append(f"{key}.{role}: '{up}' is not a stage listed before '{stage}'")
        seen.append(stage)
    for name in cfg.force:
        if name not in cfg.pipeline.stages:
            problems.append(f"force: '{name}' is not a stage of pipeline '{cfg.pipeline.name}' ({', '.join(cfg.pipeline.stages)})")
    return problems


def _check_roles(key: str, stage: str, wiring: dict) -> list[str]:
    """The wiring against the input roles the stage declares (`alignflow.stages.STAGES`)."""
    declared, problems = STAGES[stage].inputs, []
    takes = ", ".join(f"{role} ({spec.describe()})" for role, spec in declared.items()) or "no inputs"
    for role, upstream in wiring.items():
        if role not in declared:
            problems.append(f"{key}.{role}: stage {stage} has no input role '{role}'; it takes {takes}")
        elif not declared[role].many and not isinstance(upstream, str):
            problems.append(f"{key}.{role}: takes one upstream stage, got {list(upstream)}")
    for role, spec in declared.items():
        if spec.required and role not in wiring:
            problems.append(f"{key}: missing input role '{role}' ({spec.describe()}); stage {stage} takes {takes}")
    return problems


def _model_shape(cfg: DictConfig, problems: list[str]) -> ModelShape | None:
    """The model's shape from the HF config.json of `model.source` (or `model.hf_config`)."""
    key = "model.hf_config" if cfg.model.hf_config else "model.source"
    uri = f"{OmegaConf.select(cfg, key).rstrip('/')}/config.json"
    try:
        with fsspec.open(uri, "r", **options_for(uri, cfg)) as f:
            return model_shape(json.load(f))
    except FileNotFoundError:
        hint = "; a Megatron/NeMo source needs model.hf_config" if key == "model.source" else ""
        problems.append(f"{key}: {uri} does not exist (for the demo model run `align demo` first{hint})")
    except (OSError, ValueError) as err:
        problems.append(f"{key}: {uri}: {err}")
    return None


def _check_stage(cfg: DictConfig, stage: str, shape: ModelShape | None) -> list[str]:
    section = cfg[stage]
    problems = []
    world = section.resources.nodes * section.resources.tasks_per_node
    if world < 1:
        problems.append(f"{stage}.resources: nodes * tasks_per_node must be >= 1")
        return problems
    if "parallel" in section:
        problems += _check_parallel(stage, section, world, shape)
    if "optim" in section:
        problems += _check_optim(stage, section)
    if "recompute_granularity" in section:
        problems += _check_recompute(stage, section, shape)
    if stage == "dpo":
        if section.beta <= 0:
            problems.append(f"dpo.beta: must be > 0, got {section.beta}")
        if not 0 <= section.label_smoothing < 0.5:
            problems.append(f"dpo.label_smoothing: must be in [0, 0.5), got {section.label_smoothing}")
    if stage == "grpo":
        problems += _check_grpo(section)
    if stage == "eval" and (world != 1 or section.parallel.tensor_model_parallel_size * section.parallel.pipeline_model_parallel_size != 1):
        problems.append("eval.resources / eval.parallel: eval runs on one rank (TP1, PP1); generation at TP/PP > 1 is not built")
    return problems


def _check_parallel(stage: str, section: DictConfig, world: int, shape: ModelShape | None) -> list[str]:
    par, problems = section.parallel, []
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    key = f"{stage}.parallel"
    if min(tp, pp, cp) < 1:
        return [f"{key}: parallel sizes must be >= 1"]
    if world % (tp * pp * cp):
        problems.append(
            f"{key}: tensor ({tp}) x pipeline ({pp}) x context ({cp}) = {tp * pp * cp} does not divide the world size "
            f"{stage}.resources.nodes x tasks_per_node = {world}"
        )
    dp = max(world // (tp * pp * cp), 1)
    if cp > 1:
        problems.append(f"{key}.context_parallel_size: context parallelism needs Transformer Engine's attention and is not built")
    if par.sequence_parallel and tp == 1:
        problems.append(f"{key}.sequence_parallel: needs tensor_model_parallel_size > 1")
    if par.overlap_param_gather and not par.use_distributed_optimizer:
        problems.append(f"{key}.overlap_param_gather: needs use_distributed_optimizer (only its parameters are gathered)")
    vpp = par.virtual_pipeline_model_parallel_size
    if vpp is not None and (vpp < 1 or pp == 1):
        problems.append(f"{key}.virtual_pipeline_model_parallel_size: needs pipeline_model_parallel_size > 1 and a value >= 1")
    if shape is not None:
        if shape.num_attention_heads % tp:
            problems.append(f"{key}.tensor_model_parallel_size: {tp} does not divide the model's {shape.num_attention_heads} attention heads (model.source)")
        if shape.num_query_groups % tp:
            problems.append(f"{key}.tensor_model_parallel_size: {tp} does not divide the model's {shape.num_query_groups} query groups (model.source)")
        if shape.num_layers % (pp * (vpp or 1)):
            problems.append(f"{key}.pipeline_model_parallel_size: {pp} x virtual {vpp or 1} does not divide the model's {shape.num_layers} layers (model.source)")
    if section.micro_batch_size < 1:
        problems.append(f"{stage}.micro_batch_size: must be >= 1")
    elif stage == "grpo":
        problems += grpo_batch_problems(section, dp)
    elif "global_batch_size" in section and section.global_batch_size % (section.micro_batch_size * dp):
        problems.append(
            f"{stage}.global_batch_size: {section.global_batch_size} is not divisible by micro_batch_size ({section.micro_batch_size}) "
            f"x data-parallel size ({dp})"
        )
    return problems


def grpo_batch_problems(section: DictConfig, dp: int) -> list[str]:
    """GRPO's batch is num_prompts_per_step x num_generations_per_prompt samples (global_batch_size
    is unused); checked at compose time and again by the trainer, which knows its DP size."""
    if section.num_prompts_per_step % dp:
        return [f"grpo.num_prompts_per_step: {section.num_prompts_per_step} is not divisible by the data-parallel size ({dp})"]
    samples = section.num_prompts_per_step // dp * section.num_generations_per_prompt
    if samples % (section.num_optimizer_steps_per_batch * section.micro_batch_size):
        return [f"grpo.micro_batch_size: the {samples} samples per data-parallel rank and step (num_prompts_per_step / DP x "
                f"num_generations_per_prompt) do not split into num_optimizer_steps_per_batch ({section.num_optimizer_steps_per_batch}) "
                f"x micro_batch_size ({section.micro_batch_size})"]
    return []


def _check_optim(stage: str, section: DictConfig) -> list[str]:
    optim, trainer, problems = section.optim, section.trainer, []
    if optim.lr <= 0:
        problems.append(f"{stage}.optim.lr: must be > 0")
    if not 0 <= optim.min_lr <= optim.lr:
        problems.append(f"{stage}.optim.min_lr: {optim.min_lr} must be in [0, lr={optim.lr}]")
    if trainer.max_steps > 0 and optim.warmup_steps > trainer.max_steps:
        problems.append(f"{stage}.optim.warmup_steps: {optim.warmup_steps} exceeds trainer.max_steps {trainer.max_steps}")
    if trainer.max_steps <= 0 and trainer.max_epochs <= 0:
        problems.append(f"{stage}.trainer: set max_steps > 0 or max_epochs > 0")
    if trainer.val_check_interval < 1:
        problems.append(f"{stage}.trainer.val_check_interval: must be >= 1")
    return problems


def _check_recompute(stage: str, section: DictConfig, shape: ModelShape | None) -> list[str]:
    """Megatron's rules for full recompute: at least one layer, and a block within a stage's layers."""
    if section.recompute_granularity != RecomputeGranularity.full:
        return []
    n, key = section.recompute_num_layers, f"{stage}.recompute_num_layers"
    if n < 1:
        return [f"{key}: must be >= 1 with recompute_granularity full, got {n}"]
    par = section.parallel
    stage_layers = shape.num_layers // (par.pipeline_model_parallel_size * (par.virtual_pipeline_model_parallel_size or 1)) if shape else None
    if section.recompute_method == RecomputeMethod.block and stage_layers and n > stage_layers:
        return [f"{key}: {n} exceeds the {stage_layers} layers of a pipeline stage (model.source) with recompute_method block"]
    return []


def _check_grpo(section: DictConfig) -> list[str]:
    problems = []
    if section.ratio_clip_c is not None and section.ratio_clip_c <= 1:
        problems.append(f"grpo.ratio_clip_c: must be > 1 (typically 3) or null, got {section.ratio_clip_c}")
    if section.generation_temperature < 0:
        problems.append("grpo.generation_temperature: must be >= 0 (0 = greedy)")
    if not 0 < section.generation_top_p <= 1:
        problems.append("grpo.generation_top_p: must be in (0, 1]")
    if section.generation_top_k is not None and section.generation_top_k < 1:
        problems.append("grpo.generation_top_k: must be >= 1 or null")
    if section.num_generations_per_prompt < 2 and (section.use_rloo or section.normalize_rewards):
        problems.append("grpo.num_generations_per_prompt: group baselines need at least 2 generations per prompt")
    if not section.environment:
        problems.append("grpo.environment: needs at least one reward function")
    for i, reward in enumerate(section.environment):
        try:
            resolve(reward.name)
        except ValueError as err:
            problems.append(f"grpo.environment[{i}].name: {err}")
    return problems


def _check_data(cfg: DictConfig, check_paths: bool) -> list[str]:
    data, problems = cfg.data, []
    if data.seq_length < 2:
        problems.append(f"data.seq_length: must be >= 2, got {data.seq_length}")
    if not 0 < data.max_prompt_length < data.seq_length:
        problems.append(f"data.max_prompt_length: {data.max_prompt_length} must be in [1, data.seq_length={data.seq_length})")
    if "prep" not in cfg.pipeline.stages:
        return problems
    if check_paths and not _exists(cfg.model.tokenizer, cfg):
        problems.append(f"model.tokenizer: {cfg.model.tokenizer} does not exist (for the demo tokenizer run `align demo` first)")
    kinds = [kind for kind in ("sft", "preference", "prompts") if data[kind] is not None]
    if not kinds:
        problems.append("data: prep needs at least one of data.sft, data.preference, data.prompts")
    for kind in kinds:
        spec = data[kind]
        if not 0 <= spec.val_fraction < 1:
            problems.append(f"data.{kind}.val_fraction: must be in [0, 1)")
        for split in ("train", "val"):
            uri = spec[split]
            if check_paths and uri is not None and not _exists(uri, cfg):
                problems.append(f"data.{kind}.{split}: {uri} does not exist")
    return problems


def _exists(uri: str, cfg: DictConfig) -> bool:
    fs, path = fsspec.core.url_to_fs(uri, **options_for(uri, cfg))
    return bool(fs.glob(path)) if any(c in path for c in "*?[") else fs.exists(path)
