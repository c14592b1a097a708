"""Sequence packing: our best-fit-decreasing vs a first-fit-shuffle baseline vs TRL's pack_dataset.

1M lengths ~ lognormal(6, 1) clipped to [1, 4096], packed into rows of 4096. Prints wall
time, peak memory (peak RSS over the RSS at the start, the peak reset through
/proc/self/clear_refs; Linux), packs, efficiency and the lower bound ceil(tokens / 4096).

TRL's `pack_dataset(strategy="bfd")` runs as a batched `datasets.map`, so by default it
packs each batch of 1,000 rows on its own; we show it so and with batch_size=None (the
whole dataset at once, the same problem ours solves). Packing needs only the lengths, so
the input_ids column holds int8 zeros to keep 645M tokens in 0.6 GB. `pack_bfd` alone only
assigns documents to packs; the "+ gather" row also copies the tokens into packed rows, as
TRL does, so that row is the like-for-like comparison.

Run: .venv/bin/python bench/packing.py [--tiny]   (needs the `bench` extra: trl, datasets; --tiny: 10,000
lengths, every row in a few seconds, so CI runs it end to end)
"""

import argparse
import re
import time

import numpy as np
import pyarrow as pa

from alignflow.job.data.packing import pack_bfd, pack_first_fit_shuffle, packing_stats

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="10,000 lengths, not 1M")
N, CAPACITY, SEED = 10_000 if parser.parse_args().tiny else 1_000_000, 4096, 0
lengths = np.clip(np.random.default_rng(SEED).lognormal(6.0, 1.0, N), 1, CAPACITY).astype(np.int64)
tokens = int(lengths.sum())
lower = -(-tokens // CAPACITY)
print(f"{N:,} sequences, {tokens:,} tokens, capacity {CAPACITY}: lower bound {lower:,} packs (efficiency <= {tokens / (lower * CAPACITY):.5f})")
print(f"{'method':<30}{'seconds':>9}{'peak MiB':>10}{'packs':>10}{'efficiency':>12}{'over bound':>12}")


def report(label, seconds, peak_bytes, packs):
    eff = tokens / (packs * CAPACITY)
    print(f"{label:<30}{seconds:>9.2f}{peak_bytes / 2**20:>10.0f}{packs:>10,}{eff:>12.5f}{packs - lower:>12,}")


def rss_kib(field):
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def measure(fn):
    """Wall time and peak RSS growth of one run."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    start = rss_kib("VmRSS")
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    return seconds, (rss_kib("VmHWM") - start) * 1024, result


# ---- ours: best-fit-decreasing over the whole dataset
seconds, peak, bins = measure(lambda: pack_bfd(lengths, CAPACITY))
assert sorted(i for b in bins for i in b) == list(range(N))
assert max(int(lengths[b].sum()) for b in bins) <= CAPACITY
stats = packing_stats(lengths, len(bins), CAPACITY)
report("alignflow pack_bfd", seconds, peak, stats.packs)


# ---- ours end to end, like TRL: also gather the tokens into packed rows
offsets = np.zeros(N + 1, dtype=np.int32)
np.cumsum(lengths, out=offsets[1:])
column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(tokens, dtype=np.int8)))


def bfd_and_gather():
    bins = pack_bfd(lengths, CAPACITY)
    order = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=N)
    values = column.values.to_numpy()
    docs = np.concatenate([values[s:e] for s, e in zip(offsets[order].tolist(), offsets[order + 1].tolist())])
    rows = np.zeros(len(bins) + 1, dtype=np.int32)
    np.cumsum([int(lengths[b].sum()) for b in bins], out=rows[1:])
    return pa.ListArray.from_arrays(pa.array(rows), pa.array(docs))


seconds, peak, packed = measure(bfd_and_gather)
report("alignflow pack_bfd + gather", seconds, peak, len(packed))
del packed

# ---- baseline: first fit over a shuffled order
seconds, peak, bins = measure(lambda: pack_first_fit_shuffle(lengths, CAPACITY, seed=SEED))
report("first-fit-shuffle", seconds, peak, len(bins))
del bins

# ---- TRL: pack_dataset(strategy="bfd") on a datasets.Dataset
try:
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar
    from trl import pack_dataset
except ImportError as e:
    print(f"TRL not measured ({e}); install the bench extra: pip install -c constraints.txt trl datasets")
    raise SystemExit(0) from None

disable_progress_bar()
dataset = Dataset(pa.table({"input_ids": column}))

for label, map_kwargs in (("trl bfd (batch_size=1000)", {}), ("trl bfd (batch_size=None)", {"batch_size": None})):
    seconds, peak, packed = measure(lambda kwargs=map_kwargs: pack_dataset(dataset, CAPACITY, strategy="bfd", map_kwargs=kwargs))
    report(label, seconds, peak, packed.num_rows)
    del packed
