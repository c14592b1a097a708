"""How the prep stage's ranks share work: a scratch folder in the output, and the job's ranks.

`{out}/_prep` (any fsspec filesystem all ranks see; removed when prep ends):

    {kind}/{source}/NNNNNN.arrow                     chunk N of a source, tokenized (sample_id, INDEX, payload)
    {kind}/{source}/NNNNNN.index.arrow               its INDEX columns alone (what rank 0 reads of every row)
    {kind}/errors/S-NNNNNN                           the first bad row of source S's chunk N: its message
    {kind}/plans/{source}/{split}-SSSSS.arrow        what output shard SSSSS holds (rank 0's plan)
    sft/routes/{split}/{source}-NNNNNN.arrow         where chunk N's documents go (rank 0's plan)
    sft/pieces/{split}/SSSSS/{source}-NNNNNN.arrow   chunk N's documents for output shard SSSSS
    progress/R.json                                  rank R's counts, for rank 0's progress line

Chunk i is rank i % world's; then rank 0 alone reads the index of every row, splits, counts
and packs (the only work that sees the whole data set, so the only memory that grows with it,
on one rank) and writes its plan; route table k and output shard k are rank k % world's.
Everything the ranks exchange goes through these files; their only collective is a barrier
between phases, so ranks on several nodes need nothing but a store they all see. Arrow IPC
files: written and read at memory speed, with no encoding cost.

Writing SFT rows needs every document's tokens in the output row packing gave it, anywhere in
the split: the documents of each chunk go to their output shards in pieces (each document with
its token offset in the shard), then each shard is put together from its pieces, a slice of
rows at a time. Preference pairs and prompts keep their order: a shard reads the few chunks
its rows came from.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import torch.distributed as dist

from alignflow.job.data.prepared import ROW_GROUP_ROWS, SCHEMAS, ShardWriter

OK, SKIPPED, NO_LOSS = 0, 1, 2  # a row's status
# What rank 0 reads of every row to split, count and pack (the rest of a chunk only the ranks that write it).
INDEX = pa.schema([("status", pa.int8()), ("truncated", pa.int8()), ("tokens", pa.int32()), ("loss_tokens", pa.int32())])
SLICE_TOKENS = 1 << 22  # an SFT shard is put together this many tokens (20 MB) at a time
log = logging.getLogger("alignflow.prep")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the job's ranks (`alignflow.job.worker` set up their group)."""

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

    # -- rank 0's plan: where documents go (SFT) and what each output shard holds

    def write_route(self, split: str, source: str, chunk: int, table: pa.Table) -> None:
        self._write(self._path("sft", "routes", split, f"{source}-{chunk:06d}.arrow"), table)

    def routes(self) -> list[tuple[str, str, int]]:
        """(split, source, chunk) of every route table."""
        found = []
        for path in sorted(self.fs.glob(self._path("sft", "routes", "*", "*.arrow"))):
            split, name = path.split("/")[-2:]
            source, chunk = name.removesuffix(".arrow").rsplit("-", 1)
            found.append((split, source, int(chunk)))
        return found

    def read_route(self, split: str, source: str, chunk: int) -> pa.Table:
        return self._read(self._path("sft", "routes", split, f"{source}-{chunk:06d}.arrow"))

    def write_plan(self, kind: str, source: str, split: str, shard: int, table: pa.Table) -> None:
        self._write(self._path(kind, "plans", source, f"{split}-{shard:05d}.arrow"), table)

    def plans(self, kind: str) -> list[tuple[str, str, int]]:
        """(source, split, shard) of every output shard."""
        found = []
        for path in sorted(self.fs.glob(self._path(kind, "plans", "*", "*.arrow"))):
            source, name = path.split("/")[-2:]
            split, shard = name.removesuffix(".arrow").rsplit("-", 1)
            found.append((source, split, int(shard)))
        return found

    def read_plan(self, kind: str, source: str, split: str, shard: int) -> pa.Table:
        return self._read(self._path(kind, "plans", source, f"{split}-{shard:05d}.arrow"))

    def write_piece(self, split: str, shard: int, name: str, table: pa.Table) -> None:
        self._write(self._path("sft", "pieces", split, f"{shard:05d}", f"{name}.arrow"), table)

    def pieces(self, split: str, shard: int) -> Iterator[pa.Table]:
        """The pieces of an SFT output shard, one at a time."""
        folder = self._path("sft", "pieces", split, f"{shard:05d}")
        for path in sorted(self.fs.ls(folder, detail=False)) if self.fs.exists(folder) else []:
            yield self._read(path)

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
        log.info(
            "%.1f%% done, %s rows read, %s rows/s, %.1fM tokens, ETA %s",
            100 * read,
            f"{rows:,}",
            f"{rows / elapsed:,.0f}",
            tokens / 1e6,
            eta,
            extra={"event": {"percent": 100 * read}},
        )
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


