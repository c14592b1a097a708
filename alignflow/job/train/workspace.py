"""Training jobs on an object-store store: a scratch folder synced with the store.

Megatron's dist_checkpointing, HF's `from_pretrained` and the atomic renames of
`alignflow.job.train.checkpointing` need a filesystem. With a local (or shared POSIX) store a job
reads its inputs and writes its output in place, as always. With an object store (`s3://`),
input models are downloaded once per node (`alignflow.job.forward.models.local_model`), and:

- Training output (`Workspace`): the job trains in a scratch folder in the cache and
  uploads every complete checkpoint to `{out}/checkpoints/step-N/` (`complete` last, after
  metrics.jsonl and the wandb run id), pruned like the local ones. A (re)started job, on any
  node, empties its scratch and downloads the store's latest complete checkpoint: the store
  is the truth, the scratch only a copy of it. At the end the outputs (model/, hf/,
  tokenizer/, metrics.jsonl, ...) are uploaded beside the checkpoints, for the runner to
  commit, and the scratch is removed.

The scratch must be one folder for all ranks of a job (Megatron writes a checkpoint from all
of them): the node's temp dir by default, a shared filesystem for a multi-node job (checked).
"""

import json
import logging
import shutil
import uuid
from pathlib import Path

import fsspec
import torch.distributed as dist

from alignflow.job.forward.models import cache_key, is_local
from alignflow.orchestrator.store import CHECKPOINTS, COMPLETE
from alignflow.job.train.checkpointing import WANDB_RUN_ID, pruned_steps, step_dir

log = logging.getLogger("alignflow.workspace")

METRICS = "metrics.jsonl"
_SHARED = ".scratch-token"  # written by rank 0 in the scratch: every rank must read the same


def workspace_for(out: str, cache: Path) -> "Workspace":
    return Workspace(out) if is_local(out) else ObjectStoreWorkspace(out, cache)


class Workspace:
    """Where a training job writes: `out` itself on a filesystem, so there is nothing to sync."""

    def __init__(self, out: str):
        self.dir = Path(out.removeprefix("file://"))

    def restore(self, resume: bool) -> None:
        """Rank 0, before the trainer looks for checkpoints: with resume off, forget them all."""
        if not resume:
            shutil.rmtree(self.dir / CHECKPOINTS, ignore_errors=True)

    def check_shared(self) -> None:
        """Every rank, after `restore`: fail unless all ranks see the same folder."""

    def push_checkpoint(self, path: Path, keep_top_k: int, monitor: str, mode: str) -> None:
        """Rank 0, after the complete checkpoint `path` was written (and pruned) locally."""

    def push_outputs(self) -> None:
        """Rank 0, when the final model and metrics are in `dir`."""


class ObjectStoreWorkspace(Workspace):
    """A scratch folder in the cache mirrored to `out` on an object store (see the module doc)."""

    def __init__(self, out: str, cache: Path):
        self.uri = out.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(out)
        self.root = root.rstrip("/")
        self.dir = cache / "scratch" / cache_key(out)

    def restore(self, resume: bool) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / CHECKPOINTS).mkdir(parents=True)
        (self.dir / _SHARED).write_text(uuid.uuid4().hex)
        if not resume:
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

    def check_shared(self) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        token = self.dir / _SHARED
        expected = [token.read_text() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(expected, src=0)
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, token.exists() and token.read_text() == expected[0])
        if not all(seen):
            raise RuntimeError(
                f"the training scratch {self.dir} is not shared by all ranks of the job: set store.cache_dir "
                "to a filesystem every node sees (Megatron writes each checkpoint from all ranks)"
            )

    def push_checkpoint(self, path: Path, keep_top_k: int, monitor: str, mode: str) -> None:
        remote = f"{self.root}/{CHECKPOINTS}/{path.name}"
        self._remove(remote)  # a half-uploaded attempt
        files = [p for p in path.rglob("*") if p.is_file() and p.name != COMPLETE]
        self.fs.put([str(p) for p in files], [f"{remote}/{p.relative_to(path).as_posix()}" for p in files])
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

    def push_outputs(self) -> None:
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
        shutil.rmtree(self.dir, ignore_errors=True)  # all in the store now; a retry would start afresh anyway

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
