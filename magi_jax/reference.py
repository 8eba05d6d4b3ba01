"""Dense reference attention from an AttnMask: the independent check of every kernel.

`attention_f64` is float64 with a hand-written backward (jnp per head, on jax's default device);
`attention_dense` is the same function in jnp at any dtype (the "naive attention in its own precision" of
the tolerance rule, DESIGN.md section 5).
A cell covered by c slices carries weight c in the softmax (log(c) added to its logit). O(Tq x Tk): tests only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from magi_jax.mask import AttnMask


def attention_f64(q, k, v, mask: AttnMask, softmax_scale: float | None = None, softcap: float = 0.0,
                  dout=None, dlse=None):
    """Forward (out, lse) in float64; with dout (and optionally dlse) also (dq, dk, dv), as numpy arrays.

    Shapes as flex_flash_attn: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]; out [Tq, Hq, Dv], lse [Tq, Hq]. Empty rows: out 0, lse -inf.
    jnp in float64 with a hand-written backward, on jax's default device (where there is a GPU, its float64
    units rather than the host's BLAS, shared by the test workers), one q head at a time, so that the largest
    temporaries are [Tq, Tk] (a 16k x 16k mask: 2 GB each).
    """
    tq, hq, d = np.shape(q)
    group = hq // np.shape(k)[1]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    grads = dout is not None
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # on the default device, whatever held x
        q, k, v = f64(q), f64(k), f64(v)
        counts = jnp.asarray(mask.to_dense())
        if grads:
            dout = f64(dout)
            dlse = jnp.zeros((tq, hq), jnp.float64) if dlse is None else f64(dlse)
        heads = []
        for h in range(hq):
            kh, vh = k[:, h // group], v[:, h // group]
            args = (q[:, h], kh, vh, counts) + ((dout[:, h], dlse[:, h]) if grads else ())
            heads.append(_head_f64(*args, scale=scale, softcap=float(softcap)))
        out, lse = (np.stack([np.asarray(x[i]) for x in heads], axis=1) for i in (0, 1))
        if not grads:
            return out, lse
        dq = np.stack([np.asarray(x[2]) for x in heads], axis=1)
        dk, dv = np.zeros(k.shape), np.zeros(v.shape)
        for h, x in enumerate(heads):
            dk[:, h // group] += np.asarray(x[3])
            dv[:, h // group] += np.asarray(x[4])
        return out, lse, dq, dk, dv


@functools.partial(jax.jit, static_argnames=("scale", "softcap"))
def _head_f64(q, k, v, counts, dout=None, dlse=None, *, scale: float, softcap: float):
    """One q head of attention_f64 (float64 operands): (out, lse) and, given dout and dlse, (dq, dk, dv)."""
    visible = counts > 0
    log_counts = jnp.log(jnp.where(visible, counts, 1).astype(jnp.float64))
    raw = (q @ k.T) * scale
    logits = softcap * jnp.tanh(raw / softcap) if softcap > 0 else raw
    masked = jnp.where(visible, logits + log_counts, -jnp.inf)
    row_max = jnp.max(masked, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(masked - row_max)
    total = p.sum(-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    lse = jnp.where(total[:, 0] > 0, jnp.log(jnp.where(total[:, 0] > 0, total[:, 0], 1.0)) + row_max[:, 0], -jnp.inf)
    out = p @ v
    if dout is None:
        return out, lse
    dv = p.T @ dout
    dp = dout @ v.T
    ds = p * (dp - (dout * out).sum(-1, keepdims=True) + dlse[:, None])
    if softcap > 0:
        ds = ds * (1.0 - jnp.tanh(raw / softcap) ** 2)
    return out, lse, (ds @ k) * scale, (ds.T @ q) * scale, dv


def attention_dense(q, k, v, counts, softmax_scale: float | None = None, softcap: float = 0.0):
    """The same attention in jnp at the inputs' dtype (differentiable), from the dense count matrix."""
    hq, d = q.shape[1], q.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    k, v = (jnp.repeat(x, hq // x.shape[1], axis=1) for x in (k, v))
    raw = jnp.einsum("qhd,khd->hqk", q, k) * jnp.asarray(scale, q.dtype)
    logits = softcap * jnp.tanh(raw / softcap) if softcap > 0 else raw
    counts = jnp.asarray(counts)[None]
    visible = counts > 0
    masked = jnp.where(visible, logits + jnp.log(jnp.where(visible, counts, 1).astype(q.dtype)), -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    e = jnp.exp(masked - row_max)
    total = e.sum(-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1)
    out = jnp.einsum("hqk,khd->qhd", p, v)
    lse = jnp.where(total[..., 0] > 0, jnp.log(jnp.where(total[..., 0] > 0, total[..., 0], 1)) + row_max[..., 0],
                    -jnp.inf).T
    return out, lse.astype(jnp.float32)


def max_logit_f64(q, k, mask: AttnMask, softmax_scale: float | None = None, softcap: float = 0.0) -> np.ndarray:
    """Per q head the largest logit over the mask's cells, float64 [Hq] (-inf where no cell is visible)."""
    tq, hq, d = np.shape(q)
    group = hq // np.shape(k)[1]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    visible = mask.to_dense() > 0
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    out = np.full(hq, -np.inf)
    for h in range(hq):
        raw = (q[:, h] @ k[:, h // group].T) * scale
        logits = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
        if visible.any():
            out[h] = logits[visible].max()
    return out


def max_logit_dense(q, k, counts, softmax_scale: float | None = None, softcap: float = 0.0) -> jax.Array:
    """The same in jnp at the inputs' dtype (the tolerance rule's naive attention in its own precision)."""
    hq, d = q.shape[1], q.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    k = jnp.repeat(k, hq // k.shape[1], axis=1)
    raw = jnp.einsum("qhd,khd->hqk", q, k) * jnp.asarray(scale, q.dtype)
    logits = softcap * jnp.tanh(raw / softcap) if softcap > 0 else raw
    masked = jnp.where(jnp.asarray(counts)[None] > 0, logits, -jnp.inf)
    return jnp.max(masked, axis=(1, 2), initial=-jnp.inf).astype(jnp.float32)


def error_and_bound(got, ref64, ref_lp, tiny: float = 1e-6) -> tuple[float, float]:
    """The tolerance rule of DESIGN.md section 5: accept when error <= bound, where
    error = ||got - ref64|| and bound = 2 ||ref_lp - ref64|| + tiny * max(1, ||ref64||).
    Cells where ref64 is -inf (lse of empty rows) are left out; the caller checks they match."""
    got, ref64, ref_lp = (np.asarray(x, np.float64) for x in (got, ref64, ref_lp))
    empty = np.isneginf(ref64)
    got, ref64, ref_lp = (np.where(empty, 0.0, x) for x in (got, ref64, ref_lp))
    norm = lambda x: float(np.linalg.norm(x))
    return norm(got - ref64), 2 * norm(ref_lp - ref64) + tiny * max(1.0, norm(ref64))
