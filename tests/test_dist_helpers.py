"""Shared helpers for the distributed tests (CPU and GPU): meshes, mask families, random masks, and the
global round trip dispatch -> calc_attn -> undispatch checked against the float64 reference."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

import magi_jax as mj
from magi_jax import masks
from magi_jax.mask import AttnMask
from tests.conftest import check_against_reference, random_qkv

# 380 tokens: not a multiple of chunk_size * cp for most settings, so the plans pad.
DOCS = [61, 7, 90, 1, 18, 127, 4, 72]


def mesh_of(cp: int, dp: int = 1, platform: str = "cpu") -> Mesh:
    """A (cp,) mesh, or (dp, cp) when dp > 1, over the first devices of the platform."""
    devices = jax.devices(platform)
    if len(devices) < dp * cp:
        raise RuntimeError(f"need {dp * cp} {platform} devices, have {len(devices)}")
    if dp == 1:
        return Mesh(np.array(devices[:cp]), ("cp",))
    return Mesh(np.array(devices[:dp * cp]).reshape(dp, cp), ("dp", "cp"))


def families(docs=DOCS) -> dict[str, AttnMask]:
    """One mask of every family of magi_jax.masks."""
    total = sum(docs)
    third = total // 3
    return {
        "full": masks.full(total),
        "causal": masks.causal(total),
        "varlen_full": masks.varlen_full(docs),
        "varlen_causal": masks.varlen_causal(docs),
        "sliding_window": masks.sliding_window(docs, 24),
        "sliding_window_bi": masks.sliding_window(docs, 17, causal=False),
        "block_causal": masks.block_causal(docs, 32),
        "shared_question": masks.shared_question([(40, [60, 20, 17]), (third, [total - 137 - third])]),
        "prefix_lm": masks.prefix_lm(docs, [n // 3 for n in docs]),
        "global_sliding_window": masks.global_sliding_window(docs, 20, 6),
        "causal_blockwise": masks.causal_blockwise(docs),
    }


def random_mask(seed: int, total: int = 380, max_slices: int = 10) -> AttnMask:
    """Seeded arbitrary slices of all four types: overlapping rows, empty rows, any key ranges."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, max_slices + 1))
    q = np.sort(rng.integers(0, total + 1, (n, 2)), axis=1)
    k = np.sort(rng.integers(0, total + 1, (n, 2)), axis=1)
    return AttnMask(q, k, rng.integers(0, 4, n), total, total)


def global_fn(mp, **options):
    """Global q, k, v -> (out, lse) in global order through dispatch, calc_attn and undispatch (jitted)."""
    @jax.jit
    def fn(q, k, v):
        qd, kd, vd = (mj.dispatch(x, mp) for x in (q, k, v))
        out, lse = mj.calc_attn(qd, kd, vd, mp, **options)
        return mj.undispatch(out, mp), mj.undispatch(lse, mp)
    return fn


def check_dist(mask: AttnMask, mesh: Mesh, *, overlap=2, chunk_size=16, hq=2, hkv=2, d=64, dtype=np.float32,
               seed=0, softmax_scale=None, softcap=0.0, **options):
    """The global round trip on ``mesh`` against the float64 reference: out, lse, dq, dk, dv within the
    tolerance rule. Returns the plan."""
    mp = mj.plan(mask, mesh, chunk_size=chunk_size, overlap=overlap, num_heads_q=hq, num_heads_kv=hkv,
                 head_dim=d)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, hq, hkv, d, dtype)
    fn = global_fn(mp, softmax_scale=softmax_scale, softcap=softcap, **options)
    check_against_reference(fn, mask, q, k, v, rng, softmax_scale, softcap)
    return mp
