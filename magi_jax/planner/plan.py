"""``make_plan``: mask + number of ranks -> a static, hashable ``DistAttnPlan`` (numpy only, no devices)."""

from __future__ import annotations

import functools
import math
from dataclasses import astuple, dataclass, field, fields
from typing import NamedTuple

import numpy as np

from magi_jax.mask import AttnMask, slice_areas
from magi_jax.planner.chunks import chunk_table
from magi_jax.planner.slices import (RankSlices, Segments, chunk_runs, cut, needed_keys, pad_slices,
                                     rank_slices)
from magi_jax.planner.solvers import CHUNKS_PER_RANK_MULTIPLE, DEFAULT_SOLVER, SOLVERS
from magi_jax.planner.stages import (MAX_DEGREE, CostModel, StageTiming, assign_stages, stage_timing)
from magi_jax.planner.transfers import StageTransfers, build_transfers


@dataclass(frozen=True, eq=False)
class SliceSet:
    """Slice lists of every rank, padded to one length N with empty slices (q [0,0), k [0,0), FULL):
    ``q_ranges`` int32 [cp, N, 2], ``k_ranges`` int32 [cp, N, 2], ``types`` int32 [cp, N]; row r is what
    rank r passes to the kernel."""

    q_ranges: np.ndarray
    k_ranges: np.ndarray
    types: np.ndarray

    def of_rank(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rank r's slices without the padding."""
        keep = self.q_ranges[r, :, 1] > self.q_ranges[r, :, 0]
        return self.q_ranges[r][keep], self.k_ranges[r][keep], self.types[r][keep]

    def areas(self) -> np.ndarray:
        """Attended cells per rank, int64 [cp]."""
        cp, N = self.types.shape
        a = slice_areas(self.q_ranges.reshape(-1, 2).astype(np.int64),
                        self.k_ranges.reshape(-1, 2).astype(np.int64), self.types.reshape(-1))
        return a.reshape(cp, N).sum(axis=1)


@dataclass(frozen=True, eq=False)
class Stage:
    """One overlap stage: what every rank receives and the slices it then computes.

    ``slices`` rows index the rank's local queries; keys index this stage's receive buffer of
    ``transfers.buffer_len`` tokens (layout in ``magi_jax.planner.transfers``)."""

    slices: SliceSet
    transfers: StageTransfers

    @property
    def buffer_len(self) -> int:
        return self.transfers.buffer_len


@dataclass(frozen=True, eq=False)
class PlanStats:
    """Per-rank numbers of a plan (arrays over ranks r, or stages i x ranks r) and its predicted time."""

    area: np.ndarray           # int64 [cp] attended cells (host + remote)
    host_area: np.ndarray      # int64 [cp]
    stage_area: np.ndarray     # int64 [stages, cp]
    remote_keys: np.ndarray    # int64 [cp] keys fetched
    sent_keys: np.ndarray      # int64 [cp] keys sent
    buffer_lens: tuple[int, ...]
    imbalance: float           # max area / mean area
    predicted_time_s: float    # forward time from the cost model (stages.py: the slowest rank)
    rank_time_s: np.ndarray    # [cp] each rank's finish time
    stage_comm_s: np.ndarray   # [stages]
    host_time_s: np.ndarray    # [cp] host call
    stage_time_s: np.ndarray   # [stages, cp] stage calls (degree 0: the fetched part of the one fused call)
    flops: float               # forward FLOPs over all ranks: 2 * area * Hq * (D + Dv)

    @property
    def tflops_per_gpu(self) -> float:
        cp = len(self.area)
        return self.flops / cp / self.predicted_time_s / 1e12 if self.predicted_time_s > 0 else 0.0

    def table(self) -> str:
        """The per-rank table printed by ``python -m magi_jax plan``."""
        mean = self.area.mean() if len(self.area) else 0.0
        lines = [f"{'rank':>5} {'area':>14} {'area/mean':>9} {'host area':>14} {'remote keys':>11} "
                 f"{'sent keys':>10} {'time ms':>8}"]
        for r in range(len(self.area)):
            lines.append(f"{r:5d} {self.area[r]:14d} {self.area[r] / max(mean, 1):9.3f} "
                         f"{self.host_area[r]:14d} {self.remote_keys[r]:11d} {self.sent_keys[r]:10d} "
                         f"{self.rank_time_s[r] * 1e3:8.3f}")
        lines.append(f"total area {int(self.area.sum())}, imbalance (max/mean) {self.imbalance:.4f}, "
                     f"max remote keys {int(self.remote_keys.max(initial=0))}, stages {len(self.buffer_lens)} "
                     f"(buffers {list(self.buffer_lens)}), predicted {self.predicted_time_s * 1e3:.3f} ms, "
                     f"{self.tflops_per_gpu:.1f} TFLOP/s per GPU")
        return "\n".join(lines)


@dataclass(frozen=True)
class PlanCapacity:
    """Shapes that plans of different masks (same sequence length, cp and chunk size) can share: overlap
    ``stages`` (plans with fewer get empty ones), ``stage_keys`` keys any rank sends any other in one stage
    (the all_to_all block), ``transfer_rows`` key ranges a rank packs per stage, and ``slices`` per rank
    and attention call. ``magi_jax.plan_tables`` pads a plan's tables to them, so that a jitted step taking them
    as an argument serves every such plan; ``DistAttnPlan.capacity()`` is what one plan needs,
    ``PlanCapacity.of`` covers several."""

    stages: int
    stage_keys: int
    transfer_rows: int
    slices: int

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{f.name}: must be a positive int, got {value!r}")

    @classmethod
    def of(cls, plans, headroom: float = 1.0) -> PlanCapacity:
        """The smallest capacity holding every plan of ``plans`` (DistAttnPlan, or anything with one as
        ``.plan``, such as magi_jax.MeshPlan; a PlanCapacity there counts as its fields), each field but
        ``stages`` times ``headroom`` (finite, >= 1) and rounded up, so that later plans of similar masks fit
        too (stages are not: an empty stage still moves its block)."""
        if not 1.0 <= headroom < math.inf:
            raise ValueError(f"headroom: must be finite and >= 1, got {headroom}")
        need = np.ones(len(fields(cls)), np.int64)
        for i, x in enumerate(plans):
            c = getattr(x, "plan", x)
            if isinstance(c, DistAttnPlan):
                c = c.capacity()
            elif not isinstance(c, PlanCapacity):
                raise ValueError(f"plans: element {i} ({type(x).__name__}) is not a DistAttnPlan, MeshPlan or "
                                 f"PlanCapacity")
            need = np.maximum(need, astuple(c))
        return cls(int(need[0]), *(int(np.ceil(x * headroom)) for x in need[1:]))


@dataclass(frozen=True, eq=False)
class DistAttnPlan:
    """A static plan for attention over ``cp`` ranks of one mesh axis. Hashable; equal plans compare equal.

    Tokens. The sequence (``seqlen`` tokens) is padded to ``padded_seqlen = num_chunks * chunk_size``, a
    multiple of ``chunk_size * cp`` (of ``2 * chunk_size * cp`` for zigzag, which needs an even number of
    chunks per rank: ``CHUNKS_PER_RANK_MULTIPLE``); padding tokens attend nothing and are dropped by
    undispatch. Rank r owns the chunks ``partitions[r]`` (ascending, ``chunks_per_rank`` of them) and holds
    them in that order in its local buffer of ``local_len`` tokens. The dispatched (global) array is the
    ranks' local buffers one after another: ``dispatch_perm[d]`` is the global token at dispatched position
    d (-1 for padding), and ``undispatch_perm[g]`` is the dispatched position of global token g:
    ``x_d = x_pad[position_ids()]``, ``x = x_d[undispatch_perm]``.

    Slices. ``host`` holds, for every rank, the slices whose keys it owns: rows index its local queries and
    keys index its local keys (the same local buffer). Then, for each stage i of ``stages``, rank r receives
    ``stages[i].transfers`` into a buffer of ``stages[i].buffer_len`` tokens (sources in ascending order,
    each source's keys in global order, then padding) and computes ``stages[i].slices``, whose keys index
    that buffer. All arrays are int32, padded per stage to one slice count with empty slices, so a shard_map
    body takes row ``axis_index`` of each. Host plus remote slices of a rank cover exactly the mask's cells
    of its rows, each cell as many times as the mask counts it. With ``overlap_degree == 0`` there is one
    stage, meant to run fused with the host slices (``fused_slices``).

    Worked example: ``varlen_mask([6, 2])`` (two causal documents, 8 tokens), cp=2, chunk_size=2,
    solver="minheap", overlap=1. Chunk areas are [3, 7, 11, 3] (chunk 2 = rows 4, 5 of document 0, chunk 3
    = document 1), so rank 0 gets chunks (2, 3) (area 14) and rank 1 chunks (0, 1) (area 10)::

        dispatch_perm = [4 5 6 7 | 0 1 2 3]          local_len 4, no padding

        rank 0: local rows 0, 1 = global 4, 5 (document 0, keys 0..5); rows 2, 3 = global 6, 7 (document 1).
                It owns keys 4..7 (local 0..3) and fetches keys 0..3 (rank 1's local 0..3).
        host   q_ranges[0] = [[0, 2], [2, 4]]   k_ranges[0] = [[0, 2], [2, 4]]   types[0] = [CAUSAL, CAUSAL]
        host   q_ranges[1] = [[0, 4]]           k_ranges[1] = [[0, 4]]           types[1] = [CAUSAL]
               (padded: row 1 also holds one empty slice q [0, 0), k [0, 0))
        stage 0 transfers: src 1 -> dst 0, src local [0, 4) -> receive buffer [0, 4); buffer_len 4
        stage 0 q_ranges[0] = [[0, 2]]   k_ranges[0] = [[0, 4]]   types[0] = [FULL]
               (rank 1 receives nothing and has one empty slice)

    (``tests/test_planner_plan.py`` checks this example.)
    """

    mask: AttnMask
    cp: int
    axis: str
    chunk_size: int
    solver: str
    overlap_degree: int           # stages asked for or chosen (0: fetch all, one fused call); >= num_stages
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    head_dim_v: int
    cost_model: CostModel
    imbalance_cap: float
    seqlen: int
    padded_seqlen: int
    partitions: tuple[tuple[int, ...], ...]
    dispatch_perm: np.ndarray     # int32 [padded_seqlen], -1 for padding
    undispatch_perm: np.ndarray   # int32 [seqlen]
    host: SliceSet
    stages: tuple[Stage, ...]
    chunk_areas: np.ndarray       # int64 [num_chunks]
    _stats: PlanStats = field(repr=False)
    _key: tuple = field(repr=False)

    @property
    def num_chunks(self) -> int:
        return self.padded_seqlen // self.chunk_size

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.cp

    @property
    def local_len(self) -> int:
        return self.padded_seqlen // self.cp

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def position_ids(self) -> np.ndarray:
        """int32 [padded_seqlen]: the position (in the padded global sequence) of every dispatched token;
        padding tokens get seqlen.. padded_seqlen-1. Also the gather index that dispatches a padded array."""
        C = self.chunk_size
        return (np.asarray(self.partitions, np.int64)[:, :, None] * C
                + np.arange(C)[None, None, :]).reshape(-1).astype(np.int32)

    def stats(self) -> PlanStats:
        return self._stats

    def capacity(self) -> PlanCapacity:
        """What this plan needs of a PlanCapacity (each field at least 1)."""
        rows = [np.bincount(st.transfers.src, minlength=self.cp).max(initial=0) for st in self.stages]
        slices = [self.host.types.shape[1]] + [st.slices.types.shape[1] for st in self.stages]
        return PlanCapacity(max(1, self.num_stages), max([1] + [st.transfers.pair_max for st in self.stages]),
                            int(max([1] + rows)), max(slices))

    def fused_slices(self) -> SliceSet:
        """Host and all remote slices in one list per rank, keys indexing ``concat(local keys, stage 0
        buffer, stage 1 buffer, ...)``: for running everything as one call after fetching (degree 0)."""
        qs, ks, ts, rk = [], [], [], []
        shift = self.local_len
        for i, ss in enumerate([self.host] + [s.slices for s in self.stages]):
            keep = ss.q_ranges[:, :, 1] > ss.q_ranges[:, :, 0]
            r = np.nonzero(keep)[0]
            qs.append(ss.q_ranges[keep])
            ks.append(ss.k_ranges[keep] + (0 if i == 0 else shift))
            ts.append(ss.types[keep])
            rk.append(r)
            if i > 0:
                shift += self.stages[i - 1].buffer_len
        return SliceSet(*pad_slices(np.concatenate(rk), np.concatenate(qs), np.concatenate(ks),
                                    np.concatenate(ts), self.cp))

    def recv_global_keys(self, stage: int) -> np.ndarray:
        """int32 [cp, buffer_len]: the global key held at every receive-buffer position (-1 padding)."""
        t = self.stages[stage].transfers
        out = np.full((self.cp, t.buffer_len), -1, np.int32)
        ln = (t.src_end - t.src_start).astype(np.int64)
        i = np.repeat(np.arange(len(ln)), ln)
        w = np.arange(ln.sum()) - np.repeat(np.cumsum(ln) - ln, ln)
        out[t.dst[i], t.dst_start[i] + w] = self.dispatch_perm[t.src[i].astype(np.int64) * self.local_len
                                                               + t.src_start[i] + w]
        return out

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DistAttnPlan) and self._key == other._key

    def __repr__(self) -> str:
        s = self._stats
        return (f"DistAttnPlan(cp={self.cp}, axis={self.axis!r}, chunk_size={self.chunk_size}, "
                f"solver={self.solver!r}, seqlen={self.seqlen}, padded={self.padded_seqlen}, "
                f"stages={self.num_stages}, imbalance={s.imbalance:.4f}, "
                f"max_remote_keys={int(s.remote_keys.max(initial=0))})")


