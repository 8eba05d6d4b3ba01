"""Workloads for the planner's CLI and simulation: document lengths drawn like the reference library's
distributed benchmark, and the few masks the planner needs without the constructor module."""

from __future__ import annotations

import numpy as np

from magi_jax.mask import AttnMask, AttnMaskType

# Document-length histogram of the reference library's benchmark: (min, max) tokens -> weight (%).
DOC_LENGTH_BINS: tuple[tuple[int, int, float], ...] = (
    (0, 10, .22), (11, 50, 2.91), (51, 100, 5.2), (101, 200, 10.23), (201, 500, 28.19),
    (501, 1024, 24.64), (1025, 2048, 15.65), (2049, 4096, 7.34), (4097, 8192, 3.05),
    (8193, 16384, 1.29), (16385, 32768, .85), (32769, 65536, .14), (65537, 131072, .17),
    (131073, 196608, .14))


def sample_doc_lengths(total: int, seed: int = 0) -> list[int]:
    """Document lengths summing to ``total``: each the midpoint of a bin drawn by weight; a document longer
    than ``total // 4`` is cut into pieces of that size; the last one is truncated to fit."""
    rng = np.random.default_rng(seed)
    mids = np.array([(lo + hi) // 2 for lo, hi, _ in DOC_LENGTH_BINS])
    p = np.array([w for _, _, w in DOC_LENGTH_BINS])
    p = p / p.sum()
    cap = max(1, total // 4)
    out: list[int] = []
    filled = 0
    while filled < total:
        length = int(rng.choice(mids, p=p))
        pieces = [cap] * ((length - 1) // cap) + [max(1, length - cap * ((length - 1) // cap))]
        for piece in pieces:
            piece = min(piece, total - filled)
            out.append(piece)
            filled += piece
            if filled == total:
                break
    return out


def varlen_mask(doc_lengths: list[int] | np.ndarray, causal: bool = True) -> AttnMask:
    """One slice per document, causal or full; the planner's own builder (no constructor module needed)."""
    lengths = np.asarray(doc_lengths, np.int64)
    if (lengths < 1).any():
        raise ValueError("doc_lengths: every document needs at least one token")
    ends = np.cumsum(lengths)
    ranges = np.stack([ends - lengths, ends], axis=1)
    t = AttnMaskType.CAUSAL if causal else AttnMaskType.FULL
    return AttnMask(ranges, ranges, np.full(len(lengths), int(t)), int(ends[-1]), int(ends[-1]))
