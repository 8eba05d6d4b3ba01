"""magi_jax.dot_product_attention as a drop-in for jax.nn.dot_product_attention in an attention layer.

The layer below is written against jax.nn's signature; passing `attend=magi_jax.dot_product_attention` swaps
the kernel, and `segment_ids` keeps packed documents apart without a [T, T] mask (jax.nn needs a dense `mask`
for that). The script runs both on the same packed batch and checks that outputs and gradients agree.

    python examples/drop_in_attention.py            # CPU or GPU, float32
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import magi_jax as mj


def attention_layer(params, x, segment_ids, *, heads: int, attend):
    """Causal self-attention of x [B, T, W] within documents, through `attend` (jax.nn's signature)."""
    B, T, W = x.shape
    q, k, v = (jnp.einsum("btw,wd->btd", x, params[n]).reshape(B, T, heads, -1) for n in ("wq", "wk", "wv"))
    if attend is jax.nn.dot_product_attention:  # jax.nn has no segment ids: a dense [B, 1, T, T] mask
        same_doc = documents(segment_ids)[:, :, None] == documents(segment_ids)[:, None, :]
        out = attend(q, k, v, mask=same_doc[:, None], is_causal=True)
    else:
        out = attend(q, k, v, is_causal=True, segment_ids=segment_ids, max_segments=8)
    return jnp.einsum("btd,dw->btw", out.reshape(B, T, -1), params["wo"])


def documents(segment_ids):
    """Run index of every token (a new run where the id changes), as magi_jax reads segment ids."""
    change = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return jnp.cumsum(change, axis=1)


def main() -> int:
    rng = np.random.default_rng(0)
    B, T, W, heads = 2, 256, 256, 4
    params = {n: jnp.asarray(rng.standard_normal((W, W)) / np.sqrt(W), jnp.float32) for n in ("wq", "wk", "wv", "wo")}
    x = jnp.asarray(rng.standard_normal((B, T, W)), jnp.float32)
    # Two sequences of packed documents: lengths 100 + 60 + 96, and 200 + 56.
    segment_ids = jnp.asarray(np.stack([np.repeat([1, 2, 3], [100, 60, 96]), np.repeat([1, 2], [200, 56])]))
    results = {}
    for name, attend in (("jax.nn", jax.nn.dot_product_attention), ("magi_jax", mj.dot_product_attention)):
        layer = functools.partial(attention_layer, heads=heads, attend=attend)
        loss = jax.jit(lambda p, x, s: (layer(p, x, s) ** 2).mean())
        results[name] = (loss(params, x, segment_ids), jax.jit(jax.grad(loss))(params, x, segment_ids))
    (l0, g0), (l1, g1) = results["jax.nn"], results["magi_jax"]
    grad_diff = max(float(jnp.abs(g0[n] - g1[n]).max()) for n in g0)
    print(f"loss: jax.nn {float(l0):.6f}, magi_jax {float(l1):.6f}; largest gradient difference {grad_diff:.2e}")
    ok = abs(float(l0) - float(l1)) <= 1e-5 * abs(float(l0)) and grad_diff <= 1e-4
    print("agree" if ok else "DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
