"""Clock and power of the GPUs while one implementation runs back to back, phase after phase: is the H200 at its
power cap during these kernels (so that work skipped saves time, while work overlapped may only lower the clock)?

    python cuda/tools/power_probe.py kernel --cases causal_32k varlen_swa1024_32k --impls ffa cudnn
    python cuda/tools/power_probe.py dist --methods magi single        # 2 GPUs, bench/dist.py's varlen causal

Each phase runs one (case or mask, pass, implementation) for --seconds of back-to-back calls while
nvidia-smi samples every GPU every --interval-ms; per phase it prints the time per call, the energy per call
(NVML's total energy counters of the GPUs: at the cap, time per call follows it) and, per GPU, the mean SM
clock, power draw and how often a power-cap reason was active (clocks_event_reasons: 0x4 software power cap,
0x80 hardware power brake). An idle phase comes first, as the baseline. nvidia-smi's power.draw is a smoothed
reading that lags short phases; the energy counters do not (read over >= 2 s: they update every few ms).
`--data random qk0` adds each kernel phase again with q and k zeroed: the same instructions on operands that do
not toggle, which prices the data's share of the energy (BENCHMARKS.md 2026-12-04, 29th session).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Callable

import jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: the repository's bench package

FIELDS = "timestamp,index,clocks.sm,power.draw,clocks_event_reasons.active"
POWER_CAP_BITS = 0x4 | 0x80


def energy_reader() -> Callable[[], float] | None:
    """A reader of the GPUs' summed total energy (NVML counters, millijoules since the driver loaded), or None
    where NVML is missing (the CPU)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    count = ctypes.c_uint()
    if nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return None
    handles = [ctypes.c_void_p() for _ in range(count.value)]
    for i, h in enumerate(handles):
        if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) != 0:
            return None

    def read() -> float:
        total = 0.0
        for h in handles:
            e = ctypes.c_ulonglong()
            nvml.nvmlDeviceGetTotalEnergyConsumption(h, ctypes.byref(e))
            total += e.value
        return total
    return read


def run_phase(fn: Callable, inputs: tuple, seconds: float,
              energy: Callable[[], float] | None = None) -> tuple[float, float, float, float]:
    """(start, end, seconds per call, millijoules per call or nan) of back-to-back calls for about `seconds`,
    synchronised every 10, after a quarter of that to reach the clock's steady state."""
    jax.block_until_ready(fn(*inputs))
    for timed in (False, True):
        calls, start = 0, time.time()
        e0 = energy() if timed and energy else float("nan")
        while time.time() - start < (seconds if timed else seconds / 4):
            for _ in range(10):
                out = fn(*inputs)
            jax.block_until_ready(out)
            calls += 10
        end = time.time()
    mj = (energy() - e0) / calls if energy else float("nan")
    return start, end, (end - start) / calls, mj


