"""The sm90 forward (TMA + wgmma, cuda/flash_fwd_sm90_kernel.h) through the whole GPU suite.

MAGI_JAX_FFA_KERNEL=sm90 selects it; the handler reads the variable at every call, so an autouse fixture
setting it runs every test of tests/test_ffa_gpu.py (imported below) on the new forward (the backward is the
mma.sync one, fed by the new forward's out and lse). The tests added here exercise what is new: the
persistent grid with many more tiles than SMs, the longest-first order, bitwise reproducibility of the
forward (one CTA per tile, a fixed walk), and agreement with the mma.sync forward.

Run first, alone, with a hard timeout (a barrier bug hangs rather than fails):
    timeout 120 python -m pytest -q -x tests/test_ffa_sm90_gpu.py -k smoke
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax import masks
from magi_jax.mask import AttnMask
from tests.conftest import random_qkv
from tests.test_ffa_gpu import *  # noqa: F401,F403  (every GPU test, collected again under the sm90 forward)
from tests.test_ffa_gpu import _on_gpu, run_case  # noqa: F401  (the module fixture; star imports skip _names)

pytestmark = pytest.mark.gpu

ENV = "MAGI_JAX_FFA_KERNEL"


@pytest.fixture(autouse=True)
def _sm90_forward(monkeypatch):
    monkeypatch.setenv(ENV, "sm90")


def _forward(mask, q, k, v, kernel):
    """out, lse of the forward with the kernel named (None: the default mma.sync one)."""
    import os
    old = os.environ.pop(ENV, None)
    if kernel is not None:
        os.environ[ENV] = kernel
    try:
        qr, kr, types = mask.kernel_args()
        f = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, qr, kr, types))
        out, lse = f(q, k, v)
        return np.asarray(out, np.float32), np.asarray(lse)
    finally:
        os.environ.pop(ENV, None)
        if old is not None:
            os.environ[ENV] = old


@pytest.mark.parametrize("d", [64, 128])
def test_smoke_sm90_forward_matches_mma_sync(d):
    # Two slices (one causal), unaligned edges, GQA: one tile per (q block, head), fewer tiles than SMs.
    mask = AttnMask([[0, 300], [100, 333]], [[0, 300], [250, 400]], [1, 0], 333, 400)
    rng = np.random.default_rng(d)
    q, k, v = random_qkv(rng, 333, 400, 4, 2, d, jnp.bfloat16)
    out, lse = _forward(mask, q, k, v, "sm90")
    ref_out, ref_lse = _forward(mask, q, k, v, None)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=2e-3)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=2e-2)


@pytest.mark.parametrize("sched", ["lpt", "natural", "grid"])
def test_persistent_grid_many_tiles_varlen_causal(sched, monkeypatch):
    # 16k tokens x 8 heads = 1024 tiles over ~132 CTAs, documents of very different lengths (uneven work);
    # MAGI_JAX_SM90_SCHED: longest first (default), last-first, one CTA per tile (not persistent).
    monkeypatch.setenv("MAGI_JAX_SM90_SCHED", sched)
    lens = [8000, 300, 4000, 2048, 1000, 1036]
    mask = masks.varlen_causal(lens)
    run_case(mask, hq=8, hkv=2, d=128, grads=False, seed=11)


def test_forward_is_bitwise_repeatable():
    rng = np.random.default_rng(12)
    mask = masks.sliding_window([5000, 3000, 700], 512)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 8, 8, 128, jnp.bfloat16)
    first = _forward(mask, q, k, v, "sm90")
    for _ in range(2):
        again = _forward(mask, q, k, v, "sm90")
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_agrees_with_mma_sync_forward_on_a_long_mask(dtype):
    lens = [6000, 2192]
    mask = masks.varlen_causal(lens)
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, 8192, 8192, 4, 4, 128, dtype)
    out, lse = _forward(mask, q, k, v, "sm90")
    ref_out, ref_lse = _forward(mask, q, k, v, None)
    # Both are fp32-accumulated flash attention over the same tiles: bf16/fp16 rounding of P differs only
    # through the order of the key tiles' max updates, far inside the dtype's resolution.
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-3)
    rel = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert rel < 1e-2, rel
