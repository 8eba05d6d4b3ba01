"""bench/kernel.py cases through FFA, for Nsight Compute or a jax.profiler trace.

    python cuda/tools/ncu_case.py causal_32k fwd            # 3 calls (ncu_profile.sh skips the first two)
    python cuda/tools/ncu_case.py causal_32k varlen_swa1024_32k fwd
        # each case's 3 calls in turn, in one process: under ncu, every third launch is a case's measured one
        # (cuda/tools/ncu_csv.py --every 3), without a process start per case
    python cuda/tools/ncu_case.py causal_32k fwd --trace /tmp/t [--impl cudnn]
        # 10 timed calls (wall clock, as bench/kernel.py), then 10 traced: the GPU time per call of each
        # kernel, their sum, and what the wall clock holds beyond it: the last call's kernels with the idle
        # before each, and the host's longest events while the GPU waited for that call
    python cuda/tools/ncu_case.py varlen_swa1024_32k fwd --isolated 5 [--impl cudnn]
        # 20 lone calls (each synchronised, then a pause) without the profiler: their wall time; then 5 traced:
        # per call when its first kernel starts after the host's dispatch begins, when its last ends, and when
        # the host is awake again; the host's longest events before the first kernel
    python cuda/tools/ncu_case.py varlen_swa1024_32k fwd --chain 10 [--impl cudnn]
        # the wall time per call of 10 separate calls against 10 calls chained inside one jit (each call's q
        # the last one's output), as a training step runs its layers: what dispatching each call costs
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: the repository's bench package
from bench import kernel as bench  # noqa: E402
from bench.common import (call_latencies, gpu_kernel_events, host_events, kernel_totals,  # noqa: E402
                          newest_perfetto_trace, overlapping, step_timeline)


def chained(f, fn, a, q, k, v) -> None:
    """Wall time per call: a.chain separate calls of f against one jit running a.chain calls in a row (the
    forward's output, or dq, is the next call's q: nothing is hoisted out of the loop)."""
    step = (lambda q: fn(q, k, v).astype(q.dtype)) if a.mode == "fwd" else (
        lambda q: jax.grad(lambda q, k, v: fn(q, k, v).astype(jax.numpy.float32).sum(), argnums=(0, 1, 2))(
            q, k, v)[0].astype(q.dtype))
    loop = jax.jit(lambda q: jax.lax.fori_loop(0, a.chain, lambda _, x: step(x), q))
    for fun, args in ((f, (q, k, v)), (loop, (q,))):
        jax.block_until_ready(fun(*args))
    times = {"separate": [], "chained": []}
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(a.chain):
            out = f(q, k, v)
        jax.block_until_ready(out)
        times["separate"].append((time.perf_counter() - t0) / a.chain)
        t0 = time.perf_counter()
        jax.block_until_ready(loop(q))
        times["chained"].append((time.perf_counter() - t0) / a.chain)
    sep, chn = (statistics.median(times[n]) * 1e6 for n in ("separate", "chained"))
    print(f"{a.case} {a.mode} {a.impl}: {a.chain} calls, us per call: separate {sep:.1f}, chained in one jit "
          f"{chn:.1f} ({sep - chn:+.1f})")


def isolated(f, a, q, k, v) -> None:
    """Lone calls, each synchronised and followed by a pause: 20 timed by the wall clock, then a.isolated under
    the profiler: where a lone call's wall time goes beyond its kernels (bench/kernel.py's samples of 10 start
    with one such call)."""
    for _ in range(2):
        jax.block_until_ready(f(q, k, v))
    walls = []  # first without the profiler, which slows the host
    for _ in range(20):
        time.sleep(0.002)
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, k, v))
        walls.append((time.perf_counter() - t0) * 1e6)
    print(f"{a.case} {a.mode} {a.impl}: lone call wall, untraced: median {statistics.median(walls):.1f} us, "
          f"min {min(walls):.1f}")
    with jax.profiler.trace(str(a.trace), create_perfetto_trace=True):
        for _ in range(a.isolated):
            time.sleep(0.002)
            with jax.profiler.TraceAnnotation("magi_isolated_call"):
                jax.block_until_ready(f(q, k, v))
    trace = newest_perfetto_trace(a.trace)
    host = host_events(trace)
    gpu = [e for ks in gpu_kernel_events(trace).values() for e in ks]
    calls = call_latencies(host, gpu, "magi_isolated_call")
    print(f"{a.case} {a.mode} {a.impl}: {len(calls)} isolated calls, us from the dispatch's start: first kernel, "
          f"last kernel's end, host awake (GPU busy)")
    for c in calls:
        print(f"  {c['first']:8.1f} {c['last']:8.1f} {c['end']:8.1f}  ({c['busy']:.1f})")
    if calls:
        c = calls[len(calls) // 2]
        print("the middle call's kernels (start, duration, us):")
        for e in c["events"]:
            print(f"  {e['ts'] - c['events'][0]['ts'] + c['first']:8.1f} {e['dur']:8.1f}  {e['name'][:90]}")
        inside = [(us, e) for us, e in overlapping(host, c["start"], c["start"] + c["first"])
                  if e["name"] != "magi_isolated_call"]
        print("the host's longest events before its first kernel (us inside, thread, name):")
        for us, e in inside[:12]:
            print(f"  {us:8.1f}  {e.get('tid')}  {e['name'][:100]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help="bench/kernel.py case names (several: plain calls only)")
    ap.add_argument("mode", choices=["fwd", "fwd+bwd"])
    ap.add_argument("--impl", default="ffa", help="ffa, or a baseline of the case (cudnn)")
    ap.add_argument("--trace", type=pathlib.Path, default=None)
    ap.add_argument("--chain", type=int, default=0, help="compare N separate calls with N chained in one jit")
    ap.add_argument("--isolated", type=int, default=0, help="trace N lone calls (needs --trace DIR)")
    a = ap.parse_args()
    cases = {c.name: c for c in bench.make_cases()}
    if len(a.cases) > 1 and (a.trace or a.chain or a.isolated):
        ap.error("--trace, --chain and --isolated take one case")

    def prepared(name: str):
        case = cases[name]
        fn = bench.ffa(case.mask) if a.impl == "ffa" else case.baselines[a.impl]()
        return fn, bench.jitted(fn, a.mode), bench.case_inputs(case)

    if len(a.cases) > 1:
        for name in a.cases:
            _, f, args = prepared(name)
            for _ in range(3):
                jax.block_until_ready(f(*args))
            print(f"{name} {a.mode}: 3 calls done")
        return
    a.case = a.cases[0]
    fn, f, (q, k, v) = prepared(a.case)
    if a.chain:
        chained(f, fn, a, q, k, v)
        return
    if a.isolated:
        if a.trace is None:
            ap.error("--isolated needs --trace DIR")
        isolated(f, a, q, k, v)
        return
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
    trace = newest_perfetto_trace(a.trace)
    events = [e for ks in gpu_kernel_events(trace).values() for e in ks]
    rows = [(name, us / calls) for name, us in kernel_totals(events)]
    busy = sum(t for _, t in rows)
    print(f"{a.case} {a.mode} {a.impl}: wall {wall_us:.0f} us per call, GPU kernels {busy:.0f} us per call")
    for name, t in rows[:12]:
        print(f"  {t:9.1f} us  {name[:120]}")
    step_timeline(trace, calls)


if __name__ == "__main__":
    main()
