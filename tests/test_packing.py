"""Bin packing: validity, known cases, and agreement with naive O(n * bins) references."""

import numpy as np
import pytest

from alignflow.job.data import packing
from alignflow.job.data.packing import pack_bfd, pack_bfd_flat, pack_first_fit_shuffle, packing_stats


def naive_best_fit_decreasing(lengths, capacity):
    space = []
    for length in sorted(lengths, reverse=True):
        fits = [b for b, s in enumerate(space) if s >= length]
        if fits:
            b = min(fits, key=lambda b: space[b])
            space[b] -= length
        else:
            space.append(capacity - length)
    return len(space)


def naive_bfd_bins(lengths, capacity):
    """The bins themselves: longest first (ties in input order), each into the tightest bin that
    fits, ties to the bin touched last."""
    bins, space, touched = [], [], []
    for t, i in enumerate(sorted(range(len(lengths)), key=lambda i: -lengths[i])):
        fits = [b for b, s in enumerate(space) if s >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (space[b], -touched[b]))
        else:
            b = len(bins)
            bins.append([])
            space.append(capacity)
            touched.append(t)
        bins[b].append(i)
        space[b] -= lengths[i]
        touched[b] = t
    return bins


def naive_first_fit(lengths, order, capacity):
    bins, space = [], []
    for i in order:
        b = next((b for b, s in enumerate(space) if s >= lengths[i]), None)
        if b is None:
            bins.append([i])
            space.append(capacity - lengths[i])
        else:
            bins[b].append(i)
            space[b] -= lengths[i]
    return bins


def assert_valid(bins, lengths, capacity):
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths))), "every item exactly once"
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins), "no bin over capacity"
    assert all(b for b in bins), "no empty bin"


def test_known_small_cases():
    assert pack_bfd([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]
    assert pack_bfd([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    assert pack_bfd([6, 6], 6) == [[0], [1]]
    assert pack_bfd([1] * 5, 5) == [[0, 1, 2, 3, 4]]
    assert pack_bfd([], 8) == []
    # best fit picks the tightest bin: 3 goes with the 7 (left 3), not the 5 (left 5)
    assert pack_bfd([7, 5, 3], 10) == [[0, 2], [1]]


def test_rejects_items_that_cannot_fit():
    with pytest.raises(ValueError, match="item 1 has length 9 > capacity 8"):
        pack_bfd([3, 9, 2], 8)
    with pytest.raises(ValueError, match=">= 1"):
        pack_bfd([3, 0], 8)
    with pytest.raises(ValueError, match="capacity"):
        pack_first_fit_shuffle([1], 0)


@pytest.mark.parametrize("seed", range(5))
def test_random_lengths_are_packed_validly_and_tightly(seed):
    rng = np.random.default_rng(seed)
    capacity = 64
    lengths = rng.integers(1, capacity + 1, size=300).tolist()
    bfd = pack_bfd(lengths, capacity)
    ffs = pack_first_fit_shuffle(lengths, capacity, seed=seed)
    assert_valid(bfd, lengths, capacity)
    assert_valid(ffs, lengths, capacity)
    assert len(bfd) == naive_best_fit_decreasing(lengths, capacity)
    assert len(bfd) <= len(ffs)
    assert len(bfd) >= -(-sum(lengths) // capacity)


@pytest.mark.parametrize("step", [7, 1 << 16])
def test_bfd_matches_naive_best_fit_decreasing_bin_for_bin(monkeypatch, step):
    monkeypatch.setattr(packing, "_STEP", step)  # the slice boundaries of its loop change nothing
    lengths = np.random.default_rng(11).integers(1, 12, size=500).tolist()  # many ties
    expected = naive_bfd_bins(lengths, 16)
    assert pack_bfd(lengths, 16) == expected
    items, offsets = pack_bfd_flat(lengths, 16)
    assert items.dtype == np.int32 and offsets.tolist() == np.cumsum([0] + [len(b) for b in expected]).tolist()


def test_first_fit_shuffle_matches_naive_first_fit():
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 50, size=400).tolist()
    order = np.random.default_rng(3).permutation(len(lengths)).tolist()
    assert pack_first_fit_shuffle(lengths, 50, seed=3) == naive_first_fit(lengths, order, 50)


def test_bfd_beats_first_fit_shuffle_on_lognormal_lengths():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 1.0, 20_000), 1, 1024).astype(np.int64)
    bfd = packing_stats(lengths, len(pack_bfd(lengths, 1024)), 1024)
    ffs = packing_stats(lengths, len(pack_first_fit_shuffle(lengths, 1024)), 1024)
    assert bfd.packing_efficiency >= ffs.packing_efficiency
    assert bfd.packing_efficiency > 0.99
    assert bfd.packs >= bfd.packs_lower_bound
    assert bfd.efficiency_upper_bound >= bfd.packing_efficiency


def test_deterministic():
    lengths = np.random.default_rng(1).integers(1, 100, size=1000)
    assert pack_bfd(lengths, 100) == pack_bfd(lengths.tolist(), 100)
    assert pack_first_fit_shuffle(lengths, 100, seed=5) == pack_first_fit_shuffle(lengths, 100, seed=5)


def test_stats():
    s = packing_stats([4, 4, 3], 2, 8)
    assert (s.tokens, s.packs, s.packs_lower_bound) == (11, 2, 2)
    assert s.packing_efficiency == pytest.approx(11 / 16)
    assert s.efficiency_upper_bound == pytest.approx(11 / 16)
