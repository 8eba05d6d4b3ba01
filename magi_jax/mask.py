"""The mask model: a flexible attention mask as a list of (q_range, k_range, type) slices.

Ranges are half-open ``[start, end)`` over the packed (THD) token axis. For one slice with
``q in [qs, qe)`` and ``k in [ks, ke)``, query row ``q`` attends:

    FULL        [ks, ke)
    CAUSAL      [ks, ke - (qe - q - 1))              bottom-right aligned
    INV_CAUSAL  [ks + (q - qs), ke)                  top-left aligned
    BI_CAUSAL   [ks + (q - qs), ke - (qe - q - 1))   both

Slices may overlap; a cell covered by several slices counts once per slice (DESIGN.md section 1).
"""

from __future__ import annotations

import enum
from typing import Sequence

import numpy as np


class AttnMaskType(enum.IntEnum):
    FULL = 0
    CAUSAL = 1
    INV_CAUSAL = 2
    BI_CAUSAL = 3


def _as_type_code(t: object, name: str) -> int:
    if isinstance(t, str):
        try:
            return int(AttnMaskType[t.upper()])
        except KeyError:
            raise ValueError(f"{name}: unknown mask type {t!r}; expected one of "
                             f"{[m.name.lower() for m in AttnMaskType]}") from None
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
        raise ValueError(f"{name}: expected mask type names or integer codes, got {t!r}")
    code = int(t)
    if code not in AttnMaskType._value2member_map_:
        raise ValueError(f"{name}: unknown mask type code {code}; expected 0 (FULL), 1 (CAUSAL), "
                         "2 (INV_CAUSAL) or 3 (BI_CAUSAL)")
    return code


def as_type_codes(types: object, name: str = "types") -> np.ndarray:
    """Type codes (names or integers, one per slice) as int64; integer arrays are checked in one vectorised
    pass (masks may have 1e5 slices). Errors name the argument `name`."""
    try:
        arr = np.asarray(types)
    except ValueError:   # ragged
        arr = np.asarray(types, dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of mask type names or codes, got "
                         f"{type(types).__name__} of shape {arr.shape}")
    if arr.dtype.kind in "iu":
        codes = arr.astype(np.int64)
        bad = np.nonzero((codes < AttnMaskType.FULL) | (codes > AttnMaskType.BI_CAUSAL))[0]
        if bad.size:
            _as_type_code(int(codes[bad[0]]), name)  # raises the named error
        return codes
    return np.array([_as_type_code(x, name) for x in np.asarray(types, dtype=object)], dtype=np.int64)


