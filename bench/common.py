"""Timing and reporting shared by the benchmarks: median wall time, TFLOP/s on the unmasked area, a
markdown table appended to BENCHMARKS.md with date, machine, versions and command."""

from __future__ import annotations

import datetime
import gzip
import json
import math
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable, Sequence

import jax
import numpy as np

from magi_jax.planner.cli import positive_int  # noqa: F401  (argparse type of --rounds and other counts)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def doc_lengths(total: int, seed: int, mean: int = 4096, lo: int = 256) -> list[int]:
    """Exponential document lengths (mean `mean`, at least `lo`) filling `total` tokens: the document
    distribution of the peers' measurements (../shared/peers/anchors_varlen.py)."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < total:
        n = int(max(lo, rng.exponential(mean)))
        lens.append(min(n, total - sum(lens)))
    return lens


def median_seconds(fn: Callable, *args, warmup: int = 2, reps: int = 7, calls: int = 1) -> float:
    """Median wall seconds per call of fn(*args) over `reps` samples of `calls` back-to-back calls, after
    warm-up (compilation stays out of the numbers). calls > 1 times a step as a training loop runs it, each
    call dispatched while the previous one still runs; calls = 1 adds one dispatch-and-sync latency per
    call (larger for a program over several GPUs than for one)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def gpu_seconds_per_call(fn: Callable, *args, calls: int = 10) -> float | None:
    """GPU busy time per call of fn(*args): in a jax.profiler trace of `calls` back-to-back calls, the first
    GPU's kernels and copies split into the calls (each launches the same ones), each call's durations
    summed, the median over the calls. The median because the first column traced for a case read up to 11%
    above the same kernel traced next (BENCHMARKS.md 2026-11-30 20:50 UTC), by the look of it a start-of-trace
    effect on the first calls (the median's remedy is not yet measured on a GPU). None where the trace has no
    GPU events (the CPU). It holds no dispatch or launch gap, but the clock's drift stays in it. The kernels
    of one call must not overlap (one stream)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        trace = newest_perfetto_trace(pathlib.Path(log_dir))
        by_gpu = gpu_kernel_events(trace) if trace is not None else {}
    return busy_seconds_per_call(next(iter(by_gpu.values())), calls) if by_gpu else None


def busy_seconds_per_call(events: Sequence[dict], calls: int) -> float:
    """The median over `calls` calls of each one's summed event durations (trace microseconds), the events
    taken in start order, as many per call; the mean where they do not divide evenly."""
    durs = [e["dur"] for e in sorted(events, key=lambda e: e["ts"])]
    if len(durs) % calls:
        return sum(durs) * 1e-6 / calls
    per = len(durs) // calls
    return statistics.median(sum(durs[i * per:(i + 1) * per]) for i in range(calls)) * 1e-6


def attention_flops(area: int, heads_q: int, head_dim: int, backward: bool = False,
                    head_dim_v: int | None = None) -> float:
    """DESIGN.md section 5: forward 4 * area * Hq * D, forward+backward 3.5x that; with v at its own head dim
    (MLA), q k^T at D and p v at Dv: 2 * area * Hq * (D + Dv)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return 2.0 * area * heads_q * (head_dim + dv) * (3.5 if backward else 1.0)


def ratio_text(x: float) -> str:
    """A target ratio to three decimals, cut rather than rounded: a miss never reads as its target (0.9998 is
    0.999, not 1.000), and a ratio that meets a target of up to three decimals never reads below it."""
    return f"{math.floor(x * 1000) / 1000:.3f}"


def machine_line() -> str:
    devices = jax.devices()
    kind = devices[0].device_kind if devices[0].platform != "cpu" else platform.processor() or "CPU"
    import os
    return (f"{len(devices)} x {kind} ({devices[0].platform}, {os.cpu_count()} host cores), "
            f"jax {jax.__version__}, python {platform.python_version()}")


