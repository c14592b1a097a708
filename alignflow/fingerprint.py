"""Content-addressed stage identity.

fingerprint = sha256 of canonical JSON over: stage name, the stage's code version, its
config slice (minus non-identity fields), the content identity of its external sources,
and the fingerprints of its upstream stages. Canonical JSON raises on anything it cannot
encode deterministically, so a new config type can never be silently dropped from identity.
"""

import hashlib
import json
from typing import Any

import fsspec

FINGERPRINT_CHARS = 16
_HASH_CONTENT_BELOW = 64 << 20  # files smaller than this are identified by content


def canonical_json(obj: Any) -> str:
    def refuse(value: Any) -> Any:
        raise TypeError(f"cannot fingerprint a value of type {type(value).__name__}: {value!r}")

    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=refuse)


def fingerprint(stage: str, version: int, config: dict, sources: dict, inputs: dict) -> str:
    payload = {"stage": stage, "version": version, "config": config, "sources": sources, "inputs": inputs}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:FINGERPRINT_CHARS]


def source_identity(uri: str, storage_options: dict | None = None) -> dict:
    """What a source file, directory or glob *is*, per file: sha256 for small files,
    size + mtime (local) or ETag (object stores) for big ones, so a plan stays fast on
    multi-GB checkpoints while any edit still changes the fingerprint."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    root = path
    if any(c in path for c in "*?["):
        files = sorted(fs.glob(path))
        root = path[: min(path.find(c) for c in "*?[" if c in path)].rsplit("/", 1)[0]
    elif fs.isdir(path):
        files = sorted(fs.find(path))
    else:
        files = [path]
    if not files or not fs.exists(files[0]):
        raise FileNotFoundError(f"source {uri} does not exist")
    return {_relative(f, root): _file_identity(fs, f) for f in files}


def _relative(file: str, root: str) -> str:
    return file[len(root) :].lstrip("/") or "."


def _file_identity(fs, path: str) -> str:
    info = fs.info(path)
    if info.get("size", 0) < _HASH_CONTENT_BELOW:
        digest = hashlib.sha256()
        with fs.open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return "sha256:" + digest.hexdigest()
    return "ukey:" + fs.ukey(path)
