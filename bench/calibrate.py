"""Calibrate the planner's cost model from measured runs, and check it (issue 8, item 2).

(a) Rates, per mask class (the masks of bench/dist.py, documents of exponential length):
    attention: the FFA forward on one device over the mask of one device's tokens and of a quarter of
    them, a line ``seconds = launch_s + area * 4 Hq D / flops_per_s`` through the two points (area: the
    unmasked cells, the planner's convention); collectives: group_cast alone on the tables of the plan's
    one-stage fetch (overlap 0), K and V of Hkv and of 4 Hkv heads, a line ``seconds =
    collective_latency_s + bytes / bytes_per_s`` with bytes per rank counted as the model does (K and V of
    the most keys any rank receives or sends).
(b) Check, per mask class and --overlap: the plan made with the calibrated model; each rank's host call
    and each stage's call timed alone on one device (its slices on buffers of its sizes, as calc_attn
    runs them), each stage's group_cast alone on all devices, and the whole forward (calc_attn under jit).
    Printed: predicted against measured seconds per part and rank; "composed" applies the model's
    schedule (stages.finish_times) to the measured parts, so a gap between composed and measured is the
    schedule (what XLA overlaps), one between predicted and composed the rates.
(c) The calibration as JSON (CostModel fields per mask class; device, jax version, date, command, the
    measured points and the check): --out, by default magi_jax/planner/calibration/<device kind>.json, and
    a copy in $OUT when set. Use: ``python -m magi_jax plan|simulate --calibration PATH``, or
    ``CostModel.load(PATH, mask_class=...)`` as make_plan's cost_model.

    python bench/calibrate.py                              # every visible GPU (2 or more)
    python bench/calibrate.py --platform cpu --devices 4 --tokens-per-device 1024 --heads 2 --kv-heads 2 \\
        --head-dim 64 --dtype float32 --out /tmp/cpu.json    # smoke run on host devices
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import dist  # noqa: E402  (first: with --platform cpu it asks for 8 host devices before jax starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

import magi_jax as mj  # noqa: E402
from magi_jax.comm import CastTables, group_cast  # noqa: E402
from magi_jax.dist_attn import run_tables  # noqa: E402
from magi_jax.planner import CostModel, make_plan  # noqa: E402
from magi_jax.planner.stages import finish_times, save_calibration  # noqa: E402
from magi_jax.planner.transfers import StageTransfers  # noqa: E402
from bench.common import append_report, command_line, markdown_table, median_seconds, utc_stamp  # noqa: E402

MASKS = ("varlen_causal", "varlen_full", "varlen_block_causal")
TARGET = 0.15      # issue 8: predicted forward time within 15% of measured


def default_path(device_kind: str) -> pathlib.Path:
    return ROOT / "magi_jax" / "planner" / "calibration" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", device_kind) + ".json")


def fit_line(x1: float, t1: float, x2: float, t2: float) -> tuple[float, float]:
    """(seconds per unit, fixed seconds) of the line through two measured points (x2 > x1). Where noise
    makes it fall, or cross zero above the origin, the line through the origin and the larger point."""
    slope = (t2 - t1) / (x2 - x1)
    fixed = t2 - slope * x2
    return (slope, fixed) if slope > 0 and fixed >= 0 else (t2 / x2, 0.0)


def charged_keys(t: StageTransfers) -> int:
    """The keys the cost model charges a stage's collective: the most any rank receives or sends."""
    return int(max(t.recv_tokens.max(), t.send_tokens.max()))


@functools.lru_cache(maxsize=None)
def _pool(dtype) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(1 << 20, np.float32).astype(dtype)


def _normal(seed: int, shape: tuple, dtype, sharding) -> jax.Array:
    """Normal inputs tiled from one host pool (every shard alike; the values do not change the timing):
    jax.random compiles once per shape, which cost more than the timed calls at small sizes."""
    block = np.resize(_pool(dtype)[seed:], sharding.shard_shape(shape))
    return jax.make_array_from_callback(shape, sharding, lambda _: block)


