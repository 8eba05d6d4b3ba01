"""jax.export of functions that call magi_jax: serialised, deserialised and called, on one device and sharded
over a mesh, lowered for the CPU and CUDA at once (the CUDA lowering needs no GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import magi_jax as mj
from magi_jax import masks
from tests.conftest import random_qkv
from tests.test_dist_helpers import mesh_of


def _round_trip(fn, *args):
    """fn exported for cpu and cuda, serialised and deserialised; its result on args beside fn's own."""
    pytest.importorskip("flatbuffers")  # jax's serialisation format (requirements-dev.txt installs it)
    exported = jax.export.export(fn, disabled_checks=mj.EXPORT_DISABLED_CHECKS, platforms=("cpu", "cuda"))(*args)
    restored = jax.export.deserialize(exported.serialize())
    return jax.jit(restored.call)(*args), fn(*args)


def _assert_same(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-6, atol=1e-6)


def test_exported_forward_and_gradients_match_the_direct_call():
    rng = np.random.default_rng(11)
    mask = masks.sliding_window([150, 106], 40)
    q, k, v = random_qkv(rng, 256, 256, 4, 2, 64)

    def loss(q, k, v):
        out, lse = mj.flex_flash_attn(q, k, v, mask=mask)
        return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    got, want = _round_trip(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), q, k, v)
    _assert_same(got, want)


def test_exported_distributed_step_matches_the_direct_call():
    mask = masks.varlen_causal([300, 212])
    mesh = mesh_of(2)
    plan = mj.plan(mask, mesh, axis="cp", num_heads_q=4, num_heads_kv=2, head_dim=64, chunk_size=64)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P()))
               for x in random_qkv(np.random.default_rng(12), 512, 512, 4, 2, 64))

    def loss(q, k, v):
        out, _ = mj.calc_attn(*(mj.dispatch(x, plan) for x in (q, k, v)), plan)
        return jnp.sum(mj.undispatch(out, plan) ** 2)

    got, want = _round_trip(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)
    _assert_same(got, want)


def test_export_without_the_disabled_checks_names_the_call():
    q, k, v = random_qkv(np.random.default_rng(13), 64, 64, 2, 2, 64)
    fn = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=masks.causal(64))[0])
    with pytest.raises(ValueError, match="magi_jax_ffa_fwd"):
        jax.export.export(fn)(q, k, v)


def test_exported_step_sharded_over_explicit_axes():
    # Explicit mesh axes split the batch by a shard_map, which jax.export takes (Auto axes' custom_partitioning
    # it refuses).
    mask = masks.varlen_causal([100, 156])
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    q, k, v = (jax.device_put(jnp.stack([x, x[::-1]]), NamedSharding(mesh, P("dp")))
               for x in random_qkv(np.random.default_rng(14), 256, 256, 2, 2, 64))
    fn = jax.jit(jax.vmap(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask)))
    with jax.set_mesh(mesh):
        got, want = _round_trip(fn, q, k, v)
    _assert_same(got, want)


def test_version_is_the_installed_packages():
    """An exported step runs where the same version is imported, so __version__ must be what pip installed."""
    from importlib import metadata
    try:
        installed = metadata.version("magi_jax")
    except metadata.PackageNotFoundError:
        pytest.skip("magi_jax runs from the source tree, not installed (Bazel)")
    assert mj.__version__ == installed
    assert all(part.isdigit() for part in mj.__version__.split("."))
