"""flex_flash_attn through the custom calls on the default backend (CPU in CI), against float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, PartitionSpec as P

import magi_jax as mj
from magi_jax import ffa, masks
from magi_jax.mask import AttnMask
from tests.conftest import (assert_within_rule, attention_scales, chained_dq_grads, check_against_reference, ffi_calls,
                            ffi_eqns, merged_forward, packed_kv_forward, random_qkv, remat_grads_and_calls,
                            split_key_grads, stacked_slices)


def run_case(mask, hq=2, hkv=2, d=64, dtype=jnp.float32, seed=0, **kwargs):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, hq, hkv, d, dtype)
    fn = lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask, **kwargs)
    check_against_reference(fn, mask, q, k, v, rng, kwargs.get("softmax_scale"), kwargs.get("softcap", 0.0))


@pytest.mark.parametrize("mask_type", ["full", "causal", "inv_causal", "bi_causal"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_each_type_alone(mask_type, dtype):
    mask = AttnMask([[5, 150]], [[20, 200]], [mask_type], 160, 210)
    run_case(mask, dtype=dtype)


@pytest.mark.parametrize("d", [64, 128])
def test_mixed_types_and_overlapping_q_ranges(d):
    mask = AttnMask([[0, 100], [40, 180], [60, 70], [150, 200], [0, 200]],
                    [[0, 130], [10, 200], [0, 50], [100, 160], [90, 95]], [0, 1, 2, 3, 1], 200, 200)
    run_case(mask, d=d, seed=d)


@pytest.mark.parametrize("tq, tk", [(77, 300), (300, 77)])
def test_tq_differs_from_tk(tq, tk):
    mask = AttnMask([[0, tq], [tq // 3, tq]], [[0, tk], [0, tk // 2]], [1, 3], tq, tk)
    run_case(mask)


@pytest.mark.parametrize("hq, hkv", [(8, 2), (32, 4), (8, 1)])
def test_gqa_and_mqa(hq, hkv):
    run_case(masks.varlen_causal([40, 90, 30]), hq=hq, hkv=hkv)


@pytest.mark.parametrize("d, dv", [(32, 32), (96, 96), (80, 48), (192, 128), (64, 128), (128, 64)])
def test_head_dims_other_than_the_kernels(d, dv):
    # q, k of head dim d and v of dv (1 to 256): run zero-padded to the kernels' next size, the default scale
    # from d, out [Tq, Hq, dv]; against float64, gradients included.
    mask = masks.varlen_causal([40, 90, 30])
    rng = np.random.default_rng(d + 1000 * dv)
    q, k, _ = random_qkv(rng, 160, 160, 4, 2, d)
    v = jnp.asarray(rng.standard_normal((160, 2, dv)).astype(np.float32))
    fn = lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask)
    out, lse = fn(q, k, v)
    assert out.shape == (160, 4, dv) and lse.shape == (160, 4)
    check_against_reference(fn, mask, q, k, v, rng)


@pytest.mark.parametrize("deterministic, kernel_dim", [(False, 96), (True, 128)])
def test_head_dim_80_runs_at_96_and_deterministic_at_128(deterministic, kernel_dim):
    # The custom calls' q in the forward+backward: head dim 80 padded to the kernels' 96, or to 128 with
    # deterministic=True (the GPU's deterministic dq kernel has no 96); the gradients at 80.
    mask = masks.varlen_causal([40, 90, 30])
    q, k, v = random_qkv(np.random.default_rng(5), 160, 160, 4, 2, 80)
    loss = lambda q, k, v: jnp.sum(mj.flex_flash_attn(q, k, v, mask=mask, deterministic=deterministic)[0])
    grad = jax.grad(loss, argnums=(0, 1, 2))
    calls = sorted((eqn.params["target_name"], eqn.invars[0].aval.shape) for eqn in ffi_eqns(grad, q, k, v))
    assert calls == [("magi_jax_ffa_bwd", (160, 4, kernel_dim)), ("magi_jax_ffa_fwd", (160, 4, kernel_dim))], calls
    assert [g.shape for g in grad(q, k, v)] == [(160, 4, 80), (160, 2, 80), (160, 2, 80)]
    assert ffa.kernel_head_dim(80, 48) == 96 and ffa.kernel_head_dim(80, 48, deterministic=True) == 128
    assert ffa.kernel_head_dim(192, 128) == 192 and ffa.kernel_head_dim(192, 128, deterministic=True) == 256


@pytest.mark.parametrize("deterministic", [False, True])
def test_mla_takes_v_at_its_own_head_dim_in_both_passes(deterministic):
    # q, k 192 with v 100: v, out and dout at 128 in both custom calls (ffa.V_HEAD_DIMS), out and dv sliced to
    # 100. deterministic=True: everything at 256, as before.
    mask = masks.varlen_causal([40, 90, 30])
    rng = np.random.default_rng(6)
    q, k, _ = random_qkv(rng, 160, 160, 4, 2, 192)
    v = jnp.asarray(rng.standard_normal((160, 2, 100)).astype(np.float32))
    loss = lambda q, k, v: jnp.sum(mj.flex_flash_attn(q, k, v, mask=mask, deterministic=deterministic)[0])
    grad = jax.grad(loss, argnums=(0, 1, 2))
    calls = sorted((eqn.params["target_name"], eqn.invars[0].aval.shape[-1], eqn.invars[2].aval.shape[-1])
                   for eqn in ffi_eqns(grad, q, k, v))
    d, dv = (256, 256) if deterministic else (192, 128)
    assert calls == [("magi_jax_ffa_bwd", d, dv), ("magi_jax_ffa_fwd", d, dv)], calls
    assert [g.shape for g in grad(q, k, v)] == [(160, 4, 192), (160, 2, 192), (160, 2, 100)]
    check_against_reference(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask, deterministic=deterministic),
                            mask, q, k, v, rng)


def test_unpacked_second_key_source_refused_where_v_has_its_own_head_dim():
    # An unpacked second key source takes v2 as k2 (and dk2, dv2): v of its own head dim has it only packed
    # (V each head's first Dv columns), whether v2 has v's head dim (unlike k2) or k2's (unlike v).
    from magi_jax import ffa
    q, k, _ = random_qkv(np.random.default_rng(7), 100, 120, 4, 2, 64)
    v = k[..., :32]
    qr, kr, t = (jnp.asarray(a) for a in TWO_CALL_MASK.kernel_args())
    out, lse = ffa._fwd_call(q, k, v, qr, kr, t, 0.125, 0.0)
    for v2 in (v[60:], k[60:]):
        with pytest.raises(ValueError, match="^k2: with v of its own head dim 32, a second key source only packed"):
            ffa._bwd_call(q, k[:60], v[:60], out, out, lse, lse, qr, kr, t, 0.125, 0.0, False, k2=k[60:], v2=v2)
    with pytest.raises(ValueError, match=r"^head_dim_v: must be in \[1, 64\]"):
        ffa._fwd_call(q, jnp.stack([k, k], axis=1), None, qr, kr, t, 0.125, 0.0, head_dim_v=80)
    with pytest.raises(ValueError, match="^head_dim_v: only for packed K and V"):
        ffa._fwd_call(q, k, v, qr, kr, t, 0.125, 0.0, head_dim_v=32)


def test_softcap_and_scale():
    run_case(masks.sliding_window([70, 100], 30), softcap=3.0, softmax_scale=0.3)


@pytest.mark.parametrize("scale, kernel_scale", [(-0.5, 0.5), (0.0, 1.0)])
def test_negative_and_zero_scales_reach_the_kernels_positive(scale, kernel_scale):
    # The CUDA kernels' softmax takes each row's maximum of q.k before scaling (under a negative scale its
    # smallest logit) and masks cells with -inf (times a zero scale: NaN): every call of the forward and
    # backward gets a positive scale, the same logits in q (ffa.positive_scale). fp16, logits spread far
    # beyond the ~11 that P against the smallest would overflow in.
    mask = masks.sliding_window([70, 100], 30)
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 170, 170, 2, 2, 64, jnp.float16)
    fn = lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask, softmax_scale=scale)
    loss = lambda q, k, v: jnp.sum(fn(q, k, v)[0].astype(jnp.float32))
    assert attention_scales(jax.grad(loss, argnums=(0, 1, 2)), 4 * q, k, v) == [kernel_scale] * 2
    check_against_reference(fn, mask, 4 * q, k, v, rng, scale)


def test_rows_with_no_key():
    # Rows 0-9 and 60-79 are covered by no slice; the causal slice with Lk < Lq leaves its top rows empty.
    mask = AttnMask([[10, 60], [80, 120]], [[0, 50], [100, 110]], [0, 1], 120, 120)
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 120, 120, 2, 2, 64)
    (out, lse), vjp = jax.vjp(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask), q, k, v)
    empty = mask.to_dense().sum(1) == 0
    assert empty.sum() == 10 + 20 + 30
    np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
    assert np.isneginf(np.asarray(lse)[empty]).all() and np.isfinite(np.asarray(lse)[~empty]).all()
    dq, dk, dv = vjp((jnp.ones_like(out) * 0.5 + out, jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)))
    assert all(np.isfinite(np.asarray(g)).all() for g in (dq, dk, dv))
    np.testing.assert_array_equal(np.asarray(dq)[empty], 0.0)
    unattended = mask.to_dense().sum(0) == 0
    np.testing.assert_array_equal(np.asarray(dk)[unattended], 0.0)
    check_against_reference(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask), mask, q, k, v, rng)


def test_empty_mask():
    mask = AttnMask(np.zeros((0, 2), int), np.zeros((0, 2), int), [], 64, 64)
    run_case(mask)


@st.composite
def random_masks(draw):
    # A few fixed shapes keep the compiled references cached; the masks themselves vary freely.
    tq, tk = draw(st.sampled_from([(160, 160), (96, 192), (192, 64)]))
    n = draw(st.integers(1, 50))
    ranges = lambda total: sorted((draw(st.integers(0, total)), draw(st.integers(0, total))))
    return AttnMask([ranges(tq) for _ in range(n)], [ranges(tk) for _ in range(n)],
                    [draw(st.integers(0, 3)) for _ in range(n)], tq, tk)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(random_masks(), st.sampled_from([(2, 2), (4, 1)]))

def test_random_masks(mask, heads):
    run_case(mask, hq=heads[0], hkv=heads[1], seed=mask.num_slices)


def test_jit_grad_and_no_recompile_for_a_new_mask():
    n = 3
    a = AttnMask([[0, 50], [50, 128], [20, 90]], [[0, 50], [0, 128], [40, 60]], [1, 1, 0], 128, 128)
    b = AttnMask([[0, 128], [10, 20], [30, 31]], [[0, 100], [5, 128], [0, 128]], [3, 2, 1], 128, 128)
    assert a.num_slices == b.num_slices == n

    @jax.jit
    def loss(q, k, v, qr, kr, types):
        out, lse = mj.flex_flash_attn(q, k, v, qr, kr, types)
        return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 128, 128, 2, 2, 64)
    for mask in (a, b):
        args = tuple(jnp.asarray(x) for x in mask.kernel_args())
        value = loss(q, k, v, *args)
        grads = grad(q, k, v, *args)
        want = mj.flex_flash_attn(q, k, v, mask=mask)
        np.testing.assert_allclose(value, jnp.sum(want[0] ** 2) + jnp.sum(
            jnp.where(jnp.isfinite(want[1]), want[1], 0.0)), rtol=1e-5)
        assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert loss._cache_size() == 1 and grad._cache_size() == 1


def test_inside_shard_map_over_heads():
    devices = np.array(jax.devices()[:4])
    mesh = Mesh(devices, ("tp",))
    mask = masks.varlen_causal([100, 28])
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 128, 128, 8, 4, 64)
    qr, kr, types = mask.kernel_args()

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "tp"),) * 3, out_specs=(P(None, "tp"),) * 2)
    def sharded(q, k, v):
        return mj.flex_flash_attn(q, k, v, qr, kr, types)

    out, lse = sharded(q, k, v)
    want_out, want_lse = mj.flex_flash_attn(q, k, v, mask=mask)
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


def test_gradient_inside_shard_map_over_heads():
    # FFI results must vary over the mesh axis like their inputs, or shard_map's transpose sums the
    # cotangents over the axis (and custom_vjp rejects them).
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    mask = masks.sliding_window([70, 58], 24)
    rng = np.random.default_rng(12)
    q, k, v = random_qkv(rng, 128, 128, 8, 4, 64)
    qr, kr, types = mask.kernel_args()
    weights = jnp.asarray(rng.standard_normal((128, 8, 64)), jnp.float32)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "tp"),) * 3, out_specs=P(None, "tp"))
    def sharded(q, k, v):
        return mj.flex_flash_attn(q, k, v, qr, kr, types)[0]

    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * weights))
    got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask)[0]), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_deterministic_backward_is_bitwise_repeatable():
    mask = masks.shared_question([(40, [30, 50]), (20, [60])])
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 4, 2, 64, jnp.bfloat16)
    f = jax.jit(jax.grad(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask, deterministic=True)[0]
                         .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    first, second = f(q, k, v), f(q, k, v)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def _qkv(tq=16, tk=16, hq=2, hkv=2, d=64, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal(shape)).astype(dtype)
                 for shape in ((tq, hq, d), (tk, hkv, d), (tk, hkv, d)))


OK_RANGES = dict(q_ranges=np.array([[0, 16]]), k_ranges=np.array([[0, 16]]), attn_type_map=np.array([1]))


@pytest.mark.parametrize("make, match", [
    (lambda: (*_qkv()[:2], _qkv()[2][:8]), r"^v: shape"),
    (lambda: (*_qkv()[:2], _qkv()[2][:, :, :0]), r"^v: head_dim 0 unsupported; use 1 to 256"),
    (lambda: (_qkv()[0][0], *_qkv()[1:]), r"^q: expected \[tokens"),
    (lambda: (_qkv()[0], _qkv()[1].astype(jnp.bfloat16), _qkv()[2]), r"^k: dtype"),
    (lambda: _qkv(d=300), r"^q: head_dim 300 unsupported; use 1 to 256"),
    (lambda: (_qkv()[0], _qkv(d=32)[1], _qkv()[2]), r"^k: head_dim 32 differs from q's 64"),
    (lambda: _qkv(hq=3, hkv=2), r"^k: 2 kv heads do not divide 3"),
    (lambda: _qkv(dtype=jnp.int32), r"^q: dtype int32 unsupported"),
])
def test_bad_tensors_name_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        mj.flex_flash_attn(*make(), **OK_RANGES)


@pytest.mark.parametrize("ranges, match", [
    (dict(OK_RANGES, q_ranges=np.array([[0, 17]])), r"q_ranges\[0\].*out of bounds"),
    (dict(OK_RANGES, k_ranges=np.array([[9, 3]])), r"k_ranges\[0\].*reversed"),
    (dict(OK_RANGES, attn_type_map=np.array([4])), r"types.*unknown"),
    (dict(OK_RANGES, attn_type_map=np.array([1, 1])), r"different lengths"),
    (dict(OK_RANGES, q_ranges=np.array([0, 16])), r"^q_ranges: expected shape \[N, 2\]"),
    (dict(OK_RANGES, k_ranges=np.array([[0.0, 16.0]])), r"^k_ranges: expected an integer"),
    (dict(OK_RANGES, attn_type_map=["diagonal"]), r"^attn_type_map: unknown mask type 'diagonal'"),
    (dict(OK_RANGES, attn_type_map=[1.0]), r"^attn_type_map: expected mask type names or integer codes"),
    (dict(q_ranges=None, k_ranges=None, attn_type_map=None), r"all required"),
])
def test_bad_ranges_name_the_argument(ranges, match):
    with pytest.raises(ValueError, match=match):
        mj.flex_flash_attn(*_qkv(), **ranges)


def test_mistyped_kernel_switch_names_the_variable(monkeypatch):
    # The CUDA handlers read MAGI_JAX_FFA_KERNEL; a typo must not silently pick a kernel, on any platform.
    monkeypatch.setenv("MAGI_JAX_FFA_KERNEL", "sm_90")
    with pytest.raises(ValueError, match="^MAGI_JAX_FFA_KERNEL: 'sm_90' is not a kernel"):
        mj.flex_flash_attn(*_qkv(), **OK_RANGES)
    for value in ("sm90", "mma", ""):
        monkeypatch.setenv("MAGI_JAX_FFA_KERNEL", value)
        out, _ = mj.flex_flash_attn(*_qkv(), **OK_RANGES)
        assert np.isfinite(np.asarray(out)).all()


def test_bad_mask_argument():
    with pytest.raises(ValueError, match="^q: has 16 tokens but the mask expects 20"):
        mj.flex_flash_attn(*_qkv(), mask=masks.causal(20, 16))
    with pytest.raises(ValueError, match="^mask: give either"):
        mj.flex_flash_attn(*_qkv(), mask=masks.causal(16), **OK_RANGES)
    with pytest.raises(ValueError, match="^softcap"):
        mj.flex_flash_attn(*_qkv(), mask=masks.causal(16), softcap=-1.0)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="^sm_margin: expected an int >= 0"):
            mj.flex_flash_attn(*_qkv(), mask=masks.causal(16), sm_margin=bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(softmax_scale=float("nan")), "^softmax_scale: must be finite"),
    (dict(softmax_scale=np.inf), "^softmax_scale: must be finite"),
    (dict(softmax_scale="0.1"), "^softmax_scale: expected a number"),
    (dict(softcap=np.inf), "^softcap: must be finite"),
    (dict(softcap="1"), "^softcap: expected a number"),
    (dict(softcap=[1.0]), "^softcap: expected a number"),
    (dict(deterministic="no"), "^deterministic: expected True or False"),
])
def test_bad_scalars_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mj.flex_flash_attn(*_qkv(), mask=masks.causal(16), **kwargs)


def test_traced_scale_and_softcap_name_the_argument():
    # Both are fixed in the kernel call: a traced value cannot be, and says so.
    for name in ("softmax_scale", "softcap"):
        fn = jax.jit(lambda x: mj.flex_flash_attn(*_qkv(), mask=masks.causal(16), **{name: x})[0])
        with pytest.raises(ValueError, match=f"^{name}: must be a Python or NumPy number"):
            fn(0.5)


def test_ranges_as_python_lists_and_type_names():
    # The same forms AttnMask takes: lists, type names, and no slices at all (every row empty).
    q, k, v = _qkv()
    want = mj.flex_flash_attn(q, k, v, mask=masks.causal(16))
    got = mj.flex_flash_attn(q, k, v, [[0, 16]], [[0, 16]], ["causal"])
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out, lse = mj.flex_flash_attn(q, k, v, [], [], [])
    assert not np.asarray(out).any() and np.isneginf(np.asarray(lse)).all()


def test_sm_margin_does_not_change_the_result():
    # A launch setting only (the CPU handler ignores it; tests/test_ffa_sm90_gpu.py checks the GPU grid).
    q, k, v = _qkv()
    want = mj.flex_flash_attn(q, k, v, mask=masks.causal(16))
    got = mj.flex_flash_attn(q, k, v, mask=masks.causal(16), sm_margin=8)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("split", [0, 37, 64, 100])
@pytest.mark.parametrize("packed, dv", [(False, 64), (True, 64), (True, 40)])
def test_backward_with_two_key_sources_equals_one(split, packed, dv):
    # The distributed backward passes its fetched keys as a second source instead of concatenating them
    # (packed: K and V side by side per row, as fetched; dK and dV returned so; a narrower v, MLA's, padded
    # to k's head dim there); the gradients must be those of the concatenation (bitwise on the CPU, which
    # concatenates internally).
    rng = np.random.default_rng(split)
    mask = AttnMask([[0, 40], [10, 70], [50, 90]], [[0, 60], [30, 100], [70, 100]], [1, 0, 3], 90, 100)
    q, k, v = random_qkv(rng, 90, 100, 4, 2, 64)
    v = v[..., :dv]
    one, two = split_key_grads(mask, q, k, v, split, packed=packed)
    for name, a, b in zip(["dq", "dk", "dv"], one, two):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_backward_packed_second_source_shape_error_names_k2():
    from magi_jax import ffa
    q, k, v = random_qkv(np.random.default_rng(8), 90, 100, 4, 2, 64)
    lse = jnp.zeros(q.shape[:2], jnp.float32)
    qr, kr, t = (jnp.asarray(a) for a in OK_RANGES.values())
    with pytest.raises(ValueError, match=r"^k2: packed K and V must be \[Tk2, 2, 2, 64\]"):
        ffa._bwd_call(q, k, v, q, q, lse, lse, qr, kr, t, 0.125, 0.0, False, k2=k[:10])


@pytest.mark.parametrize("shared_delta", [False, True])
def test_backward_chained_over_slice_sets_equals_one_call(shared_delta):
    # The staged distributed backward: calls over disjoint slice sets, dQ summed in one float32 accumulator,
    # each computing delta or all given one.
    rng = np.random.default_rng(3)
    mask = AttnMask([[0, 40], [10, 70], [50, 90], [0, 90]], [[0, 60], [60, 80], [80, 100], [100, 120]],
                    [1, 0, 3, 0], 90, 120)
    q, k, v = random_qkv(rng, 90, 120, 4, 2, 64)
    one, two = chained_dq_grads(mask, q, k, v, cut=2, shared_delta=shared_delta)
    for name, a, b in zip(["dq", "dk", "dv"], one, two):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=name)


# Two forward calls over slices [:2] and [2:]: rows 0-9 have keys only in the first, 90-99 in none.
TWO_CALL_MASK = AttnMask([[0, 40], [10, 70], [50, 90], [10, 90]], [[0, 60], [60, 80], [80, 100], [100, 120]],
                         [1, 0, 3, 0], 100, 120)


@pytest.mark.parametrize("dv", [64, 40])
def test_forward_merged_into_a_previous_call_equals_one_call(dv):
    # The distributed forward's stage calls: each merges its slices' part into the out and lse so far, in
    # place (v, out and prev of their own head dim too: the custom call's forward takes any on the CPU). Rows
    # without keys in either call: 0 / -inf, no NaN.
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 100, 120, 4, 2, 64)
    v = v[..., :dv]
    one, two = merged_forward(TWO_CALL_MASK, q, k, v, cut=2)
    assert one[0].shape == (100, 4, dv)
    for name, a, b in zip(["out", "lse"], one, two):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.all(two[1][90:] == -np.inf) and np.all(two[0][90:] == 0)


@pytest.mark.parametrize("dv", [64, 40])
def test_forward_with_k_and_v_packed_equals_separate_ones(dv):
    # A stage call of the distributed forward reads the receive buffer as is: K and V side by side per row
    # (a narrower v, MLA's, padded to k's head dim there and read back at its own).
    q, k, v = random_qkv(np.random.default_rng(6), 100, 120, 4, 2, 64)
    v = v[..., :dv]
    separate, packed = packed_kv_forward(TWO_CALL_MASK, q, k, v, cut=2)
    assert packed[0].shape == (100, 4, dv)
    for a, b in zip(separate, packed):
        np.testing.assert_array_equal(a, b)
    from magi_jax import ffa
    qr, kr, t = (jnp.asarray(a) for a in TWO_CALL_MASK.kernel_args())
    with pytest.raises(ValueError, match="^k: packed K and V must be"):
        ffa._fwd_call(q, k, None, qr, kr, t, 0.125, 0.0)
    with pytest.raises(Exception, match="v: must be \\[Tk, Hkv, Dv\\] with k's tokens"):
        jax.block_until_ready(ffa._fwd_call(q, k, v[:-1], qr, kr, t, 0.125, 0.0))


def test_forward_prev_argument_errors():
    from magi_jax import ffa
    q, k, v = _qkv()
    qr, kr, t = (jnp.asarray(a) for a in (OK_RANGES["q_ranges"], OK_RANGES["k_ranges"], OK_RANGES["attn_type_map"]))
    out, lse = ffa._fwd_call(q, k, v, qr, kr, t, 0.125, 0.0)
    with pytest.raises(ValueError, match="^prev: expected out"):
        ffa._fwd_call(q, k, v, qr, kr, t, 0.125, 0.0, prev=(out[:4], lse))
    with pytest.raises(ValueError, match="^prev: expected out"):
        ffa._fwd_call(q, k, v, qr, kr, t, 0.125, 0.0, prev=(out, lse[:, :1]))


def test_vmap_over_a_batch_matches_a_loop():
    # jax.vmap packs the batch into one call: the same values as a Python loop, gradients too.
    rng = np.random.default_rng(5)
    mask = masks.varlen_causal([20, 12])
    q, k, v = (jnp.stack(x) for x in zip(*[random_qkv(rng, 32, 32, 4, 2, 64) for _ in range(3)]))
    fn = lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask)
    loss = lambda f: lambda q, k, v: (f(q, k, v)[0] ** 2).sum()
    got = jax.jit(jax.vmap(fn))(q, k, v)
    grads = jax.grad(loss(jax.vmap(fn)), argnums=(0, 1, 2))(q, k, v)
    for b in range(3):
        want = fn(q[b], k[b], v[b])
        for a, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(a[b]), np.asarray(w), rtol=1e-6, atol=1e-6)
        want_g = jax.grad(loss(fn), argnums=(0, 1, 2))(q[b], k[b], v[b])
        for a, w in zip(grads, want_g):
            np.testing.assert_allclose(np.asarray(a[b]), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_vmap_packs_the_batch_into_one_call():
    # One forward and one backward custom call for the whole batch (no loop over its elements), with a mask
    # per element (traced ranges, batched), keys shared by the batch (in_axes None: not copied in the
    # forward), per-element gradients (vmap of grad) and vmap inside vmap.
    rng = np.random.default_rng(11)
    B, T = 3, 32
    per = [masks.varlen_causal(lens) for lens in ([20, 12], [9, 23], [32])]
    qr, kr, ty = stacked_slices(per, range_fill=T)
    q, k, v = (jnp.stack(x) for x in zip(*[random_qkv(rng, T, T, 4, 2, 64) for _ in range(B)]))
    fn = lambda q, k, v, a, b, c: mj.flex_flash_attn(q, k, v, a, b, c)
    loss = lambda q, k, v, a, b, c: (fn(q, k, v, a, b, c)[0] ** 2).sum()
    grad = jax.grad(loss, argnums=(0, 1, 2))

    assert ffi_calls(jax.vmap(grad), q, k, v, qr, kr, ty) == {"magi_jax_ffa_fwd": 1, "magi_jax_ffa_bwd": 1}
    assert "while" not in jax.jit(jax.vmap(grad)).lower(q, k, v, qr, kr, ty).as_text()
    got, got_g = jax.jit(jax.vmap(fn))(q, k, v, qr, kr, ty), jax.jit(jax.vmap(grad))(q, k, v, qr, kr, ty)
    for b in range(B):
        for a, w in zip(got, fn(q[b], k[b], v[b], qr[b], kr[b], ty[b])):
            np.testing.assert_allclose(np.asarray(a[b]), np.asarray(w), rtol=1e-6, atol=1e-6)
        for a, w in zip(got_g, grad(q[b], k[b], v[b], qr[b], kr[b], ty[b])):
            np.testing.assert_allclose(np.asarray(a[b]), np.asarray(w), rtol=1e-5, atol=1e-5)

    shared = jax.vmap(fn, in_axes=(0, None, None, 0, 0, 0))
    assert ffi_calls(shared, q, k[0], v[0], qr, kr, ty) == {"magi_jax_ffa_fwd": 1}
    got = shared(q, k[0], v[0], qr, kr, ty)
    shared_g = jax.vmap(grad, in_axes=(0, None, None, 0, 0, 0))(q, k[0], v[0], qr, kr, ty)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(got[0][b]), np.asarray(fn(q[b], k[0], v[0], qr[b], kr[b], ty[b])[0]),
                                   rtol=1e-6, atol=1e-6)
        for a, w in zip(shared_g, grad(q[b], k[0], v[0], qr[b], kr[b], ty[b])):
            np.testing.assert_allclose(np.asarray(a[b]), np.asarray(w), rtol=1e-5, atol=1e-5)

    nested = jax.jit(jax.vmap(jax.vmap(fn, in_axes=(0, 0, 0, None, None, None)), in_axes=(0, 0, 0, 0, 0, 0)))
    stack = lambda x: jnp.stack([x, x[::-1]], axis=1)  # [B, 2, ...]: [b, 1] is element B - 1 - b
    got = nested(stack(q), stack(k), stack(v), qr, kr, ty)
    np.testing.assert_allclose(np.asarray(got[0][2, 1]), np.asarray(fn(q[0], k[0], v[0], qr[2], kr[2], ty[2])[0]),
                               rtol=1e-6, atol=1e-6)


def test_vmap_over_an_empty_batch_and_shared_keys_of_another_length():
    # A batch of no elements gives empty results (no call); keys shared by the batch (cross attention, Tk != Tq)
    # are indexed by every element's slices as they are.
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, 32, 48, 2, 2, 64)
    qr, kr, ty = np.array([[0, 16], [16, 32]], np.int32), np.array([[0, 8], [8, 48]], np.int32), np.array([0, 1])
    fn = lambda q: mj.flex_flash_attn(q, k, v, qr, kr, ty.astype(np.int32))[0]
    assert jax.vmap(fn)(jnp.zeros((0, 32, 2, 64), q.dtype)).shape == (0, 32, 2, 64)
    qs = jnp.stack([q, q[::-1]])
    got = jax.vmap(fn)(qs)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(fn(qs[b])), rtol=1e-6, atol=1e-6)


def test_vmap_keeps_an_invalid_traced_range_inside_its_element():
    # Traced ranges past the sequence are clamped to it, by each element on its own: packed, a range past
    # element 0's end must not reach element 1's tokens.
    rng = np.random.default_rng(12)
    q, k, v = (jnp.stack(x) for x in zip(*[random_qkv(rng, 16, 16, 2, 2, 64) for _ in range(2)]))
    qr = np.array([[[0, 16]], [[0, 16]]], np.int32)
    kr = np.array([[[4, 40]], [[0, 16]]], np.int32)   # element 0: keys 4..39 of a 16-key sequence
    ty = np.zeros((2, 1), np.int32)
    fn = jax.jit(lambda q, k, v, a, b, c: mj.flex_flash_attn(q, k, v, a, b, c)[0])
    got = jax.vmap(fn)(q, k, v, qr, kr, ty)
    want = fn(q[0], k[0], v[0], qr[0], np.array([[4, 16]], np.int32), ty[0])
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_batched_inputs_take_one_mask_or_one_per_sequence():
    # q [B, T, H, D]: each sequence against the float64 reference of its own mask, whether one mask serves
    # the batch or each sequence has its slices [B, N, 2]; keys [Tk, H, D] shared by the batch too.
    rng = np.random.default_rng(14)
    per = [masks.varlen_causal(lens) for lens in ([20, 12], [9, 23], [32])]
    slices = stacked_slices(per)
    q, k, v = (jnp.stack(x) for x in zip(*[random_qkv(rng, 32, 32, 4, 2, 64) for _ in range(3)]))
    for b, mask in enumerate(per):
        def element(qb, kb, vb, b=b):   # sequence b through the batched call, the others held fixed
            batch = [x.at[b].set(xb) for x, xb in ((q, qb), (k, kb), (v, vb))]
            return tuple(y[b] for y in mj.flex_flash_attn(*batch, *slices))
        check_against_reference(element, mask, q[b], k[b], v[b], rng)
    one = masks.sliding_window([32], 10)
    out, lse = mj.flex_flash_attn(q, k, v, mask=one)
    for b in range(3):
        for got, want in zip((out[b], lse[b]), mj.flex_flash_attn(q[b], k[b], v[b], mask=one)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    shared = mj.flex_flash_attn(q, k[0], v[0], mask=one)[0]
    np.testing.assert_array_equal(np.asarray(shared[2]), np.asarray(mj.flex_flash_attn(q[2], k[0], v[0], mask=one)[0]))


def test_batched_inputs_errors_name_the_argument():
    q, k, v = (jnp.stack([x] * 2) for x in random_qkv(np.random.default_rng(15), 32, 32, 2, 2, 64))
    mask = masks.causal(32)
    with pytest.raises(ValueError, match="^k: expected \\[2, Tk, H, D\\]"):
        mj.flex_flash_attn(q, k[:1], v[:1], mask=mask)
    with pytest.raises(ValueError, match="^v: expected"):
        mj.flex_flash_attn(q, k, v[0], mask=mask)
    with pytest.raises(ValueError, match="^q: has 31 tokens"):
        mj.flex_flash_attn(q[:, :31], k, v, mask=mask)
    qr, kr, ty = (np.stack([x] * 3) for x in mask.kernel_args())
    with pytest.raises(ValueError, match="^q_ranges: 3 sequences' slices for q's batch of 2"):
        mj.flex_flash_attn(q, k, v, qr, kr, ty)
    bad = qr[:2].copy()
    bad[1, 0] = [20, 10]   # sequence 1's range reversed: named before the vmap traces it
    with pytest.raises(ValueError, match="q_ranges"):
        mj.flex_flash_attn(q, k, v, bad, kr[:2], ty[:2])


def _dense_with_sinks(q, k, v, visible, sinks, xp):
    """Dense attention whose every row's softmax also counts its head's sink logit (value zero): the
    reference of with_sinks, in numpy float64 (xp=np) or in jnp at the inputs' dtype (differentiable)."""
    hq, d = q.shape[1], q.shape[2]
    k, v = (xp.repeat(x, hq // x.shape[1], axis=1) for x in (k, v))
    logits = xp.where(visible[None], xp.einsum("qhd,khd->hqk", q, k) * d ** -0.5, -xp.inf)
    sink = xp.broadcast_to(sinks[:, None, None], (hq, q.shape[0], 1)).astype(logits.dtype)
    full = xp.concatenate([logits, sink], axis=-1)
    top = full.max(axis=-1, keepdims=True)
    top = jax.lax.stop_gradient(top) if xp is jnp else top
    e = xp.exp(full - top)
    denom = e.sum(axis=-1)
    out = xp.einsum("hqk,khd->qhd", e[..., :-1], v) / denom.T[..., None]
    return out, (top[..., 0] + xp.log(denom)).T


def test_with_sinks_is_attention_with_a_sink_logit_per_head():
    # Against dense attention with one more logit per head (value zero): forward by the tolerance rule, rows
    # without keys included (out 0, lse the sink); gradients of q, k, v and the sinks against its autodiff.
    rng = np.random.default_rng(14)
    mask = AttnMask([[0, 20], [24, 40]], [[0, 20], [10, 40]], ["causal", "full"], 40, 40)  # rows 20-23: none
    q, k, v = random_qkv(rng, 40, 40, 4, 2, 64)
    sinks = jnp.asarray(rng.standard_normal(4).astype(np.float32))
    visible = mask.to_dense() > 0
    fn = lambda q, k, v, s: mj.with_sinks(*mj.flex_flash_attn(q, k, v, mask=mask), s)
    dense = lambda q, k, v, s: _dense_with_sinks(q, k, v, jnp.asarray(visible), s, jnp)
    got = fn(q, k, v, sinks)
    ref64 = _dense_with_sinks(*(np.asarray(x, np.float64) for x in (q, k, v)), visible,
                              np.asarray(sinks, np.float64), np)
    for name, g, r, l in zip(("out", "lse"), got, ref64, dense(q, k, v, sinks)):
        assert_within_rule(name, g, r, l)
    np.testing.assert_array_equal(np.asarray(got[0][20:24]), 0)
    np.testing.assert_allclose(np.asarray(got[1][20:24]), np.broadcast_to(np.asarray(sinks), (4, 4)), rtol=1e-6)
    w = jnp.asarray(rng.standard_normal(got[0].shape).astype(np.float32))
    loss = lambda f: lambda *a: (f(*a)[0] * w).sum() + (f(*a)[1] * w[..., 0]).sum()
    for a, b in zip(jax.grad(loss(fn), argnums=(0, 1, 2, 3))(q, k, v, sinks),
                    jax.grad(loss(dense), argnums=(0, 1, 2, 3))(q, k, v, sinks)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="^sinks: expected one per head"):
        mj.with_sinks(*got, sinks[:3])
    with pytest.raises(ValueError, match="^sinks: expected floats"):
        mj.with_sinks(*got, np.arange(4))
    with pytest.raises(ValueError, match="^lse: expected out's shape"):
        mj.with_sinks(got[0], got[1][:, :2], sinks)


def test_dq_chain_argument_errors():
    from magi_jax import ffa
    q, k, v = _qkv()
    qr, kr, t = (jnp.asarray(a) for a in (OK_RANGES["q_ranges"], OK_RANGES["k_ranges"], OK_RANGES["attn_type_map"]))
    out, lse = ffa._fwd_call(q, k, v, qr, kr, t, 0.125, 0.0)
    acc = jnp.zeros(q.shape, jnp.float32)
    with pytest.raises(ValueError, match="^dq_in: needs dq_f32"):
        ffa._bwd_call(q, k, v, out, out, lse, lse, qr, kr, t, 0.125, 0.0, False, dq_in=acc)
    with pytest.raises(ValueError, match="^dq_f32: not with deterministic"):
        ffa._bwd_call(q, k, v, out, out, lse, lse, qr, kr, t, 0.125, 0.0, True, dq_f32=True)
    with pytest.raises(Exception, match="dq_in: must be float32 of q's shape"):
        jax.block_until_ready(ffa._bwd_call(q, k, v, out, out, lse, lse, qr, kr, t, 0.125, 0.0, False,
                                            dq_in=acc[:5], dq_f32=True))
    with pytest.raises(ValueError, match=r"^delta: must be float32 \[Tq, Hq\]"):
        ffa._bwd_call(q, k, v, out, out, lse, lse, qr, kr, t, 0.125, 0.0, False, delta=lse[:5])
    with pytest.raises(ValueError, match=r"^delta: must be float32 \[Tq, Hq\]"):
        ffa._bwd_call(q, k, v, out, out, lse, lse, qr, kr, t, 0.125, 0.0, False, delta=lse.astype(jnp.bfloat16))


def test_second_key_source_shape_errors():
    from magi_jax import ffa
    q, k, v = _qkv()
    qr, kr, t = (jnp.asarray(a) for a in (OK_RANGES["q_ranges"], OK_RANGES["k_ranges"], OK_RANGES["attn_type_map"]))
    out, lse = ffa._fwd_call(q, k, v, qr, kr, t, 0.125, 0.0)
    bad = jnp.zeros((5, k.shape[1], 32), k.dtype)  # head dim differs from k's
    with pytest.raises(Exception, match="k2: must be"):
        jax.block_until_ready(ffa._bwd_call(q, k, v, out, out, lse, lse, qr, kr, t, 0.125, 0.0, False, k2=bad, v2=bad))


def test_checkpoint_policy_keeps_the_forward_out_of_the_backward():
    # Under jax.checkpoint the backward pass runs the attention forward again; a policy saving
    # CHECKPOINT_NAMES keeps out and lse instead, with the same gradients.
    mask = masks.varlen_causal([40, 60])
    q, k, v = random_qkv(np.random.default_rng(8), 100, 100, 4, 2, 64)

    def loss(q, k, v):
        out, lse = mj.flex_flash_attn(q, k, v, mask=mask)
        return jnp.sum(jnp.sin(out)) + jnp.sum(lse)

    want, got, calls = remat_grads_and_calls(loss, q, k, v)
    assert calls == (1, 2, 1)
    for a, b in zip(want, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
