"""Training checkpoints inside a stage's output, written atomically, resumed from the latest.

Layout under `{out}/checkpoints/`:

    step-00000010/
        model/               Megatron torch_dist: the weights as global tensors
                             (`alignflow.job.model.sharded_state`), in the training dtype; a
                             LoRA run's holds its adapters only (its base is its input model)
        optimizer/           Megatron torch_dist: the optimizer's sharded state (fp32 main
                             weights under bf16, Adam moments, step), mapped onto the weights'
                             global tensors; the distributed optimizer's in its
                             `fully_reshardable` format (gathered on DP rank 0 to save)
        rank-00000.pt ...    per rank: RNG states (python, numpy, torch, Megatron's RNG tracker,
                             CUDA when present) and the TP/PP/VP/DP layout that drew them, as
                             tensors and plain data (`alignflow.job.model_files.untrusted.load_plain`)
        trainer.json         step, data position, tracked metrics, early-stopping state
        complete             written last: a checkpoint without it does not exist
    .tmp-step-00000010/      a checkpoint being written (removed when found stale)
    wandb-run-id             the wandb run a retry continues

They live in the staging area: the commit leaves them out, or keeps the final one with
`checkpoint.keep_optimizer` (`alignflow.orchestrator.store.Store.committed_checkpoint`).

Every rank writes into the temp folder; after a barrier rank 0 writes trainer.json,
renames the folder to `step-N` and writes `complete` (where each node writes into a scratch
of its own, each node's lowest rank does so in its copy). Weights and optimizer state reshard on
load: a job resumes at another TP, PP or DP size (with the same precision and the same
`use_distributed_optimizer`). At the same layout a resumed run continues bit-exactly; at
another one the RNG states are not restored (they belong to ranks that no longer exist), so
dropout draws other masks from there on. A checkpoint written on the other device type (CPU
<-> GPU) resumes too: the host's RNG states are restored, the device's (Megatron's tracker,
CUDA's) are re-seeded, and the job log says so. On a filesystem (local or shared POSIX); when the
store is an object store, `alignflow.job.train.workspace` writes them in a scratch on each node and
uploads each complete one.

`prune` keeps the latest checkpoint (for resume) and the `save_top_k` best by the monitored
metric (`val_loss` or `loss`), whose value is the latest one computed at or before the
checkpoint's step.
"""

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.optimizer import MegatronOptimizer

from alignflow.job.model_files.untrusted import load_plain
from alignflow.job.model import sharded_state
from alignflow.orchestrator.store import COMPLETE, fsync
from alignflow.job.train.data import DataPosition

log = logging.getLogger("alignflow.job.train")

WANDB_RUN_ID = "wandb-run-id"


@dataclass
class TrainerState:
    """Everything besides weights, optimizer and RNG that a resumed run needs to continue exactly."""

    step: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    tokens: int = 0
    last_loss: Optional[float] = None
    last_val_loss: Optional[float] = None
    best_val_loss: Optional[float] = None
    bad_validations: int = 0  # validations since the last improvement (early stopping)
    stopped_early: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "TrainerState":
        return cls(**{**data, "position": DataPosition(**data["position"])})


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / COMPLETE).exists())


