"""Training data: Parquet token tables, a deterministic resumable global-batch order, DP shards.

- `GlobalBatches`: epoch `e` visits the rows in the order `permutation(seed, e)`, cut into
  global batches of `global_batch_size` rows (a last partial batch is dropped). A
  `DataPosition` (epoch, batch) says where training is, so a resumed run reads exactly the
  rows an uninterrupted one would.
- `dp_micro_batches`: this data-parallel rank's share of a global batch, in the dataset's micro
  batches (`consecutive` items, or the rows `PreferencePairs` packs a share's pairs into).
- `packed_rows`: where each document starts in the flattened micro batch (cu_seqlens, the
  attention's only view of the documents: no mask), per-document position ids and next-token
  labels for rows packing several documents, padded to one length.

A dataset the engine trains on is anything with `__len__`, `micro_batches(indices, size)` (how
items group into micro batches of `size` model rows), `collate(indices) -> dict of tensors`
(one micro batch), `num_tokens(indices) -> int` (for throughput) and
`document_lengths(indices)` (the documents' lengths, for model FLOPs: attention stays inside
each); prep's tables become datasets in `alignflow.job.train.datasets`.
"""

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch


class Dataset(Protocol):
    def __len__(self) -> int: ...

    def micro_batches(self, indices: np.ndarray, size: int) -> list[np.ndarray]: ...

    def collate(self, indices: Sequence[int]) -> dict: ...

    def num_tokens(self, indices: Sequence[int]) -> int: ...

    def document_lengths(self, indices: Sequence[int]) -> np.ndarray: ...


@dataclass
class DataPosition:
    epoch: int = 0
    batch: int = 0  # global batches already consumed in this epoch


class GlobalBatches:
    """The row indices of each global batch, reproducible from (seed, epoch, batch)."""

    def __init__(self, num_rows: int, global_batch_size: int, seed: int):
        self.num_rows, self.size, self.seed = num_rows, global_batch_size, seed
        self.per_epoch = num_rows // global_batch_size
        if self.per_epoch == 0:
            raise ValueError(f"{num_rows} training rows are fewer than one global batch of {global_batch_size}")
        self._order: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_rows))
        return self._order[1]

    def indices(self, pos: DataPosition) -> np.ndarray:
        return self.order(pos.epoch)[pos.batch * self.size : (pos.batch + 1) * self.size]

    def next(self, pos: DataPosition) -> DataPosition:
        batch = pos.batch + 1
        return DataPosition(pos.epoch + 1, 0) if batch >= self.per_epoch else DataPosition(pos.epoch, batch)


def dp_micro_batches(dataset: Dataset, indices: np.ndarray, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[np.ndarray]:
    """Rank `dp_rank`'s contiguous share of a global batch, in `dataset`'s micro batches."""
    share = len(indices) // dp_size
    return dataset.micro_batches(indices[dp_rank * share : (dp_rank + 1) * share], micro_batch_size)


def consecutive(indices: np.ndarray, size: int) -> list[np.ndarray]:
    """Micro batches of `size` items in the given order (an item is a model row)."""
    return [indices[i : i + size] for i in range(0, len(indices), size)]


@dataclass
class PackedRows:
    """Model inputs for a micro batch of packed rows, every row padded to `length`."""

    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] the next token (pad where there is none)
    loss_mask: torch.Tensor  # [b, s] float: 1 where labels[t] is trained on
    position_ids: torch.Tensor  # [b, s] restart at 0 in each document
    cu_seqlens: torch.Tensor  # [documents + 1] int32: document (and padding) starts in the flat [b * s] batch
    max_seqlen: int  # the longest document (with cu_seqlens: varlen / THD attention's arguments)
    token_mask: torch.Tensor  # [b, s] bool: a document's token, False on the padding (HF's attention_mask)


def packed_rows(rows: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], length: int, pad_id: int) -> PackedRows:
    """Rows of (input_ids, loss_mask, cu_seqlens) -> padded model inputs.

    A token attends to the earlier tokens of its own document only (`cu_seqlens`); padding
    forms one more document and is never trained on. Position t predicts token t + 1 when that token is in
    the same document and its loss_mask is 1 (loss_mask marks tokens to predict)."""
    b = len(rows)
    tokens = np.full((b, length), pad_id, dtype=np.int64)
    labels = np.full((b, length), pad_id, dtype=np.int64)
    loss = np.zeros((b, length), dtype=np.float32)
    positions = np.zeros((b, length), dtype=np.int64)
    starts = []
    for i, (ids, mask, cu) in enumerate(rows):
        n = len(ids)
        if n > length:
            raise ValueError(f"a row of {n} tokens is longer than seq_length {length}")
        cu = np.asarray(cu, dtype=np.int64)
        tokens[i, :n] = ids
        labels[i, : n - 1] = ids[1:]
        doc_of = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        positions[i, :n] = np.arange(n) - cu[doc_of]
        positions[i, n:] = np.arange(length - n)
        same_doc_next = doc_of[:-1] == doc_of[1:]
        loss[i, : n - 1] = np.asarray(mask[1:], dtype=np.float32) * same_doc_next
        starts.append(i * length + (np.r_[cu[:-1], n] if n < length else cu[:-1]))
    cu_seqlens = np.r_[np.concatenate(starts), b * length]
    return PackedRows(
        torch.from_numpy(tokens),
        torch.from_numpy(labels),
        torch.from_numpy(loss),
        torch.from_numpy(positions),
        torch.from_numpy(cu_seqlens.astype(np.int32)),
        int(np.diff(cu_seqlens).max()),
        torch.from_numpy(np.arange(length)[None, :] < np.array([len(ids) for ids, _, _ in rows])[:, None]),
    )