def newest_perfetto_trace(log_dir: pathlib.Path) -> pathlib.Path | None:
    """The perfetto trace jax.profiler.trace(log_dir, create_perfetto_trace=True) wrote last."""
    traces = sorted(log_dir.glob("plugins/profile/*/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    return traces[-1] if traces else None


def timed_events(trace: pathlib.Path) -> tuple[list[dict], dict[int, str]]:
    """The timed events of a jax.profiler perfetto trace (.json.gz) in trace order, and each process's name."""
    data = json.load(gzip.open(trace))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X" and "dur" in e], names


def gpu_kernel_events(trace: pathlib.Path) -> dict[str, list[dict]]:
    """The timed events (kernels, memcpys) of each GPU in a jax.profiler perfetto trace (.json.gz), by the
    GPU's process name, in trace order."""
    events, names = timed_events(trace)
    gpus = {pid: name for pid, name in names.items() if "gpu" in name.lower()}
    by_gpu: dict[str, list[dict]] = {name: [] for name in gpus.values()}
    for e in events:
        if e.get("pid") in gpus:
            by_gpu[gpus[e["pid"]]].append(e)
    return {name: ks for name, ks in sorted(by_gpu.items()) if ks}


def host_events(trace: pathlib.Path) -> list[dict]:
    """The timed events of the host's threads (every process not a GPU's) in a jax.profiler perfetto trace."""
    events, names = timed_events(trace)
    return [e for e in events if "gpu" not in names.get(e.get("pid"), "").lower()]


def kernel_totals(events: Sequence[dict]) -> list[tuple[str, float]]:
    """(name, total microseconds) of trace events, the longest first."""
    total: dict[str, float] = {}
    for e in events:
        total[e["name"]] = total.get(e["name"], 0.0) + e["dur"]
    return sorted(total.items(), key=lambda x: -x[1])


def last_step(events: Sequence[dict], steps: int) -> tuple[list[tuple[float, dict, float]], float, float]:
    """The last of `steps` identical steps in one GPU's events (the last len / steps by start time):
    (start from the step's first event, event, idle gap before it: no event of this GPU running) in start
    order, the step's span and its idle total, in the trace's microseconds."""
    ks = sorted(events, key=lambda e: e["ts"])
    step = ks[len(ks) - len(ks) // steps:]
    if not step:
        return [], 0.0, 0.0
    t0 = busy_until = step[0]["ts"]
    rows, idle = [], 0.0
    for e in step:
        gap = max(0.0, e["ts"] - busy_until)
        idle += gap
        busy_until = max(busy_until, e["ts"] + e["dur"])
        rows.append((e["ts"] - t0, e, gap))
    return rows, busy_until - t0, idle


def step_timeline(path: pathlib.Path, steps: int) -> None:
    """Per GPU, the last of `steps` identical steps: every kernel in start order with its start (ms from the
    step's first kernel), duration, and the idle gap before it, then the step's span and idle total: where
    a step's time goes that no kernel accounts for."""
    host = host_events(path)
    for gpu, ks in gpu_kernel_events(path).items():
        rows, span, idle = last_step(ks, steps)
        print(f"{gpu}: last step, {len(rows)} kernels")
        for start, e, gap in rows:
            print(f"  {start / 1e3:8.3f} ms  {e['dur'] / 1e3:7.3f} ms  idle before {gap / 1e3:6.3f}  {e['name'][:90]}")
        print(f"  span {span / 1e3:.3f} ms, idle {idle / 1e3:.3f} ms")
        if not rows:
            continue
        begin = rows[0][1]["ts"]
        before = [e["ts"] + e["dur"] for e in ks if e["ts"] < begin]
        if before:
            end = max(before)
            print(f"  GPU idle between the last two steps: {(begin - end) / 1e3:.3f} ms; the host's longest "
                  f"events in it (ms inside the gap, thread, name):")
            for us, e in overlapping(host, end, begin)[:8]:
                print(f"    {us / 1e3:7.3f}  {e.get('tid')}  {e['name'][:100]}")


def overlapping(events: Sequence[dict], t0: float, t1: float) -> list[tuple[float, dict]]:
    """(time inside [t0, t1), event) of the timed events that overlap that interval, the longest inside first."""
    inside = ((min(e["ts"] + e["dur"], t1) - max(e["ts"], t0), e) for e in events
              if e["ts"] < t1 and e["ts"] + e["dur"] > t0)
    return sorted(inside, key=lambda x: -x[0])


def call_latencies(host: Sequence[dict], gpu: Sequence[dict], marker: str) -> list[dict]:
    """Isolated calls in a trace: per host event named `marker` (a jax.profiler.TraceAnnotation around one call
    and its block_until_ready, the GPU idle before it), in microseconds from the marker's start: `first` the
    start of the first GPU event inside it (what the dispatch costs before the GPU starts), `last` the end of
    the last, `busy` their summed durations, `end` the marker's end (the host awake again), `events` them in
    start order, `start` the marker's own start (trace time). Markers without GPU events are left out."""
    calls = []
    for m in sorted((e for e in host if e["name"] == marker), key=lambda e: e["ts"]):
        t0, t1 = m["ts"], m["ts"] + m["dur"]
        inside = sorted((e for e in gpu if t0 <= e["ts"] < t1), key=lambda e: e["ts"])
        if inside:
            calls.append(dict(first=inside[0]["ts"] - t0, last=max(e["ts"] + e["dur"] for e in inside) - t0,
                              busy=sum(e["dur"] for e in inside), end=m["dur"], events=inside, start=t0))
    return calls


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line() -> str:
    """The command this process runs, as typed."""
    return "python " + " ".join(sys.argv) if sys.argv and sys.argv[0] else "python"


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def append_report(title: str, table: str, notes: str = "", path: pathlib.Path = ROOT / "BENCHMARKS.md") -> None:
    """Appends a dated section: title, machine, command, table, notes."""
    section = (f"\n## {title}, {utc_stamp()}\n\nMachine: {machine_line()}.  \nCommand: `{command_line()}`\n\n"
               f"{table}\n" + (f"\n{notes}\n" if notes else ""))
    if not path.exists():
        path.write_text("# Benchmarks\n\nEach section is one run, appended by the benchmark itself; numbers are "
                        "never copied forward.\n")
    with path.open("a") as f:
        f.write(section)
