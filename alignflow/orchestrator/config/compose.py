"""Compose and validate the Hydra config (orchestrator side: no torch).

`build(pipeline, overrides)` is the one entry point: Hydra's compose API over `conf/` with
`AlignConfig` (`alignflow.orchestrator.kinds`) as the typed schema, then the pipeline is built and every
cross-field rule checked (`alignflow.orchestrator.config.validate`); it returns that pipeline, whose `cfg` is
the read-only root config (nothing mutates it after validation), so a run composes once and
the flow, the plan and the tasks share what was built. `compose` is its config alone. Hugging Face Hub ids under `model` are replaced
by their folders in the local HF cache first (`alignflow.orchestrator.config.hub`). Overrides of a pipeline's stages
(`pipeline.stages.<name>.<key>=...`) add or replace, whether or not the pipeline file sets
that key (Hydra's `++`); a misspelled key is refused by the pipeline's own checks.
"""

import difflib

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from alignflow import PROJECT_ROOT
from alignflow.orchestrator.config.hub import resolve_hub_ids
from alignflow.orchestrator.config.validate import ConfigError, validate
from alignflow.orchestrator.pipeline import Pipeline, name_problems
from alignflow.orchestrator.kinds import AlignConfig

CONF_DIR = PROJECT_ROOT / "conf"

ConfigStore.instance().store(name="align_schema", node=AlignConfig)

__all__ = ["ConfigError", "build", "compose", "pipeline_names"]


def pipeline_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "pipeline").glob("*.yaml"))


def compose(pipeline: str | None = None, overrides: list[str] | None = None, check_paths: bool = True) -> DictConfig:
    """The validated, read-only config for `pipeline` with Hydra `overrides` applied."""
    return build(pipeline, overrides, check_paths).cfg


def build(pipeline: str | None = None, overrides: list[str] | None = None, check_paths: bool = True) -> Pipeline:
    """The validated pipeline `pipeline` with Hydra `overrides` applied."""
    overrides = [f"++{o}" if o.startswith("pipeline.stages.") else o for o in overrides or []]
    if pipeline and (problems := name_problems(f"pipeline={pipeline}", pipeline, "a pipeline file's")):
        raise ConfigError(problems[0])  # it names the flow's artifacts
    if pipeline:
        overrides = [f"pipeline={pipeline}", *overrides]
    try:
        cfg = _hydra(overrides)
        OmegaConf.to_container(cfg, resolve=True)  # surface interpolation errors now, with their key
    except MissingConfigException as err:
        raise ConfigError(_missing_choice(err)) from None
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain(err)) from None
    except AssertionError:  # Hydra asserts when an override sets a key under a null section
        raise ConfigError(_under_null_section(overrides)) from None
    hub_problems = resolve_hub_ids(cfg)
    if hub_problems and check_paths:  # everything else reads the model: its source comes first
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {p}" for p in hub_problems))
    built = validate(cfg, check_paths=check_paths)
    OmegaConf.set_readonly(cfg, True)
    return built


def _hydra(overrides: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name="config", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def _explain(err: Exception) -> str:
    """Hydra's message, which names the full key, minus its stack-trace noise."""
    msg = str(err).strip()
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in msg:
        msg = f"{msg}\n{str(cause).strip()}"
    return msg


def _missing_choice(err: MissingConfigException) -> str:
    """A misspelled group choice (`pipeline=sftdpo`): say which and list the ones there are."""
    group, _, name = (err.missing_cfg_file or "").partition("/")
    if not err.options:
        return str(err).splitlines()[0]
    close = difflib.get_close_matches(name, err.options, n=1)
    hint = f"did you mean '{group}={close[0]}'? " if close else ""
    return f"{group}={name}: there is no such {group}; {hint}choose one of: {', '.join(err.options)}"


def _under_null_section(overrides: list[str]) -> str:
    """Which override sets a key under a section the chosen config leaves null, said plainly."""
    choices = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0].lstrip("+~")]  # group choices: pipeline=..., data=...
    base = _hydra(choices)
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        parts = key.split(".")
        for depth in range(1, len(parts)):
            section = ".".join(parts[:depth])
            if OmegaConf.select(base, section, default="<absent>") is None:
                return (
                    f"{key}: {section} is null in this config (the pipeline does not use it), so '{override}' has nothing "
                    f"to set a key in; give the whole section instead, e.g. '{section}={{{'.'.join(parts[depth:])}: "
                    f"{override.split('=', 1)[-1]}}}', or choose a pipeline that uses it"
                )
    return f"cannot apply overrides {overrides}: one sets a key under a section that is null"
