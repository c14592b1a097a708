"""Where an export may publish: never over files alignflow did not write there.

A destination is absent, empty, or holds a previous export, recognised by the marker
`alignflow-export.json` that each publish writes into it, listing the files it published.
Anything else is refused at compose time (`destination_problems`) and again by the job right
before it publishes (`previous_export`); a publish deletes only the files a marker lists. A
destination equal to, inside or containing the store, the job cache, the launcher folder, a
model or data source of any instance, or another instance's destination is refused at compose
time. Local paths compare absolute with symlinks resolved; object-store URIs by protocol,
bucket and prefix (a bucket's root overlaps everything in it).

Light (fsspec, no torch): the compose-time checks and the export job share it.
"""

import json
import os
import posixpath

import fsspec
from fsspec.implementations.local import LocalFileSystem
from omegaconf import DictConfig, OmegaConf

from alignflow.orchestrator.pipeline import Pipeline, Stage
from alignflow.orchestrator.store import options_for

MARKER = "alignflow-export.json"
SHOWN_ENTRIES = 3  # foreign entries named in a refusal

# Config paths of every instance whose folders an export must never publish over or into:
# the root ones, and each instance's external sources (its kind's `sources`) and model paths.
GUARDED_ROOT = ("store.root", "store.cache_dir", "launcher.folder")
GUARDED_MODEL = ("model.source", "model.hf_config", "model.tokenizer")


class DestinationError(ValueError):
    """A destination that holds files alignflow did not publish there; the message names its key."""


def destination_key(kind: str, instance: str | None) -> str:
    """The key that sets an instance's destination, as compose and the job both name it."""
    return f"{kind}.destination" if instance in (None, kind) else f"pipeline.stages.{instance}.destination"


