"""Prep's output format: its one writer (`ShardWriter` and `write_metadata`, used by the prep
stage) and its one reader (`Prepared`, used by every stage that reads prepared data). Column
names live here.

    {out}/metadata.json                     counts per dataset and split, tokenizer ids, seq_length
    {out}/sft/{split}-NNNNN.parquet         input_ids list<int32>; loss_mask list<int8> (1 = predict
                                            this token); cu_seqlens list<int32> (document offsets:
                                            0, ..., len(input_ids)); sample_ids list<int64>
    {out}/preference/{split}-NNNNN.parquet  sample_id int64; prompt_length int32; chosen_input_ids,
                                            rejected_input_ids list<int32>; chosen_loss_mask,
                                            rejected_loss_mask list<int8>
    {out}/prompts/{split}-NNNNN.parquet     sample_id int64; prompt_ids list<int32> (ending with the
                                            generation prompt); prompt string; answer string

A split that exists has at least one shard, maybe empty. No torch here: training batches are
built from these tables by `alignflow.job.train` (`PackedSFT`, `PreferencePairs`, `Prompts`).
"""

import json
from dataclasses import dataclass
from functools import cached_property

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

METADATA = "metadata.json"
DATASETS = ("sft", "preference", "prompts")
SIDES = ("chosen", "rejected")
ROW_GROUP_ROWS = 256
SCHEMAS = {
    "sft": pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("cu_seqlens", pa.list_(pa.int32())),
            ("sample_ids", pa.list_(pa.int64())),
        ]
    ),
    "preference": pa.schema(
        [
            ("sample_id", pa.int64()),
            ("prompt_length", pa.int32()),
            *[(f"{side}_{column}", pa.list_(dtype)) for side in SIDES for column, dtype in (("input_ids", pa.int32()), ("loss_mask", pa.int8()))],
        ]
    ),
    "prompts": pa.schema([("sample_id", pa.int64()), ("prompt_ids", pa.list_(pa.int32())), ("prompt", pa.string()), ("answer", pa.string())]),
}


class ShardWriter:
    """Writes `{out}/{dataset}/{split}-{index:05d}.parquet` a table of rows at a time, so a shard
    never has to be in memory whole. Row groups hold ROW_GROUP_ROWS rows whatever the tables
    given (the bytes do not depend on how the rows were cut), which also keeps the writer's
    own memory near a row group's. Shards are numbered from 0 without gaps; a split that
    exists has at least one shard (maybe empty)."""

    def __init__(self, out: str, dataset: str, split: str, index: int):
        self.schema = SCHEMAS[dataset]
        fs, root = fsspec.core.url_to_fs(out)
        fs.makedirs(f"{root.rstrip('/')}/{dataset}", exist_ok=True)
        self.file = fs.open(f"{root.rstrip('/')}/{dataset}/{split}-{index:05d}.parquet", "wb")
        self.writer = pq.ParquetWriter(self.file, self.schema)
        self.pending = self.schema.empty_table()

    def write(self, table: pa.Table) -> None:
        self.pending = pa.concat_tables([self.pending, table.select(self.schema.names).cast(self.schema)])
        while self.pending.num_rows >= ROW_GROUP_ROWS:
            self._flush(self.pending.slice(0, ROW_GROUP_ROWS))
            self.pending = self.pending.slice(ROW_GROUP_ROWS)

    def _flush(self, table: pa.Table) -> None:
        self.writer.write_table(table.combine_chunks())

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.pending.num_rows:
            self._flush(self.pending)
        self.writer.close()
        self.file.close()


def write_metadata(out: str, meta: dict) -> None:
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    fs.pipe(f"{root.rstrip('/')}/{METADATA}", (json.dumps(meta, indent=2) + "\n").encode())


@dataclass(frozen=True)
class Prepared:
    """A prep output, by URI (any fsspec filesystem)."""

    uri: str

    @cached_property
    def meta(self) -> dict:
        with fsspec.open(f"{self.uri.rstrip('/')}/{METADATA}", "r") as f:
            return json.load(f)

    @property
    def seq_length(self) -> int:
        return self.meta["seq_length"]

    @property
    def max_prompt_length(self) -> int:
        """The longest prompt prep kept (data.max_prompt_length): with max_new_tokens, a generation engine's context."""
        return self.meta["max_prompt_length"]

    @property
    def tokenizer(self) -> dict:
        return self.meta["tokenizer"]

    @property
    def pad_id(self) -> int:
        """The tokenizer's pad id, else its eos id (what the model sees past a sequence's end)."""
        tok = self.tokenizer
        return tok["pad_token_id"] if tok["pad_token_id"] is not None else tok["eos_token_id"]

    def table(self, dataset: str, split: str) -> pa.Table | None:
        """Every shard of `dataset`'s `split` as one table; None when there are no rows."""
        fs, files = self._shards(dataset, split)
        if not files:
            return None
        table = pa.concat_tables([pq.read_table(f, filesystem=fs) for f in files])
        return table if table.num_rows else None

    def rows(self, dataset: str, split: str) -> int:
        """How many rows `dataset`'s `split` has (from the Parquet footers only)."""
        fs, files = self._shards(dataset, split)
        return sum(pq.ParquetFile(fs.open(f, "rb")).metadata.num_rows for f in files)

    def _shards(self, dataset: str, split: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
        fs, root = fsspec.core.url_to_fs(f"{self.uri.rstrip('/')}/{dataset}")
        return fs, sorted(fs.glob(f"{root.rstrip('/')}/{split}-*.parquet"))

    def require(self, dataset: str, split: str = "train") -> pa.Table:
        table = self.table(dataset, split)
        if table is None:
            raise FileNotFoundError(f"{self.uri}/{dataset} has no {split} rows: run prep with data.{dataset} set")
        return table


def list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets) of a list column: row i is values[offsets[i]:offsets[i + 1]]."""
    column = table.column(name).combine_chunks()
    if isinstance(column, pa.ChunkedArray):  # an empty table
        column = pa.array([], type=column.type)
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy(zero_copy_only=False)
    return values[offsets[0] : offsets[-1]], offsets - offsets[0]
