"""Distributed attention benchmark (issue 6, item 8): magi_jax against the usual context-parallel schemes,
all running the same FFA kernel, on every visible GPU (2 or more).

Methods (TFLOP/s per GPU on the unmasked area: forward 4 * area * Hq * D, or 2 * area * Hq * (D + Dv) with
--head-dim-v; forward+backward 3.5x):
  magi       magi_jax.calc_attn: comm-aware dispatch, group_cast of the keys each rank needs, overlap stages
             (the plan's "auto" degree), lse merge; custom backward with group_reduce of partial dK/dV.
  allgather  zigzag dispatch (rank r holds chunks r and 2cp-1-r of every 2cp), all-gather of K and V, one
             FFA call per rank over all keys; autodiff backward (reduce-scatter of dK/dV), as MaxText and
             Transformer Engine do.
  ring       zigzag dispatch, K/V passed around the ring with ppermute (cp-1 steps), one FFA call per step,
             lse merge; autodiff backward (dK/dV travel back around the ring).
  single     single-GPU FFA on one GPU's share of the work: the queries and keys of magi's most loaded
             rank, no communication (the target's denominator: magi >= 0.95x of it per GPU).

Masks: varlen causal and varlen block-causal (block 2048; varlen_full on request), documents of exponential
length (mean 4096, at least 256), 64k tokens per GPU by default; bf16, 16 heads, head dim 128. Appends a table to BENCHMARKS.md
(--no-append to skip) and writes JSON to $OUT/dist_bench.json when OUT is set.

    python bench/dist.py                                    # 2+ GPUs
    python bench/dist.py --dp 2                             # 8 GPUs as dp 2 x cp 4 (a batch element per group)
    python bench/dist.py --head-dim 192 --head-dim-v 128 --masks varlen_causal    # MLA's shapes
    python bench/dist.py --profile /tmp/trace               # also a jax.profiler trace of magi fwd+bwd
    python bench/dist.py --platform cpu --gpus 4 --tokens-per-gpu 512 --heads 2 --kv-heads 2 --head-dim 64 \\
        --dtype float32 --no-append                         # smoke run on host devices
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import re
import sys
import time
import traceback

if "--platform" in sys.argv and sys.argv[sys.argv.index("--platform") + 1:][:1] == ["cpu"]:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import magi_jax as mj  # noqa: E402
from magi_jax import comm, dist_attn, ffa, masks  # noqa: E402
from magi_jax.mask import AttnMask, slice_areas  # noqa: E402
from magi_jax.planner import make_plan  # noqa: E402
from magi_jax.planner.plan import DistAttnPlan  # noqa: E402
from bench.common import (append_report, attention_flops, doc_lengths, gpu_kernel_events,  # noqa: E402
                          kernel_totals, markdown_table, median_seconds, newest_perfetto_trace,
                          positive_int, ratio_text, step_timeline)

METHODS = ("magi", "allgather", "ring", "single")
# magi with the transport forced, magi with overlap 0 (fetch, then one fused call both ways), magi with the
# fused backward, magi_local: magi with no transfers (diagnostic: each rank's send buffers stand in for what it
# would receive, so the packing, the calls and the partials' scatter-add run on data of the same shapes; its
# output is wrong, its time is magi's without the collectives) (not run by default); also magi_margin<N>:
# magi with sm_margin N
# allgather_minheap and ring_minheap: the baselines on an area-balanced dispatch (the min-heap solver) instead of
# zigzag over fixed chunks, which leaves documents' areas unbalanced (varlen causal 128k on 2 ranks: 1.41x the
# mean on one rank); what per-document zigzag (Transformer Engine's THD layout) achieves in balance.
# magi_tables and magi_tables125: magi on its PlanTables (mj.plan_tables) padded to the plan's exact capacity and
# to 1.25x it (all_to_all blocks of 1.25x the keys), an argument of the jitted step: what run-time plans cost
# against the static plan.
EXTRA_METHODS = ("magi_ppermute", "magi_a2a", "magi_fused", "magi_bwd_fused", "magi_local", "allgather_minheap",
                 "ring_minheap", "magi_tables", "magi_tables125")


@contextlib.contextmanager
def transfers_for(method: str):
    """While tracing magi_local's step: every group collective's transport is the identity (the send buffer
    is taken as received), so its compiled program has no collective. Other methods: unchanged."""
    if method != "magi_local":
        yield
        return
    real = comm._transport
    comm._transport = lambda bufs, tables, axis, reverse: tuple(bufs)
    try:
        yield
    finally:
        comm._transport = real


def method_name(name: str) -> str:
    """--methods' type: a name of METHODS or EXTRA_METHODS, or magi_margin<N>."""
    if name in METHODS + EXTRA_METHODS or re.fullmatch(r"magi_margin\d+", name):
        return name
    raise argparse.ArgumentTypeError(f"unknown method {name!r}: expected one of "
                                     f"{', '.join(METHODS + EXTRA_METHODS)} or magi_margin<N>")


