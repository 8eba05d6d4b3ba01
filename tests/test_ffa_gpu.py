"""The CUDA FFA kernels (cuda/) through flex_flash_attn on a GPU, against the float64 reference.

Every test is marked `gpu` and skipped where no CUDA device is present. Inputs are fresh normal draws; the
tolerance is DESIGN.md section 5 (twice the error of naive attention in the input dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax import _ffi, ffa, masks
from magi_jax.mask import AttnMask
from magi_jax.reference import attention_dense, attention_f64
from tests.conftest import (assert_within_rule, chained_dq_grads, check_against_reference, fill_free_memory,
                            merged_forward, packed_kv_forward, random_qkv, split_key_grads)

pytestmark = pytest.mark.gpu

TYPES = ["full", "causal", "inv_causal", "bi_causal"]


@pytest.fixture(autouse=True, scope="module")
def _on_gpu():
    assert jax.devices()[0].platform == "gpu", "the default device must be the GPU"
    assert _ffi.HAS_CUDA_LIBRARY, "libmagi_jax_cuda.so was not found beside magi_jax (build with nvcc)"


def run_case(mask, hq=2, hkv=2, d=128, dtype=jnp.bfloat16, seed=0, grads=True, dv=None, **kwargs):
    """flex_flash_attn on fresh inputs (q, k of head dim d, v of dv, default d) against float64."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, hq, hkv, d, dtype)
    if dv is not None:
        v = jnp.asarray(rng.standard_normal((*v.shape[:2], dv)).astype(np.float32)).astype(dtype)
    fn = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask, **kwargs))
    check_against_reference(fn, mask, q, k, v, rng, kwargs.get("softmax_scale"), kwargs.get("softcap", 0.0),
                            grads=grads)


@pytest.mark.parametrize("mask_type", TYPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 96, 128, 192])
def test_each_type_alone(mask_type, dtype, d):
    # Unaligned ranges inside larger tensors: partial blocks on every edge. D 96: the sm90 kernels' tiles
    # with their second 64-column chunk half filled; D 192: D 256's plan on three chunks (the backward's
    # second warpgroup at N 64).
    mask = AttnMask([[5, 350]], [[20, 530]], [mask_type], 360, 545)
    run_case(mask, dtype=dtype, d=d, seed=d)


