"""Distributed attention on CPU devices (8 host devices, conftest.py): dispatch -> calc_attn -> undispatch
against the float64 reference on the global mask, for cp 1, 2, 4, 8, every mask family, seeded random
masks, overlap degrees 0..4, both transports, GQA; the permutation; a 2-D (dp, cp) mesh; calc_attn_local in a
user's shard_map; a jitted training step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import magi_jax as mj
from magi_jax import masks
from magi_jax.planner import make_plan
from magi_jax.reference import attention_f64
from tests.conftest import assert_within_rule, attention_scales, check_against_reference, ffi_eqns, random_qkv
from tests.test_dist_helpers import (DOCS, check_dist, collective_dependencies, count_ops, dp2_cp4_batch, families,
                                     global_fn, mesh_of, random_mask, remat_grads)

# Every family once, the (cp, overlap) pairs rotating so that each cp and each degree 0..4 recurs.
FAMILY_CASES = [
    ("full", 2, 1), ("causal", 4, 2), ("varlen_full", 8, 3), ("varlen_causal", 4, 4),
    ("sliding_window", 2, 0), ("sliding_window_bi", 8, 1), ("block_causal", 4, 0),
    ("shared_question", 8, 2), ("prefix_lm", 2, 3), ("global_sliding_window", 4, 1),
    ("causal_blockwise", 8, 4), ("varlen_causal", 1, "auto"), ("causal", 8, 0),
]


@pytest.mark.parametrize("name, cp, overlap", FAMILY_CASES)
def test_mask_families(name, cp, overlap):
    mp = check_dist(families()[name], mesh_of(cp), overlap=overlap, seed=cp)
    if cp > 1 and overlap not in (0, "auto"):
        assert 1 <= mp.num_stages <= overlap


@pytest.mark.parametrize("seed, cp, overlap", [(0, 2, 2), (1, 4, 3), (2, 8, 0), (3, 4, "auto"), (4, 8, 4)])
@pytest.mark.parametrize("backward", ["fused", "staged"])
def test_random_masks(seed, cp, overlap, backward):
    check_dist(random_mask(seed), mesh_of(cp), overlap=overlap, seed=seed, backward=backward)


@pytest.mark.parametrize("transport", ["all_to_all", "ppermute"])
def test_transports(transport):
    mask = masks.varlen_causal(DOCS)
    mp = check_dist(mask, mesh_of(8), overlap=3, transport=transport)
    tables = mj.dist_attn.run_tables(mp.plan, transport)
    assert all(st.tables.transport == transport for st in tables.stages)


@pytest.mark.parametrize("backward", ["fused", "staged"])
def test_one_collective_per_stage_each_way(backward):
    """K and V fetched packed in one collective per stage, the dK/dV partials returned packed in one (XLA
    merges the backward's re-fetch with the forward's): two collectives per stage in a training step."""
    mask = masks.varlen_causal(DOCS)
    mp = check_dist(mask, mesh_of(4), overlap=2, transport="all_to_all", backward=backward)
    stages = len(mj.dist_attn.run_tables(mp.plan, "all_to_all").stages)
    q = jnp.zeros((mp.padded_seqlen, 2, 64), jnp.float32)

    def step(q, k, v):
        f = lambda q, k, v: mj.calc_attn(q, k, v, mp, transport="all_to_all", backward=backward)
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return out, vjp((out, lse))
    assert count_ops(jax.jit(step).lower(q, q, q).compile().as_text())["collectives"] == 2 * stages


def test_forward_fetches_k_and_v_in_one_collective_per_stage():
    # group_cast gathers K and V side by side into one buffer, which the stage calls read as is.
    mask = masks.varlen_causal(DOCS)
    mp = check_dist(mask, mesh_of(4), overlap=2, transport="all_to_all")
    stages = len(mj.dist_attn.run_tables(mp.plan, "all_to_all").stages)
    q = jnp.zeros((mp.padded_seqlen, 2, 64), jnp.float32)
    fwd = jax.jit(lambda q, k, v: mj.calc_attn(q, k, v, mp, transport="all_to_all"))
    assert stages == 2 and count_ops(fwd.lower(q, q, q).compile().as_text())["collectives"] == stages


@pytest.mark.parametrize("hq, hkv, cp, overlap", [(4, 2, 4, 2), (4, 1, 2, 0)])
def test_gqa_and_mqa(hq, hkv, cp, overlap):
    check_dist(masks.sliding_window(DOCS, 40), mesh_of(cp), overlap=overlap, hq=hq, hkv=hkv)


@pytest.mark.parametrize("d, dv, cp", [(96, 96, 2), (80, 48, 4)])
def test_head_dims_other_than_the_kernels(d, dv, cp):
    # Padded to the kernels' head dim (80 / 48 to 96) before the collectives, the padding dropped from out;
    # q, k and v head dims apart.
    mask = masks.varlen_causal(DOCS)
    mp = mj.plan(mask, mesh_of(cp), chunk_size=16, overlap=2, num_heads_q=2, head_dim=d)
    rng = np.random.default_rng(d + dv)
    q, k, _ = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 2, 2, d)
    v = jnp.asarray(rng.standard_normal((mask.total_seqlen_k, 2, dv)).astype(np.float32))
    check_against_reference(global_fn(mp), mask, q, k, v, rng)


@pytest.mark.parametrize("d, deterministic, kernel_dim", [(96, False, 96), (96, True, 128), (192, False, 192),
                                                          (192, True, 256)])
def test_stage_calls_run_at_the_kernels_head_dim(d, deterministic, kernel_dim):
    # Every custom call of the forward+backward (host and stage calls, inside the shard_map) sees q at the
    # kernels' head dim: 96 and 192 themselves, or 128 and 256 with deterministic=True (the GPU's
    # deterministic dq kernel has neither).
    mask = masks.varlen_causal(DOCS)
    mp = mj.plan(mask, mesh_of(2), chunk_size=16, overlap=2, num_heads_q=2, head_dim=d)
    q, k, v = random_qkv(np.random.default_rng(9), mask.total_seqlen_q, mask.total_seqlen_k, 2, 2, d)
    loss = lambda q, k, v: jnp.sum(global_fn(mp, deterministic=deterministic)(q, k, v)[0])
    eqns = ffi_eqns(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    attn = [e for e in eqns if e.params["target_name"] in ("magi_jax_ffa_fwd", "magi_jax_ffa_bwd")]
    assert len(attn) >= 2 * (mp.num_stages + 1), [e.params["target_name"] for e in eqns]
    assert {e.invars[0].aval.shape[-1] for e in attn} == {kernel_dim}


@pytest.mark.parametrize("backward, overlap", [("staged", 2), ("fused", 2), ("staged", 0)])
def test_mla_computes_v_at_its_own_head_dim(backward, overlap):
    # q, k 192 with v 100: every attention call computes v at 128 (ffa.V_HEAD_DIMS), the stage calls reading
    # it from the packed receive buffers, where it travels zero-padded to 192; out and the gradients against
    # the float64 reference.
    mask = masks.varlen_causal(DOCS)
    mp = mj.plan(mask, mesh_of(2), chunk_size=16, overlap=overlap, num_heads_q=2, head_dim=192)
    rng = np.random.default_rng(10)
    q, k, _ = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 2, 2, 192)
    v = jnp.asarray(rng.standard_normal((mask.total_seqlen_k, 2, 100)).astype(np.float32))
    fn = global_fn(mp, backward=backward)
    eqns = ffi_eqns(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)[0]), argnums=(0, 1, 2)), q, k, v)
    fwd = [e for e in eqns if e.params["target_name"] == "magi_jax_ffa_fwd"]
    bwd = [e for e in eqns if e.params["target_name"] == "magi_jax_ffa_bwd"]
    assert any(e.invars[1].aval.shape[1] == 2 * 2 for e in fwd) == (overlap > 0)  # packed k: [n, 2 Hkv, 192]
    assert {e.outvars[0].aval.shape[-1] for e in fwd} == {128}           # out
    assert {e.invars[3].aval.shape[-1] for e in bwd} == {128}            # out, as the backward reads it
    check_against_reference(fn, mask, q, k, v, rng)


def test_bf16_softcap_scale_and_wire_dtype():
    check_dist(masks.varlen_causal(DOCS), mesh_of(4), overlap=2, dtype=jnp.bfloat16, softcap=5.0,
               softmax_scale=0.2, reduce_wire_dtype=jnp.float32)


@pytest.mark.parametrize("scale, kernel_scale", [(-0.2, 0.2), (0.0, 1.0)])
def test_negative_and_zero_scales_reach_the_kernels_positive(scale, kernel_scale):
    # As flex_flash_attn's (tests/test_ffa.py): every host and stage call, forward and backward.
    mask = masks.varlen_causal(DOCS)
    mp = check_dist(mask, mesh_of(2), overlap=2, dtype=jnp.bfloat16, softmax_scale=scale)
    q, k, v = random_qkv(np.random.default_rng(10), mask.total_seqlen_q, mask.total_seqlen_k, 2, 2, 64)
    loss = lambda q, k, v: jnp.sum(global_fn(mp, softmax_scale=scale)(q, k, v)[0])
    scales = attention_scales(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    assert len(scales) >= 2 * (mp.num_stages + 1) and set(scales) == {float(np.float32(kernel_scale))}, scales


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_dispatch_then_undispatch_is_identity(cp):
    mesh = mesh_of(cp)
    mp = mj.plan(masks.varlen_causal(DOCS), mesh, chunk_size=16)
    x = jnp.asarray(np.random.default_rng(cp).standard_normal((sum(DOCS), 3, 5)), jnp.float32)
    xd = mj.dispatch(x, mp)
    assert xd.shape == (mp.padded_seqlen, 3, 5)
    assert xd.sharding.is_equivalent_to(NamedSharding(mesh, P("cp")), 3)
    pos = np.asarray(mj.position_ids(mp))
    np.testing.assert_array_equal(pos, mp.plan.position_ids())
    real = pos < mp.seqlen
    np.testing.assert_array_equal(np.asarray(xd)[real], np.asarray(x)[pos[real]])
    np.testing.assert_array_equal(np.asarray(xd)[~real], 0.0)
    np.testing.assert_array_equal(np.asarray(mj.undispatch(xd, mp)), np.asarray(x))
    # Integer ids and a leading batch dim (seq_dim=1) under jit.
    ids = jnp.arange(2 * sum(DOCS), dtype=jnp.int32).reshape(2, -1)
    back = jax.jit(lambda t: mj.undispatch(mj.dispatch(t, mp, seq_dim=1), mp, seq_dim=1))(ids)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(ids))


def test_dispatch_and_undispatch_are_transposes():
    mp = mj.plan(masks.causal(300), mesh_of(4), chunk_size=16)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((300, 2)), jnp.float32)
    xd, vjp_d = jax.vjp(lambda x: mj.dispatch(x, mp), x)
    y = jnp.asarray(rng.standard_normal(xd.shape), jnp.float32)
    (gx,) = vjp_d(y)
    np.testing.assert_allclose(float(jnp.vdot(xd, y)), float(jnp.vdot(x, gx)), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(mj.undispatch(y, mp)))
    _, vjp_u = jax.vjp(lambda y: mj.undispatch(y, mp), y)
    (gy,) = vjp_u(x)
    np.testing.assert_array_equal(np.asarray(gy), np.asarray(mj.dispatch(x, mp)))


def test_two_dim_mesh_dp2_cp4_batch():
    """[B, T, H, D] on a (dp 2, cp 4) mesh: batch over dp, tokens over cp; each element checked."""
    mesh, mask, mp, q, k, v = dp2_cp4_batch(seed=5)
    dout = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape), jnp.float32)

    @jax.jit
    def fwd_bwd(q, k, v):
        def f(q, k, v):
            qd, kd, vd = (mj.dispatch(x, mp, seq_dim=1) for x in (q, k, v))
            out, lse = mj.calc_attn(qd, kd, vd, mp)
            return mj.undispatch(out, mp, seq_dim=1), lse
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return out, lse, vjp((dout, jnp.zeros_like(lse)))

    out, lse_d, grads = fwd_bwd(q, k, v)
    assert lse_d.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "cp")), 3)
    counts = mask.to_dense()
    for b in range(2):
        ref = attention_f64(q[b], k[b], v[b], mask, dout=dout[b])
        lp_fn = lambda q, k, v: mj.reference.attention_dense(q, k, v, counts)
        (lp_out, _), lp_vjp = jax.vjp(lp_fn, q[b], k[b], v[b])
        lp = lp_vjp((dout[b], jnp.zeros(lp_out.shape[:2], jnp.float32)))
        assert_within_rule("out", out[b], ref[0], lp_out)
        for name, g, r, l in zip(("dq", "dk", "dv"), grads, ref[2:], lp):
            assert_within_rule(name, g[b], r, l)


def test_calc_attn_local_inside_user_shard_map():
    """The same body in a user's own shard_map over (dp, cp), against calc_attn."""
    mesh = mesh_of(4, dp=2)
    mask = masks.varlen_causal(DOCS)
    mp = mj.plan(mask, mesh, chunk_size=16, overlap=1)
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, mp.padded_seqlen, mp.padded_seqlen, 2, 2, 64)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("cp"),) * 3, out_specs=P("cp"))
    def user(q, k, v):
        out, lse = mj.calc_attn_local(q, k, v, mp)
        return out * jnp.exp(jnp.where(jnp.isfinite(lse), lse, 0.0))[..., None] * 1e-3

    @jax.jit
    def ours(q, k, v):
        out, lse = mj.calc_attn(q, k, v, mp)
        return out * jnp.exp(jnp.where(jnp.isfinite(lse), lse, 0.0))[..., None] * 1e-3

    for f in (user, ours):
        assert f(q, k, v).shape == q.shape
    np.testing.assert_allclose(user(q, k, v), ours(q, k, v), rtol=1e-5, atol=1e-6)
    g_user = jax.jit(jax.grad(lambda *a: user(*a).sum(), argnums=(0, 1, 2)))(q, k, v)
    g_ours = jax.jit(jax.grad(lambda *a: ours(*a).sum(), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_user, g_ours):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 4])