def make_mask(name: str, total: int, seed: int = 0, block: int = 2048) -> AttnMask:
    lens = doc_lengths(total, seed)
    if name == "varlen_causal":
        return masks.varlen_causal(lens)
    if name == "varlen_full":
        return masks.varlen_full(lens)
    if name == "varlen_block_causal":
        return masks.block_causal(lens, block)
    raise ValueError(f"mask: unknown {name!r}")


# ------------------------------------------------------------------------------------------ slice tables

def source_slices(plan: DistAttnPlan) -> list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """[r][s]: rank r's slices whose keys live on rank s, keys in s's local coordinates. From a degree-0
    plan: host slices are s == r; the one stage's slices map through its transfer rows (each slice's keys
    lie inside one row's destination range)."""
    if plan.num_stages > 1:
        raise ValueError("source_slices: needs a plan with overlap=0")
    cp = plan.cp
    out = [[(np.zeros((0, 2), np.int32), np.zeros((0, 2), np.int32), np.zeros(0, np.int32))
            for _ in range(cp)] for _ in range(cp)]
    for r in range(cp):
        out[r][r] = plan.host.of_rank(r)
    if not plan.stages:
        return out
    st = plan.stages[0]
    t = st.transfers
    for r in range(cp):
        q, k, ty = st.slices.of_rank(r)
        rows = np.flatnonzero(t.dst == r)
        lo, hi = t.dst_start[rows], t.dst_start[rows] + (t.src_end[rows] - t.src_start[rows])
        which = np.searchsorted(hi, k[:, 0], side="right")
        assert (which < len(rows)).all() and (k[:, 1] <= hi[which]).all() and (k[:, 0] >= lo[which]).all()
        row = rows[which]
        src = t.src[row]
        k_src = k - t.dst_start[row][:, None] + t.src_start[row][:, None]
        for s in range(cp):
            m = src == s
            if s != r:
                out[r][s] = (q[m], k_src[m].astype(np.int32), ty[m])
    return out


