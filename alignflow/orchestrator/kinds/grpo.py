"""The `grpo` kind: GRPO with rewards from reward functions, NeMo-RL's knobs (`alignflow.job.stages.grpo`)."""

from omegaconf import DictConfig

from alignflow.orchestrator.config import schema
from alignflow.job.train.utilization import FORWARD, LORA_TRAINING
from alignflow.job.train.utilization import TRAINING as TRAINING_PASSES
from alignflow.orchestrator.kinds.spec import TRAINING, Count, StageKind, Work, environment_problems, one, optional, reward_model_use_problems


def checks(stage, key: str, check_paths: bool) -> list[str]:
    return _check_grpo(key, stage.section) + reward_model_use_problems(stage, key, "reward_model")


def _check_grpo(key: str, section: DictConfig) -> list[str]:
    problems = []
    if section.loss.ratio_clip_c is not None and section.loss.ratio_clip_c <= 1:
        problems.append(f"{key}.loss.ratio_clip_c: must be > 1 (typically 3) or null, got {section.loss.ratio_clip_c}")
    if section.generation_temperature < 0:
        problems.append(f"{key}.generation_temperature: must be >= 0 (0 = greedy)")
    if not 0 < section.generation_top_p <= 1:
        problems.append(f"{key}.generation_top_p: must be in (0, 1]")
    if section.generation_top_k is not None and section.generation_top_k < 1:
        problems.append(f"{key}.generation_top_k: must be >= 1 or null")
    for name in ("kl_input_clamp_value", "kl_output_clamp_value"):
        if section.loss[name] is not None and section.loss[name] <= 0:
            problems.append(f"{key}.loss.{name}: must be > 0 or null (no clamp), got {section.loss[name]}")
    if not 0 <= section.loss.ratio_clip_min < 1 or section.loss.ratio_clip_max < 0:
        problems.append(f"{key}.loss.ratio_clip_min / ratio_clip_max: the clip range [1 - min, 1 + max] needs 0 <= min < 1 and max >= 0")
    if section.overlong_buffer_length is not None and not 0 < section.overlong_buffer_length <= section.max_new_tokens:
        problems.append(
            f"{key}.overlong_buffer_length: must be in (0, max_new_tokens = {section.max_new_tokens}] or null, got {section.overlong_buffer_length}"
        )
    if section.overlong_buffer_penalty < 0:
        problems.append(f"{key}.overlong_buffer_penalty: must be >= 0, got {section.overlong_buffer_penalty}")
    if section.use_dynamic_sampling and section.num_generations_per_prompt < 2:
        problems.append(f"{key}.use_dynamic_sampling: keeps groups whose rewards differ, so it needs num_generations_per_prompt >= 2")
    if section.dynamic_sampling_max_gen_batches < 1:
        problems.append(f"{key}.dynamic_sampling_max_gen_batches: must be >= 1, got {section.dynamic_sampling_max_gen_batches}")
    if section.num_generations_per_prompt < 2 and (section.use_rloo or section.normalize_rewards):
        problems.append(f"{key}.num_generations_per_prompt: group baselines need at least 2 generations per prompt")
    return problems + environment_problems(section.environment, key)


def grpo_batch_problems(section: DictConfig, dp: int, key: str = "grpo") -> list[str]:
    """GRPO's batch is num_prompts_per_step x num_generations_per_prompt samples (global_batch_size
    is unused); checked at compose time and again by the trainer, which knows its DP size."""
    if section.num_prompts_per_step % dp:
        return [f"{key}.num_prompts_per_step: {section.num_prompts_per_step} is not divisible by the data-parallel size ({dp})"]
    samples = section.num_prompts_per_step // dp * section.num_generations_per_prompt
    if samples % (section.num_optimizer_steps_per_batch * section.micro_batch_size):
        return [
            f"{key}.micro_batch_size: the {samples} samples per data-parallel rank and step (num_prompts_per_step / DP x "
            f"num_generations_per_prompt) do not split into num_optimizer_steps_per_batch ({section.num_optimizer_steps_per_batch}) "
            f"x micro_batch_size ({section.micro_batch_size})"
        ]
    return []


def rows(section, data, dp: int) -> tuple[int, int]:
    """A row is a prompt and its completion; a step's samples cut into optimizer steps."""
    seq_length = min(data.seq_length, data.max_prompt_length + section.max_new_tokens)
    return seq_length, section.num_prompts_per_step // dp * section.num_generations_per_prompt // section.num_optimizer_steps_per_batch


def frozen_models(section, inputs, lora: int | None) -> int:
    """The reference model for the KL penalty, unless LoRA's base is that reference (adapters off),
    and the reward model a `score` reward runs."""
    second_reference = section.loss.ref_policy_kl_penalty > 0 and not (lora and inputs.get("ref_model") == inputs.get("model"))
    return int(second_reference) + int("reward_model" in inputs)


def work(stage, count: Count) -> list[Work]:
    """Per step, num_prompts_per_step x num_generations_per_prompt samples of max_new_tokens (an
    upper bound: EOS stops a completion earlier), each generated (one forward: KV-cached), scored
    by the reward model where there is one, through the reference and, with several optimizer
    steps per batch, the old policy (one forward each), and trained on once (as
    `alignflow.job.stages.grpo` counts a step). Dynamic sampling's extra rounds are not counted."""
    s, loss = stage.section, stage.section.loss
    steps = s.trainer.max_steps if s.trainer.max_steps > 0 else None
    forwards = (
        1 + (loss.ref_policy_kl_penalty > 0 and loss.kl_type != "none") + (s.num_optimizer_steps_per_batch > 1) + ("reward_model" in stage.inputs)
    )
    passes = (TRAINING_PASSES if s.finetuning_type == "all_weights" else LORA_TRAINING) + FORWARD * forwards
    samples = s.num_prompts_per_step * s.num_generations_per_prompt
    return [Work("prompts", "train", None if steps is None else samples, passes, s.max_new_tokens, s.generation_batch_size, steps or 1)]


KIND = StageKind(
    schema=schema.GRPOConfig,
    output="model",
    inputs={"data": one("prep"), "model": one("model"), "ref_model": one("model"), "reward_model": optional("reward_model")},
    resumable=True,
    headline=("reward_first_tenth", "reward_last_tenth", "accuracy", "steps"),
    reads=("model",),
    context=TRAINING,
    imports=("environment.*.name",),
    checks=checks,
    batch_problems=grpo_batch_problems,
    rows=rows,
    frozen_models=frozen_models,
    work=work,
)
