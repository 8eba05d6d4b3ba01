"""magi_jax.dot_product_attention (magi_jax/nn.py): jax.nn.dot_product_attention's contract on FFA.

The expected masks are built here cell by cell from jax.nn's definitions (tril, the window's two bounds, the
sequence lengths) and the runs of equal segment ids, independently of the slices the function builds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax import nn as mj_nn
from magi_jax.mask import AttnMask
from tests.conftest import check_against_reference, random_qkv


def expected_mask(T, S, is_causal=False, window=None, q_len=None, kv_len=None, segments=None) -> np.ndarray:
    """One batch element's boolean [T, S] mask by jax.nn's definitions, plus segment runs."""
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    keep = np.ones((T, S), bool)
    if is_causal:
        keep &= j <= i
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        keep &= (i <= j + left) & (i >= j - right)
    if q_len is not None:
        keep &= i < q_len
    if kv_len is not None:
        keep &= j < kv_len
    if segments is not None:
        run = np.cumsum(np.concatenate([[1], segments[1:] != segments[:-1]]))
        keep &= run[:, None] == run[None, :]
    return keep


class DenseMask:
    """The reference's view of a mask (attention_f64 and the low-precision reference call to_dense())."""

    def __init__(self, dense: np.ndarray):
        self.dense = dense.astype(np.int32)

    def to_dense(self) -> np.ndarray:
        return self.dense


def block_diagonal(masks: list[np.ndarray]) -> np.ndarray:
    """A batch's masks as the packed call sees them: element b at rows b T, columns b S."""
    T, S = masks[0].shape
    out = np.zeros((len(masks) * T, len(masks) * S), bool)
    for b, m in enumerate(masks):
        out[b * T:(b + 1) * T, b * S:(b + 1) * S] = m
    return out


def random_segments(rng, T: int, docs: int) -> np.ndarray:
    """Segment ids with `docs` runs (ids reused after a run, as packers number documents per batch)."""
    cuts = np.sort(rng.choice(np.arange(1, T), size=docs - 1, replace=False)) if docs > 1 else []
    ids = np.zeros(T, np.int32)
    for n, c in enumerate(cuts):
        ids[c:] = (n + 1) % 3  # ids 0, 1, 2, 0, ...: runs, not equality, make documents
    return ids


def packed_slices(q_ranges, k_ranges, types, T: int, S: int):
    """mask_slices' per-sequence slices [B, N, ...] as one mask's over the sequences packed end to end
    (queries of sequence b at b T, keys at b S), as the packed call sees them."""
    q_ranges, k_ranges, types = (np.asarray(x) for x in (q_ranges, k_ranges, types))
    B = q_ranges.shape[0]
    q_ranges = q_ranges + (np.arange(B) * T)[:, None, None]
    k_ranges = k_ranges + (np.arange(B) * S)[:, None, None]
    return q_ranges.reshape(-1, 2), k_ranges.reshape(-1, 2), types.reshape(-1)