def stack_slices(per_rank: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """Per-rank slice lists -> int32 [cp, N, 2], [cp, N, 2], [cp, N] padded with empty slices."""
    cp = len(per_rank)
    n = max(1, max(len(x[0]) for x in per_rank))
    q = np.zeros((cp, n, 2), np.int32)
    k = np.zeros((cp, n, 2), np.int32)
    t = np.zeros((cp, n), np.int32)
    for r, (a, b, c) in enumerate(per_rank):
        q[r, :len(a)], k[r, :len(a)], t[r, :len(a)] = a, b, c
    return q, k, t


def area_of(slices) -> int:
    q, k, t = slices
    return int(slice_areas(q.reshape(-1, 2).astype(np.int64), k.reshape(-1, 2).astype(np.int64),
                           t.reshape(-1)).sum())


# ---------------------------------------------------------------------------------------------- methods
# Each builder returns (fn(q_d, k_d, v_d) -> (out_d, lse_d) on dispatched arrays, the plan that dispatches).

def head_dim_v(args) -> int:
    """v's head dim: --head-dim-v, else --head-dim."""
    return args.head_dim if args.head_dim_v is None else args.head_dim_v


def _ffa(q, k, v, rows, scale):
    return ffa._ffa(q, k, v, *rows, scale, 0.0, False, 0, False)


def build_magi(mask, mesh, args, transport=None, overlap=None, backward=None, sm_margin=None):
    overlap = (args.overlap if args.overlap == "auto" else int(args.overlap)) if overlap is None else overlap
    mp = mj.plan(mask, mesh, num_heads_q=args.heads, num_heads_kv=args.kv_heads, head_dim=args.head_dim,
                 head_dim_v=head_dim_v(args), overlap=overlap)
    transport = transport or args.transport
    sm_margin = args.sm_margin if sm_margin is None else sm_margin
    options = dict(transport=transport, sm_margin=sm_margin) | ({} if backward is None else dict(backward=backward))
    return (lambda q, k, v: mj.calc_attn(q, k, v, mp, **options)), mp


def build_magi_tables(mask, mesh, args, headroom: float = 1.0):
    """magi with the plan as run-time tables padded to its capacity times headroom (all_to_all), passed to
    the jitted function as its fourth argument (traced, as in a training step), already on the devices (the
    host-to-device copy of numpy tables at every call took 0.14 ms of a 5.8 ms forward on 2 H200s)."""
    _, mp = build_magi(mask, mesh, args)
    tables = mj.plan_tables(mp, mj.PlanCapacity.of([mp], headroom=headroom))
    return (lambda q, k, v, t: mj.calc_attn(q, k, v, t)), mp, jax.device_put(tables, NamedSharding(mesh, P()))


def _baseline_plan(mask, mesh, args, solver: str) -> DistAttnPlan:
    """The baselines' dispatch: ``solver``'s chunks, everything fetched in one stage (overlap 0)."""
    return make_plan(mask, mesh.shape["cp"], solver=solver, overlap=0, num_heads_q=args.heads,
                     num_heads_kv=args.kv_heads, head_dim=args.head_dim, head_dim_v=head_dim_v(args))


def seq_shard_map(body, mesh: Mesh):
    """shard_map of a per-rank body over (q, k, v) -> (out, lse), the sequence split over "cp"; on a mesh
    with a "dp" axis too, a leading batch dim split over it, one batch element per rank (the body sees the
    element, as on a 1-D mesh)."""
    if "dp" not in mesh.axis_names:
        return jax.shard_map(body, mesh=mesh, in_specs=(P("cp"),) * 3, out_specs=(P("cp"), P("cp")),
                             check_vma=False)
    spec = P("dp", "cp")
    batched = lambda q, k, v: tuple(o[None] for o in body(q[0], k[0], v[0]))
    return jax.shard_map(batched, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec), check_vma=False)


def build_allgather(mask, mesh, args, solver: str = "zigzag"):
    plan = _baseline_plan(mask, mesh, args, solver)
    cp, L = plan.cp, plan.local_len
    src = source_slices(plan)
    tables = stack_slices([
        tuple(np.concatenate(parts) for parts in zip(*[(q, k + s * L, t) for s, (q, k, t) in enumerate(src[r])]))
        for r in range(cp)])
    scale = args.head_dim ** -0.5

    def body(q, k, v):
        r = jax.lax.axis_index("cp")
        k_all = jax.lax.all_gather(k, "cp", tiled=True)
        v_all = jax.lax.all_gather(v, "cp", tiled=True)
        return _ffa(q, k_all, v_all, [jnp.asarray(a)[r] for a in tables], scale)

    return seq_shard_map(body, mesh), plan


def lse_merge(parts, dtype):
    """Ring attention's merge of its steps' partial results (autodiff runs through it): lse = logsumexp_i
    lse_i, out = sum_i exp(lse_i - lse) out_i, in float32; rows with no key anywhere stay out 0, lse -inf."""
    if len(parts) == 1:
        return parts[0][0].astype(dtype), parts[0][1]
    lses = jnp.stack([lse for _, lse in parts])
    top = jnp.max(lses, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lses - top)
    total = w.sum(axis=0)
    has = total > 0
    lse = jnp.where(has, jnp.log(jnp.where(has, total, 1.0)) + top, -jnp.inf)
    w = w / jnp.where(has, total, 1.0)
    out = sum(w[i][..., None] * o.astype(jnp.float32) for i, (o, _) in enumerate(parts))
    return out.astype(dtype), lse


