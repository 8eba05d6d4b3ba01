"""flex_flash_attn's return_max_logit (per q head, the largest logit the mask lets a row see: QK-clip's
statistic) on the default backend (CPU in CI), against float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import magi_jax as mj
from magi_jax import ffa, masks
from magi_jax.mask import AttnMask
from magi_jax.reference import max_logit_f64
from tests.conftest import check_max_logit, random_qkv, stacked_slices
from tests.test_dist_helpers import dp2_cp4_batch, mesh_of

MASKS = {
    "varlen_causal": masks.varlen_causal([40, 90, 30]),
    "sliding_window": masks.sliding_window([60, 100], 24),
    "overlapping_types": AttnMask([[0, 100], [40, 180], [60, 70], [150, 200]],
                                  [[0, 130], [10, 200], [0, 50], [100, 160]], [0, 1, 2, 3], 200, 200),
    "empty_rows": AttnMask([[10, 50], [90, 120]], [[0, 40], [30, 100]], [1, 0], 130, 100),
}


def check_flex(mask, q, k, v, softmax_scale=None, softcap=0.0):
    """flex_flash_attn's max_logit, called eagerly (conftest.check_max_logit)."""
    attend = lambda flag: mj.flex_flash_attn(q, k, v, mask=mask, softmax_scale=softmax_scale, softcap=softcap,
                                             return_max_logit=flag)
    check_max_logit(attend, mask, q, k, softmax_scale, softcap)


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_max_logit_against_float64(name, dtype):
    mask = MASKS[name]
    rng = np.random.default_rng(len(name))
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 4, 2, 64, dtype)
    check_flex(mask, q, k, v)


@pytest.mark.parametrize("softmax_scale, softcap", [(0.3, 0.0), (None, 2.0), (-0.3, 0.0), (0.0, 0.0)])
def test_max_logit_takes_the_scale_and_softcap(softmax_scale, softcap):
    # Inputs scaled up so that the softcap bites (logits near +-softcap).
    mask = MASKS["overlapping_types"]
    q, k, v = random_qkv(np.random.default_rng(3), 200, 200, 2, 2, 64)
    check_flex(mask, 3 * q, k, v, softmax_scale, softcap)


def test_max_logit_of_heads_without_any_key_is_minus_infinity():
    # No slice at all, and a mask whose only slice is empty: every head -inf, no NaN, out 0.
    q, k, v = random_qkv(np.random.default_rng(4), 64, 48, 2, 1, 64)
    for mask in (AttnMask(np.zeros((0, 2)), np.zeros((0, 2)), [], 64, 48),
                 AttnMask([[10, 20]], [[30, 30]], [0], 64, 48)):
        out, lse, mx = mj.flex_flash_attn(q, k, v, mask=mask, return_max_logit=True)
        assert np.isneginf(np.asarray(mx)).all()
        assert not np.isnan(np.asarray(out)).any() and (np.asarray(out) == 0).all()


def test_max_logit_of_a_batch_is_per_sequence():
    # [B, T, H, D] with a mask per sequence: [B, Hq], each the lone call's; under jax.vmap the same.
    rng = np.random.default_rng(5)
    per_seq = [masks.varlen_causal([30, 50]), masks.sliding_window([80], 8), masks.causal(80)]
    q, k, v = (jnp.stack(x) for x in zip(*(random_qkv(rng, 80, 80, 4, 2, 64) for _ in per_seq)))
    slices = stacked_slices(per_seq)
    _, _, mx = mj.flex_flash_attn(q, k, v, *slices, return_max_logit=True)
    assert mx.shape == (3, 4)
    for b, mask in enumerate(per_seq):
        np.testing.assert_array_equal(np.asarray(mx[b]), np.asarray(
            mj.flex_flash_attn(q[b], k[b], v[b], mask=mask, return_max_logit=True)[2]))
    one = lambda q, k, v, qr, kr, t: mj.flex_flash_attn(q, k, v, qr, kr, t, return_max_logit=True)[2]
    np.testing.assert_array_equal(np.asarray(jax.vmap(one)(q, k, v, *slices)), np.asarray(mx))


