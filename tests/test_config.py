"""Config errors fail at compose time, before any job, naming the key; secrets stay masked."""

import dataclasses
import hashlib
import json

import pytest
from omegaconf.errors import ReadonlyConfigError
from omegaconf import OmegaConf

from alignflow.orchestrator.config.compose import ConfigError, compose
from alignflow.orchestrator.config.slices import MASK, for_job, identity, masked
from alignflow.orchestrator.kinds import STAGES
from flows.cli import main


@pytest.mark.parametrize(
    "override, key",
    [
        ("sft.optim.lrr=1e-4", "sft.optim.lrr"),
        ("sft.trainer.max_steps=ten", "sft.trainer.max_steps"),
        ("data.truncation=keep_middle", "data.truncation"),
        ("dpo.loss.loss_type=[hindge]", "dpo.loss.loss_type"),
        ("dpo.loss.loss_type=hinge", "dpo.loss.loss_type"),  # TRL's list, not one name
    ],
)
def test_typo_and_wrong_type_name_the_key(base_overrides, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose("sft_dpo", [*base_overrides, override])


def test_tensor_parallel_must_divide_heads(base_overrides):
    with pytest.raises(ConfigError) as err:
        compose(
            "sft_dpo", [*base_overrides, "sft.parallel.tensor_model_parallel_size=3", "sft.resources.tasks_per_node=3", "sft.global_batch_size=36"]
        )
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
        (
            ["sft.recompute_granularity=full", "sft.recompute_method=block", "sft.recompute_num_layers=3"],
            "sft.recompute_num_layers: 3 exceeds the 2 layers of a pipeline stage",
        ),
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
    with pytest.raises(ReadonlyConfigError):
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


def test_a_storage_credential_from_env_is_masked_and_never_resolved_for_jobs(base_overrides, monkeypatch):
    monkeypatch.setenv("MY_BUCKET_TOKEN", "tok-999")
    cfg = compose("sft_dpo", [*base_overrides, "+store.storage_options.key=${oc.env:MY_BUCKET_TOKEN}"])  # s3fs's access key id
    assert "tok-999" not in OmegaConf.to_yaml(OmegaConf.create(masked(cfg)))
    assert "tok-999" not in str(for_job(cfg, ("store",)))


def test_other_env_values_are_resolved_for_jobs_hashed_in_identity_and_masked_when_shown(base_overrides, monkeypatch, capsys):
    """A job computes with the value the run fingerprinted, whatever its own environment holds;
    a secret (by its key's name) still travels as `${oc.env:...}` text, resolved by the job."""
    monkeypatch.setenv("STEPS", "20")
    monkeypatch.setenv("JUDGE_API_KEY", "judge-sekrit")
    overrides = [
        *base_overrides,
        "sft.trainer.max_steps=${oc.env:STEPS}",
        "grpo.environment=[{name: exact_match, kwargs: {api_key: '${oc.env:JUDGE_API_KEY}', endpoint: '${oc.env:STEPS}'}}]",
    ]
    cfg = compose("sft_grpo", overrides)
    job = for_job(cfg, ("sft", "grpo"))
    assert job["sft"]["trainer"]["max_steps"] == 20  # resolved, typed
    assert job["grpo"]["environment"][0]["kwargs"] == {"api_key": "${oc.env:JUDGE_API_KEY}", "endpoint": "20"}
    hashed = "env:STEPS sha256:" + hashlib.sha256(json.dumps(20).encode()).hexdigest()[:16]
    ident = identity(cfg, ("sft", "grpo"))
    assert ident["sft"]["trainer"]["max_steps"] == hashed and "20" not in json.dumps(ident["sft"]["trainer"])
    assert ident["grpo"]["environment"][0]["kwargs"] == {"endpoint": "env:STEPS sha256:" + hashlib.sha256(b'"20"').hexdigest()[:16]}
    assert masked(cfg, ("sft",))["sft"]["trainer"]["max_steps"] == MASK
    assert main(["config", *overrides, "pipeline=sft_grpo"]) == 0
    shown = capsys.readouterr().out
    assert "max_steps: '***'" in shown and "judge-sekrit" not in shown


@pytest.mark.parametrize(
    "pipeline, override, key, variable",
    [
        ("sft_dpo", "logging.wandb.api_key=wandb-0123456789abcdef", "logging.wandb.api_key", "WANDB_API_KEY"),
        ("sft_dpo", "+store.storage_options.secret=wJalrXUtnFEMI", "store.storage_options.secret", "AWS_SECRET_ACCESS_KEY"),
        ("sft_dpo", "+store.storage_options.key=AKIAIOSFODNN7", "store.storage_options.key", "AWS_ACCESS_KEY_ID"),
        ("sft_dpo", "+store.storage_options.token=FwoGZXIvYXdz", "store.storage_options.token", "AWS_SESSION_TOKEN"),
        (
            "sft_dpo",
            "+store.storage_options.client_kwargs.aws_secret_access_key=wJalrXUtnFEMI",
            "store.storage_options.client_kwargs.aws_secret_access_key",
            "AWS_SECRET_ACCESS_KEY",
        ),
        (
            "sft_grpo",
            "grpo.environment=[{name: exact_match, kwargs: {api_key: judge-0123456789}}]",
            "grpo.environment[0].kwargs.api_key",
            "KWARGS_API_KEY",
        ),
        (
            "sft_grpo",
            "pipeline.stages.grpo.environment=[{name: exact_match, kwargs: {password: hunter2hunter2}}]",
            "pipeline.stages.grpo.environment[0].kwargs.password",
            "KWARGS_PASSWORD",
        ),
    ],
)
def test_a_secret_written_out_is_refused_at_compose_before_anything_is_written(base_overrides, tmp_path, capsys, pipeline, override, key, variable):
    assert main(["run", f"pipeline={pipeline}", *base_overrides, override]) == 2
    out = capsys.readouterr().out
    assert f"{key}: a secret must not be written in the config or an override (Prefect stores flow parameters in plain text" in out
    assert f"set it as ${{oc.env:{variable}}}" in out
    assert override.split("=", 1)[1].split(": ")[-1].strip("}]") not in out  # the error does not show the secret
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "store").exists()