def test_eager_calls_without_jit(cp):
    """calc_attn, and calc_attn_local in a user's shard_map, run eagerly (no jax.jit): forward and gradients.
    (An FFI call's empty optional operands once crashed XLA's partitioner when shard_map ran op by op.)"""
    mesh = mesh_of(cp)
    mask = masks.varlen_causal(DOCS)
    mp = mj.plan(mask, mesh, chunk_size=16, overlap=1, num_heads_q=2, head_dim=64)
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 2, 2, 64)

    def eager(q, k, v):
        qd, kd, vd = (mj.dispatch(x, mp) for x in (q, k, v))
        out, lse = mj.calc_attn(qd, kd, vd, mp)
        return mj.undispatch(out, mp), mj.undispatch(lse, mp)

    check_against_reference(eager, mask, q, k, v, rng)
    user = jax.shard_map(lambda q, k, v: mj.calc_attn_local(q, k, v, mp), mesh=mesh, in_specs=(P("cp"),) * 3,
                         out_specs=(P("cp"), P("cp")))
    qd, kd, vd = (mj.dispatch(x, mp) for x in (q, k, v))
    for a, b in zip(user(qd, kd, vd), jax.jit(user)(qd, kd, vd)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jitted_training_step():
    """A one-layer attention model trained for a few steps under jit on a (dp, cp) mesh: the loss falls,
    one compilation, and the first gradient matches the same model on one device with flex_flash_attn."""
    mesh = mesh_of(4, dp=2)
    mask = masks.varlen_causal(DOCS)
    mp = mj.plan(mask, mesh, chunk_size=32, overlap=2, num_heads_q=2, head_dim=64)
    rng = np.random.default_rng(3)
    T, C, H, D = mask.total_seqlen_q, 16, 2, 64
    x = jnp.asarray(rng.standard_normal((2, T, C)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((2, T, C)), jnp.float32)
    params = {n: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)
              for n, s in (("wq", (C, H * D)), ("wk", (C, H * D)), ("wv", (C, H * D)), ("wo", (H * D, C)))}

    def model(params, x, attn):
        q, k, v = ((x @ params[n]).reshape(*x.shape[:-1], H, D) for n in ("wq", "wk", "wv"))
        return attn(q, k, v).reshape(*x.shape[:-1], H * D) @ params["wo"]

    def dist_attn(q, k, v):
        qd, kd, vd = (mj.dispatch(a, mp, seq_dim=1) for a in (q, k, v))
        return mj.undispatch(mj.calc_attn(qd, kd, vd, mp)[0], mp, seq_dim=1)

    def local_attn(q, k, v):
        return jnp.stack([mj.flex_flash_attn(q[b], k[b], v[b], mask=mask)[0] for b in range(q.shape[0])])

    loss = lambda p, attn: jnp.mean((model(p, x, attn) - target) ** 2)

    @jax.jit
    def step(p):
        value, grads = jax.value_and_grad(loss)(p, dist_attn)
        return jax.tree.map(lambda w, g: w - 0.5 * g, p, grads), value, grads

    want = jax.grad(loss)(params, local_attn)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    losses = []
    for i in range(4):
        params_next, value, grads = step(params)
        if i == 0:
            for n in params:
                np.testing.assert_allclose(grads[n], want[n], rtol=2e-4, atol=1e-6)
        params = params_next
        losses.append(float(value))
    assert losses[-1] < losses[0] * 0.98, losses
    assert step._cache_size() == 1


def test_rows_with_no_key_and_padding_give_no_nan():
    mask = mj.AttnMask([[20, 100], [150, 200]], [[0, 50], [100, 180]], [0, 3], 200, 200)
    mp = mj.plan(mask, mesh_of(4), chunk_size=16, overlap=1)
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 200, 200, 2, 2, 64)
    fn = global_fn(mp)
    out, lse = fn(q, k, v)
    empty = mask.to_dense().sum(1) == 0
    np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
    assert np.isneginf(np.asarray(lse)[empty]).all() and np.isfinite(np.asarray(lse)[~empty]).all()
    grads = jax.grad(lambda q, k, v: fn(q, k, v)[0].sum(), argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    np.testing.assert_array_equal(np.asarray(grads[0])[empty], 0.0)


def test_plan_is_cached_and_bound_to_the_mesh():
    mesh = mesh_of(2)
    mask = masks.varlen_causal(DOCS)
    a = mj.plan(mask, mesh, chunk_size=16, overlap=2)
    assert a is mj.plan(mask, mesh, chunk_size=16, overlap=2)
    assert a.plan == make_plan(mask, 2, chunk_size=16, overlap=2)
    assert a.cp == 2 and a.local_len == a.plan.local_len and hash(a) == hash(mj.plan(mask, mesh, chunk_size=16,
                                                                                    overlap=2))


def test_bad_arguments():
    mesh = mesh_of(2)
    mask = masks.varlen_causal(DOCS)
    mp = mj.plan(mask, mesh, chunk_size=16)
    q = jnp.zeros((mp.padded_seqlen, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="axis"):
        mj.plan(mask, mesh, axis="tp")
    with pytest.raises(ValueError, match="x: has 10 tokens"):
        mj.dispatch(jnp.zeros((10, 2)), mp)
    with pytest.raises(ValueError, match="q: has 380 tokens.*dispatch it first"):
        mj.calc_attn(q[:380], q[:380], q[:380], mp)
    with pytest.raises(ValueError, match="transport"):
        mj.calc_attn(q, q, q, mp, transport="ragged")
    with pytest.raises(ValueError, match="backward"):
        mj.calc_attn(q, q, q, mp, backward="pipelined")
    with pytest.raises(ValueError, match="sm_margin"):
        mj.calc_attn(q, q, q, mp, sm_margin=-8)
    for wire in ("foo", jnp.int8, bool):
        with pytest.raises(ValueError, match="^reduce_wire_dtype: expected one of"):
            mj.calc_attn(q, q, q, mp, reduce_wire_dtype=wire)
    with pytest.raises(ValueError, match="the mesh has"):
        mj.calc_attn(q, q, q, make_plan(mask, 4, chunk_size=16), mesh=mesh)
    with pytest.raises(ValueError, match="no mesh"):
        mj.calc_attn(q, q, q, make_plan(mask, 2, chunk_size=16))
    with pytest.raises(ValueError, match="kv heads"):
        mj.calc_attn(q, q[:, :1].repeat(3, 1), q[:, :1].repeat(3, 1), mp)
    with pytest.raises(TypeError, match="plan"):
        mj.dispatch(q, "plan")


@pytest.mark.parametrize("overlap, backward", [(0, "fused"), (3, "fused"), (3, "staged")])
def test_no_transfer_waits_for_another_stage(overlap, backward):
    """In the compiled forward+backward, group_cast transfers depend on no attention call and each
    group_reduce transfer on one backward call (staged: its own stage's and, through the float32 dQ
    chained from call to call, the calls before it, never the host call that runs last): the dependency
    half of the overlap."""
    mp = mj.plan(masks.varlen_causal(DOCS), mesh_of(4), chunk_size=16, overlap=overlap, num_heads_q=2,
                 head_dim=64)
    q = jnp.zeros((mp.padded_seqlen, 2, 64), jnp.float32)

    def step(q, k, v):
        (out, lse), vjp = jax.vjp(lambda q, k, v: mj.calc_attn(q, k, v, mp, backward=backward), q, k, v)
        return out, vjp((out, lse))

    text = jax.jit(step).lower(q, q, q).compile().as_text()
    ops = count_ops(text)
    stages = max(mp.num_stages, 1)
    forward_calls = 1 if overlap == 0 else stages + 1
    backward_calls = stages + 1 if backward == "staged" else 1
    assert ops["ffa"] == forward_calls + backward_calls
    deps = collective_dependencies(text)
    assert deps and ops["collectives"] == len(deps)
    casts = [n for n, d in deps.items() if not d]
    reduces = [d for d in deps.values() if d]
    assert casts and reduces
    waits = [frozenset(n for n, t in d.items() if t == "magi_jax_ffa_bwd") for d in reduces]
    if backward == "fused":
        assert all(len(w) == 1 for w in waits) and len(set(waits)) == 1, waits
    else:
        # Stage i's reduce waits for calls 0..i: one more call per stage, and never all stages + 1.
        assert sorted(len(w) for w in set(waits)) == list(range(1, stages + 1)), waits


def test_explicit_mesh_from_make_mesh():
    """jax.make_mesh gives Explicit axes: dispatch reshards, calc_attn and the gradients still match."""
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), devices=jax.devices("cpu")[:8])
    mask = masks.prefix_lm(DOCS, [n // 2 for n in DOCS])
    mp = mj.plan(mask, mesh, chunk_size=16, overlap=2, num_heads_q=2, head_dim=64)
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 2, 2, 64)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(attn, q, k, v):
        return (attn(q, k, v) * w).sum()

    def dist(q, k, v):
        qd, kd, vd = (mj.dispatch(x, mp) for x in (q, k, v))
        assert jax.typeof(qd).sharding.spec[0] == "cp"
        return mj.undispatch(mj.calc_attn(qd, kd, vd, mp)[0], mp)

    local = lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask)[0]
    got = jax.jit(jax.value_and_grad(functools.partial(loss, dist), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(functools.partial(loss, local), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_explicit_mesh_batch_over_dp_gradients():
    """jax.make_mesh's Explicit (dp, cp) axes with a batch [B, T, H, D] split over dp: the gradients through
    dispatch, calc_attn and undispatch (the permutations' transposes once failed on the batch's sharding)."""
    mesh = jax.make_mesh((2, 2), ("dp", "cp"), devices=jax.devices("cpu")[:4])
    mask = masks.varlen_causal([100, 60, 96])
    mp = mj.plan(mask, mesh, chunk_size=16, overlap=1, num_heads_q=2, head_dim=64)
    rng = np.random.default_rng(11)
    q, k, v = (jnp.stack(x) for x in zip(*(random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 2, 2, 64)
                                          for _ in range(2))))
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def dist(q, k, v):
        qd, kd, vd = (mj.dispatch(x, mp, seq_dim=1) for x in (q, k, v))
        return mj.undispatch(mj.calc_attn(qd, kd, vd, mp)[0], mp, seq_dim=1)

    local = jax.vmap(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask)[0])
    got = jax.jit(jax.value_and_grad(lambda *a: (dist(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(lambda *a: (local(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_heads_over_a_tensor_parallel_axis():
    """head_axes="tp" on a (tp 2, cp 4) mesh: each device holds half the heads; no all-gather appears."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("tp", "cp"))
    mask = masks.sliding_window(DOCS, 30)
    mp = mj.plan(mask, mesh, chunk_size=16, overlap=2, num_heads_q=4, num_heads_kv=2, head_dim=64)
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 4, 2, 64)
    fn = global_fn(mp, head_axes="tp")
    want = mj.flex_flash_attn(q, k, v, mask=mask)
    for got, ref in zip(fn(q, k, v), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    qd = mj.dispatch(q, mp)
    kd = mj.dispatch(k, mp)
    text = jax.jit(lambda q, k: mj.calc_attn(q, k, k, mp, head_axes="tp")).lower(qd, kd).compile().as_text()
    assert "all-gather" not in text


@pytest.mark.parametrize("batch", [None, 2])
def test_heads_over_tp_on_an_explicit_mesh(batch):
    """head_axes="tp" on jax.make_mesh's Explicit axes: dispatch leaves the heads whole (and a batch over tp,
    its "auto" choice), calc_attn reshards them as its shard_map needs."""
    mesh = jax.make_mesh((4, 2), ("cp", "tp"), devices=jax.devices("cpu")[:8])
    mask = masks.varlen_causal([100, 156])
    mp = mj.plan(mask, mesh, chunk_size=16, overlap=1, num_heads_q=4, num_heads_kv=2, head_dim=64)
    rng = np.random.default_rng(12)
    qkv = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 4, 2, 64)
    want = mj.flex_flash_attn(*qkv, mask=mask)[0]
    if batch:
        qkv, want = tuple(jnp.stack([x] * batch) for x in qkv), jnp.stack([want] * batch)
    seq_dim = 1 if batch else 0

    @jax.jit
    def fn(q, k, v):
        qd, kd, vd = (mj.dispatch(x, mp, seq_dim=seq_dim) for x in (q, k, v))
        return mj.undispatch(mj.calc_attn(qd, kd, vd, mp, head_axes="tp")[0], mp, seq_dim=seq_dim)

    with jax.set_mesh(mesh):
        np.testing.assert_allclose(fn(*qkv), want, rtol=1e-5, atol=1e-5)


def test_checkpoint_policy_keeps_the_forward_out_of_the_backward():
    # calc_attn under jax.checkpoint: by default the backward pass runs the host and stage forward calls
    # again; a policy saving magi_jax.CHECKPOINT_NAMES keeps out and lse instead, with the same gradients.
    want, got, calls, mp = remat_grads(masks.varlen_causal(DOCS), mesh_of(2))
    assert calls == (mp.num_stages + 1, 2 * (mp.num_stages + 1), mp.num_stages + 1)
    for a, b in zip(want, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def test_heads_typed_over_tp_stay_there_on_an_explicit_mesh():
    """q, k, v from tensor-parallel projections of dispatched tokens (heads split over tp in their types):
    calc_attn without head_axes keeps them split (no all-gather), out too, with the reference's values."""
    mesh = jax.make_mesh((4, 2), ("cp", "tp"), devices=jax.devices("cpu")[:8])
    mask = masks.varlen_causal([100, 156])
    mp = mj.plan(mask, mesh, chunk_size=16, overlap=1, num_heads_q=4, num_heads_kv=2, head_dim=64)
    qkv = random_qkv(np.random.default_rng(13), mask.total_seqlen_q, mask.total_seqlen_k, 4, 2, 64)
    want = mj.flex_flash_attn(*qkv, mask=mask)[0]
    heads = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cp", "tp"))

    @jax.jit
    def fn(q, k, v):
        qd, kd, vd = (jax.sharding.reshard(mj.dispatch(x, mp), heads) for x in (q, k, v))
        out = mj.calc_attn(qd, kd, vd, mp)[0]
        assert jax.typeof(out).sharding.spec[1] == "tp"
        return mj.undispatch(out, mp)

    with jax.set_mesh(mesh):
        np.testing.assert_allclose(fn(*qkv), want, rtol=1e-5, atol=1e-5)
        qd, kd, vd = (jax.device_put(mj.dispatch(x, mp), heads) for x in qkv)
        text = jax.jit(lambda q, k, v: mj.calc_attn(q, k, v, mp)).lower(qd, kd, vd).compile().as_text()
    assert "all-gather" not in text
