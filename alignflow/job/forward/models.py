"""Input models of a job: a model stage output in a local folder (downloaded once per node
from an object store into `store.cache_dir`), its weights loaded into Megatron chunks at any
layout, and frozen chunks for the forward-only models (reference, teacher, eval).

A download's key is the URI plus a digest of the output's manifest: a committed output never
changes, and a forced re-run commits a new manifest, hence a new key. A download lands in a
temp folder renamed into place under a file lock, so a partial copy is never used and the
ranks of a node share one download.
"""

import fcntl
import hashlib
import json
import logging
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import fsspec
from omegaconf import OmegaConf

from alignflow.job.model_files import ADAPTER_DIR, HF_DIR, LORA_FILE, MODEL_DIR, TOKENIZER_DIR, ModelOutput
from alignflow.orchestrator.store import MANIFEST

log = logging.getLogger("alignflow.workspace")


def is_local(uri: str) -> bool:
    return fsspec.core.split_protocol(uri)[0] in (None, "file", "local")


def cache_dir(cfg: Any = None) -> Path:
    """`store.cache_dir`, or `alignflow-cache` in this node's temp dir."""
    configured = OmegaConf.select(cfg, "store.cache_dir", default=None) if cfg is not None else None
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "alignflow-cache"


def local_model(uri: str, cache: Path) -> ModelOutput:
    """A model stage output (`alignflow.job.model_files` layout) in a local folder: the folder
    itself on a filesystem, else its model/, hf/ and tokenizer/ downloaded once into `cache`."""
    if is_local(uri):
        return ModelOutput(uri.removeprefix("file://"))
    fs, root = fsspec.core.url_to_fs(uri)
    root = root.rstrip("/")
    dest = cache / "inputs" / cache_key(uri) / _version(fs, root)
    with _locked(dest):
        if not dest.exists():
            tmp = _fresh_tmp(dest)
            for part in (MODEL_DIR, HF_DIR, TOKENIZER_DIR, ADAPTER_DIR):
                if fs.exists(f"{root}/{part}"):
                    fs.get(f"{root}/{part}/", f"{tmp}/{part}/", recursive=True)
            if fs.exists(f"{root}/{LORA_FILE}"):  # a LoRA output: its base is fetched by its own URI when loaded
                fs.get(f"{root}/{LORA_FILE}", f"{tmp}/{LORA_FILE}")
            tmp.rename(dest)
            log.debug("downloaded %s to %s", uri, dest)
    return ModelOutput(str(dest))


def load_model_output(chunks: list, output: ModelOutput, cache: Path) -> None:
    """A model stage output's weights into plain chunks, at any layout; a LoRA output's are
    its base's (fetched like any input) with its adapter merged in. Reward-model chunks
    (`ScoreModel`) take a causal LM's trunk and keep their new head."""
    from alignflow.job.convert.families import model_shape
    from alignflow.job.model import sharded_state, lora  # megatron costs a job ~110 MB of RSS
    from alignflow.job.model.gpt import ScoreModel

    new_head = isinstance(chunks[0], ScoreModel) and not model_shape(output.hf_config).score_head

    def load(chunks: list, uri: str, select: str) -> None:
        sharded_state.load(chunks, uri, "trunk" if new_head and select == "all" else select)

    lora.load_output(chunks, output, lambda uri: local_model(uri, cache), load)


def frozen_chunks(output: ModelOutput, parallel, divisible_by: int, cache: Path, params_dtype: Any) -> list:
    """This rank's chunks of a model stage output, built at `parallel`, loaded (any layout) and
    in eval mode, in `params_dtype` (a stage's resolved `precision`): the forward-only models
    (reference, teacher, eval) all start this way."""
    from alignflow.job.model.gpt import build_gpt

    chunks = build_gpt(output.hf_config, parallel, params_dtype=params_dtype, make_vocab_size_divisible_by=divisible_by)
    load_model_output(chunks, output, cache)
    return [c.eval() for c in chunks]


def cache_key(uri: str) -> str:
    """A relative local path naming `uri`: its protocol, then its path."""
    protocol, path = fsspec.core.split_protocol(uri)
    return f"{protocol}/{path.strip('/')}"


def _version(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """A digest of what the output holds: its manifest, or the listing of an uncommitted folder."""
    try:
        identity = fs.cat_file(f"{root}/{MANIFEST}")
    except FileNotFoundError:
        listing = fs.find(root, detail=True)
        identity = json.dumps(sorted((p, i.get("size"), i.get("ETag") or i.get("mtime")) for p, i in listing.items()), default=str).encode()
    return hashlib.sha256(identity).hexdigest()[:16]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive among the processes (ranks) that share this cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _fresh_tmp(dest: Path) -> Path:
    """An empty temp folder beside `dest`; leftovers of killed downloads go (we hold the lock)."""
    for leftover in dest.parent.glob(f".tmp-{dest.name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = dest.with_name(f".tmp-{dest.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    return tmp
