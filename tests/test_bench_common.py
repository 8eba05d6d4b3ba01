"""bench/common.py's timing (on a fake clock) and its trace readers (used by bench/dist.py --profile and
cuda/tools/ncu_case.py --trace, on a made-up perfetto trace): no GPU needed."""

from __future__ import annotations

import gzip
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import bench.common  # noqa: E402
from bench.common import (busy_seconds_per_call, call_latencies, gpu_kernel_events, host_events,  # noqa: E402
                          kernel_totals, last_step, median_seconds, newest_perfetto_trace, overlapping)


def test_median_seconds_is_per_call_over_back_to_back_calls(monkeypatch):
    # A fake clock that each call of fn advances by 1 s: every sample of 4 calls reads 4 s, 1 s per call.
    clock = {"now": 0.0, "calls": 0}

    def fn(x):
        clock["now"] += 1.0
        clock["calls"] += 1
        return x

    monkeypatch.setattr(bench.common.time, "perf_counter", lambda: clock["now"])
    assert median_seconds(fn, 3, warmup=2, reps=5, calls=4) == 1.0
    assert clock["calls"] == 2 + 5 * 4


def test_gpu_kernel_events_and_totals(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 3, "name": "flash", "ts": 0.0, "dur": 5.0},
        {"ph": "X", "pid": 3, "name": "nccl", "ts": 1.0, "dur": 2.0},
        {"ph": "X", "pid": 3, "name": "flash", "ts": 9.0, "dur": 4.0},
        {"ph": "X", "pid": 1, "name": "host op", "ts": 0.0, "dur": 50.0},   # not a GPU's
        {"ph": "i", "pid": 7, "name": "marker", "ts": 0.0},                   # no duration
    ]
    folder = tmp_path / "plugins" / "profile" / "run1"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace = newest_perfetto_trace(tmp_path)
    assert trace == folder / "perfetto_trace.json.gz"
    by_gpu = gpu_kernel_events(trace)
    assert list(by_gpu) == ["/device:GPU:0"]        # GPU 1 has no timed event, the host is not a GPU
    assert [e["name"] for e in by_gpu["/device:GPU:0"]] == ["flash", "nccl", "flash"]
    assert kernel_totals(by_gpu["/device:GPU:0"]) == [("flash", 9.0), ("nccl", 2.0)]
    assert [e["name"] for e in host_events(trace)] == ["host op"]     # timed, of a process not a GPU's
    assert newest_perfetto_trace(tmp_path / "empty") is None


def test_last_step_finds_idle_gaps():
    # Two identical steps; in each, a 2 us gap after the first kernel, and an NCCL kernel under the second.
    step = [("fwd", 0.0, 5.0), ("fwd", 7.0, 4.0), ("nccl", 8.0, 5.0)]
    events = [{"name": n, "ts": t + 100.0 * s, "dur": d} for s in range(2) for n, t, d in step]
    rows, span, idle = last_step(events[::-1], steps=2)     # any input order
    assert [(start, e["name"], gap) for start, e, gap in rows] == [(0.0, "fwd", 0.0), (7.0, "fwd", 2.0),
                                                                  (8.0, "nccl", 0.0)]
    assert (span, idle) == (13.0, 2.0)
    assert last_step([], steps=3) == ([], 0.0, 0.0)


def test_positive_int_names_the_bound():
    import argparse
    import pytest
    assert bench.common.positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 1, got 0"):
        bench.common.positive_int("0")


def test_busy_seconds_per_call_is_the_median_call():
    # Three calls of two kernels each; the first call ran slow (a trace's first calls do).
    events = [{"ts": 10.0 * i, "dur": d} for i, d in enumerate([9.0, 5.0, 3.0, 2.0, 3.0, 2.5])]
    assert busy_seconds_per_call(events[::-1], calls=3) == pytest.approx(5.5e-6)   # calls: 14, 5, 5.5
    assert busy_seconds_per_call(events[:5], calls=3) == pytest.approx(22.0e-6 / 3)  # uneven: the mean


def test_call_latencies_split_each_lone_call():
    # Two calls (markers on the host); the first's kernels start 40 us into it, the second's 15 us; a kernel
    # between the markers belongs to neither; a marker without kernels is left out.
    host = [{"name": "magi_isolated_call", "ts": 100.0, "dur": 200.0},
            {"name": "dispatch", "ts": 100.0, "dur": 30.0},
            {"name": "magi_isolated_call", "ts": 500.0, "dur": 100.0},
            {"name": "magi_isolated_call", "ts": 900.0, "dur": 10.0}]
    gpu = [{"name": "prep", "ts": 140.0, "dur": 5.0}, {"name": "attn", "ts": 150.0, "dur": 100.0},
           {"name": "stray", "ts": 400.0, "dur": 10.0}, {"name": "attn", "ts": 515.0, "dur": 60.0}]
    calls = call_latencies(host, gpu, "magi_isolated_call")
    assert [(c["first"], c["last"], c["end"], c["busy"]) for c in calls] == [(40.0, 150.0, 200.0, 105.0),
                                                                             (15.0, 75.0, 100.0, 60.0)]
    assert [e["name"] for e in calls[0]["events"]] == ["prep", "attn"] and [c["start"] for c in calls] == [100.0, 500.0]


def test_overlapping_measures_each_event_inside_the_interval():
    events = [{"name": "a", "ts": 0.0, "dur": 15.0}, {"name": "b", "ts": 12.0, "dur": 30.0},
              {"name": "c", "ts": 20.0, "dur": 5.0}, {"name": "d", "ts": 30.0, "dur": 5.0}]
    assert [(us, e["name"]) for us, e in overlapping(events, 10.0, 30.0)] == [(18.0, "b"), (5.0, "a"), (5.0, "c")]
