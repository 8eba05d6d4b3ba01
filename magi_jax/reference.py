"""Dense reference attention from an AttnMask: the independent check of every kernel.

`attention_f64` is numpy float64 with a hand-written backward (einsums with optimize=True go through BLAS,
~5x faster than numpy's loops); `attention_dense` is the same function in jnp at any dtype (the "naive
attention in its own precision" of the tolerance rule, DESIGN.md section 5).
A cell covered by c slices carries weight c in the softmax (log(c) added to its logit). O(Tq x Tk): tests only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.mask import AttnMask


def _expand_kv(x: np.ndarray, hq: int) -> np.ndarray:
    """[T, Hkv, D] -> [T, Hq, D]: each kv head serves hq // Hkv consecutive q heads."""
    return np.repeat(x, hq // x.shape[1], axis=1)


def attention_f64(q, k, v, mask: AttnMask, softmax_scale: float | None = None, softcap: float = 0.0,
                  dout=None, dlse=None):
    """Forward (out, lse) in float64; with dout (and optionally dlse) also (dq, dk, dv).

    Shapes as flex_flash_attn: q [Tq, Hq, D], k/v [Tk, Hkv, D]; lse [Tq, Hq]. Empty rows: out 0, lse -inf.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    ke, ve = _expand_kv(k, hq), _expand_kv(v, hq)
    counts = mask.to_dense().astype(np.float64)[None]                      # [1, Tq, Tk]
    raw = np.einsum("qhd,khd->hqk", q, ke, optimize=True) * scale
    logits = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
    visible = counts > 0
    masked = np.where(visible, logits + np.log(np.where(visible, counts, 1.0)), -np.inf)
    row_max = np.max(masked, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(masked - row_max)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)                                 # [Hq, Tq, Tk]
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + row_max[..., 0], -np.inf).T
    out = np.einsum("hqk,khd->qhd", p, ve, optimize=True)
    if dout is None:
        return out, lse
    dout = np.asarray(dout, np.float64)
    dlse_t = np.zeros((hq, q.shape[0])) if dlse is None else np.asarray(dlse, np.float64).T
    dve = np.einsum("hqk,qhd->khd", p, dout, optimize=True)
    dp = np.einsum("qhd,khd->hqk", dout, ve, optimize=True)
    ds = p * (dp - np.einsum("qhd,qhd->hq", dout, out, optimize=True)[..., None] + dlse_t[..., None])
    if softcap > 0:
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    dq = np.einsum("hqk,khd->qhd", ds, ke, optimize=True) * scale
    dke = np.einsum("hqk,qhd->khd", ds, q, optimize=True) * scale
    fold = lambda x: x.reshape(x.shape[0], hkv, hq // hkv, d).sum(2)     # sum the q heads of each kv head
    return out, lse, dq, fold(dke), fold(dve)


def attention_dense(q, k, v, counts, softmax_scale: float | None = None, softcap: float = 0.0):
    """The same attention in jnp at the inputs' dtype (differentiable), from the dense count matrix."""
    hq, d = q.shape[1], q.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    k, v = (jnp.repeat(x, hq // x.shape[1], axis=1) for x in (k, v))
    raw = jnp.einsum("qhd,khd->hqk", q, k) * jnp.asarray(scale, q.dtype)
    logits = softcap * jnp.tanh(raw / softcap) if softcap > 0 else raw
    counts = jnp.asarray(counts)[None]
    visible = counts > 0
    masked = jnp.where(visible, logits + jnp.log(jnp.where(visible, counts, 1)).astype(q.dtype), -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    e = jnp.exp(masked - row_max)
    total = e.sum(-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1)
    out = jnp.einsum("hqk,khd->qhd", p, v)
    lse = jnp.where(total[..., 0] > 0, jnp.log(jnp.where(total[..., 0] > 0, total[..., 0], 1)) + row_max[..., 0],
                    -jnp.inf).T
    return out, lse.astype(jnp.float32)


def error_and_bound(got, ref64, ref_lp, tiny: float = 1e-6) -> tuple[float, float]:
    """The tolerance rule of DESIGN.md section 5: accept when error <= bound, where
    error = ||got - ref64|| and bound = 2 ||ref_lp - ref64|| + tiny * max(1, ||ref64||).
    Cells where ref64 is -inf (lse of empty rows) are left out; the caller checks they match."""
    got, ref64, ref_lp = (np.asarray(x, np.float64) for x in (got, ref64, ref_lp))
    empty = np.isneginf(ref64)
    got, ref64, ref_lp = (np.where(empty, 0.0, x) for x in (got, ref64, ref_lp))
    norm = lambda x: float(np.linalg.norm(x))
    return norm(got - ref64), 2 * norm(ref_lp - ref64) + tiny * max(1.0, norm(ref64))
