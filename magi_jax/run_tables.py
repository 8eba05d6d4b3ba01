"""Per-rank tables: what every rank's attention calls and collectives read, in the coordinates of the buffers
they read (DESIGN.md section 3), built from a plan on the host. As constants of the compiled step
(``run_tables``, for a plan closed over), or padded to a PlanCapacity as run-time data (``PlanTables``: a
pytree that a jitted step takes as an argument, so that the plans of many masks share one compilation)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from magi_jax.comm import CastTables, cast_tables
from magi_jax.planner.plan import DistAttnPlan, PlanCapacity
from magi_jax.planner.slices import pad_slices


@dataclass(frozen=True, eq=False)
class StageRun:
    """One stage as calc_attn runs it: the transport tables and the slices, keys indexing the transport's
    receive buffer (int32 [cp, N, 2], [cp, N, 2], [cp, N])."""

    tables: CastTables
    slices: tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True, eq=False)
class RunTables:
    """What every rank's body needs, per (plan, transport): host slices, stages, and the fused slices whose
    keys index ``concat(local kv, stage 0 receive buffer, stage 1 receive buffer, ...)`` (None without
    stages): the one call of a degree-0 forward, and of the fused backward."""

    host: tuple[np.ndarray, np.ndarray, np.ndarray]
    stages: tuple[StageRun, ...]
    fused: tuple[np.ndarray, np.ndarray, np.ndarray] | None


# Arrays as pytree leaves, the rest (stage count, buffer lengths, transports) as structure: in a jitted
# function's arguments, tables of one shape share a compilation (PlanTables).
jax.tree_util.register_pytree_node(StageRun, lambda r: ((r.tables, r.slices), None),
                                   lambda _, c: StageRun(*c))
jax.tree_util.register_pytree_node(RunTables, lambda r: ((r.host, r.stages, r.fused), None),
                                   lambda _, c: RunTables(*c))


@functools.lru_cache(maxsize=64)
def run_tables(p: DistAttnPlan, transport: str = "auto", capacity: PlanCapacity | None = None) -> RunTables:
    """The runtime tables of a plan (cached); with a ``capacity``, padded to its shapes (all_to_all; a
    ValueError names the field the plan exceeds)."""
    if capacity is not None:
        need = p.capacity()
        for f in dataclasses.fields(capacity):
            if getattr(capacity, f.name) < getattr(need, f.name):
                raise ValueError(f"capacity: {f.name} {getattr(capacity, f.name)} is less than the "
                                 f"{getattr(need, f.name)} this plan needs")
    host = (p.host.q_ranges, p.host.k_ranges, p.host.types)
    stages = []
    for st in p.stages:
        if capacity is None:
            tables = cast_tables(st.transfers, transport)
        else:
            tables = cast_tables(st.transfers, "all_to_all", capacity.stage_keys, capacity.transfer_rows)
        k = tables.remap_keys(st.slices.k_ranges)
        stages.append(StageRun(tables, (st.slices.q_ranges, k, st.slices.types)))
    if capacity is not None:
        host = _pad_to(host, capacity.slices)
        stages = [StageRun(st.tables, _pad_to(st.slices, capacity.slices)) for st in stages]
        stages += [_empty_stage(p.cp, capacity) for _ in range(capacity.stages - len(stages))]
    fused = None
    if stages:
        offsets = np.cumsum([p.local_len] + [st.tables.buffer_len for st in stages])
        fused = _concat_slices([host] + [st.slices for st in stages], [0, *offsets[:-1]])
        if capacity is not None:
            fused = _pad_to(fused, capacity.slices * (1 + capacity.stages))
        for a in fused:
            a.setflags(write=False)
    return RunTables(host, tuple(stages), fused)


def _concat_slices(sets, key_offsets):
    """Per-rank slice sets -> one, keys shifted by each set's offset, padded with empty slices."""
    live = [s[0][..., 1] > s[0][..., 0] for s in sets]
    rank = np.concatenate([np.nonzero(m)[0] for m in live])
    q = np.concatenate([s[0][m] for s, m in zip(sets, live)])
    k = np.concatenate([s[1][m] + off for s, m, off in zip(sets, live, key_offsets)])
    t = np.concatenate([s[2][m] for s, m in zip(sets, live)])
    return pad_slices(rank, q, k, t, sets[0][0].shape[0])