def test_max_logit_under_jit_with_traced_ranges_and_grad():
    # A new mask of the same slice count reuses the compilation; out's gradient is the call's without the
    # flag; max_logit is not differentiable: its cotangent is dropped (zero gradient).
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 96, 96, 2, 2, 64)
    traces = []

    @jax.jit
    def step(q, k, v, qr, kr, t):
        traces.append(1)
        out, _, mx = mj.flex_flash_attn(q, k, v, qr, kr, t, return_max_logit=True)
        return mx, jax.grad(lambda q: jnp.sum(mj.flex_flash_attn(q, k, v, qr, kr, t, return_max_logit=True)[0]))(q)

    for mask in (masks.varlen_causal([40, 56]), masks.varlen_causal([70, 26])):
        mx, dq = step(q, k, v, *mask.kernel_args())
        np.testing.assert_allclose(np.asarray(mx), max_logit_f64(q, k, mask), rtol=1e-5)
        plain = jax.grad(lambda q: jnp.sum(mj.flex_flash_attn(q, k, v, mask=mask)[0]))(q)
        np.testing.assert_array_equal(np.asarray(dq), np.asarray(plain))
    assert len(traces) == 1
    mask = masks.causal(96)
    dq = jax.grad(lambda q: jnp.sum(mj.flex_flash_attn(q, k, v, mask=mask, return_max_logit=True)[2]))(q)
    assert not np.asarray(dq).any()