def built_mask(B, T, S, traced: bool, **kwargs) -> np.ndarray:
    """The dense mask of the slices dot_product_attention passes to FFA (magi_jax.nn.mask_slices), with
    the segment ids and lengths concrete (numpy slices, empty ones left out) or traced (under jit: a fixed
    count, empty ones zeroed)."""
    if not traced:
        q_ranges, k_ranges, types, _ = mj_nn.mask_slices(B, T, S, **kwargs)
    else:
        arrays = {n: kwargs.pop(n) for n in ("query_seq_lengths", "key_value_seq_lengths", "segment_ids")
                  if kwargs.get(n) is not None}
        if "segment_ids" in arrays:
            kwargs["max_segments"] = T
        q_ranges, k_ranges, types, _ = jax.jit(lambda a: mj_nn.mask_slices(B, T, S, **kwargs, **a))(arrays)
    return AttnMask(*packed_slices(q_ranges, k_ranges, types, T, S), B * T, B * S).to_dense()


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_slices_cover_exactly_jax_nn_mask(seed, traced):
    """Every cell once where jax.nn's mask keeps it, nowhere else: causal or not, windows (symmetric, one
    sided, wider than the sequence, zero), sequence lengths, cross attention (T != S), segment runs."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 4))
    T = int(rng.integers(1, 40))
    use_segments = seed % 2 == 0
    S = T if use_segments else int(rng.integers(1, 40))
    is_causal = bool(rng.integers(0, 2))
    window = [None, int(rng.integers(0, 8)), (int(rng.integers(0, 50)), int(rng.integers(0, 6)))][seed % 3]
    q_len = rng.integers(0, T + 1, size=B).astype(np.int32) if seed % 5 == 1 else None
    kv_len = rng.integers(0, S + 1, size=B).astype(np.int32) if seed % 5 in (1, 2) else None
    segs = np.stack([random_segments(rng, T, int(rng.integers(1, min(T, 6) + 1))) for _ in range(B)]) \
        if use_segments else None
    got = built_mask(B, T, S, traced, is_causal=is_causal, local_window_size=window, query_seq_lengths=q_len,
                     key_value_seq_lengths=kv_len, segment_ids=segs)
    want = block_diagonal([expected_mask(T, S, is_causal, window, None if q_len is None else q_len[b],
                                         None if kv_len is None else kv_len[b],
                                         None if segs is None else segs[b]) for b in range(B)])
    np.testing.assert_array_equal(got, want.astype(np.int32))


def test_concrete_masks_give_exactly_the_slices_of_magi_jax_masks():
    """Without traced arguments the call's mask is the one magi_jax.masks builds: one CAUSAL slice per
    sequence or document, the window's pieces, no empty slices."""
    *slices, overflow = mj_nn.mask_slices(8, 4096, 4096, is_causal=True)
    assert overflow is None
    want = mj.masks.varlen_causal([4096] * 8).kernel_args()
    for got, w in zip(packed_slices(*slices, 4096, 4096), want):
        np.testing.assert_array_equal(got, w)
    lens = [300, 77, 500]
    segs = np.repeat(np.arange(3), lens)[None]
    args = mj_nn.mask_slices(1, 877, 877, is_causal=True, local_window_size=(99, 0), segment_ids=segs)[:3]
    got = AttnMask(*packed_slices(*args, 877, 877), 877, 877)
    np.testing.assert_array_equal(got.to_dense(), mj.masks.sliding_window(lens, 100).to_dense())
    assert got.num_slices == 5  # a CAUSAL head and a BI_CAUSAL band per document, the short one CAUSAL only


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_forward_and_grads_against_float64_reference(dtype, heads):
    rng = np.random.default_rng(7)
    B, T, (hq, hkv), d = 2, 96, heads, 64
    segs = np.stack([random_segments(rng, T, 4), random_segments(rng, T, 2)])
    kwargs = dict(is_causal=True, local_window_size=(20, 0), segment_ids=segs, max_segments=6)
    dense = block_diagonal([expected_mask(T, T, True, (20, 0), segments=segs[b]) for b in range(B)])
    q, k, v = random_qkv(rng, B * T, B * T, hq, hkv, d, dtype)

    def fn(q, k, v):
        split = lambda x: x.reshape(B, T, *x.shape[1:])
        out, lse = mj.dot_product_attention(split(q), split(k), split(v), return_residual=True, **kwargs)
        return out.reshape(q.shape), lse.reshape(B * T, hq)

    check_against_reference(fn, DenseMask(dense), q, k, v, rng, grads=dtype == jnp.float32)


