"""Preference pairs as micro batches: the chosen rows of the pairs, then their rejected rows.

Rows come from prep's `preference/` Parquet (single documents, so `cu_seqlens` is [0, n]),
padded to the longest sequence of the dataset rounded up to a multiple of 8, not to the
prep's seq_length: pairs are usually far shorter than a packed SFT row, and one length for
every micro batch keeps pipeline-parallel buffers a fixed shape;
with `reference` (the ref_logprobs stage's output for the same split, joined on sample_id)
each micro batch also carries the reference model's per-pair log-prob sums and token counts.
"""

from typing import Sequence

import numpy as np
import pyarrow as pa
import torch

from alignflow.train.data import list_column, packed_rows, read_split

SIDES = ("chosen", "rejected")
PAD_MULTIPLE = 8
REFERENCE_COLUMNS = ("chosen_logp", "rejected_logp", "chosen_tokens", "rejected_tokens")


class PreferencePairs:
    def __init__(self, table: pa.Table, seq_length: int, pad_id: int, reference: pa.Table | None = None):
        self.sample_ids = table.column("sample_id").to_numpy()
        self.columns = {side: (list_column(table, f"{side}_input_ids"), list_column(table, f"{side}_loss_mask")) for side in SIDES}
        longest = max(int(np.diff(off).max(initial=1)) for (_, off), _ in self.columns.values())
        self.seq_length, self.pad_id = min(seq_length, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE), pad_id
        self.reference = _aligned(reference, self.sample_ids) if reference is not None else None

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


def _aligned(reference: pa.Table, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The reference columns in the order of `sample_ids`; every pair must have its values."""
    position = {sid: i for i, sid in enumerate(reference.column("sample_id").to_pylist())}
    missing = [int(sid) for sid in sample_ids if sid not in position]
    if missing:
        raise KeyError(f"reference log-probs lack sample ids {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    order = np.array([position[sid] for sid in sample_ids], dtype=np.int64)
    return {name: reference.column(name).to_numpy()[order] for name in REFERENCE_COLUMNS}


def load_pairs(data_uri: str, split: str, seq_length: int, pad_id: int, reference_uri: str | None = None) -> PreferencePairs | None:
    table = read_split(f"{data_uri.rstrip('/')}/preference", split)
    if table is None or not table.num_rows:
        return None
    reference = read_split(reference_uri, split) if reference_uri else None
    if reference_uri and reference is None:
        raise FileNotFoundError(f"{reference_uri}: no {split}-*.parquet reference log-probs")
    return PreferencePairs(table, seq_length, pad_id, reference)
