"""Distributed attention on 2 GPUs (marked gpu; skipped without two CUDA devices): the CPU suite's checks
with the CUDA kernels (bf16, head dim 128), plus the compiled schedule: transfers overlap attention calls.
The range kernels the transfers pack with need one GPU: tests/test_range_ops_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax import masks
from tests.conftest import check_max_logit, has_gpu, random_qkv
from tests.test_dist_helpers import (DOCS, async_overlap,
                                     check_batched_plan_tables, check_dist, check_plan_tables,
                                     collective_dependencies, families, mesh_of, random_mask, remat_grads)


def _two_gpus() -> bool:
    return has_gpu() and len(jax.devices("gpu")) >= 2


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices")]

GDOCS = [5 * n for n in DOCS]        # 1900 tokens, padded to 2048 by the plans (chunk 128)
BF16 = dict(dtype=jnp.bfloat16, d=128, chunk_size=128)
FAMILY_OVERLAP = {name: i % 5 for i, name in enumerate(sorted(families(GDOCS)))}


def gpu_mesh():
    return mesh_of(2, platform="gpu")


@pytest.mark.parametrize("name", sorted(FAMILY_OVERLAP))
def test_mask_families_2gpu(name):
    check_dist(families(GDOCS)[name], gpu_mesh(), overlap=FAMILY_OVERLAP[name], hq=4, hkv=4, **BF16)


@pytest.mark.parametrize("seed, overlap", [(0, 1), (1, 3), (2, 0)])
def test_random_masks_2gpu(seed, overlap):
    check_dist(random_mask(seed, total=1900, max_slices=16), gpu_mesh(), overlap=overlap, hq=4, hkv=4, **BF16)


@pytest.mark.parametrize("transport", ["all_to_all", "ppermute"])
def test_transports_2gpu(transport):
    check_dist(masks.varlen_causal(GDOCS), gpu_mesh(), overlap=2, transport=transport, hq=4, hkv=4, **BF16)


@pytest.mark.parametrize("overlap", [1, 3])
def test_staged_backward_2gpu(overlap):
    # One backward call per stage, dQ chained in float32 from call to call (aliased in place on the GPU).
    check_dist(masks.varlen_causal(GDOCS), gpu_mesh(), overlap=overlap, backward="staged", hq=4, hkv=4, **BF16)


def test_checkpoint_policy_keeps_the_forward_out_of_the_backward_2gpu():
    # As on CPU devices, with the CUDA kernels (deterministic backward; the loss's own fusions may round
    # differently in the two programs: a bf16 ulp).
    want, got, calls, mp = remat_grads(masks.varlen_causal(GDOCS), gpu_mesh(), chunk_size=128, hq=4, d=128,
                                       dtype=jnp.bfloat16, deterministic=True)
    assert calls == (mp.num_stages + 1, 2 * (mp.num_stages + 1), mp.num_stages + 1)
    for a, b in zip(want, got):
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("hq, hkv, overlap", [(8, 2, 2), (4, 1, 4)])
def test_gqa_2gpu(hq, hkv, overlap):
    check_dist(masks.block_causal(GDOCS, 256), gpu_mesh(), overlap=overlap, hq=hq, hkv=hkv, **BF16)


def test_bf16_head_dim_96_2gpu():
    # Head dim 96 unpadded through the stage calls (two key sources, chained dQ, merged forwards).
    check_dist(masks.varlen_causal(GDOCS), gpu_mesh(), overlap=2, hq=4, hkv=2, dtype=jnp.bfloat16, d=96,
               chunk_size=128)


@pytest.mark.parametrize("backward", ["staged", "fused"])
def test_bf16_mla_2gpu(backward):
    # MLA's q, k 192 with v 128: v computed at 128 in every call, the stage calls reading it from the packed
    # receive buffers where it travels padded to 192 (the fused backward: 1024 local keys, then the fetched).
    check_dist(masks.varlen_causal(GDOCS), gpu_mesh(), overlap=2, hq=4, hkv=2, dtype=jnp.bfloat16, d=192, dv=128,
               chunk_size=128, backward=backward)


@pytest.mark.parametrize("overlap", [0, 2])
def test_bf16_max_logit_2gpu(overlap):
    # return_max_logit through the stage calls (each merging call's rows without keys filled -inf) or the
    # fused call, joined over the ranks: the global mask's per-head maximum; out and lse the plain call's.
    mask = masks.varlen_causal(GDOCS)
    mesh = gpu_mesh()
    mp = mj.plan(mask, mesh, chunk_size=128, overlap=overlap, num_heads_q=4, num_heads_kv=2, head_dim=128)
    q, k, v = random_qkv(np.random.default_rng(overlap), mask.total_seqlen_q, mask.total_seqlen_k, 4, 2, 128,
                         jnp.bfloat16)
    qd, kd, vd = (mj.dispatch(x, mp) for x in (q, k, v))
    check_max_logit(lambda flag: jax.jit(lambda q, k, v: mj.calc_attn(q, k, v, mp, return_max_logit=flag))(
        qd, kd, vd), mask, q, k)


def test_fp16_head_dim_64_2gpu():
    check_dist(masks.varlen_causal(GDOCS), gpu_mesh(), overlap=2, hq=4, hkv=2, dtype=jnp.float16, d=64,
               chunk_size=128)


@pytest.mark.parametrize("overlap, backward", [(1, "staged"), (2, "fused")])
def test_plan_tables_2gpu(overlap, backward):
    """Masks of one length as run-time data: one compiled function, each mask right (bf16, head dim 128)."""
    total = sum(GDOCS)
    mask_list = [masks.varlen_causal(GDOCS), masks.varlen_causal([700, 13, total - 713]),
                 masks.sliding_window([900, total - 900], 300), random_mask(7, total=total)]
    check_plan_tables(mask_list, gpu_mesh(), overlap=overlap, hq=4, hkv=2, **BF16, backward=backward)


def test_batched_plan_tables_2gpu():
    """Two sequences of one batch, each with its own mask (cp 2, both on each GPU), bf16, head dim 128."""
    total = sum(GDOCS)
    mask_list = [masks.varlen_causal(GDOCS), masks.varlen_causal([700, 13, total - 713]),
                 masks.block_causal([900, total - 900], 256)]
    check_batched_plan_tables(mask_list, gpu_mesh(), 2, hq=4, hkv=2, **BF16)


def test_jitted_training_step_2gpu():
    mesh = gpu_mesh()
    mask = masks.varlen_causal(GDOCS)
    mp = mj.plan(mask, mesh, chunk_size=128, overlap=2, num_heads_q=4, head_dim=128)
    rng = np.random.default_rng(0)
    T, C, H, D = mask.total_seqlen_q, 64, 4, 128
    x = jnp.asarray(rng.standard_normal((T, C)), jnp.bfloat16)
    target = jnp.asarray(rng.standard_normal((T, C)), jnp.float32)
    params = {n: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)
              for n, s in (("wq", (C, H * D)), ("wk", (C, H * D)), ("wv", (C, H * D)), ("wo", (H * D, C)))}

    def loss(p):
        q, k, v = ((x @ p[n].astype(jnp.bfloat16)).reshape(T, H, D) for n in ("wq", "wk", "wv"))
        qd, kd, vd = (mj.dispatch(a, mp) for a in (q, k, v))
        out = mj.undispatch(mj.calc_attn(qd, kd, vd, mp)[0], mp).reshape(T, H * D)
        return jnp.mean((out.astype(jnp.float32) @ p["wo"] - target) ** 2)

    @jax.jit
    def step(p):
        value, grads = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda w, g: w - 1.0 * g, p, grads), value

    losses = []
    for _ in range(5):
        params, value = step(params)
        losses.append(float(value))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_schedule_overlaps_transfers_with_attention_2gpu():
    """Compiled forward+backward on 2 GPUs: no group_cast transfer waits for attention, each group_reduce
    waits for its own stage's backward call and those before it (the staged backward chains dQ from call to
    call), never for the host call that runs last, and XLA's scheduler places attention calls between some
    async transfer's start and done."""
    mesh = gpu_mesh()
    mask = masks.varlen_causal([4096, 1500, 9000, 700, 5000, 12472])      # 32k tokens
    mp = mj.plan(mask, mesh, overlap=3, num_heads_q=8, head_dim=128)
    q = jnp.zeros((mp.padded_seqlen, 8, 128), jnp.bfloat16)

    def step(q, k, v):
        (out, lse), vjp = jax.vjp(lambda q, k, v: mj.calc_attn(q, k, v, mp), q, k, v)
        return vjp((out, lse))

    text = jax.jit(step).lower(q, q, q).compile().as_text()
    deps = collective_dependencies(text)
    assert any(not d for d in deps.values()), deps
    waits = {frozenset(n for n, t in d.items() if t == "magi_jax_ffa_bwd") for d in deps.values() if d}
    assert sorted(len(w) for w in waits) == list(range(1, max(mp.num_stages, 1) + 1)), waits
    windows = async_overlap(text)
    print("\nasync collectives and the attention calls scheduled inside them:")
    for w in windows:
        print(f"  {w['start']} .. {w['done']}: {w['ffa_between']}")
    assert windows, "no async collectives in the compiled module"
    assert any(w["ffa_between"] for w in windows), "no attention call is scheduled inside any transfer"


@pytest.mark.parametrize("mode", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
@pytest.mark.parametrize("spec", [jax.sharding.PartitionSpec("x"), jax.sharding.PartitionSpec(None, None, "x")])
def test_batch_or_heads_sharded_over_2gpus_run_where_they_are(mode, spec):
    # A vmapped batch over data parallel, or its heads over tensor parallel (magi_jax.partition): no
    # all-gather in the compiled step, and each device's results bitwise those of the unsharded call (the
    # same rows of the same kernel).
    mask = masks.varlen_causal(GDOCS)
    rng = np.random.default_rng(31)
    batch = [random_qkv(rng, 1900, 1900, 4, 2, 128, jnp.bfloat16) for _ in range(2)]
    q, k, v = (jnp.stack(x) for x in zip(*batch))
    fn = jax.jit(jax.vmap(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask)))
    want = fn(q, k, v)
    mesh = jax.make_mesh((2,), ("x",), axis_types=(mode,), devices=jax.devices("gpu")[:2])
    placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        assert "all-gather" not in fn.lower(*placed).compile().as_text()
        got = fn(*placed)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