def _as_ranges(name: str, ranges: object, total: int) -> np.ndarray:
    arr = np.asarray(ranges)
    if arr.size == 0:  # an empty list has no integer dtype of its own
        arr = arr.reshape(0, 2).astype(np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{name}: expected shape [N, 2], got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name}: expected integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.nonzero(arr[:, 0] > arr[:, 1])[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {arr[i].tolist()} is reversed (start > end)")
    bad = np.nonzero((arr[:, 0] < 0) | (arr[:, 1] > total))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {arr[i].tolist()} is out of bounds [0, {total}]")
    return arr


def slice_areas(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray) -> np.ndarray:
    """Exact number of attended cells of each slice, in closed form (int64)."""
    lq = (q_ranges[:, 1] - q_ranges[:, 0]).astype(np.int64)
    lk = (k_ranges[:, 1] - k_ranges[:, 0]).astype(np.int64)
    m = np.minimum(lq, lk)
    triangle = m * lk - m * (m - 1) // 2  # sum_{j<m} (lk - j): one row loses a key per step
    band = lq * np.maximum(lk - lq + 1, 0)  # BI_CAUSAL: every row sees lk - lq + 1 keys
    return np.select([types == AttnMaskType.FULL, types == AttnMaskType.BI_CAUSAL],
                     [lq * lk, band], default=triangle)


class AttnMask:
    """A validated, immutable, hashable flexible mask.

    Example: two documents of 3 and 2 tokens, each causal::

        >>> m = AttnMask([[0, 3], [3, 5]], [[0, 3], [3, 5]], ["causal", "causal"], 5, 5)
        >>> m.area()      # 1+2+3 + 1+2
        9
    """

    __slots__ = ("_q", "_k", "_t", "total_seqlen_q", "total_seqlen_k", "_hash")

    def __init__(self, q_ranges: object, k_ranges: object, types: Sequence[object] | np.ndarray,
                 total_seqlen_q: int, total_seqlen_k: int | None = None) -> None:
        if total_seqlen_k is None:
            total_seqlen_k = total_seqlen_q
        for name, v in (("total_seqlen_q", total_seqlen_q), ("total_seqlen_k", total_seqlen_k)):
            if int(v) != v or v < 0:
                raise ValueError(f"{name}: expected a non-negative integer, got {v!r}")
        q = _as_ranges("q_ranges", q_ranges, int(total_seqlen_q))
        k = _as_ranges("k_ranges", k_ranges, int(total_seqlen_k))
        t = as_type_codes(types)
        if not (len(q) == len(k) == len(t)):
            raise ValueError(f"q_ranges, k_ranges and types must have the same length, got "
                             f"{len(q)}, {len(k)} and {len(t)}")
        for a in (q, k, t):
            a.setflags(write=False)
        self._q, self._k, self._t = q, k, t
        self.total_seqlen_q, self.total_seqlen_k = int(total_seqlen_q), int(total_seqlen_k)
        self._hash = hash((q.tobytes(), k.tobytes(), t.tobytes(), self.total_seqlen_q,
                           self.total_seqlen_k))

    # Read-only views; int32 copies for kernels come from ``kernel_args``.
    @property
    def q_ranges(self) -> np.ndarray:
        return self._q

    @property
    def k_ranges(self) -> np.ndarray:
        return self._k

    @property
    def types(self) -> np.ndarray:
        return self._t

    @property
    def num_slices(self) -> int:
        return len(self._t)

    def kernel_args(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q_ranges, k_ranges, attn_type_map) as int32 arrays, the kernel's layout."""
        return (self._q.astype(np.int32), self._k.astype(np.int32), self._t.astype(np.int32))

    def area(self) -> int:
        """Number of attended (q, k) cells, counting a cell once per covering slice."""
        return int(slice_areas(self._q, self._k, self._t).sum())

    def to_dense(self) -> np.ndarray:
        """Per-cell count of covering slices, int32 [Tq, Tk]. For test sizes only."""
        tq, tk = self.total_seqlen_q, self.total_seqlen_k
        if tq * tk > 1 << 28:
            raise ValueError(f"to_dense: {tq} x {tk} is too large for a dense matrix")
        dense = np.zeros((tq, tk), np.int32)
        cols = np.arange(tk)
        for (qs, qe), (ks, ke), t in zip(self._q, self._k, self._t):
            rows = np.arange(qs, qe)[:, None]
            lo = ks + (rows - qs) if t in (AttnMaskType.INV_CAUSAL, AttnMaskType.BI_CAUSAL) else ks
            hi = ke - (qe - rows - 1) if t in (AttnMaskType.CAUSAL, AttnMaskType.BI_CAUSAL) else ke
            dense[qs:qe] += ((cols >= lo) & (cols < hi)).astype(np.int32)
        return dense

    def plot(self, path: str, title: str | None = None) -> None:
        """Write a PNG of the mask with slice outlines (matplotlib)."""
        from magi_jax.viz import plot_mask
        plot_mask(self, path, title=title)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, AttnMask) and self._hash == other._hash
                and self.total_seqlen_q == other.total_seqlen_q
                and self.total_seqlen_k == other.total_seqlen_k
                and np.array_equal(self._q, other._q) and np.array_equal(self._k, other._k)
                and np.array_equal(self._t, other._t))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return (f"AttnMask({self.num_slices} slices, {self.total_seqlen_q} x {self.total_seqlen_k}, "
                f"area {self.area()})")
