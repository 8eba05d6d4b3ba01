"""Closed-form slice geometry and per-chunk areas/needs against dense masks."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from magi_jax.mask import AttnMask
from magi_jax.planner.chunks import chunk_table
from magi_jax.planner.geometry import clip, merge_intervals

from tests.test_planner_helpers import dense_from, random_masks


@st.composite
def slice_and_rect(draw, max_len=30):
    T = draw(st.integers(1, max_len))
    a = draw(st.integers(0, T)); b = draw(st.integers(a, T))
    c = draw(st.integers(0, T)); d = draw(st.integers(c, T))
    t = draw(st.integers(0, 3))
    r0 = draw(st.integers(0, T)); r1 = draw(st.integers(r0, T))
    c0 = draw(st.integers(0, T)); c1 = draw(st.integers(c0, T))
    return T, (a, b, c, d, t), (r0, r1, c0, c1)


@settings(derandomize=True, max_examples=400, deadline=None)
@given(slice_and_rect())
def test_clip_is_the_rectangle_of_the_slice(case):
    T, (a, b, c, d, t), (r0, r1, c0, c1) = case
    full = AttnMask([[a, b]], [[c, d]], [t], T, T).to_dense()
    want = np.zeros_like(full)
    want[r0:r1, c0:c1] = full[r0:r1, c0:c1]
    p = clip(np.array([[a, b]]), np.array([[c, d]]), np.array([t]), np.array([[r0, r1]]), np.array([[c0, c1]]))
    got = dense_from(p.q_ranges, p.k_ranges, p.types, T, T)
    np.testing.assert_array_equal(got, want)
    assert len(p.types) <= 3
    # every piece is non-empty on every row: the trimming left no idle rows
    for q, k, tt in zip(p.q_ranges, p.k_ranges, p.types):
        rows = dense_from([q], [k], [tt], T, T)[q[0]:q[1]]
        assert (rows.sum(axis=1) > 0).all()
    assert p.areas().sum() == want.sum()


def test_clip_keeps_an_uncut_slice_whole():
    for t in range(4):
        p = clip(np.array([[0, 8]]), np.array([[0, 12]]), np.array([t]), np.array([[0, 8]]), np.array([[0, 12]]))
        assert len(p.types) == 1 and p.types[0] == t
        assert p.q_ranges.tolist() == [[0, 8]] and p.k_ranges.tolist() == [[0, 12]]


def test_causal_cut_at_a_key_edge_becomes_typed_pieces():
    # causal 8x8 cut to keys [0, 4): rows 0..3 keep the diagonal (CAUSAL), rows 4..7 see all 4 keys (FULL)
    p = clip(np.array([[0, 8]]), np.array([[0, 8]]), np.array([1]), np.array([[0, 8]]), np.array([[0, 4]]))
    assert sorted(zip(p.q_ranges.tolist(), p.k_ranges.tolist(), p.types.tolist())) == [
        ([0, 4], [0, 4], 1), ([4, 8], [0, 4], 0)]


def test_merge_intervals():
    g, s, e = merge_intervals(np.array([1, 0, 0, 1, 0]), np.array([5, 0, 3, 6, 10]), np.array([7, 4, 6, 9, 10]))
    assert list(zip(g.tolist(), s.tolist(), e.tolist())) == [(0, 0, 6), (1, 5, 9)]


@settings(derandomize=True, max_examples=150, deadline=None)
@given(mask=random_masks(), data=st.data())
def test_chunk_areas_and_needs_match_dense(mask, data):
    T = mask.total_seqlen_q
    C = data.draw(st.integers(1, 9))
    n = -(-T // C) + data.draw(st.integers(0, 2))             # some all-padding chunks
    table = chunk_table(mask, C, n)
    dense = np.zeros((n * C, n * C), np.int64)
    dense[:T, :T] = mask.to_dense()
    blocks = dense.reshape(n, C, n * C)
    np.testing.assert_array_equal(table.areas, blocks.sum(axis=(1, 2)))
    needed = (blocks.sum(axis=1) > 0).reshape(n, n, C).sum(axis=2)     # distinct keys per key chunk
    got = np.zeros((n, n), np.int64)
    for c in range(n):
        k, tok = table.need_of(c)
        assert (np.diff(k) > 0).all()
        got[c, k] = tok
    np.testing.assert_array_equal(got, needed)