@pytest.mark.parametrize("mask_type", TYPES)
@pytest.mark.parametrize("tq, tk", [(700, 260), (260, 700), (1000, 1000)])
def test_each_type_tq_differs_from_tk(mask_type, tq, tk):
    mask = AttnMask([[0, tq]], [[0, tk]], [mask_type], tq, tk)
    run_case(mask, deterministic=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_query_count_not_a_multiple_of_four(deterministic):
    # Tq not a multiple of 4, and the causal slice's row tiles start at rows that are not either (its first
    # row with keys is 538): lse / delta loaded by a TMA box of float rows starting there faulted
    # (illegal instruction, cuda/NOTES.md), the row tile past Tq must see no keys.
    mask = AttnMask([[0, 701], [300, 701]], [[0, 263], [100, 263]], ["full", "causal"], 701, 263)
    run_case(mask, hq=4, hkv=2, deterministic=deterministic, seed=7)


# Every type, overlapping q ranges, rows covered by several slices.
MIXED_MASK = AttnMask([[0, 300], [120, 540], [180, 210], [450, 600], [0, 600], [200, 600]],
                      [[0, 390], [30, 600], [0, 150], [300, 480], [270, 285], [0, 600]],
                      [0, 1, 2, 3, 1, 0], 600, 600)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_mixed_types_and_overlapping_q_ranges(deterministic, d):
    run_case(MIXED_MASK, hq=4, hkv=2, d=d, deterministic=deterministic, seed=3)


@pytest.mark.parametrize("hq, hkv", [(8, 2), (32, 4), (8, 1)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gqa_and_mqa(hq, hkv, deterministic):
    run_case(masks.varlen_causal([200, 333, 91]), hq=hq, hkv=hkv, deterministic=deterministic, seed=hq)


@pytest.mark.parametrize("name, mask", [
    ("varlen_full", masks.varlen_full([130, 257, 70])),
    ("sliding_window", masks.sliding_window([300, 500], 100)),
    ("sliding_window_symmetric", masks.sliding_window([300, 500], 100, causal=False)),
    ("block_causal", masks.block_causal([400, 300], 128)),
    ("shared_question", masks.shared_question([(100, [80, 150]), (60, [200])])),
    ("prefix_lm", masks.prefix_lm([300, 250], [100, 30])),
    ("global_sliding_window", masks.global_sliding_window([400, 300], 64, 16)),
    ("causal_blockwise", masks.causal_blockwise([200, 150, 300])),
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mask_families(name, mask, dtype):
    run_case(mask, hq=4, hkv=1, dtype=dtype, seed=len(name))


def test_vmap_packs_the_batch_on_the_gpu():
    # A vmapped batch runs as one packed call: each element's out and lse bitwise those of its own call (a
    # row's result depends only on its own walk); an element's gradients, through the packed backward, within
    # the rule of the float64 reference.
    rng = np.random.default_rng(21)
    mask = masks.sliding_window([300, 212], 100)
    batch = [random_qkv(rng, 512, 512, 4, 2, 128, jnp.bfloat16) for _ in range(3)]
    fn = lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask)
    got = jax.jit(jax.vmap(fn))(*(jnp.stack(x) for x in zip(*batch)))
    for b, (q, k, v) in enumerate(batch):
        for a, w in zip(got, jax.jit(fn)(q, k, v)):
            np.testing.assert_array_equal(np.asarray(a[b], np.float32), np.asarray(w, np.float32))

    def first_of_batch(q, k, v):  # the others held fixed
        out, lse = jax.vmap(fn)(*(jnp.stack([x, *(e[i] for e in batch[1:])]) for i, x in enumerate((q, k, v))))
        return out[0], lse[0]
    check_against_reference(jax.jit(first_of_batch), mask, *batch[0], rng)


def test_exported_call_gives_the_direct_calls_bits():
    # jax.export with mj.EXPORT_DISABLED_CHECKS, lowered for both platforms: on the GPU the exported forward
    # and deterministic gradients are bitwise those of the direct call.
    mask = masks.varlen_causal([300, 212])
    q, k, v = random_qkv(np.random.default_rng(22), 512, 512, 4, 2, 128, jnp.bfloat16)

    def loss(q, k, v):
        out, lse = mj.flex_flash_attn(q, k, v, mask=mask, deterministic=True)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    exported = jax.export.export(fn, disabled_checks=mj.EXPORT_DISABLED_CHECKS, platforms=("cpu", "cuda"))
    for got, want in zip(jax.tree.leaves(exported(q, k, v).call(q, k, v)), jax.tree.leaves(fn(q, k, v))):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("d", [64, 96, 128])
def test_softcap_and_scale(d):
    run_case(masks.sliding_window([300, 400], 150), d=d, softcap=5.0, softmax_scale=0.2)
    run_case(masks.varlen_causal([333, 200]), d=d, softcap=2.0, deterministic=True, seed=1)


@pytest.mark.parametrize("scale", [-0.5, 0.0])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_negative_scale_and_zero(dtype, scale):
    # -0.5: logits spread by ~+-90, whose exponentials against each row's smallest logit (a negative scale's
    # sign left in the kernels' softmax, which takes the maximum of q.k) would overflow, fp16's P and fp32
    # alike. 0: every logit 0, the mean of the keys' v (a zero scale left in the kernels would make their
    # masked cells' -inf NaN). ffa.positive_scale.
    mask = masks.sliding_window([300, 400], 150)
    rng = np.random.default_rng(31)
    q, k, v = random_qkv(rng, 700, 700, 2, 2, 128, dtype)
    fn = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask, softmax_scale=scale))
    check_against_reference(fn, mask, 4 * q, k, v, rng, scale)


def test_rows_and_keys_with_nothing():
    # Rows 0-99 and 300-379 are in no slice; the causal slice with Lk < Lq leaves its first rows empty;
    # keys 200-519 are attended by nobody (including whole 128-key blocks).
    mask = AttnMask([[100, 300], [380, 700]], [[0, 200], [600, 700]], [0, 1], 700, 700)
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 700, 700, 4, 2, 128, jnp.bfloat16)
    for deterministic in (False, True):
        f = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask, deterministic=deterministic))
        (out, lse), vjp = jax.vjp(f, q, k, v)
        dense = mask.to_dense()
        empty, unattended = dense.sum(1) == 0, dense.sum(0) == 0
        assert empty.sum() == 100 + 80 + 220
        np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)
        assert np.isneginf(np.asarray(lse)[empty]).all() and np.isfinite(np.asarray(lse)[~empty]).all()
        dout = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
        dq, dk, dv = vjp((dout, jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)))
        assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in (dq, dk, dv))
        np.testing.assert_array_equal(np.asarray(dq, np.float32)[empty], 0.0)
        np.testing.assert_array_equal(np.asarray(dk, np.float32)[unattended], 0.0)
        np.testing.assert_array_equal(np.asarray(dv, np.float32)[unattended], 0.0)
        check_against_reference(f, mask, q, k, v, rng)


