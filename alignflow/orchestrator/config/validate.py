"""Cross-field checks that run at compose time, before any job is submitted.

Every problem is reported with the config key it is about, all at once, so a user fixes
a config in one round trip instead of one GPU-hour at a time.
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from alignflow.orchestrator.config.destinations import destination_problems
from alignflow.orchestrator.config.engine import engine_problems
from alignflow.orchestrator.config.memory import GIB, Dimensions, Footprint, Layout, estimate, layout_of
from alignflow.orchestrator.config.schema import FinetuningType, LauncherName, RecomputeGranularity, RecomputeMethod
from alignflow.orchestrator.config.slices import secret_problems
from alignflow.job.convert import lora as lora_targets
from alignflow.job.convert.families import ModelShape, model_shape
from alignflow.orchestrator.kinds import STAGES
from alignflow.orchestrator.launch import gpus_per_node, local_gpus, time_limit
from alignflow.orchestrator.lease import conditional_writes_problem
from alignflow.orchestrator.pipeline import Pipeline, PipelineError, Stage
from alignflow.orchestrator.runs import read as read_run
from alignflow.orchestrator.store import options_for, store_of


class ConfigError(ValueError):
    """A config that cannot run; the message names the offending keys."""


def validate(cfg: DictConfig, check_paths: bool = True) -> Pipeline:
    """The pipeline of `cfg`, or ConfigError naming every problem of it and of its stages."""
    text = _control_characters(_plain(cfg))
    try:
        pipeline = Pipeline.build(cfg)
    except PipelineError as err:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {p}" for p in dict.fromkeys(text + err.problems))) from None
    problems: list[str] = text + secret_problems(cfg) + destination_problems(pipeline, cfg, read=check_paths)
    shapes: dict[str, tuple] = {}
    gpus = gpus_per_node(cfg.launcher)
    memory = memory_estimates(pipeline, check_paths, problems, shapes)
    for stage in pipeline:
        key = stage.kind if stage.name == stage.kind else f"pipeline.stages.{stage.name}"
        shape = _model_shape(stage.cfg, problems, shapes) if check_paths and "parallel" in stage.section else None
        problems += _check_stage(stage, key, shape) + stage.spec.checks(stage, key, check_paths)
        problems += _check_time_limit(stage, key) + _check_ranks_on_gpus(stage.section, key, gpus)
        problems += _check_nodes(stage.section, key, cfg.launcher)
        hf_config = _read_model(stage.cfg, problems, shapes)[1] if check_paths and "generation_engine" in stage.section else None
        problems += engine_problems(stage.section, key, hf_config, gpus, cfg.launcher.mem_gb)
        problems += _check_memory(key, memory.get(stage.name), cfg.launcher.gpu_memory_gib)
        problems += _check_lineage(pipeline, stage, cfg if check_paths else None)
    problems += _check_retention(cfg.store.retention) + _check_lease(cfg.store) + _check_gpus(cfg.launcher)
    problems += _check_gate(cfg, pipeline, check_paths)
    if cfg.launcher.gpu_memory_gib is not None and not cfg.launcher.gpu_memory_gib > 0:
        problems.append(f"launcher.gpu_memory_gib: must be > 0 GiB, or null (unknown: not checked), got {cfg.launcher.gpu_memory_gib}")
    if check_paths:
        problems += _check_store(cfg) + _check_launcher(cfg)
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {p}" for p in dict.fromkeys(problems)))
    return pipeline


# Keys whose values are text for a model or for user code (a Jinja chat template, a reward
# function's arguments), where a newline belongs; every other string is a name, a path or an
# option that reaches file names, sbatch lines or artifact keys.
FREE_TEXT = ("chat_template", "kwargs")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _plain(cfg: DictConfig):
    """`cfg` as plain data, resolved where it resolves (values from the environment included)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:  # an instance's own interpolation error: Pipeline.build names it
        return OmegaConf.to_container(cfg, resolve=False)


def _control_characters(node, key: str = "") -> list[str]:
    """Every string value or mapping key with a control character (\\x00-\\x1f, \\x7f) in it, by key;
    the value itself is not shown (it may be a secret)."""
    if isinstance(node, dict):
        problems = [
            f"{key or 'the config'}: the key {k!r} contains a control character {CONTROL.search(k).group()!r}"
            for k in node
            if isinstance(k, str) and CONTROL.search(k)
        ]
        return problems + [
            p for k, v in node.items() if k not in FREE_TEXT for p in _control_characters(v, f"{key}.{_printable(k)}" if key else _printable(k))
        ]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _control_characters(v, f"{key}[{i}]")]
    if isinstance(node, str) and (found := CONTROL.search(node)):
        return [
            f"{key}: contains the control character {found.group()!r}; names, paths and options reach file names, sbatch "
            "lines and artifact keys, where it would break or inject a line"
        ]
    return []