def open_destination(uri: str, storage_options: dict) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of `uri`; a local path absolute with its symlinks resolved, so a
    publish replaces the folder a link points to, not the link."""
    fs, path = fsspec.core.url_to_fs(uri, **storage_options)
    path = os.path.realpath(path) if isinstance(fs, LocalFileSystem) else path.rstrip("/")
    return fs, path


def previous_export(fs: fsspec.AbstractFileSystem, root: str, key: str, uri: str) -> list[str]:
    """The files of the previous export at `root` that its marker lists (the marker among
    them), [] where `root` is absent or empty; DestinationError naming `key` if it holds
    anything else."""
    fs.invalidate_cache(root)
    if not fs.exists(root):
        return []
    if not fs.isdir(root):
        raise DestinationError(f"{key}: {uri} is a file; an export publishes a folder: choose a folder's path")
    if not fs.exists(f"{root}/{MARKER}"):
        entries = fs.ls(root, detail=True)
        if not entries:
            return []
        raise DestinationError(
            f"{key}: {uri} holds files alignflow did not publish ({_shown(root, entries)}) and no {MARKER}; "
            "an export goes to an absent or empty folder, or replaces a previous export, and deletes nothing "
            "else: choose another destination or move those files away"
        )
    listed = _listed(fs, root, key, uri)
    found = {path[len(root) + 1 :]: info for path, info in fs.find(root, withdirs=True, detail=True).items() if len(path) > len(root) + 1}
    ours = {MARKER, *listed, *(parent for name in listed for parent in _parents(name))}
    foreign = [info for name, info in found.items() if name not in ours]
    if foreign:
        raise DestinationError(
            f"{key}: {uri} holds a previous export and files it did not publish ({_shown(root, foreign)}); "
            "a file added into an export folder makes it no longer alignflow's alone, so it is not replaced: "
            "move those files away or choose another destination"
        )
    return sorted(name for name, info in found.items() if info["type"] == "file" and name in {MARKER, *listed})


def _listed(fs: fsspec.AbstractFileSystem, root: str, key: str, uri: str) -> set[str]:
    """The files the marker at `root` lists: relative paths inside `root`, or DestinationError."""
    try:
        files = json.loads(fs.cat_file(f"{root}/{MARKER}"))["files"]
        if not isinstance(files, list) or not all(isinstance(name, str) and _inside(name) for name in files):
            raise ValueError(f"files: {files!r}"[:200])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DestinationError(
            f"{key}: {uri}/{MARKER} is not a marker alignflow wrote (its `files` must list relative paths: "
            f"{type(err).__name__} {err}); nothing there is replaced: move the folder's files away or choose "
            "another destination"
        ) from None
    return set(files)


def _inside(name: str) -> bool:
    return bool(name) and not name.startswith("/") and posixpath.normpath(name) == name and ".." not in name.split("/")


def _parents(name: str) -> list[str]:
    parts = name.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _shown(root: str, entries: list[dict]) -> str:
    """A few entries, a folder for all that is in it (`other/`, not `other/` and `other/sentinel`)."""
    paths = {info["name"].rstrip("/")[len(root) + 1 :]: info["type"] == "directory" for info in entries}
    tops = sorted(
        (name + "/" * is_dir for name, is_dir in paths.items() if not any(p in paths for p in _parents(name))),
        key=lambda name: (name.rstrip("/").count("/"), name),
    )
    more = len(tops) - SHOWN_ENTRIES
    return ", ".join(tops[:SHOWN_ENTRIES]) + (f" and {more} more" if more > 0 else "")


def destinations(pipeline: Pipeline) -> dict[str, str]:
    """key -> URI of every destination the pipeline publishes to."""
    return {
        destination_key(stage.kind, stage.name): stage.section.destination
        for stage in pipeline
        if "destination" in stage.section and stage.section.destination
    }


def destination_problems(pipeline: Pipeline, cfg: DictConfig, read: bool = True) -> list[str]:
    """Per destination: the guarded folders and other destinations it overlaps; else, when
    `read`, what it holds that is not a previous export."""
    guarded = {key: OmegaConf.select(cfg, key) for key in GUARDED_ROOT}
    for stage in pipeline:
        for path in (*stage.spec.sources, *GUARDED_MODEL):
            guarded.setdefault(_key(cfg, stage, path), OmegaConf.select(stage.cfg, path, default=None))
    ours, problems = destinations(pipeline), []
    for i, (key, uri) in enumerate(ours.items()):
        others = {**{k: v for k, v in guarded.items() if isinstance(v, str)}, **dict(list(ours.items())[i + 1 :])}
        overlaps = [
            f"{relation} {other_key} ({other})" for other_key, other in others.items() if (relation := _overlap(_location(uri), _location(other)))
        ]
        if overlaps:
            more = len(overlaps) - SHOWN_ENTRIES
            problems.append(
                f"{key}: {uri} {', '.join(overlaps[:SHOWN_ENTRIES])}{f' and overlaps {more} more' if more > 0 else ''}; an "
                "export needs a folder of its own, apart from the store, the launcher folder, the pipeline's sources "
                "and its other exports' destinations"
            )
        elif read:
            problems += _content_problem(key, uri, cfg)
    return problems


def _content_problem(key: str, uri: str, cfg: DictConfig) -> list[str]:
    try:
        previous_export(*open_destination(uri, options_for(uri, cfg)), key, uri)
    except DestinationError as err:
        return [str(err)]
    except Exception as err:  # noqa: BLE001 - every failure to read the destination is the same problem to the user
        return [f"{key}: {uri} cannot be read: {type(err).__name__}: {err}"]
    return []


def _key(cfg: DictConfig, stage: Stage, path: str) -> str:
    """The key that sets `path` as `stage` reads it: the root key, or the instance's own."""
    same = OmegaConf.select(stage.cfg, path, default=None) == OmegaConf.select(cfg, path, default=None)
    return path if same else f"pipeline.stages.{stage.name}.{path}"


def _location(uri: str) -> tuple[str, tuple[str, ...]]:
    """What `uri` names, to compare: a local path absolute with symlinks resolved, an object
    store's by protocol, bucket and prefix; a glob up to its first wildcard."""
    protocol, path = fsspec.core.split_protocol(uri)
    parts = path.split("/")
    path = "/".join(parts[: next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))])
    try:
        cls = fsspec.get_filesystem_class(protocol or "file")
        canonical = cls.protocol if isinstance(cls.protocol, str) else cls.protocol[0]
    except (ValueError, ImportError):
        cls, canonical = None, protocol
    if cls is not None and issubclass(cls, LocalFileSystem):
        return "file", tuple(p for p in os.path.realpath(path or ".").split("/") if p)
    return canonical, tuple(p for p in posixpath.normpath(path).split("/") if p not in ("", "."))


def _overlap(a: tuple[str, tuple[str, ...]], b: tuple[str, tuple[str, ...]]) -> str | None:
    (fs_a, a), (fs_b, b) = a, b
    if fs_a != fs_b:
        return None
    if a == b:
        return "is"
    if a[: len(b)] == b:
        return "is inside"
    if b[: len(a)] == a:
        return "contains"
    return None
