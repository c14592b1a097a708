"""Prep's tables as datasets the engine trains on: rows -> micro batches of model inputs.

Each is built from a `Prepared` output (`alignflow.job.data.prepared`, the one reader of prep's
format) and implements `alignflow.job.train.data.Dataset`: `__len__`, `collate(indices)` and
`num_tokens(indices)`, `document_lengths(indices)`.

- `PackedSFT`: packed SFT rows (several documents per row, attention kept inside each).
- `PreferencePairs`: a step's pairs packed into rows (best-fit-decreasing), a micro batch a
  few of those rows, no padding to the data set's longest sequence; with reference log-probs (`alignflow.job.data.logprobs`) each micro batch also carries the
  reference's per-pair sums.
- `DistillRows`: packed SFT rows with the teacher's top-k (`alignflow.job.data.teacher_topk`) at
  each loss position, as [rows, length, k] tensors aligned to the packed rows.
- `Prompts`: RL prompts with their rendered text and ground-truth answer (not collated: GRPO
  generates from them).
"""

from typing import Sequence

import numpy as np
import torch

from alignflow.job.data import logprobs, teacher_topk
from alignflow.job.data.packing import pack_bfd_flat
from alignflow.job.data.prepared import SIDES, Prepared, list_column
from alignflow.job.train.data import consecutive, packed_rows

PAD_MULTIPLE = 8


class PackedSFT:
    KIND = "sft"

    def __init__(self, prepared: Prepared, split: str):
        table = prepared.require(self.KIND, split)
        self.ids, self.ids_off = list_column(table, "input_ids")
        self.mask, _ = list_column(table, "loss_mask")
        self.cu, self.cu_off = list_column(table, "cu_seqlens")
        self.seq_length, self.pad_id = prepared.seq_length, prepared.pad_id

    def __len__(self) -> int:
        return len(self.ids_off) - 1

    micro_batches = staticmethod(consecutive)

    def row(self, i: int):
        a, b = self.ids_off[i], self.ids_off[i + 1]
        return self.ids[a:b], self.mask[a:b], self.cu[self.cu_off[i] : self.cu_off[i + 1]]

    def collate(self, indices: Sequence[int]) -> dict:
        return vars(packed_rows([self.row(int(i)) for i in indices], self.seq_length, self.pad_id))

    def num_tokens(self, indices: Sequence[int]) -> int:
        return int(sum(self.ids_off[i + 1] - self.ids_off[i] for i in indices))

    def document_lengths(self, indices: Sequence[int]) -> np.ndarray:
        return np.concatenate([np.diff(self.row(int(i))[2]) for i in indices] or [np.zeros(0, dtype=np.int64)])


class DistillRows:
    """`PackedSFT` rows plus `teacher_ids` [b, s, k] (int64) and `teacher_logp` [b, s, k] (fp32):
    the teacher's top-k at every position the loss trains on (zeros elsewhere, never read
    there). The teacher's positions must be exactly the collated loss positions: a teacher
    output computed on other rows fails here rather than training on misaligned targets."""

    KIND = "sft"

    def __init__(self, prepared: Prepared, split: str, teacher_uri: str):
        self.rows = PackedSFT(prepared, split)
        self.seq_length = self.rows.seq_length
        self.teacher = teacher_topk.read(teacher_uri, split, len(self.rows))

    def __len__(self) -> int:
        return len(self.rows)

    micro_batches = staticmethod(consecutive)

    def num_tokens(self, indices: Sequence[int]) -> int:
        return self.rows.num_tokens(indices)

    def document_lengths(self, indices: Sequence[int]) -> np.ndarray:
        return self.rows.document_lengths(indices)

    def collate(self, indices: Sequence[int]) -> dict:
        batch = self.rows.collate(indices)
        ids = np.zeros((*batch["tokens"].shape, self.teacher.k), dtype=np.int64)
        logp = np.zeros(ids.shape, dtype=np.float32)
        for r, i in enumerate(int(i) for i in indices):
            positions, top_ids, top_logp = self.teacher.row(i)
            expected = np.flatnonzero(batch["loss_mask"][r].numpy())
            if self.teacher.tokens[i] != self.rows.num_tokens([i]) or not np.array_equal(positions, expected):
                raise ValueError(f"teacher top-k of row {i} do not line up with its loss positions: computed on other data?")
            ids[r, positions], logp[r, positions] = top_ids, top_logp
        return batch | {"teacher_ids": torch.from_numpy(ids), "teacher_logp": torch.from_numpy(logp)}


