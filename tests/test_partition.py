"""flex_flash_attn and the drop-in under jit on arrays sharded over batch (data parallel) and heads (tensor
parallel), Auto and Explicit mesh axes: each device runs its own batch elements and heads (no all-gather in
the compiled step), with the values and gradients of the unsharded call; shardings that one call per device
cannot run (kv heads split unlike the q heads) are gathered and still correct."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import magi_jax as mj
from magi_jax import masks
from tests.conftest import check_against_reference, random_qkv, stacked_slices

MODES = [AxisType.Auto, AxisType.Explicit]
MASK = masks.sliding_window([100, 156], 40)


def _mesh(shape: dict[str, int], mode) -> jax.sharding.Mesh:
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(mode,) * len(shape))


def _batch(rng, b: int, hq: int, hkv: int, d: int = 64):
    """b sequences of MASK's tokens: q [b, T, hq, d], k and v [b, T, hkv, d]."""
    per_element = [random_qkv(rng, MASK.total_seqlen_q, MASK.total_seqlen_k, hq, hkv, d) for _ in range(b)]
    return tuple(jnp.stack(x) for x in zip(*per_element))


def _run(fn, mesh, specs, *args):
    """fn jitted on args placed by specs: its results and gradients (of a loss over every result), their
    shardings' specs, and whether the compiled forward and backward gather anything."""
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    loss = lambda *a: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(fn(*a)))
    with jax.set_mesh(mesh):
        fwd, grad = jax.jit(fn), jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
        outs, grads = fwd(*placed), grad(*placed)
        hlo = fwd.lower(*placed).compile().as_text() + grad.lower(*placed).compile().as_text()
    return outs, grads, [y.sharding.spec for y in jax.tree.leaves(outs)], "all-gather" in hlo


def _unsharded(fn, *args):
    loss = lambda *a: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(fn(*a)))
    return jax.jit(fn)(*args), jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def _assert_equal(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape, spec, heads", [
    ({"dp": 4}, P("dp"), (4, 2)),                      # data parallel: a vmapped batch split over dp
    ({"tp": 2}, P(None, None, "tp"), (4, 2)),          # tensor parallel: heads, the kv heads split alike
    ({"dp": 2, "tp": 2}, P("dp", None, "tp"), (4, 2)),
    ({"tp": 4}, P(None, None, "tp"), (4, 1)),          # MQA: the one kv head whole on every device
])
def test_vmapped_call_runs_on_each_devices_batch_and_heads(mode, mesh_shape, spec, heads):
    q, k, v = _batch(np.random.default_rng(1), 4, *heads)
    fn = jax.vmap(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=MASK))
    kv_spec = P(*spec[:2]) if heads[1] == 1 else spec
    outs, grads, out_specs, gathers = _run(fn, _mesh(mesh_shape, mode), (spec, kv_spec, kv_spec), q, k, v)
    assert not gathers
    want = tuple(s for s in spec if s is not None)
    for s in out_specs:
        assert tuple(e for e in s if e is not None) == want, (s, spec)
    _assert_equal((outs, grads), _unsharded(fn, q, k, v))


@pytest.mark.parametrize("mode", MODES)
def test_lone_call_with_sharded_heads_against_the_reference(mode):
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, MASK.total_seqlen_q, MASK.total_seqlen_k, 4, 2, 64)
    mesh = _mesh({"tp": 2}, mode)
    heads = NamedSharding(mesh, P(None, "tp"))
    place = jax.sharding.reshard if mode == AxisType.Explicit else jax.lax.with_sharding_constraint
    # The reference takes and gives the arrays whole; the call splits their heads over tp.
    whole = NamedSharding(mesh, P())
    fn = jax.jit(lambda q, k, v: tuple(place(y, whole) for y in mj.flex_flash_attn(
        *(place(x, heads) for x in (q, k, v)), mask=MASK)))
    split = jax.jit(lambda q, k, v: mj.flex_flash_attn(*(place(x, heads) for x in (q, k, v)), mask=MASK))
    with jax.set_mesh(mesh):
        assert "all-gather" not in split.lower(q, k, v).compile().as_text()
        check_against_reference(fn, MASK, q, k, v, rng)


