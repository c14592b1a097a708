"""Config errors fail at compose time, before any job, naming the key; secrets stay masked."""

import pytest
from omegaconf import OmegaConf

from alignflow.config.compose import ConfigError, compose
from alignflow.config.slices import MASK, for_job, identity, masked
from flows.cli import main


@pytest.mark.parametrize(
    "override, key",
    [
        ("sft.optim.lrr=1e-4", "sft.optim.lrr"),
        ("sft.trainer.max_steps=ten", "sft.trainer.max_steps"),
        ("data.truncation=keep_middle", "data.truncation"),
        ("dpo.loss.loss_type=hinge", "dpo.loss.loss_type"),
    ],
)
def test_typo_and_wrong_type_name_the_key(base_overrides, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose("sft_dpo", [*base_overrides, override])


def test_tensor_parallel_must_divide_heads(base_overrides):
    with pytest.raises(ConfigError) as err:
        compose("sft_dpo", [*base_overrides, "sft.parallel.tensor_model_parallel_size=3", "sft.resources.tasks_per_node=3", "sft.global_batch_size=36"])
    assert "sft.parallel.tensor_model_parallel_size: 3 does not divide the model's 4 attention heads" in str(err.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sft.resources.tasks_per_node=4", "sft.parallel.pipeline_model_parallel_size=3"], "does not divide the world size"),
        (["sft.resources.tasks_per_node=2", "sft.global_batch_size=6", "sft.micro_batch_size=2"], "sft.global_batch_size: 6 is not divisible"),
        (["sft.parallel.pipeline_model_parallel_size=4", "sft.resources.tasks_per_node=4"], "does not divide the model's 2 layers"),
        (["sft.parallel.sequence_parallel=true"], "sft.parallel.sequence_parallel"),
        (["data.max_prompt_length=999"], "data.max_prompt_length"),
        (["sft.optim.min_lr=1.0"], "sft.optim.min_lr"),
        (["data.sft.train=/nonexistent/x.jsonl"], "data.sft.train: /nonexistent/x.jsonl does not exist"),
        (["force=[grpo]"], "force: 'grpo' is not a stage"),
        (["sft.recompute_granularity=full", "sft.recompute_num_layers=0"], "sft.recompute_num_layers: must be >= 1"),
        (["sft.recompute_granularity=full", "sft.recompute_method=block", "sft.recompute_num_layers=3"],
         "sft.recompute_num_layers: 3 exceeds the 2 layers of a pipeline stage"),
        (["sft.parallel.overlap_param_gather=true"], "sft.parallel.overlap_param_gather: needs use_distributed_optimizer"),
    ],
)
def test_cross_field_checks(base_overrides, overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose("sft_dpo", [*base_overrides, *overrides])


def test_key_under_a_dropped_section_is_a_config_error(base_overrides):
    with pytest.raises(ConfigError, match="null"):
        compose("sft_grpo", [*base_overrides, "data.preference.train=x"])  # sft_grpo drops data.preference


def test_all_problems_reported_at_once(base_overrides):
    with pytest.raises(ConfigError) as err:
        compose("sft_dpo", [*base_overrides, "data.max_prompt_length=999", "dpo.loss.beta=0"])
    assert "data.max_prompt_length" in str(err.value) and "dpo.loss.beta" in str(err.value)


def test_min_lr_defaults_to_a_tenth_of_lr(base_overrides):
    cfg = compose("sft_dpo", [*base_overrides, "sft.optim.lr=3e-4"])
    assert cfg.sft.optim.min_lr == pytest.approx(3e-5)


def test_config_is_read_only(base_overrides):
    cfg = compose("sft_dpo", base_overrides)
    with pytest.raises(Exception):
        cfg.sft.optim.lr = 1.0


def test_pipeline_drops_unused_datasets(base_overrides):
    assert compose("sft_grpo", base_overrides).data.preference is None


def test_secret_from_env_is_masked_and_never_resolved_for_jobs(base_overrides, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "sekrit-123")
    cfg = compose("sft_dpo", base_overrides)
    assert cfg.logging.wandb.api_key == "sekrit-123"  # the running process can use it
    assert masked(cfg)["logging"]["wandb"]["api_key"] == MASK
    assert for_job(cfg, ("sft", "logging"))["logging"]["wandb"]["api_key"] == "${oc.env:WANDB_API_KEY,null}"
    assert for_job(cfg, ("logging.wandb.api_key",)) == {"logging": {"wandb": {"api_key": "${oc.env:WANDB_API_KEY,null}"}}}
    assert "sekrit" not in str(identity(cfg, ("sft", "logging")))
    assert main(["config", *base_overrides]) == 0
    assert "sekrit" not in capsys.readouterr().out


def test_any_env_interpolation_is_treated_as_secret(base_overrides, monkeypatch):
    monkeypatch.setenv("MY_BUCKET_TOKEN", "tok-999")
    cfg = compose("sft_dpo", [*base_overrides, "+store.storage_options.key=${oc.env:MY_BUCKET_TOKEN}"])
    assert "tok-999" not in OmegaConf.to_yaml(OmegaConf.create(masked(cfg)))
    assert "tok-999" not in str(for_job(cfg, ("store",)))


def test_cli_config_error_exits_2_without_submitting(base_overrides, tmp_path, capsys):
    assert main(["run", *base_overrides, "sft.optim.lrr=1"]) == 2
    assert "sft.optim.lrr" in capsys.readouterr().out
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "store").exists()


def test_unknown_reward_function_fails_at_compose(base_overrides):
    with pytest.raises(ConfigError, match=r"grpo.environment\[0\].name: reward 'exactmatch'"):
        compose("sft_grpo", [*base_overrides, "grpo.environment=[{name: exactmatch}]"])


def test_grpo_batches_must_split_over_data_parallel_ranks_and_optimizer_steps(base_overrides):
    with pytest.raises(ConfigError) as err:
        compose("sft_grpo", [*base_overrides, "grpo.resources.tasks_per_node=2", "grpo.num_prompts_per_step=3"])
    assert "grpo.num_prompts_per_step: 3 is not divisible by the data-parallel size (2)" in str(err.value)
    with pytest.raises(ConfigError, match=r"grpo.micro_batch_size: the 512 samples .* num_optimizer_steps_per_batch \(3\)"):
        compose("sft_grpo", [*base_overrides, "grpo.num_optimizer_steps_per_batch=3"])
    assert compose("sft_grpo", [*base_overrides, "grpo.num_optimizer_steps_per_batch=4"]).grpo.micro_batch_size == 128
