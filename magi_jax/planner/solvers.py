"""Dispatch solvers: which rank owns which chunks (equal chunk count per rank).

Every solver maps a ``ChunkTable`` and ``cp`` to ``cp`` ascending int64 arrays of chunk ids. Selectable by name
through ``SOLVERS``:

- ``comm_aware`` (default): minimise the slowest rank's predicted time, ``cell_cost * area +
  key_cost * remote_keys``, under a hard cap on ``max area / mean area``: a greedy start that keeps chunks
  needing the same keys together, then a swap local search.
- ``minheap``: the reference library's solver: chunks by area descending onto the least-loaded rank that
  still has room. Balances area, ignores communication.
- ``zigzag``: rank i gets blocks i and 2cp-1-i of 2cp equal blocks (balanced for one causal sequence).
- ``contiguous``: rank i gets the i-th run of chunks.
"""

from __future__ import annotations

import heapq
from typing import Callable, NamedTuple

import numpy as np

from magi_jax.planner.chunks import ChunkTable

Partition = tuple[np.ndarray, ...]

# What a solver needs the chunks per rank to be a multiple of (zigzag halves each rank's share); make_plan
# pads the sequence to a multiple of ``chunk_size * cp * CHUNKS_PER_RANK_MULTIPLE.get(solver, 1)``.
CHUNKS_PER_RANK_MULTIPLE: dict[str, int] = {"zigzag": 2}


def _check(num_chunks: int, cp: int) -> int:
    if num_chunks % cp:
        raise ValueError(f"num_chunks={num_chunks} is not a multiple of cp={cp}")
    return num_chunks // cp


def minheap(areas: np.ndarray, cp: int) -> Partition:
    """Largest area first onto the least-loaded rank with room; ties go to the lower rank id."""
    areas = np.asarray(areas)
    per = _check(len(areas), cp)
    heap = [(0, r) for r in range(cp)]
    parts: list[list[int]] = [[] for _ in range(cp)]
    for c in np.argsort(-areas, kind="stable"):
        load, r = heapq.heappop(heap)
        parts[r].append(int(c))
        if len(parts[r]) < per:  # a full rank leaves the heap for good
            heapq.heappush(heap, (load + areas[c], r))
    return tuple(np.sort(np.array(p, np.int64)) for p in parts)


def contiguous(num_chunks: int, cp: int) -> Partition:
    per = _check(num_chunks, cp)
    return tuple(np.arange(r * per, (r + 1) * per, dtype=np.int64) for r in range(cp))


def zigzag(num_chunks: int, cp: int) -> Partition:
    per = _check(num_chunks, cp)
    if per % 2:
        raise ValueError(f"solver 'zigzag' needs an even number of chunks per rank, got {num_chunks} chunks over "
                         f"cp={cp} ({per} per rank): the sequence must be padded to a multiple of "
                         f"2 x chunk_size x cp (make_plan does this)")
    half = per // 2
    return tuple(np.concatenate([np.arange(r * half, (r + 1) * half),
                                 np.arange((2 * cp - 1 - r) * half, (2 * cp - r) * half)]).astype(np.int64)
                 for r in range(cp))


def area_cap(areas: np.ndarray, cp: int, imbalance_cap: float) -> float:
    """The largest area a rank may get: ``imbalance_cap * mean``, or, when the heaviest chunk plus the
    lightest others already exceed that (no partition can meet it), that reachable bound instead."""
    areas = np.asarray(areas, np.float64)
    per = _check(len(areas), cp)
    return max(imbalance_cap * areas.sum() / cp, areas.max() + np.sort(areas)[:per - 1].sum())


def _bincount(index: np.ndarray, weights: np.ndarray, size: int) -> np.ndarray:
    """Float sums per index (np.bincount returns ints for empty input)."""
    return np.bincount(index, weights=weights.astype(np.float64), minlength=size).astype(np.float64)