def test_a_secret_from_the_environment_or_left_null_is_accepted(base_overrides, monkeypatch):
    monkeypatch.setenv("MY_SECRET", "s")
    compose(
        "sft_dpo",
        [*base_overrides, "logging.wandb.api_key=null", "+store.storage_options.secret=${oc.env:MY_SECRET}", "+store.storage_options.anon=false"],
    )


def test_only_secret_named_keys_are_secrets(base_overrides):
    """Every setting of every stage kind is in its identity but for the fields the schema marks
    not-identity: no setting's name is mistaken for a secret's (grpo.loss.token_level_loss, now loss_type, was)."""
    cfg = compose("sft_grpo", base_overrides)
    for kind in STAGES:
        shown, hashed = _leaves(OmegaConf.to_container(cfg[kind], resolve=True)), _leaves(identity(cfg, (kind,))[kind])
        left_out = {key for key in shown if key not in hashed}
        assert all(_marked_not_identity(cfg[kind], key) for key in left_out), (kind, left_out)
    assert {"loss_type", "importance_sampling_level"} <= set(identity(cfg, ("grpo",))["grpo"]["loss"])


def _leaves(node, prefix=""):
    if isinstance(node, dict) and node:
        return {key for k, v in node.items() for key in _leaves(v, f"{prefix}{k}.")}
    return {prefix.rstrip(".")}


def _marked_not_identity(section, key):
    parent, _, name = key.rpartition(".")
    while True:
        schema = OmegaConf.get_type(OmegaConf.select(section, parent) if parent else section)
        field = next((f for f in dataclasses.fields(schema) if f.name == name), None) if dataclasses.is_dataclass(schema) else None
        if field is not None and field.metadata.get("identity") is False:
            return True
        if not parent:
            return False
        parent, _, name = parent.rpartition(".")


def test_cli_config_error_exits_2_without_submitting(base_overrides, tmp_path, capsys):
    assert main(["run", *base_overrides, "sft.optim.lrr=1"]) == 2
    assert "sft.optim.lrr" in capsys.readouterr().out
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "store").exists()