def _printable(name) -> str:
    return str(name) if str(name).isprintable() else repr(str(name))[1:-1]


def _model_shape(cfg: DictConfig, problems: list[str], seen: dict) -> ModelShape | None:
    """The model's shape from the HF config.json of `model.source` (or `model.hf_config`)."""
    return _read_model(cfg, problems, seen)[2]


def _read_model(cfg: DictConfig, problems: list[str], seen: dict) -> tuple[str, dict | None, ModelShape | None]:
    """The URI of the model's HF config.json, its content and the shape it gives (None where it fails)."""
    key = "model.hf_config" if cfg.model.hf_config else "model.source"
    uri = f"{OmegaConf.select(cfg, key).rstrip('/')}/config.json"
    if uri in seen:
        return seen[uri]
    seen[uri] = (uri, None, None)
    try:
        with fsspec.open(uri, "r", **options_for(uri, cfg)) as f:
            seen[uri] = (uri, config := json.load(f), None)
        seen[uri] = (uri, config, model_shape(config))
    except FileNotFoundError:
        hint = "; a Megatron/NeMo source needs model.hf_config" if key == "model.source" else ""
        problems.append(f"{key}: {uri} does not exist (for the demo model run `align demo` first{hint})")
    except (OSError, ValueError) as err:
        problems.append(f"{key}: {uri}: {err}")
    return seen[uri]


@dataclass(frozen=True)
class StageMemory:
    footprint: Footprint
    layout: Layout
    shape_from: str  # the config.json it was read from, or model.architecture


def memory_estimates(
    pipeline: Pipeline, check_paths: bool = True, problems: list[str] | None = None, seen: dict | None = None
) -> dict[str, StageMemory]:
    """Each training stage's estimated per-rank memory (`alignflow.orchestrator.config.memory`), by instance
    name, where the model's shape is known: from its config.json (read only with `check_paths`),
    else from `model.architecture`. Problems of reading it go to `problems`."""
    problems, seen, estimates = [] if problems is None else problems, {} if seen is None else seen, {}
    for stage in pipeline:
        if "optim" not in stage.section:
            continue
        uri, config, _ = _read_model(stage.cfg, problems, seen) if check_paths else (None, None, None)
        dims, shape_from = _dimensions(stage.cfg, uri, config, problems)
        if dims is not None and (layout := layout_of(stage.kind, stage.cfg, stage.inputs, dims)) is not None:
            estimates[stage.name] = StageMemory(estimate(dims, layout), layout, shape_from)
    return estimates


def _dimensions(cfg: DictConfig, uri: str | None, config: dict | None, problems: list[str]) -> tuple[Dimensions | None, str]:
    """The model's Dimensions from its config.json, else from the preset's `model.architecture`."""
    preset = cfg.model.architecture
    if preset is not None and not isinstance(preset, DictConfig):
        problems.append(f"model.architecture: a mapping of the checkpoint's config.json keys (hidden_size: 4096, ...) or null, got {preset!r}")
        return None, ""
    preset = OmegaConf.to_container(preset) if preset is not None else None
    if config is not None:
        problems += _disagreements(preset or {}, config, uri)
    if config is not None:
        source, shape_from, where = config, "config.json", f"model.source: {uri}"
    else:
        source, shape_from, where = preset, "model.architecture", "model.architecture:"
    if source is None:
        return None, ""
    try:
        return Dimensions.of(source), shape_from
    except (KeyError, TypeError) as err:
        problems.append(
            f"{where} lacks {err} (the config.json keys that size a model: num_hidden_layers, hidden_size, "
            "intermediate_size, num_attention_heads, vocab_size; num_key_value_heads, head_dim, MoE keys where they apply)"
        )
        return None, ""


