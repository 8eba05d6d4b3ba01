"""Group collectives on a plan's static transfer tables (DESIGN.md section 3).

``group_cast`` sends ranges of every rank's local buffer to the ranks that need them; ``group_reduce`` is
its transpose: partial results over the receive buffer are summed back into the owners' rows. Every size is
static, so the transport is XLA's ``all_to_all`` or ``collective_permute`` (``ppermute``) on padded buffers,
never ``ragged_all_to_all`` (100x slower on NVLinked H200s, PEERS.md). Packing the send buffer and unpacking
the returned partials are one FFI kernel each (``range_gather``; ``range_scatter_add``, from zero or in place
into an init, touching only the rows that were sent); received data is not unpacked at all: the kernels that
consume it index the transport's receive buffer directly (``CastTables.remap_keys`` rewrites slice key
ranges into it). With ``packed`` several arrays (K and V; dK and dV) share one buffer [S, n, ...], row by row:
one collective moves them all (XLA keeps one collective in flight by default, so separate ones serialise).

Layouts, for one stage on every rank (``S = CastTables.buffer_len``, the same for send and receive):

* ``all_to_all``: the buffer is ``[cp, pair_max]`` rows: block b of rank r's send buffer goes to rank b,
  block s of its receive buffer came from rank s. One collective.
* ``ppermute``: one block per shift d = 1..cp-1 that carries anything, of the largest size any rank sends
  to rank (r + d) % cp: block d of the send buffer goes to (r + d) % cp, block d of the receive buffer came
  from (r - d) % cp. One collective per non-empty shift; less padding when the traffic is sparse.

Example: cp = 2, rank 1 sends its local keys [0, 4) to rank 0 (the worked example of ``DistAttnPlan``).
With all_to_all, pair_max = 4 and S = 8: rank 1 packs keys 0..3 at rows 0..3 (block 0, for rank 0) by the
range (0, 4, 0); rank 0 receives them at rows 4..7 (block 1, from rank 1), and its stage slice's keys
[0, 4) of the plan's receive buffer become [4, 8).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax import _ffi
from magi_jax._ffi import match_varying
from magi_jax.planner.transfers import StageTransfers

TRANSPORTS = ("auto", "all_to_all", "ppermute")


# ---------------------------------------------------------------------------------------------------------
# Range ops: the FFI packing kernels, each the other's transpose.

def _range_call(target: str, xs: tuple, ranges, out_len: int, out_dtype, packed: bool) -> tuple:
    """One range op; `packed`: the gather's one output, or a scatter-add's one input, is [T, n, ...]."""
    if packed and target == _ffi.RANGE_GATHER:
        results = (jax.ShapeDtypeStruct((out_len, len(xs), *xs[0].shape[1:]), out_dtype or xs[0].dtype),)
    elif packed:
        y = xs[0]
        results = tuple(jax.ShapeDtypeStruct((out_len, *y.shape[2:]), out_dtype or y.dtype) for _ in range(y.shape[1]))
    else:
        results = tuple(jax.ShapeDtypeStruct((out_len, *x.shape[1:]), out_dtype or x.dtype) for x in xs)
    return _ffi.call(target, results, ranges, *xs, packed=packed)


def _check_range_args(name: str, xs, ranges, packed_in: bool = False) -> tuple:
    xs = tuple(xs)
    if packed_in and (len(xs) != 1 or xs[0].ndim < 2 or not 1 <= xs[0].shape[1] <= 4):
        raise ValueError(f"{name}: packed takes one array [T, n, ...] with 1 <= n <= 4, got "
                         f"{[x.shape for x in xs]}")
    if not 1 <= len(xs) <= 4:
        raise ValueError(f"{name}: takes 1 to 4 arrays, got {len(xs)}")
    for i, x in enumerate(xs):
        if x.ndim < 1 or x.shape[0] != xs[0].shape[0] or x.dtype != xs[0].dtype:
            raise ValueError(f"{name}: array {i} must share the leading length and dtype of array 0")
        if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise ValueError(f"{name}: array {i} has dtype {x.dtype}; use float32, bfloat16 or float16")
    if np.shape(ranges)[-1:] != (3,) or len(np.shape(ranges)) != 2:
        raise ValueError(f"{name}: ranges must be int32 [M, 3], got shape {np.shape(ranges)}")
    return xs


def range_gather(xs: Sequence[jax.Array], ranges, out_len: int, out_dtype=None, packed: bool = False
                 ) -> tuple[jax.Array, ...]:
    """``y[dst_start + t] = x[src_start + t]`` for each row ``(src_start, src_end, dst_start)`` of ranges
    (int32 [M, 3], numpy or traced), for up to 4 arrays x [T, ...] of one length and dtype at once; rows of
    y [out_len, ...] that no range covers are zero (several ranges on one row add). ``packed``: one y
    [out_len, n, ...] holding the n arrays side by side (y[:, j] is array j's), returned as a 1-tuple.
    Differentiable: the transpose is ``range_scatter_add``."""
    xs = _check_range_args("range_gather", xs, ranges)
    return _gather(xs, jnp.asarray(ranges, jnp.int32), int(out_len), out_dtype and jnp.dtype(out_dtype),
                   bool(packed))


def range_scatter_add(ys: Sequence[jax.Array], ranges, out_len: int | None = None, out_dtype=None,
                      init: Sequence[jax.Array] | None = None, packed: bool = False) -> tuple[jax.Array, ...]:
    """``x[src_start + t] += y[dst_start + t]`` from zero: the transpose of ``range_gather``. Sums are
    taken in float32 in table order (deterministic) and rounded once to ``out_dtype`` (default: y's).

    With ``init`` (arrays [out_len, ...], float32 or y's dtype) the sums start from it instead, in place:
    only rows some range covers are read and written (each ``init + sum``, rounded once). ``packed``: ys is
    one array [T, n, ...] holding n arrays side by side (what ``range_gather(..., packed=True)`` makes)."""
    ys = _check_range_args("range_scatter_add", ys, ranges, packed_in=packed)
    ranges = jnp.asarray(ranges, jnp.int32)
    packed = bool(packed)
    if init is None:
        return _scatter_add(ys, ranges, int(out_len), out_dtype and jnp.dtype(out_dtype), packed)
    init = tuple(init)
    trailing = [ys[0].shape[2:]] * ys[0].shape[1] if packed else [y.shape[1:] for y in ys]
    if len(init) != len(trailing) or any(i.shape[1:] != t or i.dtype != init[0].dtype or
                                         i.shape[0] != init[0].shape[0] for i, t in zip(init, trailing)):
        raise ValueError("range_scatter_add: init must hold one array per y, of y's trailing shape, one length "
                         "and one dtype")
    if init[0].dtype not in (ys[0].dtype, jnp.float32):
        raise ValueError(f"range_scatter_add: init dtype {init[0].dtype} must be float32 or y's {ys[0].dtype}")
    return _scatter_add_into(ys, init, ranges, packed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _gather(xs, ranges, out_len, out_dtype, packed):
    return _range_call(_ffi.RANGE_GATHER, xs, ranges, out_len, out_dtype, packed)


def _like(x):
    """A zero-size stand-in carrying x's leading length, dtype and varying axes into the backward."""
    return x[:, :0] if x.ndim > 1 else x[:, None][:, :0]


def _gather_fwd(xs, ranges, out_len, out_dtype, packed):
    return _gather(xs, ranges, out_len, out_dtype, packed), (ranges, _like(xs[0]))


def _transpose(target: str, res, cts, packed: bool) -> tuple:
    """The mirror range op on the cotangents, back at the primal's length and dtype (gather <-> scatter-add)."""
    ranges, like = res
    cts = tuple(c.astype(cts[0].dtype) for c in cts)
    grads = _range_call(target, cts, ranges, like.shape[0], None, packed)
    return match_varying((g.astype(like.dtype) for g in grads), like), None


def _gather_bwd(out_len, out_dtype, packed, res, cts):
    return _transpose(_ffi.RANGE_SCATTER_ADD, res, cts, packed)


_gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _scatter_add(ys, ranges, out_len, out_dtype, packed):
    return _range_call(_ffi.RANGE_SCATTER_ADD, ys, ranges, out_len, out_dtype, packed)


def _scatter_add_fwd(ys, ranges, out_len, out_dtype, packed):
    return _scatter_add(ys, ranges, out_len, out_dtype, packed), (ranges, _like(ys[0]))


def _scatter_add_bwd(out_len, out_dtype, packed, res, cts):
    return _transpose(_ffi.RANGE_GATHER, res, cts, packed)


_scatter_add.defvjp(_scatter_add_fwd, _scatter_add_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _scatter_add_into(ys, inits, ranges, packed):
    n = len(ys)
    results = tuple(jax.ShapeDtypeStruct(i.shape, i.dtype) for i in inits)
    call = jax.ffi.ffi_call(_ffi.RANGE_SCATTER_ADD_INTO, results,
                            input_output_aliases={1 + n + j: j for j in range(len(inits))})
    return match_varying(call(ranges, *ys, *inits, packed=packed), ranges, *ys, *inits)


def _scatter_add_into_fwd(ys, inits, ranges, packed):
    return _scatter_add_into(ys, inits, ranges, packed), (ranges, _like(ys[0]))


def _scatter_add_into_bwd(packed, res, cts):
    ranges, like = res
    grads = _range_call(_ffi.RANGE_GATHER, tuple(c.astype(cts[0].dtype) for c in cts), ranges, like.shape[0], None,
                        packed)
    return match_varying((g.astype(like.dtype) for g in grads), like), tuple(cts), None


_scatter_add_into.defvjp(_scatter_add_into_fwd, _scatter_add_into_bwd)


# ---------------------------------------------------------------------------------------------------------
# Static tables of one stage for one transport.

@dataclass(frozen=True, eq=False)
class CastTables:
    """What one stage's group_cast needs on every rank, for one transport (layouts in the module docstring).

    ``send_ranges`` int32 [cp, M, 3]: row r is rank r's packing table (local src_start, src_end, send-buffer
    position), padded with empty rows. ``recv_base`` int64 [cp (src), cp (dst)]: where the block src -> dst
    starts in dst's receive buffer (and, for ``ppermute``, in src's send buffer). ``shifts``: for
    ``ppermute``, (d, offset, length) of each non-empty shift block."""

    transport: str
    cp: int
    buffer_len: int
    send_ranges: np.ndarray
    recv_base: np.ndarray
    pair_max: int
    shifts: tuple[tuple[int, int, int], ...]
    transfers: StageTransfers

    @property
    def wire_tokens(self) -> int:
        """Tokens a rank puts on the wire per array (padding included, its own block excluded)."""
        if self.transport == "all_to_all":
            return (self.cp - 1) * self.pair_max
        return sum(n for _, _, n in self.shifts)

    def remap_keys(self, k_ranges: np.ndarray) -> np.ndarray:
        """int32 [cp, N, 2] key ranges over the plan's packed receive buffer (``Stage.slices``) -> the same
        keys in this transport's receive buffer. Every non-empty range lies inside one source's block."""
        t = self.transfers
        cp = self.cp
        pair = t.pair_tokens
        first = np.cumsum(pair, axis=0) - pair                 # [src, dst]: block start in the packed buffer
        out = np.array(k_ranges, np.int64)
        for r in range(cp):
            ks = out[r]
            live = ks[:, 1] > ks[:, 0]
            if not live.any():
                continue
            ends = first[:, r] + pair[:, r]
            src = np.searchsorted(ends, ks[live, 0], side="right")
            if (src >= cp).any() or (ks[live, 1] > ends[np.minimum(src, cp - 1)]).any():
                raise AssertionError("remap_keys: a key range crosses source blocks of the receive buffer")
            shift = self.recv_base[src, r] - first[src, r]
            ks[live] += shift[:, None]
        return out.astype(np.int32)


def cast_tables(transfers: StageTransfers, transport: str = "auto", pair_capacity: int | None = None,
                rows_capacity: int | None = None) -> CastTables:
    """The stage's tables for ``transport`` ("all_to_all", "ppermute", or "auto": all_to_all unless its
    padding puts over 1.5x the tokens of the ppermute blocks on the wire). With capacities (all_to_all
    only): blocks of ``pair_capacity`` keys and ``rows_capacity`` packing rows per rank, so that tables of
    other transfers fit the same shapes."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
    t = transfers
    cp = t.cp
    pair = t.pair_tokens
    if pair_capacity is not None or rows_capacity is not None:
        if transport == "ppermute":
            raise ValueError("transport: capacities need all_to_all (ppermute's blocks depend on the transfers)")
        transport = "all_to_all"
    if transport == "auto":
        shift_total = int(t.shift_tokens().sum())
        transport = "all_to_all" if (cp - 1) * t.pair_max <= 1.5 * shift_total else "ppermute"
    src, dst = np.arange(cp)[:, None], np.arange(cp)[None, :]
    if transport == "all_to_all":
        m = max(t.pair_max if pair_capacity is None else _at_least("pair_capacity", pair_capacity, t.pair_max), 1)
        recv_base = np.broadcast_to(src * m, (cp, cp)).astype(np.int64)    # block src on dst
        send_base = np.broadcast_to(dst * m, (cp, cp)).astype(np.int64)    # block dst on src
        shifts, length = (), cp * m
    else:
        lens = t.shift_tokens()
        shifts, off = [], 0
        for d in range(1, cp):
            if lens[d]:
                shifts.append((d, off, int(lens[d])))
                off += int(lens[d])
        base = np.zeros(cp, np.int64)
        for d, o, _ in shifts:
            base[d] = o
        recv_base = base[(dst - src) % cp]
        send_base = recv_base
        shifts, length = tuple(shifts), max(off, 1)
    first = np.cumsum(pair, axis=0) - pair
    s, d = t.src.astype(np.int64), t.dst.astype(np.int64)
    pos = send_base[s, d] + (t.dst_start - first[s, d])
    counts = np.bincount(s, minlength=cp)
    M = max(1, int(counts.max()) if len(counts) else 1)
    if rows_capacity is not None:
        M = _at_least("rows_capacity", rows_capacity, M)
    send_ranges = np.zeros((cp, M, 3), np.int32)
    order = np.argsort(s, kind="stable")
    slot = np.arange(len(s)) - np.repeat(np.cumsum(counts) - counts, counts)
    send_ranges[s[order], slot] = np.stack([t.src_start, t.src_end, pos], axis=1)[order]
    for a in (send_ranges, recv_base):
        a.setflags(write=False)
    pair_max = int(t.pair_max) if pair_capacity is None else int(pair_capacity)
    return CastTables(transport, cp, int(length), send_ranges, recv_base, pair_max, shifts, t)


def _at_least(name: str, capacity: int, need: int) -> int:
    if capacity < need:
        raise ValueError(f"{name}: {capacity} is less than the {need} these transfers need")
    return int(capacity)


# In a jitted function's arguments, tables are their arrays (traced), the rest static: tables of one shape and
# transport share a compilation. The host-side fields (recv_base, transfers) do not travel.
jax.tree_util.register_pytree_node(
    CastTables,
    lambda t: ((t.send_ranges,), (t.transport, t.cp, t.buffer_len, t.pair_max, t.shifts)),
    lambda aux, leaves: CastTables(aux[0], aux[1], aux[2], leaves[0], None, aux[3], aux[4], None))


# ---------------------------------------------------------------------------------------------------------
# The collectives. Called inside a shard_map (or any context binding ``axis``) on every rank.

def _transport(bufs: tuple, tables: CastTables, axis: str, reverse: bool) -> tuple:
    """Moves the send buffers (forward) or returns partials to their senders (reverse): one collective per
    buffer (and, for ppermute, per non-empty shift)."""
    cp = tables.cp
    if tables.transport == "all_to_all":
        m = bufs[0].shape[0] // cp
        # all_to_all on [cp, m, ...] blocks is its own inverse: the same call serves both directions.
        return tuple(jax.lax.all_to_all(b.reshape(cp, m, *b.shape[1:]), axis, 0, 0).reshape(b.shape)
                     for b in bufs)
    out = []
    for b in bufs:
        pieces = []
        for d, off, n in tables.shifts:
            step = -d if reverse else d
            perm = [(r, (r + step) % cp) for r in range(cp)]
            pieces.append(jax.lax.ppermute(b[off:off + n], axis, perm))
        pad = b.shape[0] - sum(n for _, _, n in tables.shifts)
        if pad:
            pieces.append(jnp.zeros((pad, *b.shape[1:]), b.dtype))
        out.append(jnp.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0])
    return tuple(out)


def own_row(table, axis: str) -> jax.Array:
    """This rank's row of a per-rank table [cp, ...]: row axis_index(axis), or row 0 of a table that holds
    one row (already this rank's: a table sharded over the axis, as calc_attn passes PlanTables)."""
    table = jnp.asarray(table)
    return table[0] if table.shape[0] == 1 else table[jax.lax.axis_index(axis)]


def group_cast(xs: Sequence[jax.Array], tables: CastTables, axis: str, packed: bool = False
               ) -> tuple[jax.Array, ...]:
    """Every rank sends the ranges of its local arrays xs [local_len, ...] that the stage's table lists, and
    receives its buffers [tables.buffer_len, ...] (layout in the module docstring; rows no transfer fills
    are zero). One range_gather for all arrays, then one transport per array; ``packed``: one buffer
    [buffer_len, n, ...] holding the arrays side by side (gathered so: no copy), one transport, returned
    as a 1-tuple. XLA keeps one collective in flight by default, so of separate ones all but one would run
    synchronously."""
    send = range_gather(xs, own_row(tables.send_ranges, axis), tables.buffer_len, packed=packed)
    return _transport(send, tables, axis, reverse=False)


def return_partials(ys: Sequence[jax.Array], tables: CastTables, axis: str, wire_dtype=None
                    ) -> tuple[jax.Array, ...]:
    """group_reduce's transport alone: partials over the receive buffer go back to the ranks that sent
    those rows, arriving in the layout of their send buffers (cast to ``wire_dtype`` first, if given)."""
    ys = tuple(y if wire_dtype is None else y.astype(wire_dtype) for y in ys)
    return _transport(ys, tables, axis, reverse=True)


def accumulate_partials(back: Sequence[jax.Array], tables: CastTables, axis: str, out_len: int | None = None,
                        out_dtype=jnp.float32, init: Sequence[jax.Array] | None = None, packed: bool = False
                        ) -> tuple[jax.Array, ...]:
    """group_reduce's unpacking alone: returned partials summed (float32) into the rows they came from,
    from zero into [out_len, ...] of ``out_dtype``, or in place into ``init``; ``packed``: back is one
    buffer [buffer_len, n, ...] of n arrays side by side, summed into n arrays."""
    return range_scatter_add(back, own_row(tables.send_ranges, axis), out_len, out_dtype, init=init, packed=packed)


def group_reduce(ys: Sequence[jax.Array], tables: CastTables, axis: str, out_len: int | None = None,
                 out_dtype=jnp.float32, wire_dtype=None, init: Sequence[jax.Array] | None = None,
                 packed: bool = False) -> tuple[jax.Array, ...]:
    """The transpose of group_cast: partials ys [tables.buffer_len, ...] over each rank's receive buffer
    go back to the ranks that sent those rows and are summed there into [out_len, ...] arrays of
    ``out_dtype`` (float32 by default; the sum is always taken in float32), or added in place to ``init``
    (only the rows that were sent are touched). ``wire_dtype`` casts before the transport (default: ys').
    ``packed``: ys is one buffer [buffer_len, n, ...] (group_cast's packed layout), one transport."""
    back = return_partials(ys, tables, axis, wire_dtype)
    return accumulate_partials(back, tables, axis, out_len, out_dtype, init, packed)


__all__ = ["range_gather", "range_scatter_add", "CastTables", "cast_tables", "own_row",
           "group_cast", "group_reduce", "return_partials", "accumulate_partials", "TRANSPORTS"]
