"""Plans as run-time data (PlanTables): masks of one sequence length padded to one PlanCapacity share a
compiled step, and each gives its own mask's attention (against the float64 reference), on CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import magi_jax as mj
from magi_jax import masks
from tests.test_dist_helpers import check_batched_plan_tables, check_plan_tables, mesh_of, random_mask

TOTAL = 380


def _masks():
    """Masks of TOTAL tokens: packed documents of other lengths, other families, arbitrary slices."""
    return [masks.varlen_causal([61, 7, 90, 1, 18, 127, 4, 72]),
            masks.varlen_causal([200, 3, 177]),
            masks.sliding_window([150, 230], 40),
            masks.block_causal([100, 280], 32),
            random_mask(5, total=TOTAL)]


def _plans(mesh, overlap, hq=2, hkv=2, d=64):
    return [mj.plan(m, mesh, chunk_size=16, overlap=overlap, num_heads_q=hq, num_heads_kv=hkv, head_dim=d)
            for m in _masks()]


@pytest.mark.parametrize("cp, overlap, backward", [(2, 1, "staged"), (4, 2, "staged"), (4, 2, "fused"),
                                                    (8, 0, "staged")])
def test_masks_share_one_compilation_and_each_is_right(cp, overlap, backward):
    tables = check_plan_tables(_masks(), mesh_of(cp), overlap=overlap, seed=cp, backward=backward)
    assert len({jax.tree.structure(t) for t in tables}) == 1
    assert len({tuple(x.shape for x in jax.tree.leaves(t)) for t in tables}) == 1


def test_training_step_compiles_once_for_new_documents_every_step():
    """A jitted step (loss, gradients, update) taking the tables as an argument: a new packing of documents
    every step, one compilation; position_ids from the tables."""
    mesh = mesh_of(4)
    H, D = 2, 64
    rng = np.random.default_rng(0)
    lengths = [list(rng.multinomial(TOTAL - 10 * n, np.ones(n) / n) + 10) for n in (3, 5, 8, 4)]
    plans = [mj.plan(masks.varlen_causal(ls), mesh, chunk_size=16, overlap=1, num_heads_q=H, head_dim=D)
             for ls in lengths]
    capacity = mj.PlanCapacity.of(plans, headroom=1.5)
    w = jax.device_put(jnp.asarray(rng.standard_normal((3, H, D, D)) / 8, jnp.float32), NamedSharding(mesh, P()))
    x = jnp.asarray(rng.standard_normal((TOTAL, H, D)), jnp.float32)

    @jax.jit
    def step(w, x, t):
        def loss(w):
            xd = mj.dispatch(x, t)
            pos = mj.position_ids(t).astype(jnp.float32)[:, None, None]
            q, k, v = (jnp.einsum("thd,hde->the", xd, w[i]) for i in range(3))
            out, _ = mj.calc_attn(q + 1e-3 * pos, k, v, t)
            return jnp.mean(out ** 2)
        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value, g

    for mp in plans:
        t = mj.plan_tables(mp, capacity)
        _, value, g = step(w, x, t)

        def want_loss(w):      # the same loss on one device with the plan's own mask
            pos = jnp.asarray(mp.position_ids(), jnp.float32)
            pos = jnp.take(pos, jnp.asarray(mp.undispatch_perm))[:, None, None]
            q, k, v = (jnp.einsum("thd,hde->the", x, w[i]) for i in range(3))
            out, _ = mj.flex_flash_attn(q + 1e-3 * pos, k, v, mask=mp.mask)
            return jnp.sum(out ** 2) / (mp.padded_seqlen * H * D)
        want, want_g = jax.value_and_grad(want_loss)(w)
        np.testing.assert_allclose(value, want, rtol=1e-4)
        np.testing.assert_allclose(g, want_g, rtol=1e-3, atol=1e-6)
    assert step._cache_size() == 1


def test_dispatch_then_undispatch_is_identity_with_tables():
    mesh = mesh_of(4)
    plans = _plans(mesh, 2)
    capacity = mj.PlanCapacity.of(plans)
    fn = jax.jit(lambda x, t: mj.undispatch(mj.dispatch(x, t), t))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((TOTAL, 3)), jnp.float32)
    for mp in plans:
        t = mj.plan_tables(mp, capacity)
        np.testing.assert_array_equal(fn(x, t), x)
        np.testing.assert_array_equal(mj.dispatch(x, t), mj.dispatch(x, mp))
        np.testing.assert_array_equal(mj.position_ids(t), mj.position_ids(mp))
    assert fn._cache_size() == 1


def test_capacity_of_covers_and_errors_name_the_field():
    mesh = mesh_of(4)
    plans = _plans(mesh, 2)
    exact = mj.PlanCapacity.of(plans)
    for mp in plans:
        mj.plan_tables(mp, exact)          # every plan fits the capacity made of them
    big = max(plans, key=lambda mp: mj.PlanCapacity.of([mp]).stage_keys)
    need = mj.PlanCapacity.of([big])
    for field in ("stage_keys", "transfer_rows", "slices", "stages"):
        value = getattr(need, field) - 1
        if value < 1:
            continue
        small = mj.PlanCapacity(**{**need.__dict__, field: value})
        with pytest.raises(ValueError, match=field):
            mj.plan_tables(big, small)
    with pytest.raises(ValueError, match="slices"):
        mj.PlanCapacity(stages=1, stage_keys=8, transfer_rows=2, slices=0)
    with pytest.raises(ValueError, match="headroom"):
        mj.PlanCapacity.of(plans, headroom=0.5)
    with pytest.raises(TypeError, match="capacity"):
        mj.plan_tables(plans[0], {"stages": 1})
    with pytest.raises(ValueError, match="transport"):
        t = mj.plan_tables(plans[0], exact)
        mj.calc_attn(*(jnp.zeros((t.padded_seqlen, 2, 64)),) * 3, t, transport="ppermute")


@pytest.mark.parametrize("table_spec", [P(), P("cp")])
def test_calc_attn_local_takes_tables_through_a_user_shard_map(table_spec):
    """PlanTables passed into a user's own shard_map, replicated or each rank its own rows: calc_attn_local
    there equals calc_attn on the static plan, forward and gradients."""
    mesh = mesh_of(4)
    plans = _plans(mesh, 1)
    capacity = mj.PlanCapacity.of(plans, headroom=1.25)
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal((plans[0].padded_seqlen, 2, 64)), jnp.float32) for _ in range(3))

    @jax.jit
    def user(q, k, v, t):
        def body(q, k, v, t):
            out, lse = mj.calc_attn_local(q, k, v, t)
            return out * jnp.exp(jnp.where(jnp.isfinite(lse), lse, 0.0))[..., None] * 1e-3
        run_spec = jax.tree.map(lambda _: table_spec, t.run)
        return jax.shard_map(lambda q, k, v, run: body(q, k, v, mj.PlanTables(t.spec, run, None, None)), mesh=mesh,
                             in_specs=(P("cp"),) * 3 + (run_spec,), out_specs=P("cp"))(q, k, v, t.run)

    for mp in plans[:3]:
        t = mj.plan_tables(mp, capacity)
        ours = jax.jit(lambda q, k, v: (lambda o, l: o * jnp.exp(jnp.where(jnp.isfinite(l), l, 0.0))[..., None]
                                        * 1e-3)(*mj.calc_attn(q, k, v, mp)))
        np.testing.assert_allclose(user(q, k, v, t), ours(q, k, v), rtol=1e-5, atol=1e-6)
        g_user = jax.grad(lambda *a: user(*a, t).sum(), argnums=(0, 1, 2))(q, k, v)
        g_ours = jax.grad(lambda *a: ours(*a).sum(), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(g_user, g_ours):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert user._cache_size() == 1


def test_plan_capacity_is_the_shapes_of_the_plans_own_tables():
    """DistAttnPlan.capacity() (numpy, the planner's layer) against the tables calc_attn builds: packing rows,
    all_to_all block, slices per call; and PlanCapacity.of is their maximum."""
    for mp in _plans(mesh_of(8), 3):
        cap = mp.capacity()
        tables = mj.dist_attn.run_tables(mp.plan, "all_to_all")
        assert cap.stages == max(1, len(tables.stages))
        assert cap.transfer_rows == max([1] + [st.tables.send_ranges.shape[1] for st in tables.stages])
        assert cap.stage_keys == max([1] + [st.tables.buffer_len // mp.cp for st in tables.stages])
        assert cap.slices == max(x[0].shape[1] for x in [tables.host] + [st.slices for st in tables.stages])
    caps = [mp.capacity() for mp in _plans(mesh_of(8), 3)]
    both = mj.PlanCapacity.of(caps)
    for name in ("stages", "stage_keys", "transfer_rows", "slices"):
        assert getattr(both, name) == max(getattr(c, name) for c in caps)


@pytest.mark.parametrize("batch, d", [(2, 64), (4, 64), (2, 96)])
def test_batched_tables_give_each_batch_element_its_own_mask(batch, d):
    """dp 2 x cp 2; batch 2: one element per dp group, 4: two; head dim 96 runs padded to 128."""
    check_batched_plan_tables(_masks(), mesh_of(2, dp=2), batch, seed=batch, d=d)


def test_batched_tables_refuse_mismatched_inputs():
    mesh = mesh_of(2, dp=2)
    plans = _plans(mesh, 1)
    t = mj.plan_tables(plans[:2], mj.PlanCapacity.of(plans))
    x = jnp.zeros((3, TOTAL, 2, 64))
    with pytest.raises(ValueError, match="x: batched plan tables of 2"):
        mj.dispatch(x, t, seq_dim=1)
    with pytest.raises(ValueError, match="seq_dim=0"):
        mj.dispatch(x[0], t)
    with pytest.raises(ValueError, match="q: batched plan tables of 2"):
        mj.calc_attn(*(jnp.zeros((3, t.padded_seqlen, 2, 64)),) * 3, t)
    other = mj.plan(masks.varlen_causal([100, 200]), mesh, chunk_size=16, overlap=2)
    with pytest.raises(ValueError, match="plan: the plans differ"):
        mj.plan_tables([plans[0], other], mj.PlanCapacity.of([plans[0], other]))
    with pytest.raises(ValueError, match="plan: an empty list"):
        mj.plan_tables([], mj.PlanCapacity.of(plans))


@pytest.mark.parametrize("batched", [False, True])
def test_tables_on_an_explicit_mesh_from_make_mesh(batched):
    """jax.make_mesh's Explicit axes: run-time tables (batched: one plan per sequence of 2, over dp) as an
    argument, dispatch and calc_attn, gradients against flex_flash_attn on one device per sequence, two
    batches of masks through one compilation."""
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), devices=jax.devices("cpu")[:8])
    plans = _plans(mesh, 2)
    capacity = mj.PlanCapacity.of(plans)
    groups = [[plans[0], plans[1]], [plans[2], plans[4]]] if batched else [[plans[0]], [plans[3]]]
    rng = np.random.default_rng(6)
    shape = (2, TOTAL, 2, 64) if batched else (TOTAL, 2, 64)
    q, k, v, w = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(4))
    seq_dim = 1 if batched else 0

    @jax.jit
    def got(q, k, v, t):
        def loss(q, k, v):
            qd, kd, vd = (mj.dispatch(x, t, seq_dim=seq_dim) for x in (q, k, v))
            return (mj.undispatch(mj.calc_attn(qd, kd, vd, t)[0], t, seq_dim=seq_dim) * w).sum()
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    for group in groups:
        value, grads = got(q, k, v, mj.plan_tables(group if batched else group[0], capacity))

        def loss(q, k, v):
            if not batched:
                return (mj.flex_flash_attn(q, k, v, mask=group[0].mask)[0] * w).sum()
            return sum((mj.flex_flash_attn(q[b], k[b], v[b], mask=mp.mask)[0] * w[b]).sum()
                       for b, mp in enumerate(group))
        want, want_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
        np.testing.assert_allclose(value, want, rtol=1e-5)
        for a, b in zip(grads, want_grads):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert got._cache_size() == 1


def test_batched_tables_dispatch_and_undispatch_eagerly():
    """Batched tables on jax.make_mesh's Explicit (dp, cp) axes, outside jit and jax.set_mesh: the round trip
    (undispatch placed its index with a reshard, which needs a mesh context there)."""
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), devices=jax.devices("cpu")[:8])
    plans = [mj.plan(masks.varlen_causal(lens), mesh, num_heads_q=2, head_dim=64, chunk_size=16)
             for lens in ([100, 156], [50, 206])]
    tables = mj.plan_tables(plans, mj.PlanCapacity.of(plans))
    x = np.random.default_rng(13).standard_normal((2, 256, 3)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(mj.undispatch(mj.dispatch(x, tables, seq_dim=1), tables, seq_dim=1)), x)
