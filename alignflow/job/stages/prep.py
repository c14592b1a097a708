"""The prep stage: raw SFT / preference / RL-prompt datasets -> tokenized Parquet shards.

Supported:
- inputs behind any fsspec URI (local, s3://, ...): a file, a directory or a glob of
  .jsonl, .json (lines or one array), .parquet and .arrow (IPC file or HF stream) files, and
  HF `datasets` on disk: a `save_to_disk` folder, or the arrow / parquet files of a cache
  (name a split's files with a glob), read with pyarrow, without `datasets`;
- formats (see alignflow.job.data.formats): sft `messages`, `prompt_completion`, `input_output`;
  preference `preference` (TRL, strings or message lists) and `nemo_preference`; prompts
  `prompt_answer`; `auto` detects from the first readable row's keys;
- everything rendered by the tokenizer's chat template (or model.chat_template); the loss
  mask covers every assistant turn (for preference pairs, the chosen/rejected turns only);
- truncation to data.seq_length keeping the start or the end; prompts cut to
  data.max_prompt_length (keep_end keeps the prompt's end); completions keep their start;
- a bad row raises ValueError naming file, line/row and field, or with prep.skip_bad_rows
  is skipped and counted; rows left with no trained token after truncation are dropped and
  counted (no_loss_rows); with several bad rows, the first in file order is the one named;
- a val split from a URI or split off train (val_fraction, seeded by data.seed);
  dev_choose_samples keeps the first N rows of each source;
- SFT packing: best-fit-decreasing over the whole split into rows of seq_length, with
  per-document boundaries kept; packs are then shuffled (seeded), since BFD emits them
  longest-first;
- data sets larger than memory, on all the stage's ranks (`alignflow.job.data.spill`): the input
  is read in chunks of prep.chunk_rows rows, dealt to the ranks in turn, tokenized 256 rows
  per tokenizer call and spilled to `{out}/_prep`; rank 0 then splits, counts and packs from
  the per-row lengths alone (best-fit-decreasing stays global and exact), and the ranks move
  the tokens to their shards through the spill and write them a slice at a time. Memory per
  rank follows prep.chunk_rows (a chunk's tokens) and not the data set, except rank 0's
  plan: about 40 bytes per row. The output (bytes and fingerprint) is the same for any number
  of ranks and any chunk size;
- progress: rows read, rows/s, tokens and an ETA in rank 0's log every prep.progress_interval_s
  ("42.0% done, ..."; the percent is of the input's bytes, the ETA of the reading).

Deliberately simplified: every rank reads every input byte (it parses only its own chunks),
so remote inputs are downloaded once per rank; a .json array file is parsed whole; packed SFT
goes through (chunks x output shards) temporary files, and each output shard reads all of its
own once per 4M tokens; string message contents only (no multimodal parts, no tool-call
fields); a NeMo prompt is treated as user text and goes through the chat template, so an
already templated NeMo prompt would be templated twice.

With a `generated` input (a score output), data.sft's and data.preference's train splits are its
sft.jsonl and preference.jsonl (`with_generated`): rejection sampling and online DPO rounds.

Output under `out`: the format of `alignflow.job.data.prepared` (Parquet shards of
prep.rows_per_shard rows per dataset and split, and metadata.json with per dataset and split
the counts (rows_in, rows, skipped_rows, truncated_rows, no_loss_rows, tokens, loss_tokens;
packed SFT also packs, packing_efficiency, packs_lower_bound, efficiency_upper_bound), the
format used, and the tokenizer's vocab size and bos/eos/pad ids).
sample_id is the 0-based index of the row in its source (files in sorted order); a val
split cut from train keeps the train source's indices.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import count, islice

import numpy as np
import pyarrow as pa
from omegaconf import OmegaConf

from alignflow.job.data.formats import Chat, PreferencePair, PromptAnswer, RowError, check_format, detect_format, parse_row
from alignflow.job.data.packing import pack_bfd_flat, packing_stats
from alignflow.job.data.prepared import SCHEMAS, write_metadata
from alignflow.job.data.readers import Record, iter_chunks, source_bytes
from alignflow.job.data.spill import INDEX, NO_LOSS, OK, SKIPPED, Layout, Progress, Ranks, Spill, plan_in_order, plan_packed, write_shards
from alignflow.job.data.tokenize import ChatEncoder, Encoded, Request, load_tokenizer, share_cores, truncate

KINDS = ("sft", "preference", "prompts")
ENCODE_ROWS = 256  # rows per tokenizer call: its overhead amortized, a small Python working set


@dataclass(frozen=True)
class Limits:
    """The length settings rows are cut to, read from the config once (not once per row)."""

    seq_length: int
    max_prompt_length: int
    truncation: str

    @classmethod
    def of(cls, data) -> Limits:
        return cls(data.seq_length, data.max_prompt_length, str(data.truncation))


@dataclass
class Counts:
    rows_in: int
    rows: int
    skipped_rows: int
    truncated_rows: int
    no_loss_rows: int
    tokens: int
    loss_tokens: int


def run(cfg, inputs: dict[str, str], out: str) -> dict:
    """Build every requested dataset into `out` with all of the job's ranks. Rank 0 writes
    metadata.json and returns the flat headline metrics (the job's result); other ranks {}."""
    cfg = with_generated(cfg, inputs.get("generated"))
    ranks, spill = Ranks.of_job(), Spill(out)
    spill.start(ranks)
    share_cores()
    encoder = ChatEncoder(load_tokenizer(cfg.model.tokenizer, cfg.model.chat_template))
    kinds = [k for k in KINDS if cfg.data[k] is not None]
    total = sum(source_bytes(uri) for k in kinds for uri in sources(cfg.data[k]).values())
    progress = Progress(spill, ranks, total, cfg.prep.progress_interval_s)
    with collector_per_chunk():
        meta = {kind: prepare(kind, cfg, encoder, spill, ranks, progress) for kind in kinds}
    ranks.barrier()  # every shard written
    progress.finish()
    if ranks.rank != 0:
        return {}
    spill.remove()
    write_metadata(
        out,
        {"tokenizer": tokenizer_info(encoder.tokenizer), "seq_length": cfg.data.seq_length, "max_prompt_length": cfg.data.max_prompt_length, **meta},
    )
    return {f"{kind}.{split}.{k}": v for kind in kinds for split, stats in meta[kind]["splits"].items() for k, v in stats.items()}


GENERATED = {"sft": ("sft.jsonl", "messages"), "preference": ("preference.jsonl", "preference")}  # a score output's files


def with_generated(cfg, generated: str | None):
    """With a `generated` input (a score stage's output: the best completion per prompt, best
    against worst pairs), the train split of data.sft and data.preference, where configured, is
    read from it; the val splits stay the configured held-out data."""
    if generated is None:
        return cfg
    root = generated.rstrip("/")
    files = {kind: {"train": f"{root}/{name}", "format": fmt} for kind, (name, fmt) in GENERATED.items() if cfg.data[kind] is not None}
    merged = OmegaConf.merge(cfg, {"data": files})
    OmegaConf.set_readonly(merged, True)
    return merged


@contextmanager
def collector_per_chunk() -> Iterator[None]:
    """Python's cyclic garbage collector, left to itself, runs whenever the parsed rows pile up
    and then scans every object alive, the imported torch and transformers included: 7% of
    prep's time at 2 ranks. Here it runs once per chunk (`tokenize_source`), over only what prep
    made: what was alive before is frozen. Prep's rows hold no cycles, so nothing waits long."""
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def tokenizer_info(tokenizer) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def sources(spec) -> dict[str, str]:
    """The URIs a dataset reads, by source name (its config key)."""
    return {"train": spec.train} | ({"val": spec.val} if spec.val is not None else {})


# ---------------------------------------------------------------- one dataset


def prepare(kind: str, cfg, encoder: ChatEncoder, spill: Spill, ranks: Ranks, progress: Progress) -> dict | None:
    """Tokenize one dataset on every rank, plan its shards on rank 0, write them on every rank;
    its metadata on rank 0."""
    spec = cfg.data[kind]
    check_val_fraction(spec)
    fmt = resolve_format(kind, spec)
    for number, (source, uri) in enumerate(sources(spec).items()):
        tokenize_source(kind, fmt, number, source, uri, cfg, encoder, spill, ranks, progress)
    progress.flush()
    ranks.barrier()  # every chunk spilled
    progress.report()
    if (failure := spill.first_failure(kind)) is not None:
        raise ValueError(failure)
    check_rows_left(kind, spec, spill, cfg.data.seq_length)
    info = plan(kind, fmt, cfg, spill) if ranks.rank == 0 else None
    ranks.barrier()  # the plan written
    write_shards(spill, ranks, kind)
    return info


def check_rows_left(kind: str, spec, spill: Spill, seq_length: int) -> None:
    """Every rank: a data set with no usable training row fails here, saying why, not later in
    the stage that trains on it (and its empty output is never committed)."""
    status = spill.index(kind, "train")["status"]
    if len(status) and not (status == OK).any():
        raise ValueError(
            f"data.{kind}.train: no usable row in {spec.train}: {len(status)} read, {int((status == SKIPPED).sum())} skipped as "
            f"bad, {int((status == NO_LOSS).sum())} with nothing left to train on within data.seq_length={seq_length} (a prompt "
            "as long as the sequence, or an empty response); raise data.seq_length or data.max_prompt_length, or check the data"
        )


def plan(kind: str, fmt: str, cfg, spill: Spill) -> dict:
    """Rank 0: every split's rows, counts and (SFT) packing, and the plan of its shards."""
    spec, rows_per_shard = cfg.data[kind], cfg.prep.rows_per_shard
    index = {source: spill.index(kind, source) for source in sources(spec)}
    info = {"format": fmt, "splits": {}}
    for split, (source, rows) in split_rows(spec, {s: len(ix["status"]) for s, ix in index.items()}, cfg.data.seed).items():
        info["splits"][split] = asdict(counts(index[source], rows))
        docs, starts = np.flatnonzero(rows & (index[source]["status"] == OK)), index[source]["starts"]
        if kind == "sft":
            layout, stats = sft_layout(docs, index[source]["tokens"][docs], cfg.data)
            info["splits"][split] |= stats
            plan_packed(spill, split, source, layout, starts, rows_per_shard)
        else:
            plan_in_order(spill, kind, split, source, docs, starts, rows_per_shard)
    if kind == "sft":
        info["packed"] = bool(cfg.data.packing)
    return info


def resolve_format(kind: str, spec) -> str:
    """The configured format, or the one the first readable row has (train's, else val's)."""
    fmt = spec.format
    check_format(kind, fmt)
    if fmt != "auto":
        return fmt
    for source, uri in sources(spec).items():
        first = next((rec for chunk in iter_chunks(uri, 1, spec.dev_choose_samples) for rec in chunk.records() if rec.row is not None), None)
        if first is not None:
            try:
                return detect_format(kind, first.row, spec.answer_key)
            except ValueError as e:
                raise ValueError(f"data.{kind}.{source}: {first.where()}: {e}") from None
    raise ValueError(f"data.{kind}.train: {spec.train}: no readable row to detect the format from")


def tokenize_source(
    kind: str, fmt: str, number: int, source: str, uri: str, cfg, encoder: ChatEncoder, spill: Spill, ranks: Ranks, progress: Progress
) -> None:
    """Spill this rank's chunks of one source (chunk i is rank i % world's). The first bad row
    is left for every rank to raise after the barrier; ranks stop at chunks past it."""
    progress.begin(source_bytes(uri))
    for chunk in iter_chunks(uri, cfg.prep.chunk_rows, cfg.data[kind].dev_choose_samples):
        progress.at(chunk.bytes_read)
        if not ranks.mine(chunk.index):
            continue
        if spill.failed_before(kind, number, chunk.index):
            return
        try:
            table = encode_chunk(kind, fmt, chunk.start, chunk.records(), cfg, encoder, f"data.{kind}.{source}", progress)
        except ValueError as e:
            spill.fail(kind, number, chunk.index, str(e))
            return
        spill.write_chunk(kind, source, chunk.index, table)
        gc.collect()  # see collector_per_chunk


def encode_chunk(kind: str, fmt: str, start: int, records, cfg, encoder: ChatEncoder, context: str, progress: Progress) -> pa.Table:
    """A chunk's rows as a spill table (`alignflow.job.data.spill.INDEX` + the kind's payload)."""
    batches, sample_ids = [], count(start)
    while batch := list(islice(records, ENCODE_ROWS)):
        rows = encode_rows(kind, fmt, batch, cfg, encoder, context)
        batches.append(spill_batch(kind, [(next(sample_ids), *row) for row in rows]))
        progress.add(len(rows), sum(row[2] for row in rows if row[0] == OK))
    return pa.Table.from_batches(batches, schema=spill_schema(kind))


def encode_rows(kind: str, fmt: str, records: list[Record], cfg, encoder: ChatEncoder, context: str) -> list[tuple]:
    """(status, truncated, tokens, loss_tokens, payload or None) per row, in order. Rows are
    parsed and rendered one by one, then tokenized in one call; the first error in row order
    wins. A bad row raises with its place, or is skipped and counted."""
    answer_key, skip_bad_rows, limits = cfg.data[kind].answer_key, cfg.prep.skip_bad_rows, Limits.of(cfg.data)
    examples = [parse(kind, fmt, rec, answer_key) for rec in records]
    requests = [[] if isinstance(ex, ValueError) else ROWS[kind].requests(ex) for ex in examples]
    encoded = iter(encoder.encode([r for rs in requests for r in rs]))
    rows = []
    for rec, example, n in zip(records, examples, map(len, requests)):
        encs = [next(encoded) for _ in range(n)]
        try:
            if error := next((e for e in [example, *encs] if isinstance(e, ValueError)), None):
                raise error
            payload, truncated = ROWS[kind].build(example, encs, limits, encoder)
        except RowError as e:
            if not skip_bad_rows:
                raise ValueError(f"{context}: {rec.where()}: {e}") from None
            rows.append((SKIPPED, 0, 0, 0, None))
            continue
        except ValueError as e:  # not the row's fault (e.g. the template): never skipped
            raise ValueError(f"{context}: {rec.where()}: {e}") from None
        rows.append(measured(kind, payload, truncated))
    return rows


def parse(kind: str, fmt: str, rec: Record, answer_key: str):
    """The row as its format's example, or the ValueError it raised."""
    try:
        if rec.error:
            raise RowError(None, rec.error)
        return parse_row(kind, fmt, rec.row, answer_key)
    except ValueError as e:
        return e


def measured(kind: str, payload: tuple | None, truncated: bool) -> tuple:
    if payload is None:
        return NO_LOSS, int(truncated), 0, 0, None
    fields = PAYLOAD[kind].names
    tokens = sum(len(v) for name, v in zip(fields, payload) if name.endswith("_ids"))
    loss_tokens = sum(int(v.sum()) for name, v in zip(fields, payload) if name.endswith("loss_mask"))
    return OK, int(truncated), tokens, loss_tokens, payload


# ---------------------------------------------------------------- row encoders
# Per kind: the chats a row needs encoded, and its payload from them (None when no token is
# left to train on) with whether it was truncated.


def sft_requests(ex: Chat) -> list[Request]:
    return [Request(ex.messages)]


def build_sft(ex: Chat, encs: list[Encoded], data: Limits, encoder: ChatEncoder):
    (enc,) = encs
    ids, mask, cut = truncate(enc.input_ids, enc.loss_mask, data.seq_length, data.truncation)
    return ((ids, mask) if mask.any() else None), cut


def preference_requests(ex: PreferencePair) -> list[Request]:
    return [Request(ex.prompt + ex.chosen, len(ex.prompt)), Request(ex.prompt + ex.rejected, len(ex.prompt))]


def build_preference(ex: PreferencePair, encs: list[Encoded], data: Limits, encoder: ChatEncoder):
    """Both sequences share the prompt tokens, cut to max_prompt_length first."""
    chosen, rejected = encs
    p = chosen.prompt_length
    if rejected.prompt_length != p or not np.array_equal(rejected.input_ids[:p], chosen.input_ids[:p]):
        raise ValueError("chat template renders the same prompt differently for chosen and rejected")
    prompt, prompt_mask, cut_prompt = truncate(chosen.input_ids[:p], chosen.loss_mask[:p], data.max_prompt_length, data.truncation)
    budget = data.seq_length - len(prompt)
    seqs, cut = [], cut_prompt
    for enc in (chosen, rejected):
        ids, mask, cut_reply = truncate(enc.input_ids[p:], enc.loss_mask[p:], budget, "keep_start")
        seqs += [np.concatenate([prompt, ids]), np.concatenate([prompt_mask, mask])]
        cut |= cut_reply
    if not (seqs[1].any() and seqs[3].any()):
        return None, cut
    return (len(prompt), *seqs), cut


def prompt_requests(ex: PromptAnswer) -> list[Request]:
    return [Request(ex.prompt, generation_prompt=True)]


def build_prompt(ex: PromptAnswer, encs: list[Encoded], data: Limits, encoder: ChatEncoder):
    (enc,) = encs
    kept, _, cut = truncate(enc.input_ids, enc.loss_mask, data.max_prompt_length, data.truncation)
    return (kept, encoder.tokenizer.decode(kept.tolist()) if cut else enc.text, ex.answer), cut


@dataclass(frozen=True)
class RowKind:
    requests: Callable[..., list[Request]]
    build: Callable[..., tuple[tuple | None, bool]]


ROWS = {
    "sft": RowKind(sft_requests, build_sft),
    "preference": RowKind(preference_requests, build_preference),
    "prompts": RowKind(prompt_requests, build_prompt),
}
# The spilled payload of a row: its output columns, less what prep adds when it writes shards.
PAYLOAD = {
    "sft": pa.schema([SCHEMAS["sft"].field("input_ids"), SCHEMAS["sft"].field("loss_mask")]),
    "preference": pa.schema([f for f in SCHEMAS["preference"] if f.name != "sample_id"]),
    "prompts": pa.schema([f for f in SCHEMAS["prompts"] if f.name != "sample_id"]),
}


def spill_schema(kind: str) -> pa.Schema:
    return pa.schema([pa.field("sample_id", pa.int64()), *INDEX, *PAYLOAD[kind]])


def spill_batch(kind: str, rows: list[tuple]) -> pa.RecordBatch:
    """(sample_id, status, truncated, tokens, loss_tokens, payload) rows as one record batch; a
    row without payload has empty lists and nulls there."""
    schema = spill_schema(kind)
    columns = [pa.array([row[i] for row in rows], f.type) for i, f in enumerate(list(schema)[:5])]
    for i, f in enumerate(PAYLOAD[kind]):
        values = [row[5][i] if row[5] is not None else None for row in rows]
        columns.append(token_lists(values, f.type) if pa.types.is_list(f.type) else pa.array(values, f.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def token_lists(arrays: list[np.ndarray | None], type: pa.DataType) -> pa.ListArray:
    """Token arrays as one list column, from one flat buffer (None: an empty list)."""
    present = [a for a in arrays if a is not None]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([0 if a is None else len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(present) if present else np.zeros(0, np.int8)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type.value_type))


# ---------------------------------------------------------------- splits and counts


def split_rows(spec, lengths: dict[str, int], seed: int) -> dict[str, tuple[str, np.ndarray]]:
    """{split: (source, which of its rows are the split's)}: train and val from their own
    sources, or val cut from train (val_fraction of its rows, seeded)."""
    train = ("train", np.ones(lengths["train"], dtype=bool))
    if spec.val is not None:
        return {"train": train, "val": ("val", np.ones(lengths["val"], dtype=bool))}
    if not spec.val_fraction:
        return {"train": train}
    n = lengths["train"]
    is_val = np.zeros(n, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n)[: int(round(n * spec.val_fraction))]] = True
    return {"train": ("train", ~is_val), "val": ("train", is_val)}


def check_val_fraction(spec) -> None:
    if spec.val is None and spec.val_fraction and not 0 < spec.val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {spec.val_fraction}")


def counts(index: dict[str, np.ndarray], rows: np.ndarray) -> Counts:
    """The counts of a split, its rows a mask over its source's index."""
    status, ok = index["status"], rows & (index["status"] == OK)
    return Counts(
        rows_in=int(rows.sum()),
        rows=int(ok.sum()),
        skipped_rows=int((rows & (status == SKIPPED)).sum()),
        truncated_rows=int(index["truncated"].sum(where=rows, dtype=np.int64)),
        no_loss_rows=int((rows & (status == NO_LOSS)).sum()),
        tokens=int(index["tokens"].sum(where=ok, dtype=np.int64)),
        loss_tokens=int(index["loss_tokens"].sum(where=ok, dtype=np.int64)),
    )


# ---------------------------------------------------------------- packing


def sft_layout(docs: np.ndarray, lengths: np.ndarray, data) -> tuple[Layout, dict]:
    """A split's good documents (sample ids, token counts) in packed rows (BFD over the whole
    split, then shuffled) or one per row; with the packing figures."""
    if not data.packing:
        return Layout(docs, lengths, np.arange(len(docs), dtype=np.int32), np.arange(len(docs) + 1)), {}
    order, offsets = shuffled(*pack_bfd_flat(lengths, data.seq_length), data.seed)
    stats = asdict(packing_stats(lengths, len(offsets) - 1, data.seq_length))
    del stats["tokens"]
    return Layout(docs, lengths, order, offsets), stats


def shuffled(items: np.ndarray, offsets: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The bins in a seeded random order (BFD emits them longest-first)."""
    perm = np.random.default_rng(seed).permutation(len(offsets) - 1)
    sizes = np.diff(offsets)[perm]
    new = np.zeros(len(perm) + 1, dtype=np.int64)
    np.cumsum(sizes, out=new[1:])
    at = np.repeat((offsets[:-1][perm] - new[:-1]).astype(items.dtype), sizes)
    at += np.arange(len(items), dtype=items.dtype)
    return items[at], new
