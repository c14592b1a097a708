"""How the prep stage's ranks share work: a scratch folder in the output, and the job's ranks.

`{out}/_prep` (any fsspec filesystem all ranks see; removed when prep ends):

    {kind}/{source}/NNNNNN.arrow          a chunk of tokenized rows, by the rank that owned it
    {kind}/{source}/NNNNNN.index.arrow    the same rows' INDEX columns only (what every rank reads)
    {kind}/errors/S-NNNNNN                the first bad row of source S, chunk N: its message
    {kind}/pieces/{split}/SSSSS/...       documents on their way to output shard SSSSS
    progress/R.json                       rank R's counts, for rank 0's progress line

Chunk i is rank i % world's; output shard k (counted over a dataset's splits) is rank
k % world's. Everything the ranks exchange goes through these files; their only collective is
a barrier between phases, so ranks on several nodes need nothing but a store they all see.
Arrow IPC files: written and read at memory speed, with no encoding cost.

Writing SFT rows (`write_packed`) needs every document's tokens in the output row that
packing gave it, anywhere in the split: each rank routes the documents of its chunks to their
output shards (one piece per chunk and shard, holding each document's token offset in the
shard), then each rank assembles its shards from their pieces. Preference pairs and prompts
keep their order (`write_in_order`): a shard reads the few chunks its rows came from.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import torch.distributed as dist

from alignflow.data.prepared import SCHEMAS, write_shard

OK, SKIPPED, NO_LOSS = 0, 1, 2  # a row's status
# What every rank reads of every row (the rest of a chunk, only the rank that needs it).
INDEX = pa.schema([("status", pa.int8()), ("truncated", pa.int8()), ("tokens", pa.int32()), ("loss_tokens", pa.int32())])
log = logging.getLogger("alignflow.prep")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the job's ranks (`alignflow.worker` set up their group)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def of_job(cls) -> Ranks:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def mine(self, i: int) -> bool:
        return i % self.world == self.rank

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


class Spill:
    """The scratch folder `{out}/_prep` and the output `out` itself."""

    def __init__(self, out: str):
        self.out = out
        self.fs, root = fsspec.core.url_to_fs(out)
        self.root = f"{root.rstrip('/')}/_prep"

    def start(self, ranks: Ranks) -> None:
        """Clear what a failed attempt left in the same `out`."""
        if ranks.rank == 0 and self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)
        ranks.barrier()

    def remove(self) -> None:
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)

    def write_chunk(self, kind: str, source: str, chunk: int, table: pa.Table) -> None:
        self._write(self._path(kind, source, f"{chunk:06d}.arrow"), table)
        self._write(self._path(kind, source, f"{chunk:06d}.index.arrow"), table.select(INDEX.names))

    def read_chunk(self, kind: str, source: str, chunk: int) -> pa.Table:
        return self._read(self._path(kind, source, f"{chunk:06d}.arrow"))

    def index(self, kind: str, source: str) -> dict[str, np.ndarray]:
        """The INDEX columns of every row of a source, and `starts`: its chunks' first rows (and the end)."""
        tables = [self._read(p) for p in sorted(self.fs.glob(self._path(kind, source, "*.index.arrow")))]
        index = {name: np.concatenate([t.column(name).to_numpy() for t in tables]) for name in INDEX.names}
        index["starts"] = np.cumsum([0] + [t.num_rows for t in tables])
        return index

    # -- the first bad row, so that every rank raises the same error

    def fail(self, kind: str, source: int, chunk: int, message: str) -> None:
        self.fs.makedirs(self._path(kind, "errors"), exist_ok=True)
        self.fs.pipe(self._path(kind, "errors", f"{source}-{chunk:06d}"), message.encode())

    def _failures(self, kind: str) -> list[str]:
        folder = self._path(kind, "errors")
        return sorted(self.fs.ls(folder, detail=False)) if self.fs.exists(folder) else []

    def failed_before(self, kind: str, source: int, chunk: int) -> bool:
        """Whether a row before this chunk (in file order) failed already: this one cannot matter."""
        return any(path.rsplit("/", 1)[-1] < f"{source}-{chunk:06d}" for path in self._failures(kind))

    def first_failure(self, kind: str) -> str | None:
        failures = self._failures(kind)
        return self.fs.cat(failures[0]).decode() if failures else None

    # -- pieces of output shards

    def write_piece(self, kind: str, split: str, shard: int, name: str, table: pa.Table) -> None:
        self._write(self._path(kind, "pieces", split, f"{shard:05d}", f"{name}.arrow"), table)

    def pieces(self, kind: str, split: str, shard: int) -> list[pa.Table]:
        folder = self._path(kind, "pieces", split, f"{shard:05d}")
        return [self._read(p) for p in sorted(self.fs.ls(folder, detail=False))] if self.fs.exists(folder) else []

    # -- progress counts

    def put_counts(self, rank: int, counts: dict) -> None:
        self.fs.makedirs(self._path("progress"), exist_ok=True)
        self.fs.pipe(self._path("progress", f"{rank}.json"), json.dumps(counts).encode())

    def counts(self, rank: int) -> dict | None:
        """Rank `rank`'s latest counts; None before its first, or while it is being written."""
        try:
            return json.loads(self.fs.cat(self._path("progress", f"{rank}.json")))
        except (FileNotFoundError, ValueError):
            return None

    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _write(self, path: str, table: pa.Table) -> None:
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(path, "wb") as f, pa.ipc.new_file(f, table.schema) as writer:
            writer.write_table(table)

    def _read(self, path: str) -> pa.Table:
        with self.fs.open(path, "rb") as f:
            return pa.ipc.open_file(f).read_all()