def test_empty_mask():
    mask = AttnMask(np.zeros((0, 2), int), np.zeros((0, 2), int), [], 200, 300)
    run_case(mask)


def random_mask(rng, n, tq, tk, max_len=None):
    def ranges(total):
        if max_len is None:
            a = rng.integers(0, total + 1, size=(n, 2))
            return np.sort(a, axis=1)
        start = rng.integers(0, total, size=n)
        return np.stack([start, np.minimum(total, start + rng.integers(1, max_len, size=n))], axis=1)
    return AttnMask(ranges(tq), ranges(tk), rng.integers(0, 4, size=n), tq, tk)


@pytest.mark.parametrize("seed", range(6))
def test_random_masks(seed):
    rng = np.random.default_rng(100 + seed)
    tq, tk = (int(x) for x in rng.integers(1, 900, size=2))
    mask = random_mask(rng, int(rng.integers(1, 40)), tq, tk)
    hq, hkv = [(2, 2), (4, 1), (6, 3)][seed % 3]
    run_case(mask, hq=hq, hkv=hkv, d=[64, 128][seed % 2], deterministic=bool(seed % 2), seed=seed)


@pytest.mark.parametrize("tq, tk", [(2048, 2048), (1500, 2600)])
def test_thousand_slice_random_masks(tq, tk):
    rng = np.random.default_rng(tq + tk)
    mask = random_mask(rng, 1000, tq, tk, max_len=300)
    run_case(mask, hq=2, hkv=1, deterministic=tq == tk, seed=tq)


def test_scan_path_when_slice_lists_overflow(monkeypatch):
    # A capacity of one id forces every kernel to scan the slice array instead of its block's list.
    rng = np.random.default_rng(9)
    mask = random_mask(rng, 200, 900, 700, max_len=250)
    monkeypatch.setenv("MAGI_JAX_CUDA_LIST_CAPACITY", "0")
    for deterministic in (False, True):
        run_case(mask, hq=4, hkv=2, deterministic=deterministic, seed=9)


@pytest.mark.parametrize("capacity", [None, "0"])
def test_slice_lists_filled_by_several_ctas(capacity, monkeypatch):
    # 2100 rows (17 q blocks) and 2700 keys (22 k blocks): the lists' fill spans two CTAs of 16 blocks
    # (cuda/block_lists.h kListWarps), the second summing the counts of the first for its offsets; listed,
    # then scanned (capacity 0).
    rng = np.random.default_rng(11)
    mask = random_mask(rng, 300, 2100, 2700, max_len=400)
    if capacity is not None:
        monkeypatch.setenv("MAGI_JAX_CUDA_LIST_CAPACITY", capacity)
    run_case(mask, hq=2, hkv=1, deterministic=capacity is None, seed=11)


def test_head_dim_256_scan_path_when_slice_lists_overflow(monkeypatch):
    # The same at head dim 256 (its own forward and split-D backward, deterministic=False only).
    rng = np.random.default_rng(10)
    mask = random_mask(rng, 200, 900, 700, max_len=250)
    monkeypatch.setenv("MAGI_JAX_CUDA_LIST_CAPACITY", "0")
    run_case(mask, hq=4, hkv=2, d=256, seed=10)


def _grads_fn(mask, deterministic):
    def f(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask,
                                                                     deterministic=deterministic), q, k, v)
        return (out, lse, *vjp((dout, dlse)))
    return jax.jit(f)