def test_unknown_reward_function_fails_at_compose(base_overrides):
    with pytest.raises(ConfigError, match=r"grpo.environment\[0\].name: reward 'exactmatch'"):
        compose("sft_grpo", [*base_overrides, "grpo.environment=[{name: exactmatch}]"])
    with pytest.raises(ConfigError, match=r"grpo.environment\[1\].name: reward 'no_such_module:boxed': cannot import it \(No module named"):
        compose("sft_grpo", [*base_overrides, "grpo.environment=[{name: exact_match}, {name: 'no_such_module:boxed'}]"])


def test_grpo_batches_must_split_over_data_parallel_ranks_and_optimizer_steps(base_overrides):
    with pytest.raises(ConfigError) as err:
        compose("sft_grpo", [*base_overrides, "grpo.resources.tasks_per_node=2", "grpo.num_prompts_per_step=3"])
    assert "grpo.num_prompts_per_step: 3 is not divisible by the data-parallel size (2)" in str(err.value)
    with pytest.raises(ConfigError, match=r"grpo.micro_batch_size: the 512 samples .* num_optimizer_steps_per_batch \(3\)"):
        compose("sft_grpo", [*base_overrides, "grpo.num_optimizer_steps_per_batch=3"])
    assert compose("sft_grpo", [*base_overrides, "grpo.num_optimizer_steps_per_batch=4"]).grpo.micro_batch_size == 128


def test_the_stages_that_generate_split_a_moes_experts_over_ep(base_overrides):
    ep2 = [f"{stage}.{key}=2" for stage in ("grpo", "eval") for key in ("parallel.expert_model_parallel_size", "resources.tasks_per_node")]
    cfg = compose("sft_grpo", [*base_overrides, "model=tiny_qwen3_moe", *ep2])
    assert cfg.grpo.parallel.expert_model_parallel_size == cfg.eval.parallel.expert_model_parallel_size == 2


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments) of every `align run|plan|config` README shows (code blocks and inline
    code; not the `$ ` lines that show an error), every `overrides=[...]` a deployment command
    passes (with that deployment's pipeline) and every deployment's own parameters."""
    import re
    import shlex

    from alignflow import PROJECT_ROOT

    deployments = OmegaConf.load(PROJECT_ROOT / "deployments" / "prefect.yaml").deployments
    pipelines = {d.name: d.parameters.pipeline for d in deployments}
    found = [(f"prefect.yaml {d.name}", [f"pipeline={d.parameters.pipeline}", *d.parameters.overrides]) for d in deployments]
    for path in (PROJECT_ROOT / "README.md", PROJECT_ROOT / "deployments" / "prefect.yaml"):
        block = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            block ^= line.startswith("```")
            where = f"{path.name}:{n}"
            commands = [line] if block and not line.startswith("$") else re.findall(r"`([^`]+)`", line)
            for command in commands:
                if m := re.search(r"\balign (?:run|plan|config) ([^#]*)", command):
                    found.append((where, [a for a in shlex.split(m.group(1)) if not a.startswith(("--", "force=", "OTHER"))]))
            if m := re.search(r"deployment run align/([\w-]+).*overrides=(\[\".*?\"\])", line):
                found.append((where, [f"pipeline={pipelines[m.group(1)]}", *json.loads(m.group(2))]))
    return found


@pytest.mark.slow
def test_every_documented_command_composes(base_overrides):
    """What README and the deployments tell users to type names keys that exist (`dpo.beta=0.2`
    once stood where `dpo.loss.beta` is)."""
    commands = documented_commands()
    assert len(commands) > 10
    for where, arguments in commands:
        if any(a.startswith("hydra.searchpath=") for a in arguments):
            continue  # a user's own config folder
        pipeline = next((a.partition("=")[2] for a in arguments if a.startswith("pipeline=")), None)
        overrides = [a for a in arguments if not a.startswith("pipeline=")]
        try:
            compose(pipeline, [*base_overrides, *overrides], check_paths=False)
        except ConfigError as err:
            pytest.fail(f"{where}: {arguments}: {err}")
