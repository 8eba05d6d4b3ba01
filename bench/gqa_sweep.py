"""Where the sm90 backward's GQA split pays: forward+backward of varlen causal masks over tokens and kv heads,
with the split off, on, and as the library picks it (cuda/launch.h BwdSm90GqaSplit), side by side in one
process (the handler reads MAGI_JAX_SM90_BWD_GQA_SPLIT at every call, so one jit serves all three).

    python bench/gqa_sweep.py [--tokens 8192 16384 32768] [--kv-heads 8 4 2 1] [--rounds 3] [--stage-call]

prints a markdown row per (tokens, kv heads): the backward's CTAs without and with the split (fewer than the
device's SMs leave SMs idle, and the library splits: BwdSm90GqaSplit), ms per call of each setting (the
median of its rounds, settings in turn in each round) and off / auto, on / off. --stage-call times instead the
backward call of a staged distributed backward's stage (every key a second source's, K and V packed:
magi_jax/dist_attn.py).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.common import doc_lengths, median_seconds  # noqa: E402
from bench.kernel import D, H, ffa, jitted  # noqa: E402
from magi_jax import ffa as ffa_ops, masks  # noqa: E402

SETTINGS = {"off": "0", "on": "1", "auto": ""}  # "": unset, the library's choice
K_BLOCK = 128  # keys per CTA of the sm90 backward at D 128 (cuda/tile_size_sm90.h BwdSm90Tile)


def stage_call(mask, q, k, v):
    """The backward call of a stage (ffa._bwd_call, keys only in a packed second source) and its inputs."""
    qr, kr, types = (jnp.asarray(a) for a in mask.kernel_args())
    q, k, v = q[0], k[0], v[0]
    out, lse = ffa_ops._fwd_call(q, k, v, qr, kr, types, D ** -0.5, 0.0)
    none = jnp.zeros((0, *k.shape[1:]), k.dtype)
    call = jax.jit(lambda q, kv, out, lse: ffa_ops._bwd_call(
        q, none, none, out, out, lse, jnp.zeros_like(lse), qr, kr, types, D ** -0.5, 0.0, False, k2=kv))
    return call, (q, jnp.stack([k, v], axis=1), out, lse)


def sweep_row(tokens: int, kv_heads: int, rounds: int, calls: int = 10, stage: bool = False) -> dict[str, float]:
    """Median ms per forward+backward call (stage: per stage backward call) of each setting (each round's
    sample: 5 x `calls` calls)."""
    mask = masks.varlen_causal(doc_lengths(tokens, seed=tokens))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, tokens, h, D), jnp.bfloat16) for kk, h in zip(keys, (H, kv_heads, kv_heads)))
    step, args = stage_call(mask, q, k, v) if stage else (jitted(ffa(mask), "fwd+bwd"), (q, k, v))
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, value in SETTINGS.items():
            os.environ["MAGI_JAX_SM90_BWD_GQA_SPLIT"] = value
            times[name].append(median_seconds(step, *args, reps=5, calls=calls) * 1e3)
    os.environ.pop("MAGI_JAX_SM90_BWD_GQA_SPLIT")
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[8, 4, 2, 1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stage-call", action="store_true")
    a = ap.parse_args()
    what = "a stage's backward call (keys packed in the second source)" if a.stage_call else "forward+backward"
    device = jax.devices()[0]
    print(f"{device.device_kind} ({getattr(device, 'core_count', '?')} SMs); jax {jax.__version__}; bf16, {H} q "
          f"heads, D {D}, varlen causal, {what}: ms per call; CTAs off / on: the backward's (k block, kv head) "
          f"and (k block, q head) tiles")
    print("| tokens | kv heads | CTAs off / on | off | on | auto | off / auto | on / off |\n"
          "|---|---|---|---|---|---|---|---|")
    for tokens in a.tokens:
        for kv_heads in a.kv_heads:
            t = sweep_row(tokens, kv_heads, a.rounds, stage=a.stage_call)
            k_blocks = -(-tokens // K_BLOCK)
            print(f"| {tokens} | {kv_heads} | {k_blocks * kv_heads} / {k_blocks * H} | {t['off']:.3f} | "
                  f"{t['on']:.3f} | {t['auto']:.3f} | {t['off'] / t['auto']:.3f} | {t['on'] / t['off']:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