def build_ring(mask, mesh, args, solver: str = "zigzag"):
    plan = _baseline_plan(mask, mesh, args, solver)
    cp = plan.cp
    src = source_slices(plan)
    # Step j: rank r holds the kv of rank (r - j) % cp.
    steps = [stack_slices([src[r][(r - j) % cp] for r in range(cp)]) for j in range(cp)]
    busy = [any(len(src[r][(r - j) % cp][0]) for r in range(cp)) for j in range(cp)]
    scale = args.head_dim ** -0.5
    shift = [(i, (i + 1) % cp) for i in range(cp)]

    def body(q, k, v):
        r = jax.lax.axis_index("cp")
        parts = []
        for j in range(cp):
            if j:
                k, v = jax.lax.ppermute((k, v), "cp", shift)
            if busy[j]:
                parts.append(_ffa(q, k, v, [jnp.asarray(a)[r] for a in steps[j]], scale))
        return lse_merge(parts, q.dtype)

    return seq_shard_map(body, mesh), plan


def single_share(mask, args, cp: int):
    """The most loaded rank of magi's plan with everything fetched (degree 0): its queries [L], keys
    [L + buffer] and fused slices, for one GPU. Returns (slices, L, key length, area)."""
    plan = make_plan(mask, cp, num_heads_q=args.heads, num_heads_kv=args.kv_heads, head_dim=args.head_dim,
                     head_dim_v=head_dim_v(args), overlap=0)
    fused = plan.fused_slices()
    r = int(np.argmax(plan.stats().area))
    rows = fused.of_rank(r)
    tk = plan.local_len + (plan.stages[0].buffer_len if plan.stages else 0)
    return rows, plan.local_len, tk, area_of(tuple(x[None] for x in rows))


def build_single(mask, args, cp: int):
    """The single-GPU baseline: FFA on one GPU over the most loaded rank's share (single_share), on fresh
    random inputs there. Returns (fn(q, k, v), its inputs, the share's area)."""
    rows, tq, tk, share = single_share(mask, args, cp)
    dev = jax.devices(args.platform)[0]
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(1), 3)
    inputs = tuple(jax.device_put(jax.random.normal(kk, (t, h, d), jnp.float32).astype(dtype), dev)
                   for kk, t, h, d in zip(keys, (tq, tk, tk), (args.heads, args.kv_heads, args.kv_heads),
                                          (args.head_dim, args.head_dim, head_dim_v(args))))
    rr = tuple(jax.device_put(jnp.asarray(x), dev) for x in rows)
    return (lambda q, k, v: mj.flex_flash_attn(q, k, v, *rr)), inputs, share


# ----------------------------------------------------------------------------------------------- running

# Each method's builder (single: build_single, called by _build itself).
BUILDERS = {"magi": build_magi, "allgather": build_allgather, "ring": build_ring,
            "magi_ppermute": functools.partial(build_magi, transport="ppermute"),
            "magi_a2a": functools.partial(build_magi, transport="all_to_all"),
            "magi_fused": functools.partial(build_magi, overlap=0),
            "magi_bwd_fused": functools.partial(build_magi, backward="fused"), "magi_local": build_magi,
            "allgather_minheap": functools.partial(build_allgather, solver="minheap"),
            "ring_minheap": functools.partial(build_ring, solver="minheap"), "magi_tables": build_magi_tables,
            "magi_tables125": functools.partial(build_magi_tables, headroom=1.25)}


def builder_of(method: str):
    """The builder of a method of METHODS or EXTRA_METHODS, or of magi_margin<N> (None for single)."""
    if method.startswith("magi_margin"):
        return functools.partial(build_magi, sm_margin=int(method[len("magi_margin"):]))
    return BUILDERS.get(method)


