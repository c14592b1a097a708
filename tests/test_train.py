"""The training engine's pieces: schedules, data order, packed rows, checkpoint pruning, and a
packed row's loss equal to its documents' losses run one by one."""

import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from alignflow.job.train import checkpoints
from alignflow.job.train.data import DataPosition, GlobalBatches, dp_micro_batches, packed_rows
from alignflow.job.train.datasets import PackedSFT
from alignflow.job.train.schedule import lr_at

sys.path.insert(0, str(Path(__file__).parent))
from ranks import run_ranks  # noqa: E402
from train_ranks import SEQ_LENGTH, prep_demo  # noqa: E402

LR, MIN_LR, WARMUP, TOTAL = 1e-3, 1e-4, 10, 110


def sched(step, schedule, warmup=WARMUP):
    return lr_at(step, lr=LR, min_lr=MIN_LR, warmup_steps=warmup, total_steps=TOTAL, schedule=schedule)


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_is_linear_to_lr(schedule):
    for step in range(1, WARMUP + 1):
        assert sched(step, schedule) == pytest.approx(LR * step / WARMUP, rel=1e-12)


def test_cosine_decays_to_min_lr():
    for step in range(WARMUP + 1, TOTAL + 1):
        p = (step - WARMUP) / (TOTAL - WARMUP)
        assert sched(step, "cosine") == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * p)), rel=1e-12)
    assert sched(TOTAL, "cosine") == pytest.approx(MIN_LR)
    assert sched(TOTAL + 5, "cosine") == pytest.approx(MIN_LR)  # clamped past the end
    assert sched(WARMUP + (TOTAL - WARMUP) // 2, "cosine") == pytest.approx((LR + MIN_LR) / 2)


def test_linear_decays_to_min_lr_and_constant_stays():
    for step in range(WARMUP + 1, TOTAL + 1):
        p = (step - WARMUP) / (TOTAL - WARMUP)
        assert sched(step, "linear") == pytest.approx(LR - (LR - MIN_LR) * p, rel=1e-12)
        assert sched(step, "constant") == LR
    assert sched(1, "cosine", warmup=0) == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi / TOTAL)))
    with pytest.raises(ValueError, match="unknown schedule"):
        sched(1, "step")


# ---------------------------------------------------------------- data order


def test_global_batches_are_a_seeded_permutation_per_epoch_and_resumable():
    batches = GlobalBatches(num_rows=23, global_batch_size=4, seed=7)
    assert batches.per_epoch == 5
    pos, seen = DataPosition(), []
    for _ in range(10):
        seen.append(batches.indices(pos))
        pos = batches.next(pos)
    assert pos == DataPosition(epoch=2, batch=0)
    epoch0, epoch1 = np.concatenate(seen[:5]), np.concatenate(seen[5:])
    assert len(set(epoch0)) == 20 and len(set(epoch1)) == 20 and not np.array_equal(epoch0, epoch1)
    fresh = GlobalBatches(23, 4, seed=7)  # a resumed run rebuilds the order from (seed, epoch)
    assert np.array_equal(fresh.indices(DataPosition(1, 3)), seen[8])
    assert not np.array_equal(GlobalBatches(23, 4, seed=8).indices(DataPosition()), seen[0])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatches(3, 4, 0)


def test_dp_ranks_split_a_global_batch_into_micro_batches():
    indices = np.arange(100, 112)
    shares = [dp_micro_batches(PackedSFT, indices, micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    assert [m.tolist() for m in shares[0]] == [[100, 101], [102, 103], [104, 105]]
    assert np.array_equal(np.concatenate([np.concatenate(s) for s in shares]), indices)


def test_packed_rows_documents_positions_and_labels():
    ids, mask, cu = np.array([5, 6, 7, 8, 9]), np.array([0, 1, 1, 0, 1]), np.array([0, 3, 5])
    rows = packed_rows([(ids, mask, cu), (ids[:4], mask[:4], np.array([0, 4]))], length=7, pad_id=0)
    assert rows.tokens[0].tolist() == [5, 6, 7, 8, 9, 0, 0]
    assert rows.labels[0, :4].tolist() == [6, 7, 8, 9]
    assert rows.loss_mask[0].tolist() == [1, 1, 0, 1, 0, 0, 0]  # no loss across the document boundary
    assert rows.position_ids[0, :5].tolist() == [0, 1, 2, 0, 1]
    assert rows.cu_seqlens.tolist() == [0, 3, 5, 7, 11, 14]  # the documents, then each row's padding, in the flat [2 * 7]
    assert rows.max_seqlen == 4 and rows.cu_seqlens.dtype == torch.int32


# ---------------------------------------------------------------- checkpoints


def fake_checkpoint(root: Path, step: int, val_loss, complete=True):
    path = checkpoints.step_dir(root, step)
    path.mkdir(parents=True)
    (path / "trainer.json").write_text(json.dumps({"step": step, "last_val_loss": val_loss}))
    if complete:
        (path / checkpoints.COMPLETE).write_text("")


def test_prune_keeps_the_top_k_and_the_latest(tmp_path):
    for step, val in ((10, 3.0), (20, 2.0), (30, 2.5), (40, 2.8), (50, None)):
        fake_checkpoint(tmp_path, step, val)
    fake_checkpoint(tmp_path, 60, 1.0, complete=False)  # a checkpoint killed mid-write does not exist
    assert checkpoints.complete_steps(tmp_path) == [10, 20, 30, 40, 50]
    assert checkpoints.prune(tmp_path, 2, "val_loss", "min") == [10, 40]
    assert checkpoints.complete_steps(tmp_path) == [20, 30, 50]
    assert checkpoints.prune(tmp_path, 1, "val_loss", "max") == [20]
    assert checkpoints.prune(tmp_path, 0, "val_loss", "min") == [30]
    assert checkpoints.complete_steps(tmp_path) == [50]


def philox(seed: int) -> torch.Tensor:
    """A CUDA generator's state as `torch.cuda.get_rng_state` gives it: 8 bytes of seed, 8 of offset."""
    return torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint8)


def seed_host(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("drawn_on,here", [("cuda", "cpu"), ("cpu", "cuda"), ("cpu", "cpu")])
def test_rng_states_of_the_other_device_type_are_re_seeded_and_the_hosts_restored(drawn_on, here):
    """A checkpoint's python, numpy and torch (CPU) states resume on any device type; Megatron's
    tracker and CUDA's states only on the device type that drew them (CPU ones are 5056 bytes,
    CUDA ones 16). What a CUDA rank does with its own states needs CUDA: not run here."""
    from megatron.core import tensor_parallel

    seed_host(1)
    states = {
        "python": random.getstate(),
        "numpy": checkpoints._plain_numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "tracker": {"model-parallel-rng": torch.Generator().manual_seed(4).get_state()},
    }
    if drawn_on == "cuda":
        states |= {"tracker": {"model-parallel-rng": philox(4)}, "cuda": philox(3)}
    expected = (random.random(), np.random.rand(), torch.rand(1))
    seed_host(9)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(9).get_state()})
    before = tracker.get_states()

    reseeded = checkpoints.set_rng_states(states, here)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert checkpoints.rng_device(states) == drawn_on
    assert reseeded == (() if drawn_on == here else ("tracker", "cuda"))
    assert tracker.get_states() == (states["tracker"] if drawn_on == here else before)