def _pad_to(slices, n: int):
    """Slices [cp, N, ...] padded with empty ones to [cp, n >= N, ...]."""
    return tuple(np.pad(a, [(0, 0), (0, n - a.shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in slices)


def _empty_stage(cp: int, capacity: PlanCapacity) -> StageRun:
    """A stage that moves and computes nothing, in the capacity's shapes (plans with fewer stages)."""
    tables = CastTables("all_to_all", cp, cp * capacity.stage_keys,
                        np.zeros((cp, capacity.transfer_rows, 3), np.int32), None, capacity.stage_keys, (), None)
    slices = (np.zeros((cp, capacity.slices, 2), np.int32), np.zeros((cp, capacity.slices, 2), np.int32),
              np.zeros((cp, capacity.slices), np.int32))
    return StageRun(tables, slices)


# Plans as run-time data: every plan that fits one PlanCapacity has tables of the same shapes, so a jitted
# step that takes them as an argument compiles once for all of them (packed batches of new documents).

@dataclass(frozen=True)
class PlanSpec:
    """The static part of PlanTables: what a compiled step depends on."""

    cp: int
    axis: str
    seqlen: int
    padded_seqlen: int
    local_len: int
    overlap_degree: int      # 0: fetch all, one fused call; else capacity.stages
    capacity: PlanCapacity
    mesh: Mesh | None
    batch: int | None = None  # None: one plan; B: B plans stacked (leaves [B, ...]), one per batch element


@dataclass(frozen=True, eq=False)
class PlanTables:
    """A plan's tables padded to a PlanCapacity: a pytree whose leaves are int32 arrays (the slices, the
    transfer tables, the permutation) and whose structure is ``spec``. Pass it to a jitted step as an
    argument: plans of other masks that fit the same capacity reuse the compilation. Use it wherever a plan
    goes (calc_attn, calc_attn_local, dispatch, undispatch, position_ids). Batched (``spec.batch``): one
    plan per element of a leading batch dim, each leaf [B, ...]; the arrays it serves are [B, T, ...]."""

    spec: PlanSpec
    run: RunTables
    dispatch_index: Any      # int32 [padded_seqlen]: position_ids()
    undispatch_index: Any    # int32 [seqlen]

    cp = property(lambda self: self.spec.cp)
    axis = property(lambda self: self.spec.axis)
    seqlen = property(lambda self: self.spec.seqlen)
    padded_seqlen = property(lambda self: self.spec.padded_seqlen)
    local_len = property(lambda self: self.spec.local_len)
    overlap_degree = property(lambda self: self.spec.overlap_degree)
    undispatch_perm = property(lambda self: self.undispatch_index)

    def position_ids(self):
        return self.dispatch_index

    def __repr__(self) -> str:
        return f"PlanTables({self.spec})"


jax.tree_util.register_pytree_node(
    PlanTables, lambda t: ((t.run, t.dispatch_index, t.undispatch_index), t.spec),
    lambda spec, c: PlanTables(spec, *c))


def padded_tables(p: DistAttnPlan, mesh: Mesh | None, capacity: PlanCapacity) -> PlanTables:
    """p's tables padded to ``capacity`` (ValueError naming the field it exceeds)."""
    tables = run_tables(p, "all_to_all", capacity)
    degree = 0 if p.overlap_degree == 0 else capacity.stages
    spec = PlanSpec(p.cp, p.axis, p.seqlen, p.padded_seqlen, p.local_len, degree, capacity, mesh)
    return PlanTables(spec, tables, p.position_ids(), p.undispatch_perm)


def stacked_tables(each: list[PlanTables]) -> PlanTables:
    """Tables of one spec stacked along a new first dim: batched tables, one plan per batch element."""
    if any(t.spec != each[0].spec for t in each):
        raise ValueError("plan: the plans differ in sequence length, mesh, axis or overlap degree: "
                         f"{sorted({repr(t.spec) for t in each})}")
    stacked = jax.tree.map(lambda *a: np.stack(a), *each)
    return PlanTables(dataclasses.replace(each[0].spec, batch=len(each)), stacked.run, stacked.dispatch_index,
                      stacked.undispatch_index)


__all__ = ["StageRun", "RunTables", "run_tables", "PlanSpec", "PlanTables", "padded_tables", "stacked_tables"]
