"""Closed-form geometry of mask slices: restricting a slice to a rectangle of rows and keys.

For a slice ``(q=[qs,qe), k=[ks,ke), type)`` row ``q`` attends ``[lo(q), hi(q))`` with
``lo(q) = ks + a*(q - qs)`` and ``hi(q) = ke - b*(qe - 1 - q)``, where ``a`` is 1 for INV_CAUSAL and
BI_CAUSAL and ``b`` is 1 for CAUSAL and BI_CAUSAL (DESIGN.md section 1). Both bounds are linear in ``q``
with slope 0 or 1, so cutting a slice to rows ``[r0, r1)`` and keys ``[c0, c1)`` gives at most three row
segments in which each clipped bound is either constant or the diagonal; every segment is again one of the
four types. Everything here is vectorised over many (slice, rectangle) pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from magi_jax.mask import AttnMaskType, slice_areas


class Pieces(NamedTuple):
    """Typed slices produced by ``clip``; ``src`` is the index of the input pair each came from."""

    q_ranges: np.ndarray  # int64 [M, 2]
    k_ranges: np.ndarray  # int64 [M, 2]
    types: np.ndarray     # int64 [M]
    src: np.ndarray       # int64 [M]

    def areas(self) -> np.ndarray:
        return slice_areas(self.q_ranges, self.k_ranges, self.types)


def _slopes(types: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = (types == AttnMaskType.INV_CAUSAL) | (types == AttnMaskType.BI_CAUSAL)
    b = (types == AttnMaskType.CAUSAL) | (types == AttnMaskType.BI_CAUSAL)
    return a.astype(np.int64), b.astype(np.int64)


# (lower bound is diagonal, upper bound is diagonal) -> type of the piece
_TYPE_OF = np.array([[AttnMaskType.FULL, AttnMaskType.CAUSAL],
                     [AttnMaskType.INV_CAUSAL, AttnMaskType.BI_CAUSAL]], dtype=np.int64)


def clip(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray,
         rows: np.ndarray, keys: np.ndarray) -> Pieces:
    """Cut slice i to rows ``rows[i]`` and keys ``keys[i]`` (all int arrays, [N, 2] / [N]).

    Returns the non-empty typed pieces whose cells are exactly the slice's cells inside the rectangle,
    with rows that attend nothing trimmed away. Row ranges outside the slice's own rows are intersected
    with them first.
    """
    qs, qe = q_ranges[:, 0].astype(np.int64), q_ranges[:, 1].astype(np.int64)
    ks, ke = k_ranges[:, 0].astype(np.int64), k_ranges[:, 1].astype(np.int64)
    a, b = _slopes(np.asarray(types))
    r0, r1 = np.maximum(rows[:, 0], qs), np.minimum(rows[:, 1], qe)
    c0, c1 = keys[:, 0].astype(np.int64), keys[:, 1].astype(np.int64)
    lo0 = ks - a * qs            # lo(q) = lo0 + a*q
    hi0 = ke - b * (qe - 1)      # hi(q) = hi0 + b*q
    # Rows where the diagonal bounds cross the rectangle's key edges: below x_lo the lower bound is
    # c0 (the diagonal is still left of it); from x_hi on the upper bound is c1 (the diagonal passed it;
    # the row where it equals c1 stays diagonal, so an uncut slice stays one piece).
    x_lo = np.where(a == 1, np.clip(c0 - lo0, r0, np.maximum(r0, r1)), r0)
    x_hi = np.where(b == 1, np.clip(c1 - hi0 + 1, r0, np.maximum(r0, r1)), np.maximum(r0, r1))
    x1, x2 = np.minimum(x_lo, x_hi), np.maximum(x_lo, x_hi)
    starts = np.stack([r0, x1, x2], axis=1)
    ends = np.stack([x1, x2, np.maximum(r0, r1)], axis=1)
    n = len(qs)
    idx = np.repeat(np.arange(n, dtype=np.int64), 3)
    s, e = starts.reshape(-1), ends.reshape(-1)
    keep = e > s
    idx, s, e = idx[keep], s[keep], e[keep]
    # In one segment each bound has a fixed slope: diagonal iff the type has it and we are past the edge.
    diag_lo = (a[idx] == 1) & (s >= x_lo[idx])
    diag_hi = (b[idx] == 1) & (e <= x_hi[idx])
    lo_s = np.where(diag_lo, lo0[idx] + s, np.maximum(lo0[idx] + a[idx] * s, c0[idx]))
    hi_s = np.where(diag_hi, hi0[idx] + s, np.minimum(hi0[idx] + b[idx] * s, c1[idx]))
    lo_s = np.maximum(lo_s, c0[idx])
    hi_s = np.minimum(hi_s, c1[idx])
    w0 = hi_s - lo_s                                   # width of the first row of the segment
    slope = diag_hi.astype(np.int64) - diag_lo.astype(np.int64)
    # Trim rows with no key: width grows (causal-like) -> drop leading rows; shrinks -> drop trailing.
    s2 = np.where(slope == 1, s + np.maximum(0, 1 - w0), s)
    e2 = np.where(slope == -1, np.minimum(e, s + np.maximum(w0, 0)), e)
    e2 = np.where((slope == 0) & (w0 <= 0), s2, e2)
    keep = e2 > s2
    idx, s2, e2 = idx[keep], s2[keep], e2[keep]
    diag_lo, diag_hi = diag_lo[keep], diag_hi[keep]
    # The piece's k range: lower bound at its first row, upper bound at its last row.
    lo_first = np.where(diag_lo, lo0[idx] + s2, np.maximum(lo0[idx] + a[idx] * s2, c0[idx]))
    lo_first = np.maximum(lo_first, c0[idx])
    last = e2 - 1
    hi_last = np.where(diag_hi, hi0[idx] + last, np.minimum(hi0[idx] + b[idx] * last, c1[idx]))
    hi_last = np.minimum(hi_last, c1[idx])
    t = _TYPE_OF[diag_lo.astype(np.int64), diag_hi.astype(np.int64)]
    return Pieces(np.stack([s2, e2], axis=1), np.stack([lo_first, hi_last], axis=1), t, idx)


def merge_intervals(group: np.ndarray, start: np.ndarray, end: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Union of half-open intervals per group: sorted, disjoint, non-adjacent (group, start, end)."""
    keep = end > start
    group, start, end = group[keep], start[keep], end[keep]
    if len(group) == 0:
        z = np.zeros(0, np.int64)
        return z, z.copy(), z.copy()
    order = np.lexsort((start, group))
    group, start, end = group[order], start[order], end[order]
    # Offset each group so one running maximum over the sorted sequence never crosses groups.
    span = int(max(end.max(), 0)) + 1
    off = group.astype(np.int64) * span
    run_end = np.maximum.accumulate(end + off)
    new = np.ones(len(group), bool)
    new[1:] = (start[1:] + off[1:]) > run_end[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(group)) - 1
    return group[first], start[first], run_end[last] - off[first]
