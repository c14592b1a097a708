"""Leases: one run at a time produces a fingerprint, and its job outlives the run that started it.

`{root}/{stage}/_leases/{fp}.json` names its holder (a fresh token per run, with its host, boot
and process). The holder beats it every `ttl/4`; each beat changes the lease's *version*: its
mtime on a filesystem, its ETag on an object store (the record carries a beat counter there).
Staleness never compares two hosts' clocks: an observer calls a lease stale once it has seen
the same version for `ttl` on its own monotonic clock, or at once when its holder was a process
of this very machine that no longer exists. A record that cannot be read (a crash or a full
disk between creating the file and writing it) is judged by its version like any other.

`{fp}.job.json` beside it names the job producing `fp` (launcher, id, submitit folder) and the
runs that own it: the one that submitted it and any that adopted it. A run that takes a stale
lease over may adopt the job of the dead run instead of starting another (`adopt`): it adds
itself to the job's owners *before* taking the lease, so the job never sees a stranger.

Fencing, so a takeover never races a live job on the same staging folder:
- the job checks the lease before it touches anything (`holds`) and then watches it (`watch`,
  every `ttl/8`, on every rank): it stops, killing its own child processes, once the lease is
  held by a run that does not own the job, or is gone (released: its run stopped it). It does
  *not* stop when its run stops beating: a dead orchestrator's job trains on, and a rerun
  adopts it;
- a holder that sees another owner in the lease, or a compare-and-swap beat fail, knows it
  lost it; the runner checks (`Lease.check`) right before it commits and commits nothing then.
  Errors of the store itself (a network blip, an I/O error) are retried, never taken for a loss.

Atomicity: on a POSIX filesystem creation is exclusive (`O_EXCL`), a beat only touches the
mtime (never rewrites the record, so a late beat cannot resurrect a lost lease) and a takeover
renames the stale file away and checks it is the one it judged stale. On S3 (s3fs) creation
is a conditional put (`If-None-Match: *`) and beats and takeovers are compare-and-swap puts
(`If-Match: <ETag>`), so exactly one writer wins (`alignflow.orchestrator.config.validate` probes once per
store that the endpoint honours both). What remains best-effort: the moment between the
runner's last check and its commit (milliseconds, and only after its own beats stopped for a
whole `ttl`); on other object stores, creation and beats are write-then-verify.
"""

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import fsspec
import psutil
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger("alignflow.orchestrator.lease")

UNREADABLE = "<unreadable record>"  # the owner of a lease file whose record cannot be read
JOB_SUFFIX = ".job.json"


class LeaseLost(RuntimeError):
    """Another run took this run's lease over: its work must not be committed."""


@dataclass(frozen=True)
class Seen:
    """One read of a lease: who holds it, which beat it is at (None: no lease), and where its
    holder runs (host, boot id, pid and the process's start time)."""

    owner: str | None
    version: str | None
    process: tuple | None = None


def read(fs: fsspec.AbstractFileSystem, path: str) -> Seen:
    """The lease at `path`. A missing file is no lease; other store errors are raised (transient
    ones are the caller's to retry)."""
    try:
        if _local(fs):
            with open(path, "rb") as f:
                body, version = f.read(), str(os.fstat(f.fileno()).st_mtime_ns)
        else:
            fs.invalidate_cache(path)
            body = fs.cat_file(path)
            version = fs.info(path).get("ETag") or _record(body).get("beat")
    except FileNotFoundError:
        return Seen(None, None)
    record = _record(body)
    if not isinstance(record.get("owner"), str):
        return Seen(UNREADABLE, f"{version}")
    process = tuple(record[k] for k in ("host", "boot", "pid", "started")) if "started" in record else None
    return Seen(record["owner"], f"{version}", process)


def _record(body: bytes) -> dict:
    try:
        record = json.loads(body)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def this_process() -> tuple:
    """(host, boot id, pid, start time) of this process: enough to tell, on this machine, that it is gone."""
    return (socket.gethostname(), _boot_id(), os.getpid(), psutil.Process().create_time())


@lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def holder_gone(seen: Seen) -> bool:
    """Whether the lease's holder was a process of this machine (this boot) that has ended."""
    if seen.process is None:
        return False
    host, boot, pid, started = seen.process
    if host != socket.gethostname() or boot != _boot_id() or not boot:
        return False
    try:
        return abs(psutil.Process(pid).create_time() - started) > 0.01
    except psutil.NoSuchProcess:
        return True


class Observer:
    """How long a lease's version has stood still, on this process's own clock."""

    def __init__(self):
        self.seen, self.since = Seen(None, None), time.monotonic()

    def still_for(self, seen: Seen) -> float:
        if seen != self.seen:
            self.seen, self.since = seen, time.monotonic()
        return time.monotonic() - self.since


