"""Leases: one run at a time produces a fingerprint, and a job stops once its run is gone.

`{root}/{stage}/_leases/{fp}.json` names its holder (a fresh token per run). The holder beats
it every `ttl/4`; each beat changes the lease's *version*: its mtime on a filesystem, its ETag
on an object store (the record carries a beat counter there). Staleness never compares two
hosts' clocks: an observer calls a lease stale once it has seen the same version for `ttl` on
its own monotonic clock. Hence a contender waits at least `ttl` before taking a lease over,
even a long-dead one.

Fencing, so a takeover never races a live job on the same staging folder:
- the holder's job watches the lease (`watch`, every `ttl/8`, on every rank) and stops,
  killing its own child processes, as soon as the lease names another holder or its version
  has not moved for `ttl/2` (its run is gone): before any contender can take it over;
- a holder that finds another owner in the lease, or no lease twice in a row, knows it lost
  it; the runner checks (`Lease.check`) right before it commits and commits nothing then.

Atomicity: on a POSIX filesystem creation is exclusive (`O_EXCL`), a beat only touches the
mtime (never rewrites the record, so a late beat cannot resurrect a lost lease) and a takeover
renames the stale file away and checks it is the one it judged stale. On S3 (s3fs) creation
is a conditional put (`If-None-Match: *`) and beats and takeovers are compare-and-swap puts
(`If-Match: <ETag>`), so exactly one writer wins. What remains best-effort: the moment
between the runner's last check and its commit (milliseconds, and only after its own beats
stopped for a whole `ttl`); on other object stores, creation and beats are write-then-verify.
"""

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger("alignflow.lease")


class LeaseLost(RuntimeError):
    """Another run took this run's lease over: its work must not be committed."""


@dataclass(frozen=True)
class Seen:
    """One read of a lease: who holds it and which beat it is at (None: no lease)."""

    owner: str | None
    version: str | None


def read(fs: fsspec.AbstractFileSystem, path: str) -> Seen:
    try:
        if _local(fs):
            with open(path, "rb") as f:
                body, version = f.read(), str(os.fstat(f.fileno()).st_mtime_ns)
        else:
            fs.invalidate_cache(path)
            body, version = fs.cat_file(path), None
            version = fs.info(path).get("ETag") or json.loads(body).get("beat")
        return Seen(json.loads(body).get("owner"), f"{version}")
    except (FileNotFoundError, ValueError):
        return Seen(None, None)


class Observer:
    """How long a lease's version has stood still, on this process's own clock."""

    def __init__(self):
        self.seen, self.since = Seen(None, None), time.monotonic()

    def still_for(self, seen: Seen) -> float:
        if seen != self.seen:
            self.seen, self.since = seen, time.monotonic()
        return time.monotonic() - self.since


