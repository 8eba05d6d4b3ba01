"""The ``plan`` and ``simulate`` commands (wired into ``python -m magi_jax``)."""

from __future__ import annotations

import argparse
import datetime
import math
import pathlib
import time
from typing import Callable, Sequence

import numpy as np

from magi_jax.mask import AttnMask
from magi_jax.planner.geometry import clip
from magi_jax.planner.plan import DistAttnPlan, make_plan
from magi_jax.planner.solvers import DEFAULT_SOLVER, SOLVERS
from magi_jax.planner.stages import MAX_DEGREE, CostModel, stored_calibrations
from magi_jax.planner.workloads import sample_doc_lengths, varlen_mask


def parse_tokens(text: str) -> int:
    """'1M' = 2**20, '64k' = 65536, '4096' = 4096."""
    t = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 64k, 1M)") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive whole token count: {text!r}")
    return int(value)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low (anything else a usage error that names the option)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def rank_counts(text: str) -> list[int]:
    """argparse type: comma-separated positive rank counts, '8,16,32'."""
    try:
        counts = [positive_int(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None
    if not counts:
        raise argparse.ArgumentTypeError(f"no rank counts in {text!r}")
    return counts


MASKS = ("full", "causal", "varlen_full", "varlen_causal", "sliding_window", "sliding_window_bidirectional",
         "block_causal", "shared_question", "prefix_lm", "global_sliding_window", "causal_blockwise")


def build_mask(name: str, seqlen: int, seed: int, window: int = 1024, block: int = 2048,
               num_global: int = 64) -> AttnMask:
    """A mask of one of ``MASKS`` over ``seqlen`` tokens; the varlen families use documents drawn from the
    reference histogram (``sample_doc_lengths(seqlen, seed)``). shared_question: each document is a question
    (its first quarter) and up to three answers; prefix_lm: each document's first half is the prefix."""
    from magi_jax import masks      # the constructor layer (imported here: the planner itself needs none)
    if name == "full":
        return masks.full(seqlen)
    if name == "causal":
        return masks.causal(seqlen)
    lengths = sample_doc_lengths(seqlen, seed)
    if name == "shared_question":
        samples: list[tuple[int, list[int]]] = []
        for n in lengths:
            if n < 2:                        # too short to split: lengthen the previous answer
                if not samples:
                    return masks.causal(seqlen)
                samples[-1][1][-1] += n
                continue
            q = max(1, n // 4)
            k = min(3, n - q)
            samples.append((q, [(n - q) // k + (i < (n - q) % k) for i in range(k)]))
        return masks.shared_question(samples)
    ctors = {
        "varlen_full": lambda: masks.varlen_full(lengths),
        "varlen_causal": lambda: masks.varlen_causal(lengths),
        "sliding_window": lambda: masks.sliding_window(lengths, window),
        "sliding_window_bidirectional": lambda: masks.sliding_window(lengths, window, causal=False),
        "block_causal": lambda: masks.block_causal(lengths, block),
        "prefix_lm": lambda: masks.prefix_lm(lengths, [n // 2 for n in lengths]),
        "global_sliding_window": lambda: masks.global_sliding_window(lengths, window, num_global),
        "causal_blockwise": lambda: masks.causal_blockwise(lengths),
    }
    if name not in ctors:
        raise SystemExit(f"plan: unknown mask {name!r}; expected one of {', '.join(MASKS)}")
    return ctors[name]()


# Calibration files name mask classes as bench/dist.py does; the --mask names that differ.
MASK_CLASS = {"block_causal": "varlen_block_causal"}


def _overlap(text: str) -> int | str:
    if text == "auto":
        return text
    v = int(text)
    if not 0 <= v <= MAX_DEGREE:
        raise argparse.ArgumentTypeError(f"overlap must be auto or 0..{MAX_DEGREE}")
    return v


def _common(p: argparse.ArgumentParser, mask_class_default: str) -> None:
    p.add_argument("--heads-q", type=positive_int, default=16)
    p.add_argument("--heads-kv", type=positive_int, default=None)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--head-dim-v", type=positive_int, default=None, help="v's head dim (default --head-dim)")
    p.add_argument("--overlap", type=_overlap, default="auto", help="stages: auto or 0..8")
    p.add_argument("--calibration", default=None, help="cost model rates from a calibration file "
                   f"(bench/calibrate.py) or a stored one by name {stored_calibrations()} "
                   "(default: the built-in H200 estimates)")
    p.add_argument("--mask-class", default=None, help=f"the file's mask class to use (default: {mask_class_default})")


def cost_model(a: argparse.Namespace, mask_class_default: str) -> CostModel:
    """The built-in model, or ``--calibration``'s rates for ``--mask-class``; prints which."""
    if a.calibration is None:
        print("cost model: built-in defaults (no --calibration)")
        return CostModel()
    mask_class = a.mask_class or mask_class_default
    try:
        model = CostModel.load(a.calibration, mask_class)
    except ValueError as e:          # name the flag, not load's argument
        msg = str(e)
        flag = "--mask-class" if msg.startswith("mask_class: ") else "--calibration"
        raise ValueError(f"{flag}: {msg.removeprefix('mask_class: ')}") from None
    print(f"cost model: {a.calibration} [{mask_class}]: {model.flops_per_s / 1e12:.4g} TFLOP/s, "
          f"{model.bytes_per_s / 1e9:.4g} GB/s per rank, latency {model.collective_latency_s * 1e6:.3g} us, "
          f"launch {model.launch_s * 1e6:.3g} us")
    return model


def plan_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m magi_jax plan",
                                description="Plan distributed attention for a mask and print the per-rank table.")
    p.add_argument("--mask", default="varlen_causal", choices=MASKS)
    p.add_argument("--window", type=parse_tokens, default=1024, help="sliding-window masks")
    p.add_argument("--block", type=parse_tokens, default=2048, help="block_causal")
    p.add_argument("--num-global", type=non_negative_int, default=64, help="global_sliding_window")
    p.add_argument("--seqlen", type=parse_tokens, default=parse_tokens("64k"))
    p.add_argument("--cp", type=positive_int, default=8)
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument("--solver", choices=sorted(SOLVERS), default=DEFAULT_SOLVER)
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the document lengths")
    p.add_argument("--plot", default=None, help="write a PNG: chunks coloured by owner, one rank's remote blocks")
    p.add_argument("--plot-rank", type=non_negative_int, default=None, help="rank whose blocks the plot shows "
                   "(default: the one fetching most)")
    _common(p, "the --mask name; varlen_block_causal for block_causal")
    a = p.parse_args(list(argv))
    # Checked before planning, which can take seconds, rather than failing after it.
    if a.plot and not pathlib.Path(a.plot).parent.is_dir():
        p.error(f"argument --plot: no directory {str(pathlib.Path(a.plot).parent)!r} to write into")
    if a.plot_rank is not None and a.plot_rank >= a.cp:
        p.error(f"argument --plot-rank: rank {a.plot_rank} out of range for --cp {a.cp}")
    mask = build_mask(a.mask, a.seqlen, a.seed, a.window, a.block, a.num_global)
    try:
        model = cost_model(a, MASK_CLASS.get(a.mask, a.mask))
        t0 = time.perf_counter()
        plan = make_plan(mask, cp=a.cp, chunk_size=a.chunk, solver=a.solver, overlap=a.overlap,
                         num_heads_q=a.heads_q, num_heads_kv=a.heads_kv, head_dim=a.head_dim,
                         head_dim_v=a.head_dim_v, cost_model=model)
    except ValueError as e:
        print(f"plan: {e}")
        return 2
    dt = time.perf_counter() - t0
    s = plan.stats()
    print(f"{a.mask}: {mask.num_slices} slices, {plan.seqlen} tokens (padded {plan.padded_seqlen}), cp={plan.cp}, "
          f"chunk={plan.chunk_size}, solver={plan.solver}, overlap degree {plan.overlap_degree}; "
          f"planned in {dt:.3f} s")
    print(s.table())
    print(f"shapes for run-time plans (magi_jax.plan_tables): {plan.capacity()}")
    if a.plot:
        rank = int(np.argmax(s.remote_keys)) if a.plot_rank is None else a.plot_rank
        plot_plan(plan, a.plot, rank)
        print(f"wrote {a.plot}")
    return 0


def block_areas(plan: DistAttnPlan, max_bins: int = 512) -> tuple[np.ndarray, int]:
    """Attended cells per (query bin, key bin), bins of whole chunks (at most ``max_bins`` per side)."""
    m, C = plan.mask, plan.chunk_size
    per_bin = math.ceil(plan.num_chunks / max_bins)
    B = per_bin * C
    nb = math.ceil(plan.num_chunks / per_bin)
    q = m.q_ranges
    keep = np.flatnonzero(q[:, 1] > q[:, 0])
    first, last = q[keep, 0] // B, (q[keep, 1] - 1) // B
    cnt = last - first + 1
    sl = np.repeat(keep, cnt)
    qb = np.repeat(first, cnt) + np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    rows = np.stack([qb * B, (qb + 1) * B], axis=1)
    pc = clip(m.q_ranges[sl], m.k_ranges[sl], m.types[sl], rows, m.k_ranges[sl])   # trimmed, k = union
    k0, k1 = pc.k_ranges[:, 0] // B, (pc.k_ranges[:, 1] - 1) // B
    kc = k1 - k0 + 1
    i = np.repeat(np.arange(len(pc.types)), kc)
    kb = k0[i] + np.arange(kc.sum()) - np.repeat(np.cumsum(kc) - kc, kc)
    pp = clip(pc.q_ranges[i], pc.k_ranges[i], pc.types[i], pc.q_ranges[i], np.stack([kb * B, (kb + 1) * B], 1))
    out = np.zeros((nb, nb))
    np.add.at(out, (pp.q_ranges[:, 0] // B, kb[pp.src]), pp.areas())
    return out, per_bin


def plot_plan(plan: DistAttnPlan, path: str, rank: int) -> None:
    """Left: the mask at chunk resolution, each query chunk coloured by its owner. Right: rank ``rank``'s
    rows: blocks of keys it owns (host) and keys it fetches (remote)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    areas, per_bin = block_areas(plan)
    nb = areas.shape[0]
    owner = np.empty(plan.num_chunks, np.int64)
    for r, p in enumerate(plan.partitions):
        owner[list(p)] = r
    bin_owner = owner[::per_bin][:nb]          # a bin's colour: its first chunk's owner
    bins = np.arange(plan.num_chunks) // per_bin
    mine = np.bincount(bins, weights=owner == rank, minlength=nb)[:nb] > 0   # bins holding any of rank's chunks
    fig, ax = plt.subplots(1, 2, figsize=(13, 6.5))
    img = np.where(areas > 0, bin_owner[:, None] % 20, np.nan)
    ax[0].imshow(img, cmap=plt.get_cmap("tab20"), vmin=0, vmax=19, interpolation="nearest")
    ax[0].set_title(fontsize=10, label=f"mask by owner of the query chunk (cp={plan.cp}, chunk={plan.chunk_size}"
                    + (f", {per_bin} chunks per pixel" if per_bin > 1 else "") + ")")
    ax[0].set_xlabel("key chunk")
    ax[0].set_ylabel("query chunk")
    kind = np.full(areas.shape, np.nan)
    kind[(areas > 0)] = 0
    kind[np.ix_(mine, np.ones(nb, bool))] = np.where(areas[mine] > 0, 2, np.nan)
    kind[np.ix_(mine, mine)] = np.where(areas[np.ix_(mine, mine)] > 0, 1, np.nan)
    ax[1].imshow(kind, cmap=ListedColormap(["#dddddd", "#2a9d4a", "#d62728"]), vmin=0, vmax=2,
                 interpolation="nearest")
    s = plan.stats()
    ax[1].set_title(fontsize=10, label=f"rank {rank}: host blocks (green), remote blocks (red); "
                    f"fetches {s.remote_keys[rank]} keys")
    ax[1].set_xlabel("key chunk")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- simulate -------------------------------------------------------------------------------------------

SIM_SOLVERS = ("comm_aware", "minheap", "zigzag", "all-gather")


def simulate_one(cp: int, seed: int, per_gpu: int, solver: str, **kw) -> dict:
    """One workload of the reference benchmark: documents from the histogram, ``per_gpu`` tokens per rank,
    chunk = min(2048, total / (8 cp)). ``all-gather`` = minheap placement, every rank fetching all keys."""
    total = cp * per_gpu
    chunk = min(2048, math.ceil(total / (8 * cp)))
    mask = varlen_mask(sample_doc_lengths(total, seed))
    t0 = time.perf_counter()
    plan = make_plan(mask, cp=cp, chunk_size=chunk, solver="minheap" if solver == "all-gather" else solver, **kw)
    dt = time.perf_counter() - t0
    s = plan.stats()
    remote_max = int(s.remote_keys.max())
    seconds = s.predicted_time_s
    if solver == "all-gather":
        cm = plan.cost_model
        cell_s = cm.cell_seconds(plan.num_heads_q, plan.head_dim, plan.head_dim_v)
        remote_max = plan.padded_seqlen - plan.local_len
        comm = cm.collective_latency_s + cm.key_seconds(plan.num_heads_kv, plan.head_dim, plan.head_dim_v) * remote_max
        host = cm.launch_s + cell_s * s.host_area
        rest = cm.launch_s + cell_s * (s.area - s.host_area)
        seconds = max(host.max(), comm) + rest.max()       # gather || host attention, then the rest
    return dict(imbalance=s.imbalance, remote=remote_max / total, seconds=seconds,
                tflops=s.flops / cp / seconds / 1e12, plan_seconds=dt)


def simulate_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m magi_jax simulate",
                                description="Predicted balance, traffic and throughput of the solvers at scale.")
    p.add_argument("--cp", type=rank_counts, default="8,16,32,64,128,256,512,1024", help="comma-separated rank counts")
    p.add_argument("--per-gpu", type=parse_tokens, default=8192, help="tokens per rank")
    p.add_argument("--seeds", type=positive_int, default=3)
    p.add_argument("--solvers", default=",".join(SIM_SOLVERS))
    p.add_argument("--markdown", default=None, help="append the table as a dated section to this file")
    _common(p, "varlen_causal, the simulated workload")
    a = p.parse_args(list(argv))
    solvers = [x for x in a.solvers.split(",") if x]
    for s in solvers:
        if s not in SIM_SOLVERS and s not in SOLVERS:
            print(f"simulate: unknown solver {s!r}")
            return 2
    try:
        model = cost_model(a, "varlen_causal")
    except ValueError as e:
        print(f"simulate: {e}")
        return 2
    kw = dict(overlap=a.overlap, num_heads_q=a.heads_q, num_heads_kv=a.heads_kv, head_dim=a.head_dim,
              head_dim_v=a.head_dim_v, cost_model=model)
    ratio = "comm_aware" in solvers and "minheap" in solvers
    head = ("| cp | tokens | " + " | ".join(f"{s}: max/mean area, max remote/total, TFLOP/s" for s in solvers)
            + (" | comm_aware / minheap max remote |" if ratio else " |") + " comm_aware plan s |")
    lines = [head, "|" + "---|" * (len(solvers) + 3 + ratio)]
    print(head, flush=True)
    for cp in a.cp:
        cells, plan_s, res = [], 0.0, {}
        for s in solvers:
            res[s] = [simulate_one(cp, seed, a.per_gpu, s, **kw) for seed in range(a.seeds)]
            m = {k: float(np.mean([r[k] for r in res[s]])) for k in res[s][0]}
            cells.append(f"{m['imbalance']:.3f}, {m['remote']:.3f}, {m['tflops']:.0f}")
            if s == "comm_aware":
                plan_s = m["plan_seconds"]
        if ratio:   # mean over seeds of the per-workload ratio
            pairs = zip(res["comm_aware"], res["minheap"])
            cells.append(f"{np.mean([c['remote'] / h['remote'] for c, h in pairs]):.3f}")
        line = f"| {cp} | {cp * a.per_gpu} | " + " | ".join(cells) + f" | {plan_s:.2f} |"
        lines.append(line)
        print(line, flush=True)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(f"\n## Planner simulation ({datetime.date.today().isoformat()})\n\n"
                    + "\n".join(lines) + "\n")
    return 0
