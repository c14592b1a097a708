"""The teacher_logprobs stage's output format: its one writer and its one reader.

    {out}/{split}-NNNNN.parquet   row int64 (the row's index in prep's sft/{split} tables, in
                                  shard order); tokens int32 (the row's length, checked on
                                  read); positions list<int32> (the row's loss positions t: t
                                  predicts token t + 1); ids list<int32>, logprobs list<float32>
                                  (k per position, flat, best first: the teacher's top-k next
                                  tokens and their log-probs under its full-vocab softmax)

k is the schema metadata's `topk_logits_k`. One shard per data-parallel rank; `row` joins them
to prep's packed SFT rows. Log-probs are the full-vocab ones (not renormalised over the top-k),
so a consumer may renormalise (NeMo-RL does) or not. No torch here.
"""

from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        ("row", pa.int64()),
        ("tokens", pa.int32()),
        ("positions", pa.list_(pa.int32())),
        ("ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
    ]
)
K_KEY = b"topk_logits_k"


def write(columns: dict[str, list], k: int, out: str, split: str, shard: int) -> None:
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    schema = SCHEMA.with_metadata({K_KEY: str(k).encode()})
    table = pa.Table.from_arrays([pa.array(columns[name], f.type) for name, f in zip(SCHEMA.names, SCHEMA)], schema=schema)
    with fs.open(f"{root.rstrip('/')}/{split}-{shard:05d}.parquet", "wb") as f:
        pq.write_table(table, f)


@dataclass
class TeacherTopK:
    """The teacher's top-k of every row of a split, flat: row i's positions are
    positions[off[i]:off[i + 1]] and their (ids, logprobs) the same slice of the [n, k] arrays."""

    k: int
    tokens: np.ndarray  # [rows] int32
    off: np.ndarray  # [rows + 1] int64
    positions: np.ndarray  # [n] int32
    ids: np.ndarray  # [n, k] int32
    logprobs: np.ndarray  # [n, k] float32

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.off[i], self.off[i + 1]
        return self.positions[a:b], self.ids[a:b], self.logprobs[a:b]


def read(uri: str, split: str, num_rows: int) -> TeacherTopK:
    """Every row 0..num_rows-1 of `split`, in row order; a row without values is an error."""
    fs, root = fsspec.core.url_to_fs(uri)
    files = sorted(fs.glob(f"{root.rstrip('/')}/{split}-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{uri}: no {split}-*.parquet teacher top-k log-probs")
    tables = [pq.read_table(f, filesystem=fs) for f in files]
    k = int(tables[0].schema.metadata[K_KEY])
    table = pa.concat_tables(tables)
    rows = table.column("row").to_numpy()
    if sorted(rows.tolist()) != list(range(num_rows)):
        raise KeyError(
            f"{uri}: teacher top-k rows of {split} are not the {num_rows} rows of the prepared data "
            f"(got {len(rows)} rows): computed on another prep output?"
        )
    order = np.argsort(rows, kind="stable")
    table = table.take(pa.array(order))
    positions = table.column("positions").combine_chunks()
    lengths = np.diff(positions.offsets.to_numpy()).astype(np.int64)
    flat = {name: _flat(table, name) for name in ("ids", "logprobs")}
    return TeacherTopK(
        k=k,
        tokens=table.column("tokens").to_numpy(),
        off=np.r_[0, np.cumsum(lengths)],
        positions=_flat(table, "positions"),
        ids=flat["ids"].reshape(-1, k),
        logprobs=flat["logprobs"].reshape(-1, k),
    )


def _flat(table: pa.Table, name: str) -> np.ndarray:
    column = table.column(name).combine_chunks()
    if isinstance(column, pa.ChunkedArray):  # an empty table
        column = pa.array([], type=column.type)
    offsets = column.offsets.to_numpy()
    return column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
