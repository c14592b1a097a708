"""Training jobs on an object-store store: a scratch folder per node synced with the store.

Megatron's dist_checkpointing, HF's `from_pretrained` and the atomic renames of
`alignflow.job.train.checkpoints` need a filesystem. With a local (or shared POSIX) store a job
reads its inputs and writes its output in place, as always. With an object store (`s3://`),
input models are downloaded once per node (`alignflow.job.forward.models.local_model`), and:

- Training output (`Workspace`): each node of the job trains in its own scratch folder in the
  cache (`scratch/{digest of the output}.{node}`), managed by the node's lowest rank (its
  `leader`). Every complete checkpoint is uploaded to `{out}/checkpoints/step-N/`, each node
  its own ranks' files, `complete` last (after metrics.jsonl and the wandb run id), pruned like
  the local ones. A (re)started job empties each node's scratch and downloads the store's
  latest complete checkpoint there: the store is the truth, the scratch only a copy of it. At
  the end rank 0 completes its copy of the final weights from the other nodes' files
  (`gather`) and uploads the outputs (model/, hf/, tokenizer/, metrics.jsonl, ...) beside the
  checkpoints, for the runner to commit.
- The scratch is the job's own: each node's is removed when the job ends, by success or by an
  error. A killed node cannot remove its own: the next job of the same output on that node
  empties it first. Nothing else in `store.cache_dir` is touched.

A node's scratch need not be seen by the other nodes (node-local disks, the default temp dir);
on a filesystem all nodes share, each node still keeps its own folder.
"""

import hashlib
import json
import logging
import shutil
import socket
from pathlib import Path

import fsspec
import torch.distributed as dist

from alignflow.job.forward.models import is_local
from alignflow.orchestrator.store import CHECKPOINTS, COMPLETE
from alignflow.job.train.checkpoints import WANDB_RUN_ID, pruned_steps, step_dir

log = logging.getLogger("alignflow.workspace")

METRICS = "metrics.jsonl"
SCRATCH = "scratch"  # under store.cache_dir: the training jobs' folders, one per output and node


def workspace_for(out: str, cache: Path) -> "Workspace":
    return Workspace(out) if is_local(out) else ObjectStoreWorkspace(out, cache)


class Workspace:
    """Where a training job writes: `out` itself on a filesystem, so there is nothing to sync.
    One folder for every rank: rank 0 is its leader (creates, renames and prunes in it)."""

    def __init__(self, out: str):
        self.dir = Path(out.removeprefix("file://"))
        self.leader = dist.get_rank() == 0

    def restore(self, resume: bool) -> None:
        """The leaders, before the trainer looks for checkpoints: with resume off, forget them all."""
        if not resume:
            shutil.rmtree(self.dir / CHECKPOINTS, ignore_errors=True)

    def push_checkpoint(self, path: Path, keep_top_k: int, monitor: str, mode: str) -> None:
        """Every rank, after the complete checkpoint `path` was written (and pruned) locally."""

    def gather(self, path: Path) -> None:
        """Every rank: make rank 0's copy of `path` (a folder all ranks wrote into) complete."""

    def push_outputs(self) -> None:
        """Rank 0, when the final model and metrics are in `dir` (the job's process group is gone)."""

    def close(self, failed: bool) -> None:
        """Every rank, as the job's training ends (`failed`: by an error)."""


