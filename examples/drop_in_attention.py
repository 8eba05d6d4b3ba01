"""magi_jax.dot_product_attention as a drop-in for jax.nn.dot_product_attention in an attention layer.

The layer below is written against jax.nn's signature; passing `attend=magi_jax.dot_product_attention` swaps
the kernel, and `segment_ids` keeps packed documents apart without a [T, T] mask (jax.nn needs a dense `mask`
for that). The script runs both on the same packed batch and checks that outputs and gradients agree. Then it
runs magi_jax's step again under jit on four CPU devices, the batch split over "dp" and the heads over "tp"
(Megatron-style projections, no shard_map): the attention runs on each device's own sequences and heads, and
the step gathers nothing.

    python examples/drop_in_attention.py            # CPU or GPU, float32
"""

from __future__ import annotations

import functools
import os

# Four host devices for the sharded step; set before jax starts its CPU backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np

import magi_jax as mj
from jax.sharding import NamedSharding, PartitionSpec as P


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
    return 0 if ok and sharded_step_agrees(params, x, segment_ids, heads, l1, g1) else 1


def sharded_step_agrees(params, x, segment_ids, heads: int, loss_want, grads_want) -> bool:
    """magi_jax's step on a (dp 2, tp 2) mesh of CPU devices: x and the segment ids split over dp, the q / k /
    v projections' columns (whole heads) and the output projection's rows over tp."""
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices("cpu")[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)   # XLA places what the inputs leave open
    place = lambda a, *spec: jax.device_put(jax.device_get(a), NamedSharding(mesh, P(*spec)))
    params = {n: place(w, None, "tp") if n != "wo" else place(w, "tp", None) for n, w in params.items()}
    x, segment_ids = place(x, "dp"), place(segment_ids, "dp")
    layer = functools.partial(attention_layer, heads=heads, attend=mj.dot_product_attention)
    step = jax.jit(jax.value_and_grad(lambda p, x, s: (layer(p, x, s) ** 2).mean()))
    with jax.set_mesh(mesh):
        loss, grads = step(params, x, segment_ids)
        gathers = step.lower(params, x, segment_ids).compile().as_text().count("all-gather")
    grad_diff = max(float(jnp.abs(jax.device_get(grads[n]) - jax.device_get(grads_want[n])).max()) for n in grads)
    print(f"sharded over (dp 2, tp 2): loss {float(loss):.6f}, largest gradient difference {grad_diff:.2e}, "
          f"all-gathers in the step: {gathers}")
    ok = abs(float(loss) - float(loss_want)) <= 1e-5 * abs(float(loss_want)) and grad_diff <= 1e-4 and gathers == 0
    print("agree" if ok else "DIFFER")
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
