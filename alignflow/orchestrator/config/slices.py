"""Views of a composed config: a stage's slice, its identity, and secret-free copies.

Two kinds of values need care:
- secrets: the values of secret-named keys (api_key, password, secret, token, credentials, ...;
  under `store.storage_options` also key, key_id, credential, connection_string: the
  credential names of s3fs, botocore, gcsfs and adlfs), known by the key's name alone. They
  must be read from the environment (`${oc.env:VAR}`; `secret_problems` refuses one written
  out), are masked wherever a config is printed, saved or logged, stay out of identity and
  never leave the orchestrator: a job receives the unresolved `${oc.env:...}` text and
  resolves it from its own environment.
- other values read from the environment: resolved here, and a job receives the resolved
  value, so it computes with exactly what was fingerprinted (a Slurm job's environment may
  differ). Identity holds `env:VAR sha256:<digest>` of the value, not the value (manifests
  are readable by anyone with store access); printed and saved configs mask it.
"""

import dataclasses
import re
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from alignflow.orchestrator.fingerprint import FINGERPRINT_CHARS, digest

MASK = "***"
_SECRET_KEY = re.compile(r"(?:^|_)(api_?key|private_?key|password|passwd|secret|token|credentials?)(?:_access)?(?:_key|_id)?$", re.IGNORECASE)
_STORAGE_OPTIONS = "store.storage_options."
_STORAGE_SECRET_KEY = re.compile(r"(?:^|_)(key|key_id|credential|connection_string)$", re.IGNORECASE)
_S3_VARIABLES = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN"}  # s3fs option -> variable
_ENV = re.compile(r"\$\{oc\.env:([^,}]+)")
_WALK = object()  # "no special value here: walk on"


def stage_paths(stage: str, reads: tuple[str, ...]) -> tuple[str, ...]:
    """The stage's own section plus the paths it declares it reads."""
    return (stage, *reads)


def identity(cfg: DictConfig, paths: tuple[str, ...]) -> dict:
    """The resolved slice minus fields the schema marks `identity=False` and minus secrets;
    values read from the environment as `env:VAR sha256:<digest of the value>`."""
    return {path: _identity_node(OmegaConf.select(cfg, path)) for path in paths}


def _identity_node(node: Any) -> Any:
    if isinstance(node, DictConfig):
        skip = _non_identity_fields(node)
        return {k: _identity_value(node, k) for k in node if k not in skip and not _is_secret(node, k)}
    if isinstance(node, ListConfig):
        return [_identity_value(node, i) for i in range(len(node))]
    return node.value if isinstance(node, Enum) else node


def _identity_value(node: DictConfig | ListConfig, key: Any) -> Any:
    return _env_tag(node, key) if _env_names(node, key) else _identity_node(node[key])


def _env_tag(node: DictConfig | ListConfig, key: Any) -> str:
    value = node[key]
    plain = OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    plain = plain.value if isinstance(plain, Enum) else plain
    return f"env:{','.join(_env_names(node, key))} sha256:{digest(plain)[:FINGERPRINT_CHARS]}"


def _non_identity_fields(node: DictConfig) -> set[str]:
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return set()
    return {f.name for f in dataclasses.fields(schema) if f.metadata.get("identity") is False}


def _is_secret(node: DictConfig | ListConfig, key: Any) -> bool:
    """Whether `node[key]` is a secret: by the key's name, whatever its value (a list item's
    by its list's key, checked where the list is)."""
    if isinstance(node, ListConfig):
        return False
    name = str(key)
    storage_option = node._get_full_key(key).startswith(_STORAGE_OPTIONS)
    return bool(_SECRET_KEY.search(name) or storage_option and _STORAGE_SECRET_KEY.search(name))


def _env_names(node: DictConfig | ListConfig, key: Any) -> list[str]:
    """The environment variables `node[key]` is read from (`${oc.env:VAR}`), if any."""
    child = node._get_node(key)
    raw = child._value() if child is not None else None
    return _ENV.findall(raw) if isinstance(raw, str) else []


def secret_problems(cfg: DictConfig) -> list[str]:
    """Every secret written out in the config or an override (instead of `${oc.env:...}`), by key."""
    problems, todo = [], [cfg]
    while todo:
        node = todo.pop()
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            child = node._get_node(key)
            if child._is_none():
                continue
            if _is_secret(node, key):
                if not _env_names(node, key):
                    problems.append(_written_secret(node._get_full_key(key)))
            elif isinstance(child, (DictConfig, ListConfig)) and not child._is_interpolation():
                todo.append(child)
    return sorted(problems)


def _written_secret(key: str) -> str:
    parts = re.sub(r"\[\d+\]", "", key).split(".")
    if key.startswith(_STORAGE_OPTIONS):
        var = _S3_VARIABLES.get(parts[-1], parts[-1].upper())
        hint = " (or leave it out: s3fs reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from the environment itself)"
    else:
        var, hint = "_".join(parts[-2:]).upper(), ""
    return (
        f"{key}: a secret must not be written in the config or an override (Prefect stores flow parameters in plain text, and "
        f"jobs' pickles and run records keep configs); set it as ${{oc.env:{var}}}{hint}"
    )


def masked(cfg: DictConfig, paths: tuple[str, ...] | None = None) -> dict:
    """The resolved config (or its `paths`) as plain data, every secret and every value read from
    the environment masked (where it has a value)."""

    def mask(node: DictConfig, key: Any) -> Any:
        if not (_is_secret(node, key) or _env_names(node, key)):
            return _WALK
        return MASK if OmegaConf.select(node, str(key), throw_on_missing=False) is not None else None

    return _sliced(cfg, paths, mask)


def for_job(cfg: DictConfig, paths: tuple[str, ...]) -> dict:
    """The slice as plain data for a job: secrets left as their unresolved `${oc.env:...}` text
    (resolved from the job's environment), everything else resolved here."""
    return _sliced(cfg, paths, lambda node, key: node._get_node(key)._value() if _is_secret(node, key) else _WALK)


def _sliced(cfg: DictConfig, paths: tuple[str, ...] | None, special) -> dict:
    if paths is None:
        return _walk(cfg, special)
    out: dict = {}
    for path in paths:
        parent_path, _, key = path.rpartition(".")
        parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
        target = out
        for part in parent_path.split(".") if parent_path else []:
            target = target.setdefault(part, {})
        target[key] = _value(parent, key, special)
    return out


def _value(node: DictConfig, key: Any, special) -> Any:
    value = special(node, key)
    return _walk(node[key], special) if value is _WALK else value


def _walk(node: Any, special) -> Any:
    if isinstance(node, DictConfig):
        return {k: _value(node, k, special) for k in node}
    if isinstance(node, ListConfig):
        return [_value(node, i, special) for i in range(len(node))]
    return node.value if isinstance(node, Enum) else node
