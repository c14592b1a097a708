"""What an output must hold before it is committed: the checks behind `alignflow.orchestrator.kinds.OUTPUTS`.

Each output format declares its files as data (`Need`: a glob under the output, and a check
that the file opens), and `Store.commit` runs them on the staging folder before it writes the
manifest. A stage that returned without writing what its format promises (a bug in it), or
whose files a full or failing disk cut short, is then refused, naming the file, instead of
becoming a cache hit for ever. The checks read headers, never whole files, and import no
torch: this is the orchestrator's side.
"""

import json
import struct
from dataclasses import dataclass
from typing import Callable

import fsspec

Check = Callable[[fsspec.AbstractFileSystem, str], str | None]  # (fs, path) -> why it does not open, or None


class IncompleteOutput(RuntimeError):
    """A staged output lacks a declared file or holds one that does not open: not committed.
    Not an infrastructure failure, so never retried: the stage's code ran to its end without
    writing it (a retry runs the same code), or the disk lost it (a retry writes on the same disk)."""


@dataclass(frozen=True)
class Need:
    """Files of an output: `pattern` (a glob under the output's folder) matches at least one
    (unless not `required`), and `check` passes on each match."""

    pattern: str
    check: Check
    required: bool = True


@dataclass(frozen=True)
class OutputFormat:
    """An output format: what it is (for people) and what must be in it. `one_of`: alternative
    sets of needs, one of which must hold whole (e.g. full weights, or a LoRA adapter)."""

    description: str
    needs: tuple[Need, ...] = ()
    one_of: tuple[tuple[Need, ...], ...] = ()

    def problems(self, fs: fsspec.AbstractFileSystem, root: str, leave_out: tuple[str, ...] = ()) -> list[str]:
        """Why the output at `root`, without the paths `leave_out` (relative to it: what its
        commit leaves out), is not one of this format (empty: it is), each naming a file."""
        root = root.rstrip("/")
        problems = [p for need in self.needs for p in _need_problems(fs, root, need, leave_out)]
        failed = [[p for need in variant for p in _need_problems(fs, root, need, leave_out)] for variant in self.one_of]
        if failed and all(failed):
            alternatives = " or ".join(" + ".join(need.pattern for need in variant) for variant in self.one_of)
            problems.append(f"needs {alternatives}: " + "; ".join(p for variant in failed for p in variant))
        return problems


def under(path: str, parts: tuple[str, ...]) -> bool:
    """Whether `path` is one of `parts` or inside one."""
    return any(path == part or path.startswith(f"{part}/") for part in parts)


def _need_problems(fs: fsspec.AbstractFileSystem, root: str, need: Need, leave_out: tuple[str, ...]) -> list[str]:
    matches = sorted(m for m in fs.glob(f"{root}/{need.pattern}") if not under(m[len(root) + 1 :], leave_out))
    if not matches:
        return [f"{need.pattern}: missing"] if need.required else []
    return [f"{path[len(root) + 1 :]}: {why}" for path in matches if (why := why_not(need.check, fs, path))]


def why_not(check: Check, fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """`check`'s verdict on `path`, a read error being one too."""
    try:
        return check(fs, path)
    except (OSError, ValueError) as err:
        return f"unreadable: {type(err).__name__}: {err}"


# ----------------------------------------------------------------------------- checks


def nonempty(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    if not fs.isfile(path):
        return "not a file"
    return "empty" if fs.size(path) == 0 else None


def json_file(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    try:
        json.loads(fs.cat_file(path))
    except ValueError as err:
        return f"not JSON: {err}"
    return None


def json_lines(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """A file of one JSON value per line (none: an empty file is valid)."""
    for number, line in enumerate(fs.cat_file(path).decode().splitlines(), 1):
        try:
            json.loads(line)
        except ValueError as err:
            return f"line {number} is not JSON: {err}"
    return None


def parquet(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    import pyarrow.parquet as pq  # 0.3 s of import that `align plan` does not need

    with fs.open(path, "rb") as f:
        pq.read_metadata(f)  # the footer: a cut-short file has none
    return None


def safetensors(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """The header parses and the file is as long as the header says (struct + json, no torch)."""
    with fs.open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"truncated: {len(prefix)} bytes, not even a header length"
        (size,) = struct.unpack("<Q", prefix)
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    expected = 8 + size + max((meta["data_offsets"][1] for meta in header.values()), default=0)
    actual = fs.size(path)
    return f"truncated: {actual} of the {expected} bytes its header describes" if actual < expected else None


def torch_dist(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """A Megatron torch_dist folder: DCP's `.metadata` and data files, and Megatron's metadata.json."""
    if not fs.isdir(path):
        return "not a folder"
    if not fs.exists(f"{path}/.metadata") or fs.size(f"{path}/.metadata") == 0:
        return "no .metadata (or an empty one): not a torch_dist checkpoint"
    if not fs.glob(f"{path}/*.distcp"):
        return "no *.distcp data files"
    try:
        backend = json.loads(fs.cat_file(f"{path}/metadata.json")).get("sharded_backend")
    except FileNotFoundError:
        return "no metadata.json"
    except ValueError as err:
        return f"metadata.json is not JSON: {err}"
    return None if backend == "torch_dist" else f"metadata.json names the backend {backend!r}, not torch_dist"
