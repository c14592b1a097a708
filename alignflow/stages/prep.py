"""The prep stage: raw SFT / preference / RL-prompt datasets -> tokenized Parquet shards.

Supported:
- inputs behind any fsspec URI (local, s3://, ...): a file, a directory or a glob of
  .jsonl, .json (lines or one array), .parquet and .arrow (IPC file or HF stream) files;
- formats (see alignflow.data.formats): sft `messages`, `prompt_completion`, `input_output`;
  preference `preference` (TRL, strings or message lists) and `nemo_preference`; prompts
  `prompt_answer`; `auto` detects from the first row's keys;
- everything rendered by the tokenizer's chat template (or model.chat_template); the loss
  mask covers every assistant turn (for preference pairs, the chosen/rejected turns only);
- truncation to data.seq_length keeping the start or the end; prompts cut to
  data.max_prompt_length (keep_end keeps the prompt's end); completions keep their start;
- a bad row raises ValueError naming file, line/row and field, or with prep.skip_bad_rows
  is skipped and counted; rows left with no trained token after truncation are dropped and
  counted (no_loss_rows);
- a val split from a URI or split off train (val_fraction, seeded by data.seed);
  dev_choose_samples keeps the first N rows of each source;
- SFT packing: best-fit-decreasing over the whole split into rows of seq_length, with
  per-document boundaries kept; packs are then shuffled (seeded), since BFD emits them
  longest-first.

Deliberately simplified: one process holds a split in memory (fine to a few million rows);
rows are tokenized one at a time; string message contents only (no multimodal parts, no
tool-call fields); a NeMo prompt is treated as user text and goes through the chat
template, so an already templated NeMo prompt would be templated twice.

Output under `out`: the format of `alignflow.data.prepared` (Parquet shards of
prep.rows_per_shard rows per dataset and split, and metadata.json with per dataset and split
the counts (rows_in, rows, skipped_rows, truncated_rows, no_loss_rows, tokens, loss_tokens;
packed SFT also packs, packing_efficiency, packs_lower_bound, efficiency_upper_bound), the
format used, and the tokenizer's vocab size and bos/eos/pad ids).
sample_id is the 0-based index of the row in its source (files in sorted order); a val
split cut from train keeps the train source's indices.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import chain

import numpy as np
import pyarrow as pa

from alignflow.data.formats import Chat, PreferencePair, PromptAnswer, RowError, check_format, detect_format, parse_row
from alignflow.data.packing import pack_bfd, packing_stats
from alignflow.data.prepared import SCHEMAS, write_metadata, write_split
from alignflow.data.readers import Record, read_records
from alignflow.data.tokenize import ChatEncoder, load_tokenizer, truncate

KINDS = ("sft", "preference", "prompts")


@dataclass
class Counts:
    rows_in: int = 0
    rows: int = 0
    skipped_rows: int = 0
    truncated_rows: int = 0
    no_loss_rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0


def run(cfg, inputs: dict[str, str], out: str) -> dict:
    """Build every requested dataset into `out`; returns flat headline metrics."""
    encoder = ChatEncoder(load_tokenizer(cfg.model.tokenizer, cfg.model.chat_template))
    meta = {
        "tokenizer": tokenizer_info(encoder.tokenizer),
        "seq_length": cfg.data.seq_length,
        "max_prompt_length": cfg.data.max_prompt_length,
    }
    metrics = {}
    for kind in (k for k in KINDS if cfg.data[k] is not None):
        meta[kind] = prepare(kind, cfg, encoder, out)
        for split, stats in meta[kind]["splits"].items():
            metrics |= {f"{kind}.{split}.{k}": v for k, v in stats.items()}
    write_metadata(out, meta)
    return metrics


def tokenizer_info(tokenizer) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


# ---------------------------------------------------------------- one dataset


def prepare(kind: str, cfg, encoder: ChatEncoder, out: str) -> dict:
    spec = cfg.data[kind]
    splits = load_splits(spec, cfg.data.seed)
    fmt = resolve_format(kind, spec, sorted(chain(*splits.values()), key=lambda r: r[0]))
    info = {"format": fmt, "splits": {}}
    for split, records in splits.items():
        context = f"data.{kind}.{'val' if split == 'val' and spec.val is not None else 'train'}"
        items, counts = encode_split(kind, fmt, records, cfg, encoder, context)
        table, extra = TABLES[kind](items, counts, cfg)
        write_split(out, kind, split, table, cfg.prep.rows_per_shard)
        info["splits"][split] = asdict(counts) | extra
    if kind == "sft":
        info["packed"] = bool(cfg.data.packing)
    return info


def load_splits(spec, seed: int) -> dict[str, list[tuple[int, Record]]]:
    """{"train": [(sample_id, record)], "val": [...] if any}; the split is seeded."""
    train = list(enumerate(read_records(spec.train, spec.dev_choose_samples)))
    if spec.val is not None:
        return {"train": train, "val": list(enumerate(read_records(spec.val, spec.dev_choose_samples)))}
    if not spec.val_fraction:
        return {"train": train}
    if not 0 < spec.val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {spec.val_fraction}")
    n_val = int(round(len(train) * spec.val_fraction))
    is_val = np.zeros(len(train), dtype=bool)
    is_val[np.random.default_rng(seed).permutation(len(train))[:n_val]] = True
    return {"train": [r for r, v in zip(train, is_val) if not v], "val": [r for r, v in zip(train, is_val) if v]}


def resolve_format(kind: str, spec, records: list[tuple[int, Record]]) -> str:
    fmt = spec.format
    check_format(kind, fmt)
    if fmt != "auto":
        return fmt
    first = next((rec for _, rec in records if rec.row is not None), None)
    if first is None:
        raise ValueError(f"data.{kind}.train: {spec.train}: no readable row to detect the format from")
    try:
        return detect_format(kind, first.row, spec.answer_key)
    except ValueError as e:
        raise ValueError(f"data.{kind}.train: {first.where()}: {e}") from None


def encode_split(kind: str, fmt: str, records, cfg, encoder: ChatEncoder, context: str) -> tuple[list, Counts]:
    """Encode every row; bad rows raise with their place, or are skipped and counted."""
    counts, items = Counts(rows_in=len(records)), []
    encode = ENCODERS[kind]
    for sample_id, rec in records:
        try:
            if rec.error:
                raise RowError(None, rec.error)
            example = parse_row(kind, fmt, rec.row, cfg.data[kind].answer_key)
            item, truncated = encode(sample_id, example, cfg.data, encoder)
        except RowError as e:
            if not cfg.prep.skip_bad_rows:
                raise ValueError(f"{context}: {rec.where()}: {e}") from None
            counts.skipped_rows += 1
            continue
        except ValueError as e:  # not the row's fault (e.g. the template): never skipped
            raise ValueError(f"{context}: {rec.where()}: {e}") from None
        counts.truncated_rows += truncated
        if item is None:
            counts.no_loss_rows += 1
        else:
            items.append(item)
    counts.rows = len(items)
    return items, counts


# ---------------------------------------------------------------- row encoders
# Each returns (item or None when no token is left to train on, was_truncated).


def encode_sft(sample_id: int, ex: Chat, data, encoder: ChatEncoder):
    enc = encoder.encode_chat(ex.messages)
    ids, mask, cut = truncate(enc.input_ids, enc.loss_mask, data.seq_length, data.truncation)
    return ((sample_id, ids, mask) if any(mask) else None), cut


def encode_preference(sample_id: int, ex: PreferencePair, data, encoder: ChatEncoder):
    """Both sequences share the prompt tokens, cut to max_prompt_length first."""
    chosen = encoder.encode_chat(ex.prompt + ex.chosen, train_from=len(ex.prompt))
    rejected = encoder.encode_chat(ex.prompt + ex.rejected, train_from=len(ex.prompt))
    p = chosen.prompt_length
    if rejected.prompt_length != p or rejected.input_ids[:p] != chosen.input_ids[:p]:
        raise ValueError("chat template renders the same prompt differently for chosen and rejected")
    prompt, _, cut_prompt = truncate(chosen.input_ids[:p], [0] * p, data.max_prompt_length, data.truncation)
    budget = data.seq_length - len(prompt)
    seqs, cut = [], cut_prompt
    for enc in (chosen, rejected):
        ids, mask, cut_reply = truncate(enc.input_ids[p:], enc.loss_mask[p:], budget, "keep_start")
        seqs.append((prompt + ids, [0] * len(prompt) + mask))
        cut |= cut_reply
    if not all(any(mask) for _, mask in seqs):
        return None, cut
    return (sample_id, len(prompt), *seqs[0], *seqs[1]), cut


def encode_prompt(sample_id: int, ex: PromptAnswer, data, encoder: ChatEncoder):
    text, ids = encoder.encode_prompt(ex.prompt)
    kept, _, cut = truncate(ids, [0] * len(ids), data.max_prompt_length, data.truncation)
    if cut:
        text = encoder.tokenizer.decode(kept)
    return (sample_id, kept, text, ex.answer), cut


ENCODERS = {"sft": encode_sft, "preference": encode_preference, "prompts": encode_prompt}


# ---------------------------------------------------------------- tables


def list_array(seqs: list[list[int]], dtype) -> pa.ListArray:
    """A list column built from one flat buffer (no per-row Python objects in Arrow)."""
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    flat = np.fromiter((t for s in seqs for t in s), dtype=dtype, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def sft_table(items: list, counts: Counts, cfg) -> tuple[pa.Table, dict]:
    """Packed rows (BFD, then shuffled) or one document per row."""
    lengths = [len(ids) for _, ids, _ in items]
    counts.tokens = sum(lengths)
    counts.loss_tokens = sum(sum(mask) for _, _, mask in items)
    extra = {}
    if cfg.data.packing:
        bins = pack_bfd(lengths, cfg.data.seq_length)
        bins = [bins[i] for i in np.random.default_rng(cfg.data.seed).permutation(len(bins))]
        extra = asdict(packing_stats(lengths, len(bins), cfg.data.seq_length))
        del extra["tokens"]
    else:
        bins = [[i] for i in range(len(items))]
    return table_of("sft", [
        list_array([[t for i in b for t in items[i][1]] for b in bins], np.int32),
        list_array([[t for i in b for t in items[i][2]] for b in bins], np.int8),
        list_array([np.cumsum([0] + [lengths[i] for i in b]).tolist() for b in bins], np.int32),
        list_array([[items[i][0] for i in b] for b in bins], np.int64),
    ]), extra


def preference_table(items: list, counts: Counts, cfg) -> tuple[pa.Table, dict]:
    cols = list(zip(*items)) or [[]] * 6
    counts.tokens = sum(len(ids) for ids in cols[2]) + sum(len(ids) for ids in cols[4])
    counts.loss_tokens = sum(sum(m) for m in cols[3]) + sum(sum(m) for m in cols[5])
    return table_of("preference", [pa.array(cols[0], pa.int64()), pa.array(cols[1], pa.int32()), list_array(cols[2], np.int32),
                                   list_array(cols[3], np.int8), list_array(cols[4], np.int32), list_array(cols[5], np.int8)]), {}


def prompts_table(items: list, counts: Counts, cfg) -> tuple[pa.Table, dict]:
    cols = list(zip(*items)) or [[]] * 4
    counts.tokens = sum(len(ids) for ids in cols[1])
    return table_of("prompts", [pa.array(cols[0], pa.int64()), list_array(cols[1], np.int32), pa.array(cols[2], pa.string()),
                                pa.array(cols[3], pa.string())]), {}


TABLES = {"sft": sft_table, "preference": preference_table, "prompts": prompts_table}


def table_of(dataset: str, arrays: list) -> pa.Table:
    """The arrays as the dataset's table, in the order of its schema (`alignflow.data.prepared`)."""
    return pa.Table.from_arrays(arrays, schema=SCHEMAS[dataset])


