"""Bad input, tried as a new user would: found before any job where it can be, named by key,
file or line in the user's terms, nothing written, nothing that existed lost or changed, and
never retried (a StageFailed).

`CASES` is the table: each row is what a user types (`align run ...`, with files set up
first), and the words the error must say. Each row also checks that `align run` exits 2
before Prefect starts, that neither the store nor the launcher folder was created, and that
every file that existed before (the user's, the demo's) is byte for byte the same.
"""

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from alignflow.orchestrator.config.compose import ConfigError, compose
from alignflow.orchestrator.launch import StageFailed
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import run_stage
from flows.cli import main


def refused(base_overrides, *overrides, pipeline="sft_dpo") -> str:
    with pytest.raises(ConfigError) as err:
        compose(pipeline, [*base_overrides, *overrides])
    return str(err.value)


def test_a_key_under_a_section_the_pipeline_leaves_null_says_what_to_do(base_overrides):
    message = refused(base_overrides, "data.preference.train=/data/pairs.jsonl", pipeline="sft_grpo")
    assert message.startswith("data.preference.train: data.preference is null in this config (the pipeline does not use it)")
    assert "'data.preference={train: /data/pairs.jsonl}'" in message


def test_a_misspelled_pipeline_is_named_with_the_likely_one(base_overrides):
    message = refused(base_overrides, pipeline="sftdpo")
    assert message.startswith("pipeline=sftdpo: there is no such pipeline; did you mean 'pipeline=sft_dpo'?") and "iterative_dpo" in message


def test_an_enum_error_keeps_its_choices_on_the_console(base_overrides, capsys):
    assert main(["plan", *base_overrides, "data.sft.format=chat"]) == 2
    assert "expected one of [auto, messages, prompt_completion, input_output" in capsys.readouterr().out


def test_a_format_of_another_kind_of_data_fails_at_compose(base_overrides):
    assert "data.sft.format: preference is not a sft format; use auto or one of messages, prompt_completion, input_output" in refused(
        base_overrides, "data.sft.format=preference"
    )


def test_an_object_store_without_credentials_fails_at_compose(base_overrides, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    message = refused(base_overrides, "store.root=s3://alignflow/outputs", "+store.storage_options.client_kwargs.endpoint_url=http://127.0.0.1:9")
    assert "store.root: s3://alignflow/outputs cannot be reached: NoCredentialsError" in message and "AWS_ACCESS_KEY_ID" in message


def test_slurm_without_sbatch_fails_at_compose(base_overrides, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    assert shutil.which("sbatch") is None
    assert "launcher=slurm: sbatch is not on this machine's PATH" in refused(base_overrides, "launcher=slurm")


def truncated_copy(demo_dir, tmp_path):
    source = tmp_path / "model"
    shutil.copytree(demo_dir / "tiny-llama", source)
    weights = source / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return source


@pytest.mark.slow
def test_a_job_that_fails_says_its_cause_first_and_is_not_retried(base_overrides, demo_dir, tmp_path):
    """The same truncated file behind the compose check (a file cut short after planning): the
    job fails as a StageFailed (never retried) whose first line is the short read, not as an
    infrastructure error; nothing is committed."""
    source = truncated_copy(demo_dir, tmp_path)
    cfg = compose("convert", [*base_overrides, f"model.source={source}", f"model.tokenizer={demo_dir / 'tokenizer'}"], check_paths=False)
    with pytest.raises(StageFailed) as err:
        run_stage(Pipeline.build(cfg)["convert"], {}, log=lambda line: None)
    first = str(err.value).splitlines()[0]
    assert f"{source}/model.safetensors: short read of" in first
    assert not list((tmp_path / "store" / "convert").glob("*/_SUCCESS.json"))


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    """`align run ARGS` after `setup(W, D)` (W: the test's folder, D: the demo assets) must exit 2
    with every string of `says` in its error (`{W}` and `{D}` filled in)."""

    args: tuple[str, ...]
    says: tuple[str, ...]
    setup: Callable[[Path, Path], None] = lambda w, d: None
    env: dict = field(default_factory=dict)


def files(*paths_and_texts) -> Callable[[Path, Path], None]:
    """A set-up that writes `(path under W, text)` pairs."""

    def setup(w: Path, d: Path) -> None:
        for path, text in paths_and_texts:
            (w / path).parent.mkdir(parents=True, exist_ok=True)
            (w / path).write_text(text)

    return setup


def model_copy(change: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    """A copy of the demo model at W/model, then `change(W/model)`."""

    def setup(w: Path, d: Path) -> None:
        shutil.copytree(d / "tiny-llama", w / "model")
        change(w / "model")

    return setup


def moe_with_router_logits(w: Path, d: Path) -> None:
    """The demo Qwen3-MoE at W/moe with output_router_logits on (HF then adds its load-balancing loss)."""
    shutil.copytree(d / "tiny-qwen3-moe", w / "moe")
    config = json.loads((w / "moe" / "config.json").read_text())
    (w / "moe" / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))


def truncated(model: Path) -> None:
    os.truncate(model / "model.safetensors", (model / "model.safetensors").stat().st_size // 2)


def pickled_only(model: Path) -> None:
    (model / "model.safetensors").rename(model / "pytorch_model.bin")


def config_changed(**changes) -> Callable[[Path], None]:
    """A change of the model's config.json: `changes` over its keys."""

    def change(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **changes}))

    return change


PHI3_LONGROPE = config_changed(
    architectures=["Phi3ForCausalLM"],
    model_type="phi3",
    original_max_position_embeddings=256,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
        "original_max_position_embeddings": 256,
    },
)
PHI4_MINI_LONGROPE = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "original_max_position_embeddings": 128,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0] * 6,
        "long_factor": [4.0] * 6,
        "original_max_position_embeddings": 128,
    },
}  # 12 of the demo's 16 dims per head rotate: 6 factors


