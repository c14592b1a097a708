"""The output store: `{root}/{stage}/{fingerprint}/` on any fsspec filesystem.

Layout per stage output:
- `{root}/{stage}/{fp}/`            the committed output; `_SUCCESS.json` inside is the commit.
- `{root}/{stage}/_staging/{fp}/`   where a job writes (and checkpoints, so a retry resumes).
- `{root}/{stage}/_leases/{fp}.json` who is producing `fp` now, with a heartbeat.
- `{root}/{stage}/_staging/{fp}/checkpoints/` a training stage's checkpoints
  (`alignflow.job.train.checkpoints`): a retry resumes from them, so the commit leaves them out
  (`Store.committed_checkpoint`), all of them, or all but the final one when its config asks to keep
  the optimizer (`checkpoint.keep_optimizer`: the manifest names it under `training_state`).

An output without a manifest does not exist, and a manifest is written only once the staged
files hold what the stage's output format declares (`alignflow.orchestrator.verify`): never for an empty
folder, a missing file or one that does not open. On a local filesystem the staging directory
is renamed into place with the manifest already inside (atomic); on object stores files
are copied and the manifest is written last, so readers never see a half output.
`{root}/{stage}/_leases/{fp}.json` is the lease of the run producing `fp` (`alignflow.orchestrator.lease`).
"""

import json
import os
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem
from omegaconf import DictConfig, OmegaConf

from alignflow.orchestrator.lease import Lease
from alignflow.orchestrator.verify import IncompleteOutput, OutputFormat, under

MANIFEST = "_SUCCESS.json"
CHECKPOINTS = "checkpoints"
COMPLETE = "complete"  # written last into a training checkpoint: one without it does not exist
TRAINING_STATE = "training_state"  # the manifest's name for the checkpoint a commit kept


def store_of(cfg: DictConfig) -> "Store":
    return Store(cfg.store.root, OmegaConf.to_container(cfg.store.storage_options, resolve=True))


def options_for(uri: str, cfg: DictConfig) -> dict:
    """The store's storage options apply to every URI of the same protocol (e.g. one S3 endpoint)."""
    same = fsspec.core.split_protocol(uri)[0] == fsspec.core.split_protocol(cfg.store.root)[0]
    return OmegaConf.to_container(cfg.store.storage_options, resolve=True) if same and "://" in uri else {}


def staging_owner(uri: str) -> tuple[str | None, str | None]:
    """(stage, fingerprint) whose staging folder `uri` is (`Store.staging_path`), else (None, None)."""
    parts = uri.rstrip("/").split("/")
    return (parts[-3], parts[-1]) if len(parts) >= 3 and parts[-2] == "_staging" else (None, None)