class Lease:
    """A holder's side of a lease: acquire (maybe adopting a dead run's job), beat, record its
    job, check, release or abandon."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, ttl_s: float):
        self.fs, self.path, self.ttl_s = fs, path, ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.beats, self.etag = 0, None
        self.lost = threading.Event()
        self.adopted: dict | None = None  # the dead run's job this run took over, if any
        self.previous: dict | None = None  # the dead run's job it did not adopt (to be stopped first)
        self.abandoned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._observer = Observer()

    @property
    def job_path(self) -> str:
        return self.path.removesuffix(".json") + JOB_SUFFIX

    def try_acquire(self, adopt: Callable[[dict], bool] | None = None) -> bool:
        """Create the lease, or take it over once it is stale; `adopt(job)` decides whether to
        take over the dead run's job too (else it is in `previous`, to be stopped)."""
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        current = read(self.fs, self.path)
        if current.owner is None:
            if not self._create():
                return False
        else:
            if self._observer.still_for(current) < self.ttl_s and not holder_gone(current):
                return False
            job = self.job()
            if job is not None and adopt is not None and adopt(job["job"]):
                self._write_job({**job, "owners": [*job["owners"], self.owner]})  # before the job can see us
                self.adopted = job
            else:
                self.previous = job
            if not self._take_over(current):
                self.adopted = self.previous = None
                return False
        self._thread = threading.Thread(target=self._beat_loop, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return True

    def holder(self) -> str:
        current = read(self.fs, self.path)
        return f"held by {current.owner}, unchanged for {self._observer.still_for(current):.0f}s on this host's clock"

    def job(self) -> dict | None:
        """The job record beside the lease: {"job": {...}, "owners": [run tokens]}."""
        try:
            record = _record(self.fs.cat_file(self.job_path))
        except FileNotFoundError:
            return None
        return record if isinstance(record.get("job"), dict) and isinstance(record.get("owners"), list) else None

    def record_job(self, job: dict) -> None:
        """Name the job this run submitted, so that a rerun can adopt it if this run dies."""
        self._write_job({"job": job, "owners": [self.owner]})

    def check(self) -> None:
        """Raise LeaseLost unless this run still holds the lease (right before a commit)."""
        if self.lost.is_set() or _retried(lambda: read(self.fs, self.path), self.ttl_s).owner != self.owner:
            self.lost.set()
            raise LeaseLost(f"lease {self.path} was taken over by another run: this run's output is not committed")
        if not _local(self.fs):
            self._beat()  # a compare-and-swap: fails if anyone wrote the lease since our last beat

    def fence(self) -> dict:
        """What a job needs to check and watch this lease (`holds`, `watch`)."""
        return {"uri": self.fs.unstrip_protocol(self.path) if not _local(self.fs) else self.path, "owner": self.owner, "ttl_s": self.ttl_s}

    def release(self) -> None:
        """The job is over (committed, failed or cancelled): the lease and its job record go."""
        self._stop_beating()
        if not self.abandoned and not self.lost.is_set() and read(self.fs, self.path).owner == self.owner:
            for path in (self.job_path, self.path):
                try:
                    self.fs.rm(path)
                except FileNotFoundError:
                    pass

    def abandon(self) -> None:
        """Stop beating but leave the lease and the job record: the job runs on, and a rerun
        takes the lease over after its ttl and adopts the job."""
        self.abandoned = True
        self._stop_beating()

    # -- filesystem specifics

    def _stop_beating(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _record(self) -> bytes:
        host, boot, pid, started = this_process()
        return json.dumps({"owner": self.owner, "beat": self.beats, "host": host, "boot": boot, "pid": pid, "started": started}).encode()

    def _write_job(self, record: dict) -> None:
        body = json.dumps(record).encode()
        if _local(self.fs):
            tmp = f"{self.job_path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(body)
            os.replace(tmp, self.job_path)
        else:
            self.fs.pipe_file(self.job_path, body)

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
        why = "its holder's process is gone" if holder_gone(stale) else f"it stood still for {self.ttl_s:.0f}s"
        log.info("lease %s: taking it over from %s (%s)", self.path, stale.owner, why)
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
        missing, failing_since = 0, None
        while not self._stop.wait(self.ttl_s / 4 if failing_since is None else self.ttl_s / 16):
            try:
                owner = read(self.fs, self.path).owner
                missing = missing + 1 if owner is None else 0
                if (owner is not None and owner != self.owner) or missing >= 2:
                    return self._lose(owner or "absent")
                self._beat()
                failing_since = None
            except FileNotFoundError:  # a contender holds it renamed for a moment, or it is gone: judged next beat
                pass
            except Exception as err:  # noqa: BLE001 - any failure of the store itself is retried
                if precondition_failed(err):  # a failed compare-and-swap: someone else wrote it
                    return self._lose("rewritten by another run")
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("lease %s: the store failed a beat (%s); retrying", self.path, err)

    def _lose(self, now: str) -> None:
        self.lost.set()
        log.warning("lease %s: lost (now %s): this run will not commit", self.path, now)


def precondition_failed(err: BaseException) -> bool:
    """Whether an object store refused a conditional write (HTTP 412), as opposed to failing it."""
    return "PreconditionFailed" in repr(err.__cause__) or "pre-conditions you specified did not hold" in str(err)


_PROBED: dict[tuple, str | None] = {}


def conditional_writes_problem(fs: fsspec.AbstractFileSystem, root: str) -> str | None:
    """Why an S3 endpoint cannot hold leases, or None: a second create-if-absent of one object
    must fail (If-None-Match), and so must a write whose If-Match names another version.
    Probed once per endpoint and bucket in a process, with an object under `root` it removes."""
    bucket = root.strip("/").split("/")[0]
    key = (bucket, json.dumps(fs.storage_options, sort_keys=True, default=str))
    if key not in _PROBED:
        probe = f"{root.rstrip('/')}/.alignflow-probe-{uuid.uuid4().hex[:12]}"
        try:
            _PROBED[key] = _probe(fs, probe)
        finally:
            try:
                fs.rm(probe)
            except FileNotFoundError:
                pass
    return _PROBED[key]


def _probe(fs: fsspec.AbstractFileSystem, probe: str) -> str | None:
    fs.pipe_file(probe, b"1", mode="create")
    try:
        fs.pipe_file(probe, b"2", mode="create")
        return "it overwrote an object that a create-if-absent write (If-None-Match: *) should have left alone"
    except FileExistsError:
        pass
    try:
        fs.pipe_file(probe, b"3", IfMatch='"00000000000000000000000000000000"')
        return "it accepted a write whose If-Match named another version of the object"
    except OSError as err:
        return None if precondition_failed(err) else f"a conditional write failed otherwise: {err}"


def _retried(read_lease: Callable[[], Seen], ttl_s: float) -> Seen:
    """A read of the lease, retried over store errors for up to ttl/2."""
    deadline = time.monotonic() + ttl_s / 2
    while True:
        try:
            return read_lease()
        except Exception:  # noqa: BLE001 - s3fs raises more than OSError for a lost connection
            if time.monotonic() >= deadline:
                raise
            time.sleep(min(ttl_s / 16, 1.0))


# ----------------------------------------------------------------------------- the job's side


def _job_owners(fs: fsspec.AbstractFileSystem, path: str, job_id: str) -> list[str]:
    """The runs that own job `job_id` according to the job record beside the lease at `path`."""
    try:
        record = _record(fs.cat_file(path.removesuffix(".json") + JOB_SUFFIX))
    except FileNotFoundError:
        return []
    job = record.get("job") if isinstance(record.get("job"), dict) else {}
    return list(record.get("owners") or []) if str(job.get("job_id")) == str(job_id) else []


def holds(fence: dict, job_id: str) -> str | None:
    """None if the lease in `fence` is held by the run that submitted this job or by one that
    adopted it; else why this job must not touch anything (e.g. a queued job of a dead run
    whose lease another run took over)."""
    fs, path = fsspec.core.url_to_fs(fence["uri"])
    seen = _retried(lambda: read(fs, path), fence["ttl_s"])
    if seen.owner is None:
        return f"the lease {fence['uri']} is gone: the run that submitted this job stopped it"
    if seen.owner == fence["owner"] or seen.owner in _job_owners(fs, path, job_id):
        return None
    return f"the lease {fence['uri']} is held by {seen.owner}, which does not own job {job_id}"


def watch(fence: dict, job_id: str, on_lost: Callable[[str], None]) -> threading.Thread:
    """Job side: call `on_lost(reason)` once the lease in `fence` is gone or held by a run that
    does not own this job, seen twice in a row (a takeover renames the file away for an instant,
    and an adopter is written into the job record before it takes the lease). Store errors are
    skipped. Runs in a daemon thread; returns it."""

    def loop() -> None:
        strikes = 0
        while True:
            time.sleep(fence["ttl_s"] / 8)
            try:
                reason = holds(fence, job_id)
            except Exception:  # noqa: BLE001 - the store failing is not the lease changing hands
                continue
            strikes = strikes + 1 if reason else 0
            if strikes >= 2:
                return on_lost(reason)

    thread = threading.Thread(target=loop, name="lease-watch", daemon=True)
    thread.start()
    return thread


def _local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _s3(fs: fsspec.AbstractFileSystem) -> bool:
    return "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
