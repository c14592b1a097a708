"""Read raw rows from jsonl / json / parquet / arrow files behind any fsspec URI, in chunks.

A URI names a file, a directory (its supported files, sorted), a glob, or a folder written by
HF `datasets`' `save_to_disk` (its arrow files in the order of its state.json). Rows come in
chunks of a fixed number of rows, read as they are needed, so memory follows the chunk and not
the data set; a chunk parses its rows only when asked (`Chunk.records`), so a rank passes over
the chunks of other ranks for the price of reading them. Every row comes back as a `Record`
that remembers its file and 1-based line (jsonl) or row number, so a bad row can be reported
where a person can find it. Unparseable rows are records too (with `error` set): whether they
raise or are skipped is the caller's policy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
HF_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")  # `datasets`' own files, not rows
GLOB_CHARS = "*?["
READ_BYTES = 1 << 20  # jsonl is read in blocks of this size
PART_LINES = 1024  # and handed on this many lines at a time (the progress's grain)
BATCH_ROWS = 4096  # parquet rows per read


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
        root = path.rstrip("/")
        if fs.isfile(f"{root}/dataset_dict.json"):
            raise ValueError(f"{uri} holds a DatasetDict (save_to_disk): name one of its splits, e.g. {root}/train")
        if fs.isfile(f"{root}/state.json"):
            return fs, _saved_dataset_files(fs, root)
        paths = [p for p in fs.find(path) if not _hidden(p[len(root) :]) and p.rsplit("/", 1)[-1] not in HF_METADATA]
    elif fs.isfile(path):
        return fs, [path]
    else:
        raise FileNotFoundError(f"{uri}: no such file or directory")
    files = sorted(p for p in paths if p.endswith(SUFFIXES) and fs.isfile(p))
    if not files:
        raise FileNotFoundError(f"{uri}: no {', '.join(SUFFIXES)} files")
    return fs, files


def _saved_dataset_files(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """A `save_to_disk` folder's arrow files, in the order its state.json gives (its row order)."""
    with fs.open(f"{root}/state.json", "r") as f:
        return [f"{root}/{entry['filename']}" for entry in json.load(f)["_data_files"]]


def _hidden(relpath: str) -> bool:
    return any(part.startswith((".", "_")) for part in relpath.split("/") if part)


def source_bytes(uri: str) -> int:
    fs, files = list_files(uri)
    return sum(fs.size(p) for p in files)


# ---------------------------------------------------------------- chunks


@dataclass
class Chunk:
    """`size` consecutive rows of a source (the last chunk may have fewer)."""

    index: int  # 0-based chunk number in the source
    start: int  # 0-based number of its first row in the source
    parts: list  # _Lines and _Rows, in order
    bytes_read: int  # bytes of the source read once this chunk was

    def records(self) -> Iterator[Record]:
        for part in self.parts:
            yield from part.records()


def iter_chunks(uri: str, size: int, limit: int | None = None) -> Iterator[Chunk]:
    """The rows of every file of `uri` in order, `size` at a time; the first `limit` only when given."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    fs, files = list_files(uri)
    sizes = [fs.size(p) for p in files]
    left = limit if limit is not None else float("inf")
    parts, count, index, done = [], 0, 0, 0
    for path, nbytes in zip(files, sizes):
        for part, at in _parts(fs, path):
            while len(part) and left:
                head, part = part.split(int(min(size - count, left)))
                parts.append(head)
                count, left = count + len(head), left - len(head)
                if count == size and left:
                    yield Chunk(index, index * size, parts, done + at)
                    parts, count, index = [], 0, index + 1
            if not left:
                break
        done += nbytes
        if not left:
            break
    if parts or index == 0:
        yield Chunk(index, index * size, parts, sum(sizes))


def _parts(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[tuple[_Lines | _Rows, int]]:
    """A file's rows in pieces of bounded size, each with the bytes of the file read so far."""
    source = path if _is_local(fs) else fs.unstrip_protocol(path)
    with fs.open(path, "rb") as f:
        if path.endswith(".parquet"):
            yield from _parquet_parts(f, source, fs.size(path))
        elif path.endswith(".arrow"):
            first = 1
            for batch in _arrow_batches(f):
                yield _Rows(source, first, batch), f.tell()
                first += batch.num_rows
        else:
            yield from _json_parts(f, source, path.endswith(".json"))


