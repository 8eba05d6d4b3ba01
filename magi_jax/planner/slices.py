"""Per-rank slices: the mask cut to each rank's query chunks, then to the key segments it reads.

A rank owns whole chunks; its local buffer holds them in ascending chunk order. A *run* is a maximal set of
consecutive chunk ids owned by one rank: contiguous both globally and in the local buffer, so one slice
restricted to a run stays one slice (``RankSlices``). Each restricted slice is then cut against *key
segments*: ranges of global keys that lie contiguously in some buffer the rank computes against (its own
runs for host slices; a stage's receive buffer for remote slices). ``cut`` gives the typed pieces with
rows in local coordinates and keys in that buffer's coordinates.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from magi_jax.mask import AttnMask
from magi_jax.planner.chunks import slice_chunk_pairs
from magi_jax.planner.geometry import clip, merge_intervals


class Runs(NamedTuple):
    """Maximal runs of consecutive chunks per rank, sorted by (rank, first chunk)."""

    rank: np.ndarray         # int64 [R]
    first: np.ndarray        # first chunk id
    end: np.ndarray          # one past the last chunk id
    local_first: np.ndarray  # position of the first chunk in the rank's chunk list


def chunk_runs(partitions: tuple[np.ndarray, ...]) -> tuple[Runs, np.ndarray]:
    """The runs, and the run id of every chunk."""
    P = np.stack([np.asarray(p, np.int64) for p in partitions])   # equal chunk counts per rank
    cp, per = P.shape
    flat = P.reshape(-1)
    rank = np.repeat(np.arange(cp), per)
    loc = np.tile(np.arange(per), cp)
    start = np.ones(len(flat), bool)
    start[1:] = (flat[1:] != flat[:-1] + 1) | (loc[1:] == 0)
    first = np.flatnonzero(start)
    last = np.append(first[1:], len(flat)) - 1
    run_of = np.empty(len(flat), np.int64)
    run_of[flat] = np.cumsum(start) - 1
    return Runs(rank[first], flat[first], flat[last] + 1, loc[first]), run_of


class RankSlices(NamedTuple):
    """The mask's slices restricted to each rank's runs (rows trimmed to those attending something)."""

    rank: np.ndarray       # int64 [M]
    slice: np.ndarray      # index into the mask's slices
    rows: np.ndarray       # int64 [M, 2] global rows
    need: np.ndarray       # int64 [M, 2] union of the keys these rows attend
    row_shift: np.ndarray  # local row = global row + row_shift


def rank_slices(mask: AttnMask, chunk_size: int, partitions: tuple[np.ndarray, ...]) -> RankSlices:
    """Every (slice, run) intersection, with the keys its rows need and the shift to local rows."""
    C = chunk_size
    runs, run_of = chunk_runs(partitions)
    sl, ch = slice_chunk_pairs(mask, C)
    rid = run_of[ch]
    # Pairs come grouped by slice with ascending chunks: a new (slice, run) group starts where either changes.
    new = np.ones(len(sl), bool)
    new[1:] = (sl[1:] != sl[:-1]) | (rid[1:] != rid[:-1])
    g_sl, g_run = sl[new], rid[new]
    rows = np.stack([runs.first[g_run] * C, runs.end[g_run] * C], axis=1)
    q, k, t = mask.q_ranges[g_sl], mask.k_ranges[g_sl], mask.types[g_sl]
    p = clip(q, k, t, rows, k)          # trims empty rows; k range = union of attended keys
    src_run = g_run[p.src]
    shift = runs.local_first[src_run] * C - runs.first[src_run] * C
    return RankSlices(runs.rank[src_run], g_sl[p.src], p.q_ranges, p.k_ranges, shift)


class Segments(NamedTuple):
    """Disjoint global key ranges per rank, each contiguous in one buffer; sorted by (rank, start)."""

    rank: np.ndarray    # int64 [S]
    start: np.ndarray   # global key range [start, end)
    end: np.ndarray
    offset: np.ndarray  # buffer position of ``start``
    tag: np.ndarray     # which buffer: -1 host, s >= 0 remote stage s (or any id the caller chooses)

    @staticmethod
    def build(rank, start, end, offset, tag) -> "Segments":
        order = np.lexsort((start, rank))
        return Segments(*(np.asarray(a, np.int64)[order] for a in (rank, start, end, offset, tag)))


class Cut(NamedTuple):
    """Typed pieces of ``RankSlices`` inside ``Segments``, rows local, keys in the segment's buffer."""

    rank: np.ndarray
    tag: np.ndarray
    segment: np.ndarray
    q_ranges: np.ndarray
    k_ranges: np.ndarray
    types: np.ndarray


def cut(mask: AttnMask, rs: RankSlices, segs: Segments, span: int) -> Cut:
    """Cut every restricted slice against every segment of its rank that its keys reach."""
    base_s = segs.rank * span
    lo = np.searchsorted(base_s + segs.end, rs.rank * span + rs.need[:, 0], side="right")
    hi = np.searchsorted(base_s + segs.start, rs.rank * span + rs.need[:, 1], side="left")
    counts = np.maximum(hi - lo, 0)
    i = np.repeat(np.arange(len(rs.rank)), counts)
    j = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
    s = rs.slice[i]
    p = clip(mask.q_ranges[s], mask.k_ranges[s], mask.types[s], rs.rows[i],
             np.stack([segs.start[j], segs.end[j]], axis=1))
    i, j = i[p.src], j[p.src]
    q = p.q_ranges + rs.row_shift[i][:, None]
    k = p.k_ranges - (segs.start[j] - segs.offset[j])[:, None]
    return Cut(rs.rank[i], segs.tag[j], j, q, k, p.types)


def needed_keys(rs: RankSlices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Union of the keys each rank's rows attend: (rank, start, end), disjoint and sorted."""
    return merge_intervals(rs.rank, rs.need[:, 0], rs.need[:, 1])


def pad_slices(rank: np.ndarray, q: np.ndarray, k: np.ndarray, t: np.ndarray, cp: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-rank slice lists as int32 arrays [cp, N, 2], [cp, N, 2], [cp, N], sorted by (q start, k start)
    and padded with empty slices (q [0, 0), k [0, 0), FULL) to the common N (at least 1)."""
    order = np.lexsort((k[:, 0], q[:, 0], rank))
    rank, q, k, t = rank[order], q[order], k[order], t[order]
    counts = np.bincount(rank, minlength=cp)
    N = max(1, int(counts.max()) if len(counts) else 1)
    slot = np.arange(len(rank)) - np.repeat(np.cumsum(counts) - counts, counts)
    Q = np.zeros((cp, N, 2), np.int32)
    K = np.zeros((cp, N, 2), np.int32)
    T = np.zeros((cp, N), np.int32)
    Q[rank, slot] = q
    K[rank, slot] = k
    T[rank, slot] = t
    return Q, K, T