def test_agrees_with_jax_nn_where_every_row_attends():
    """The same call through jax.nn (xla) and magi_jax: outputs and residual lse agree in float32."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 40, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 48, 2, 64)), jnp.float32) for _ in range(2))
    lens = jnp.array([33, 40], jnp.int32), jnp.array([48, 29], jnp.int32)
    for kw in (dict(is_causal=True), dict(local_window_size=(5, 3)), dict(query_seq_lengths=lens[0],
                                                                          key_value_seq_lengths=lens[1])):
        want, want_lse = jax.nn.dot_product_attention(q, k, v, implementation="xla", return_residual=True, **kw)
        got, got_lse = mj.dot_product_attention(q, k, v, return_residual=True, **kw)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=str(kw))
        rows = np.isfinite(np.asarray(got_lse))
        rows &= np.arange(40)[None, :, None] < np.asarray(kw.get("query_seq_lengths", [40, 40]))[:, None, None]
        np.testing.assert_allclose(np.asarray(got_lse)[rows], np.asarray(want_lse)[rows], rtol=2e-5, atol=2e-5)


def test_unbatched_inputs_and_grads_match_jax_nn():
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((24, 2, 64)), jnp.float32) for _ in range(3))
    loss = lambda f: lambda q, k, v: (f(q, k, v, is_causal=True) ** 2).sum()
    ref = jax.grad(loss(lambda *a, **kw: jax.nn.dot_product_attention(*a, implementation="xla", **kw)),
                   argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss(mj.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d", [32, 96])
def test_head_dims_other_than_the_kernels_match_jax_nn(d):
    """Head dims the kernels do not have (run zero-padded to 64 or 128): jax.nn's output and gradients."""
    rng = np.random.default_rng(d)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 40, 2, d)), jnp.float32) for _ in range(3))
    loss = lambda f: lambda q, k, v: (f(q, k, v, local_window_size=(7, 2)) ** 2).sum()
    ref = jax.value_and_grad(loss(lambda *a, **kw: jax.nn.dot_product_attention(*a, implementation="xla", **kw)),
                             argnums=(0, 1, 2))(q, k, v)
    got = jax.value_and_grad(loss(mj.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_new_packings_do_not_recompile_and_overflow_gives_nan():
    rng = np.random.default_rng(11)
    B, T = 2, 64
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, 2, 64)), jnp.float32) for _ in range(3))
    traces = []

    @jax.jit
    def step(q, k, v, segs):
        traces.append(1)
        return mj.dot_product_attention(q, k, v, is_causal=True, segment_ids=segs, max_segments=4)

    for docs in (1, 3, 4):
        segs = np.stack([random_segments(rng, T, docs)] * B)
        got = step(q, k, v, segs)
        want = mj.dot_product_attention(q, k, v, is_causal=True, segment_ids=segs)  # exact count, eager
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert len(traces) == 1
    segs = np.stack([random_segments(rng, T, 5), random_segments(rng, T, 2)])
    assert np.isnan(np.asarray(step(q, k, v, segs))).all()
    segs = np.stack([random_segments(rng, T, 2), random_segments(rng, T, 5)])  # the second sequence overflows
    assert np.isnan(np.asarray(step(q, k, v, segs))).all()
    assert len(traces) == 1