@pytest.mark.parametrize("mode", MODES)
def test_kv_heads_split_unlike_the_q_heads_are_gathered_and_correct(mode):
    # 2 kv heads cannot follow 4 q heads over 4 devices: each device would hold half a kv head.
    q, k, v = _batch(np.random.default_rng(3), 2, 4, 2)
    fn = jax.vmap(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=MASK))
    outs, grads, _, _ = _run(fn, _mesh({"tp": 4}, mode), (P(None, None, "tp"), P(), P()), q, k, v)
    _assert_equal((outs, grads), _unsharded(fn, q, k, v))


@pytest.mark.parametrize("mode", MODES)
def test_drop_in_keeps_the_batch_where_it_is(mode):
    q, k, v = _batch(np.random.default_rng(4), 4, 4, 2)
    segments = np.repeat(np.arange(3), [90, 60, 106])[None].repeat(4, 0)
    fn = lambda q, k, v: mj.dot_product_attention(q, k, v, is_causal=True, segment_ids=segments,
                                                  return_residual=True)
    outs, grads, out_specs, gathers = _run(fn, _mesh({"dp": 2, "tp": 2}, mode), (P("dp", None, "tp"),) * 3,
                                           q, k, v)
    assert not gathers
    assert all(s[0] == "dp" for s in out_specs)
    _assert_equal((outs, grads), _unsharded(fn, q, k, v))


@pytest.mark.parametrize("mode", MODES)
def test_drop_in_with_traced_segment_ids_sharded_like_the_batch(mode):
    # Segment ids as an argument of the step (slices built on the devices), split over dp with the batch.
    q, k, v = _batch(np.random.default_rng(5), 4, 4, 2)
    segments = jnp.asarray(np.stack([np.repeat(np.arange(3), [90, 60, 106]), np.repeat(np.arange(2), [200, 56]),
                                     np.repeat(np.arange(4), [10, 100, 46, 100]), np.zeros(256, np.int32)]))
    fn = lambda q, k, v, s: mj.dot_product_attention(q, k, v, is_causal=True, segment_ids=s, max_segments=4,
                                                     return_residual=True)
    mesh = _mesh({"dp": 2, "tp": 2}, mode)
    placed = [jax.device_put(x, NamedSharding(mesh, P("dp", None, "tp"))) for x in (q, k, v)]
    ids = jax.device_put(segments, NamedSharding(mesh, P("dp")))
    step = jax.jit(jax.grad(lambda q, k, v, s: sum(jnp.sum(jnp.sin(y)) for y in fn(q, k, v, s)), argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        got = jax.jit(fn)(*placed, ids), step(*placed, ids)
        assert "all-gather" not in step.lower(*placed, ids).compile().as_text()
    _assert_equal(got, (jax.jit(fn)(q, k, v, segments), jax.jit(step)(q, k, v, segments)))


@pytest.mark.parametrize("mode", MODES)
def test_batched_call_with_each_sequences_slices_over_dp(mode):
    # flex_flash_attn on q [B, T, H, D] with slices [B, N, 2]: the slices split over dp like the batch.
    q, k, v = _batch(np.random.default_rng(6), 4, 4, 2)
    per = [masks.varlen_causal(lens) for lens in ([100, 156], [256], [56, 200], [128, 128])]
    slices = stacked_slices(per)
    fn = lambda q, k, v: mj.flex_flash_attn(q, k, v, *slices)
    outs, grads, out_specs, gathers = _run(fn, _mesh({"dp": 2}, mode), (P("dp"),) * 3, q, k, v)
    assert not gathers
    assert all(s[0] == "dp" for s in out_specs)
    _assert_equal((outs, grads), _unsharded(fn, q, k, v))
