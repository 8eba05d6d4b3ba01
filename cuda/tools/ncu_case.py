"""One bench/kernel.py case through FFA for Nsight Compute: two warm-up calls, then the calls ncu profiles
(cuda/tools/ncu_profile.sh picks the kernel by name and skips the warm-up launches).

    python cuda/tools/ncu_case.py causal_32k fwd
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernel", ROOT / "bench" / "kernel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(case_name: str, mode: str, calls: int = 3) -> None:
    bench = load_bench()
    case = next(c for c in bench.make_cases() if c.name == case_name)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, case.mask.total_seqlen_q, bench.H, case.head_dim), jnp.bfloat16)
               for kk in keys)
    fn = bench.ffa(case.mask)
    if mode == "fwd":
        f = jax.jit(fn)
    else:
        f = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    for _ in range(calls):
        jax.block_until_ready(f(q, k, v))
    print(f"{case_name} {mode}: {calls} calls done")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