def test_deterministic_backward_is_bitwise_repeatable():
    rng = np.random.default_rng(4)
    mask = random_mask(rng, 300, 1500, 1500, max_len=400)
    q, k, v = random_qkv(rng, 1500, 1500, 8, 2, 128, jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:2]), jnp.float32)
    f = _grads_fn(mask, True)
    first = [np.asarray(x) for x in f(q, k, v, dout, dlse)]
    for _ in range(3):
        again = f(q, k, v, dout, dlse)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("deterministic, d", [(False, 64), (True, 64), (False, 96)])
def test_outputs_written_everywhere_whatever_the_garbage(deterministic, d):
    # Empty rows, unattended keys and ragged edges, run on NaN garbage and on huge-number garbage (D 96: the
    # tiles' half-filled second chunk, TMA storing up to column 96).
    mask = AttnMask([[50, 400], [420, 777], [0, 30]], [[0, 333], [500, 900], [880, 901]], [1, 3, 0], 777, 901)
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 777, 901, 4, 4, d, jnp.float16)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float16)
    dlse = jnp.asarray(rng.standard_normal(q.shape[:2]), jnp.float32)
    f = _grads_fn(mask, deterministic)
    jax.block_until_ready(f(q, k, v, dout, dlse))  # compiled before the memory is poisoned
    runs = []
    for garbage in (np.nan, 3.0e38, -1.0):
        fill_free_memory(garbage)
        runs.append([np.asarray(x, np.float32) for x in f(q, k, v, dout, dlse)])
    for run in runs:
        for name, x in zip(("out", "lse", "dq", "dk", "dv"), run):
            assert not np.isnan(x).any(), f"{name}: NaN (an element was not written)"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs[0], runs[1]):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2, err_msg=name)
    ref = attention_f64(q, k, v, mask, dout=dout, dlse=dlse)
    lp_fn = lambda q, k, v: attention_dense(q, k, v, mask.to_dense())
    lp, lp_vjp = jax.vjp(lp_fn, q, k, v)
    for name, got, r, l in zip(("out", "lse", "dq", "dk", "dv"), runs[1], ref, (*lp, *lp_vjp((dout, dlse)))):
        assert_within_rule(name, got, r, l)


def doc_lengths(total, seed, mean=4096, lo=256):
    """Document lengths as the peers' measurements: exponential with this mean, at least `lo`."""
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < total:
        n = int(max(lo, rng.exponential(mean)))
        lens.append(min(n, total - sum(lens)))
    return lens


def test_one_million_tokens_varlen_causal_forward_backward():
    total, heads, d = 1 << 20, 8, 128
    lens = doc_lengths(total, seed=1)
    mask = masks.varlen_causal(lens)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(kk, (total, heads, d), jnp.bfloat16) for kk in keys)
    f = _grads_fn(mask, False)
    out, lse, dq, dk, dv = f(q, k, v, dout, jnp.zeros((total, heads), jnp.float32))
    jax.block_until_ready(dv)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use", 0)
    print(f"\n1M-token varlen causal ({len(lens)} documents, {heads} heads, D {d}) fwd+bwd: peak GPU memory "
          f"{peak / 2**30:.2f} GiB (inputs+outputs {9 * total * heads * d * 2 / 2**30:.1f} GiB)")
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert bool(jnp.isfinite(x.astype(jnp.float32)).all()), f"{name}: not finite"
    assert bool(jnp.isfinite(lse).all())
    # Documents are independent: check the last one of 512 to 1024 tokens (a billion elements into the
    # tensors) against float64 (numpy's einsum makes larger ones slow).
    i = max(j for j, n in enumerate(lens) if 512 <= n <= 1024)
    s, n = sum(lens[:i]), lens[i]
    sub = masks.varlen_causal([n])
    part = lambda x: x[s:s + n]
    zeros = jnp.zeros((n, heads), jnp.float32)
    ref = attention_f64(part(q), part(k), part(v), sub, dout=part(dout), dlse=zeros)
    lp, lp_vjp = jax.vjp(lambda a, b, c: attention_dense(a, b, c, sub.to_dense()), part(q), part(k), part(v))
    for name, got, r, l in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref,
                               (*lp, *lp_vjp((part(dout), zeros)))):
        assert_within_rule(name, part(got), r, l)