def _disagreements(preset: dict, config: dict, uri: str) -> list[str]:
    """A preset's numbers that the checkpoint's config.json contradicts (a stale or wrong preset)."""
    flat = lambda d: {k: v for k, v in {**d, **d.get("text_config", {})}.items() if k != "text_config"}  # noqa: E731
    mine, theirs = flat(preset), flat(config)
    return [
        f"model.architecture.{k}: {v!r}, but {uri} says {theirs[k]!r}: the preset does not describe this checkpoint "
        "(set model.architecture=null to size it from its config.json alone)"
        for k, v in mine.items()
        if k in theirs and theirs[k] != v
    ]


def _check_memory(key: str, memory: StageMemory | None, limit_gib: float | None) -> list[str]:
    """A training stage whose estimated per-rank memory exceeds the launcher's GPU memory."""
    if memory is None or limit_gib is None or limit_gib <= 0 or memory.footprint.total <= limit_gib * GIB:
        return []
    layout, where = memory.layout, {"first": " (first pipeline stage)", "last": " (last pipeline stage)"}.get(memory.footprint.stage, "")
    recompute = layout.recompute + (f" ({layout.recompute_method}, {layout.recompute_layers} layers)" if layout.recompute == "full" else "")
    return [
        f"{key}: needs an estimated {memory.footprint.describe()}{where}, more than launcher.gpu_memory_gib = {limit_gib:g} GiB; "
        f"layout: tensor {layout.tp} x pipeline {layout.pp} x expert {layout.ep} x data {layout.dp}, micro_batch_size "
        f"{layout.micro_batch} x {layout.seq_length} tokens, {'bf16' if layout.bf16 else 'fp32'}, recompute {recompute}, "
        f"distributed optimizer {'on' if layout.distributed_optimizer else 'off'}. Raise tensor or pipeline parallelism, set "
        f"{key}.parallel.use_distributed_optimizer=true, {key}.recompute_granularity=full or lower {key}.micro_batch_size "
        "(`align plan` prints the estimate)"
    ]


def _check_stage(stage: Stage, key: str, shape: ModelShape | None) -> list[str]:
    section, kind = stage.section, stage.kind
    problems = []
    world = section.resources.nodes * section.resources.tasks_per_node
    if world < 1:
        return [f"{key}.resources: nodes * tasks_per_node must be >= 1"]
    if "parallel" in section:
        problems += _check_parallel(kind, key, section, world, shape)
    if "optim" in section:
        problems += _check_optim(key, section)
    if "recompute_granularity" in section:
        problems += _check_recompute(key, section, shape)
    if "finetuning_type" in section and section.finetuning_type != FinetuningType.all_weights:
        problems += _check_lora(key, section, shape)
    if "optim" in section and shape is not None and shape.moe_aux_loss_coef:
        problems += _check_load_balancing(kind, key, section, shape)
    if shape is not None and shape.rope_original_max is not None and "data" in stage.inputs:
        problems += _check_longrope(stage.cfg.data.seq_length, shape.rope_original_max)
    return problems


def _check_load_balancing(kind: str, key: str, section: DictConfig, shape: ModelShape) -> list[str]:
    """A MoE model whose config.json sets output_router_logits: HF's training loss adds
    router_aux_loss_coef x its load-balancing loss, over every layer's routing of a micro batch
    at once; alignflow adds it where the whole model and its forward's router logits are at hand."""
    why = (
        f"the model's config.json (model.source) sets output_router_logits=true, so HF's training loss adds router_aux_loss_coef "
        f"({shape.moe_aux_loss_coef}) x its load-balancing loss"
    )
    off = "or set output_router_logits to false (HF's default) to train on the language-model loss alone"
    if not STAGES[kind].load_balancing:
        adding = [name for name, spec in STAGES.items() if spec.load_balancing]
        return [f"{key}: {why}, which {kind} does not add (only {' and '.join(adding)} do); {off}"]
    problems, par = [], section.parallel
    if par.pipeline_model_parallel_size > 1:
        problems.append(
            f"{key}.parallel.pipeline_model_parallel_size: {par.pipeline_model_parallel_size}, but {why}, computed over "
            f"all layers' router logits of a micro batch together, which alignflow adds with every layer on one pipeline "
            f"stage; set it to 1, {off}"
        )
    if section.recompute_granularity == RecomputeGranularity.full:
        problems.append(
            f"{key}.recompute_granularity: full recomputes each layer in the backward pass, but {why}, which needs the "
            f"router logits of every layer's forward with their gradients; use selective or none, {off}"
        )
    if par.sequence_parallel:
        problems.append(
            f"{key}.parallel.sequence_parallel: each tensor-parallel rank routes a slice of the tokens, but {why} over "
            f"all the micro batch's tokens (not built with sequence parallelism); turn it off, {off}"
        )
    return problems