def parse_samples(path: pathlib.Path) -> list[tuple[float, int, float, float, int]]:
    """(unix time, gpu, SM MHz, watts, reasons) per nvidia-smi line; lines it could not read are skipped."""
    rows = []
    with path.open() as f:
        for rec in csv.reader(f):
            try:
                stamp = datetime.datetime.strptime(rec[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
                stamp = stamp.replace(tzinfo=datetime.timezone.utc).timestamp()  # nvidia-smi runs with TZ=UTC
                rows.append((stamp, int(rec[1]), float(rec[2]), float(rec[3]), int(rec[4].strip(), 16)))
            except (ValueError, IndexError):
                continue
    return rows


def summarize(samples, phases) -> None:
    for name, start, end, per_call, mj in phases:
        inside = [s for s in samples if start <= s[0] <= end]
        line = (f"{name:48s} {per_call * 1e3:9.3f} ms/call {mj:9.1f} mJ/call ({mj / per_call / 1e3:4.0f} W)"
                if per_call else f"{name:48s} {'':>43s}")
        for gpu in sorted({s[1] for s in inside}):
            g = [s for s in inside if s[1] == gpu]
            clock = sum(s[2] for s in g) / len(g)
            watts = sum(s[3] for s in g) / len(g)
            capped = sum(1 for s in g if s[4] & POWER_CAP_BITS) / len(g)
            line += f" | gpu{gpu}: {clock:6.0f} MHz {watts:5.0f} W capped {capped:4.0%} ({len(g)})"
        print(line, flush=True)


def kernel_phases(a) -> list[tuple[str, Callable, tuple]]:
    from bench import kernel as kb
    cases = {c.name: c for c in kb.make_cases()}
    phases = []
    for name in a.cases:
        case = cases[name]
        q, k, v = kb.case_inputs(case)
        for impl in a.impls:
            fn = kb.ffa(case.mask) if impl == "ffa" else case.baselines[impl]()
            for mode in a.modes:
                for data in a.data:
                    inputs = (q, k, v) if data == "random" else (jax.numpy.zeros_like(q), jax.numpy.zeros_like(k), v)
                    label = f"{name} {mode} {impl}" + ("" if data == "random" else f" {data}")
                    phases.append((label, kb.jitted(fn, mode), inputs))
    return phases


def dist_phases(a) -> list[tuple[str, Callable, tuple]]:
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from bench import dist as db
    args = db.arg_parser().parse_args(["--platform", a.platform, "--tokens-per-gpu", str(a.tokens_per_gpu)])
    devices = jax.devices(a.platform)[:a.gpus]
    mesh = Mesh(np.array(devices), ("cp",))
    mask = db.make_mask(a.mask, a.tokens_per_gpu * len(devices))
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (a.tokens_per_gpu * len(devices), args.heads, args.head_dim)
    q, k, v = (jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16) for kk in keys)
    row = {"area": mask.area()}
    phases = []
    for method in a.methods:
        with db.transfers_for(method):
            _, _, passes, inputs, _ = db._build(method, db.builder_of(method), mask, mesh, args, q, k, v, 0, row)
        for mode, fn in passes:
            if mode in a.modes:
                phases.append((f"{a.mask} {mode} {method}", fn, inputs))
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["kernel", "dist"])
    ap.add_argument("--cases", nargs="+", default=["causal_32k", "varlen_swa1024_32k"])
    ap.add_argument("--impls", nargs="+", default=["ffa", "cudnn"])
    ap.add_argument("--methods", nargs="+", default=["magi", "single"])
    ap.add_argument("--mask", default="varlen_causal")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--platform", default="gpu", choices=["gpu", "cpu"], help="cpu: a check of the phases only")
    ap.add_argument("--tokens-per-gpu", type=int, default=65536)
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--interval-ms", type=int, default=50)
    ap.add_argument("--data", nargs="+", default=["random"], choices=["random", "qk0"],
                    help="kernel phases' inputs: random, and/or q and k zeroed (qk0)")
    a = ap.parse_args()
    phases = kernel_phases(a) if a.what == "kernel" else dist_phases(a)  # built and compiled before sampling
    if a.platform == "cpu":
        for name, fn, inputs in phases:
            print(f"{name:48s} {run_phase(fn, inputs, a.seconds)[2] * 1e3:9.3f} ms/call", flush=True)
        return
    energy = energy_reader()
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "smi.csv"
        with log.open("w") as f:
            for fields in (FIELDS, FIELDS.replace("clocks_event_reasons", "clocks_throttle_reasons")):  # older drivers
                smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                        f"-lms={a.interval_ms}"], stdout=f, stderr=subprocess.STDOUT,
                                       env=os.environ | {"TZ": "UTC"})
                time.sleep(1.0)
                if smi.poll() is None:
                    break
            done = []
            start = time.time()
            time.sleep(a.seconds)
            done.append(("idle", start, time.time(), 0.0, 0.0))
            for name, fn, inputs in phases:
                done.append((name, *run_phase(fn, inputs, a.seconds, energy)))
            smi.terminate()
            smi.wait()
        samples = parse_samples(log)
        if not samples:
            print("no nvidia-smi samples:", log.read_text()[:500])
            return
        summarize(samples, done)


if __name__ == "__main__":
    main()
