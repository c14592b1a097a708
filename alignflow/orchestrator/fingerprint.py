"""Content-addressed stage identity, and why two identities differ.

A stage's identity is a record of everything that makes its output what it is:

- `kind`: the stage kind;
- `code`: a digest per source file of the code that produces the output: the stage's worker
  module and every alignflow module it imports, transitively (found by reading the import
  statements, so nothing of alignflow is imported here), and the user code its config names
  by import path (a `module:function` reward) with the user modules that imports in turn (user
  code: neither the standard library, nor an installed package in site-packages, nor alignflow).
  A file's digest is over its AST with docstrings removed: an edited comment or docstring
  changes nothing, a changed formula re-runs the stage. The orchestrator side's modules a job
  imports (`alignflow.orchestrator`: schema, store, leases) are left out: they decide where and
  whether a job runs, not what it computes;
- `packages`: the versions of the packages that change numbers (`NUMERIC_PACKAGES`);
- `config`: the stage's config slice minus non-identity fields and secrets (`alignflow.orchestrator.config.slices`);
- `sources`: a digest of the content identity of each external source (data files, checkpoints);
- `inputs`: `{input role: upstream fingerprint (or a list of them)}`.

The fingerprint is a sha256 of its canonical JSON, which raises on anything it cannot encode
deterministically, so a new config type can never be silently dropped from identity. The
record is kept in the output's manifest, so `align plan` can say which part changed
(`differences`).
"""

import ast
import hashlib
import importlib.util
import json
import site
import sys
import sysconfig
import threading
from functools import lru_cache, partial
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable

import fsspec

from alignflow import PROJECT_ROOT

FINGERPRINT_CHARS = 16
NUMERIC_PACKAGES = ("torch", "megatron-core", "transformers", "tokenizers")
ORCHESTRATOR_MODULES = ("alignflow", "alignflow.job", "alignflow.job.stages", "alignflow.orchestrator")  # packages' faces
_ORCHESTRATOR_PACKAGES = ("alignflow.orchestrator.",)  # the orchestrator side decides where and whether a job runs, never what it computes
_HASH_CONTENT_BELOW = 64 << 20  # files smaller than this are identified by content
_SHOWN_DIFFERENCES = 6


def canonical_json(obj: Any) -> str:
    def refuse(value: Any) -> Any:
        raise TypeError(f"cannot fingerprint a value of type {type(value).__name__}: {value!r}")

    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=refuse)


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def fingerprint(identity: dict) -> str:
    return digest(identity)[:FINGERPRINT_CHARS]


# ----------------------------------------------------------------------------- code


def code_identity(module: str, imports: Iterable[str] = (), root: Path = PROJECT_ROOT) -> dict[str, str]:
    """{file: digest of its normalized source} for `module` and the alignflow modules it imports,
    transitively (orchestrator-side ones left out), and for the user modules named by `imports`
    (`module:function` import paths) and the user and alignflow modules they import. alignflow's
    files are named relative to `root`, a user's relative to the sys.path folder it is found in
    (so a copy elsewhere keeps its identity)."""
    files = _closure([module], partial(_alignflow_file, root=root))
    files |= _closure([path.partition(":")[0] for path in imports], partial(_user_file, root=root))
    return {str(path.relative_to(base)): _source_digest(path, *_stat(path)) for base, path in files.values()}


def package_versions(names: tuple[str, ...] = NUMERIC_PACKAGES) -> dict[str, str]:
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


Found = tuple[Path, Path]  # (the folder its name is relative to, the file)


def _closure(modules: list[str], find: Callable[[str], Found | None]) -> dict[str, Found]:
    """{module: where found} for `modules` and the modules they import, transitively, as far as
    `find` finds them (orchestrator-side ones left out)."""
    seen: dict[str, Found] = {}
    todo = list(modules)
    while todo:
        parts = todo.pop().split(".")
        for package in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):  # importing a.b.c runs a and a.b
            if package in seen or (found := find(package)) is None:
                continue
            seen[package] = found
            if not _orchestrator_side(package):  # what it imports is not the job's code either
                todo.extend(_imports(package, found[1]))
    return {name: found for name, found in seen.items() if not _orchestrator_side(name)}


def _orchestrator_side(name: str) -> bool:
    return name in ORCHESTRATOR_MODULES or name.startswith(_ORCHESTRATOR_PACKAGES)


def _module_file(name: str, root: Path) -> Path | None:
    base = root.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _alignflow_file(name: str, root: Path) -> Found | None:
    path = _module_file(name, root) if name.split(".")[0] == "alignflow" else None
    return None if path is None else (root, path)