# ---------------------------------------------------------------- packed attention


def test_packed_row_loss_equals_documents_one_by_one(demo_dir, tmp_path):
    """Every document's loss in a packed row equals its loss run alone (each document attends
    on its own; RoPE is relative, so equal up to float rounding)."""
    from alignflow.job.data.prepared import Prepared
    from alignflow.job.device import device, to_device
    from alignflow.job.model import runtime
    from alignflow.job.model.gpt import build_gpt
    from alignflow.job.forward.objectives import sft_forward
    from alignflow.job.stages.sft import load_data
    from train_ranks import sft_cfg

    data = load_data(Prepared(str(prep_demo(demo_dir, tmp_path / "data"))))
    hf_config = json.loads((demo_dir / "tiny-llama" / "config.json").read_text())
    parallel = sft_cfg(demo_dir)["sft"]["parallel"]
    rows = [i for i in range(len(data.train)) if len(data.train.row(i)[2]) >= 4][:2]  # rows with >= 3 documents
    runtime.init_parallel(parallel, seed=3)
    try:
        model = build_gpt(hf_config, parallel, calculate_per_token_loss=True)[0].eval()
        with torch.no_grad():
            packed = to_device(data.train.collate(rows))
            per_token = sft_forward(model, packed) * packed["loss_mask"]
            for b, i in enumerate(rows):
                ids, mask, cu = data.train.row(i)
                for a, e in zip(cu, cu[1:]):
                    alone = to_device(vars(packed_rows([(ids[a:e], mask[a:e], np.array([0, e - a]))], SEQ_LENGTH, data.train.pad_id)))
                    loss_alone = (sft_forward(model, alone) * alone["loss_mask"])[0, : e - a]
                    assert alone["loss_mask"].sum() > 0
                    torch.testing.assert_close(per_token[b, a:e], loss_alone, atol=1e-5, rtol=1e-5)
            # and the documents matter: each row as one document, the later documents' losses change
            rows_only = torch.arange(0, packed["tokens"].numel() + 1, SEQ_LENGTH, dtype=torch.int32, device=device())
            unmasked = dict(packed, cu_seqlens=rows_only, max_seqlen=SEQ_LENGTH)
            assert not torch.allclose(sft_forward(model, unmasked) * packed["loss_mask"], per_token, atol=1e-3)
    finally:
        runtime.teardown()


EVEN_OUT = """
import numpy as np
import torch.distributed as dist
from alignflow.job.model import runtime
from alignflow.job.train.engine import as_many_as_the_expert_group
runtime.init_parallel({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
                       "context_parallel_size": 1, "expert_model_parallel_size": 2})
mine = [np.arange(0, 5)] if dist.get_rank() == 0 else [np.arange(5, 7), np.array([7]), np.array([8, 9]), np.array([10])]
print(f"rank {dist.get_rank()}: {[m.tolist() for m in as_many_as_the_expert_group(mine)]}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_ranks_of_an_expert_group_run_as_many_micro_batches(tmp_path):
    """Under EP each MoE layer exchanges tokens among the group's ranks once per micro batch:
    a rank whose pairs packed into fewer micro batches splits its longest until it has as many
    as the group's most, keeping every item once and in order."""
    script = tmp_path / "even_out.py"
    script.write_text(EVEN_OUT)
    run = run_ranks(2, script)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "rank 0: [[0], [1], [2], [3, 4]]" in run.stdout and "rank 1: [[5, 6], [7], [8, 9], [10]]" in run.stdout, run.stdout