def test_inside_shard_map_over_batch_and_heads():
    """Batch over dp, heads over tp (8 host devices), traced segment ids split with the batch: the same output
    and gradients as one unsharded call."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    rng = np.random.default_rng(17)
    B, T = 4, 96
    q = jnp.asarray(rng.standard_normal((B, T, 8, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, 4, 64)), jnp.float32) for _ in range(2))
    segs = np.stack([random_segments(rng, T, d) for d in (1, 3, 4, 2)])
    attend = lambda q, k, v, s: mj.dot_product_attention(q, k, v, is_causal=True, segment_ids=s, max_segments=4)
    spec = P("dp", None, "tp")
    sharded = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec, P("dp")), out_specs=spec)
    loss = lambda f: (lambda q, k, v, s: (f(q, k, v, s) ** 2).sum())
    got = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v, segs)
    want = jax.jit(jax.value_and_grad(loss(attend), argnums=(0, 1, 2)))(q, k, v, segs)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def _qkv4(B=1, T=8, S=8):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, 2, 64)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).standard_normal((B, S, 2, 64)), jnp.float32)
    return x, y, y


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias=jnp.zeros((1, 2, 8, 8))), "bias"),
    (dict(mask=jnp.ones((1, 2, 8, 8), bool)), "mask"),
    (dict(implementation="cudnn"), "implementation"),
    (dict(local_window_size=-1), "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), "local_window_size"),
    (dict(query_seq_lengths=np.array([3, 4])), "query_seq_lengths"),
    (dict(key_value_seq_lengths=np.array([9])), "key_value_seq_lengths"),
    (dict(query_seq_lengths=np.array([9])), "query_seq_lengths: lengths must lie in"),
    (dict(segment_ids=np.zeros((1, 7), np.int32)), "segment_ids"),
    (dict(segment_ids=np.zeros((1, 8), np.float32)), "segment_ids"),
    (dict(segment_ids=np.arange(8, dtype=np.int32)[None], max_segments=3), "max_segments"),
    (dict(segment_ids=np.zeros((1, 8), np.int32), max_segments=0), "max_segments"),
    (dict(max_segments=2), "max_segments"),
    (dict(query_seq_lengths=[3.0]), "query_seq_lengths: expected integers"),
    (dict(scale=float("nan")), "scale: must be finite"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mj.dot_product_attention(*_qkv4(), **kwargs)


def test_seq_lengths_as_lists_or_tuples_as_jax_nn_takes_them():
    q, k, v = _qkv4(B=2)
    want = mj.dot_product_attention(q, k, v, query_seq_lengths=np.array([3, 8], np.int32),
                                    key_value_seq_lengths=np.array([5, 2], np.int32))
    got = mj.dot_product_attention(q, k, v, query_seq_lengths=[3, 8], key_value_seq_lengths=(5, 2))
    np.testing.assert_array_equal(got, want)


def test_traced_scale_is_named_scale():
    with pytest.raises(ValueError, match="scale: must be a Python or NumPy number"):
        jax.jit(lambda s: mj.dot_product_attention(*_qkv4(), scale=s))(0.2)


def test_bad_shapes_name_the_argument():
    q, k, v = _qkv4()
    with pytest.raises(ValueError, match="key"):
        mj.dot_product_attention(q, k[0], v)
    # The caller's names and shapes, not the flattened ones FFA sees.
    with pytest.raises(ValueError, match=r"value: shape \(1, 4, 2, 64\) differs from key's \(1, 8, 2, 64\)"):
        mj.dot_product_attention(q, k, v[:, :4])
    with pytest.raises(ValueError, match=r"key: head_dim 128 differs from query's 64"):
        mj.dot_product_attention(q, jnp.tile(k, 2), jnp.tile(v, 2))
    with pytest.raises(ValueError, match=r"query: head_dim 320 unsupported"):
        mj.dot_product_attention(*(jnp.tile(x, 5) for x in (q, k, v)))
    with pytest.raises(ValueError, match=r"value: dtype bfloat16 differs from query's float32"):
        mj.dot_product_attention(q, k, v.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"key: 2 kv heads do not divide 3 query heads"):
        mj.dot_product_attention(jnp.concatenate([q, q[:, :, :1]], 2), k, v)
    with pytest.raises(ValueError, match="segment_ids: self-attention"):
        mj.dot_product_attention(*_qkv4(S=12), segment_ids=np.zeros((1, 8), np.int32))
    with pytest.raises(ValueError, match="max_segments: required"):
        jax.jit(lambda s: mj.dot_product_attention(q, k, v, segment_ids=s))(np.zeros((1, 8), np.int32))


@pytest.mark.gpu
def test_packed_causal_window_on_gpu():
    """bf16, D 128, GQA, on the sm90 kernels: forward and grads against the float64 reference."""
    rng = np.random.default_rng(13)
    B, T, hq, hkv = 2, 2048, 8, 2
    segs = np.stack([random_segments(rng, T, 7), random_segments(rng, T, 3)])
    dense = block_diagonal([expected_mask(T, T, True, (300, 0), segments=segs[b]) for b in range(B)])
    q, k, v = random_qkv(rng, B * T, B * T, hq, hkv, 128, jnp.bfloat16)

    def fn(q, k, v):
        split = lambda x: x.reshape(B, T, *x.shape[1:])
        out, lse = jax.jit(lambda q, k, v: mj.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=300, segment_ids=segs, max_segments=8,
            return_residual=True))(split(q), split(k), split(v))
        return out.reshape(q.shape), lse.reshape(B * T, hq)

    check_against_reference(fn, DenseMask(dense), q, k, v, rng)


@pytest.mark.gpu
def test_traced_segment_ids_on_gpu():
    """Segment ids as an argument of the jitted call (slices built on the device), forward alone and with
    gradients: the same as with them concrete; an overflow makes the output NaN."""
    rng = np.random.default_rng(19)
    B, T = 2, 4096
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, 8, 128)), jnp.bfloat16) for _ in range(3))
    segs = np.stack([random_segments(rng, T, 6), random_segments(rng, T, 2)])
    attend = lambda q, k, v, s, m: mj.dot_product_attention(q, k, v, is_causal=True, local_window_size=(500, 0),
                                                           segment_ids=s, max_segments=m)
    fwd = jax.jit(attend, static_argnums=4)
    want = np.asarray(attend(q, k, v, segs, None), np.float32)
    np.testing.assert_allclose(np.asarray(fwd(q, k, v, segs, 8), np.float32), want, rtol=1e-2, atol=1e-2)
    grad = jax.jit(jax.grad(lambda q, k, v, s: attend(q, k, v, s, 8).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    ref = jax.grad(lambda q, k, v: attend(q, k, v, segs, None).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    for g, r in zip(grad(q, k, v, segs), ref(q, k, v)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2e-2, atol=2e-2)
    assert np.isnan(np.asarray(fwd(q, k, v, segs, 4), np.float32)).all()
