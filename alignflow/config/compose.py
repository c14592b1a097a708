"""Compose and validate the Hydra config (orchestrator side: no torch).

`compose(pipeline, overrides)` is the one entry point: Hydra's compose API over `conf/`
with `AlignConfig` (`alignflow.stages`) as the typed schema, then the pipeline is built and
every cross-field rule checked (`alignflow.config.validate`). The returned config is
read-only: nothing mutates it after validation. Overrides of a pipeline's stages
(`pipeline.stages.<name>.<key>=...`) add or replace, whether or not the pipeline file sets
that key (Hydra's `++`); a misspelled key is refused by the pipeline's own checks.
"""


from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from alignflow import PROJECT_ROOT
from alignflow.config.validate import ConfigError, validate
from alignflow.stages import AlignConfig

CONF_DIR = PROJECT_ROOT / "conf"

ConfigStore.instance().store(name="align_schema", node=AlignConfig)

__all__ = ["ConfigError", "compose", "pipeline_names"]


def pipeline_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "pipeline").glob("*.yaml"))


def compose(pipeline: str | None = None, overrides: list[str] | None = None, check_paths: bool = True) -> DictConfig:
    """The validated, read-only config for `pipeline` with Hydra `overrides` applied."""
    overrides = [f"++{o}" if o.startswith("pipeline.stages.") else o for o in overrides or []]
    if pipeline:
        overrides = [f"pipeline={pipeline}", *overrides]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
        OmegaConf.to_container(cfg, resolve=True)  # surface interpolation errors now, with their key
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain(err)) from None
    except AssertionError as err:  # Hydra asserts when an override sets a key under a null section
        raise ConfigError(f"cannot apply overrides {overrides}: {err} (does one set a key under a section that is null?)") from None
    finally:
        GlobalHydra.instance().clear()
    validate(cfg, check_paths=check_paths)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _explain(err: Exception) -> str:
    """Hydra's message, which names the full key, minus its stack-trace noise."""
    msg = str(err).strip()
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in msg:
        msg = f"{msg}\n{str(cause).strip()}"
    return msg
