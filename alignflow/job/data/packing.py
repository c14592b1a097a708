"""Bin packing of sequence lengths into fixed-capacity rows (SFT sequence packing).

Pure functions over lengths; they return bins as lists of item indices, and the caller
concatenates the documents and keeps their boundaries (cu_seqlens). Best-fit-decreasing
over the whole dataset wastes far fewer tokens than packing in arrival order or in small
batches (see "Fewer Truncations Improve Language Modeling", Ding et al. 2024).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil

import numpy as np

_STEP = 1 << 16  # items converted to Python ints at a time


def _as_lengths(lengths: Sequence[int] | np.ndarray, capacity: int) -> np.ndarray:
    """Validate once, up front, so the hot loops need no checks. Signed integer arrays are
    taken as they are (no copy); anything else becomes int64."""
    arr = np.asarray(lengths).reshape(-1)
    if arr.dtype.kind != "i":
        arr = arr.astype(np.int64)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if arr.size and arr.min() < 1:
        raise ValueError(f"lengths must be >= 1; item {int(arr.argmin())} has length {int(arr.min())}")
    if arr.size and arr.max() > capacity:
        i = int(arr.argmax())
        raise ValueError(f"item {i} has length {int(arr[i])} > capacity {capacity}; truncate it first")
    return arr


def pack_bfd(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit-decreasing as lists of item indices per bin (`pack_bfd_flat` as lists)."""
    items, offsets = pack_bfd_flat(lengths, capacity)
    return [items[a:b].tolist() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


def pack_bfd_flat(lengths: Sequence[int] | np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing: longest first, each into the open bin it fills most tightly.

    Returns (items, offsets): bin b holds items[offsets[b]:offsets[b + 1]], in the order they were
    placed; bins are numbered in the order they were opened. Flat int32 arrays rather than lists
    of lists keep millions of items in tens of MB.

    Bins are bucketed by remaining capacity (an integer in 1..capacity), and a sorted list
    holds the capacities that have at least one open bin. The best fit for an item of
    length L is then one bisect away: the smallest free capacity >= L. That list has at
    most `capacity` entries, so search is O(log capacity) and insertion a C-level memmove;
    with the sort the whole run is O(n log n). Ties go to the most recently touched bin.
    Deterministic: equal lengths keep their input order.
    """
    arr = _as_lengths(lengths, capacity)
    order = np.argsort(-arr, kind="stable").astype(np.int32)
    bin_of = np.empty(arr.size, dtype=np.int32)  # the bin of the k-th item placed
    opened = 0
    buckets: dict[int, list[int]] = {}  # remaining capacity -> stack of bin indices
    free: list[int] = []  # sorted remaining capacities with a non-empty bucket
    for start in range(0, arr.size, _STEP):  # Python ints for a slice at a time, not all at once
        placed = []
        for length in arr[order[start : start + _STEP]].tolist():
            pos = bisect_left(free, length)
            if pos == len(free):
                b, left = opened, capacity - length
                opened += 1
            else:
                space = free[pos]
                stack = buckets[space]
                b = stack.pop()
                if not stack:
                    del free[pos]
                left = space - length
            placed.append(b)
            if left:
                stack = buckets.get(left)
                if stack:
                    stack.append(b)
                else:
                    buckets[left] = [b]
                    insort(free, left)
        bin_of[start : start + len(placed)] = placed
    offsets = np.zeros(opened + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of, minlength=opened), out=offsets[1:])
    return order[np.argsort(bin_of, kind="stable")], offsets


class _MinTree:
    """Min over leaves 0..n-1 with O(log n) point update and range-min query [lo, n)."""

    def __init__(self, n: int, fill: int):
        self.size = 1 << max(n - 1, 0).bit_length()
        self.fill = fill
        self.tree = [fill] * (2 * self.size)

    def set(self, i: int, value: int) -> None:
        tree = self.tree
        i += self.size
        tree[i] = value
        i >>= 1
        while i:
            a, b = tree[2 * i], tree[2 * i + 1]
            tree[i] = a if a < b else b
            i >>= 1

    def min_from(self, lo: int) -> int:
        tree, best = self.tree, self.fill
        lo += self.size
        hi = 2 * self.size
        while lo < hi:
            if lo & 1:
                if tree[lo] < best:
                    best = tree[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                if tree[hi] < best:
                    best = tree[hi]
            lo >>= 1
            hi >>= 1
        return best


def pack_first_fit_shuffle(lengths: Sequence[int] | np.ndarray, capacity: int, seed: int = 0) -> list[list[int]]:
    """Baseline: shuffle, then put each item into the lowest-numbered bin it fits.

    Per remaining capacity a min-heap of bin numbers; a min-tree over capacities holds each
    heap's top, so the first bin that fits is one range-min query. O(n log n).
    """
    arr = _as_lengths(lengths, capacity)
    order = np.random.default_rng(seed).permutation(arr.size)
    none = arr.size + 1
    tree = _MinTree(capacity + 1, none)
    heaps: dict[int, list[int]] = {}
    space_of: list[int] = []  # bin number -> remaining capacity
    bins: list[list[int]] = []
    for idx, length in zip(order.tolist(), arr[order].tolist()):
        b = tree.min_from(length)
        if b == none:
            b = len(bins)
            bins.append([idx])
            space_of.append(capacity)
        else:
            heap = heaps[space_of[b]]
            heapq.heappop(heap)  # b is this heap's top: the tree holds the tops
            tree.set(space_of[b], heap[0] if heap else none)
            bins[b].append(idx)
        left = space_of[b] = space_of[b] - length
        if left:
            heap = heaps.setdefault(left, [])
            heapq.heappush(heap, b)
            if heap[0] == b:
                tree.set(left, b)
    return bins


@dataclass(frozen=True)
class PackingStats:
    tokens: int
    packs: int
    packs_lower_bound: int
    packing_efficiency: float
    efficiency_upper_bound: float


def packing_stats(lengths: Sequence[int] | np.ndarray, packs: int, capacity: int) -> PackingStats:
    """Efficiency = tokens / (packs * capacity); the bound uses ceil(tokens / capacity) packs."""
    tokens = int(np.asarray(lengths, dtype=np.int64).sum())
    lower = ceil(tokens / capacity)
    return PackingStats(
        tokens=tokens,
        packs=packs,
        packs_lower_bound=lower,
        packing_efficiency=tokens / (packs * capacity) if packs else 0.0,
        efficiency_upper_bound=tokens / (lower * capacity) if lower else 0.0,
    )
