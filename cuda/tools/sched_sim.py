"""Host model of the sm90 forward's persistent tile scheduler (scheduler_sm90.h): the makespan of the bench
cases' tiles on 132 SMs, relative to the LPT bound, for three tile orders: one section (all heads at once),
plain L2 sections, and L2 sections with the wider last section of TailSectionStart (the kernel's). It
separates the tail of an order from its L2 effect, which it leaves out. A tile costs `tile_cost` plus one
per key tile of its q block's walk; CTAs take tiles in order as they free (the atomic counter).

    python cuda/tools/sched_sim.py
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


def block_work(mask: AttnMask, block_n: int) -> np.ndarray:
    """Key tiles walked by each q block of BLOCK_M rows (the kernel's FwdBlockWork without its +1)."""
    nb = -(-mask.total_seqlen_q // BLOCK_M)
    work = np.zeros(nb, np.int64)
    for (qs, qe), (ks, ke), t in zip(mask.q_ranges, mask.k_ranges, mask.types):
        for b in range(qs // BLOCK_M, -(-qe // BLOCK_M)):
            rb, re = max(qs, b * BLOCK_M), min(qe, (b + 1) * BLOCK_M)
            lo = ks + (rb - qs) if t in (AttnMaskType.INV_CAUSAL, AttnMaskType.BI_CAUSAL) else ks
            hi = ke - (qe - re) if t in (AttnMaskType.CAUSAL, AttnMaskType.BI_CAUSAL) else ke
            lo, hi = max(lo, ks), min(hi, ke)
            if hi > lo:
                work[b] += -(-(hi - lo) // block_n)
    return work


def section_heads(tk: int, d: int, hq: int, hkv: int, l2_bytes: int) -> int:
    """launch_fwd_sm90.cu SectionHeads: whole GQA groups whose K/V fit half of L2."""
    kv_head = max(1, tk * d * 2 * 2)
    return int(np.clip(l2_bytes // 2 // kv_head, 1, hkv)) * (hq // hkv)


def tail_section_start(work: np.ndarray, hq: int, group: int, per: int, ctas: int, waves: float = 1.5) -> int:
    """scheduler_sm90.h TailSectionStart (work with the kernel's +1 per q block)."""
    need = int(np.ceil(waves * ctas * work.max() / work.sum()))
    tail = max(per, hq if need >= hq else -(-need // group) * group)
    return 0 if tail >= hq else (hq - tail) // per * per


def makespan(work: np.ndarray, sections: list[int], sms: int, tile_cost: float) -> float:
    """Finish time of the last tile, tiles in DecodeTile's order: sections of the given widths (heads), the
    longest q blocks first within each."""
    order = np.argsort(-work, kind="stable")
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--l2-bytes", type=int, default=50 << 20)
    ap.add_argument("--tile-cost", type=float, default=1.0, help="per-tile overhead in key-tile steps")
    args = ap.parse_args()
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