def plan_packed(spill: Spill, split: str, source: str, layout: Layout, starts: np.ndarray, rows_per_shard: int) -> None:
    """Rank 0, for an SFT split: per output shard, its documents in output order with their
    rows; per chunk, where its documents go (shard, and the token offset there: int32, as the
    list offsets that address a shard's tokens)."""
    shard, offset = np.empty(len(layout.docs), np.int32), np.empty(len(layout.docs), np.int32)
    for i in range(layout.shards(rows_per_shard)):
        docs, bounds = layout.shard(i, rows_per_shard)
        lengths = layout.lengths[docs]
        shard[docs], offset[docs] = i, np.cumsum(lengths, dtype=np.int64) - lengths
        row = np.repeat(np.arange(len(bounds) - 1, dtype=np.int32), np.diff(bounds))
        spill.write_plan("sft", source, split, i, pa.table({"sample_id": layout.docs[docs], "length": lengths, "row": row}))
    cuts = np.searchsorted(layout.docs, starts)
    for chunk, (a, b) in enumerate(zip(cuts[:-1].tolist(), cuts[1:].tolist())):
        if a < b:
            rows = pa.array((layout.docs[a:b] - starts[chunk]).astype(np.int32))
            spill.write_route(split, source, chunk, pa.table({"row": rows, "shard": shard[a:b], "offset": offset[a:b]}))