class _RemoteModel:
    """Predicted fetched keys of a chunk set: per key chunk not owned, the most keys any owned chunk
    needs from it (exact when needs from one key chunk are nested, as for causal documents)."""

    def __init__(self, table: ChunkTable):
        self.n = table.num_chunks
        self.indptr = table.need_indptr
        self.kc = table.need_chunk
        self.tok = table.need_tokens.astype(np.float64)
        self.row = np.repeat(np.arange(self.n), np.diff(self.indptr))
        self._mark = np.zeros(self.n, bool)

    def entries(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(key chunk, tokens, position in ``chunks``) of every need entry of ``chunks``."""
        s, e = self.indptr[chunks], self.indptr[chunks + 1]
        lens = e - s
        pos = np.repeat(np.arange(len(chunks)), lens)
        idx = np.repeat(s - (np.cumsum(lens) - lens), lens) + np.arange(lens.sum())
        return self.kc[idx], self.tok[idx], pos

    def cover(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Per key chunk: largest need (cov1), runner-up (cov2), the position in ``chunks`` of the largest
        (-1 if none); and the remote keys: the sum of cov1 over key chunks not in ``chunks``."""
        n = self.n
        cov1, cov2 = np.zeros(n), np.zeros(n)
        arg1 = np.full(n, -1, np.int64)
        k, w, pos = self.entries(chunks)
        if len(k):
            order = np.lexsort((-w, k))
            k, w, pos = k[order], w[order], pos[order]
            first = np.ones(len(k), bool)
            first[1:] = k[1:] != k[:-1]
            cov1[k[first]] = w[first]
            arg1[k[first]] = pos[first]
            second = np.zeros(len(k), bool)
            second[1:] = ~first[1:] & first[:-1]
            cov2[k[second]] = w[second]
        self._mark[chunks] = True
        rem = float(cov1[~self._mark].sum())
        self._mark[chunks] = False
        return cov1, cov2, arg1, rem

    def remote(self, chunks: np.ndarray) -> float:
        """``cover(chunks)[3]`` without the runner-up tables: only the largest need per key chunk."""
        k, w, _ = self.entries(chunks)
        cov1 = np.zeros(self.n)
        np.maximum.at(cov1, k, w)
        self._mark[chunks] = True
        rem = float(cov1[~self._mark].sum())
        self._mark[chunks] = False
        return rem


def affinity_greedy(table: ChunkTable, cp: int, key_cost: float, imbalance_cap: float) -> Partition:
    """Largest area first, each chunk onto the rank where it adds the fewest fetched keys.

    Only ranks with room whose load stays under the cap (keeping, for their remaining slots, half the
    mean area of the chunks not yet placed) are eligible; among equal additions a chunk the rank already
    needs goes to the rank fetching the most, a new need to the rank fetching the least. When no rank is
    eligible the least-loaded rank with room takes it, as in ``minheap``.
    """
    n = table.num_chunks
    per = _check(n, cp)
    areas = table.areas.astype(np.float64)
    model = _RemoteModel(table)
    cap = area_cap(areas, cp, imbalance_cap)
    # Per key chunk and rank: the largest need so far, inf once the rank owns the key chunk (it then
    # adds nothing: max(0, w - inf) = 0).
    cov_t = np.zeros((n, cp))
    owner = np.full(n, -1, np.int64)
    load, rem = np.zeros(cp), np.zeros(cp)
    count = np.zeros(cp, np.int64)
    half_slots = np.full(cp, 0.5 * max(per - 1, 0))    # half of each rank's slots left after this chunk
    left_area, left = areas.sum(), n
    for c in np.argsort(-areas, kind="stable"):
        k, w = model.kc[model.indptr[c]:model.indptr[c + 1]], model.tok[model.indptr[c]:model.indptr[c + 1]]
        other = k != c
        k, w = k[other], w[other]
        inc = np.maximum(0.0, w[:, None] - cov_t[k]).sum(axis=0) - cov_t[c]   # owning c stops fetching it
        left_area -= areas[c]
        left -= 1
        reserve = half_slots * left_area / max(left, 1)
        room = count < per
        ok = room & (load + areas[c] + reserve <= cap)
        if ok.any():
            primary = np.where(ok, inc, np.inf)
            tie = np.flatnonzero(primary <= primary.min() + 1e-9)
            second = np.where(inc[tie] < 0, -rem[tie], rem[tie] + inc[tie])
            r = int(tie[np.argmin(second)])
        else:
            r = int(np.argmin(np.where(room, load, np.inf)))
        owner[c] = r
        count[r] += 1
        half_slots[r] = max(half_slots[r] - 0.5, 0.0)
        load[r] += areas[c]
        rem[r] += inc[r]
        cov_t[k, r] = np.maximum(cov_t[k, r], w)
        cov_t[c, r] = np.inf
    return tuple(np.sort(np.flatnonzero(owner == r)) for r in range(cp))


class _SwapSearch:
    """State of the comm-aware local search (see ``comm_aware``).

    Areas and key counts are integers held exactly in float64, so sums do not depend on their order and
    every host of a multi-host job computes the same plan.
    """

    def __init__(self, table: ChunkTable, cp: int, cell_cost: float, key_cost: float,
                 cap: float, start: Partition, min_gain: float = 0.0):
        n = table.num_chunks
        self.n, self.cp, self.per = n, cp, _check(n, cp)
        self.areas = table.areas.astype(np.float64)
        self.model = model = _RemoteModel(table)
        self.not_self = model.kc != model.row
        self.cell_cost, self.key_cost = cell_cost, key_cost
        self.cap = cap   # the largest area a rank may get
        # One cell over the cap costs more than any time the search can save.
        self.penalty = 2.0 * (cell_cost * self.areas.sum() + key_cost * n * table.chunk_size) + 1.0
        # Areas and keys are integers: a real improvement is far above this, float noise far below.
        self.tol = 1e-12 * (cell_cost * self.areas.sum() / cp + key_cost * table.chunk_size)
        self.min_gain = min_gain
        self.parts = np.stack([np.asarray(p, np.int64) for p in start])
        self.owner = np.empty(n, np.int64)
        for r, p in enumerate(self.parts):
            self.owner[p] = r
        # Per rank and key chunk: the largest need, the runner-up, and the chunk giving the largest (-1).
        self.cov1 = np.zeros((cp, n))
        self.cov2 = np.zeros((cp, n))
        self.arg1 = np.full((cp, n), -1, np.int64)
        self.rem = np.zeros(cp)
        self.rem_without = np.zeros(n)   # remote keys of owner[c] once c leaves it, per chunk c
        for r in range(cp):
            self.refresh(r)
        self.load = self.areas[self.parts].sum(axis=1)
        self.t = self.cost(self.load, self.rem)

    def cost(self, load, rem):
        return (self.cell_cost * load + self.key_cost * rem
                + self.penalty * np.maximum(0.0, load - self.cap))

    def refresh(self, r: int) -> None:
        P = self.parts[r]
        c1, c2, a1, rm = self.model.cover(P)
        self.cov1[r], self.cov2[r], self.rem[r] = c1, c2, rm
        self.arg1[r] = np.where(a1 >= 0, P[np.maximum(a1, 0)], -1)
        # Removing P[j]: keys whose top need came from P[j] fall to the runner-up, and P[j] becomes a
        # key chunk the rest may need.
        notown = np.ones(self.n, bool)
        notown[P] = False
        valid = (a1 >= 0) & notown
        delta = _bincount(a1[valid], (c1 - c2)[valid], self.per)
        self_cov = np.where(a1[P] == np.arange(self.per), c2[P], c1[P])
        self.rem_without[P] = rm - delta + self_cov

    def best_swap(self, r: int, candidates_checked: int) -> tuple[int, int, int] | None:
        """A swap (position j in r, chunk c', its owner s) lowering both costs below r's, or None."""
        n, per, areas, owner = self.n, self.per, self.areas, self.owner
        model, limit = self.model, self.t[r] - self.tol - self.min_gain * self.t[r]
        kc, tok, row = model.kc, model.tok, model.row
        P = self.parts[r]
        pos = np.full(n, -1, np.int64)
        pos[P] = np.arange(per)
        c1, c2 = self.cov1[r], self.cov2[r]
        a1 = np.where(self.arg1[r] >= 0, pos[np.maximum(self.arg1[r], 0)], -1)
        self_cov = np.where(a1[P] == np.arange(per), c2[P], c1[P])
        # r's remote after swapping P[j] for c', exactly: keys c' adds relative to r's full cover...
        k_owned = pos[kc] >= 0
        add = _bincount(row, np.maximum(0.0, tok - c1[kc]) * (~k_owned & self.not_self), n)
        # ...corrected where P[j] gave the top need (the cover falls to the runner-up) and for P[j]
        # itself, which becomes a key chunk to fetch...
        a_k = a1[kc]
        sel = np.flatnonzero((a_k >= 0) & ~k_owned & self.not_self)
        ks, ws = kc[sel], tok[sel]
        fix = _bincount(a_k[sel] * n + row[sel],
                        np.maximum(0.0, ws - c2[ks]) - np.maximum(0.0, ws - c1[ks]), per * n)
        sel = np.flatnonzero(k_owned & self.not_self)
        j_of = pos[kc[sel]]
        fix += _bincount(j_of * n + row[sel], np.maximum(0.0, tok[sel] - self_cov[j_of]), per * n)
        # ...minus c' itself, which r then owns (its cover without P[j]).
        cov_wo = np.broadcast_to(c1, (per, n)).copy()
        has = np.flatnonzero(a1 >= 0)
        cov_wo[a1[has], has] = c2[has]
        est_r = self.cost(self.load[r] - areas[P][:, None] + areas[None, :],
                          self.rem_without[P][:, None] + add[None, :] + fix.reshape(per, n) - cov_wo)
        # Only swaps whose r side already wins are worth scoring on the s side: pairs (j, c') in row-major
        # order, so ties among equal scores fall as they would over the flattened (per, n) table.
        ok_r = est_r < limit
        ok_r[:, P] = False
        jj, cc = np.nonzero(ok_r)
        if len(jj) == 0:
            return None
        ss = owner[cc]
        S = np.flatnonzero(np.bincount(ss, minlength=self.cp))
        s_of = np.full(self.cp, -1, np.int64)
        s_of[S] = np.arange(len(S))
        # s's remote, a lower bound: without c' (exact), plus what P[j] adds to s's current cover, minus
        # s's need of P[j], which s then owns.
        k, w, je = model.entries(P)
        keep = k != P[je]
        k, w, je = k[keep], w[keep], je[keep]
        gap = np.maximum(0.0, w[:, None] - self.cov1[np.ix_(S, k)].T)       # [entries, |S|]
        so_k = s_of[owner[k]]
        hit = np.flatnonzero(so_k >= 0)
        gap[hit, so_k[hit]] = 0.0                       # keys s owns cost s nothing
        add_s = np.zeros((per, len(S)))
        if len(k):
            starts = np.searchsorted(je, np.arange(per))
            nonempty = np.bincount(je, minlength=per) > 0
            add_s[nonempty] = np.add.reduceat(gap, starts[nonempty], axis=0)
        Pj = P[jj]
        est_s = self.cost(self.load[ss] - areas[cc] + areas[Pj],
                          self.rem_without[cc] + add_s[jj, s_of[ss]] - self.cov1[ss, Pj])
        score = np.maximum(est_r[jj, cc], est_s)
        cand = np.flatnonzero(score < limit)
        if len(cand) == 0:
            return None
        if len(cand) > candidates_checked and self.load[r] <= self.cap:   # over the cap: try them all
            cand = cand[np.argpartition(score[cand], candidates_checked - 1)[:candidates_checked]]
        for i in cand[np.argsort(score[cand], kind="stable")]:
            j, c_new, s = int(jj[i]), int(cc[i]), int(ss[i])
            if self.cost(self.load[s] - areas[c_new] + areas[P[j]], self.remote_after(s, c_new, P[j])) < limit:
                return j, c_new, s
        return None

    def remote_after(self, s: int, c_out: int, c_in: int) -> float:
        """s's remote keys once it gives ``c_out`` for ``c_in``, from its tables: what ``model.remote`` of
        the new chunk set gives (keys are integers, so the sums are exact in any order)."""
        def cover_without(k):      # s's largest need per key chunk once c_out is gone
            return np.where(self.arg1[s, k] == c_out, self.cov2[s, k], self.cov1[s, k])
        m = self.model
        k, w = m.kc[m.indptr[c_in]:m.indptr[c_in + 1]], m.tok[m.indptr[c_in]:m.indptr[c_in + 1]]
        fetched = (k != c_in) & ((self.owner[k] != s) | (k == c_out))
        k, w = k[fetched], w[fetched]
        return float(self.rem_without[c_out] - cover_without(c_in) + np.maximum(0.0, w - cover_without(k)).sum())

    def apply(self, r: int, j: int, c_new: int, s: int) -> None:
        c = self.parts[r, j]
        self.parts[r, j] = c_new
        self.parts[s][self.parts[s] == c_new] = c
        self.owner[c], self.owner[c_new] = s, r
        self.load[r] += self.areas[c_new] - self.areas[c]
        self.load[s] += self.areas[c] - self.areas[c_new]
        for x in (r, s):
            self.refresh(x)
            self.t[x] = self.cost(self.load[x], self.rem[x])

    def run(self, max_moves: int, ranks_tried: int, candidates_checked: int) -> Partition:
        for _ in range(max_moves):
            for r in np.argsort(-self.t, kind="stable")[:ranks_tried]:
                move = self.best_swap(int(r), candidates_checked)
                if move is not None:
                    self.apply(int(r), *move)
                    break
            else:
                break
        return tuple(np.sort(p) for p in self.parts)


def comm_aware(table: ChunkTable, cp: int, cell_cost: float = 1.0, key_cost: float = 1800.0,
               imbalance_cap: float = 1.02, min_gain: float = 0.005, polish_gain: float = 0.001,
               max_moves: int | None = None, ranks_tried: int = 4, candidates_checked: int = 8) -> Partition:
    """Minimise the slowest rank's ``cell_cost*area + key_cost*remote`` under ``max area <= cap * mean``.

    Start: ``affinity_greedy``, or contiguous or zigzag if under the cap and cheaper. Then a swap local search:
    a swap of chunk c (rank r) with chunk c' (rank s) is taken when both new costs fall below r's old cost
    by ``min_gain`` (relative), so the sorted vector of rank costs strictly decreases and the search ends.
    Ranks are tried from the most expensive down (``ranks_tried`` per round). For rank r every swap is
    scored at once: r's new remote keys exactly, s's by a tight lower bound (per-rank tables of the largest
    and second largest need per key chunk); the best ``candidates_checked`` are then checked exactly (all of
    them while r is over the cap). Area over the cap costs more than any time the search can save, so it is
    removed first and never comes back. ``cell_cost`` and ``key_cost`` are seconds per attended cell and
    per fetched key (only their ratio matters).

    The search is local: where it ends depends on the cap it runs under, and a tighter cap often leads it to
    a partition that is both better balanced and fetches less (varlen causal, 128k tokens on 2 ranks: 18.7k
    remote keys at cap 1.02, 12.7k at cap 1.0025, both within 0.25% of the mean area; forward+backward on 2
    H200s 20.98 -> 20.74 ms, BENCHMARKS.md 2026-11-30 16:28). So it also runs under tighter caps
    (``CAP_LADDER``) and keeps the cheapest partition. Heavier key costs were tried as further starts: the
    model then picked less balanced partitions, which measured slower than it predicts.

    Last, a polish: the search again from that partition with the smaller ``polish_gain`` and its own
    largest area as the cap, so it only takes swaps that fetch less without unbalancing more. The ladder's
    searches stop early (``min_gain``) because, run to the end under a loose cap, they trade balance for
    keys, which measured slower (varlen block-causal, 2 H200s: imbalance 1.0022 -> 1.0080 for 10% fewer
    keys, +0.5%); under its own cap the polish found, for varlen causal 128k on 2 ranks, imbalance 1.0022 ->
    1.0007 and 12662 -> 11946 keys: forward+backward -1.1% (BENCHMARKS.md 2026-11-30 18:20).
    """
    slack = max(imbalance_cap - 1.0, 0.0)
    cap = area_cap(table.areas, cp, imbalance_cap)
    fixed = _fixed_starts(table, cp, cell_cost, key_cost)     # the same for every cap: scored once
    ladder = dict.fromkeys(1.0 + fraction * slack for fraction in CAP_LADDER)   # no slack: one search
    found = [_comm_aware_at(table, cp, cell_cost, key_cost, c, min_gain, max_moves, ranks_tried, candidates_checked,
                            fixed) for c in ladder]
    scored = (_score_start(table, parts, cell_cost, key_cost) for parts in found)
    best = min(scored, key=lambda x: (max(0.0, x.largest - cap), x.cost))   # area over the cap first, then cost
    polish = _SwapSearch(table, cp, cell_cost, key_cost, best.largest, best.parts, polish_gain)
    return polish.run(40 * table.num_chunks if max_moves is None else max_moves, ranks_tried, candidates_checked)


# The caps comm_aware searches under, as fractions of the imbalance cap's slack (1: the cap itself).
CAP_LADDER = (1.0, 0.5, 0.25, 0.125)


class _Start(NamedTuple):
    """A start of the swap search: the partition, its largest area and its cost (the slowest rank's)."""

    parts: Partition
    largest: float
    cost: float


def _score_start(table: ChunkTable, parts: Partition, cell_cost: float, key_cost: float) -> _Start:
    areas = table.areas.astype(np.float64)
    load = np.array([areas[p].sum() for p in parts])
    rem = predicted_remote(table, parts)
    return _Start(parts, float(load.max()), float((cell_cost * load + key_cost * rem).max()))


def _fixed_starts(table: ChunkTable, cp: int, cell_cost: float, key_cost: float) -> list[_Start]:
    """Contiguous, and zigzag when each rank has an even number of chunks."""
    n = table.num_chunks
    starts = [contiguous(n, cp)] + ([zigzag(n, cp)] if _check(n, cp) % 2 == 0 else [])
    return [_score_start(table, p, cell_cost, key_cost) for p in starts]


def _comm_aware_at(table: ChunkTable, cp: int, cell_cost: float, key_cost: float, imbalance_cap: float,
                   min_gain: float, max_moves: int | None, ranks_tried: int, candidates_checked: int,
                   fixed: list[_Start] | None = None) -> Partition:
    """One search of ``comm_aware`` under one cap; ``fixed``: ``_fixed_starts`` when already scored."""
    # The greedy start leads to the best searches on document masks even when it starts over the cap; a
    # start already under the cap (e.g. contiguous for sliding windows) wins when it is cheaper.
    greedy = affinity_greedy(table, cp, key_cost / max(cell_cost, 1e-300), imbalance_cap)
    fixed = _fixed_starts(table, cp, cell_cost, key_cost) if fixed is None else fixed
    starts = [_score_start(table, greedy, cell_cost, key_cost)] + fixed
    cap = area_cap(table.areas, cp, imbalance_cap)
    pick = min((x for x in starts if x.largest <= cap), key=lambda x: x.cost, default=starts[0])
    search = _SwapSearch(table, cp, cell_cost, key_cost, cap, pick.parts, min_gain)
    return search.run(40 * table.num_chunks if max_moves is None else max_moves, ranks_tried, candidates_checked)


def predicted_remote(table: ChunkTable, partition: Partition) -> np.ndarray:
    """The solvers' estimate of each rank's fetched keys (the plan computes the exact number)."""
    model = _RemoteModel(table)
    return np.array([model.remote(np.asarray(p)) for p in partition])


SolverFn = Callable[..., Partition]

SOLVERS: dict[str, SolverFn] = {
    "comm_aware": lambda table, cp, **kw: comm_aware(table, cp, **kw),
    "minheap": lambda table, cp, **kw: minheap(table.areas, cp),
    "zigzag": lambda table, cp, **kw: zigzag(table.num_chunks, cp),
    "contiguous": lambda table, cp, **kw: contiguous(table.num_chunks, cp),
}
DEFAULT_SOLVER = "comm_aware"
