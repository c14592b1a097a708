"""Hugging Face Hub ids as model sources, resolved from the local HF cache and never downloaded.

`model.source=Qwen/Qwen3-8B` (likewise `model.tokenizer`, `model.hf_config`, at the root or in
a pipeline instance's `model:`) names the snapshot that `hf download Qwen/Qwen3-8B` put in the
cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub; read by
huggingface_hub when it is imported). Compose replaces the id by that snapshot's folder, so the
stages, the fingerprints (a snapshot folder is one commit) and `align config` see a path; every
node must see the same cache, as it sees `launcher.folder`. An id not in the cache is refused at
compose with the id and the cache folder: alignflow runs where there may be no network, and a
download belongs to the user. `Owner/name@revision` picks a branch, tag or commit the cache has.
"""

import os
import re

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError
from omegaconf import DictConfig, OmegaConf

# huggingface_hub's repo id rule (`validate_repo_id`): owner/name of letters, digits, - _ . ;
# a path that exists is a path, whatever it looks like.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@(?P<revision>[\w./-]+))?")
KEYS = ("source", "tokenizer", "hf_config")


def is_hub_id(value: object) -> bool:
    return isinstance(value, str) and bool(HUB_ID.fullmatch(value)) and not os.path.exists(value) and ".." not in value


def local_snapshot(hub_id: str) -> str:
    """The cached snapshot folder of `hub_id` (owner/name[@revision]); LookupError saying where it looked."""
    repo, revision = HUB_ID.fullmatch(hub_id).group("repo", "revision")
    try:
        return snapshot_download(repo, revision=revision, local_files_only=True)
    except IncompleteSnapshotError as err:
        raise LookupError(f"{hub_id}: {err}") from None
    except LocalEntryNotFoundError:
        download = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
        raise LookupError(
            f"{hub_id} is not in the local Hugging Face cache {constants.HF_HUB_CACHE} (HF_HUB_CACHE / HF_HOME); "
            f"alignflow never downloads: run `{download}` into this cache where there is network, or give a "
            "local folder"
        ) from None


def resolve_hub_ids(cfg: DictConfig) -> list[str]:
    """Replace every hub id under `model` (root and pipeline instances) by its cached snapshot
    folder, in place, before validation; the problems of ids not in the cache, by key."""
    problems, missing = [], set()
    for key, node in _model_nodes(cfg):
        for name in KEYS:
            value = OmegaConf.select(node, name, default=None, throw_on_missing=False)
            if not is_hub_id(value) or value in missing:  # model.tokenizer is model.source unless set
                continue
            try:
                node[name] = local_snapshot(value)
            except LookupError as err:
                missing.add(value)
                problems.append(f"{key}.{name}: {err}")
    return problems


def _model_nodes(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    nodes = [("model", cfg.model)]
    for name, entry in (cfg.pipeline.stages or {}).items():
        if isinstance(entry, DictConfig) and isinstance(entry.get("model"), DictConfig):
            nodes.append((f"pipeline.stages.{name}.model", entry.model))
    return nodes
