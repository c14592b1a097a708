"""Prep's tables as datasets the engine trains on: rows -> micro batches of model inputs.

Each is built from a `Prepared` output (`alignflow.data.prepared`, the one reader of prep's
format) and implements `alignflow.train.data.Dataset`: `__len__`, `collate(indices)` and
`num_tokens(indices)`.

- `PackedSFT`: packed SFT rows (several documents per row, attention kept inside each).
- `PreferencePairs`: pairs as micro batches of their chosen rows, then their rejected rows,
  padded to the longest sequence of the data set rounded up to a multiple of 8 (one length
  for every micro batch keeps pipeline buffers a fixed shape); with reference log-probs
  (`alignflow.data.logprobs`) each micro batch also carries the reference's per-pair sums.
- `Prompts`: RL prompts with their rendered text and ground-truth answer (not collated: GRPO
  generates from them).
"""

from typing import Sequence

import numpy as np
import torch

from alignflow.data import logprobs
from alignflow.data.prepared import SIDES, Prepared, list_column
from alignflow.train.data import packed_rows

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

    def row(self, i: int):
        a, b = self.ids_off[i], self.ids_off[i + 1]
        return self.ids[a:b], self.mask[a:b], self.cu[self.cu_off[i] : self.cu_off[i + 1]]

    def collate(self, indices: Sequence[int]) -> dict:
        return vars(packed_rows([self.row(int(i)) for i in indices], self.seq_length, self.pad_id))

    def num_tokens(self, indices: Sequence[int]) -> int:
        return int(sum(self.ids_off[i + 1] - self.ids_off[i] for i in indices))


class PreferencePairs:
    KIND = "preference"

    def __init__(self, prepared: Prepared, split: str, reference_uri: str | None = None):
        table = prepared.require(self.KIND, split)
        self.sample_ids = table.column("sample_id").to_numpy()
        self.columns = {side: (list_column(table, f"{side}_input_ids"), list_column(table, f"{side}_loss_mask")) for side in SIDES}
        longest = max(int(np.diff(off).max(initial=1)) for (_, off), _ in self.columns.values())
        self.seq_length = min(prepared.seq_length, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
        self.pad_id = prepared.pad_id
        self.reference = logprobs.read(reference_uri, split, self.sample_ids) if reference_uri else None

    def __len__(self) -> int:
        return len(self.sample_ids)

    def rows(self, side: str, indices: Sequence[int]) -> list:
        (ids, off), (mask, _) = self.columns[side]
        return [(ids[off[i] : off[i + 1]], mask[off[i] : off[i + 1]], [0, int(off[i + 1] - off[i])]) for i in indices]

    def collate(self, indices: Sequence[int]) -> dict:
        indices = [int(i) for i in indices]
        batch = vars(packed_rows([*self.rows("chosen", indices), *self.rows("rejected", indices)], self.seq_length, self.pad_id))
        if self.reference is not None:
            batch |= {f"ref_{name}": torch.from_numpy(values[indices]) for name, values in self.reference.items()}
        return batch

    def num_tokens(self, indices: Sequence[int]) -> int:
        return sum(int(off[i + 1] - off[i]) for (_, off), _ in self.columns.values() for i in indices)


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
