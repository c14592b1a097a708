"""Read raw rows from jsonl / json / parquet / arrow files behind any fsspec URI.

A URI names a file, a directory (its supported files, sorted) or a glob. Every row comes
back as a `Record` that remembers its file and 1-based line (jsonl) or row number, so a bad
row can be reported where a person can find it. Unparseable rows are records too (with
`error` set): whether they raise or are skipped is the caller's policy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Record:
    source: str  # file URI as shown in messages
    unit: str  # "line" for jsonl, "row" otherwise
    number: int  # 1-based line or row number within the file
    row: dict | None  # the parsed row, or None when it could not be parsed
    error: str | None = None  # parse error, with the field when there is one

    def where(self) -> str:
        return f"{self.source} {self.unit} {self.number}"


def list_files(uri: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The supported files a URI names, sorted, so row order is reproducible."""
    fs, path = fsspec.core.url_to_fs(uri)
    if any(c in path for c in GLOB_CHARS):
        paths = fs.glob(path)
    elif fs.isdir(path):
        paths = [p for p in fs.find(path) if not _hidden(p[len(path.rstrip("/")) :])]
    elif fs.isfile(path):
        return fs, [path]
    else:
        raise FileNotFoundError(f"{uri}: no such file or directory")
    files = sorted(p for p in paths if p.endswith(SUFFIXES) and fs.isfile(p))
    if not files:
        raise FileNotFoundError(f"{uri}: no {', '.join(SUFFIXES)} files")
    return fs, files


def _hidden(relpath: str) -> bool:
    return any(part.startswith((".", "_")) for part in relpath.split("/") if part)


def read_records(uri: str, limit: int | None = None) -> list[Record]:
    """All rows of all files of `uri` in order, the first `limit` only when given."""
    fs, files = list_files(uri)
    rows = (rec for path in files for rec in _read_file(fs, path))
    return list(islice(rows, limit))


def _read_file(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[Record]:
    source = path if _is_local(fs) else fs.unstrip_protocol(path)
    if path.endswith(".parquet"):
        yield from _read_table_rows(source, _iter_parquet(fs, path))
    elif path.endswith(".arrow"):
        yield from _read_table_rows(source, _iter_arrow(fs, path))
    else:
        with fs.open(path, "rb") as f:
            text = f.read().decode("utf-8")
        yield from _read_json_text(source, text, json_array=path.endswith(".json"))


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _read_json_text(source: str, text: str, json_array: bool) -> Iterator[Record]:
    """JSON Lines; a .json file may also hold one array of objects (HF accepts both)."""
    if json_array and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            yield Record(source, "line", e.lineno, None, f"invalid JSON: {e.msg}")
            return
        for i, row in enumerate(rows, 1):
            yield _checked(source, "row", i, row)
        return
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield Record(source, "line", i, None, f"invalid JSON: {e.msg} at column {e.colno}")
            continue
        yield _checked(source, "line", i, row)


def _checked(source: str, unit: str, number: int, row) -> Record:
    if not isinstance(row, dict):
        return Record(source, unit, number, None, f"expected a JSON object, got {type(row).__name__}")
    return Record(source, unit, number, row)


def _read_table_rows(source: str, batches: Iterator[pa.RecordBatch]) -> Iterator[Record]:
    number = 0
    for batch in batches:
        for row in batch.to_pylist():
            number += 1
            yield Record(source, "row", number, row)


def _iter_parquet(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[pa.RecordBatch]:
    with fs.open(path, "rb") as f:
        yield from pq.ParquetFile(f).iter_batches(batch_size=4096)


def _iter_arrow(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[pa.RecordBatch]:
    """Arrow IPC file format, or the stream format HF `datasets` writes with a .arrow suffix."""
    with fs.open(path, "rb") as f:
        data = f.read()
    try:
        reader = pa.ipc.open_file(pa.BufferReader(data))
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        batches = iter(pa.ipc.open_stream(pa.BufferReader(data)))
    yield from batches