def _check_longrope(seq_length: int, original_max: int) -> list[str]:
    """A longrope model is mapped where HF keeps its short factors: rows within its original positions."""
    if seq_length <= original_max:
        return []
    return [
        f"data.seq_length: {seq_length} passes the model's original_max_position_embeddings={original_max} (model.source: "
        "longrope), past which HF switches its RoPE to long_factor; that switch is not mapped"
    ]


def _check_parallel(kind: str, stage_key: str, section: DictConfig, world: int, shape: ModelShape | None) -> list[str]:
    par, problems = section.parallel, []
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    key = f"{stage_key}.parallel"
    sizes = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": par.expert_model_parallel_size,
    }
    if small := [f"{key}.{name}: must be >= 1, got {size}" for name, size in sizes.items() if size < 1]:
        return small
    if world % (tp * pp * cp):
        problems.append(
            f"{key}: tensor ({tp}) x pipeline ({pp}) x context ({cp}) = {tp * pp * cp} does not divide the world size "
            f"{stage_key}.resources.nodes x tasks_per_node = {world}"
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
    problems += _check_experts(key, par.expert_model_parallel_size, dp, shape)
    if shape is not None:
        if shape.num_attention_heads % tp:
            problems.append(
                f"{key}.tensor_model_parallel_size: {tp} does not divide the model's {shape.num_attention_heads} attention heads (model.source)"
            )
        if shape.num_query_groups % tp:
            problems.append(
                f"{key}.tensor_model_parallel_size: {tp} does not divide the model's {shape.num_query_groups} query groups (model.source)"
            )
        if shape.num_layers % (pp * (vpp or 1)):
            problems.append(
                f"{key}.pipeline_model_parallel_size: {pp} x virtual {vpp or 1} does not divide the model's {shape.num_layers} layers (model.source)"
            )
    if section.micro_batch_size < 1:
        problems.append(f"{stage_key}.micro_batch_size: must be >= 1")
    else:
        problems += STAGES[kind].batch_problems(section, dp, stage_key)
    return problems


def _check_experts(key: str, ep: int, dp: int, shape: ModelShape | None) -> list[str]:
    """Expert parallelism splits each MoE layer's experts over EP of the data-parallel ranks."""
    if ep == 1:
        return []
    if shape is not None and not shape.moe:
        return [f"{key}.expert_model_parallel_size: {ep}, but the model ({shape.architecture}, model.source) has no experts"]
    problems = []
    if dp % ep:
        problems.append(
            f"{key}.expert_model_parallel_size: {ep} does not divide the data-parallel size {dp} (world size / "
            "(tensor x pipeline x context)); expert-parallel ranks are data-parallel ranks"
        )
    if shape is not None and shape.num_experts % ep:
        problems.append(f"{key}.expert_model_parallel_size: {ep} does not divide the model's {shape.num_experts} experts (model.source)")
    return problems


def _check_gpus(launcher: DictConfig) -> list[str]:
    """A GPU count the launcher can give: none or more, and for local jobs no more than this machine has."""
    asked = launcher.gpus_per_node
    if asked is None:
        return []
    if asked < 0:
        return [f"launcher.gpus_per_node: must be >= 0 (0: the ranks run on the CPU), got {asked}"]
    found = local_gpus() if launcher.name == LauncherName.local else None
    if found is None or asked <= len(found.ids):
        return []
    return [
        f"launcher.gpus_per_node: {asked} for the local launcher, but this machine has {len(found.ids) or 'none'} ({found.source}); "
        "leave it unset (null) to use the GPUs there are, or set 0 to run on the CPU"
    ]


def _check_nodes(section: DictConfig, key: str, launcher: DictConfig) -> list[str]:
    """More than one node is Slurm's: the local launcher runs every rank on this machine."""
    nodes, tasks = section.resources.nodes, section.resources.tasks_per_node
    if launcher.name != LauncherName.local or nodes <= 1:
        return []
    return [
        f"{key}.resources.nodes: {nodes} nodes need launcher=slurm; the local launcher runs every rank on this machine "
        f"(set {key}.resources.nodes=1 and tasks_per_node={nodes * tasks} for the same {nodes * tasks} ranks here)"
    ]


def _check_ranks_on_gpus(section: DictConfig, key: str, gpus: int) -> list[str]:
    """One GPU per rank: a node's ranks need as many GPUs, and one model replica (tensor x
    pipeline x context ranks) needs at least that many in the job."""
    nodes, tasks = section.resources.nodes, section.resources.tasks_per_node
    if gpus <= 0 or min(nodes, tasks) < 1:
        return []
    world, given, problems = nodes * tasks, nodes * gpus, []
    par = section.parallel if "parallel" in section else None
    tp, pp, cp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size) if par else (1, 1, 1)
    model = tp * pp * cp
    if tasks > gpus:
        divides = par is not None and model >= 1 and world % model == 0
        layout = f" = tensor ({tp}) x pipeline ({pp}) x context ({cp}) x data ({world // model})" if divides else ""
        problems.append(
            f"{key}.resources.tasks_per_node: {tasks} ranks per node but launcher.gpus_per_node is {gpus} (one GPU per "
            f"rank): the job's {world} ranks{layout} need {world} GPUs, it gets nodes ({nodes}) x {gpus} = {given}"
        )
    if model > given:
        problems.append(
            f"{key}.parallel: tensor ({tp}) x pipeline ({pp}) x context ({cp}) = {model} ranks hold one "
            f"model replica, more than the {given} GPUs of {key}.resources.nodes ({nodes}) x launcher.gpus_per_node ({gpus})"
        )
    return problems


