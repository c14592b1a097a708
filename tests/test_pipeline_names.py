"""Names are checked at compose time: instance and pipeline names follow one charset (they
name store folders, jobs and Prefect artifact keys), and no config string carries a control
character to a path, an sbatch line or an artifact key. A refusal names the key and writes
nothing: no store, no launcher folder."""

import pytest
from omegaconf import OmegaConf, open_dict
from prefect.types.names import raise_on_name_alphanumeric_dashes_only

from alignflow.orchestrator.config.compose import ConfigError, compose, pipeline_names
from alignflow.orchestrator.config.validate import validate
from alignflow.orchestrator.pipeline import NAME
from flows.cli import main
from tasks.stage import _key

ARTIFACT_KINDS = ("stage", "progress", "curves", "steps", "models", "wandb")  # every `_key(kind, stage)` tasks/stage.py makes


def refused(base_overrides, *overrides, pipeline="demo") -> str:
    with pytest.raises(ConfigError) as err:
        compose(pipeline, [*base_overrides, *overrides])
    return str(err.value)


def nothing_written(tmp_path) -> bool:
    return not (tmp_path / "store").exists() and not (tmp_path / "jobs").exists()


def test_align_run_refuses_an_instance_name_prefect_cannot_key(base_overrides, tmp_path, capsys):
    """The issue's case: the stage used to run and commit, then every run failed on its artifact key."""
    assert main(["run", "pipeline=demo", *base_overrides, "pipeline.stages.Export2={kind: export, inputs: {model: sft}}"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "pipeline.stages.Export2: an instance name must be lowercase letters, digits and _, starting with a letter" in out
    assert "got 'Export2'" in out and nothing_written(tmp_path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("pipeline.stages.export-2={kind: export, inputs: {model: sft}}", "pipeline.stages.export-2: an instance name must be"),
        ("pipeline.stages._x={kind: export, inputs: {model: sft}}", "pipeline.stages._x: an instance name must be"),
        (f"pipeline.stages.{'e' * 65}={{kind: export, inputs: {{model: sft}}}}", f"pipeline.stages.{'e' * 65}: an instance name must be"),
        (
            "pipeline.name=demo/nightly",
            "pipeline.name: a pipeline name must be lowercase letters, digits and _, starting with a "
            "letter, at most 64 characters (it names store folders, jobs and Prefect artifact keys), got "
            "'demo/nightly'",
        ),
        ("pipeline.name='My Demo'", "pipeline.name: a pipeline name must be"),
        ("force=[../sft]", "force: '../sft' is not a stage of pipeline 'demo'"),
    ],
)
def test_names_outside_the_charset_are_refused_by_key(base_overrides, tmp_path, override, message):
    assert message in refused(base_overrides, override) and nothing_written(tmp_path)


def test_a_pipeline_file_name_outside_the_charset_is_refused(base_overrides, tmp_path):
    assert refused(base_overrides, pipeline="Demo-Nightly").startswith("pipeline=Demo-Nightly: a pipeline file's name must be")
    assert nothing_written(tmp_path)


@pytest.mark.parametrize(
    "override, key",
    [
        ("launcher.partition=${oc.env:AF_TEST_VALUE}", "launcher.partition"),  # would reach an sbatch line
        ("store.root=${oc.env:AF_TEST_VALUE}", "store.root"),  # a path
        ("launcher.setup=['module load cuda', '${oc.env:AF_TEST_VALUE}']", "launcher.setup[1]"),  # one entry, one shell line
        ("force=[sft, '${oc.env:AF_TEST_VALUE}']", "force[1]"),
        ("logging.wandb.project=${oc.env:AF_TEST_VALUE}", "logging.wandb.project"),
        ("pipeline.stages.prep_b={kind: prep, data: {sft: {train: '${oc.env:AF_TEST_VALUE}'}}}", "pipeline.stages.prep_b.data.sft.train"),
    ],
)
@pytest.mark.parametrize("character", ["\n", "\r", "\x1b", "\x7f"])  # an environment holds no NUL: see the literal test
def test_a_control_character_in_a_config_string_is_refused_by_key(base_overrides, tmp_path, monkeypatch, override, key, character):
    monkeypatch.setenv("AF_TEST_VALUE", f"gpu{character}#SBATCH --wrap=secret-looking-text")
    lines = [line for line in refused(base_overrides, override).splitlines() if line.startswith(f"  - {key}: ")]
    assert lines[0].startswith(f"  - {key}: contains the control character {character!r}; ")
    assert "secret-looking-text" not in lines[0]  # the value is not shown: it may be a secret
    assert nothing_written(tmp_path)


def test_a_control_character_in_a_literal_override_and_in_a_mapping_key(base_overrides, tmp_path):
    assert "  - store.root: contains the control character '\\x00'" in refused(base_overrides, "store.root='/tmp/out\x00put'")
    cfg = compose("demo", base_overrides, check_paths=False)
    OmegaConf.set_readonly(cfg, False)
    with open_dict(cfg):
        cfg.pipeline.stages["ref\nlogprobs"] = {"kind": "ref_logprobs"}  # as a pipeline YAML file can spell it
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "pipeline.stages: the key 'ref\\nlogprobs' contains a control character '\\n'" in str(err.value)
    assert "pipeline.stages.ref\\nlogprobs: an instance name must be" in str(err.value)
    assert nothing_written(tmp_path)


def test_text_for_a_model_may_span_lines(base_overrides, monkeypatch):
    template = "{% for m in messages %}\n\t{{ m['content'] }}\n{% endfor %}"
    monkeypatch.setenv("AF_TEMPLATE", template)
    assert compose("demo", [*base_overrides, "model.chat_template=${oc.env:AF_TEMPLATE}"]).model.chat_template == template


def test_every_name_the_rule_takes_makes_artifact_keys_prefect_takes(base_overrides):
    """Against Prefect's own validator (prefect.types.names): every shipped pipeline's names, and
    names at the rule's edges, give artifact keys Prefect accepts."""
    names = {"a", "a_b", "x" * 64, "dpo_round2", "sft2"}
    for pipeline in pipeline_names():
        cfg = compose(pipeline, base_overrides, check_paths=False)
        names |= {pipeline, cfg.pipeline.name, *cfg.pipeline.stages}
    for name in names:
        assert NAME.fullmatch(name), name
        for kind in ARTIFACT_KINDS:
            raise_on_name_alphanumeric_dashes_only(_key(kind, name))
    for name in ("Export2", "export.2", "étape", "a b"):
        assert not NAME.fullmatch(name)
        with pytest.raises(ValueError):
            raise_on_name_alphanumeric_dashes_only(_key("stage", name))


def test_no_two_names_share_an_artifact_key():
    """`_` becomes `-` in a key, so a name with `-` would share its key with the `_` one: refused."""
    assert _key("stage", "a_b") == _key("stage", "a-b")
    assert NAME.fullmatch("a_b") and not NAME.fullmatch("a-b")