class PreferencePairs:
    """Pairs packed into rows of at most `row_length` tokens (the split's longest pair, rounded up
    to 8), each pair's chosen and rejected sequences side by side, every sequence its own
    document (attention never crosses one). `micro_batches` packs all the pairs it is given
    (a DP rank's share of a step) best-fit-decreasing and cuts the rows `size` at a time, so a
    micro batch is at most `size` rows and holds as many pairs as fill them: padding to a micro
    batch's longest pair would leave a fifth of the positions computed empty on real length
    mixes. `collate` lays its pairs into rows next-fit in the order given, which rebuilds those
    rows (or merges some), and trims the rows to the fullest one (rounded up to 8: attention
    costs rows x length^2). Micro batches thus differ in shape (pipeline stages exchange
    shapes) and in pairs; losses are sums over pairs divided by the step's pair count, so the
    grouping does not change them. `batch["sequence"]` names each position's sequence (chosen
    of pair j: j, rejected: n + j; padding: -1), which `sequence_sums` sums over."""

    KIND = "preference"

    def __init__(self, prepared: Prepared, split: str, reference_uri: str | None = None):
        table = prepared.require(self.KIND, split)
        self.sample_ids = table.column("sample_id").to_numpy()
        self.columns = {side: (list_column(table, f"{side}_input_ids"), list_column(table, f"{side}_loss_mask")) for side in SIDES}
        self.lengths = sum(np.diff(off) for (_, off), _ in self.columns.values())  # chosen + rejected tokens of each pair
        self.row_length = _padded(int(self.lengths.max(initial=1)))  # the longest a micro batch's rows can be
        self.pad_id = prepared.pad_id
        self.reference = logprobs.read(reference_uri, split, self.sample_ids) if reference_uri else None

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sequence(self, side: str, i: int) -> tuple[np.ndarray, np.ndarray]:
        (ids, off), (mask, _) = self.columns[side]
        return ids[off[i] : off[i + 1]], mask[off[i] : off[i + 1]]

    def rows(self, side: str, indices: Sequence[int]) -> list:
        """One side's sequences as unpacked rows (input_ids, loss_mask, cu_seqlens)."""
        return [(*seq, [0, len(seq[0])]) for seq in (self.sequence(side, int(i)) for i in indices)]

    def micro_batches(self, indices: np.ndarray, size: int) -> list[np.ndarray]:
        """`indices`' pairs in micro batches of at most `size` rows, each row's pairs in turn."""
        indices = np.asarray(indices, dtype=np.int64)
        items, offsets = pack_bfd_flat(self.lengths[indices], self.row_length)
        rows = [items[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        rows.sort(key=lambda row: -int(self.lengths[indices[row]].sum()))  # rows of like fill together: trimmed alike
        return [indices[np.concatenate(rows[k : k + size])] for k in range(0, len(rows), size)]

    def collate(self, indices: Sequence[int]) -> dict:
        indices = [int(i) for i in indices]
        n, rows, sequence_ids = len(indices), [], []
        for row in _next_fit([int(self.lengths[i]) for i in indices], self.row_length):
            parts = [(self.sequence(side, indices[j]), j + k * n) for j in row for k, side in enumerate(SIDES)]
            rows.append(
                (
                    np.concatenate([ids for (ids, _), _ in parts]),
                    np.concatenate([mask for (_, mask), _ in parts]),
                    np.cumsum([0] + [len(ids) for (ids, _), _ in parts]),
                )
            )
            sequence_ids.append([seq for _, seq in parts])
        length = _padded(max(cu[-1] for _, _, cu in rows))
        batch = vars(packed_rows(rows, length, self.pad_id))
        batch["sequence"] = _sequence_map(rows, sequence_ids, length)
        batch["pairs"] = n
        if self.reference is not None:
            batch |= {f"ref_{name}": torch.from_numpy(values[indices]) for name, values in self.reference.items()}
        return batch

    def num_tokens(self, indices: Sequence[int]) -> int:
        return int(sum(self.lengths[int(i)] for i in indices))

    def document_lengths(self, indices: Sequence[int]) -> np.ndarray:
        """The chosen and the rejected sequence of each pair (each its own document)."""
        rows = np.asarray(indices, dtype=np.int64)
        return np.concatenate([np.diff(off)[rows] for (_, off), _ in self.columns.values()])


def _next_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Items in order into rows of `capacity`, a new row when the next does not fit: on rows
    laid end to end it gives back those rows (or fewer, where one's items fit in the row
    before)."""
    rows, room = [], 0
    for i, length in enumerate(lengths):
        if length > room:
            rows.append([])
            room = capacity
        rows[-1].append(i)
        room -= length
    return rows


def _padded(length: int) -> int:
    return -(-length // PAD_MULTIPLE) * PAD_MULTIPLE


def _sequence_map(rows: list, sequence_ids: list[list[int]], length: int) -> torch.Tensor:
    """[rows, length]: the sequence id of each position, -1 past a row's documents."""
    out = np.full((len(rows), length), -1, dtype=np.int64)
    for r, ((_, _, cu), ids) in enumerate(zip(rows, sequence_ids)):
        out[r, : cu[-1]] = np.repeat(ids, np.diff(cu))
    return torch.from_numpy(out)


def sequence_sums(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Per-sequence sums [2 * pairs] of per-position `values` [rows, length] (chosen, then rejected)."""
    sequence = batch["sequence"].to(values.device).flatten()
    keep = sequence >= 0
    return values.new_zeros(2 * batch["pairs"]).index_add_(0, sequence[keep], values.flatten()[keep])


class Prompts:
    KIND = "prompts"

    def __init__(self, prepared: Prepared, split: str):
        table = prepared.require(self.KIND, split)
        self.ids, self.off = list_column(table, "prompt_ids")
        self.text, self.answer = table.column("prompt").to_pylist(), table.column("answer").to_pylist()

    def __len__(self) -> int:
        return len(self.text)

    def tokens(self, i: int) -> list[int]:
        return self.ids[self.off[i] : self.off[i + 1]].tolist()


def optional(dataset: type, prepared: Prepared, split: str, *args):
    """`dataset` of `split`, or None when prep wrote no rows there (e.g. no val split)."""
    return dataset(prepared, split, *args) if prepared.rows(dataset.KIND, split) else None