@pytest.mark.parametrize("d, dv", [(80, 80), (192, 128), (32, 64)])
def test_head_dims_other_than_the_kernels(d, dv):
    # Zero-padded to 96, 192 (v: MLA's 192 / 128) and 64 (ffa.pad_head_dims), v's head dim apart: bf16 against
    # float64, gradients included, on whichever kernels the padded size takes.
    mask = masks.varlen_causal([700, 333, 91])
    rng = np.random.default_rng(d + dv)
    q, k, _ = random_qkv(rng, 1124, 1124, 4, 2, d, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1124, 2, dv)).astype(np.float32)).astype(jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask))
    assert fn(q, k, v)[0].shape == (1124, 4, dv)
    check_against_reference(fn, mask, q, k, v, rng)


# --------------------------------------------------------------------------------- MLA: q, k 192, v 128
# Both passes take v at its own 128 (ffa.V_HEAD_DIMS): the forward's FwdSm90Tile<192, 128> (V tiles, O and P V
# of 128 columns, an O staging buffer of its own, the intra-warpgroup overlap with one Q buffer), the
# backward's BwdSm90Tile<192, 128> (dP^T over 128, dV's 128 columns in warpgroup 0).

@pytest.mark.parametrize("mask_type", TYPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mla_head_dims_each_type_alone(mask_type, dtype):
    mask = AttnMask([[5, 350]], [[20, 530]], [mask_type], 360, 545)
    run_case(mask, dtype=dtype, d=192, dv=128, seed=19)


def test_mla_head_dims_mixed_types_gqa_softcap():
    run_case(MIXED_MASK, hq=8, hkv=2, d=192, dv=128, softcap=5.0, seed=20)


def test_mla_head_dims_persistent_grid_many_short_walks():
    # 1024 tiles of about two steps (tests/test_ffa_sm90_gpu.py test_persistent_grid_many_short_walks): the
    # V stages' own byte count on every release.
    run_case(masks.sliding_window([3000, 2500, 2692], 128), hq=16, hkv=4, d=192, dv=128, grads=False, seed=21)


def test_forward_refuses_other_v_head_dims_by_name():
    # The CUDA forward takes v at q's head dim or 192 / 128; flex_flash_attn pads every other pair first.
    q, k, v = random_qkv(np.random.default_rng(23), 256, 256, 2, 2, 128, jnp.bfloat16)
    args = tuple(jnp.asarray(a) for a in masks.causal(256).kernel_args())
    with pytest.raises(Exception, match="v: head_dim 64 differs from q's 128"):
        jax.block_until_ready(ffa._fwd_call(q, k, v[..., :64], *args, 0.1, 0.0))
    out, lse = ffa._fwd_call(q, k, v, *args, 0.1, 0.0)
    with pytest.raises(Exception, match="v: head_dim 64 differs from q's 128; the CUDA backward"):
        jax.block_until_ready(ffa._bwd_call(q, k, v[..., :64], out[..., :64], out[..., :64], lse, lse, *args, 0.1,
                                            0.0, False))


# ------------------------------------------------------------------------------------------ head dim 256
# cuda/handlers.cu: D 256 always runs the sm90 forward (TMA + wgmma, key tiles of 80, no intra-warpgroup
# overlap) and the sm90 backward (BwdSm90Tile<256>: 64-key CTAs, the two consumer warpgroups split D, dQ by
# TMA reduce-add), whatever MAGI_JAX_FFA_KERNEL says. deterministic=True at D 256 is refused with an error
# naming head_dim. grads=False: out and lse against the float64 reference; the test_head_dim_256_backward_*
# tests check dq, dk, dv too. Collected again, unchanged, under MAGI_JAX_FFA_KERNEL=sm90 by
# tests/test_ffa_sm90_gpu.py.

@pytest.mark.parametrize("mask_type", TYPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_256_each_type_alone(mask_type, dtype):
    # Unaligned ranges inside larger tensors: partial q blocks and key tiles of 80 on every edge.
    mask = AttnMask([[5, 350]], [[20, 530]], [mask_type], 360, 545)
    run_case(mask, d=256, dtype=dtype, seed=256, grads=False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_256_varlen_causal_documents(dtype):
    # Several documents, q blocks straddling document edges; 8 heads x 23 q blocks = 184 tiles: more than the
    # SMs, so CTAs take second tiles (the Q buffer, which also stages O at D 256, is reused).
    run_case(masks.varlen_causal([1500, 333, 91, 700, 300]), hq=8, hkv=8, d=256, dtype=dtype, seed=7,
             grads=False)


@pytest.mark.parametrize("hq, hkv", [(8, 2), (8, 1)])
def test_head_dim_256_gqa_and_mqa(hq, hkv):
    run_case(masks.varlen_causal([200, 333, 91]), hq=hq, hkv=hkv, d=256, seed=hq + hkv, grads=False)


def test_head_dim_256_mixed_types_and_overlapping_q_ranges():
    run_case(MIXED_MASK, hq=4, hkv=2, d=256, seed=3, grads=False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_256_softcap_and_scale(dtype):
    run_case(masks.sliding_window([300, 400], 150), d=256, dtype=dtype, softcap=5.0, softmax_scale=0.2,
             grads=False)
    run_case(masks.varlen_causal([333, 200]), d=256, dtype=dtype, softcap=2.0, seed=1, grads=False)


@pytest.mark.parametrize("tq, tk", [(700, 260), (260, 700)])
def test_head_dim_256_tq_differs_from_tk(tq, tk):
    run_case(AttnMask([[0, tq]], [[0, tk]], ["causal"], tq, tk), d=256, grads=False)


def test_head_dim_256_rows_and_keys_with_nothing():
    # Empty rows (O = 0, lse = -inf, checked by the rule), keys nobody attends, and an empty mask.
    mask = AttnMask([[100, 300], [380, 700]], [[0, 200], [600, 700]], [0, 1], 700, 700)
    run_case(mask, hq=4, hkv=2, d=256, seed=5, grads=False)
    run_case(AttnMask(np.zeros((0, 2), int), np.zeros((0, 2), int), [], 200, 300), d=256, grads=False)


# Gradients (dq, dk, dv) against the float64 reference. Sizes keep the reference small; they cover partial
# 64-key CTAs (545 keys = 8 x 64 + 33), two CTAs sharing one k block's slice list, rows past the end.
@pytest.mark.parametrize("mask_type", TYPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_256_backward_each_type_alone(mask_type, dtype):
    mask = AttnMask([[5, 350]], [[20, 530]], [mask_type], 360, 545)
    run_case(mask, d=256, dtype=dtype, seed=257)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_256_backward_varlen_causal_documents(dtype):
    run_case(masks.varlen_causal([700, 333, 91, 300]), hq=4, hkv=4, d=256, dtype=dtype, seed=8)


@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 1)])
def test_head_dim_256_backward_gqa_and_mqa(hq, hkv):
    run_case(masks.varlen_causal([200, 333, 91]), hq=hq, hkv=hkv, d=256, seed=hq + hkv + 1)


def test_head_dim_256_backward_mixed_types_and_overlapping_q_ranges():
    run_case(MIXED_MASK, hq=4, hkv=2, d=256, seed=4)


@pytest.mark.parametrize("name, mask", [
    ("sliding_window", masks.sliding_window([300, 500], 100)),
    ("block_causal", masks.block_causal([400, 300], 128)),
    ("shared_question", masks.shared_question([(100, [80, 150]), (60, [200])])),
])
def test_head_dim_256_backward_mask_families(name, mask):
    run_case(mask, d=256, seed=9)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_256_backward_softcap_and_scale(dtype):
    run_case(masks.sliding_window([300, 400], 150), d=256, dtype=dtype, softcap=5.0, softmax_scale=0.2, seed=2)
    run_case(masks.varlen_causal([333, 200]), d=256, dtype=dtype, softcap=2.0, seed=1)


@pytest.mark.parametrize("tq, tk", [(700, 260), (260, 700)])
def test_head_dim_256_backward_tq_differs_from_tk(tq, tk):
    run_case(AttnMask([[0, tq]], [[0, tk]], ["causal"], tq, tk), d=256)


def test_head_dim_256_backward_rows_and_keys_with_nothing():
    # Keys no row attends (dk = dv = 0 there), rows attending nothing (dq = 0), an empty mask.
    mask = AttnMask([[0, 200], [400, 500]], [[100, 300], [0, 50]], [0, 1], 600, 700)
    run_case(mask, hq=4, hkv=2, d=256, seed=6)
    run_case(AttnMask(np.zeros((0, 2), int), np.zeros((0, 2), int), [], 200, 300), d=256)


def test_head_dim_96_deterministic_backward_call_is_refused_by_name():
    # deterministic=True has no D 96 kernel (flex_flash_attn pads it to 128): a direct call is refused with an
    # error naming head_dim, before any kernel runs.
    mask = masks.varlen_causal([300, 200])
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 500, 500, 2, 2, 96, jnp.bfloat16)
    out, lse = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask))(q, k, v)
    qr, kr, types = mask.kernel_args()
    with pytest.raises(Exception, match="head_dim 96 has no deterministic CUDA backward"):
        jax.block_until_ready(ffa._bwd_call(q, k, v, out, out, lse, jnp.zeros_like(lse), qr, kr, types,
                                            96 ** -0.5, 0.0, True))


