"""`python -m magi_jax demo`: flexible attention through the custom calls on two masks, checked against
float64, timed, and plotted."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import magi_jax as mj
from magi_jax import masks
from magi_jax.planner.cli import int_at_least
from magi_jax.reference import attention_dense, attention_f64, error_and_bound


def _timed(fn, *args, reps: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def run_mask(name: str, mask: mj.AttnMask, heads: int, head_dim: int, dtype, seed: int) -> bool:
    rng = np.random.default_rng(seed)
    t = mask.total_seqlen_q
    q, k, v = (jnp.asarray(rng.standard_normal((t, heads, head_dim)), dtype) for _ in range(3))
    dout = jnp.asarray(rng.standard_normal((t, heads, head_dim)), dtype)
    qr, kr, types = (jnp.asarray(x) for x in mask.kernel_args())

    fwd = jax.jit(lambda q, k, v, qr, kr, types: mj.flex_flash_attn(q, k, v, qr, kr, types))
    def fwd_bwd(q, k, v, qr, kr, types):
        (out, lse), vjp = jax.vjp(lambda q, k, v: mj.flex_flash_attn(q, k, v, qr, kr, types), q, k, v)
        return out, lse, *vjp((dout, jnp.zeros_like(lse)))
    fwd_bwd = jax.jit(fwd_bwd)

    got = fwd_bwd(q, k, v, qr, kr, types)
    ref64 = attention_f64(q, k, v, mask, dout=dout)
    (lp_out, lp_lse), lp_vjp = jax.vjp(lambda q, k, v: attention_dense(q, k, v, mask.to_dense()), q, k, v)
    ref_lp = (lp_out, lp_lse, *lp_vjp((dout, jnp.zeros_like(lp_lse))))

    ok = True
    print(f"\n{name}: {mask.num_slices} slices, {t} tokens, area {mask.area():,} "
          f"({mask.area() / t / t:.1%} of dense), {heads} heads, D {head_dim}, {jnp.dtype(dtype).name}")
    for label, g, r, l in zip(("out", "lse", "dq", "dk", "dv"), got, ref64, ref_lp):
        err, bound = error_and_bound(g, r, l)
        rel = err / max(np.linalg.norm(np.where(np.isfinite(r), r, 0)), 1e-30)
        ok &= err <= bound
        print(f"  {label:4s} relative error vs float64 {rel:.2e}   ({'within' if err <= bound else 'OUTSIDE'} "
              f"tolerance: {err:.2e} <= {bound:.2e})")
    flops = 4.0 * mask.area() * heads * head_dim
    t_fwd = _timed(fwd, q, k, v, qr, kr, types)
    t_all = _timed(fwd_bwd, q, k, v, qr, kr, types)
    print(f"  forward {t_fwd * 1e3:.1f} ms ({flops / t_fwd / 1e12:.3f} TFLOP/s);  forward+backward "
          f"{t_all * 1e3:.1f} ms ({3.5 * flops / t_all / 1e12:.3f} TFLOP/s)  on {jax.devices()[0].device_kind}")
    path = f"mask_{name.replace(' ', '_')}.png"
    mask.plot(path, title=name)
    print(f"  mask plot: {path}")
    return ok


# The smallest --seqlen whose every document and answer below (the shortest is seqlen // 16) is non-empty.
MIN_SEQLEN = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m magi_jax demo")
    parser.add_argument("--seqlen", type=int_at_least(MIN_SEQLEN), default=2048, help="tokens per mask")
    args = parser.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    t = args.seqlen
    lengths = [t // 2, t // 8, t // 4, t - t // 2 - t // 8 - t // 4]
    question = t // 16  # two samples: a question with three answers, and one with two
    last_answer = t - 2 * question - 3 * (t // 8) - t // 4
    cases = {"varlen causal": masks.varlen_causal(lengths),
             "shared question": masks.shared_question([(question, [t // 8] * 3),
                                                       (question, [t // 4, last_answer])])}
    ok = all([run_mask(name, mask, 4, 64, dtype, seed) for seed, (name, mask) in enumerate(cases.items())])
    print("\nall results within the tolerance of DESIGN.md section 5" if ok else "\nSOME RESULTS OUTSIDE TOLERANCE")
    return 0 if ok else 1