def _parquet_parts(f, source: str, nbytes: int) -> Iterator[tuple[_Rows, int]]:
    """Its batches; the bytes read are its share of rows (pyarrow reads ahead)."""
    parquet = pq.ParquetFile(f)
    first, rows = 1, max(parquet.metadata.num_rows, 1)
    for batch in parquet.iter_batches(batch_size=BATCH_ROWS):
        first += batch.num_rows
        yield _Rows(source, first - batch.num_rows, batch), nbytes * (first - 1) // rows


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _arrow_batches(f) -> Iterator[pa.RecordBatch]:
    """Arrow IPC file format, or the stream format HF `datasets` writes with a .arrow suffix."""
    try:
        reader = pa.ipc.open_file(f)
    except pa.ArrowInvalid:
        f.seek(0)
        yield from pa.ipc.open_stream(f)
        return
    for i in range(reader.num_record_batches):
        yield reader.get_batch(i)


def _json_parts(f, source: str, json_file: bool) -> Iterator[tuple[_Lines | _Rows, int]]:
    """JSON Lines, streamed; a .json file may also hold one array of objects (HF accepts both),
    which is parsed whole."""
    block = f.read(READ_BYTES)
    if json_file and block.lstrip().startswith(b"["):
        text = block + f.read()
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            yield _Lines(source, [e.lineno], [b""], f"invalid JSON: {e.msg}"), f.tell()
            return
        yield _Rows(source, 1, rows), f.tell()
        return
    number, rest, at = 0, b"", 0  # at: where `rest` starts in the file
    while block:
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        for start in range(0, len(lines), PART_LINES):
            numbers, kept = [], []
            for line in lines[start : start + PART_LINES]:
                number += 1
                at += len(line) + 1
                if line.strip():
                    numbers.append(number)
                    kept.append(line)
            yield _Lines(source, numbers, kept), at
        block = f.read(READ_BYTES)
    if rest.strip():
        yield _Lines(source, [number + 1], [rest]), at + len(rest)


@dataclass
class _Lines:
    """JSON lines not parsed yet (blank lines left out, their numbers kept)."""

    source: str
    numbers: list[int]
    lines: list[bytes]
    error: str | None = None  # the whole file failed to parse

    def __len__(self) -> int:
        return len(self.lines)

    def split(self, n: int) -> tuple[_Lines, _Lines]:
        return (_Lines(self.source, self.numbers[:n], self.lines[:n], self.error), _Lines(self.source, self.numbers[n:], self.lines[n:], self.error))

    def records(self) -> Iterator[Record]:
        return map(self._record, self.numbers, self.lines)

    def _record(self, number: int, line: bytes) -> Record:
        if self.error:
            return Record(self.source, "line", number, None, self.error)
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return Record(self.source, "line", number, None, f"invalid JSON: {e.msg} at column {e.colno}")
        except UnicodeDecodeError as e:
            return Record(
                self.source, "line", number, None, f"not UTF-8: byte 0x{e.object[e.start]:02x} at column {e.start + 1} (re-encode the file as UTF-8)"
            )
        return _checked(self.source, "line", number, row)


@dataclass
class _Rows:
    """Rows of a table batch (parquet, arrow) or of a parsed JSON array, numbered from `first`."""

    source: str
    first: int
    rows: pa.RecordBatch | list

    def __len__(self) -> int:
        return len(self.rows)

    def split(self, n: int) -> tuple[_Rows, _Rows]:
        return _Rows(self.source, self.first, self.rows[:n]), _Rows(self.source, self.first + n, self.rows[n:])

    def records(self) -> Iterator[Record]:
        rows = self.rows.to_pylist() if isinstance(self.rows, pa.RecordBatch) else self.rows
        return (_checked(self.source, "row", self.first + i, row) for i, row in enumerate(rows))


def _checked(source: str, unit: str, number: int, row) -> Record:
    if not isinstance(row, dict):
        return Record(source, unit, number, None, f"expected a JSON object, got {type(row).__name__}")
    return Record(source, unit, number, row)