def rng_states() -> dict:
    states = {
        "python": random.getstate(),
        "numpy": _plain_numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _plain_numpy_state(state: tuple) -> tuple:
    """numpy's legacy RNG state with its key array as a list, which `weights_only` loads and
    `np.random.set_state` takes back."""
    name, keys, *rest = state
    return (name, keys.tolist(), *rest)


# States of the device that drew them: Megatron's tracker (dropout in tensor-parallel regions)
# holds CUDA generator states on GPU and CPU ones on CPU (`cpu_shim.CpuRNGStatesTracker`), of
# another size; `cuda` is CUDA's default generator's.
DEVICE_RNG = ("tracker", "cuda")


def rng_device(states: dict) -> str:
    """The device type that drew `states`: `rng_states` adds `cuda` where CUDA is."""
    return "cuda" if "cuda" in states else "cpu"


def set_rng_states(states: dict, device_type: str) -> tuple[str, ...]:
    """Restore `states` on a rank of `device_type`: the host's (python, numpy, torch) always, the
    device's only when drawn on the same device type; returns those not restored, which stay as
    this job's start seeded them (`alignflow.job.model.runtime.seed_all`)."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if rng_device(states) != device_type:
        return DEVICE_RNG
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    return ()


def layout() -> dict:
    """This job's parallel layout: RNG states are restored only into the same one."""
    return {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        "data": parallel_state.get_data_parallel_world_size(),
    }


def save(root: Path, chunks, optimizer: MegatronOptimizer, state: TrainerState, select: str = "all", leader: bool | None = None) -> Path:
    """Write `step-N` atomically (every rank calls this); returns its path. `select`: the
    weights it holds (`alignflow.job.model.sharded_state.SELECT`; a LoRA run's: its adapters).
    `leader`: whether this rank manages its copy of `root` (default rank 0; where each node
    writes into a scratch of its own, each node's lowest rank: `alignflow.job.train.workspace`)."""
    rank = dist.get_rank()
    leader = rank == 0 if leader is None else leader
    final, tmp = step_dir(root, state.step), root / f".tmp-step-{state.step:08d}"
    if leader:
        for stale in (tmp, final):  # a half-written attempt, or a renamed one that never got `complete`
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    sharded_state.save(chunks, str(tmp / "model"), select)
    sharded_state.save_optimizer(optimizer, chunks, str(tmp / "optimizer"), select)
    torch.save({"layout": layout(), "rng": rng_states()}, tmp / f"rank-{rank:05d}.pt")
    dist.barrier()
    if leader:
        (tmp / "trainer.json").write_text(json.dumps(state.to_json(), indent=2) + "\n")
        os.replace(tmp, final)
        fsync(root)
        (final / COMPLETE).write_text("")
    dist.barrier()
    return final


def load(path: Path, chunks, optimizer: MegatronOptimizer, select: str = "all") -> TrainerState:
    """Restore weights (those `select` names), optimizer and trainer state from a complete
    checkpoint written at any layout, and the RNG states when it was written at this one."""
    sharded_state.load_optimizer(optimizer, chunks, str(path / "optimizer"), select)  # first: it may step the optimizer
    sharded_state.load(chunks, str(path / "model"), select)
    rank_file = path / f"rank-{dist.get_rank():05d}.pt"
    saved = load_plain(str(rank_file)) if rank_file.exists() else {"layout": None}
    here, rank0 = "cuda" if torch.cuda.is_available() else "cpu", dist.get_rank() == 0
    if saved["layout"] != layout():
        if rank0:
            log.warning("%s was written at layout %s, this job runs at %s: RNG states not restored", path, saved["layout"], layout())
    elif (reseeded := set_rng_states(saved["rng"], here)) and rank0:
        log.info(
            "%s was written on %s, this job runs on %s: RNG states %s re-seeded (as this job's start seeded them from "
            "trainer.seed), python, numpy and torch restored",
            path,
            rng_device(saved["rng"]),
            here,
            ", ".join(reseeded),
        )
    return TrainerState.from_json(json.loads((path / "trainer.json").read_text()))


def prune(root: Path, keep_top_k: int, monitor: str, mode: str) -> list[int]:
    """Keep the latest checkpoint and the `keep_top_k` best by `monitor` (rank 0; -1 keeps all);
    returns the steps deleted."""
    trainer_state = lambda step: json.loads((step_dir(root, step) / "trainer.json").read_text())  # noqa: E731
    deleted = pruned_steps(complete_steps(root), trainer_state, keep_top_k, monitor, mode)
    for step in deleted:
        shutil.rmtree(step_dir(root, step))
    return deleted


def pruned_steps(steps: list[int], trainer_state: Callable[[int], dict], keep_top_k: int, monitor: str, mode: str) -> list[int]:
    """The rule of `prune` over `steps` (ascending), wherever they are stored: `trainer_state(step)`
    reads a checkpoint's trainer.json. Checkpoints without the monitored value rank below those
    with it, newer before older."""
    if keep_top_k < 0 or len(steps) <= 1:
        return []

    def rank_key(step: int):
        value = trainer_state(step).get(_STATE_KEYS.get(monitor, monitor))
        if value is None:
            return (1, -step)
        return (0, value if mode == "min" else -value, -step)

    keep = set(sorted(steps, key=rank_key)[:keep_top_k]) | {steps[-1]}
    return [s for s in steps if s not in keep]


# monitor names -> TrainerState fields holding them at checkpoint time
_STATE_KEYS = {"val_loss": "last_val_loss", "loss": "last_loss", "train_loss": "last_loss"}
