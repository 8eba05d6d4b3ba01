"""CPU benchmark of the FFA custom call (issue: foundation).

At 8k tokens (varlen causal, 8 documents), 4 heads, D 64, float32: FFA forward and forward+backward against
jax.nn.dot_product_attention(implementation="xla") with the equivalent dense mask, and FFA's forward on the
whole causal mask of the same length, to check that time follows the unmasked area.

    python -m magi_jax bench --backend cpu [--seqlen 8192] [--no-append]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import magi_jax as mj
from bench.common import append_report, attention_flops, markdown_table, median_seconds, positive_int
from magi_jax import masks
from magi_jax.ffa import SUPPORTED_HEAD_DIMS


def document_lengths(total: int, count: int, seed: int = 0) -> list[int]:
    """`count` documents of random lengths (at least total / (4 count)) summing to `total`."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.25, 1.75, count)
    lengths = np.floor(weights / weights.sum() * total).astype(int)
    lengths[-1] += total - lengths.sum()
    return lengths.tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m magi_jax bench --backend cpu")
    parser.add_argument("--seqlen", type=positive_int, default=8192, help="at least 8 tokens per document")
    parser.add_argument("--docs", type=positive_int, default=8)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--head-dim", type=int, choices=SUPPORTED_HEAD_DIMS, default=64)
    parser.add_argument("--no-append", action="store_true", help="print only; do not touch BENCHMARKS.md")
    args = parser.parse_args(argv)
    # document_lengths gives each document at least 1/7 of the mean length: 8 tokens a document keep it >= 1.
    if args.seqlen < 8 * args.docs:
        parser.error(f"argument --seqlen: {args.seqlen} tokens for --docs {args.docs}: at least 8 a document")
    t, h, d = args.seqlen, args.heads, args.head_dim
    lengths = document_lengths(t, args.docs)
    cases = {"varlen causal": masks.varlen_causal(lengths), "whole causal": masks.causal(t)}
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32) for _ in range(3))

    rows, seconds = [], {}
    for name, mask in cases.items():
        qr, kr, types = (jnp.asarray(x) for x in mask.kernel_args())
        ffa = jax.jit(lambda q, k, v, qr, kr, types: mj.flex_flash_attn(q, k, v, qr, kr, types)[0])
        seconds[name] = median_seconds(ffa, q, k, v, qr, kr, types)
        flops = attention_flops(mask.area(), h, d)
        rows.append([name, "FFA custom call", f"{mask.area():,}", f"{seconds[name] * 1e3:.1f}",
                     f"{flops / seconds[name] / 1e9:.1f}"])
        print(rows[-1], flush=True)

    # XLA dense attention on the same varlen mask, as a [1, 1, T, T] boolean mask.
    mask = cases["varlen causal"]
    dense = jnp.asarray(mask.to_dense() > 0)[None, None]
    xla = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q[None], k[None], v[None], mask=m,
                                                                  implementation="xla")[0])
    want = jax.jit(lambda q, k, v, qr, kr, types: mj.flex_flash_attn(q, k, v, qr, kr, types)[0])(
        q, k, v, *(jnp.asarray(x) for x in mask.kernel_args()))
    np.testing.assert_allclose(xla(q, k, v, dense), want, atol=2e-5, rtol=2e-5)  # same function first
    seconds["xla"] = median_seconds(xla, q, k, v, dense, reps=3)
    rows.append(["varlen causal", "jax.nn.dot_product_attention xla, dense mask", f"{mask.area():,}",
                 f"{seconds['xla'] * 1e3:.1f}", f"{attention_flops(mask.area(), h, d) / seconds['xla'] / 1e9:.1f}"])
    print(rows[-1], flush=True)

    # Forward+backward on the varlen mask (gradients of q, k, v for a random cotangent of out): 3.5x the
    # forward's FLOPs, as bench/kernel.py counts them.
    cotangent = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    kernel_args = tuple(jnp.asarray(x) for x in mask.kernel_args())
    grads = lambda attn: jax.jit(jax.grad(lambda q, k, v, *rest: jnp.sum(attn(q, k, v, *rest) * cotangent),
                                          argnums=(0, 1, 2)))
    ffa_grads = grads(lambda q, k, v, qr, kr, types: mj.flex_flash_attn(q, k, v, qr, kr, types)[0])
    xla_grads = grads(xla)
    for got, want in zip(ffa_grads(q, k, v, *kernel_args), xla_grads(q, k, v, dense)):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    for key, name, fn, fn_args, reps in (("ffa fwd+bwd", "FFA custom calls", ffa_grads, kernel_args, 5),
                                         ("xla fwd+bwd", "jax.nn.dot_product_attention xla, dense mask",
                                          xla_grads, (dense,), 3)):
        seconds[key] = median_seconds(fn, q, k, v, *fn_args, reps=reps)
        rows.append(["varlen causal, fwd+bwd", name, f"{mask.area():,}", f"{seconds[key] * 1e3:.1f}",
                     f"{3.5 * attention_flops(mask.area(), h, d) / seconds[key] / 1e9:.1f}"])
        print(rows[-1], flush=True)

    area_ratio = cases["whole causal"].area() / cases["varlen causal"].area()
    time_ratio = seconds["whole causal"] / seconds["varlen causal"]
    follows = max(time_ratio / area_ratio, area_ratio / time_ratio)
    notes = (f"Float32, {t} tokens, {args.docs} documents {lengths}, {h} heads, D {d}; forward unless marked "
             f"fwd+bwd. FFA vs XLA dense: {seconds['xla'] / seconds['varlen causal']:.1f}x faster forward, "
             f"{seconds['xla fwd+bwd'] / seconds['ffa fwd+bwd']:.1f}x forward+backward. Whole causal / varlen "
             f"causal: area ratio {area_ratio:.2f}, time ratio {time_ratio:.2f} ({follows:.2f}x apart; bar 1.3x). "
             "GFLOP/s on the unmasked area.")
    table = markdown_table(["mask", "implementation", "area", "ms", "GFLOP/s"], rows)
    print(table + "\n\n" + notes)
    if not args.no_append:
        append_report("CPU kernel: FFA vs XLA dense, forward and forward+backward", table, notes)
    return 0
