"""bench/common.py's trace readers (used by bench/dist.py --profile and cuda/tools/ncu_case.py --trace), on
a made-up perfetto trace: no GPU needed."""

from __future__ import annotations

import gzip
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench.common import gpu_kernel_events, kernel_totals, newest_perfetto_trace  # noqa: E402


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
    assert newest_perfetto_trace(tmp_path / "empty") is None
