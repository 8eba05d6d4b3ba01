"""Shared test helpers: the tolerance rule of DESIGN.md section 5, random inputs, the gpu marker."""

from __future__ import annotations

import os

# Eight host devices for the shard_map and distributed tests; set before jax starts its CPU backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.mask import AttnMask
from magi_jax.reference import attention_dense, attention_f64


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def random_qkv(rng: np.random.Generator, tq: int, tk: int, hq: int, hkv: int, d: int, dtype=jnp.float32):
    """Fresh normal inputs in the given dtype (never zeros or ones)."""
    shapes = ((tq, hq, d), (tk, hkv, d), (tk, hkv, d))
    return tuple(jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype) for s in shapes)


def _norm(x) -> float:
    x = np.asarray(x, np.float64)
    return float(np.linalg.norm(np.where(np.isfinite(x), x, 0.0)))


def assert_within_rule(name: str, got, ref64, ref_lp, tiny: float = 1e-6) -> None:
    """||got - ref64|| <= 2 ||ref_lp - ref64|| + tiny, with -inf (empty rows) required at the same places."""
    got, ref64, ref_lp = (np.asarray(x, np.float64) for x in (got, ref64, ref_lp))
    assert not np.isnan(got).any(), f"{name}: NaN in result"
    inf = np.isneginf(ref64)
    np.testing.assert_array_equal(np.isneginf(got), inf, err_msg=f"{name}: -inf (empty rows) misplaced")
    got, ref64, ref_lp = (np.where(inf, 0.0, x) for x in (got, ref64, ref_lp))
    err = _norm(got - ref64)
    bound = 2 * _norm(ref_lp - ref64) + tiny * max(1.0, _norm(ref64))
    assert err <= bound, f"{name}: error {err:.3e} exceeds the bound {bound:.3e}"


def check_against_reference(attn_fn, mask: AttnMask, q, k, v, rng: np.random.Generator,
                            softmax_scale=None, softcap: float = 0.0, grads: bool = True) -> None:
    """Runs attn_fn(q, k, v) -> (out, lse) and its vjp, and checks all against the float64 reference."""
    (out, lse), vjp = jax.vjp(attn_fn, q, k, v)
    dout = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32)).astype(out.dtype)
    dlse = jnp.asarray(rng.standard_normal(lse.shape).astype(np.float32))
    ref = attention_f64(q, k, v, mask, softmax_scale, softcap, dout=dout, dlse=dlse)
    counts = mask.to_dense()
    lp_fn = lambda q, k, v: attention_dense(q, k, v, counts, softmax_scale, softcap)
    (lp_out, lp_lse), lp_vjp = jax.vjp(lp_fn, q, k, v)
    assert_within_rule("out", out, ref[0], lp_out)
    assert_within_rule("lse", lse, ref[1], lp_lse)
    if grads:
        got = vjp((dout, dlse))
        lp = lp_vjp((dout, dlse))
        for name, g, r, l in zip(("dq", "dk", "dv"), got, ref[2:], lp):
            assert_within_rule(name, g, r, l)
