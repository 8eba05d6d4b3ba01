"""Dense reference attention from an AttnMask: the independent check of every kernel.

`attention_f64` is numpy float64 with a hand-written backward (matrix products per head through BLAS);
`attention_dense` is the same function in jnp at any dtype (the "naive attention in its own precision" of
the tolerance rule, DESIGN.md section 5).
A cell covered by c slices carries weight c in the softmax (log(c) added to its logit). O(Tq x Tk): tests only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.mask import AttnMask


def attention_f64(q, k, v, mask: AttnMask, softmax_scale: float | None = None, softcap: float = 0.0,
                  dout=None, dlse=None):
    """Forward (out, lse) in float64; with dout (and optionally dlse) also (dq, dk, dv).

    Shapes as flex_flash_attn: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]; out [Tq, Hq, Dv], lse [Tq, Hq]. Empty rows: out 0, lse -inf.
    One q head at a time, so that the largest temporaries are [Tq, Tk] (a 16k x 16k mask: 2 GB each).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    counts = mask.to_dense().astype(np.float64)
    visible = counts > 0
    log_counts = np.log(np.where(visible, counts, 1.0))
    grads = dout is not None
    if grads:
        dout = np.asarray(dout, np.float64)
        dlse = np.zeros((tq, hq)) if dlse is None else np.asarray(dlse, np.float64)
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    out, lse = np.zeros((tq, hq, v.shape[-1])), np.zeros((tq, hq))
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]
        raw = (q[:, h] @ kh.T) * scale
        logits = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
        masked = np.where(visible, logits + log_counts, -np.inf)
        row_max = np.max(masked, axis=-1, keepdims=True)
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)
        p = np.exp(masked - row_max)
        total = p.sum(-1, keepdims=True)
        p /= np.where(total > 0, total, 1.0)
        with np.errstate(divide="ignore"):
            lse[:, h] = np.where(total[:, 0] > 0, np.log(total[:, 0]) + row_max[:, 0], -np.inf)
        out[:, h] = p @ vh
        if not grads:
            continue
        dv[:, h // group] += p.T @ dout[:, h]
        dp = dout[:, h] @ vh.T
        ds = p * (dp - (dout[:, h] * out[:, h]).sum(-1, keepdims=True) + dlse[:, h, None])
        if softcap > 0:
            ds *= 1.0 - np.tanh(raw / softcap) ** 2
        dq[:, h] = (ds @ kh) * scale
        dk[:, h // group] += (ds.T @ q[:, h]) * scale
    return (out, lse, dq, dk, dv) if grads else (out, lse)


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