@pytest.mark.parametrize("d, hq, hkv, deterministic", [(96, 8, 2, False), (96, 8, 1, False), (96, 8, 2, True),
                                                       (192, 8, 2, False), (192, 8, 1, False)])
def test_head_dims_96_and_192_gqa_and_mqa(d, hq, hkv, deterministic):
    # D 96's and 192's own backward under GQA / MQA (dK / dV summed over each group's CTA walks), and
    # deterministic=True run at 128.
    run_case(masks.varlen_causal([200, 333, 91]), hq=hq, hkv=hkv, d=d, deterministic=deterministic, seed=hq + hkv)


@pytest.mark.parametrize("d", [256, 192])
def test_head_dim_256_deterministic_backward_is_refused_by_name(d):
    # deterministic=True has no D 256 kernel (the mma.sync dq kernel is sized for 64 and 128): a clear error,
    # also where a head dim above 128 runs padded to 256, and deterministic=False still runs in the same process.
    mask = masks.varlen_causal([300, 200])
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 500, 500, 2, 2, d, jnp.bfloat16)
    qr, kr, types = mask.kernel_args()

    def loss(q, k, v, deterministic):
        out, _ = mj.flex_flash_attn(q, k, v, qr, kr, types, deterministic=deterministic)
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    with pytest.raises(Exception, match="head_dim 256"):
        jax.block_until_ready(grad(q, k, v, True))
    dq, dk, dv = jax.block_until_ready(grad(q, k, v, False))
    for g in (dq, dk, dv):
        assert bool(jnp.isfinite(g.astype(jnp.float32)).all())


