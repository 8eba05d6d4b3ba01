"""Transfer tables: which key ranges each rank sends to which, per overlap stage, and where they land.

Layout of a stage's receive buffer on rank ``dst``: the keys from source 0, then from source 1, ... (only
sources that send anything), each source's keys in ascending global order, packed with no gaps; then padding
up to ``buffer_len``, the largest receive size over ranks (XLA needs one shape on every rank). A key range
needed by several slices of a rank is sent once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class StageTransfers:
    """One row per contiguous range: ``src`` sends its local keys ``[src_start, src_end)`` to ``dst``, which
    stores them at ``[dst_start, dst_start + src_end - src_start)`` of this stage's receive buffer.

    Rows are sorted by (dst, src, src_start); per (src, dst) pair the rows are consecutive and their
    destinations are contiguous, so the pair's keys form one block of the receive buffer.
    """

    src: np.ndarray          # int32 [M]
    dst: np.ndarray          # int32 [M]
    src_start: np.ndarray    # int32 [M] in the source's local (dispatched) buffer
    src_end: np.ndarray      # int32 [M]
    dst_start: np.ndarray    # int32 [M] in the destination's receive buffer
    pair_tokens: np.ndarray  # int64 [cp, cp]: keys src -> dst
    buffer_len: int          # receive buffer length, equal on every rank

    @property
    def cp(self) -> int:
        return self.pair_tokens.shape[0]

    @property
    def recv_tokens(self) -> np.ndarray:
        return self.pair_tokens.sum(axis=0)

    @property
    def send_tokens(self) -> np.ndarray:
        return self.pair_tokens.sum(axis=1)

    @property
    def pair_max(self) -> int:
        """Largest keys any one pair exchanges: the row length of padded all_to_all buffers."""
        return int(self.pair_tokens.max()) if self.pair_tokens.size else 0

    def shift_tokens(self) -> np.ndarray:
        """int64 [cp]: for each shift d, the most keys any rank r sends to rank (r + d) % cp: the buffer
        length of a collective_permute by d (0: that shift carries nothing and can be skipped)."""
        cp = self.cp
        r = np.arange(cp)
        return np.array([self.pair_tokens[r, (r + d) % cp].max() if d else 0 for d in range(cp)], np.int64)

    def send_index(self) -> np.ndarray:
        """int32 [cp (src), cp (dst), pair_max]: the source-local key positions src packs for dst, in order,
        -1 past the end. Row [src] is what an all_to_all sender gathers from its local buffer."""
        cp, m = self.cp, self.pair_max
        out = np.full((cp, cp, m), -1, np.int32)
        ln = (self.src_end - self.src_start).astype(np.int64)
        i = np.repeat(np.arange(len(ln)), ln)
        within = np.arange(ln.sum()) - np.repeat(np.cumsum(ln) - ln, ln)
        pair_first = self.dst_start - self._pair_offset()
        out[self.src[i], self.dst[i], pair_first[i] + within] = self.src_start[i] + within
        return out

    def recv_index(self) -> np.ndarray:
        """int32 [cp (dst), buffer_len]: for each receive-buffer position, its index in the flattened
        all_to_all result ``[cp (src) * pair_max]``, -1 for padding."""
        cp, m = self.cp, self.pair_max
        out = np.full((cp, self.buffer_len), -1, np.int32)
        ln = (self.src_end - self.src_start).astype(np.int64)
        i = np.repeat(np.arange(len(ln)), ln)
        within = np.arange(ln.sum()) - np.repeat(np.cumsum(ln) - ln, ln)
        pair_first = self.dst_start - self._pair_offset()
        out[self.dst[i], self.dst_start[i] + within] = self.src[i] * m + pair_first[i] + within
        return out

    def _pair_offset(self) -> np.ndarray:
        """Receive-buffer position where each row's (src, dst) block begins."""
        first_of_dst = np.cumsum(self.pair_tokens, axis=0) - self.pair_tokens   # [src, dst]
        return first_of_dst[self.src, self.dst]


def build_transfers(dst: np.ndarray, src: np.ndarray, start: np.ndarray, end: np.ndarray,
                    src_local: np.ndarray, cp: int) -> tuple[StageTransfers, np.ndarray, np.ndarray]:
    """One stage's table from its remote pieces (global key ranges [start, end), each inside one chunk,
    with ``src_local`` the source-local position of ``start``).

    Returns the table and, per merged range, (global start, receive-buffer offset) for cutting slices.
    """
    order = np.lexsort((start, src, dst))
    dst, src, start, end, src_local = dst[order], src[order], start[order], end[order], src_local[order]
    # Adjacent pieces of one (dst, src) pair merge when they continue each other globally; consecutive
    # chunks of one owner are also consecutive in its local buffer, so the source range stays contiguous.
    new = np.ones(len(dst), bool)
    new[1:] = (dst[1:] != dst[:-1]) | (src[1:] != src[:-1]) | (start[1:] != end[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(dst)) - 1
    d, s, g0, g1, sl = dst[first], src[first], start[first], end[last], src_local[first]
    ln = g1 - g0
    recv_total = np.bincount(d, weights=ln, minlength=cp).astype(np.int64)
    off = np.cumsum(ln) - ln
    off -= off[np.searchsorted(d, d, side="left")] if len(d) else 0
    pair = np.zeros((cp, cp), np.int64)
    np.add.at(pair, (s, d), ln)
    i32 = lambda a: np.asarray(a, np.int32)
    table = StageTransfers(i32(s), i32(d), i32(sl), i32(sl + ln), i32(off), pair,
                           int(recv_total.max()) if len(recv_total) else 0)
    return table, g0, off