class ObjectStoreWorkspace(Workspace):
    """A scratch folder per node in the cache, mirrored to `out` on an object store (see the module doc)."""

    def __init__(self, out: str, cache: Path):
        self.uri = out.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(out)
        self.root = root.rstrip("/")
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        here, rank = hosts[dist.get_rank()], dist.get_rank()
        self.dir = cache / SCRATCH / f"{hashlib.sha256(self.uri.encode()).hexdigest()[:16]}.{here}"
        self.leader, self.nodes = hosts.index(here) == rank, len(set(hosts))

    def restore(self, resume: bool) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)  # this node's copy of an earlier attempt: it may be stale
        (self.dir / CHECKPOINTS).mkdir(parents=True)
        if not resume:
            if dist.get_rank() == 0:
                self._remove(f"{self.root}/{CHECKPOINTS}")
            return
        steps = self._remote_steps()
        if not steps:
            return
        remote, local = self._step(steps[-1]), step_dir(self.dir / CHECKPOINTS, steps[-1])
        self.fs.get(f"{remote}/", f"{local}/", recursive=True)
        for name in (METRICS, f"{CHECKPOINTS}/{WANDB_RUN_ID}"):
            if self.fs.exists(f"{self.root}/{name}"):
                self.fs.get_file(f"{self.root}/{name}", str(self.dir / name))
        log.debug("downloaded checkpoint %s to %s", self.fs.unstrip_protocol(remote), local)

    def push_checkpoint(self, path: Path, keep_top_k: int, monitor: str, mode: str) -> None:
        """Rank 0 clears a half-uploaded attempt, each node's leader uploads its files (its ranks'
        shards: no two nodes write the same file but trainer.json, the same on each), then rank 0
        marks it complete and prunes."""
        remote, rank0 = f"{self.root}/{CHECKPOINTS}/{path.name}", dist.get_rank() == 0
        if rank0:
            self._remove(remote)
        dist.barrier()
        if self.leader:
            files = [p for p in path.rglob("*") if p.is_file() and p.name != COMPLETE]
            self.fs.put([str(p) for p in files], [f"{remote}/{p.relative_to(path).as_posix()}" for p in files])
        dist.barrier()
        if not rank0:
            return
        for name in (METRICS, f"{CHECKPOINTS}/{WANDB_RUN_ID}"):  # a resume truncates metrics.jsonl to its step
            if (self.dir / name).exists():
                self.fs.put_file(str(self.dir / name), f"{self.root}/{name}")
        self.fs.pipe(f"{remote}/{COMPLETE}", b"")
        trainer_state = lambda step: json.loads(self.fs.cat_file(f"{self._step(step)}/trainer.json"))  # noqa: E731
        deleted = pruned_steps(self._remote_steps(), trainer_state, keep_top_k, monitor, mode)
        for step in deleted:
            self.fs.rm(f"{self._step(step)}/{COMPLETE}")  # no longer a checkpoint before it is half deleted
            self.fs.rm(self._step(step), recursive=True)
        log.debug("uploaded checkpoint %s%s", self.fs.unstrip_protocol(remote), f" (removed steps {deleted})" if deleted else "")

    def gather(self, path: Path) -> None:
        """Through the store: the other nodes' leaders upload what they wrote into `path` (a
        checkpoint's files are there already), rank 0 downloads what it lacks; a folder outside
        the checkpoints (lora_merged's merged weights) leaves no copy in the store."""
        if self.nodes == 1:
            return
        relative, rank0 = path.relative_to(self.dir).as_posix(), dist.get_rank() == 0
        remote = f"{self.root}/{relative}"
        if self.leader and not rank0:
            for file in (p for p in path.rglob("*") if p.is_file()):
                if not self.fs.exists(f"{remote}/{file.relative_to(path).as_posix()}"):
                    self.fs.put_file(str(file), f"{remote}/{file.relative_to(path).as_posix()}")
        dist.barrier()
        if rank0:
            self.fs.invalidate_cache()
            for key in self.fs.find(remote):
                local = path / key[len(remote) + 1 :]
                if not local.exists():
                    local.parent.mkdir(parents=True, exist_ok=True)
                    self.fs.get_file(key, str(local))
            if not relative.startswith(f"{CHECKPOINTS}/"):
                self._remove(remote)
        dist.barrier()

    def push_outputs(self) -> None:
        try:
            for entry in sorted(self.dir.iterdir()):
                if entry.name == CHECKPOINTS or entry.name.startswith("."):
                    continue
                target = f"{self.root}/{entry.name}"
                self._remove(target)  # a previous attempt's copy
                if entry.is_dir():
                    self.fs.put(f"{entry}/", f"{target}/", recursive=True)
                else:
                    self.fs.put_file(str(entry), target)
            log.info("uploaded the outputs to %s", self.uri)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)  # all in the store now, or a retry starts afresh anyway

    def close(self, failed: bool) -> None:
        """A node's leader removes its scratch, but rank 0's after a success: `push_outputs` uploads
        from it, then removes it."""
        if self.leader and (failed or dist.get_rank() != 0):
            shutil.rmtree(self.dir, ignore_errors=True)

    def _remote_steps(self) -> list[int]:
        """Steps with a complete checkpoint in the store, ascending."""
        self.fs.invalidate_cache()  # another attempt may have written since we last listed
        markers = self.fs.glob(f"{self.root}/{CHECKPOINTS}/step-*/{COMPLETE}")
        return sorted(int(m.rsplit("/", 2)[-2].removeprefix("step-")) for m in markers)

    def _step(self, step: int) -> str:
        return f"{self.root}/{CHECKPOINTS}/step-{step:08d}"

    def _remove(self, path: str) -> None:
        self.fs.invalidate_cache(path)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