@dataclass(frozen=True)
class Store:
    root: str
    storage_options: dict

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.core.url_to_fs(self.root, **self.storage_options)[0]

    @property
    def _root_path(self) -> str:
        return fsspec.core.url_to_fs(self.root, **self.storage_options)[1].rstrip("/")

    def uri(self, path: str) -> str:
        """A full URI (with protocol) for a path of this store's filesystem."""
        return path if isinstance(self.fs, LocalFileSystem) else self.fs.unstrip_protocol(path)

    def path(self, *parts: str) -> str:
        """A path under the store's root, for the filesystem's calls."""
        return "/".join([self._root_path, *parts])

    def output_path(self, stage: str, fp: str) -> str:
        return f"{self._root_path}/{stage}/{fp}"

    def staging_path(self, stage: str, fp: str) -> str:
        return f"{self._root_path}/{stage}/_staging/{fp}"

    def read_manifest(self, stage: str, fp: str) -> dict | None:
        try:
            with self.fs.open(f"{self.output_path(stage, fp)}/{MANIFEST}", "r") as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def clear_staging(self, stage: str, fp: str) -> None:
        path = self.staging_path(stage, fp)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def staged_files(self, stage: str, fp: str, leave_out: tuple[str, ...] = ()) -> list[dict]:
        """The staged files (path relative to the staging folder, size), but those under `leave_out`."""
        root = self.staging_path(stage, fp)
        found = self.fs.find(root, detail=True) if self.fs.exists(root) else {}
        listed = [{"path": p[len(root) + 1 :], "size": info["size"]} for p, info in sorted(found.items())]
        return [f for f in listed if not under(f["path"], leave_out)]

    def committed_checkpoint(self, stage: str, fp: str, keep_latest: bool) -> tuple[str | None, tuple[str, ...]]:
        """What the commit of `fp`'s staged output does with its training checkpoints: the latest
        complete one it keeps with `keep_latest` (else None; IncompleteOutput if there is none),
        and the paths it leaves out: `checkpoints/` whole, or everything in it but the kept one."""
        paths = {f["path"] for f in self.staged_files(stage, fp)}
        entries = sorted({p.split("/")[1] for p in paths if p.startswith(f"{CHECKPOINTS}/")})
        complete = [e for e in entries if f"{CHECKPOINTS}/{e}/{COMPLETE}" in paths]  # step-%08d: in step order
        if keep_latest and not complete:
            raise IncompleteOutput(
                f"{stage} {fp}: not committed: its checkpoint.keep_optimizer asks to keep its final training "
                f"checkpoint, but none is complete at {self.uri(self.staging_path(stage, fp))}/{CHECKPOINTS}"
            )
        if not entries:
            return None, ()
        if not keep_latest:
            return None, (CHECKPOINTS,)
        return f"{CHECKPOINTS}/{complete[-1]}", tuple(f"{CHECKPOINTS}/{e}" for e in entries if e != complete[-1])

    def commit(self, stage: str, fp: str, manifest: dict, holds: OutputFormat, leave_out: tuple[str, ...] = ()) -> str:
        """Publish the staging directory, but the paths `leave_out` (relative to it), as the output
        of `fp` once what is published `holds` its format (else IncompleteOutput, and nothing is
        written); returns the output URI."""
        staging, output = self.staging_path(stage, fp), self.output_path(stage, fp)
        self.fs.invalidate_cache(staging)  # the job wrote it from another process
        staged = self.staged_files(stage, fp, leave_out)
        problems = holds.problems(self.fs, staging, leave_out) if staged else ["the folder is empty or absent"]
        if problems:
            raise IncompleteOutput(f"{stage} {fp}: not committed: the output staged at {self.uri(staging)} is incomplete: " + "; ".join(problems))
        body = json.dumps(manifest, indent=2)  # insertion order: a stage lists its headline metrics first
        if isinstance(self.fs, LocalFileSystem):
            self._commit_local(staging, output, body, leave_out)
        else:
            self._commit_object_store(staging, output, body, [f["path"] for f in staged])
        return self.uri(output)

    def _commit_local(self, staging: str, output: str, body: str, leave_out: tuple[str, ...]) -> None:
        _fsync_tree(staging, leave_out)  # the data is on disk before the manifest that vouches for it
        _write_atomic(f"{staging}/{MANIFEST}", body)
        replaced = f"{output}.replaced-{uuid.uuid4().hex[:8]}"
        if os.path.exists(output):  # a forced re-run: the old output stays whole until the new one is in
            os.rename(output, replaced)
        os.rename(staging, output)
        fsync(os.path.dirname(output))
        if os.path.exists(replaced):
            self.fs.rm(replaced, recursive=True)
        for path in leave_out:  # after the rename: until then a retry may still resume from them
            self.fs.rm(f"{output}/{path}", recursive=True)

    def _commit_object_store(self, staging: str, output: str, body: str, files: list[str]) -> None:
        fs = self.fs
        if fs.exists(output):  # uncommit first, so no reader sees old files with a new manifest
            if fs.exists(f"{output}/{MANIFEST}"):
                fs.rm(f"{output}/{MANIFEST}")
            fs.rm(output, recursive=True)
        fs.copy([f"{staging}/{path}" for path in files], [f"{output}/{path}" for path in files])  # server-side, concurrently
        fs.pipe(f"{output}/{MANIFEST}", body.encode())
        fs.rm(staging, recursive=True)

    def uncommit(self, stage: str, fp: str) -> None:
        """Delete an output: its manifest first, so no reader ever sees half of it."""
        output = self.output_path(stage, fp)
        self.fs.rm_file(f"{output}/{MANIFEST}")
        self.fs.rm(output, recursive=True)

    def drop_checkpoints(self, stage: str, fp: str) -> None:
        """Delete a committed output's `checkpoints/`, its manifest first rewritten (atomically)
        without them and with a `reclaimed` record, so its file list stays true."""
        manifest = self.read_manifest(stage, fp)
        if manifest is None:  # uncommitted meanwhile
            return
        gone = [f for f in manifest.get("files", []) if f["path"].startswith(f"{CHECKPOINTS}/")]
        manifest["files"] = [f for f in manifest.get("files", []) if f not in gone]
        manifest.setdefault("reclaimed", {})[f"{CHECKPOINTS}/"] = {
            "files": len(gone),
            "bytes": sum(f["size"] for f in gone),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        path = f"{self.output_path(stage, fp)}/{MANIFEST}"
        if isinstance(self.fs, LocalFileSystem):
            _write_atomic(path, json.dumps(manifest, indent=2))
        else:
            self.fs.pipe(path, json.dumps(manifest, indent=2).encode())  # one PUT: atomic
        self.fs.rm(f"{self.output_path(stage, fp)}/{CHECKPOINTS}", recursive=True)

    def lease_path(self, stage: str, fp: str) -> str:
        return f"{self._root_path}/{stage}/_leases/{fp}.json"

    @contextmanager
    def lease(
        self,
        stage: str,
        fp: str,
        ttl_s: float,
        poll_s: float,
        log: Callable[[str], None],
        take_committed: bool = True,
        adopt: Callable[[dict], bool] | None = None,
    ) -> Iterator[Lease | None]:
        """Hold the right to produce `fp` (`alignflow.orchestrator.lease`). Yields None when it is committed
        (by another run) before the lease is ours; the caller re-checks after acquiring, as a
        commit can land between the check and the acquisition. A forced re-run passes
        take_committed=False. Taking over a dead run's lease, `adopt(job)` says whether to carry
        on with its job (`Lease.adopted`). The lease is released when the block ends, unless the
        block abandoned it (its job runs on, for a rerun to adopt)."""
        lease = Lease(self.fs, self.lease_path(stage, fp), ttl_s)
        while True:
            if take_committed and self.read_manifest(stage, fp) is not None:
                yield None
                return
            if lease.try_acquire(adopt):
                break
            log(f"{stage} {fp}: another run holds the lease ({lease.holder()}); waiting")
            time.sleep(poll_s)
        try:
            yield lease
        finally:
            lease.release()

    def latest_manifest(self, stage: str) -> dict | None:
        """The most recently committed manifest of `stage`, whatever its fingerprint."""
        manifests = []
        for path in self.fs.glob(f"{self._root_path}/{stage}/*/{MANIFEST}"):
            try:
                manifests.append(json.loads(self.fs.cat_file(path)))
            except (FileNotFoundError, ValueError):
                continue
        return max(manifests, key=lambda m: m.get("committed_at", ""), default=None)


def _write_atomic(path: str, body: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: str, leave_out: tuple[str, ...] = ()) -> None:
    for folder, subfolders, files in os.walk(root):
        relative = os.path.relpath(folder, root)
        subfolders[:] = [d for d in subfolders if not under(os.path.normpath(os.path.join(relative, d)), leave_out)]
        for name in files:
            if not under(os.path.normpath(os.path.join(relative, name)), leave_out):
                fsync(os.path.join(folder, name))
        fsync(folder)


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's or a folder's entries to disk (a folder: so a rename in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