@pytest.mark.parametrize("d, split, deterministic, packed", [
    (128, 256, False, False),   # split on the sm90 kernel's 128-key CTAs: both sources read and written in place
    (64, 128, False, False),
    (128, 200, False, False),   # not on a CTA boundary: the handler's concat fallback
    (128, 256, True, False),    # deterministic: the concat fallback (the mma.sync dq kernel reads K, V)
    (256, 192, False, False),   # head dim 256: 64-key CTAs
    (256, 100, False, False),
    (128, 256, False, True),    # packed second source (K, V and dK, dV side by side): maps at a row stride 2 Hkv D
    (128, 0, False, True),      # every key the second source's: no first-source maps (a staged stage call)
    (128, 200, False, True),    # packed through the concat fallback (strided copies in and out)
    (128, 256, True, True),
    (256, 192, False, True),
    (96, 256, False, False),    # head dim 96 (D 128's CTAs on half-filled chunks), for the distributed layer
    (96, 256, False, True),
    (96, 200, False, True),
    (192, 192, False, False),   # head dim 192 (D 256's 64-key CTAs on three chunks)
    (192, 100, False, True),
])
def test_backward_with_two_key_sources_matches_one(d, split, deterministic, packed):
    # The distributed backward's path (ffa._bwd_call with k2, v2) against the same keys in one array.
    rng = np.random.default_rng(d + split)
    mask = masks.varlen_causal([300, 250, 150])  # 700 keys: sources of 256 + 444 etc.
    q, k, v = random_qkv(rng, 700, 700, 4, 2, d, jnp.bfloat16)
    one, two = split_key_grads(mask, q, k, v, split, deterministic, packed)
    for name, a, b in zip(["dq", "dk", "dv"], one, two):
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
        assert rel < (1e-6 if deterministic else 1e-3), (name, rel)   # atomic dq: summation order only