def fwd_bwd(fn):
    """jit of (forward, then the gradient of sum(out)) returning dq, dk, dv: forward included."""
    def loss(q, k, v, *rest):
        return fn(q, k, v, *rest)[0].astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def rel_diff(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _build(method: str, builder, mask, mesh: Mesh, args, q, k, v, seq_dim: int, row: dict):
    """One method built, compiled (its first calls) and run once: (work, note, [(pass, fn)], inputs, its
    output in global order, or None for single)."""
    if method == "single":
        fn, inputs, share = build_single(mask, args, mesh.shape["cp"])
        work, note, plan = share, f"rank share {share / row['area'] * mesh.shape['cp']:.3f} x mean", None
        row["share_area"] = share
    else:
        fn, plan, *extra = builder(mask, mesh, args)   # extra: arguments after q, k, v (magi_tables' tables)
        inputs = tuple(mj.dispatch(x, plan, seq_dim=seq_dim, mesh=mesh) for x in (q, k, v)) + tuple(extra)
        work, note = row["area"] / mesh.shape["cp"], ""
        if method.startswith("magi"):
            s = plan.stats()
            remote_share = s.stage_area.sum(axis=0) / np.maximum(s.area, 1)
            note = (f"stages {plan.num_stages}, imbalance {s.imbalance:.3f}, max remote keys "
                    f"{int(s.remote_keys.max())}, remote area share per rank "
                    + " ".join(f"{x:.2f}" for x in remote_share))
            row.update(stages=plan.num_stages, imbalance=float(s.imbalance),
                       max_remote_keys=int(s.remote_keys.max()))
        else:
            note = f"dispatch {plan.solver}, imbalance {plan.stats().imbalance:.3f}"
    f = jax.jit(fn)
    g = fwd_bwd(fn)
    out = f(*inputs)[0]
    jax.block_until_ready(g(*inputs))
    got = None if plan is None else mj.undispatch(out, plan, seq_dim=seq_dim, mesh=mesh)
    return work, note, [("fwd", f), ("fwd+bwd", g)], inputs, got


def run_mask(name: str, args, mesh: Mesh, results: list[dict]) -> None:
    """Every method on one mask. On a (dp, cp) mesh each of the dp groups attends its own batch element with
    the same mask (per-GPU work: the mask's area / cp, as on a 1-D mesh of cp). Every method is built and
    compiled first; then ``args.rounds`` rounds time each method in turn (the machine's drift during the run
    falls on all of them alike) and a method's time is the median of its rounds."""
    n = mesh.shape["cp"]
    dp = mesh.shape.get("dp", 1)
    total = args.tokens_per_gpu * n
    mask = make_mask(name, total, seed=args.seed)
    area = mask.area()
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(args.seed), 3)
    batch = (dp,) if dp > 1 else ()
    shapes = ((*batch, total, args.heads, args.head_dim), (*batch, total, args.kv_heads, args.head_dim),
              (*batch, total, args.kv_heads, head_dim_v(args)))
    q, k, v = (jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk, shape in zip(keys, shapes))
    seq_dim = len(batch)
    print(f"\n{name}: {total} tokens on {n} GPUs" + (f" (x {dp} data-parallel groups)" if dp > 1 else "")
          + f", {mask.num_slices} slices, area {area:.4g} ({area / total / total:.2%} of dense)", flush=True)
    reference = None
    timed = []   # (row, work, note, [(pass, fn)], inputs)
    for method in args.methods:
        row = {"mask": name, "method": method, "gpus": n * dp, "cp": n, "dp": dp, "tokens": total, "area": area}
        try:
            # Compiled inside (the first calls); the rounds below run the executables jit has cached.
            with transfers_for(method):
                work, note, passes, inputs, got = _build(method, builder_of(method), mask, mesh, args, q, k, v,
                                                         seq_dim, row)
            if got is not None and method != "magi_local":
                if reference is None:
                    reference = got
                else:
                    row["rel_diff_vs_first"] = rel_diff(got, reference)
            timed.append((row, work, note, passes, inputs))
        except Exception as e:  # a failing baseline must not hide the others
            traceback.print_exc()
            results.append({**row, "pass": "error", "ms": float("nan"), "tflops_per_gpu": float("nan"),
                            "note": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"  {method}: FAILED {type(e).__name__}: {e}", flush=True)
    rounds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for row, _, _, passes, inputs in timed:
            for label, func in passes:
                t = median_seconds(func, *inputs, warmup=args.warmup, reps=args.reps, calls=args.calls)
                rounds.setdefault((row["method"], label), []).append(t * 1e3)
    for row, work, note, passes, _ in timed:
        for label, _ in passes:
            ms_rounds = rounds[(row["method"], label)]
            ms = float(np.median(ms_rounds))
            tf = attention_flops(int(work), args.heads, args.head_dim, label == "fwd+bwd", head_dim_v(args)) / ms / 1e9
            results.append({**row, "pass": label, "ms": ms, "ms_rounds": ms_rounds, "tflops_per_gpu": tf,
                            "note": note})
            print(f"  {row['method']:9s} {label:7s} {ms:9.3f} ms  {tf:7.1f} TFLOP/s per GPU  {note}"
                  f"  (rounds: {', '.join(f'{x:.3f}' for x in ms_rounds)})"
                  + (f"  (out vs {args.methods[0]}: {row['rel_diff_vs_first']:.1e})"
                     if "rel_diff_vs_first" in row else ""), flush=True)


def report(results: list[dict], args, n: int) -> str:
    """The markdown table and its notes; n: GPUs per context-parallel group."""
    def tf(mask, method, p):
        for r in results:
            if r["mask"] == mask and r["method"] == method and r["pass"] == p:
                return r["tflops_per_gpu"]
        return float("nan")

    rows, verdicts = [], []
    for mask in dict.fromkeys(r["mask"] for r in results):
        for p in ("fwd", "fwd+bwd"):
            magi = tf(mask, "magi", p)
            cells = []
            for m in args.methods:
                r = next((r for r in results if r["mask"] == mask and r["method"] == m and r["pass"] == p), None)
                cells.append("-" if r is None else f"{r['tflops_per_gpu']:.1f} ({r['ms']:.2f})")
            ratios = [f"{magi / tf(mask, m, p):.2f}" if m != "magi" and tf(mask, m, p) > 0 else "-"
                      for m in args.methods if m != "magi"]
            rows.append([mask, p, *cells, *ratios])
            if p == "fwd+bwd" and mask == "varlen_causal":
                for m, target in (("single", 0.95), ("allgather", 1.15), ("ring", 1.5)):
                    if m in args.methods:
                        x = magi / tf(mask, m, p)
                        verdict = "met" if x >= target else "MISSED"
                        verdicts.append(f"magi / {m} = {ratio_text(x)} (target >= {target}: {verdict})")
    header = ["mask", "pass", *[f"{m} TFLOP/s per GPU (ms)" for m in args.methods],
              *[f"magi / {m}" for m in args.methods if m != "magi"]]
    groups = f" x {args.dp} data-parallel groups" if args.dp > 1 else ""
    dims = f"D {args.head_dim}" + (f", v {head_dim_v(args)}" if head_dim_v(args) != args.head_dim else "")
    notes = (f"{n} GPUs{groups}, {args.tokens_per_gpu} tokens per GPU, {jnp.dtype(args.dtype).name}, {args.heads} q heads, "
             f"{args.kv_heads} kv heads, {dims}; per method the median of {args.rounds} rounds (methods in "
             f"turn within a round), each the median of {args.reps} samples of {args.calls} back-to-back calls after "
             f"{args.warmup} warm-up; "
             f"TFLOP/s per GPU on the unmasked area (single: on its share). Targets (varlen causal, fwd+bwd): "
             + ("; ".join(verdicts) if verdicts else "not evaluated"))
    extra = [f"{r['mask']}: magi {r['note']}" for r in results if r["method"] == "magi" and r["pass"] == "fwd"]
    return markdown_table(header, rows), notes + ("\n" + "\n".join(extra) if extra else "")


# --------------------------------------------------------------------------------------------- profiling

PROFILE_STEPS = 3


def profile(args, mesh: Mesh, log_dir: pathlib.Path) -> None:
    """A jax.profiler trace of PROFILE_STEPS back-to-back steps (dispatched as a training loop does, one
    sync at the end) of magi's forward+backward (or forward alone: --profile-pass fwd; or the single-GPU
    baseline: --profile-method single; magi without its transfers: magi_local) on the first mask: for magi
    the compiled schedule (which attention calls sit between each async transfer's start and done) and the
    kernel overlap measured in the trace
    (NCCL kernels running while attention kernels run); for both the last step's kernels in time order on
    each GPU, the GPU idle time between the last two steps and the host's longest events in that gap."""
    from tests.test_dist_helpers import async_overlap, collective_dependencies
    n = mesh.shape["cp"]
    mask = make_mask(args.masks[0], args.tokens_per_gpu * n, seed=args.seed)
    if args.profile_method == "single":
        fn, (q, k, v), _ = build_single(mask, args, n)
        what = "single GPU, the most loaded rank's share"
    else:
        fn, mp = build_magi(mask, mesh, args, backward=args.profile_backward)
        dtype = jnp.dtype(args.dtype)
        shapes = ((mp.padded_seqlen, args.heads, args.head_dim), (mp.padded_seqlen, args.kv_heads, args.head_dim),
                  (mp.padded_seqlen, args.kv_heads, head_dim_v(args)))
        sh = NamedSharding(mesh, P("cp"))
        q, k, v = (jax.device_put(jax.random.normal(jax.random.key(i), s, jnp.float32).astype(dtype), sh)
                   for i, s in enumerate(shapes))
        what = f"backward {args.profile_backward or 'default'}, {mp!r}"
    g = fwd_bwd(fn) if args.profile_pass == "fwd+bwd" else jax.jit(fn)
    print(f"\nprofile: {args.masks[0]}, {args.profile_method}, {args.profile_pass}, {what}")
    with transfers_for(args.profile_method):   # traced and compiled here; the steps below reuse it
        text = g.lower(q, k, v).compile().as_text() if args.profile_method != "single" else ""
        jax.block_until_ready(g(q, k, v))
    if text:
        (log_dir / "hlo").mkdir(parents=True, exist_ok=True)
        (log_dir / "hlo" / f"{args.profile_method}_{args.profile_pass.replace('+', '_')}.txt").write_text(text)
        deps = collective_dependencies(text)
        waiting = {c: d for c, d in deps.items() if d}
        print(f"collectives: {len(deps)}, of which {len(waiting)} wait for an attention call (group_reduce: "
              f"each should wait for its own stage's backward only)")
        for c, d in waiting.items():
            print(f"  {c}: {sorted(t for t in d.values())}")
        windows = async_overlap(text)
        print(f"async collectives in the schedule: {len(windows)}; with attention calls inside: "
              f"{sum(bool(w['ffa_between']) for w in windows)}")
        for w in windows:
            print(f"  {w['start']} .. {w['done']}: {w['ffa_between']}")
    for _ in range(2):
        jax.block_until_ready(g(q, k, v))
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        jax.block_until_ready([g(q, k, v) for _ in range(PROFILE_STEPS)])
    trace = newest_perfetto_trace(log_dir)
    if trace is None:
        print("no perfetto trace written")
        return
    summarize_trace(trace)
    step_timeline(trace, PROFILE_STEPS)


def summarize_trace(path: pathlib.Path) -> dict:
    """Per GPU: busy time of NCCL kernels, of attention (FFA) kernels, and how much NCCL time ran while an
    attention kernel was running (interval intersection); the top kernels by time."""
    summary = {}
    for gpu, ks in gpu_kernel_events(path).items():
        is_nccl = lambda e: "nccl" in e["name"].lower()
        is_attn = lambda e: any(s in e["name"].lower() for s in ("flash", "ffa", "fwd", "bwd", "dkdv"))
        nccl = [(e["ts"], e["ts"] + e["dur"]) for e in ks if is_nccl(e)]
        attn = sorted((e["ts"], e["ts"] + e["dur"]) for e in ks if is_attn(e) and not is_nccl(e))
        merged = []
        for a, b in attn:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        overlap = 0.0
        for a, b in nccl:
            for c, d in merged:
                if c >= b:
                    break
                overlap += max(0.0, min(b, d) - max(a, c))
        top = kernel_totals(ks)[:10]
        nccl_us = sum(b - a for a, b in nccl)
        attn_us = sum(b - a for a, b in merged)
        summary[gpu] = {"nccl_us": nccl_us, "attention_us": attn_us, "nccl_overlapping_attention_us": overlap}
        print(f"{gpu}: NCCL kernels {nccl_us / 1e3:.3f} ms, attention kernels {attn_us / 1e3:.3f} ms, NCCL "
              f"time overlapping attention {overlap / 1e3:.3f} ms ({overlap / max(nccl_us, 1e-9):.0%} of NCCL)")
        for nm, us in top:
            print(f"    {us / 1e3:9.3f} ms  {nm[:110]}")
    return summary


def arg_parser() -> argparse.ArgumentParser:
    """The command line, also the defaults of other tools that build these methods (cuda/tools/power_probe.py)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", default="gpu", choices=["gpu", "cpu"])
    ap.add_argument("--gpus", type=int, default=None, help="devices to use (default: all)")
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel groups: a (dp, cp) mesh, each group attending its own batch element")
    ap.add_argument("--tokens-per-gpu", type=int, default=65536)
    ap.add_argument("--masks", nargs="+", default=["varlen_causal", "varlen_block_causal"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), type=method_name,
                    help=f"of {', '.join(METHODS + EXTRA_METHODS)}, magi_margin<N> (default: %(default)s)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--head-dim-v", type=positive_int, default=None,
                    help="v's head dim (default --head-dim; MLA: 192 / 128)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--overlap", default="auto")
    ap.add_argument("--transport", default="auto", choices=["auto", "all_to_all", "ppermute"])
    ap.add_argument("--sm-margin", type=int, default=dist_attn.SM_MARGIN,
                    help="SMs the magi methods' forward leaves to the group_cast beside it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="rounds over all methods; each method's median is kept")
    ap.add_argument("--calls", type=int, default=10,
                    help="back-to-back calls per timed sample, as a training loop dispatches its steps (1: each "
                         "call also pays one multi-GPU dispatch-and-sync latency)")
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--profile", type=pathlib.Path, default=None, help="trace magi fwd+bwd into this folder")
    ap.add_argument("--profile-only", action="store_true")
    ap.add_argument("--profile-backward", default=None, choices=dist_attn.BACKWARDS,
                    help="the backward of the profiled magi step (default: calc_attn's)")
    ap.add_argument("--profile-method", default="magi", choices=["magi", "magi_local", "single"],
                    help="profile magi's step, magi's without its transfers (magi_local) or the single-GPU "
                         "baseline's")
    ap.add_argument("--profile-pass", default="fwd+bwd", choices=["fwd", "fwd+bwd"],
                    help="profile magi's forward+backward step or its forward alone")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = arg_parser().parse_args(argv)
    devices = jax.devices(args.platform)
    n = args.gpus or len(devices)
    if n < 2 or len(devices) < n:
        print(f"bench/dist.py: needs at least 2 {args.platform} devices (have {len(devices)})", file=sys.stderr)
        return 2
    if args.dp < 1 or n % args.dp or n // args.dp < 2:
        print(f"bench/dist.py: --dp {args.dp} must divide the {n} devices into groups of 2 or more",
              file=sys.stderr)
        return 2
    if args.dp == 1:
        mesh = Mesh(np.array(devices[:n]), ("cp",))
    else:
        mesh = Mesh(np.array(devices[:n]).reshape(args.dp, n // args.dp), ("dp", "cp"))
    print(f"{n} x {devices[0].device_kind}, jax {jax.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if args.profile is not None:
        profile(args, mesh, args.profile)
        if args.profile_only:
            return 0
    results: list[dict] = []
    for name in args.masks:
        run_mask(name, args, mesh, results)
    table, notes = report(results, args, mesh.shape["cp"])
    print("\n" + table + "\n\n" + notes)
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out, "dist_bench.json").write_text(json.dumps(results, indent=1))
    if not args.no_append:
        shape = f"{n} GPUs" if args.dp == 1 else f"{n} GPUs as dp {args.dp} x cp {n // args.dp}"
        append_report(f"Distributed attention, {shape}", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
