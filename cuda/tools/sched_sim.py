"""Host model of the sm90 kernels' tile orders (tile_order.h): the makespan of the bench cases' tiles on 132
SMs, relative to the LPT bound. It separates the tail of an order from its L2 effect, which it leaves out;
CTAs take tiles in order as they free (the forward's atomic counter, the backward's grid).

Forward (scheduler_sm90.h): a tile (q block, q head) costs `tile_cost` plus one per key tile of its q
block's walk; three orders: one section (all heads at once), plain L2 sections, and L2 sections with the
wider last section of TailSectionStart (the kernel's).
Backward (launch_bwd_sm90.cu): a tile (k block of 128 keys, kv head) costs `tile_cost` plus one per row
step of 64 rows (KvBlockWork); two orders: the grid's (k blocks in order, head after head) and the kernel's
(k blocks longest first, kv heads in L2 sections of their Q and dO, the last section wider).

    python cuda/tools/sched_sim.py [--pass bwd]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.kernel import make_cases  # noqa: E402
from magi_jax.mask import AttnMask, AttnMaskType  # noqa: E402

BLOCK_M = 128


def key_span(q: tuple[int, int], k: tuple[int, int], t: AttnMaskType, rb: int, re: int) -> tuple[int, int]:
    """Keys attended by any of the rows [rb, re) of a slice (the kernel's KeySpan)."""
    (qs, qe), (ks, ke) = q, k
    lo = ks + (rb - qs) if t in (AttnMaskType.INV_CAUSAL, AttnMaskType.BI_CAUSAL) else ks
    hi = ke - (qe - re) if t in (AttnMaskType.CAUSAL, AttnMaskType.BI_CAUSAL) else ke
    return max(lo, ks), min(hi, ke)


def row_span(q: tuple[int, int], k: tuple[int, int], t: AttnMaskType, cb: int, ce: int) -> tuple[int, int]:
    """Rows of a slice attending some key of [cb, ce) (the kernel's RowSpan; empty when ce <= cb)."""
    (qs, qe), (ks, ke) = q, k
    if ce <= cb:
        return 0, 0
    lo = max(qs, cb - ke + qe) if t in (AttnMaskType.CAUSAL, AttnMaskType.BI_CAUSAL) else qs
    hi = min(qe, ce - ks + qs) if t in (AttnMaskType.INV_CAUSAL, AttnMaskType.BI_CAUSAL) else qe
    return lo, hi


def fwd_group_slices(mask: AttnMask, block_n: int) -> dict[int, list[tuple[int, int, list[int]]]]:
    """The groups each q block of BLOCK_M rows walks (scheduler_sm90.h FwdStepFrom), as (c0, ke, slice
    indices): a group of consecutive slices whose rows in the block are disjoint and ascending and whose key
    spans lie less than a tile apart is walked once, over the union [c0, ke) of its spans."""
    walks: dict[int, list[tuple[int, int, list[int]]]] = {}
    for b in range(-(-mask.total_seqlen_q // BLOCK_M)):
        r0, r1 = b * BLOCK_M, (b + 1) * BLOCK_M
        group = None  # [rows end, c0, ke, slices]
        for i, (q, k, t) in enumerate(zip(mask.q_ranges, mask.k_ranges, mask.types)):
            rb, re = max(q[0], r0), min(q[1], r1)
            if rb >= re or k[0] >= k[1]:
                continue  # not in the block's list (block_lists.h AxisRange: a slice with cells here)
            lo, hi = key_span(q, k, t, rb, re)
            if group and rb >= group[0] and lo < hi and lo < group[2] + block_n and hi > group[1] - block_n:
                group = [re, min(group[1], lo), max(group[2], hi), group[3] + [i]]
                continue
            if group:
                walks.setdefault(b, []).append((group[1], group[2], group[3]))
            group = [re, lo, hi, [i]] if lo < hi else None
        if group:
            walks.setdefault(b, []).append((group[1], group[2], group[3]))
    return walks


def fwd_groups(mask: AttnMask, block_n: int) -> dict[int, list[tuple[int, int]]]:
    """The key spans [c0, ke) that each q block walks: fwd_group_slices without the slices."""
    return {b: [(c0, ke) for c0, ke, _ in groups] for b, groups in fwd_group_slices(mask, block_n).items()}


def block_work(mask: AttnMask, block_n: int) -> np.ndarray:
    """Key tiles walked by each q block of BLOCK_M rows (the kernel's FwdBlockWork without its +1)."""
    work = np.zeros(-(-mask.total_seqlen_q // BLOCK_M), np.int64)
    for b, spans in fwd_groups(mask, block_n).items():
        work[b] = sum(-(-(ke - c0) // block_n) for c0, ke in spans)
    return work


def kv_block_work(mask: AttnMask, block_n: int = 128, block_m: int = 64) -> np.ndarray:
    """Row steps of each k block of block_n keys (the kernel's KvBlockWork without its +1): per slice, the
    rows attending some key of the block, in steps of block_m from the first of them."""
    nb = -(-mask.total_seqlen_k // block_n)
    work = np.zeros(nb, np.int64)
    for (qs, qe), (ks, ke), t in zip(mask.q_ranges, mask.k_ranges, mask.types):
        for b in range(ks // block_n, -(-ke // block_n)):
            # Row q sees keys [ks + (q - qs) if inv, ke - (qe - q - 1) if causal): rows seeing a key of [cb, ce).
            lo, hi = row_span((qs, qe), (ks, ke), t, max(ks, b * block_n), min(ke, (b + 1) * block_n))
            if hi > lo:
                work[b] += -(-(hi - lo) // block_m)
    return work


def section_heads(tk: int, d: int, hq: int, hkv: int, l2_bytes: int) -> int:
    """launch_fwd_sm90.cu SectionHeads: whole GQA groups whose K/V (tk rows) fit half of L2; with tq rows
    and hq == hkv, the backward's kv heads whose Q / dO fit (launch_bwd_sm90.cu BuildTileOrder)."""
    kv_head = max(1, tk * d * 2 * 2)
    return int(np.clip(l2_bytes // 2 // kv_head, 1, hkv)) * (hq // hkv)


def tail_section_start(work: np.ndarray, hq: int, group: int, per: int, ctas: int, waves: float = 1.5) -> int:
    """scheduler_sm90.h TailSectionStart (work with the kernel's +1 per q block)."""
    need = int(np.ceil(waves * ctas * work.max() / work.sum()))
    tail = max(per, hq if need >= hq else -(-need // group) * group)
    return 0 if tail >= hq else (hq - tail) // per * per


def makespan(work: np.ndarray, sections: list[int], sms: int, tile_cost: float, order=None) -> float:
    """Finish time of the last tile, tiles in SectionTile's order: sections of the given widths (heads), the
    blocks in `order` (default: longest first) within each."""
    order = np.argsort(-work, kind="stable") if order is None else order
    costs = []
    for heads in sections:
        costs.extend(np.repeat(work[order] + tile_cost, heads))
    free = [0.0] * min(sms, len(costs))
    heapq.heapify(free)
    end = 0.0
    for c in costs:
        t = heapq.heappop(free) + c
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def bwd_makespans(work: np.ndarray, heads: int, per: int, sms: int, tile_cost: float) -> tuple[float, float, float]:
    """(LPT bound, grid order, the kernel's order) of the backward's tiles: work per k block, `heads` kv heads,
    `per` kv heads per L2 section."""
    cost = work + tile_cost
    bound = cost.sum() * heads / sms
    grid = makespan(work, [1] * heads, sms, tile_cost, order=np.arange(len(work)))
    first = tail_section_start(cost, heads, 1, per, sms)
    sections = [per] * (first // per) + [heads - first]
    return bound, grid, makespan(work, sections, sms, tile_cost)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pass", dest="which", default="fwd", choices=["fwd", "bwd"])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--l2-bytes", type=int, default=50 << 20)
    ap.add_argument("--tile-cost", type=float, default=1.0, help="per-tile overhead in key-tile steps")
    args = ap.parse_args()
    if args.which == "bwd":
        print(f"{'case':26s} {'kv heads/section':>16s} {'bound':>9s} {'grid':>6s} {'kernel':>6s}  "
              "(makespan / LPT bound)")
        for case in make_cases():
            d = case.head_dim
            block_n = 128 if d <= 128 else 64
            work = kv_block_work(case.mask, block_n)
            per = section_heads(case.mask.total_seqlen_q, d, args.heads, args.heads, args.l2_bytes)
            bound, grid, kernel = bwd_makespans(work, args.heads, per, args.sms, args.tile_cost)
            print(f"{case.name:26s} {per:16d} {bound:9.0f} {grid / bound:6.3f} {kernel / bound:6.3f}")
        return 0
    print(f"{'case':26s} {'heads/section':>13s} {'last section':>12s} {'bound':>9s} {'one section':>11s} "
          f"{'sections':>9s} {'+ tail':>7s}  (makespan / LPT bound)")
    for case in make_cases():
        d = case.head_dim
        block_n = 128 if d <= 128 else 80
        work = block_work(case.mask, block_n)
        hq = args.heads
        per = section_heads(case.mask.total_seqlen_k, d, hq, hq, args.l2_bytes)
        bound = (work.sum() + args.tile_cost * len(work)) * hq / args.sms
        plain = [per] * (hq // per) + ([hq % per] if hq % per else [])
        first = tail_section_start(work + args.tile_cost, hq, 1, per, args.sms)
        tailed = [per] * (first // per) + [hq - first]
        one, cut, tail = (makespan(work, s, args.sms, args.tile_cost) for s in ([hq], plain, tailed))
        print(f"{case.name:26s} {per:13d} {hq - first:12d} {bound:9.0f} {one / bound:11.3f} "
              f"{cut / bound:9.3f} {tail / bound:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
