"""magi_jax.comm on CPU devices: the range-op kernels against numpy, their transposes, and group_cast /
group_reduce on real plans (both transports) against the planner's receive-buffer contents."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from magi_jax import comm, masks
from magi_jax.planner import make_plan
from tests.test_dist_helpers import DOCS, assert_packed_range_ops_equal_separate, mesh_of, random_mask


def _numpy_gather(x, ranges, out_len):
    y = np.zeros((out_len, *x.shape[1:]), np.float64)
    for s, e, d in ranges:
        for t in range(e - s):
            if 0 <= s + t < len(x) and 0 <= d + t < out_len:
                y[d + t] += x[s + t]
    return y


RANGES = np.array([[0, 5, 7], [9, 12, 0], [3, 6, 13], [0, 0, 0], [10, 14, 17], [2, 4, 1]], np.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_range_gather_and_scatter_add_match_numpy(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((15, 3, 4)), dtype)
    w = jnp.asarray(rng.standard_normal((15, 6)), dtype)
    y, z = comm.range_gather([x, w], RANGES, 19)                # [10, 14) -> [17, 21) is clipped at 19
    for got, src in ((y, x), (z, w)):
        assert got.dtype == dtype and got.shape == (19, *src.shape[1:])
        np.testing.assert_allclose(np.asarray(got, np.float64),
                                   _numpy_gather(np.asarray(src, np.float64), RANGES, 19), rtol=1e-2)
    g = jnp.asarray(rng.standard_normal((19, 3, 4)), dtype)
    (back,) = comm.range_scatter_add([g], RANGES, 15, out_dtype=jnp.float32)
    assert back.dtype == jnp.float32
    # The transpose reads the gather's destinations: ranges (dst, dst + len, src).
    length = RANGES[:, 1] - RANGES[:, 0]
    swapped = np.stack([RANGES[:, 2], RANGES[:, 2] + length, RANGES[:, 0]], axis=1)
    want = _numpy_gather(np.asarray(g, np.float64), swapped, 15)
    np.testing.assert_allclose(np.asarray(back), want, rtol=1e-6, atol=1e-6)


def test_range_ops_are_transposes_and_jit_with_traced_tables():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((15, 2, 8)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((19, 2, 8)), jnp.float32)
    gather = jax.jit(lambda x, r: comm.range_gather([x], r, 19)[0])
    y, vjp = jax.vjp(lambda x: gather(x, RANGES), x)
    (gx,) = vjp(g)
    np.testing.assert_allclose(float(jnp.vdot(y, g)), float(jnp.vdot(x, gx)), rtol=1e-5)
    np.testing.assert_allclose(gx, comm.range_scatter_add([g], RANGES, 15)[0], rtol=1e-6)
    z, vjp_s = jax.vjp(lambda g: comm.range_scatter_add([g], RANGES, 15)[0], g)
    np.testing.assert_allclose(vjp_s(x)[0], gather(x, RANGES), rtol=1e-6)
    # Another table of the same shape reuses the compiled call.
    gather(x, RANGES[::-1].copy())
    assert gather._cache_size() == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scatter_add_into_init_touches_only_covered_rows(dtype):
    rng = np.random.default_rng(2)
    y = jnp.asarray(rng.standard_normal((19, 3, 4)), dtype)
    w = jnp.asarray(rng.standard_normal((19, 5)), dtype)
    init = (jnp.asarray(rng.standard_normal((15, 3, 4)), dtype), jnp.asarray(rng.standard_normal((15, 5)), dtype))
    into = jax.jit(lambda y, w, a, b: comm.range_scatter_add([y, w], RANGES, init=[a, b]))
    got = into(y, w, *init)
    fresh = comm.range_scatter_add([y, w], RANGES, 15, out_dtype=jnp.float32)
    covered = np.zeros(15, bool)
    for s_, e, _ in RANGES:
        covered[s_:min(e, 15)] = True
    for g, f, i in zip(got, fresh, init):
        assert g.dtype == dtype
        want = (np.asarray(i, np.float32) + np.asarray(f)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32)[covered], want[covered], rtol=1e-2, atol=1e-2)
        # Rows no range covers are the init's bits.
        np.testing.assert_array_equal(np.asarray(g)[~covered], np.asarray(i)[~covered])
    # Gradients: identity for init, range_gather for y.
    cts = tuple(jnp.asarray(rng.standard_normal(i.shape), dtype) for i in init)
    _, vjp = jax.vjp(into, y, w, *init)
    gy, gw, ga, gb = vjp(cts)
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(cts[0]))
    np.testing.assert_array_equal(np.asarray(gb), np.asarray(cts[1]))
    np.testing.assert_array_equal(np.asarray(gy), np.asarray(comm.range_gather([cts[0]], RANGES, 19)[0]))
    with pytest.raises(ValueError, match="init"):
        comm.range_scatter_add([y], RANGES, init=[init[1]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_range_ops_equal_separate_ones(dtype):
    # packed=True: the gather writes its arrays side by side in one [L, n, ...] buffer (K and V of a key in
    # one row of a group collective's buffer), the scatter-adds read one; same values as separate arrays,
    # and each is the other's transpose.
    rng = np.random.default_rng(5)
    k, v = (jnp.asarray(rng.standard_normal((15, 3, 4)), dtype) for _ in range(2))
    (kv,) = comm.range_gather([k, v], RANGES, 19, packed=True)
    assert kv.shape == (19, 2, 3, 4) and kv.dtype == dtype
    g = jnp.asarray(rng.standard_normal((19, 2, 3, 4)), dtype)
    init = tuple(jnp.asarray(rng.standard_normal((15, 3, 4)), dtype) for _ in range(2))
    assert_packed_range_ops_equal_separate(k, v, g, init, RANGES)
    # Transposes: <gather(x), c> = <x, gather^T(c)> through autodiff, both ways.
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    kv32, vjp = jax.vjp(lambda a, b: comm.range_gather([a, b], RANGES, 19, packed=True)[0], f32(k), f32(v))
    gk, gv = vjp(f32(g))
    np.testing.assert_allclose(float(jnp.vdot(kv32, f32(g))), float(jnp.vdot(f32(k), gk) + jnp.vdot(f32(v), gv)),
                               rtol=1e-5)
    _, vjp_s = jax.vjp(lambda y: comm.range_scatter_add([y], RANGES, 15, packed=True), f32(g))
    (gy,) = vjp_s((f32(k), f32(v)))
    np.testing.assert_array_equal(np.asarray(gy), np.asarray(kv32))
    with pytest.raises(ValueError, match="packed"):
        comm.range_scatter_add([g, g], RANGES, 15, packed=True)       # packed is one array


def test_empty_table_gives_zeros():
    x = jnp.ones((4, 3), jnp.float32) * 2.5
    (y,) = comm.range_gather([x], np.zeros((1, 3), np.int32), 6)
    np.testing.assert_array_equal(np.asarray(y), 0.0)


def test_bad_range_arguments():
    x = jnp.ones((4, 3), jnp.float32)
    with pytest.raises(ValueError, match="ranges must be int32"):
        comm.range_gather([x], np.zeros((2, 2), np.int32), 4)
    with pytest.raises(ValueError, match="leading length"):
        comm.range_gather([x, jnp.ones((5, 3))], np.zeros((1, 3), np.int32), 4)
    with pytest.raises(ValueError, match="dtype int32"):
        comm.range_gather([jnp.ones((4,), jnp.int32)], np.zeros((1, 3), np.int32), 4)
    transfers = make_plan(masks.causal(64), 2, chunk_size=8).stages[0].transfers
    with pytest.raises(ValueError, match="transport"):
        comm.cast_tables(transfers, "ragged")
    # Capacities: at least what the transfers need, and only for all_to_all.
    exact = comm.cast_tables(transfers, "all_to_all")
    rows = exact.send_ranges.shape[1]
    padded = comm.cast_tables(transfers, pair_capacity=transfers.pair_max + 5, rows_capacity=rows + 2)
    assert padded.buffer_len == 2 * (transfers.pair_max + 5) and padded.send_ranges.shape[1] == rows + 2
    with pytest.raises(ValueError, match="pair_capacity"):
        comm.cast_tables(transfers, pair_capacity=transfers.pair_max - 1)
    with pytest.raises(ValueError, match="rows_capacity"):
        comm.cast_tables(transfers, rows_capacity=rows - 1)
    with pytest.raises(ValueError, match="transport: capacities need all_to_all"):
        comm.cast_tables(transfers, "ppermute", pair_capacity=transfers.pair_max)


def _recv_positions(tables: comm.CastTables, r: int, n: int) -> np.ndarray:
    """Transport-buffer position of each of the first n positions of the plan's packed receive buffer."""
    one = np.zeros((tables.cp, n, 2), np.int32)
    one[r, :, 0] = np.arange(n)
    one[r, :, 1] = np.arange(n) + 1
    return tables.remap_keys(one)[r, :, 0]


