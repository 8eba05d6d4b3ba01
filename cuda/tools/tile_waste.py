"""Host model of the sm90 forward's computed cells against the unmasked area (no GPU needed): how much of the
work the tiling itself wastes on the bench cases' masks, and how much finer walks would save.

The forward computes, per q block of 128 rows and per group of its list's slices (consecutive slices whose
rows in the block are disjoint and whose key spans lie less than a tile apart: scheduler_sm90.h FwdStepFrom),
the 128-key tiles of the group's key span over the block's rows, counted from the span's first key (c0 = the
span's start, then + 128), for both consumer warpgroups (64 rows each). Variants, each as computed cells /
unmasked cells:
  now          that walk;
  slices       one walk per slice (the kernel's until 2026-12-01), on the grid from its own span's start;
  wg_tiles     each warpgroup walks the block's tiles that its own 64 rows need (skips the others);
  wg_halves    each warpgroup walks the block's tiles in 64-key halves where its span ends inside one (a
               half step: S with N = 64, PV over 64 keys);
  union        one walk per q block over the union of its slices' key tiles (slices with disjoint rows in
               the same block, such as a document's causal head and its band, share their key tiles); a
               shared walk needs a shared grid, so its tiles are aligned to multiples of 128 keys;
  union_halves both of the last two;
  now_n64      the kernel's walk with 64-key tiles, both warpgroups (measured in the 31st session: a 64-key
               step costs +18..+28% cycles, far more than the cells it saves; cuda/NOTES.md).

    python cuda/tools/tile_waste.py [case ...]      # default: every case of bench/kernel.py

Head dim 256 walks 80-key tiles: its row, at 128, only indicates.

The backward (masked_wg_steps): of the sm90 dK / dV kernel's (warpgroup, step) pairs, a step being 64 rows of a
slice against a CTA's 128 keys and a warpgroup holding 64 of them, the share where none of the step's rows
attends any of the warpgroup's keys: work a skip could save.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.kernel import make_cases  # noqa: E402
from magi_jax.mask import AttnMask  # noqa: E402
from sched_sim import fwd_groups, key_span, row_span  # noqa: E402  (its folder is on sys.path: run as a script or by the tests)

BLOCK_M, BLOCK_N, WG_M = 128, 128, 64


def computed_cells(mask: AttnMask, rows: int, halves: bool, union: bool) -> int:
    """Cells computed when units of `rows` rows (BLOCK_M: the block; WG_M: each warpgroup) walk key units
    (64-key halves if `halves`, else whole 128-key tiles) of their q block's walk: per slice on the grid
    that starts at the block's key span, or (`union`) over the union of the slices' units on the aligned
    grid."""
    units: dict[tuple[int, int], set[int]] = {}
    cells = 0
    for q, k, t in zip(mask.q_ranges, mask.k_ranges, mask.types):
        for b in range(q[0] // BLOCK_M, -(-q[1] // BLOCK_M)):
            lo, hi = key_span(q, k, t, max(q[0], b * BLOCK_M), min(q[1], (b + 1) * BLOCK_M))
            if hi <= lo:
                continue
            origin = 0 if union else lo
            for r in range(b * BLOCK_M, (b + 1) * BLOCK_M, rows):
                wlo, whi = key_span(q, k, t, max(q[0], r), min(q[1], r + rows))
                if whi <= wlo:
                    continue
                first, last = (wlo - origin) // 64, -(-(whi - origin) // 64)   # 64-key units from the origin
                if not halves:   # whole tiles: widen to the tile grid (pairs of units)
                    first, last = first - first % 2, last + last % 2
                if union:
                    units.setdefault((b, r), set()).update(range(first, last))
                else:
                    cells += (last - first) * 64 * rows
    return cells + sum(len(s) for s in units.values()) * 64 * rows


def walk_cells(mask: AttnMask, block_n: int = BLOCK_N) -> int:
    """Cells the kernel's walk computes: each q block's groups (sched_sim.fwd_groups) in tiles of block_n keys
    over all BLOCK_M rows."""
    return int(sum(-(-(ke - c0) // block_n) for spans in fwd_groups(mask, block_n).values()
                   for c0, ke in spans)) * block_n * BLOCK_M


def masked_wg_steps(mask: AttnMask, block_n: int = 128, block_m: int = 64) -> tuple[int, int]:
    """(fully masked pairs, all pairs) of the backward's walk (scheduler.h KvStep: per k block and slice, the
    row steps of block_m from the first row attending the block's keys) by its two warpgroups' key halves."""
    masked = total = 0
    half = block_n // 2
    for q, k, t in zip(mask.q_ranges, mask.k_ranges, mask.types):
        for b in range(k[0] // block_n, -(-k[1] // block_n)):
            rb, re = row_span(q, k, t, max(k[0], b * block_n), min(k[1], (b + 1) * block_n))
            if re <= rb:
                continue
            spans = [row_span(q, k, t, max(k[0], b * block_n + w * half), min(k[1], b * block_n + (w + 1) * half))
                     for w in range(2)]
            for r in range(rb, re, block_m):
                for lo, hi in spans:
                    total += 1
                    masked += not (lo < min(r + block_m, re) and hi > r and hi > lo)
    return masked, total


def main() -> int:
    wanted = sys.argv[1:]
    print(f"{'case':26s} {'now':>7s} {'slices':>7s} {'wg_tiles':>9s} {'wg_halves':>10s} {'union':>7s} "
          f"{'union_halves':>13s} {'now_n64':>8s}")
    for case in make_cases():
        if wanted and case.name not in wanted:
            continue
        area = case.mask.area()
        ratios = [walk_cells(case.mask) / area] + [
            computed_cells(case.mask, rows, halves, union) / area for rows, halves, union in
            ((BLOCK_M, False, False), (WG_M, False, False), (WG_M, True, False), (BLOCK_M, False, True),
             (WG_M, True, True))] + [walk_cells(case.mask, 64) / area]
        print(f"{case.name:26s} " + " ".join(f"{r:{w}.4f}" for r, w in zip(ratios, (7, 7, 9, 10, 7, 13, 8))))
    print(f"\n{'case':26s} backward (warpgroup, step) pairs fully masked")
    for case in make_cases():
        if wanted and case.name not in wanted:
            continue
        masked, total = masked_wg_steps(case.mask)
        print(f"{case.name:26s} {masked / total:.2%} of {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
