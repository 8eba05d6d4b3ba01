"""planner/calls.py: which q blocks the distributed forward's last call takes from the host call."""

from __future__ import annotations

import numpy as np
import pytest

from magi_jax import masks
from magi_jax.mask import AttnMask
from magi_jax.planner import CostModel, make_plan
from magi_jax.planner.calls import Q_BLOCK, moved_blocks, split_host
from tests.test_dist_helpers import random_mask


def test_moved_blocks_fewest_host_cells_first_while_the_host_call_keeps_enough():
    area = np.array([50, 10, 40, 30, 20, 60])
    mixed = np.array([True, True, False, True, True, False])
    # 210 cells; moving 10, then 20, then 30 leaves 150 >= 140; the next (50) would leave 100.
    np.testing.assert_array_equal(moved_blocks(area, mixed, keep_cells=140),
                                  [False, True, False, True, True, False])
    np.testing.assert_array_equal(moved_blocks(area, mixed, keep_cells=0), mixed)        # every mixed block
    assert not moved_blocks(area, mixed, keep_cells=1e9).any()


def _dense(mask_like: tuple[np.ndarray, np.ndarray, np.ndarray], tq: int, tk: int) -> np.ndarray:
    q, k, t = mask_like
    return AttnMask(q, k, t, tq, tk).to_dense() if len(q) else np.zeros((tq, tk), np.int64)


@pytest.mark.parametrize("cp, seed", [(2, 0), (4, 1), (8, 2)])
@pytest.mark.parametrize("free", [False, True])
def test_split_host_partitions_the_host_cells_by_q_block(cp, seed, free):
    model = CostModel(bytes_per_s=1e30, collective_latency_s=0.0) if free else CostModel()
    plan = make_plan(random_mask(seed, total=384 * cp, max_slices=14), cp, chunk_size=32, overlap=2,
                     cost_model=model)
    kept, moved = split_host(plan)
    L = plan.local_len
    for r in range(cp):
        host = _dense(plan.host.of_rank(r), L, L)
        a, b = _dense(kept.of_rank(r), L, L), _dense(moved.of_rank(r), L, L)
        np.testing.assert_array_equal(a + b, host)                 # every host cell once, in one of the calls
        blocks_a = {int(x) // Q_BLOCK for x in np.flatnonzero(a.any(axis=1))}
        blocks_b = {int(x) // Q_BLOCK for x in np.flatnonzero(b.any(axis=1))}
        assert not blocks_a & blocks_b                             # a q block runs in one call
        remote = set()
        for st in plan.stages:
            for qs, qe in st.slices.of_rank(r)[0]:
                remote |= set(range(qs // Q_BLOCK, -(-qe // Q_BLOCK)))
        assert blocks_b <= remote                                  # only blocks with remote keys move
        if free:
            assert blocks_b == remote & {int(x) // Q_BLOCK for x in np.flatnonzero(host.any(axis=1))}


def test_split_host_keeps_the_host_call_as_long_as_the_first_transfer():
    # 1M tokens on 8 ranks (bench/dist.py's mask at that scale): the rank whose host cells would mostly move
    # keeps enough of them to cover the first stage's predicted transfer.
    from bench.common import doc_lengths
    plan = make_plan(masks.varlen_causal(doc_lengths(8 * 131072, 0)), 8, num_heads_q=16, head_dim=128)
    kept, moved = split_host(plan)
    cell_s = plan.cost_model.cell_seconds(16, 128)
    comm0 = plan.stats().stage_comm_s[0]
    assert (kept.areas() * cell_s >= comm0).all()
    assert moved.areas().sum() > 0.3 * plan.host.areas().sum()
