"""Constructors of common masks. Documents are packed back to back; `lengths` lists them in order.

Each constructor returns an AttnMask whose slices never cover a cell twice, e.g.::

    >>> varlen_causal([3, 2]).to_dense()
    array([[1, 0, 0, 0, 0],
           [1, 1, 0, 0, 0],
           [1, 1, 1, 0, 0],
           [0, 0, 0, 1, 0],
           [0, 0, 0, 1, 1]], dtype=int32)
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from magi_jax.mask import AttnMask, AttnMaskType

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = (AttnMaskType.FULL, AttnMaskType.CAUSAL, AttnMaskType.INV_CAUSAL,
                                       AttnMaskType.BI_CAUSAL)

Slices = list[tuple[int, int, int, int, int]]  # (qs, qe, ks, ke, type)


def _build(slices: Slices, total_q: int, total_k: int | None = None) -> AttnMask:
    kept = [s for s in slices if s[0] < s[1] and s[2] < s[3]]
    arr = np.array(kept, np.int64).reshape(-1, 5)
    return AttnMask(arr[:, 0:2], arr[:, 2:4], arr[:, 4], total_q, total_q if total_k is None else total_k)


def _documents(lengths: Iterable[int], name: str = "lengths") -> list[tuple[int, int]]:
    """[(start, end)] of each document; lengths must be positive integers."""
    if not isinstance(lengths, Iterable) or isinstance(lengths, str):
        raise ValueError(f"{name}: expected a sequence of document lengths, got {lengths!r}")
    docs, start = [], 0
    for i, n in enumerate(lengths):
        if int(n) != n or n <= 0:
            raise ValueError(f"{name}[{i}]: document lengths must be positive integers, got {n!r}")
        docs.append((start, start + int(n)))
        start += int(n)
    if not docs:
        raise ValueError(f"{name}: needs at least one document")
    return docs


def _positive(name: str, value: int) -> int:
    if int(value) != value or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    return int(value)


def full(seqlen_q: int, seqlen_k: int | None = None) -> AttnMask:
    """Every query sees every key."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    return _build([(0, seqlen_q, 0, seqlen_k, FULL)], seqlen_q, seqlen_k)


def causal(seqlen_q: int, seqlen_k: int | None = None) -> AttnMask:
    """Causal, bottom-right aligned when seqlen_q != seqlen_k (the last query sees every key)."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    return _build([(0, seqlen_q, 0, seqlen_k, CAUSAL)], seqlen_q, seqlen_k)


def varlen_full(lengths: Sequence[int]) -> AttnMask:
    """Packed documents, each attending all of itself."""
    docs = _documents(lengths)
    return _build([(s, e, s, e, FULL) for s, e in docs], docs[-1][1])


def varlen_causal(lengths: Sequence[int]) -> AttnMask:
    """Packed documents, each causal."""
    docs = _documents(lengths)
    return _build([(s, e, s, e, CAUSAL) for s, e in docs], docs[-1][1])


def _causal_window(s: int, e: int, window: int) -> Slices:
    """Rows of [s, e) seeing themselves and the window - 1 keys before them inside [s, e)."""
    head = min(e, s + window)
    return [(s, head, s, head, CAUSAL), (s + window, e, s + 1, e, BI_CAUSAL)]


def sliding_window(lengths: Sequence[int], window: int, causal: bool = True) -> AttnMask:
    """Sliding window inside each document.

    causal=True: a query sees itself and the `window - 1` keys before it. causal=False (symmetric): a
    query sees every key k of its document with |q - k| < window.
    """
    window = _positive("window", window)
    docs = _documents(lengths)
    slices: Slices = []
    for s, e in docs:
        slices += _causal_window(s, e, window)
        if not causal:  # mirror part: keys (q, q + window) inside the document
            split = max(s, e - window + 1)
            slices += [(s, split, s + 1, e, BI_CAUSAL), (split, e, split + 1, e, INV_CAUSAL)]
    return _build(slices, docs[-1][1])


def block_causal(lengths: Sequence[int], block: int) -> AttnMask:
    """Inside each document, a query sees all keys of its own block and of every earlier block."""
    block = _positive("block", block)
    docs = _documents(lengths)
    slices = [(b, min(e, b + block), s, min(e, b + block), FULL) for s, e in docs for b in range(s, e, block)]
    return _build(slices, docs[-1][1])


def shared_question(samples: Sequence[tuple[int, Sequence[int]]]) -> AttnMask:
    """Per sample, a question followed by several answers: the question is causal; each answer sees the
    whole question and itself causally (not the other answers). samples = [(question_len, [answer_len, ...])].
    """
    slices: Slices = []
    start = 0
    for i, (question, answers) in enumerate(samples):
        (qs, qe), = _documents([question], f"samples[{i}] question")
        qs, qe = qs + start, qe + start
        slices.append((qs, qe, qs, qe, CAUSAL))
        for s, e in _documents(answers, f"samples[{i}] answers"):
            s, e = s + qe, e + qe
            slices += [(s, e, qs, qe, FULL), (s, e, s, e, CAUSAL)]
            start = e
    if not slices:
        raise ValueError("samples: needs at least one sample")
    return _build(slices, start)


def prefix_lm(lengths: Sequence[int], prefix_lengths: Sequence[int]) -> AttnMask:
    """Per document, its prefix attends bidirectionally within the prefix; the rest is causal."""
    docs = _documents(lengths)
    if len(prefix_lengths) != len(docs):
        raise ValueError(f"prefix_lengths: {len(prefix_lengths)} values for {len(docs)} documents")
    slices: Slices = []
    for i, ((s, e), p) in enumerate(zip(docs, prefix_lengths)):
        if int(p) != p or not 0 <= p <= e - s:
            raise ValueError(f"prefix_lengths[{i}]: must be in [0, {e - s}], got {p!r}")
        slices += [(s, s + p, s, s + p, FULL), (s + p, e, s, e, CAUSAL)]
    return _build(slices, docs[-1][1])


def global_sliding_window(lengths: Sequence[int], window: int, num_global: int) -> AttnMask:
    """Causal sliding window (as sliding_window) plus the first `num_global` tokens of each document."""
    window = _positive("window", window)
    if int(num_global) != num_global or num_global < 0:
        raise ValueError(f"num_global: must be a non-negative integer, got {num_global!r}")
    docs = _documents(lengths)
    slices: Slices = []
    for s, e in docs:
        g = min(num_global, e - s)
        head = min(e, s + g + window)  # rows whose window reaches back into the global tokens
        slices += [(s, head, s, head, CAUSAL), (s + g + window, e, s + g + 1, e, BI_CAUSAL),
                   (s + g + window, e, s, s + g, FULL)]
    return _build(slices, docs[-1][1])


def causal_blockwise(lengths: Sequence[int]) -> AttnMask:
    """Documents causal by themselves, except the last one, which also sees everything before it."""
    docs = _documents(lengths)
    ls, le = docs[-1]
    slices = [(s, e, s, e, CAUSAL) for s, e in docs] + [(ls, le, 0, ls, FULL)]
    return _build(slices, le)


__all__ = ["full", "causal", "varlen_full", "varlen_causal", "sliding_window", "block_causal",
           "shared_question", "prefix_lm", "global_sliding_window", "causal_blockwise"]