class Progress:
    """Rows read, rows/s, tokens and an ETA, logged by rank 0 every `interval_s` while the ranks
    tokenize (its log is the one the orchestrator forwards). The other ranks leave their counts
    in the spill as often, and rank 0 adds them up. The percent is of the input's bytes: every
    rank reads them all, so rank 0's place in them is the job's."""

    def __init__(self, spill: Spill, ranks: Ranks, total_bytes: int, interval_s: float):
        self.spill, self.ranks, self.total, self.interval = spill, ranks, max(total_bytes, 1), interval_s
        self.started = self.last = time.monotonic()
        self.rows = self.tokens = self.done = self.source = self.position = 0

    def begin(self, source_bytes: int) -> None:
        """A source starts: the bytes before it are read."""
        self.done, self.source = self.done + self.source, source_bytes
        self.position = self.done

    def at(self, bytes_read: int) -> None:
        self.position = self.done + bytes_read

    def add(self, rows: int, tokens: int) -> None:
        self.rows, self.tokens = self.rows + rows, self.tokens + tokens
        if time.monotonic() - self.last >= self.interval:
            self.report() if self.ranks.rank == 0 else self.flush()

    def flush(self) -> None:
        """Leave this rank's counts for rank 0."""
        if self.ranks.rank != 0:
            self.spill.put_counts(self.ranks.rank, {"rows": self.rows, "tokens": self.tokens})
        self.last = time.monotonic()

    def report(self) -> None:
        """Rank 0: the job's counts so far, in one log line."""
        if self.ranks.rank != 0:
            return
        others = [self.spill.counts(r) or {"rows": 0, "tokens": 0} for r in range(1, self.ranks.world)]
        rows, tokens = self.rows + sum(c["rows"] for c in others), self.tokens + sum(c["tokens"] for c in others)
        elapsed = max(time.monotonic() - self.started, 1e-9)
        read = min(self.position / self.total, 1.0)
        eta = f"{elapsed * (1 - read) / read:.0f} s" if read else "?"
        log.info("%.1f%% done, %s rows read, %s rows/s, %.1fM tokens, ETA %s",
                 100 * read, f"{rows:,}", f"{rows / elapsed:,.0f}", tokens / 1e6, eta)
        self.last = time.monotonic()

    def finish(self) -> None:
        if self.ranks.rank == 0:
            log.info("done in %.1f s", time.monotonic() - self.started)


# ---------------------------------------------------------------- writing shards