def an_export_marker(files_listed: list[str]) -> Callable[[Path, Path], None]:
    return files(("prev/alignflow-export.json", json.dumps({"files": files_listed})), ("prev/config.json", "{}"))


NEW_EXPORT = "pipeline.stages.export_hf={kind: export, inputs: {model: sft}, destination: {W}/models}"
CONVERT = ("pipeline=convert", "model.tokenizer={D}/tokenizer")
RM = "pipeline.stages.rm={kind: reward_model, inputs: {data: prep, model: sft}}"
BENCH = "pipeline=sft_bench"
LM_EVAL_TASK = "task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\noutput_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{{{context}}}}'\ndoc_to_target: '{{{{completion}}}}'\n"
ERR_SECRET = "a secret must not be written in the config or an override"

CASES = {
    # export destinations: never a folder alignflow did not write, never one the pipeline reads or writes
    "destination-foreign-folder": Case(
        ("export.destination={W}/models",),
        ("export.destination: {W}/models holds files alignflow did not publish (other/)",),
        files(("models/other/sentinel", "mine")),
    ),
    "destination-foreign-file": Case(
        ("export.destination={W}/models",),
        ("export.destination: {W}/models holds files alignflow did not publish (notes.md)",),
        files(("models/notes.md", "mine")),
    ),
    "destination-untrusted-marker": Case(
        ("export.destination={W}/prev",),
        ("export.destination: {W}/prev/alignflow-export.json is not a marker alignflow wrote",),
        an_export_marker(["../victim"]),
    ),
    "destination-is-a-file": Case(("export.destination={W}/afile",), ("export.destination: {W}/afile is a file",), files(("afile", "x"))),
    "destination-in-the-store": Case(("export.destination={W}/store/published",), ("export.destination: {W}/store/published is inside store.root",)),
    "destination-holds-the-store": Case(("export.destination={W}",), ("export.destination: {W} contains store.root ({W}/store)",)),
    "destination-is-the-model": Case(("export.destination={D}/tiny-llama",), ("export.destination: {D}/tiny-llama is model.source",)),
    "destination-holds-the-data": Case(("export.destination={D}/data",), ("export.destination: {D}/data contains data.sft.train",)),
    "destination-in-the-job-folder": Case(("export.destination={W}/jobs/m",), ("export.destination: {W}/jobs/m is inside launcher.folder",)),
    "destination-of-two-exports": Case(
        ("export.destination={W}/models", NEW_EXPORT), ("export.destination: {W}/models is pipeline.stages.export_hf.destination",)
    ),
    # names: one charset wherever a name reaches a path, a shell line or an artifact key
    # a reward model is a scorer: never a policy, and its head would not train under LoRA
    "reward-model-as-a-policy": Case(
        (RM, "pipeline.stages.dpo.inputs.model=rm"),
        ("pipeline.stages.dpo.inputs.model: expects a model output; 'rm' (reward_model) gives a reward_model output",),
    ),
    "reward-model-lora": Case(
        (RM, "pipeline.stages.rm.finetuning_type=lora"), ("pipeline.stages.rm.finetuning_type: lora is not supported by reward_model",)
    ),
    "reward-model-moe-load-balancing": Case(
        (RM, "model.source={W}/moe"),
        (
            "pipeline.stages.rm: the model's config.json (model.source) sets output_router_logits=true",
            "which reward_model does not add (only sft and dpo do)",
        ),
        moe_with_router_logits,
    ),
    "instance-name-uppercase": Case(
        ("pipeline.stages.Export2={kind: export, inputs: {model: sft}}",), ("pipeline.stages.Export2: an instance name must be",)
    ),
    "instance-name-dash": Case(
        ("pipeline.stages.export-2={kind: export, inputs: {model: sft}}",), ("pipeline.stages.export-2: an instance name must be",)
    ),
    "pipeline-name-path": Case(("pipeline.name=demo/nightly",), ("pipeline.name: a pipeline name must be",)),
    "force-a-path": Case(("force=[../sft]",), ("force: '../sft' is not a stage of pipeline 'sft_dpo'",)),
    "control-character-from-env": Case(
        ("launcher.partition=${oc.env:AF_PARTITION}",),
        ("launcher.partition: contains the control character '\\n'",),
        env={"AF_PARTITION": "gpu\n#SBATCH --x"},
    ),
    # values from the environment
    "env-unset": Case(
        ("sft.trainer.max_steps=${oc.env:AF_UNSET_STEPS}",), ("Environment variable 'AF_UNSET_STEPS' not found", "sft.trainer.max_steps")
    ),
    "env-not-an-integer": Case(
        ("sft.trainer.max_steps=${oc.env:AF_STEPS}",), ("could not be converted to Integer", "sft.trainer.max_steps"), env={"AF_STEPS": "forty"}
    ),
    "env-control-character-in-a-path": Case(
        ("store.root=${oc.env:AF_STORE}",), ("store.root: contains the control character",), env={"AF_STORE": "/tmp/a\rb"}
    ),
    # secrets: from the environment only
    "secret-wandb": Case(("logging.wandb.api_key=wandb-0123456789abcdef",), (f"logging.wandb.api_key: {ERR_SECRET}", "${oc.env:WANDB_API_KEY}")),
    "secret-s3-secret": Case(("+store.storage_options.secret=wJalrXUtnFEMI",), (f"store.storage_options.secret: {ERR_SECRET}",)),
    "secret-s3-key": Case(("+store.storage_options.key=AKIAIOSFODNN7",), (f"store.storage_options.key: {ERR_SECRET}",)),
    "secret-s3-token": Case(("+store.storage_options.token=FwoGZXIvYXdz",), (f"store.storage_options.token: {ERR_SECRET}",)),
    "secret-reward-kwargs": Case(
        ("pipeline=sft_grpo", "grpo.environment=[{name: exact_match, kwargs: {api_key: judge-0123456789}}]"),
        (f"grpo.environment[0].kwargs.api_key: {ERR_SECRET}",),
    ),
    # GRPO's loss family
    "grpo-loss-type-unknown": Case(
        ("pipeline=sft_grpo", "grpo.loss.loss_type=ppo"),
        ("grpo.loss.loss_type=ppo", "Invalid value 'ppo', expected one of [grpo, bnpo, dr_grpo, dapo]"),
    ),
    "grpo-kl-type-unknown": Case(
        ("pipeline=sft_grpo", "grpo.loss.kl_type=k4"), ("grpo.loss.kl_type=k4", "Invalid value 'k4', expected one of [k1, k2, k3, none]")
    ),
    "grpo-importance-level-unknown": Case(
        ("pipeline=sft_grpo", "grpo.loss.importance_sampling_level=group"),
        ("grpo.loss.importance_sampling_level=group", "Invalid value 'group', expected one of [token, sequence]"),
    ),
    "grpo-kl-clamp-zero": Case(
        ("pipeline=sft_grpo", "grpo.loss.kl_output_clamp_value=0"), ("grpo.loss.kl_output_clamp_value: must be > 0 or null (no clamp), got 0",)
    ),
    "grpo-clip-min-one": Case(
        ("pipeline=sft_grpo", "grpo.loss.ratio_clip_min=1.0"),
        ("grpo.loss.ratio_clip_min / ratio_clip_max: the clip range [1 - min, 1 + max] needs 0 <= min < 1 and max >= 0",),
    ),
    "grpo-overlong-buffer-too-long": Case(
        ("pipeline=sft_grpo", "grpo.overlong_buffer_length=100"), ("grpo.overlong_buffer_length: must be in (0, max_new_tokens = ",)
    ),
    "grpo-overlong-penalty-negative": Case(
        ("pipeline=sft_grpo", "grpo.overlong_buffer_length=4", "grpo.overlong_buffer_penalty=-1"),
        ("grpo.overlong_buffer_penalty: must be >= 0, got -1",),
    ),
    "grpo-dynamic-sampling-no-batches": Case(
        ("pipeline=sft_grpo", "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=0"),
        ("grpo.dynamic_sampling_max_gen_batches: must be >= 1, got 0",),
    ),
    # eval's pass@k / maj@k sampling
    "eval-k-more-than-n": Case(
        ("eval.sampling.k=[1,8]",),
        ("eval.sampling.k: k = 8 is more than the 4 completions sampled per prompt (eval.sampling.n); raise n or lower k",),
    ),
    "eval-k-zero": Case(("eval.sampling.k=[0]",), ("eval.sampling.k: every k must be >= 1, got [0]",)),
    "eval-k-not-a-list": Case(("eval.sampling.k=4",), ("eval.sampling.k", "int is not a ListConfig, list or tuple")),
    "eval-greedy-samples": Case(
        ("eval.sampling.k=[1,4]", "eval.sampling.temperature=0"),
        ("eval.sampling.temperature: 0 is greedy, so the 4 completions of a prompt would be one repeated",),
    ),
    "eval-temperature-negative": Case(("eval.sampling.temperature=-1",), ("eval.sampling.temperature: must be >= 0 (0 = greedy), got -1.0",)),
    "eval-top-p-zero": Case(("eval.sampling.k=[1]", "eval.sampling.top_p=0"), ("eval.sampling.top_p: must be in (0, 1], got 0.0",)),
    "eval-n-zero": Case(("eval.sampling.n=0",), ("eval.sampling.n: must be >= 1, got 0",)),
    "grpo-dynamic-sampling-one-generation": Case(
        (
            "pipeline=sft_grpo",
            "grpo.use_dynamic_sampling=true",
            "grpo.num_generations_per_prompt=1",
            "grpo.use_rloo=false",
            "grpo.normalize_rewards=false",
        ),
        ("grpo.use_dynamic_sampling: keeps groups whose rewards differ, so it needs num_generations_per_prompt >= 2",),
    ),
    "grpo-token-level-loss-renamed": Case(
        ("pipeline=sft_grpo", "grpo.loss.token_level_loss=false"), ("Key 'token_level_loss' not in 'GRPOLossConfig'", "grpo.loss.token_level_loss")
    ),
    # a reward model as GRPO's reward
    "grpo-score-without-reward-model": Case(
        ("pipeline=sft_grpo", "grpo.environment=[{name: score}]"),
        ("grpo.environment[0].name: score needs a reward_model input (pipeline.stages.grpo.inputs.reward_model",),
    ),
    "grpo-reward-model-unused": Case(
        ("pipeline=sft_rm_grpo", "grpo.environment=[{name: exact_match}]"),
        ("pipeline.stages.grpo.inputs.reward_model: no grpo.environment entry uses it; add {name: score}",),
    ),
    "eval-reward-model-not-a-reward-model": Case(
        ("pipeline=sft_rm_grpo", "pipeline.stages.eval.inputs.reward_model=sft"),
        ("pipeline.stages.eval.inputs.reward_model: expects a reward_model output; 'sft' (sft) gives a model output",),
    ),
    # the generation engine (vLLM): its environment, what it serves, its layout and memory
    "engine-environment-missing": Case(
        ("pipeline=sft_grpo", "grpo.generation_engine=vllm", "grpo.vllm.python={W}/venv/bin/python"),
        ("grpo.vllm.python: {W}/venv/bin/python is not the interpreter of an environment with vLLM",),
    ),
    "engine-other-version": Case(
        ("pipeline=sft_grpo", "grpo.generation_engine=vllm", "grpo.vllm.version=0.31.0"),
        ("grpo.vllm.version: the stage runs vLLM 0.31.0, but", "environment has 0.32.0"),
    ),
    "engine-head-size": Case(
        ("pipeline=sft_grpo", "grpo.generation_engine=vllm", "model.source={D}/tiny-llama-student"),
        ("grpo.generation_engine: the model's head size 12 is not one vLLM's CPU attention serves ([32, 64, 80",),
    ),
    "engine-tensor-parallel-on-cpu": Case(
        ("pipeline=sft_grpo", "grpo.generation_engine=vllm", "grpo.vllm.tensor_parallel_size=2"),
        ("grpo.vllm.tensor_parallel_size: 2, but the nodes have no GPUs: the CPU engine runs at 1",),
    ),
    "engine-layout-does-not-divide-the-gpus": Case(
        ("pipeline=sft_grpo", "launcher.gpus_per_node=4", "grpo.generation_engine=vllm", "grpo.vllm.tensor_parallel_size=3"),
        ("grpo.vllm.tensor_parallel_size: 3 does not divide the node's 4 GPUs",),
    ),
    "engine-kv-cache-beyond-memory": Case(
        ("pipeline=sft_grpo", "launcher.mem_gb=2", "grpo.generation_engine=vllm", "grpo.vllm.kv_cache_gib=4"),
        ("grpo.vllm.kv_cache_gib: 4 GiB of KV cache and 0.0 GiB of weights exceed the job's 2 GiB of memory",),
    ),
    "engine-with-lora": Case(
        ("pipeline=sft_grpo", "grpo.generation_engine=vllm", "grpo.finetuning_type=lora"),
        ("grpo.generation_engine: vllm refits full weights; with finetuning_type lora use the decoder",),
    ),
    # time limits
    "timeout-zero": Case(("sft.timeout_min=0",), ("sft.timeout_min: must be > 0 minutes",)),
    "timeout-negative-prep": Case(("prep.timeout_min=-1",), ("prep.timeout_min: must be > 0 minutes",)),
    "timeout-shorter-than-checkpoints": Case(
        ("sft.timeout_min=20", "sft.checkpoint.every_n_minutes=30"),
        ("sft.checkpoint.every_n_minutes: 30 min does not fit in the job's time limit of 20 min (sft.timeout_min)",),
    ),
    "timeout-without-time-checkpoints": Case(
        ("sft.timeout_min=30", "sft.checkpoint.every_n_minutes=null"), ("sft.checkpoint.every_n_minutes: null (no checkpoints by time) does not fit",)
    ),
    "checkpoint-minutes-negative": Case(("sft.checkpoint.every_n_minutes=-5",), ("sft.checkpoint.every_n_minutes: must be > 0 or null",)),
    "timeout-not-a-number": Case(("sft.timeout_min=soon",), ("sft.timeout_min",)),
    "keep-optimizer-not-a-bool": Case(("dpo.checkpoint.keep_optimizer=sometimes",), ("dpo.checkpoint.keep_optimizer=sometimes",)),
    "instance-keep-optimizer-not-a-bool": Case(
        ("pipeline.stages.sft.checkpoint.keep_optimizer=sometimes",),
        ("pipeline.stages.sft.checkpoint.keep_optimizer: Value 'sometimes' is not a valid bool",),
    ),
    "instance-precision-unknown": Case(
        ("pipeline.stages.sft.precision=fp16",), ("pipeline.stages.sft.precision: Invalid value 'fp16', expected one of [auto, fp32, bf16]",)
    ),
    # the DPO family: no knob silently ignored
    "dpo-label-smoothing-with-sigmoid": Case(
        ("dpo.loss.label_smoothing=0.1",),
        ("dpo.loss.label_smoothing: none of ['sigmoid'] uses it (TRL 1.16 ignores it there); conservative DPO is loss_type [cdpo]",),
    ),
    "dpo-label-smoothing-with-ipo": Case(
        ("dpo.loss.loss_type=[ipo]", "dpo.loss.label_smoothing=0.1"), ("dpo.loss.label_smoothing: none of ['ipo'] uses it",)
    ),
    "dpo-label-smoothing-half": Case(
        ("dpo.loss.loss_type=[robust]", "dpo.loss.label_smoothing=0.5"), ("dpo.loss.label_smoothing: must be in [0, 0.5), got 0.5",)
    ),
    "dpo-exo-without-smoothing": Case(("dpo.loss.loss_type=[exo_pair]",), ("dpo.loss.label_smoothing: exo_pair needs it > 0",)),
    "dpo-weights-count": Case(
        ("dpo.loss.loss_type=[sigmoid,sft]", "dpo.loss.loss_weights=[1.0]"), ("dpo.loss.loss_weights: 1 weights for 2 loss types",)
    ),
    "dpo-reference-free-mixed": Case(
        ("dpo.loss.loss_type=[simpo,sigmoid]",), ("dpo.loss.loss_type: ['simpo', 'sigmoid'] mixes reference-free losses",)
    ),
    "dpo-unknown-loss-type": Case(("dpo.loss.loss_type=[dpo]",), ("Invalid value 'dpo', expected one of [sigmoid, sigmoid_norm, hinge",)),
    "dpo-discopop-tau": Case(("dpo.loss.loss_type=[discopop]", "dpo.loss.discopop_tau=0"), ("dpo.loss.discopop_tau: must be > 0, got 0",)),
    # lease and poll settings, retention
    "lease-ttl-too-short": Case(("store.lease_ttl_s=1",), ("store.lease_ttl_s: must be >= 2 s",)),
    "poll-zero": Case(("store.poll_interval_s=0",), ("store.poll_interval_s: must be > 0",)),
    "poll-longer-than-ttl": Case(
        ("store.lease_ttl_s=10", "store.poll_interval_s=30"), ("store.poll_interval_s: must be > 0 and at most store.lease_ttl_s",)
    ),
    "retention-negative": Case(("store.retention.keep_days=-1",), ("store.retention.keep_days: must be >= 0",)),
    # unreadable or hostile sources, and the rest of what a new user gets wrong
    "source-pickled-weights-only": Case(
        (*CONVERT, "model.source={W}/model"), ("model.source: {W}/model holds pickled weights only (pytorch_model.bin)",), model_copy(pickled_only)
    ),
    "source-truncated": Case(
        (*CONVERT, "model.source={W}/model"), ("model.source: {W}/model/model.safetensors is truncated",), model_copy(truncated)
    ),
    "longrope-rows-past-original-positions": Case(
        ("model.source={W}/model", "data.seq_length=512"),
        ("data.seq_length: 512 passes the model's original_max_position_embeddings=256 (model.source: longrope)",),
        model_copy(PHI3_LONGROPE),
    ),
    "longrope-phi4-mini-rows-past-original-positions": Case(
        ("model.source={W}/model", "data.seq_length=256"),
        ("data.seq_length: 256 passes the model's original_max_position_embeddings=128 (model.source: longrope)",),
        model_copy(config_changed(**PHI4_MINI_LONGROPE)),
    ),
    "source-longrope-short-factors-of-whole-heads": Case(
        (*CONVERT, "model.source={W}/model"),
        (
            "model.source: {W}/model/config.json: longrope rope_parameters.short_factor has 8 factors; the model's 12 rotary dims per head "
            "(head_dim x partial_rotary_factor 0.75) take 6",
        ),
        model_copy(config_changed(**{**PHI4_MINI_LONGROPE, "rope_parameters": {**PHI4_MINI_LONGROPE["rope_parameters"], "short_factor": [1.0] * 8}})),
    ),
    "source-partial-rotary-outside-phi3": Case(
        (*CONVERT, "model.source={W}/model"),
        (
            "model.source: {W}/model/config.json: unsupported HF config partial_rotary_factor=0.5: "
            "LlamaForCausalLM is mapped with RoPE over whole heads",
        ),
        model_copy(config_changed(partial_rotary_factor=0.5)),
    ),
    "source-classifier-of-two-labels": Case(
        (*CONVERT, "model.source={W}/model"),
        ("model.source: {W}/model/config.json: unsupported LlamaForSequenceClassification with 2 labels: a reward model has one (num_labels 1)",),
        model_copy(config_changed(architectures=["LlamaForSequenceClassification"], id2label={"0": "bad", "1": "good"})),
    ),
    "source-missing": Case((*CONVERT, "model.source={W}/nothing"), ("model.source: {W}/nothing/config.json does not exist",)),
    "source-multimodal-gemma3": Case(
        (*CONVERT, "model.source={W}/model"),
        ("model.source: {W}/model/config.json: unsupported architecture 'Gemma3ForConditionalGeneration': the multimodal Gemma 3 checkpoint",),
        model_copy(config_changed(architectures=["Gemma3ForConditionalGeneration"])),
    ),
    "lora-on-gemma-post-normed": Case(
        ("pipeline=sft_lora_dpo", "model.source={W}/model"),
        ("sft.lora.target_modules: LoRA on mlp.linear_fc2, self_attention.linear_proj is not supported for Gemma2ForCausalLM",),
        model_copy(config_changed(architectures=["Gemma2ForCausalLM"])),
    ),
    "source-bidirectional-gemma": Case(
        (*CONVERT, "model.source={W}/model"),
        ("model.source: {W}/model/config.json: unsupported HF config use_bidirectional_attention=True",),
        model_copy(config_changed(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True)),
    ),
    "tokenizer-missing": Case(("model.tokenizer={W}/nothing",), ("model.tokenizer: {W}/nothing does not exist",)),
    "data-empty-file": Case(("data.sft.train={W}/empty.jsonl",), ("data.sft.train: {W}/empty.jsonl is an empty file",), files(("empty.jsonl", ""))),
    "data-empty-folder": Case(
        ("data.sft.val={W}/folder",), ("data.sft.val: {W}/folder is a folder with no data file in it",), lambda w, d: (w / "folder").mkdir()
    ),
    "data-glob-matches-nothing": Case(("data.preference.train={W}/*.parquet",), ("data.preference.train: {W}/*.parquet matches no file",)),
    "store-not-writable": Case(("store.root=/proc/alignflow/outputs",), ("store.root: /proc/alignflow/outputs is not writable: /proc",)),
    "unknown-key": Case(("sft.optim.lrr=1e-4",), ("Key 'lrr' not in 'OptimConfig'", "sft.optim.lrr")),
    # GPUs: one per rank, and no more than the launcher gives
    "gpus-on-a-machine-without": Case(
        ("launcher.gpus_per_node=2",),
        ("launcher.gpus_per_node: 2 for the local launcher, but this machine has none (CUDA_VISIBLE_DEVICES='')",),
        env={"CUDA_VISIBLE_DEVICES": ""},
    ),
    "gpus-more-than-visible": Case(
        ("launcher.gpus_per_node=2",),
        ("launcher.gpus_per_node: 2 for the local launcher, but this machine has 1 (CUDA_VISIBLE_DEVICES='3')",),
        env={"CUDA_VISIBLE_DEVICES": "3"},
    ),
    "gpus-negative": Case(("launcher.gpus_per_node=-1",), ("launcher.gpus_per_node: must be >= 0 (0: the ranks run on the CPU), got -1",)),
    "ranks-more-than-gpus": Case(
        ("sft.resources.tasks_per_node=4",),
        (
            "sft.resources.tasks_per_node: 4 ranks per node but launcher.gpus_per_node is 2 (one GPU per rank): the "
            "job's 4 ranks = tensor (1) x pipeline (1) x context (1) x data (4) need 4 GPUs, it gets nodes (1) x 2 = 2",
        ),
        env={"CUDA_VISIBLE_DEVICES": "0,1"},
    ),
    "model-replica-more-than-gpus": Case(
        (
            "sft.parallel.tensor_model_parallel_size=2",
            "sft.parallel.pipeline_model_parallel_size=2",
            "sft.resources.tasks_per_node=4",
            "launcher.gpus_per_node=2",
        ),
        (
            "sft.parallel: tensor (2) x pipeline (2) x context (1) = 4 ranks hold one model replica, more than "
            "the 2 GPUs of sft.resources.nodes (1) x launcher.gpus_per_node (2)",
            "sft.resources.tasks_per_node: 4 ranks per node but launcher.gpus_per_node is 2",
        ),
        env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
    ),
    "slurm-ranks-more-than-gpus": Case(
        ("launcher=slurm", "launcher.partition=debug", "launcher.gpus_per_node=1", "dpo.resources.tasks_per_node=2"),
        ("dpo.resources.tasks_per_node: 2 ranks per node but launcher.gpus_per_node is 1 (one GPU per rank)",),
    ),
    # several nodes
    "nodes-on-the-local-launcher": Case(
        ("sft.resources.nodes=2",),
        (
            "sft.resources.nodes: 2 nodes need launcher=slurm; the local launcher runs every rank on this machine "
            "(set sft.resources.nodes=1 and tasks_per_node=2 for the same 2 ranks here)",
        ),
    ),
    "layout-does-not-split-over-the-nodes": Case(
        ("launcher=slurm", "launcher.partition=debug", "dpo.resources.nodes=3", "dpo.parallel.pipeline_model_parallel_size=2"),
        ("dpo.parallel: tensor (1) x pipeline (2) x context (1) = 2 does not divide the world size dpo.resources.nodes x tasks_per_node = 3",),
    ),
    # model sources from the Hugging Face cache, and what a model needs of the GPUs
    "hub-id-not-in-the-cache": Case(
        ("model.source=nobody/no-such-model", "model.tokenizer={D}/tokenizer"),
        ("model.source: nobody/no-such-model is not in the local Hugging Face cache", "hf download nobody/no-such-model"),
    ),
    "layout-does-not-fit-the-gpu": Case(
        ("launcher.gpu_memory_gib=0.001",),
        ("sft: needs an estimated", "more than launcher.gpu_memory_gib = 0.001 GiB; layout: tensor 1 x pipeline 1", "dpo: needs an estimated"),
    ),
    "gpu-memory-not-positive": Case(("launcher.gpu_memory_gib=0",), ("launcher.gpu_memory_gib: must be > 0 GiB, or null",)),
    "preset-numbers-disagree-with-the-checkpoint": Case(
        ("model.architecture={hidden_size: 128}",), ("model.architecture.hidden_size: 128, but {D}/tiny-llama/config.json says 64",)
    ),
    "preset-numbers-not-a-mapping": Case(("model.architecture=4096",), ("model.architecture: a mapping of the checkpoint's config.json keys",)),
    "tensor-parallel-does-not-divide-heads": Case(
        ("sft.parallel.tensor_model_parallel_size=3", "sft.resources.tasks_per_node=3"),
        ("sft.parallel.tensor_model_parallel_size: 3 does not divide the model's 4 attention heads",),
    ),
    "expert-parallel-on-a-dense-model": Case(
        ("sft.parallel.expert_model_parallel_size=2", "sft.resources.tasks_per_node=2"),
        ("sft.parallel.expert_model_parallel_size: 2, but the model (LlamaForCausalLM, model.source) has no experts",),
    ),
    "expert-parallel-does-not-divide-experts": Case(
        ("model=tiny_qwen3_moe", "sft.parallel.expert_model_parallel_size=3", "sft.resources.tasks_per_node=3"),
        ("sft.parallel.expert_model_parallel_size: 3 does not divide the model's 4 experts",),
    ),
    "expert-parallel-beyond-data-parallel": Case(
        (
            "model=tiny_qwen3_moe",
            "dpo.parallel.expert_model_parallel_size=2",
            "dpo.parallel.tensor_model_parallel_size=2",
            "dpo.resources.tasks_per_node=2",
        ),
        ("dpo.parallel.expert_model_parallel_size: 2 does not divide the data-parallel size 1",),
    ),
    "moe-load-balancing-loss-in-grpo": Case(
        ("pipeline=sft_grpo", "model.source={W}/moe"),
        (
            "grpo: the model's config.json (model.source) sets output_router_logits=true, so HF's training "
            "loss adds router_aux_loss_coef (0.001) x its load-balancing loss, which grpo does not add",
        ),
        moe_with_router_logits,
    ),
    "moe-load-balancing-loss-over-pipeline-stages": Case(
        ("model.source={W}/moe", "sft.parallel.pipeline_model_parallel_size=2", "sft.resources.tasks_per_node=2"),
        ("sft.parallel.pipeline_model_parallel_size: 2, but the model's config.json (model.source) sets output_router_logits=true",),
        moe_with_router_logits,
    ),
    "moe-load-balancing-loss-with-full-recompute": Case(
        ("model.source={W}/moe", "dpo.recompute_granularity=full"),
        (
            "dpo.recompute_granularity: full recomputes each layer in the backward pass, "
            "but the model's config.json (model.source) sets output_router_logits=true",
        ),
        moe_with_router_logits,
    ),
    "moe-load-balancing-loss-with-sequence-parallel": Case(
        (
            "model.source={W}/moe",
            "sft.parallel.tensor_model_parallel_size=2",
            "sft.parallel.sequence_parallel=true",
            "sft.resources.tasks_per_node=2",
        ),
        ("sft.parallel.sequence_parallel: each tensor-parallel rank routes a slice of the tokens",),
        moe_with_router_logits,
    ),
    "lora-on-experts": Case(
        ("pipeline=sft_lora_dpo", "model=tiny_qwen3_moe"),
        ("sft.lora.target_modules: ['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2'] adapts the MLP, but the model's MLPs are experts",),
    ),
    "expert-parallel-in-generation-beyond-data-parallel": Case(
        (
            "pipeline=sft_grpo",
            "model=tiny_qwen3_moe",
            "grpo.parallel.expert_model_parallel_size=2",
            "grpo.parallel.tensor_model_parallel_size=2",
            "grpo.resources.tasks_per_node=2",
        ),
        ("grpo.parallel.expert_model_parallel_size: 2 does not divide the data-parallel size 1",),
    ),
    "expert-parallel-zero": Case(
        ("model=tiny_qwen3_moe", "sft.parallel.expert_model_parallel_size=0"), ("sft.parallel.expert_model_parallel_size: must be >= 1, got 0",)
    ),
    # lm-eval benchmarks: task names and their data checked against lm-eval's task index, before any job
    "benchmark-unknown-task": Case(
        (BENCH, "benchmark.tasks=[arithmetic_demo,gsm8k_demoo]"),
        ("benchmark.tasks: gsm8k_demoo is not a task, group or tag of lm-eval 0.4.13's tasks or {D}/benchmarks",),
    ),
    "benchmark-remote-data": Case(
        (BENCH, "benchmark.include_path={W}/tasks", "benchmark.tasks=[remote_arithmetic]"),
        ("benchmark.tasks: remote_arithmetic reads hf://datasets/EleutherAI/arithmetic/data/two_digit_addition.jsonl, not a local file",),
        files(
            (
                "tasks/remote.yaml",
                LM_EVAL_TASK.format(name="remote_arithmetic", data="hf://datasets/EleutherAI/arithmetic/data/two_digit_addition.jsonl"),
            )
        ),
    ),
    "benchmark-missing-data": Case(
        (BENCH, "benchmark.include_path={W}/tasks", "benchmark.tasks=[gone]"),
        ("benchmark.tasks: gone reads /nonexistent/arithmetic.jsonl, which does not exist",),
        files(("tasks/gone.yaml", LM_EVAL_TASK.format(name="gone", data="/nonexistent/arithmetic.jsonl"))),
    ),
    "benchmark-include-path-missing": Case(
        (BENCH, "benchmark.include_path={W}/my_tasks"), ("benchmark.include_path: {W}/my_tasks is not a local folder of lm-eval task YAMLs",)
    ),
    "benchmark-no-task": Case((BENCH, "benchmark.tasks=[]"), ("benchmark.tasks: name at least one lm-eval task",)),
    "benchmark-multiturn-without-chat-template": Case(
        (BENCH, "benchmark.apply_chat_template=false", "benchmark.fewshot_as_multiturn=true"),
        ("benchmark.fewshot_as_multiturn: few-shot examples as chat turns need benchmark.apply_chat_template: true",),
    ),
    # the nightly gate
    "gate-threshold-on-no-stage": Case(
        ("+gate.thresholds={evl.dpo.accuracy: 0.02}",), ("gate.thresholds.evl.dpo.accuracy: names no stage of pipeline 'sft_dpo'",)
    ),
    "gate-negative-threshold": Case(
        ("+gate.thresholds={eval.dpo.accuracy: -0.02}",), ("gate.thresholds.eval.dpo.accuracy: the largest tolerated drop must be >= 0, got -0.02",)
    ),
    "gate-negative-sigmas": Case(("gate.sigmas=-1",), ("gate.sigmas: must be >= 0, got -1.0",)),
    "gate-pinned-baseline-missing": Case(
        ("+gate.thresholds={eval.dpo.accuracy: 0.02}", "gate.baseline=last-tuesday"),
        ("gate.baseline: no run 'last-tuesday' in {W}/store/_runs (recent runs: none yet)",),
    ),
}


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under `root`, a file by the sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder" for p in sorted(root.rglob("*"))}


def test_the_table_has_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_refused_by_key_and_nothing_is_written_or_lost(name, demo_dir, tmp_path, monkeypatch, capsys):
    case = CASES[name]
    work = tmp_path / "w"
    work.mkdir()
    case.setup(work, demo_dir)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    fill = lambda text: text.replace("{W}", str(work)).replace("{D}", str(demo_dir))  # noqa: E731
    before, demo = tree(work), tree(demo_dir)
    code = main(
        [
            "run",
            f"paths.demo={demo_dir}",
            f"store.root={work / 'store'}",
            f"launcher.folder={work / 'jobs'}",
            *(arg if arg.startswith("pipeline=") else fill(arg) for arg in case.args),
        ]
    )
    said = capsys.readouterr().out
    assert code == 2, said
    for words in case.says:
        assert fill(words) in said, said
    assert not (work / "store").exists() and not (work / "jobs").exists()  # nothing written
    assert tree(work) == before and tree(demo_dir) == demo  # nothing lost or changed
