"""The output store: `{root}/{stage}/{fingerprint}/` on any fsspec filesystem.

Layout per stage output:
- `{root}/{stage}/{fp}/`            the committed output; `_SUCCESS.json` inside is the commit.
- `{root}/{stage}/_staging/{fp}/`   where a job writes (and checkpoints, so a retry resumes).
- `{root}/{stage}/_leases/{fp}.json` who is producing `fp` now, with a heartbeat.

An output without a manifest does not exist. On a local filesystem the staging directory
is renamed into place with the manifest already inside (atomic); on object stores files
are copied and the manifest is written last, so readers never see a half output.
Leases are exclusive-create plus rename-to-take-over on local/POSIX filesystems (atomic);
on object stores they are write-then-verify, which is best-effort (documented limitation).
"""

import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem
from omegaconf import DictConfig, OmegaConf

MANIFEST = "_SUCCESS.json"


def store_of(cfg: DictConfig) -> "Store":
    return Store(cfg.store.root, OmegaConf.to_container(cfg.store.storage_options, resolve=True))


def options_for(uri: str, cfg: DictConfig) -> dict:
    """The store's storage options apply to every URI of the same protocol (e.g. one S3 endpoint)."""
    same = fsspec.core.split_protocol(uri)[0] == fsspec.core.split_protocol(cfg.store.root)[0]
    return OmegaConf.to_container(cfg.store.storage_options, resolve=True) if same and "://" in uri else {}


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

    def staged_files(self, stage: str, fp: str) -> list[dict]:
        root = self.staging_path(stage, fp)
        found = self.fs.find(root, detail=True) if self.fs.exists(root) else {}
        return [{"path": p[len(root) + 1 :], "size": info["size"]} for p, info in sorted(found.items())]

    def commit(self, stage: str, fp: str, manifest: dict) -> str:
        """Publish the staging directory as the output of `fp`; returns the output URI."""
        staging, output = self.staging_path(stage, fp), self.output_path(stage, fp)
        body = json.dumps(manifest, indent=2)  # insertion order: a stage lists its headline metrics first
        if isinstance(self.fs, LocalFileSystem):
            self._commit_local(staging, output, body)
        else:
            self._commit_object_store(staging, output, body)
        return self.uri(output)

    def _commit_local(self, staging: str, output: str, body: str) -> None:
        os.makedirs(staging, exist_ok=True)
        _write_atomic(f"{staging}/{MANIFEST}", body)
        replaced = f"{output}.replaced-{uuid.uuid4().hex[:8]}"
        if os.path.exists(output):  # a forced re-run: the old output stays whole until the new one is in
            os.rename(output, replaced)
        os.rename(staging, output)
        if os.path.exists(replaced):
            self.fs.rm(replaced, recursive=True)

    def _commit_object_store(self, staging: str, output: str, body: str) -> None:
        fs = self.fs
        if fs.exists(output):  # uncommit first, so no reader sees old files with a new manifest
            if fs.exists(f"{output}/{MANIFEST}"):
                fs.rm(f"{output}/{MANIFEST}")
            fs.rm(output, recursive=True)
        files = fs.find(staging)
        fs.copy(files, [f"{output}/{path[len(staging) + 1 :]}" for path in files])  # server-side, concurrently
        fs.pipe(f"{output}/{MANIFEST}", body.encode())
        fs.rm(staging, recursive=True)

    @contextmanager
    def lease(
        self, stage: str, fp: str, ttl_s: float, poll_s: float, log: Callable[[str], None], take_committed: bool = True
    ) -> Iterator[bool]:
        """Hold the right to produce `fp`. Yields False when it is committed (by another run)
        before the lease is ours; the caller re-checks after acquiring, as a commit can land
        between the check and the acquisition. A forced re-run passes take_committed=False."""
        lease = _Lease(self.fs, f"{self._root_path}/{stage}/_leases/{fp}.json", ttl_s)
        while True:
            if take_committed and self.read_manifest(stage, fp) is not None:
                yield False
                return
            if lease.try_acquire():
                break
            log(f"{stage} {fp}: another run holds the lease ({lease.holder()}); waiting")
            time.sleep(poll_s)
        try:
            yield True
        finally:
            lease.release()


def _write_atomic(path: str, body: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Lease:
    """A lease file with a heartbeat thread; stale after `ttl_s` without a beat."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, ttl_s: float):
        self.fs, self.path, self.ttl_s = fs, path, ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({"owner": self.owner, "heartbeat": time.time()}).encode()

    def _read(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except (FileNotFoundError, ValueError):
            return None

    def holder(self) -> str:
        current = self._read() or {}
        age = time.time() - current.get("heartbeat", time.time())
        return f"owner {current.get('owner', '?')}, last heartbeat {age:.0f}s ago"

    def try_acquire(self) -> bool:
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        current = self._read()
        if current is not None and time.time() - current["heartbeat"] < self.ttl_s:
            return False
        if current is not None and not self._remove_stale(current):
            return False
        if not self._create_exclusive():
            return False
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()
        return True

    def _remove_stale(self, seen: dict) -> bool:
        """Take a dead holder's lease away; exactly one contender wins on POSIX."""
        if not isinstance(self.fs, LocalFileSystem):
            self.fs.rm(self.path)
            return True
        moved = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return False
        with open(moved, "rb") as f:
            taken = f.read()
        if json.loads(taken or b"{}") != seen:  # another contender had already renewed it: give it back
            try:
                os.link(moved, self.path)
            except FileExistsError:
                pass
            os.remove(moved)
            return False
        return True

    def _create_exclusive(self) -> bool:
        if isinstance(self.fs, LocalFileSystem):
            try:
                with open(self.path, "xb") as f:
                    f.write(self._record())
            except FileExistsError:
                return False
            return True
        if self.fs.exists(self.path):
            return False
        self.fs.pipe(self.path, self._record())
        time.sleep(0.5)  # let a concurrent writer land, then see who won
        return (self._read() or {}).get("owner") == self.owner

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            if (self._read() or {}).get("owner") != self.owner:
                return
            self.fs.pipe(self.path, self._record())

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if (self._read() or {}).get("owner") == self.owner:
            self.fs.rm(self.path)
        if isinstance(self.fs, LocalFileSystem):
            for stale in self.fs.glob(f"{self.path}.stale-*"):
                self.fs.rm(stale)
