"""return_max_logit on a GPU: the sm90 forward's instantiations that track each row's maximum (every head dim,
softcap), the mma.sync forward, and a merging call, against float64; every element written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax import _ffi, ffa, masks
from magi_jax.mask import AttnMask
from tests.conftest import check_max_logit, fill_free_memory, random_qkv

pytestmark = pytest.mark.gpu

# Documents, a window, overlapping slices of all four types, empty rows and unattended keys, ragged edges.
MASK = AttnMask([[50, 400], [420, 777], [0, 30], [300, 700], [600, 650]],
                [[0, 333], [500, 900], [880, 901], [100, 600], [0, 901]], [1, 3, 0, 2, 1], 777, 901)


@pytest.fixture(autouse=True, scope="module")
def _on_gpu():
    assert jax.devices()[0].platform == "gpu", "the default device must be the GPU"
    assert _ffi.HAS_CUDA_LIBRARY, "libmagi_jax_cuda.so was not found beside magi_jax (build with nvcc)"


def check(mask, q, k, v, **kwargs):
    """The jitted flex_flash_attn's max_logit (conftest.check_max_logit)."""
    attend = lambda flag: jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask, return_max_logit=flag,
                                                                     **kwargs))(q, k, v)
    check_max_logit(attend, mask, q, k, kwargs.get("softmax_scale"), kwargs.get("softcap", 0.0))


@pytest.mark.parametrize("d, dv", [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_each_head_dim(d, dv, dtype):
    rng = np.random.default_rng(d + dv)
    q, k, _ = random_qkv(rng, 777, 901, 4, 2, d, dtype)
    v = jnp.asarray(rng.standard_normal((901, 2, dv)).astype(np.float32)).astype(dtype)
    check(MASK, q, k, v)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap_and_scale(d):
    q, k, v = random_qkv(np.random.default_rng(d), 777, 901, 2, 2, d, jnp.bfloat16)
    check(MASK, 3 * q, k, v, softmax_scale=0.2, softcap=4.0)
    check(MASK, 3 * q, k, v, softmax_scale=-0.2)  # the largest logit, not the largest q.k
    check(MASK, 3 * q, k, v, softmax_scale=0.0)


def test_long_walks_and_many_short_tiles():
    # The persistent grid over more tiles than SMs (512): a window over 8k tokens and 8 heads (GQA).
    mask = masks.sliding_window([8192], 1024)
    q, k, v = random_qkv(np.random.default_rng(1), 8192, 8192, 8, 2, 128, jnp.bfloat16)
    check(mask, q, k, v)


@pytest.mark.parametrize("d", [64, 128])
def test_mma_kernel(d, monkeypatch):
    monkeypatch.setenv(_ffi.KERNEL_ENV, "mma")
    q, k, v = random_qkv(np.random.default_rng(2), 777, 901, 4, 2, d, jnp.float16)
    check(MASK, q, k, v)


def test_merging_call_fills_rows_it_does_not_visit():
    # A call merged into a previous one (the distributed stage calls) skips the q blocks without keys in it:
    # its max_logit there is -inf (filled first), its other rows its own keys' maxima.
    q, k, v = random_qkv(np.random.default_rng(3), 777, 901, 4, 2, 128, jnp.bfloat16)
    qr, kr, t = (np.asarray(x) for x in MASK.kernel_args())
    scale = 128 ** -0.5

    def calls(q, k, v):
        first = ffa._fwd_call(q, k, v, qr[:2], kr[:2], t[:2], scale, 0.0, max_logit=True)
        second = ffa._fwd_call(q, k, v, qr[2:], kr[2:], t[2:], scale, 0.0, prev=first[:2], max_logit=True)
        whole = ffa._fwd_call(q, k, v, qr, kr, t, scale, 0.0, max_logit=True)
        return first[2], second[2], whole[2]

    fn = jax.jit(calls)
    jax.block_until_ready(fn(q, k, v))
    for garbage in (np.nan, 3.0e38):
        fill_free_memory(garbage)
        first, second, whole = (np.asarray(x) for x in fn(q, k, v))
        assert not np.isnan(second).any()
        np.testing.assert_array_equal(np.maximum(first, second), whole)
        # Rows [30, 50) are in no slice; rows [700, 777) only in slice 1 (the first call's), and the q block
        # from 768 has no keys in the second call, which does not visit it.
        assert np.isneginf(whole[30:50]).all() and np.isneginf(second[30:50]).all()
        assert np.isneginf(second[700:]).all() and np.isfinite(first[700:]).all()


def test_written_everywhere_whatever_the_garbage():
    q, k, v = random_qkv(np.random.default_rng(4), 777, 901, 4, 4, 64, jnp.float16)
    fn = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=MASK, return_max_logit=True)[2])
    jax.block_until_ready(fn(q, k, v))
    runs = []
    for garbage in (np.nan, 3.0e38, -1.0):
        fill_free_memory(garbage)
        runs.append(np.asarray(fn(q, k, v)))
    for run in runs:
        assert not np.isnan(run).any()
        np.testing.assert_array_equal(run, runs[0])