@dataclass(frozen=True)
class Layout:
    """Where a split's documents go: output row r holds docs[order[offsets[r]:offsets[r + 1]]]."""

    docs: np.ndarray  # sample ids (int64), ascending
    lengths: np.ndarray  # their token counts (int32)
    order: np.ndarray  # indices into docs (int32), in output order
    offsets: np.ndarray  # row boundaries in `order` (int64)

    def shards(self, rows_per_shard: int) -> int:
        return max(-(-(len(self.offsets) - 1) // rows_per_shard), 1)

    def shard(self, i: int, rows_per_shard: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard i's documents (indices into docs, in output order) and its row boundaries in them."""
        bounds = self.offsets[i * rows_per_shard : (i + 1) * rows_per_shard + 1]
        return self.order[bounds[0] : bounds[-1]], bounds - bounds[0]

    def destinations(self, rows_per_shard: int) -> tuple[np.ndarray, np.ndarray]:
        """Per document (as in docs): its output shard and its first token's offset in that shard."""
        shard, offset = np.empty(len(self.docs), np.int32), np.empty(len(self.docs), np.int64)
        if len(self.docs):
            lengths = self.lengths[self.order]
            starts = np.cumsum(lengths, dtype=np.int64)
            starts -= lengths
            shard_at = np.repeat(np.arange(len(self.offsets) - 1, dtype=np.int32) // rows_per_shard, np.diff(self.offsets))
            shard[self.order] = shard_at
            offset[self.order] = starts - starts[self.offsets[:-1:rows_per_shard]][shard_at]
        return shard, offset


def write_packed(spill: Spill, ranks: Ranks, index: dict[str, dict], splits: dict[str, tuple[str, Layout]],
                 rows_per_shard: int) -> None:
    """SFT rows: every rank routes the documents of its chunks to their shards, then assembles its shards."""
    routes = {split: (source, layout, *layout.destinations(rows_per_shard)) for split, (source, layout) in splits.items()}
    for source in dict.fromkeys(source for source, _ in splits.values()):
        starts = index[source]["starts"]
        for chunk in range(len(starts) - 1):
            if ranks.mine(chunk):
                _route(spill, source, chunk, int(starts[chunk]), int(starts[chunk + 1]), routes)
    del routes
    ranks.barrier()  # every piece written
    jobs = [(split, layout, i) for split, (_, layout) in splits.items() for i in range(layout.shards(rows_per_shard))]
    for k, (split, layout, i) in enumerate(jobs):
        if ranks.mine(k):
            write_shard(spill.out, "sft", split, i, _assemble(spill, split, layout, i, rows_per_shard))


def _route(spill: Spill, source: str, chunk: int, first: int, end: int, routes: dict) -> None:
    """One chunk's documents, in one piece per split and output shard they go to."""
    table = None
    for split, (src, layout, shard, offset) in routes.items():
        a, b = np.searchsorted(layout.docs, [first, end]) if src == source else (0, 0)
        if a == b:
            continue
        if table is None:
            table = spill.read_chunk("sft", source, chunk).select(["input_ids", "loss_mask"])
        docs = table.take(layout.docs[a:b] - first)
        by_shard = np.argsort(shard[a:b], kind="stable")
        for part in np.split(by_shard, np.flatnonzero(np.diff(shard[a:b][by_shard])) + 1):
            piece = docs.take(part).append_column("offset", pa.array(offset[a:b][part]))
            spill.write_piece("sft", split, int(shard[a + part[0]]), f"{source}-{chunk:06d}", piece)


def _assemble(spill: Spill, split: str, layout: Layout, i: int, rows_per_shard: int) -> pa.Table:
    """Shard i of a split: its documents' tokens put in place from its pieces, then cut into rows."""
    docs, bounds = layout.shard(i, rows_per_shard)
    lengths = layout.lengths[docs]
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    ids, mask = np.empty(ends[-1], np.int32), np.empty(ends[-1], np.int8)
    for piece in spill.pieces("sft", split, i):
        column = piece.column("input_ids").combine_chunks()
        starts = column.offsets.to_numpy()
        at = np.repeat(piece.column("offset").to_numpy() - starts[:-1], np.diff(starts)) + np.arange(starts[0], starts[-1])
        ids[at] = column.flatten().to_numpy()
        mask[at] = piece.column("loss_mask").combine_chunks().flatten().to_numpy()
    rows = len(bounds) - 1
    row_of_doc = np.repeat(np.arange(rows), np.diff(bounds))
    cu = np.zeros(len(docs) + rows, np.int32)
    cu[np.arange(len(docs)) + row_of_doc + 1] = ends[1:] - ends[bounds[:-1]][row_of_doc]
    return pa.Table.from_arrays([
        pa.ListArray.from_arrays(pa.array(ends[bounds].astype(np.int32)), pa.array(ids)),
        pa.ListArray.from_arrays(pa.array(ends[bounds].astype(np.int32)), pa.array(mask)),
        pa.ListArray.from_arrays(pa.array((bounds + np.arange(rows + 1)).astype(np.int32)), pa.array(cu)),
        pa.ListArray.from_arrays(pa.array(bounds.astype(np.int32)), pa.array(layout.docs[docs])),
    ], schema=SCHEMAS["sft"])


def write_in_order(spill: Spill, ranks: Ranks, kind: str, index: dict[str, dict], splits: dict[str, tuple[str, np.ndarray]],
                   rows_per_shard: int) -> None:
    """Preference pairs and prompts: a split's good rows in order, rows_per_shard to a shard."""
    jobs = []
    for split, (source, rows) in splits.items():
        ok = rows[index[source]["status"][rows] == OK]
        jobs += [(split, source, i, ok[i * rows_per_shard : (i + 1) * rows_per_shard])
                 for i in range(max(-(-len(ok) // rows_per_shard), 1))]
    for k, (split, source, i, rows) in enumerate(jobs):
        if ranks.mine(k):
            write_shard(spill.out, kind, split, i, _gather(spill, kind, source, index[source]["starts"], rows))


def _gather(spill: Spill, kind: str, source: str, starts: np.ndarray, rows: np.ndarray) -> pa.Table:
    """These rows (sample ids, ascending) from the chunks that hold them."""
    chunks = np.searchsorted(starts, rows, side="right") - 1
    tables = [spill.read_chunk(kind, source, c).take(rows[chunks == c] - starts[c]) for c in np.unique(chunks)]
    return pa.concat_tables(tables) if tables else spill.read_chunk(kind, source, 0).slice(0, 0)
