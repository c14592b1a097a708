"""Compose, validate and slice the Hydra config (orchestrator side: no torch).

`compose(pipeline, overrides)` is the one entry point: Hydra's compose API over `conf/`
with `AlignConfig` as the typed schema, then cross-field validation. The returned
config is read-only: nothing mutates it after validation.
"""


from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from alignflow import PROJECT_ROOT
from alignflow.config.schema import AlignConfig
from alignflow.config.validate import ConfigError, validate

CONF_DIR = PROJECT_ROOT / "conf"

OmegaConf.register_new_resolver("af.project", lambda: str(PROJECT_ROOT), replace=True)
OmegaConf.register_new_resolver("af.mul", lambda a, b: float(a) * float(b), replace=True)
ConfigStore.instance().store(name="align_schema", node=AlignConfig)

__all__ = ["ConfigError", "compose", "pipeline_names"]


def pipeline_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "pipeline").glob("*.yaml"))


def compose(pipeline: str | None = None, overrides: list[str] | None = None, check_paths: bool = True) -> DictConfig:
    """The validated, read-only config for `pipeline` with Hydra `overrides` applied."""
    overrides = list(overrides or [])
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
