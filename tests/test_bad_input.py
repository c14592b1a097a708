"""Bad input, tried as a new user would: found before any job where it can be, named by key,
file or line in the user's terms, nothing committed, and never retried (a StageFailed)."""

import os
import shutil

import pytest

from alignflow.config.compose import ConfigError, compose
from alignflow.launch import StageFailed
from alignflow.pipeline import Pipeline
from alignflow.runner import run_stage
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
    assert "data.sft.format: preference is not a sft format; use auto or one of messages, prompt_completion, input_output" in \
        refused(base_overrides, "data.sft.format=preference")


def test_empty_data_files_and_folders_are_named_as_such(base_overrides, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "folder").mkdir()
    message = refused(base_overrides, f"data.sft.train={tmp_path / 'empty.jsonl'}", f"data.sft.val={tmp_path / 'folder'}",
                      f"data.preference.train={tmp_path / '*.parquet'}")
    assert f"data.sft.train: {tmp_path / 'empty.jsonl'} is an empty file" in message
    assert f"data.sft.val: {tmp_path / 'folder'} is a folder with no data file in it" in message
    assert f"data.preference.train: {tmp_path / '*.parquet'} matches no file" in message


def test_an_unwritable_store_fails_at_compose(base_overrides):
    assert "store.root: /proc/alignflow/outputs is not writable: /proc" in refused(base_overrides, "store.root=/proc/alignflow/outputs")


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


def test_a_truncated_safetensors_file_fails_at_compose(base_overrides, demo_dir, tmp_path):
    source = truncated_copy(demo_dir, tmp_path)
    message = refused(base_overrides, f"model.source={source}", f"model.tokenizer={demo_dir / 'tokenizer'}", pipeline="convert")
    assert f"model.source: {source}/model.safetensors is truncated" in message


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