def _check_optim(stage: str, section: DictConfig) -> list[str]:  # stage: the section's key
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


def _check_lora(stage: str, section: DictConfig, shape: ModelShape | None) -> list[str]:
    """LoRA's settings, and its targets against the model (every pattern must select something)."""
    lora, key, problems = section.lora, f"{stage}.lora", []
    if lora.adapter_dim < 1:
        problems.append(f"{key}.adapter_dim: must be >= 1, got {lora.adapter_dim}")
    if lora.alpha <= 0:
        problems.append(f"{key}.alpha: must be > 0, got {lora.alpha}")
    if not 0 <= lora.adapter_dropout < 1:
        problems.append(f"{key}.adapter_dropout: must be in [0, 1), got {lora.adapter_dropout}")
    if section.recompute_granularity == RecomputeGranularity.full:
        problems.append(
            f"{stage}.recompute_granularity: full recompute with LoRA is not supported (a recomputed layer's "
            "output would not carry its adapters' gradients); use selective or none"
        )
    patterns = list(lora.target_modules)
    problems += lora_targets.target_problems(f"{key}.target_modules", patterns, shape.num_layers if shape else None)
    if shape is not None and shape.gemma_norms and not problems:
        problems += _post_normed_targets(f"{key}.target_modules", patterns, shape)
    if shape is not None and shape.moe and any(path.startswith("mlp.") for _, path in lora_targets.select(patterns, shape.num_layers)):
        problems.append(
            f"{key}.target_modules: {patterns} adapts the MLP, but the model's MLPs are experts ({shape.architecture}) "
            "and LoRA on the expert projections is not built; target the attention only, e.g. [linear_qkv, linear_proj]"
        )
    par = section.parallel
    if (
        shape is not None
        and not problems
        and shape.num_layers % (par.pipeline_model_parallel_size * (par.virtual_pipeline_model_parallel_size or 1)) == 0
    ):
        problems += lora_targets.stage_problems(
            f"{key}.target_modules", patterns, shape.num_layers, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
        )
    return problems


def _post_normed_targets(key: str, patterns: list[str], shape: ModelShape) -> list[str]:
    """Gemma's attention output and fc2 are followed by their post-norm inside the module, which LoRA's layers do not apply."""
    chosen = sorted({path for _, path in lora_targets.select(patterns, shape.num_layers)} & {"self_attention.linear_proj", "mlp.linear_fc2"})
    return (
        [
            f"{key}: LoRA on {', '.join(chosen)} is not supported for {shape.architecture} (its post-attention / post-MLP "
            "norm sits in that module); target linear_qkv and linear_fc1 (q_proj, k_proj, v_proj, gate_proj, up_proj)"
        ]
        if chosen
        else []
    )


VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def _check_lineage(pipeline: Pipeline, stage: Stage, cfg: DictConfig | None) -> list[str]:
    """The lineage rules of `stage`'s kind between its inputs (`StageKind.same_upstream`,
    `same_tokenizer`). Tokenizers at different URIs are compared by content, so only when paths
    are checked (`cfg` given; `align config` does not read files)."""
    key, problems = f"pipeline.stages.{stage.name}.inputs", []
    for role, via, upstream_role in stage.spec.same_upstream:
        mine, theirs = stage.inputs[role], pipeline[stage.inputs[via]].inputs[upstream_role]
        if mine != theirs:
            problems.append(
                f"{key}.{role}: '{mine}' is not the {upstream_role} '{theirs}' that its {via} "
                f"'{stage.inputs[via]}' was computed on; give both the same {role}"
            )
    roles = stage.spec.same_tokenizer
    if roles:
        (chain_a, tok_a), (chain_b, tok_b) = (output_tokenizer(pipeline, stage.inputs[role]) for role in roles)
        if tok_a != tok_b and cfg is not None and _vocab_digest(tok_a, cfg) != _vocab_digest(tok_b, cfg):
            problems.append(
                f"{key}: {roles[0]} '{chain_a[0]}' has the tokenizer {tok_a} (from {' <- '.join(chain_a)}) and "
                f"{roles[1]} '{chain_b[0]}' the tokenizer {tok_b} (from {' <- '.join(chain_b)}); they differ, and "
                f"{stage.kind} needs one tokenizer (student and teacher may differ in size, not in vocabulary)"
            )
    return problems


def output_tokenizer(pipeline: Pipeline, name: str) -> tuple[list[str], str]:
    """The tokenizer URI of stage `name`'s output, and the stages it was followed through, from
    `name` up to the one whose config names it (its kind's `tokenizer_role` input, if wired)."""
    stage = pipeline[name]
    upstream = stage.inputs.get(stage.spec.tokenizer_role)
    if isinstance(upstream, str):
        chain, uri = output_tokenizer(pipeline, upstream)
        return [name, *chain], uri
    return [name], str(stage.cfg.model.tokenizer)


def _vocab_digest(uri: str, cfg: DictConfig) -> str | None:
    """A digest of the files that map text to token ids in tokenizer folder `uri` (tokenizer.json's
    model, normalizer, pre-tokenizer and added tokens; sentencepiece or BPE vocab files), so two
    copies of one tokenizer agree and a chat template or max length may differ; None if unreadable."""
    try:
        fs, path = fsspec.core.url_to_fs(uri, **options_for(uri, cfg))
    except (OSError, ValueError):
        return None
    digest, found = hashlib.sha256(), False
    for name in VOCAB_FILES:
        try:
            data = fs.cat_file(f"{path.rstrip('/')}/{name}")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        if name == "tokenizer.json":
            spec = json.loads(data)
            data = json.dumps({k: spec.get(k) for k in ("model", "normalizer", "pre_tokenizer", "added_tokens")}, sort_keys=True).encode()
        digest.update(name.encode() + b"\0" + data)
        found = True
    return digest.hexdigest() if found else None


def _check_store(cfg: DictConfig) -> list[str]:
    """The store must be writable (local) or reachable with this environment's credentials."""
    root = cfg.store.root
    fs, path = fsspec.core.url_to_fs(root, **options_for(root, cfg))
    if isinstance(fs, LocalFileSystem):
        existing = Path(path)
        while not existing.exists():
            existing = existing.parent
        try:  # a real write: permission bits say nothing to root, nor of read-only mounts
            fd, probe = tempfile.mkstemp(dir=existing, prefix=".alignflow-write-check-")
            os.close(fd)
            os.remove(probe)
        except OSError as err:
            return [f"store.root: {root} is not writable: {existing}: {err.strerror}"]
        return []
    try:
        fs.ls(path.split("/")[0])  # the bucket
        problem = conditional_writes_problem(fs, path) if "s3" in fs.protocol else None
    except Exception as err:  # noqa: BLE001 - every failure to reach the store is the same problem to the user
        return [
            f"store.root: {root} cannot be reached: {type(err).__name__}: {err} (credentials come from the environment, "
            "e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; the endpoint from store.storage_options)"
        ]
    if problem:
        return [
            f"store.root: {root} cannot hold alignflow's leases, which need S3's conditional writes: {problem} "
            "(use an endpoint that supports If-None-Match and If-Match on PUT, e.g. AWS S3 or a recent MinIO)"
        ]
    return []