class Lease:
    """A holder's side of a lease: acquire, beat, check, release."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, ttl_s: float):
        self.fs, self.path, self.ttl_s = fs, path, ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.beats, self.etag = 0, None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._observer = Observer()

    def try_acquire(self) -> bool:
        """Create the lease, or take it over once its version stood still for `ttl`."""
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        current = read(self.fs, self.path)
        if current.owner is not None:
            if self._observer.still_for(current) < self.ttl_s or not self._take_over(current):
                return False
        elif not self._create():
            return False
        self._thread = threading.Thread(target=self._beat_loop, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return True

    def holder(self) -> str:
        current = read(self.fs, self.path)
        return f"held by {current.owner}, unchanged for {self._observer.still_for(current):.0f}s on this host's clock"

    def check(self) -> None:
        """Raise LeaseLost unless this run still holds the lease (right before a commit)."""
        if self.lost.is_set() or read(self.fs, self.path).owner != self.owner:
            self.lost.set()
            raise LeaseLost(f"lease {self.path} was taken over by another run: this run's output is not committed")
        if not _local(self.fs):
            self._beat()  # a compare-and-swap: fails if anyone wrote the lease since our last beat

    def fence(self) -> dict:
        """What a job needs to watch this lease (`watch`)."""
        return {"uri": self.fs.unstrip_protocol(self.path) if not _local(self.fs) else self.path, "owner": self.owner, "ttl_s": self.ttl_s}

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.lost.is_set() and read(self.fs, self.path).owner == self.owner:
            self.fs.rm(self.path)

    # -- filesystem specifics

    def _record(self) -> bytes:
        return json.dumps({"owner": self.owner, "beat": self.beats, "host": socket.gethostname(), "pid": os.getpid()}).encode()

    def _create(self) -> bool:
        try:
            if _local(self.fs):
                with open(self.path, "xb") as f:
                    f.write(self._record())
            elif _s3(self.fs):
                self.etag = self.fs.pipe_file(self.path, self._record(), mode="create")["ETag"]
            else:  # no conditional write: write, then see who won
                if self.fs.exists(self.path):
                    return False
                self.fs.pipe_file(self.path, self._record())
                time.sleep(0.5)
                return read(self.fs, self.path).owner == self.owner
        except FileExistsError:
            return False
        return True

    def _take_over(self, stale: Seen) -> bool:
        log.info("lease %s: %s stood still for %.0fs: taking it over", self.path, stale.owner, self.ttl_s)
        if _local(self.fs):
            moved = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(self.path, moved)
            except FileNotFoundError:
                return False
            if read(self.fs, moved) != stale:  # it beat meanwhile, or another contender replaced it: give it back
                try:
                    os.link(moved, self.path)
                except FileExistsError:
                    pass
                os.remove(moved)
                return False
            os.remove(moved)
            return self._create()
        if _s3(self.fs):
            try:
                self.etag = self.fs.pipe_file(self.path, self._record(), IfMatch=stale.version)["ETag"]
            except (OSError, FileExistsError):
                return False
            return True
        self.fs.rm(self.path)
        return self._create()

    def _beat(self) -> None:
        self.beats += 1
        if _local(self.fs):
            os.utime(self.path)
        elif _s3(self.fs):
            self.etag = self.fs.pipe_file(self.path, self._record(), IfMatch=self.etag)["ETag"]
        else:
            self.fs.pipe_file(self.path, self._record())

    def _beat_loop(self) -> None:
        missing = 0
        while not self._stop.wait(self.ttl_s / 4):
            owner = read(self.fs, self.path).owner
            missing = missing + 1 if owner is None else 0
            if (owner is not None and owner != self.owner) or missing >= 2:
                self.lost.set()
                log.warning("lease %s: lost (now %s): this run will not commit", self.path, owner or "absent")
                return
            try:
                self._beat()
            except FileNotFoundError:  # a contender holds it renamed for a moment, or it is gone: judged next beat
                pass
            except OSError:  # a failed compare-and-swap: someone else wrote it
                self.lost.set()
                return


def watch(fence: dict, on_lost: Callable[[str], None]) -> threading.Thread:
    """Job side: call `on_lost(reason)` once the lease in `fence` names another holder or has
    not moved for ttl/2 (its run is gone). Runs in a daemon thread; returns it."""
    fs, path = fsspec.core.url_to_fs(fence["uri"])
    ttl, observer = fence["ttl_s"], Observer()

    def loop() -> None:
        while True:
            time.sleep(ttl / 8)
            seen = read(fs, path)
            if seen.owner is not None and seen.owner != fence["owner"]:
                return on_lost(f"the lease {fence['uri']} was taken over by {seen.owner}")
            if observer.still_for(seen) >= ttl / 2:
                return on_lost(f"the run holding lease {fence['uri']} stopped beating it {ttl / 2:.0f}s ago (it is gone)")

    thread = threading.Thread(target=loop, name="lease-watch", daemon=True)
    thread.start()
    return thread


def _local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _s3(fs: fsspec.AbstractFileSystem) -> bool:
    return "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
