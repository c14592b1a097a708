"""Views of a composed config: a stage's slice, its identity, and secret-free copies.

Secrets are config values taken from the environment (`${oc.env:VAR}`) or held under a
secret-looking key (api_key, password, token, secret). They are masked wherever a config
is printed, saved or logged, and never leave the orchestrator: a job receives the
unresolved `${oc.env:...}` text and resolves it from its own environment.
"""

import dataclasses
import re
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

MASK = "***"
_SECRET_KEY = re.compile(r"(?:^|_)(api_?key|password|passwd|secret|token|credentials?)(?:$|_)", re.IGNORECASE)
_ENV = re.compile(r"\$\{oc\.env:")


def stage_paths(stage: str, reads: tuple[str, ...]) -> tuple[str, ...]:
    """The stage's own section plus the paths it declares it reads."""
    return (stage, *reads)


def identity(cfg: DictConfig, paths: tuple[str, ...]) -> dict:
    """The resolved slice minus fields the schema marks `identity=False` and minus secrets."""
    return {path: _identity_node(OmegaConf.select(cfg, path)) for path in paths}


def _identity_node(node: Any) -> Any:
    if isinstance(node, DictConfig):
        skip = _non_identity_fields(node)
        return {k: _identity_node(node[k]) for k in node if k not in skip and not _is_secret(node, k)}
    if isinstance(node, ListConfig):
        return [_identity_node(v) for v in node]
    return node.value if isinstance(node, Enum) else node


def _non_identity_fields(node: DictConfig) -> set[str]:
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return set()
    return {f.name for f in dataclasses.fields(schema) if f.metadata.get("identity") is False}


def _is_secret(node: DictConfig, key: str) -> bool:
    raw = node._get_node(key)._value() if node._get_node(key) is not None else None
    return bool(_SECRET_KEY.search(str(key))) or (isinstance(raw, str) and bool(_ENV.search(raw)))


def masked(cfg: DictConfig, paths: tuple[str, ...] | None = None) -> dict:
    """The resolved config (or its `paths`) as plain data, every secret that has a value masked."""
    return _sliced(cfg, paths, lambda node, key: MASK if OmegaConf.select(node, key, throw_on_missing=False) is not None else None)


def for_job(cfg: DictConfig, paths: tuple[str, ...]) -> dict:
    """The slice as plain data for a job, secrets left as their unresolved `${oc.env:...}` text."""
    return _sliced(cfg, paths, lambda node, key: node._get_node(key)._value())


def _sliced(cfg: DictConfig, paths: tuple[str, ...] | None, on_secret) -> dict:
    if paths is None:
        return _walk(cfg, on_secret)
    out: dict = {}
    for path in paths:
        parent_path, _, key = path.rpartition(".")
        parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
        value = on_secret(parent, key) if _is_secret(parent, key) else _walk(parent[key], on_secret)
        target = out
        for part in parent_path.split(".") if parent_path else []:
            target = target.setdefault(part, {})
        target[key] = value
    return out


def _walk(node: Any, on_secret) -> Any:
    if isinstance(node, DictConfig):
        return {k: on_secret(node, k) if _is_secret(node, k) else _walk(node[k], on_secret) for k in node}
    if isinstance(node, ListConfig):
        return [_walk(v, on_secret) for v in node]
    return node.value if isinstance(node, Enum) else node