def _check_lease(store: DictConfig) -> list[str]:
    """Lease timings that work: holders beat every ttl/4 and jobs check every ttl/8, so the ttl
    must leave room for a file system's timestamps; a waiter polls at least once per ttl."""
    ttl, poll, problems = store.lease_ttl_s, store.poll_interval_s, []
    if not ttl >= MIN_LEASE_TTL_S:
        problems.append(f"store.lease_ttl_s: must be >= {MIN_LEASE_TTL_S:g} s (holders beat every ttl/4), got {ttl}")
    if not 0 < poll <= max(ttl, MIN_LEASE_TTL_S):
        problems.append(f"store.poll_interval_s: must be > 0 and at most store.lease_ttl_s ({ttl}), got {poll}")
    return problems


MIN_LEASE_TTL_S = 2.0
REQUEUE_MARGIN_MIN = 2.0  # Slurm signals a job 90 s before its time limit (local: 30 s): its work must be saved before


def _check_time_limit(stage: Stage, key: str) -> list[str]:
    """A time limit a job can live with: positive, and for a training stage longer than its
    checkpoint interval in time, or every requeue would start over from the same checkpoint."""
    section, launcher = stage.section, stage.cfg.launcher
    if section.timeout_min is not None and not section.timeout_min > 0:
        return [f"{key}.timeout_min: must be > 0 minutes, or null for no limit (local jobs), got {section.timeout_min}"]
    if launcher.name == LauncherName.slurm and not launcher.time_min > 0:
        return [f"launcher.time_min: must be > 0 minutes, got {launcher.time_min}"]
    every_n_minutes = OmegaConf.select(section, "checkpoint.every_n_minutes", default=None)
    if every_n_minutes is not None and not every_n_minutes > 0:
        return [f"{key}.checkpoint.every_n_minutes: must be > 0 or null, got {every_n_minutes}"]
    limit = time_limit(launcher, section)
    if not stage.spec.resumable or limit is None:
        return []
    local_limit = launcher.name == LauncherName.local or (section.timeout_min or launcher.time_min) <= launcher.time_min
    which = f"{key}.timeout_min" if section.timeout_min is not None and local_limit else "launcher.time_min"
    if every_n_minutes is None or every_n_minutes > limit - REQUEUE_MARGIN_MIN:
        interval = "null (no checkpoints by time)" if every_n_minutes is None else f"{every_n_minutes:g} min"
        return [
            f"{key}.checkpoint.every_n_minutes: {interval} does not fit in the job's time limit of {limit:g} min ({which}) "
            f"minus {REQUEUE_MARGIN_MIN:g} min for the requeue signal: a job killed by its limit before its first checkpoint "
            f"starts over after every requeue; set it to at most {max(limit - REQUEUE_MARGIN_MIN, 0):g}, or give the job more time"
        ]
    return []


def _check_retention(retention: DictConfig) -> list[str]:
    return [f"store.retention.{key}: must be >= 0, got {retention[key]}" for key in ("keep_runs", "keep_days") if not retention[key] >= 0]


def _check_gate(cfg: DictConfig, pipeline: Pipeline, check_paths: bool) -> list[str]:
    """Thresholds `{stage}.{metric}` on stages of the pipeline, tolerating a drop >= 0; a pinned baseline run in the store."""
    section, names = cfg.gate, [stage.name for stage in pipeline]
    problems = [f"gate.{key}: must be >= {low}, got {section[key]}" for key, low in (("sigmas", 0), ("trend_runs", 1)) if not section[key] >= low]
    for pattern, drop in section.thresholds.items():
        if "." not in pattern or not any(fnmatchcase(name, pattern.split(".", 1)[0]) for name in names):
            problems.append(
                f"gate.thresholds.{pattern}: names no stage of pipeline '{pipeline.name}' (a key is `{{stage}}.{{metric}}`, "
                f"fnmatch patterns allowed, e.g. eval.sft.accuracy; its stages: {', '.join(names)})"
            )
        if not drop >= 0:
            problems.append(f"gate.thresholds.{pattern}: the largest tolerated drop must be >= 0, got {drop}")
    if check_paths and section.thresholds and section.baseline != "last":
        try:
            read_run(store_of(cfg), section.baseline)
        except FileNotFoundError as err:
            problems.append(f"gate.baseline: {err}")
    return problems


def _check_launcher(cfg: DictConfig) -> list[str]:
    if cfg.launcher.name == "slurm" and shutil.which("sbatch") is None:
        return ["launcher=slurm: sbatch is not on this machine's PATH (run the flow where Slurm's client is, or use launcher=local)"]
    return []
