"""Which query rows the distributed forward's last call takes whole, over both of its key sources.

The forward runs the host call (local keys) beside the first transfer, then one call per stage, each merging
its part into the out and lse so far. A q block whose rows attend remote keys too is then visited by two
calls: two tiles per head, each loading Q, paying a tile's start and end, the second merging. `split_host`
moves those blocks' host slices into the last call, which reads the local keys and the last stage's receive
buffer as two key sources (ffa's k2): one tile each. The host call must still outlast the first transfer,
or the wait for it shows: blocks move fewest host cells first, and only while the host call's predicted time
stays at or above the first stage's predicted transfer (the plan's cost model).
"""

from __future__ import annotations

import numpy as np

from magi_jax.mask import slice_areas
from magi_jax.planner.geometry import clip
from magi_jax.planner.plan import DistAttnPlan, SliceSet
from magi_jax.planner.slices import pad_slices

# The forward kernels' q block (cuda/tile_size.h kQBlock): the unit a call visits.
Q_BLOCK = 128


def _block_pairs(q_ranges: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slice, interval) index pairs of every slice with every interval [bounds[j], bounds[j + 1]) its rows
    overlap; bounds ascending."""
    first = np.searchsorted(bounds, q_ranges[:, 0], side="right") - 1
    last = np.searchsorted(bounds, q_ranges[:, 1], side="left")
    count = np.maximum(last - first, 0)
    i = np.repeat(np.arange(len(q_ranges)), count)
    j = first[i] + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    return i, j


def _pieces_by_interval(q: np.ndarray, k: np.ndarray, t: np.ndarray, bounds: np.ndarray):
    """The slices cut at the row bounds: (q, k, types, interval of each piece)."""
    i, j = _block_pairs(q, bounds)
    rows = np.stack([bounds[j], bounds[j + 1]], axis=1)
    p = clip(q[i].astype(np.int64), k[i].astype(np.int64), t[i].astype(np.int64), rows, k[i].astype(np.int64))
    return p.q_ranges, p.k_ranges, p.types, j[p.src]


def moved_blocks(host_area: np.ndarray, mixed: np.ndarray, keep_cells: float) -> np.ndarray:
    """Which q blocks move: mixed ones, fewest host cells first, while the cells left in the host call stay
    at or above keep_cells. host_area [blocks], mixed bool [blocks]; returns bool [blocks]."""
    cand = np.flatnonzero(mixed)
    cand = cand[np.argsort(host_area[cand], kind="stable")]
    left = host_area.sum() - np.cumsum(host_area[cand])
    out = np.zeros(len(mixed), bool)
    out[cand[left >= keep_cells]] = True
    return out


def split_host(plan: DistAttnPlan) -> tuple[SliceSet, SliceSet]:
    """(the host call's slices, the moved ones) per rank: the plan's host slices cut at q-block bounds into
    the blocks that stay and those the last call takes (keys, as the host's, index the local keys)."""
    cp, nb = plan.cp, -(-plan.local_len // Q_BLOCK)
    bounds = np.arange(nb + 1, dtype=np.int64) * Q_BLOCK
    s = plan.stats()
    model = plan.cost_model
    comm0 = s.stage_comm_s[0] if len(s.stage_comm_s) else 0.0
    keep_cells = np.floor(comm0 / model.cell_seconds(plan.num_heads_q, plan.head_dim))
    parts: list[list[np.ndarray]] = [[], [], [], [], []]   # rank, q, k, types, moved
    for r in range(cp):
        q, k, t = plan.host.of_rank(r)
        mixed = np.zeros(nb, bool)
        for st in plan.stages:
            mixed[_block_pairs(st.slices.of_rank(r)[0].astype(np.int64), bounds)[1]] = True
        pq, pk, pt, block = _pieces_by_interval(q, k, t, bounds)
        moved = moved_blocks(np.bincount(block, weights=slice_areas(pq, pk, pt), minlength=nb), mixed, keep_cells)
        # Cut the slices again, at the bounds of the runs of blocks on one side only: as few pieces as can be.
        edges = np.flatnonzero(np.diff(moved)) + 1
        runs = np.concatenate([[0], bounds[edges], [bounds[-1]]])
        pq, pk, pt, run = _pieces_by_interval(q, k, t, runs)
        for lst, x in zip(parts, (np.full(len(pq), r), pq, pk, pt, moved[runs[run] // Q_BLOCK])):
            lst.append(x)
    rank, q, k, t, moved = (np.concatenate(x) for x in parts)
    return (SliceSet(*pad_slices(rank[~moved], q[~moved], k[~moved], t[~moved], cp)),
            SliceSet(*pad_slices(rank[moved], q[moved], k[moved], t[moved], cp)))