@pytest.mark.parametrize("transport", ["all_to_all", "ppermute"])
@pytest.mark.parametrize("cp, mask_seed", [(4, None), (8, 3)])
def test_group_cast_delivers_the_planned_keys_and_reduce_is_its_transpose(transport, cp, mask_seed):
    mask = masks.varlen_causal(DOCS) if mask_seed is None else random_mask(mask_seed)
    plan = make_plan(mask, cp, chunk_size=16, overlap=3)
    mesh = mesh_of(cp)
    L = plan.local_len
    # Local buffers hold their global token id (padding: -1) in two arrays of different widths.
    ids = jnp.asarray(plan.dispatch_perm.astype(np.float32))
    a = jnp.repeat(ids[:, None], 3, axis=1)
    b = jnp.repeat(ids[:, None, None], 4, axis=1).repeat(2, axis=2)
    for i, stage in enumerate(plan.stages):
        tables = comm.cast_tables(stage.transfers, transport)
        assert tables.transport == transport

        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("cp"), P("cp")), out_specs=P("cp"))
        def cast(a, b):
            ra, rb = comm.group_cast((a, b), tables, "cp")
            return jnp.concatenate([ra, rb.reshape(rb.shape[0], -1)], axis=1)

        got = np.asarray(cast(a, b)).reshape(cp, tables.buffer_len, -1)
        want = plan.recv_global_keys(i)
        for r in range(cp):
            n = int(stage.transfers.recv_tokens[r])
            pos = _recv_positions(tables, r, n)
            np.testing.assert_array_equal(got[r, pos], np.repeat(want[r, :n, None], got.shape[2], axis=1))

        # group_reduce = transpose of group_cast: <cast(x), y> == <x, reduce(y)>, sums in float32.
        rng = np.random.default_rng(i)
        x = jnp.asarray(rng.standard_normal((plan.padded_seqlen, 3)), jnp.float32)
        y = jnp.asarray(rng.standard_normal((cp * tables.buffer_len, 3)), jnp.float32)
        sm = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"))
        fwd = jax.jit(sm(lambda x: comm.group_cast((x,), tables, "cp")[0]))
        red = jax.jit(sm(lambda y: comm.group_reduce((y.astype(jnp.bfloat16),), tables, "cp", L,
                                                     wire_dtype=jnp.float32)[0]))
        cx, ry = fwd(x), red(y)
        assert ry.dtype == jnp.float32 and ry.shape == x.shape
        yb = y.astype(jnp.bfloat16).astype(jnp.float32)
        # Padding rows of the transport buffer receive nothing, so only delivered rows count.
        live = np.zeros((cp, tables.buffer_len), bool)
        for r in range(cp):
            live[r, _recv_positions(tables, r, int(stage.transfers.recv_tokens[r]))] = True
        yb = jnp.where(jnp.asarray(live.reshape(-1, 1)), yb, 0.0)
        # float32 sums in two orders: the tolerance scales with the sum of |terms| (the dot itself may
        # cancel to near 0); one misplaced row would move it by O(1), far above it.
        l1 = float(jnp.vdot(jnp.abs(cx), jnp.abs(yb)))
        np.testing.assert_allclose(float(jnp.vdot(cx, yb)), float(jnp.vdot(x, red(yb))), rtol=1e-5, atol=1e-6 * l1)
        # Autodiff of group_cast gives the same map as group_reduce.
        _, vjp = jax.vjp(fwd, x)
        np.testing.assert_allclose(vjp(yb)[0], red(yb), rtol=1e-5, atol=1e-5)


def test_auto_transport_prefers_all_to_all_unless_padding_dominates():
    plan = make_plan(masks.varlen_causal(DOCS), 2, chunk_size=16, overlap=1)
    assert comm.cast_tables(plan.stages[0].transfers).transport == "all_to_all"
    for st in make_plan(masks.sliding_window(DOCS * 4, 8), 8, chunk_size=16, overlap=2).stages:
        t = comm.cast_tables(st.transfers)
        other = comm.cast_tables(st.transfers, "ppermute" if t.transport == "all_to_all" else "all_to_all")
        assert t.wire_tokens <= 1.5 * other.wire_tokens or t.transport == "all_to_all"