@pytest.mark.parametrize("split", [256, 0, 200])
def test_mla_backward_with_a_packed_second_source_matches_one(split):
    # v 128 beside q, k 192 (the distributed layer's MLA): the packed source's V heads are 192 wide, the
    # kernel reading and writing their first 128 columns; split 0: a stage call; 200: the concat fallback's
    # strided copies in and out.
    rng = np.random.default_rng(split + 1)
    mask = masks.varlen_causal([300, 250, 150])
    q, k, v = random_qkv(rng, 700, 700, 4, 2, 192, jnp.bfloat16)
    one, two = split_key_grads(mask, q, k, v[..., :128], split, packed=True)
    assert one[2].shape == (700, 2, 128)
    for name, a, b in zip(["dq", "dk", "dv"], one, two):
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
        assert rel < 1e-3, (name, rel)   # atomic dq: summation order only


@pytest.mark.parametrize("shared_delta", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_backward_chained_dq_matches_one_call(d, shared_delta):
    # The staged distributed backward: calls over disjoint slice sets (remote keys, then local ones), dQ
    # accumulated in place in one float32 buffer (aliased from call to call) and rounded once at the end;
    # shared_delta: the calls take one delta (copied into their scratch) instead of computing it.
    rng = np.random.default_rng(d)
    mask = masks.varlen_causal([300, 250, 150])
    q, k, v = random_qkv(rng, 700, 700, 4, 2, d, jnp.bfloat16)
    one, two = chained_dq_grads(mask, q, k, v, cut=2, shared_delta=shared_delta)
    for name, a, b in zip(["dq", "dk", "dv"], one, two):
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
        assert rel < 1e-2, (name, rel)   # dk, dv: two bf16 partials added; dq: the atomics' order only


def two_call_case(d: int, seed: int):
    """Three documents for two forward calls over slices [:2] and [2:] (the second has empty q blocks)."""
    mask = masks.varlen_causal([300, 250, 150])
    return mask, random_qkv(np.random.default_rng(seed), 700, 700, 4, 2, d, jnp.bfloat16)


@pytest.mark.parametrize("d, dv", [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)])
def test_forward_with_k_and_v_packed_gives_the_same_bits(d, dv):
    # A distributed stage call reads the receive buffer as is, K and V side by side per row (the sm90 maps
    # and the mma.sync loads at a row stride of 2 Hkv D; MLA's v 128 the first columns of V heads 192 wide):
    # the same kernel on the same values.
    mask, (q, k, v) = two_call_case(d, seed=d + 2)
    separate, packed = packed_kv_forward(mask, q, k, v[..., :dv], cut=2)
    assert packed[0].shape == (700, 4, dv)
    for a, b in zip(separate, packed):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_merged_forward_leaves_rows_without_keys_as_they_were(d):
    # The merging call's q blocks without keys (rows [0, 512) here: the first four of 128 rows; its slice
    # starts at row 550) are not visited at all: they keep the first call's out and lse bit for bit.
    mask, (q, k, v) = two_call_case(d, seed=d + 3)
    first, two = merged_forward(mask, q, k, v, cut=2, first_too=True)[1:]
    for a, b in zip(first, two):
        np.testing.assert_array_equal(a[:512].view(np.uint8), b[:512].view(np.uint8))


@pytest.mark.parametrize("d, dv", [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256)])
def test_forward_merged_into_a_previous_call_matches_one_call(d, dv):
    # The distributed forward's stage calls: the kernel merges its part into the out and lse so far, in place
    # (this file runs on the default sm90 kernels, tests/test_ffa_mma_gpu.py on mma.sync); 192 / 128: MLA's
    # forward with v at its own head dim.
    mask, (q, k, v) = two_call_case(d, seed=d + 1)
    v = v[..., :dv]
    one, two = merged_forward(mask, q, k, v, cut=2)
    assert one[0].shape == (700, 4, dv)
    for name, a, b in zip(["out", "lse"], one, two):
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
        assert rel < 1e-2, (name, rel)   # out: rounded to bf16 once more in between
