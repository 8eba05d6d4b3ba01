"""One bench/kernel.py case through FFA, for Nsight Compute or a jax.profiler trace.

    python cuda/tools/ncu_case.py causal_32k fwd            # 3 calls (ncu_profile.sh skips the first two)
    python cuda/tools/ncu_case.py causal_32k fwd --trace /tmp/t [--impl cudnn]
        # 10 timed calls (wall clock, as bench/kernel.py), then 10 traced: the GPU time per call of each
        # kernel, their sum, and what the wall clock holds beyond it (gaps between kernels, clocks)
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: the repository's bench package
from bench import kernel as bench  # noqa: E402
from bench.common import gpu_kernel_events, kernel_totals, newest_perfetto_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("mode", choices=["fwd", "fwd+bwd"])
    ap.add_argument("--impl", default="ffa", help="ffa, or a baseline of the case (cudnn)")
    ap.add_argument("--trace", type=pathlib.Path, default=None)
    a = ap.parse_args()
    case = next(c for c in bench.make_cases() if c.name == a.case)
    q, k, v = bench.case_inputs(case)
    f = bench.jitted(bench.ffa(case.mask) if a.impl == "ffa" else case.baselines[a.impl](), a.mode)
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
    events = [e for ks in gpu_kernel_events(newest_perfetto_trace(a.trace)).values() for e in ks]
    rows = [(name, us / calls) for name, us in kernel_totals(events)]
    busy = sum(t for _, t in rows)
    print(f"{a.case} {a.mode} {a.impl}: wall {wall_us:.0f} us per call, GPU kernels {busy:.0f} us per call")
    for name, t in rows[:12]:
        print(f"  {t:9.1f} us  {name[:120]}")


if __name__ == "__main__":
    main()
