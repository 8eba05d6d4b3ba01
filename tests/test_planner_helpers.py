"""Shared helpers for the planner tests: random masks and the dense per-rank coverage check."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from magi_jax.mask import AttnMask


def varlen_causal(lengths) -> AttnMask:
    ends = np.cumsum(lengths)
    r = np.stack([ends - np.asarray(lengths), ends], axis=1)
    return AttnMask(r, r, [1] * len(lengths), int(ends[-1]), int(ends[-1]))


@st.composite
def random_masks(draw, max_len: int = 40, max_slices: int = 6) -> AttnMask:
    """Arbitrary slices of all four types, overlapping and possibly empty."""
    T = draw(st.integers(1, max_len))
    n = draw(st.integers(1, max_slices))
    q, k, t = [], [], []
    for _ in range(n):
        a = draw(st.integers(0, T))
        b = draw(st.integers(a, T))
        c = draw(st.integers(0, T))
        d = draw(st.integers(c, T))
        q.append([a, b])
        k.append([c, d])
        t.append(draw(st.integers(0, 3)))
    return AttnMask(q, k, t, T, T)


def dense_from(q, k, t, rows: int, cols: int) -> np.ndarray:
    if len(t) == 0:
        return np.zeros((rows, cols), np.int32)
    return AttnMask(np.asarray(q, np.int64), np.asarray(k, np.int64), np.asarray(t), rows, cols).to_dense()


def check_coverage(plan) -> None:
    """For every rank: host + remote slices, mapped back to global keys, equal the mask's rows of its
    chunks cell by cell (with multiplicity); padding rows and receive-buffer padding get nothing."""
    T, Tp, L = plan.seqlen, plan.padded_seqlen, plan.local_len
    full = np.zeros((Tp, Tp), np.int64)
    full[:T, :T] = plan.mask.to_dense()
    pos = plan.position_ids().astype(np.int64)
    assert sorted(pos.tolist()) == list(range(Tp))
    recv = [plan.recv_global_keys(s) for s in range(plan.num_stages)]
    for r in range(plan.cp):
        rows = pos[r * L:(r + 1) * L]
        got = np.zeros((L, Tp), np.int64)
        got[:, rows] += dense_from(*plan.host.of_rank(r), L, L)
        for s, stage in enumerate(plan.stages):
            d = dense_from(*stage.slices.of_rank(r), L, stage.buffer_len)
            keys = recv[s][r].astype(np.int64)
            assert not d[:, keys < 0].any(), "a slice reads receive-buffer padding"
            np.add.at(got.T, keys[keys >= 0], d[:, keys >= 0].T)
        np.testing.assert_array_equal(got, full[rows], err_msg=f"rank {r}")