def default_chunk_size(seqlen: int, cp: int) -> int:
    """At least 8 chunks per rank, at most 2048 tokens: ``seqlen / (8 cp)`` rounded down to a multiple of
    128 (kernel tiles) when that large, else to a power of two."""
    c = max(1, min(2048, math.ceil(seqlen / (8 * cp))))
    return c // 128 * 128 if c >= 128 else 1 << (c.bit_length() - 1)


def _check_args(mask, cp, chunk_size, solver, overlap, num_heads_q, num_heads_kv, head_dim, head_dim_v,
                imbalance_cap, cost_model):
    if not isinstance(mask, AttnMask):
        raise TypeError(f"mask: expected a magi_jax AttnMask, got {type(mask).__name__}")
    if mask.total_seqlen_q != mask.total_seqlen_k:
        raise ValueError(f"mask: cross-attention (total_seqlen_q={mask.total_seqlen_q} != total_seqlen_k="
                         f"{mask.total_seqlen_k}) is not supported by the planner; only self-attention is")
    if mask.total_seqlen_q < 1:
        raise ValueError("mask: the sequence is empty")
    for name, v in (("cp", cp), ("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv),
                    ("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool)
                                   or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected an integer >= 1 (or None for the default), got {chunk_size!r}")
    if num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q={num_heads_q} is not a multiple of num_heads_kv={num_heads_kv}")
    if solver not in SOLVERS:
        raise ValueError(f"solver: unknown {solver!r}; expected one of {sorted(SOLVERS)}")
    if not (overlap == "auto" or (isinstance(overlap, (int, np.integer)) and not isinstance(overlap, bool)
                                  and 0 <= overlap <= MAX_DEGREE)):
        raise ValueError(f"overlap: expected 'auto' or an integer 0..{MAX_DEGREE}, got {overlap!r}")
    if not imbalance_cap >= 1.0:
        raise ValueError(f"imbalance_cap: expected a number >= 1, got {imbalance_cap!r}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model: expected a magi_jax.planner CostModel (or None), got "
                         f"{type(cost_model).__name__}")


def make_plan(mask: AttnMask, cp: int, chunk_size: int | None = None, solver: str = DEFAULT_SOLVER,
              overlap: int | str = "auto", num_heads_q: int = 16, num_heads_kv: int | None = None,
              head_dim: int = 128, cost_model: CostModel | None = None, imbalance_cap: float = 1.02,
              axis: str = "cp", head_dim_v: int | None = None) -> DistAttnPlan:
    """Plan self-attention with ``mask`` over ``cp`` ranks; cached on all arguments.

    ``chunk_size`` defaults to ``default_chunk_size(seqlen, cp)``. ``solver`` is one of ``SOLVERS``
    (``comm_aware``, ``minheap``, ``zigzag``, ``contiguous``); the sequence is padded to an equal number of
    chunks per rank, an even number for ``zigzag`` (``CHUNKS_PER_RANK_MULTIPLE``). ``overlap`` is the number
    of stages the remote keys are fetched in (0: all at once, then one fused call; 1..8), or "auto" for the
    cost model's best.
    Heads, head_dim and head_dim_v (v's, default head_dim: MLA's 128 beside q / k's 192) only feed the
    cost model. ``imbalance_cap`` bounds max/mean area for ``comm_aware``.
    """
    num_heads_kv = num_heads_q if num_heads_kv is None else num_heads_kv
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    _check_args(mask, cp, chunk_size, solver, overlap, num_heads_q, num_heads_kv, head_dim, head_dim_v,
                imbalance_cap, cost_model)
    cost_model = CostModel() if cost_model is None else cost_model
    chunk_size = default_chunk_size(mask.total_seqlen_q, cp) if chunk_size is None else int(chunk_size)
    return _make_plan(mask, int(cp), chunk_size, solver, overlap if overlap == "auto" else int(overlap),
                      int(num_heads_q), int(num_heads_kv), int(head_dim), int(head_dim_v), cost_model,
                      float(imbalance_cap), str(axis))


class _Pieces(NamedTuple):
    """Remote keys: per rank (dst), the needed global keys [start, end) outside its own chunks, one piece per
    key chunk touched, owned by ``src`` at source-local position ``src_local``."""

    dst: np.ndarray
    src: np.ndarray
    start: np.ndarray
    end: np.ndarray
    src_local: np.ndarray

    @property
    def tokens(self) -> np.ndarray:
        return self.end - self.start


def _remote_pieces(rs: RankSlices, owner: np.ndarray, local: np.ndarray, C: int) -> _Pieces:
    nr, na, nb = needed_keys(rs)
    first, last = na // C, (nb - 1) // C
    cnt = last - first + 1
    i = np.repeat(np.arange(len(nr)), cnt)
    ch = first[i] + np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    g0, g1 = np.maximum(na[i], ch * C), np.minimum(nb[i], (ch + 1) * C)
    keep = owner[ch] != nr[i]
    ch, g0 = ch[keep], g0[keep]
    return _Pieces(nr[i][keep], owner[ch], g0, g1[keep], local[ch] * C + (g0 - ch * C))


def _host_pass(mask: AttnMask, rs: RankSlices, parts: tuple[np.ndarray, ...], pieces: _Pieces, C: int,
               cp: int, span: int) -> tuple[SliceSet, np.ndarray, np.ndarray]:
    """Host slices (final), host area per rank, and the area each remote piece brings (to size stages)."""
    runs, _ = chunk_runs(parts)
    n = len(pieces.dst)
    segs = Segments.build(np.concatenate([runs.rank, pieces.dst]), np.concatenate([runs.first * C, pieces.start]),
                          np.concatenate([runs.end * C, pieces.end]),
                          np.concatenate([runs.local_first * C, np.zeros(n, np.int64)]),
                          np.concatenate([np.full(len(runs.rank), -1), np.arange(n)]))
    c = cut(mask, rs, segs, span)
    area = slice_areas(c.q_ranges, c.k_ranges, c.types)
    h = c.tag < 0
    host_area = np.bincount(c.rank[h], weights=area[h], minlength=cp).astype(np.int64)
    piece_area = np.bincount(c.tag[~h], weights=area[~h], minlength=n).astype(np.int64)
    host = SliceSet(*pad_slices(c.rank[h], c.q_ranges[h], c.k_ranges[h], c.types[h], cp))
    return host, host_area, piece_area


def _choose_stages(pieces: _Pieces, piece_area: np.ndarray, host_area: np.ndarray, overlap: int | str,
                   cp: int, cell_s: float, key_s: float, model: CostModel
                   ) -> tuple[StageTiming, np.ndarray, int]:
    """(timing, stage of every piece, degree): the degree asked for, or the cost model's best of 0..8."""
    if len(pieces.dst) == 0:
        options = [0]
    else:
        options = list(range(MAX_DEGREE + 1)) if overlap == "auto" else [int(overlap)]
    best = None
    for d in options:
        st = assign_stages(pieces.dst, pieces.start, pieces.tokens, cp, d)
        if len(st):                                   # drop stages empty on every rank
            st = np.unique(st, return_inverse=True)[1].reshape(-1)
        used = 0 if d == 0 or len(st) == 0 else int(st.max()) + 1
        tm = stage_timing(used, cp, host_area, pieces.dst, pieces.src, pieces.tokens, piece_area, st,
                          cell_s, key_s, model)
        if best is None or tm.total < best[0].total * (1 - 1e-9):
            best = (tm, st, d)
    return best


def _remote_pass(mask: AttnMask, rs: RankSlices, pieces: _Pieces, stage: np.ndarray, cp: int, span: int
                 ) -> tuple[Stage, ...]:
    """Per stage the transfer table, then the remote slices cut against its merged key ranges."""
    n_stages = int(stage.max()) + 1 if len(stage) else 0
    tables, segs = [], []
    for s in range(n_stages):
        m = stage == s
        tbl, g0, off = build_transfers(pieces.dst[m], pieces.src[m], pieces.start[m], pieces.end[m],
                                       pieces.src_local[m], cp)
        tables.append(tbl)
        segs.append((tbl.dst, g0, g0 + (tbl.src_end - tbl.src_start), off, np.full(len(g0), s)))
    if not n_stages:
        return ()
    c = cut(mask, rs, Segments.build(*(np.concatenate([sg[k] for sg in segs]) for k in range(5))), span)
    out = []
    for s in range(n_stages):
        m = c.tag == s
        out.append(Stage(SliceSet(*pad_slices(c.rank[m], c.q_ranges[m], c.k_ranges[m], c.types[m], cp)),
                         tables[s]))
    return tuple(out)


def _freeze(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.setflags(write=False)


@functools.lru_cache(maxsize=64)
def _make_plan(mask: AttnMask, cp: int, C: int, solver: str, overlap: int | str, hq: int, hkv: int,
               head_dim: int, head_dim_v: int, model: CostModel, imbalance_cap: float, axis: str) -> DistAttnPlan:
    key = (mask, cp, C, solver, overlap, hq, hkv, head_dim, head_dim_v, model, imbalance_cap, axis)
    T = mask.total_seqlen_q
    real_chunks = math.ceil(T / C)
    if real_chunks < cp:
        raise ValueError(f"cp={cp} ranks but only {real_chunks} chunks of chunk_size={C} in {T} tokens; "
                         f"use chunk_size <= {max(1, T // cp)} or fewer ranks")
    step = cp * CHUNKS_PER_RANK_MULTIPLE.get(solver, 1)    # chunks: equal per rank, as the solver needs
    n = math.ceil(T / (C * step)) * step
    T_pad, per = n * C, n // cp
    table = chunk_table(mask, C, n)
    cell_s, key_s = model.cell_seconds(hq, head_dim, head_dim_v), model.key_seconds(hkv, head_dim, head_dim_v)
    parts = tuple(np.asarray(p, np.int64) for p in
                  SOLVERS[solver](table, cp, cell_cost=cell_s, key_cost=key_s, imbalance_cap=imbalance_cap))
    owner = np.empty(n, np.int64)
    local = np.empty(n, np.int64)        # position of each chunk in its owner's list
    for r, p in enumerate(parts):
        owner[p] = r
        local[p] = np.arange(per)

    # Dispatch: rank-major local buffers; padding tokens (global index >= T) marked -1.
    pos = (np.stack(parts)[:, :, None] * C + np.arange(C)[None, None, :]).reshape(-1)
    dispatch_perm = np.where(pos < T, pos, -1).astype(np.int32)
    undispatch = np.empty(T_pad, np.int64)
    undispatch[pos] = np.arange(T_pad)
    undispatch_perm = undispatch[:T].astype(np.int32)

    rs = rank_slices(mask, C, parts)
    pieces = _remote_pieces(rs, owner, local, C)
    span = T_pad + 1
    host, host_area, piece_area = _host_pass(mask, rs, parts, pieces, C, cp, span)
    timing, stage, degree = _choose_stages(pieces, piece_area, host_area, overlap, cp, cell_s, key_s, model)
    stages = _remote_pass(mask, rs, pieces, stage, cp, span)

    stage_area = np.array([s.slices.areas() for s in stages], np.int64).reshape(len(stages), cp)
    area = host_area + stage_area.sum(axis=0)
    stats = PlanStats(area=area, host_area=host_area, stage_area=stage_area,
                      remote_keys=np.bincount(pieces.dst, weights=pieces.tokens, minlength=cp).astype(np.int64),
                      sent_keys=np.bincount(pieces.src, weights=pieces.tokens, minlength=cp).astype(np.int64),
                      buffer_lens=tuple(s.buffer_len for s in stages),
                      imbalance=float(area.max() / max(area.mean(), 1e-300)),
                      predicted_time_s=timing.total, rank_time_s=timing.per_rank, stage_comm_s=timing.comm,
                      host_time_s=timing.host, stage_time_s=timing.comp,
                      flops=2.0 * float(area.sum()) * hq * (head_dim + head_dim_v))
    _freeze(dispatch_perm, undispatch_perm, table.areas, *host.__dict__.values(),
            *(a for s in stages for a in (*s.slices.__dict__.values(), s.transfers.src, s.transfers.dst,
                                          s.transfers.src_start, s.transfers.src_end, s.transfers.dst_start,
                                          s.transfers.pair_tokens)),
            *(a for a in stats.__dict__.values() if isinstance(a, np.ndarray)))
    return DistAttnPlan(mask=mask, cp=cp, axis=axis, chunk_size=C, solver=solver, overlap_degree=degree,
                        num_heads_q=hq, num_heads_kv=hkv, head_dim=head_dim, head_dim_v=head_dim_v, cost_model=model,
                        imbalance_cap=imbalance_cap, seqlen=T, padded_seqlen=T_pad,
                        partitions=tuple(tuple(int(c) for c in p) for p in parts),
                        dispatch_perm=dispatch_perm, undispatch_perm=undispatch_perm, host=host,
                        stages=stages, chunk_areas=table.areas, _stats=stats, _key=key)
