"""The CUDA range kernels of magi_jax/comm.py (the group-cast's packing gathers and the group-reduce's
scatter-adds) on one GPU (marked gpu; skipped without a CUDA device), against numpy and against themselves
unpacked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax import comm
from tests.conftest import has_gpu
from tests.test_dist_helpers import assert_packed_range_ops_equal_separate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")]


@pytest.mark.parametrize("features", [(8, 128), (3, 5)])
def test_packed_range_ops_cuda_equal_separate_ones(features):
    """packed=True on the CUDA kernels: the gather's arrays side by side in one buffer, the scatter-adds
    reading one (strided rows; odd features take the unvectorised path): bitwise the separate results."""
    rng = np.random.default_rng(1)
    ranges = np.stack([rng.integers(-5, 900, 300), np.zeros(300, int), rng.integers(-5, 700, 300)], axis=1)
    ranges[:, 1] = ranges[:, 0] + rng.integers(0, 30, 300)
    ranges = ranges.astype(np.int32)
    k, v = (jnp.asarray(rng.standard_normal((900, *features)), jnp.bfloat16) for _ in range(2))
    g = jnp.asarray(rng.standard_normal((700, 2, *features)), jnp.bfloat16)
    init = tuple(jnp.asarray(rng.standard_normal((900, *features)), jnp.bfloat16) for _ in range(2))
    assert_packed_range_ops_equal_separate(k, v, g, init, ranges)


def range_table(kind: str, rng, n_in: int, n_out: int) -> np.ndarray:
    """long: 700 ranges (several shared-memory tiles); short: 120 (one tile), both with overlapping
    destinations; disjoint: 50 ranges, no row in two of them on either side (a packing table: the kernels'
    copy path), in shuffled order. All clipped at both ends, with padding rows."""
    if kind == "disjoint":
        lens = rng.integers(1, 45, 50)
        src = rng.permutation(n_in // 45)[:50] * 45 - 10
        dst = rng.permutation(n_out // 45 + 1)[:50] * 45 - 10
    else:
        n = 700 if kind == "long" else 120
        lens = rng.integers(0, 40, n)
        src = rng.integers(-20, n_in, n)
        dst = rng.integers(-20, n_out, n)
    ranges = np.stack([src, src + lens, dst], axis=1).astype(np.int32)
    ranges[::7] = 0                                                     # padding rows
    return ranges


@pytest.mark.parametrize("table", ["long", "short", "disjoint"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("features", [(8, 128), (3, 5)])     # vectorised rows, and rows of odd length
def test_range_ops_cuda_match_numpy(dtype, features, table):
    """The CUDA range kernels against numpy: tables of each kind (range_table), two arrays, float32 output
    of the scatter-add, in place from an init."""
    rng = np.random.default_rng(0)
    n_in, n_out = 3000, 2500
    ranges = range_table(table, rng, n_in, n_out)
    x = rng.standard_normal((n_in, *features)).astype(np.float32)
    w = rng.standard_normal((n_in, 4)).astype(np.float32)
    xd, wd = (jnp.asarray(a, dtype) for a in (x, w))
    want_x, want_w = (np.zeros((n_out, *a.shape[1:])) for a in (x, w))
    back = np.zeros((n_in, *features))
    x64, w64 = (np.asarray(a, np.float64) for a in (xd, wd))  # the inputs as rounded to dtype, read once
    for s, e, d in ranges:
        for t in range(e - s):
            if 0 <= s + t < n_in and 0 <= d + t < n_out:
                want_x[d + t] += x64[s + t]
                want_w[d + t] += w64[s + t]
    gx, gw = jax.jit(lambda a, b, r: comm.range_gather([a, b], r, n_out))(xd, wd, ranges)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(gx, np.float64), want_x, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(gw, np.float64), want_w, rtol=tol, atol=tol)
    y = jnp.asarray(rng.standard_normal((n_out, *features)), dtype)
    (sx,) = comm.range_scatter_add([y], ranges, n_in, out_dtype=jnp.float32)
    y64 = np.asarray(y, np.float64)
    for s, e, d in ranges:
        for t in range(e - s):
            if 0 <= s + t < n_in and 0 <= d + t < n_out:
                back[s + t] += y64[d + t]
    np.testing.assert_allclose(np.asarray(sx), back, rtol=1e-5, atol=1e-5)
    # In place from an init: covered rows init + sum, the others untouched (bitwise).
    init = jnp.asarray(rng.standard_normal((n_in, *features)), dtype)
    (into,) = jax.jit(lambda y, i: comm.range_scatter_add([y], ranges, init=[i]))(y, init)
    covered = np.zeros(n_in, bool)
    for s, e, d in ranges:
        for t in range(e - s):
            if 0 <= s + t < n_in and 0 <= d + t < n_out:
                covered[s + t] = True
    np.testing.assert_array_equal(np.asarray(into)[~covered], np.asarray(init)[~covered])
    want = np.asarray(init, np.float64) + back
    np.testing.assert_allclose(np.asarray(into, np.float64)[covered], want[covered], rtol=tol, atol=tol * 4)