# Ranges are traced arguments: one compilation per buffer shape and slice count, not per rank.
_ffa_fwd = jax.jit(mj.flex_flash_attn)


def time_call(tq: int, tk: int, slices, args) -> float:
    """Median seconds of one FFA forward call on one device: q [tq], k, v [tk], slices (q_ranges,
    k_ranges, types) of one rank, padding slices included (calc_attn runs them too)."""
    dev = SingleDeviceSharding(args.device)
    q = _normal(0, (tq, args.heads, args.head_dim), args.dtype, dev)
    k, v = (_normal(i, (tk, args.kv_heads, args.head_dim), args.dtype, dev) for i in (1, 2))
    ranges = tuple(jax.device_put(jnp.asarray(a, jnp.int32), dev) for a in slices)
    return median_seconds(_ffa_fwd, q, k, v, *ranges, warmup=args.warmup, reps=args.reps)


def time_cast(mesh: Mesh, tables: CastTables, local_len: int, heads: int, args) -> float:
    """Median seconds of one group_cast of K and V ([local_len, heads, D] per rank) on a stage's tables,
    packed side by side as calc_attn fetches them."""
    cp = mesh.shape["cp"]
    fn = jax.jit(jax.shard_map(lambda k, v: group_cast((k, v), tables, "cp", packed=True)[0], mesh=mesh,
                               in_specs=(P("cp"),) * 2, out_specs=P("cp"), check_vma=False))
    sh = NamedSharding(mesh, P("cp"))
    k, v = (_normal(i, (cp * local_len, heads, args.head_dim), args.dtype, sh) for i in (1, 2))
    return median_seconds(fn, k, v, warmup=args.warmup, reps=args.reps)


def _row(slices, r: int) -> tuple[np.ndarray, ...]:
    return tuple(a[r] for a in slices)


# ------------------------------------------------------------------------------------------- (a) rates