def _user_file(name: str, root: Path) -> Found | None:
    """Where user module `name` is, or alignflow's (user code may import it); None for the
    standard library, installed packages and what is not found."""
    top = name.split(".")[0]
    if top == "alignflow":
        return _alignflow_file(name, root)
    base = _user_root(top)
    path = None if base is None else _module_file(name, base)
    return None if path is None else (base, path)


def _user_root(top: str) -> Path | None:
    """The sys.path folder that top-level module `top` comes from, if it is user code: not the
    standard library, not an installed package (site-packages), not built in. Finding a
    top-level module imports nothing."""
    if top in sys.stdlib_module_names:
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec (__main__)
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package (a namespace package has no origin)
        base = Path(next(iter(spec.submodule_search_locations))).parent
    elif spec.has_location:
        base = Path(spec.origin).parent
    else:
        return None
    base = base.resolve()
    return None if any(base.is_relative_to(folder) for folder in _installed_folders()) else base


@lru_cache(maxsize=1)
def _installed_folders() -> tuple[Path, ...]:
    """Where the standard library and installed packages live."""
    folders = {*site.getsitepackages(), site.getusersitepackages(), *(sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    return tuple(Path(folder).resolve() for folder in folders if folder)


def _imports(name: str, path: Path) -> set[str]:
    """Modules named by `path`'s import statements (anywhere in it), `from a import b` giving
    both a and a.b (b may be a submodule); an alignflow module's only alignflow's (what else
    it imports is an installed package, even where it lies outside site-packages)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return {m for m in found if m.split(".")[0] == "alignflow"} if name.split(".")[0] == "alignflow" else found


_PARSE_LOCK = threading.Lock()


def _parse(path: Path) -> ast.Module:
    """One parse at a time: CPython 3.11's ast.parse is not thread-safe (concurrent parses fail
    with "AST constructor recursion depth mismatch"), and the flow's stage tasks are threads."""
    with _PARSE_LOCK:
        return ast.parse(path.read_text(), str(path))


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


@lru_cache(maxsize=1024)
def _source_digest(path: Path, mtime_ns: int, size: int) -> str:
    """sha256 of the module's AST without docstrings (comments are not in the AST); the
    (mtime, size) arguments only key the cache."""
    tree = _parse(path)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()


# ----------------------------------------------------------------------------- external sources


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
        sha = hashlib.sha256()
        with fs.open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
        return "sha256:" + sha.hexdigest()
    return "ukey:" + fs.ukey(path)


# ----------------------------------------------------------------------------- explanations


def differences(current: dict, previous: dict) -> list[str]:
    """What changed from `previous` to `current` (two identity records), in a person's words."""
    found = []
    old_config, new_config = _flat(previous.get("config", {})), _flat(current.get("config", {}))
    for key in sorted(old_config.keys() | new_config.keys()):
        if old_config.get(key, "<unset>") != new_config.get(key, "<unset>"):
            found.append(f"config {key}: {_short(old_config.get(key, '<unset>'))} -> {_short(new_config.get(key, '<unset>'))}")
    old_code, new_code = previous.get("code", {}), current.get("code", {})
    for path in sorted(old_code.keys() | new_code.keys()):
        if path not in old_code:
            found.append(f"code {path}: new module")
        elif path not in new_code:
            found.append(f"code {path}: no longer used")
        elif old_code[path] != new_code[path]:
            found.append(f"code {path}: changed")
    old_packages, new_packages = previous.get("packages", {}), current.get("packages", {})
    for name in sorted(old_packages.keys() | new_packages.keys()):
        if old_packages.get(name) != new_packages.get(name):
            found.append(f"package {name}: {old_packages.get(name)} -> {new_packages.get(name)}")
    for key in ("sources", "inputs"):
        old, new = previous.get(key, {}), current.get(key, {})
        for name in sorted(old.keys() | new.keys()):
            if old.get(name) != new.get(name):
                what = "source" if key == "sources" else "input"
                found.append(f"{what} {name}: " + ("changed" if name in old and name in new else "added" if name in new else "removed"))
    if previous.get("kind") != current.get("kind"):
        found.insert(0, f"kind: {previous.get('kind')} -> {current.get('kind')}")
    if len(found) > _SHOWN_DIFFERENCES:
        found = [*found[:_SHOWN_DIFFERENCES], f"... and {len(found) - _SHOWN_DIFFERENCES} more"]
    return found


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out |= _flat(value, f"{prefix}{key}.")
        return out
    return {prefix.rstrip("."): node}


def _short(value: Any, limit: int = 48) -> str:
    """The value, its middle cut out if long: ends differ as often as starts (`env:VAR sha256:...`)."""
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit // 2 - 2] + "..." + text[-(limit // 2 - 1) :]