def plan_in_order(spill: Spill, kind: str, split: str, source: str, rows: np.ndarray, starts: np.ndarray, rows_per_shard: int) -> None:
    """Rank 0, for preference pairs and prompts: per output shard, its rows (good ones, in order)
    as (chunk, row in chunk)."""
    for i in range(max(-(-len(rows) // rows_per_shard), 1)):
        part = rows[i * rows_per_shard : (i + 1) * rows_per_shard]
        chunk = np.searchsorted(starts, part, side="right") - 1
        spill.write_plan(kind, source, split, i, pa.table({"chunk": chunk.astype(np.int32), "row": (part - starts[chunk]).astype(np.int32)}))


def write_shards(spill: Spill, ranks: Ranks, kind: str) -> None:
    """Every rank writes its share of the output shards rank 0 planned; for SFT the documents
    first go to their shards in pieces, each rank taking its share of the chunks."""
    if kind == "sft":
        for k, (split, source, chunk) in enumerate(spill.routes()):
            if ranks.mine(k):
                _route(spill, split, source, chunk)
        ranks.barrier()  # every piece written
    for k, (source, split, i) in enumerate(spill.plans(kind)):
        if ranks.mine(k):
            plan = spill.read_plan(kind, source, split, i)
            tables = _packed_slices(spill, split, i, plan) if kind == "sft" else _in_order(spill, kind, source, plan)
            with ShardWriter(spill.out, kind, split, i) as writer:
                for table in tables:
                    writer.write(table)


def _route(spill: Spill, split: str, source: str, chunk: int) -> None:
    """One chunk's documents of a split, in one piece per output shard they go to."""
    route = spill.read_route(split, source, chunk)
    docs = spill.read_chunk("sft", source, chunk).select(["input_ids", "loss_mask"]).take(route.column("row"))
    shard, offset = route.column("shard").to_numpy(), route.column("offset").to_numpy()
    by_shard = np.argsort(shard, kind="stable")
    for part in np.split(by_shard, np.flatnonzero(np.diff(shard[by_shard])) + 1):
        piece = docs.take(part).append_column("offset", pa.array(offset[part]))
        spill.write_piece(split, int(shard[part[0]]), f"{source}-{chunk:06d}", piece)


def _packed_slices(spill: Spill, split: str, i: int, plan: pa.Table) -> Iterator[pa.Table]:
    """SFT shard i as tables of rows of about SLICE_TOKENS tokens: for each, the tokens of its
    documents are put in place from every piece of the shard (one piece in memory at a time)."""
    row = plan.column("row").to_numpy()
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(row)) + 1, [len(row)]]) if len(row) else np.zeros(1, np.int64)
    ends = np.concatenate([[0], np.cumsum(plan.column("length").to_numpy(), dtype=np.int64)])
    sample_ids = plan.column("sample_id").to_numpy()
    longest = int(np.diff(ends[bounds]).max(initial=1))
    step = ROW_GROUP_ROWS * max(1, SLICE_TOKENS // (ROW_GROUP_ROWS * longest))
    for r in range(0, max(len(bounds) - 1, 1), step):
        rows = bounds[r : r + step + 1]
        lo, hi = ends[rows[0]], ends[rows[-1]]
        ids, mask = np.empty(hi - lo, np.int32), np.empty(hi - lo, np.int8)
        for piece in spill.pieces(split, i):
            offset = piece.column("offset").to_numpy()
            inside = np.flatnonzero((offset >= lo) & (offset < hi))
            if len(inside):
                piece = piece.take(inside)
                column = piece.column("input_ids").combine_chunks()
                starts = column.offsets.to_numpy()
                at = np.repeat(offset[inside] - lo - starts[:-1], np.diff(starts)) + np.arange(starts[0], starts[-1])
                ids[at] = column.flatten().to_numpy()
                mask[at] = piece.column("loss_mask").combine_chunks().flatten().to_numpy()
        yield _packed_rows(ids, mask, ends[rows[0] : rows[-1] + 1] - lo, rows - rows[0], sample_ids[rows[0] : rows[-1]])


def _packed_rows(ids: np.ndarray, mask: np.ndarray, ends: np.ndarray, bounds: np.ndarray, sample_ids: np.ndarray) -> pa.Table:
    """Rows of documents: row r holds documents bounds[r]:bounds[r + 1], which end at `ends[1:]` in ids."""
    rows = len(bounds) - 1
    row_of_doc = np.repeat(np.arange(rows), np.diff(bounds))
    cu = np.zeros(len(sample_ids) + rows, np.int32)
    cu[np.arange(len(sample_ids)) + row_of_doc + 1] = ends[1:] - ends[bounds[:-1]][row_of_doc]
    tokens = pa.array(ends[bounds].astype(np.int32))
    return pa.Table.from_arrays(
        [
            pa.ListArray.from_arrays(tokens, pa.array(ids)),
            pa.ListArray.from_arrays(tokens, pa.array(mask)),
            pa.ListArray.from_arrays(pa.array((bounds + np.arange(rows + 1)).astype(np.int32)), pa.array(cu)),
            pa.ListArray.from_arrays(pa.array(bounds.astype(np.int32)), pa.array(sample_ids)),
        ],
        schema=SCHEMAS["sft"],
    )


def _in_order(spill: Spill, kind: str, source: str, plan: pa.Table) -> Iterator[pa.Table]:
    """A shard's rows from the chunks that hold them, a chunk at a time."""
    chunk, row = plan.column("chunk").to_numpy(), plan.column("row").to_numpy()
    for c in np.unique(chunk):
        yield spill.read_chunk(kind, source, int(c)).take(row[chunk == c])
