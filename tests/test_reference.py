"""The float64 reference itself: attention_f64 against the mask table of DESIGN.md read row by row (forward),
and its hand-written backward against jax's autodiff of the dense attention in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.mask import AttnMask
from magi_jax.reference import attention_dense, attention_f64


def _keys_of_row(q: int, qs: int, qe: int, ks: int, ke: int, t: int) -> range:
    """DESIGN.md section 1's table: the keys one slice gives row q."""
    lo = ks + (q - qs) if t in (2, 3) else ks
    hi = ke - (qe - q - 1) if t in (1, 3) else ke
    return range(lo, hi)


def _rowwise(q, k, v, slices, scale: float, softcap: float):
    """out, lse by a loop over rows: a cell's logit appears once per slice that covers it."""
    tq, hq, _ = q.shape
    group = hq // k.shape[1]
    out, lse = np.zeros((tq, hq, v.shape[-1])), np.full((tq, hq), -np.inf)
    for row in range(tq):
        keys = [key for qs, qe, ks, ke, t in slices if qs <= row < qe for key in _keys_of_row(row, qs, qe, ks, ke, t)]
        if not keys:
            continue
        for h in range(hq):
            logits = np.array([q[row, h] @ k[key, h // group] * scale for key in keys])
            if softcap > 0:
                logits = softcap * np.tanh(logits / softcap)
            top = logits.max()
            weights = np.exp(logits - top)
            lse[row, h] = top + np.log(weights.sum())
            out[row, h] = (weights / weights.sum()) @ v[keys, h // group]
    return out, lse


def _random_case(seed: int, hq: int, hkv: int):
    rng = np.random.default_rng(seed)
    tq, tk = 37, 29
    slices = [(int(a), int(b) + 1, int(c), int(d) + 1, int(t)) for (a, b), (c, d), t in
              zip(np.sort(rng.integers(0, tq - 5, (4, 2)), 1), np.sort(rng.integers(0, tk, (4, 2)), 1),
                  rng.integers(0, 4, 4))]
    slices += [slices[0][:4] + (0,)] * 2  # cells covered twice or more (the table's weight: one per slice)
    slices.append((tq - 3, tq, 0, 0, 0))  # the last rows: one empty slice only, so no key
    mask = AttnMask(np.array([s[:2] for s in slices], np.int32), np.array([s[2:4] for s in slices], np.int32),
                    np.array([s[4] for s in slices], np.int32), tq, tk)
    q, k = rng.standard_normal((tq, hq, 16)), rng.standard_normal((tk, hkv, 16))
    v = rng.standard_normal((tk, hkv, 8))
    return rng, slices, mask, q, k, v


@pytest.mark.parametrize("seed,hq,hkv,softcap", [(0, 2, 2, 0.0), (1, 4, 2, 0.0), (2, 3, 1, 2.5), (3, 2, 1, 0.0)])
def test_forward_is_the_mask_table_row_by_row(seed, hq, hkv, softcap):
    _, slices, mask, q, k, v = _random_case(seed, hq, hkv)
    out, lse = attention_f64(q, k, v, mask, 0.3, softcap)
    want_out, want_lse = _rowwise(q, k, v, slices, 0.3, softcap)
    assert mask.to_dense().max() >= 2 and np.isneginf(lse[-3:]).all() and not np.isneginf(want_lse[:-3]).all()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12)


@pytest.mark.parametrize("seed,hq,hkv,softcap", [(4, 2, 2, 0.0), (5, 4, 2, 3.0), (6, 2, 1, 0.0)])
def test_backward_is_autodiff_of_the_dense_attention(seed, hq, hkv, softcap):
    rng, _, mask, q, k, v = _random_case(seed, hq, hkv)
    dout = rng.standard_normal((q.shape[0], hq, v.shape[-1]))
    # dlse in float32 values: attention_dense returns lse as float32, so its cotangent is rounded to that.
    dlse = rng.standard_normal((q.shape[0], hq)).astype(np.float32).astype(np.float64)
    _, _, dq, dk, dv = attention_f64(q, k, v, mask, 0.3, softcap, dout=dout, dlse=dlse)
    counts = mask.to_dense()
    with jax.enable_x64(True):
        fn = lambda q, k, v: attention_dense(q, k, v, counts, 0.3, softcap)
        _, vjp = jax.vjp(fn, *(jnp.asarray(x) for x in (q, k, v)))
        want = vjp((jnp.asarray(dout), jnp.asarray(dlse, jnp.float32)))
    assert all(np.abs(g).max() > 0 for g in (dq, dk, dv))
    assert not dq[-3:].any()  # rows without keys: zero gradients
    for got, w in zip((dq, dk, dv), want):
        np.testing.assert_allclose(got, np.asarray(w), rtol=1e-10, atol=1e-10)
