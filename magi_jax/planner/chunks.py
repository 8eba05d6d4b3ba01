"""Chunking: per chunk of query rows, its exact attention area and the keys it needs.

The (padded) sequence is cut into ``num_chunks`` chunks of ``chunk_size`` tokens. A chunk's area is the
number of attended cells of its rows, summed over slices in closed form; its *need* is, per key chunk, how
many distinct keys of that key chunk any of its rows attends (the union over slices). The solvers balance
the areas and use the needs to predict the keys a rank must fetch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from magi_jax.mask import AttnMask
from magi_jax.planner.geometry import clip, merge_intervals


@dataclass(frozen=True, eq=False)
class ChunkTable:
    """Per-chunk areas and key needs; needs in CSR form sorted by (chunk, key chunk).

    Example: causal over 4 tokens, chunk_size 2 -> areas [3, 7]; chunk 1 needs 2 keys of key chunk 0 and
    2 of key chunk 1: ``need_indptr = [0, 1, 3]``, ``need_chunk = [0, 0, 1]``, ``need_tokens = [2, 2, 2]``.
    """

    chunk_size: int
    num_chunks: int
    areas: np.ndarray        # int64 [num_chunks]
    need_indptr: np.ndarray  # int64 [num_chunks + 1]
    need_chunk: np.ndarray   # int64 [nnz] key chunk id
    need_tokens: np.ndarray  # int64 [nnz] distinct keys needed from that key chunk

    def need_of(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = self.need_indptr[chunk], self.need_indptr[chunk + 1]
        return self.need_chunk[s:e], self.need_tokens[s:e]


def slice_chunk_pairs(mask: AttnMask, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(slice index, chunk id) for every chunk that a slice's q range touches."""
    q = mask.q_ranges
    nonempty = np.flatnonzero(q[:, 1] > q[:, 0])
    first = q[nonempty, 0] // chunk_size
    last = (q[nonempty, 1] - 1) // chunk_size
    counts = last - first + 1
    sl = np.repeat(nonempty, counts)
    base = np.repeat(np.cumsum(counts) - counts, counts)
    ch = np.repeat(first, counts) + (np.arange(counts.sum()) - base)
    return sl.astype(np.int64), ch.astype(np.int64)


def chunk_table(mask: AttnMask, chunk_size: int, num_chunks: int) -> ChunkTable:
    """Areas and needs of every chunk; chunks past the mask's length (padding) are empty."""
    C = chunk_size
    sl, ch = slice_chunk_pairs(mask, C)
    rows = np.stack([ch * C, (ch + 1) * C], axis=1)
    # Clipping to the slice's own key range only trims rows, leaving one piece whose k range is
    # exactly the union of the keys its rows attend.
    pieces = clip(mask.q_ranges[sl], mask.k_ranges[sl], mask.types[sl], rows, mask.k_ranges[sl])
    pc = ch[pieces.src]
    areas = np.bincount(pc, weights=pieces.areas(), minlength=num_chunks).astype(np.int64)
    g, k0, k1 = merge_intervals(pc, pieces.k_ranges[:, 0], pieces.k_ranges[:, 1])
    # Split each merged key interval at key-chunk edges; intervals are disjoint, so tokens add up.
    first, last = k0 // C, (k1 - 1) // C
    counts = last - first + 1
    rep = np.repeat(np.arange(len(g)), counts)
    kc = first[rep] + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    tok = np.minimum(k1[rep], (kc + 1) * C) - np.maximum(k0[rep], kc * C)
    row = g[rep]
    key = row * num_chunks + kc
    uniq, inv = np.unique(key, return_inverse=True)
    tokens = np.bincount(inv, weights=tok).astype(np.int64)
    need_row, need_chunk = uniq // num_chunks, uniq % num_chunks
    indptr = np.zeros(num_chunks + 1, np.int64)
    np.cumsum(np.bincount(need_row, minlength=num_chunks), out=indptr[1:])
    return ChunkTable(C, num_chunks, areas, indptr, need_chunk.astype(np.int64), tokens)