@pytest.mark.parametrize("mode", [AxisType.Auto, AxisType.Explicit])
def test_max_logit_with_heads_sharded(mode):
    # Heads split over two devices: each device's heads' maxima, as on one device, with no gather.
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(mode,))
    mask = masks.varlen_causal([40, 88])
    q, k, v = random_qkv(np.random.default_rng(7), 128, 128, 4, 2, 64)
    expect = mj.flex_flash_attn(q, k, v, mask=mask, return_max_logit=True)[2]
    fn = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask, return_max_logit=True)[2])
    placed = [jax.device_put(x, NamedSharding(mesh, P(None, "tp"))) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        mx = fn(*placed)
        assert "all-gather" not in fn.lower(*placed).compile().as_text()
    assert tuple(mx.sharding.spec) == ("tp",)
    np.testing.assert_array_equal(np.asarray(mx), np.asarray(expect))


def test_forward_calls_give_their_own_rows_maxima():
    # The custom call's per-row maxima over its own keys only: a call merged into a previous one (prev) gives
    # its slices' maxima, and the two calls' maximum is the single call's.
    mask = MASKS["overlapping_types"]
    q, k, v = random_qkv(np.random.default_rng(8), 200, 200, 2, 2, 64)
    qr, kr, t = (np.asarray(x) for x in mask.kernel_args())
    call = lambda sl, prev=None: ffa._fwd_call(q, k, v, qr[sl], kr[sl], t[sl], 0.125, 0.0, prev=prev,
                                              max_logit=True)
    whole, first = call(slice(None)), call(slice(0, 2))
    second = call(slice(2, None), prev=first[:2])
    np.testing.assert_array_equal(np.asarray(jnp.maximum(first[2], second[2])), np.asarray(whole[2]))
    np.testing.assert_allclose(np.asarray(second[0]), np.asarray(whole[0]), rtol=1e-5, atol=1e-6)
    assert np.isneginf(np.asarray(first[2])[180:]).all()  # rows without keys among the first two slices


def test_return_max_logit_must_be_a_bool():
    q, k, v = random_qkv(np.random.default_rng(9), 64, 64, 1, 1, 64)
    with pytest.raises(ValueError, match="return_max_logit"):
        mj.flex_flash_attn(q, k, v, mask=masks.causal(64), return_max_logit="yes")
    mp = mj.plan(masks.causal(64), mesh_of(2), chunk_size=16, overlap=1, num_heads_q=1, head_dim=64)
    with pytest.raises(ValueError, match="return_max_logit"):
        mj.calc_attn(*(mj.dispatch(x, mp) for x in (q, k, v)), mp, return_max_logit=1)


# ------------------------------------------------------------------------------------- distributed (calc_attn)

DIST_MASKS = {**{name: MASKS[name] for name in ("varlen_causal", "sliding_window", "overlapping_types")},
              "empty_rows": AttnMask([[10, 50], [90, 120]], [[0, 40], [30, 100]], [1, 0], 130, 130)}


@pytest.mark.parametrize("name, cp, overlap", [("varlen_causal", 4, 2), ("sliding_window", 2, 0),
                                               ("overlapping_types", 8, 1), ("empty_rows", 2, 2),
                                               ("varlen_causal", 1, 1)])
def test_calc_attn_max_logit_is_the_whole_sequences(name, cp, overlap):
    # Host and stage calls (merged in place) or one fused call (overlap 0), every rank's rows joined: the
    # global mask's per-head maximum, replicated; out, lse and the gradients those of the call without it.
    mask = DIST_MASKS[name]
    mesh = mesh_of(cp)
    mp = mj.plan(mask, mesh, chunk_size=16, overlap=overlap, num_heads_q=4, num_heads_kv=2, head_dim=64)
    q, k, v = random_qkv(np.random.default_rng(cp), mask.total_seqlen_q, mask.total_seqlen_k, 4, 2, 64)
    qd, kd, vd = (mj.dispatch(x, mp) for x in (q, k, v))
    attend = lambda flag: jax.jit(lambda q, k, v: mj.calc_attn(q, k, v, mp, return_max_logit=flag))(qd, kd, vd)
    assert tuple(check_max_logit(attend, mask, q, k).sharding.spec) in ((), (None,))
    loss = lambda flag: jax.jit(jax.grad(
        lambda q, k, v: jnp.sum(jnp.sin(mj.calc_attn(q, k, v, mp, return_max_logit=flag)[0])), argnums=(0, 1, 2)))
    for a, b in zip(loss(True)(qd, kd, vd), loss(False)(qd, kd, vd)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_calc_attn_max_logit_per_batch_element_on_a_dp_cp_mesh():
    # [B, T, H, D] on (dp 2, cp 4): [B, Hq], each element's own, split over dp like the batch.
    mesh, mask, mp, q, k, v = dp2_cp4_batch(seed=11)
    qd, kd, vd = (mj.dispatch(x, mp, seq_dim=1) for x in (q, k, v))
    mx = jax.jit(lambda q, k, v: mj.calc_attn(q, k, v, mp, return_max_logit=True)[2])(qd, kd, vd)
    assert mx.shape == (2, 2) and mx.sharding.is_equivalent_to(NamedSharding(mesh, P("dp")), 2)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(mx[b]), max_logit_f64(q[b], k[b], mask), rtol=1e-5)


def test_calc_attn_max_logit_with_plan_tables_and_in_a_users_shard_map():
    # Run-time tables (one compilation for two masks) and calc_attn_local inside the caller's shard_map.
    mesh = mesh_of(4)
    ms = [masks.varlen_causal([100, 60, 32]), masks.sliding_window([120, 72], 20)]
    plans = [mj.plan(m, mesh, chunk_size=16, overlap=1, num_heads_q=2, head_dim=64) for m in ms]
    capacity = mj.PlanCapacity.of(plans)
    attend = jax.jit(lambda q, k, v, t: mj.calc_attn(q, k, v, t, return_max_logit=True)[2])
    q, k, v = random_qkv(np.random.default_rng(12), 192, 192, 2, 2, 64)
    for m, p in zip(ms, plans):
        t = mj.plan_tables(p, capacity)
        mx = attend(*(mj.dispatch(x, t) for x in (q, k, v)), t)
        np.testing.assert_allclose(np.asarray(mx), max_logit_f64(q, k, m), rtol=1e-5)
    assert attend._cache_size() == 1
    p = plans[0]

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("cp"),) * 3, out_specs=P())
    def user(q, k, v):
        return mj.calc_attn_local(q, k, v, p, return_max_logit=True)[2]

    mx = user(*(mj.dispatch(x, p) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(mx), max_logit_f64(q, k, ms[0]), rtol=1e-5)