def calibrate(name: str, mesh: Mesh, args) -> tuple[CostModel, dict]:
    """The cost model of one mask class, and the measured points it is fitted to."""
    L, cp = args.tokens_per_device, mesh.shape["cp"]
    ffa = []
    for tokens in (L // 4, L):
        m = dist.make_mask(name, tokens, seed=args.seed)
        ffa.append((float(m.area()), time_call(tokens, tokens, m.kernel_args(), args)))
    cell_s, launch_s = fit_line(*ffa[0], *ffa[1])

    plan = make_plan(dist.make_mask(name, cp * L, seed=args.seed), cp, overlap=0, num_heads_q=args.heads,
                     num_heads_kv=args.kv_heads, head_dim=args.head_dim)
    if not plan.stages:
        raise SystemExit(f"calibrate: {name} on {cp} devices fetches no keys; nothing to time the collective on")
    tables = run_tables(plan, args.transport).stages[0].tables
    keys = charged_keys(plan.stages[0].transfers)
    itemsize = jnp.dtype(args.dtype).itemsize
    comm = [(2.0 * h * args.head_dim * itemsize * keys, time_cast(mesh, tables, plan.local_len, h, args))
            for h in (args.kv_heads, 4 * args.kv_heads)]
    byte_s, latency_s = fit_line(*comm[0], *comm[1])

    model = CostModel.calibrated(attn_cells=1.0, attn_seconds=cell_s, num_heads_q=args.heads,
                                 head_dim=args.head_dim, comm_bytes=1.0, comm_seconds=byte_s,
                                 collective_latency_s=latency_s, launch_s=launch_s, dtype_bytes=itemsize)
    print(f"{name}: FFA (area, s) {_points(ffa)} -> {model.flops_per_s / 1e12:.4g} TFLOP/s, launch "
          f"{launch_s * 1e6:.3g} us; group_cast (bytes per rank, s) {_points(comm)} -> "
          f"{model.bytes_per_s / 1e9:.4g} GB/s, latency {latency_s * 1e6:.3g} us", flush=True)
    return model, {"ffa_area_seconds": ffa, "group_cast_bytes_seconds": comm}


def _points(points) -> str:
    return ", ".join(f"({x:.4g}, {t:.4g})" for x, t in points)


# ------------------------------------------------------------------------------------------- (b) check

def check(name: str, overlap: int | str, model: CostModel, mesh: Mesh, args) -> dict:
    """Predicted against measured seconds of one plan, per part and rank (printed), and the summary."""
    cp = mesh.shape["cp"]
    mp = mj.plan(dist.make_mask(name, cp * args.tokens_per_device, seed=args.seed), mesh,
                 num_heads_q=args.heads, num_heads_kv=args.kv_heads, head_dim=args.head_dim, overlap=overlap,
                 cost_model=model)
    s, tabs, L = mp.stats(), run_tables(mp.plan, args.transport), mp.local_len
    fused = mp.overlap_degree == 0 and bool(tabs.stages)
    comm = np.array([time_cast(mesh, st.tables, L, args.kv_heads, args) for st in tabs.stages])
    if fused:     # one call per rank over concat(local, received keys)
        tk = L + sum(st.tables.buffer_len for st in tabs.stages)
        host = np.array([time_call(L, tk, _row(tabs.fused, r), args) for r in range(cp)])
        comp = np.zeros((1, cp))
        pred_host, pred_comp = s.host_time_s + s.stage_time_s[0], comp
    else:
        host = np.array([time_call(L, L, _row(tabs.host, r), args) for r in range(cp)])
        comp = np.array([[time_call(L, st.tables.buffer_len, _row(st.slices, r), args) for r in range(cp)]
                         for st in tabs.stages]).reshape(len(tabs.stages), cp)
        pred_host, pred_comp = s.host_time_s, s.stage_time_s
    composed = finish_times(host, comm, comp, fused)
    measured = time_forward(mp, args)

    rows = [("fused call" if fused else "host call", r, pred_host[r], host[r]) for r in range(cp)]
    for i in range(len(tabs.stages)):
        rows.append((f"stage {i} group_cast", "all", s.stage_comm_s[i], comm[i]))
        if not fused:
            rows += [(f"stage {i} call", r, pred_comp[i, r], comp[i, r]) for r in range(cp)]
    rows += [("finish, parts composed", r, s.rank_time_s[r], composed[r]) for r in range(cp)]
    rows += [("forward, parts composed", "max", s.predicted_time_s, composed.max()),
             ("forward (calc_attn)", "all", s.predicted_time_s, measured)]
    print(f"\n{name}, overlap {overlap}: degree {mp.overlap_degree}, {mp.num_stages} stages, "
          f"buffers {list(s.buffer_lens)}, imbalance {s.imbalance:.3f}")
    print(f"  {'part':24s} {'rank':>5} {'predicted ms':>13} {'measured ms':>12} {'error':>8}")
    for part, r, pred, meas in rows:
        print(f"  {part:24s} {r!s:>5} {pred * 1e3:13.4f} {meas * 1e3:12.4f} {_error(pred, meas):+7.1f}%")
    error = _error(s.predicted_time_s, measured)
    print(f"  forward: predicted {s.predicted_time_s * 1e3:.4f} ms, measured {measured * 1e3:.4f} ms, error "
          f"{error:+.1f}% (target within {TARGET:.0%}: {'met' if abs(error) <= TARGET * 100 else 'MISSED'})",
          flush=True)
    return {"mask": name, "overlap": overlap, "degree": mp.overlap_degree, "stages": mp.num_stages,
            "predicted_ms": s.predicted_time_s * 1e3, "measured_ms": measured * 1e3,
            "composed_ms": float(composed.max()) * 1e3, "error_pct": error,
            "parts": [[part, r, pred * 1e3, meas * 1e3] for part, r, pred, meas in rows]}


def _error(predicted: float, measured: float) -> float:
    return (predicted / measured - 1.0) * 100.0


def time_forward(mp, args) -> float:
    """Median seconds of calc_attn's forward under jit on random dispatched q, k, v."""
    sh = NamedSharding(mp.mesh, P(mp.axis))
    T = mp.padded_seqlen
    q = _normal(0, (T, args.heads, args.head_dim), args.dtype, sh)
    k, v = (_normal(i, (T, args.kv_heads, args.head_dim), args.dtype, sh) for i in (1, 2))
    fn = jax.jit(lambda q, k, v: mj.calc_attn(q, k, v, mp, transport=args.transport))
    return median_seconds(fn, q, k, v, warmup=args.warmup, reps=args.reps)


# ----------------------------------------------------------------------------------------------- main

def _overlap(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", default="gpu", choices=["gpu", "cpu"])
    ap.add_argument("--devices", type=int, default=None, help="devices to use (default: all)")
    ap.add_argument("--tokens-per-device", type=int, default=65536)
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    ap.add_argument("--overlap", nargs="+", type=_overlap, default=["auto"],
                    help="overlap degrees of the checked plans (auto or 0..8)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--transport", default="auto", choices=["auto", "all_to_all", "ppermute"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="calibration JSON (default: magi_jax/planner/calibration/<device kind>.json)")
    ap.add_argument("--append", action="store_true", help="append the check's summary to BENCHMARKS.md")
    args = ap.parse_args(argv)
    available = jax.devices(args.platform)
    n = args.devices or len(available)
    if n < 2 or len(available) < n:
        print(f"bench/calibrate.py: needs at least 2 {args.platform} devices (have {len(available)})",
              file=sys.stderr)
        return 2
    if args.tokens_per_device < 8:
        print("bench/calibrate.py: --tokens-per-device must be at least 8", file=sys.stderr)
        return 2
    args.device, args.dtype = available[0], jnp.dtype(args.dtype)     # single-device calls run here
    mesh = Mesh(np.array(available[:n]), ("cp",))
    kind = args.device.device_kind
    print(f"{n} x {kind}, jax {jax.__version__}; {args.tokens_per_device} tokens per device, {args.dtype.name}, "
          f"{args.heads} q heads, {args.kv_heads} kv heads, D {args.head_dim}", flush=True)

    models, points, checks = {}, {}, []
    for name in args.masks:
        models[name], points[name] = calibrate(name, mesh, args)
    for name in args.masks:
        checks += [check(name, ov, models[name], mesh, args) for ov in args.overlap]

    out = args.out or default_path(kind)
    save_calibration(out, models, device_kind=kind, platform=args.platform, devices=n,
                     jax_version=jax.__version__, date=utc_stamp(), command=command_line(),
                     tokens_per_device=args.tokens_per_device, heads_q=args.heads, heads_kv=args.kv_heads,
                     head_dim=args.head_dim, dtype=args.dtype.name, transport=args.transport, points=points,
                     check=checks)
    print(f"\nwrote {out}")
    if os.environ.get("OUT"):
        shutil.copy(out, pathlib.Path(os.environ["OUT"]) / out.name)

    table = markdown_table(
        ["mask", "overlap", "degree", "predicted ms", "measured ms", "parts composed ms", "error"],
        [[c["mask"], c["overlap"], c["degree"], f"{c['predicted_ms']:.3f}", f"{c['measured_ms']:.3f}",
          f"{c['composed_ms']:.3f}", f"{c['error_pct']:+.1f}%"] for c in checks])
    print("\n" + table)
    if args.append:
        append_report(f"Cost-model calibration, {n} devices", table,
                      f"Forward only; {args.tokens_per_device} tokens per device, {args.dtype.name}, "
                      f"{args.heads} q heads, {args.kv_heads} kv heads, D {args.head_dim}; calibration {out.name}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
