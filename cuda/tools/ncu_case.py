"""One bench/kernel.py case through FFA, for Nsight Compute or a jax.profiler trace.

    python cuda/tools/ncu_case.py causal_32k fwd            # 3 calls (ncu_profile.sh skips the first two)
    python cuda/tools/ncu_case.py causal_32k fwd --trace /tmp/t [--impl cudnn]
        # 10 timed calls (wall clock, as bench/kernel.py), then 10 traced: the GPU time per call of each
        # kernel, their sum, and what the wall clock holds beyond it (gaps between kernels, clocks)
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernel", ROOT / "bench" / "kernel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def kernel_times(trace_dir: pathlib.Path, calls: int) -> list[tuple[str, float]]:
    """(kernel name, microseconds per call) on the GPU, from the newest perfetto trace in trace_dir."""
    path = sorted(trace_dir.glob("plugins/profile/*/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)[-1]
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in names.items() if "gpu" in name.lower()}
    total: dict[str, float] = {}
    for e in events:
        if e.get("pid") in gpu and e.get("ph") == "X" and "dur" in e:
            total[e["name"]] = total.get(e["name"], 0.0) + e["dur"]
    return sorted(((n, t / calls) for n, t in total.items()), key=lambda x: -x[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("mode", choices=["fwd", "fwd+bwd"])
    ap.add_argument("--impl", default="ffa", help="ffa, or a baseline of the case (cudnn)")
    ap.add_argument("--trace", type=pathlib.Path, default=None)
    a = ap.parse_args()
    bench = load_bench()
    case = next(c for c in bench.make_cases() if c.name == a.case)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, case.mask.total_seqlen_q, bench.H, case.head_dim), jnp.bfloat16)
               for kk in keys)
    fn = bench.ffa(case.mask) if a.impl == "ffa" else case.baselines[a.impl]()
    if a.mode == "fwd":
        f = jax.jit(fn)
    else:
        f = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    calls = 3 if a.trace is None else 10
    for _ in range(2 if a.trace is not None else calls):
        jax.block_until_ready(f(q, k, v))
    if a.trace is None:
        print(f"{a.case} {a.mode}: {calls} calls done")
        return
    t0 = time.perf_counter()
    for _ in range(calls):
        out = f(q, k, v)
    jax.block_until_ready(out)
    wall_us = (time.perf_counter() - t0) / calls * 1e6
    with jax.profiler.trace(str(a.trace), create_perfetto_trace=True):
        for _ in range(calls):
            out = f(q, k, v)
        jax.block_until_ready(out)
    rows = kernel_times(a.trace, calls)
    busy = sum(t for _, t in rows)
    print(f"{a.case} {a.mode} {a.impl}: wall {wall_us:.0f} us per call, GPU kernels {busy:.0f} us per call")
    for name, t in rows[:12]:
        print(f"  {t:9.1f} us  {name[:120]}")


if __name__ == "__main__":
    main()
