"""Host model of the sm90 forward's computed cells against the unmasked area (no GPU needed): how much of the
work the tiling itself wastes on the bench cases' masks, and how much finer walks would save.

The forward computes, per q block of 128 rows and per slice of its list, the 128-key tiles of the slice's
key span over the block's rows, counted from the span's first key (scheduler_sm90.h FwdStep: c0 = the span's
start, then + 128), for both consumer warpgroups (64 rows each). Variants, each as computed cells / unmasked
cells:
  now          that walk;
  wg_tiles     each warpgroup walks the block's tiles that its own 64 rows need (skips the others);
  wg_halves    each warpgroup walks the block's tiles in 64-key halves where its span ends inside one (a
               half step: S with N = 64, PV over 64 keys);
  union        one walk per q block over the union of its slices' key tiles (slices with disjoint rows in
               the same block, such as a document's causal head and its band, share their key tiles); a
               shared walk needs a shared grid, so its tiles are aligned to multiples of 128 keys;
  union_halves both of the last two.

    python cuda/tools/tile_waste.py [case ...]      # default: every case of bench/kernel.py

Head dim 256 walks 80-key tiles: its row, at 128, only indicates.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.kernel import make_cases  # noqa: E402
from magi_jax.mask import AttnMask  # noqa: E402
from sched_sim import key_span  # noqa: E402  (its folder is on sys.path: run as a script or by the tests)

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


def main() -> int:
    wanted = sys.argv[1:]
    print(f"{'case':26s} {'now':>7s} {'wg_tiles':>9s} {'wg_halves':>10s} {'union':>7s} {'union_halves':>13s}")
    for case in make_cases():
        if wanted and case.name not in wanted:
            continue
        area = case.mask.area()
        ratios = [computed_cells(case.mask, rows, halves, union) / area for rows, halves, union in
                  ((BLOCK_M, False, False), (WG_M, False, False), (WG_M, True, False), (BLOCK_M, False, True),
                   (WG_M, True, True))]
        print(f"{case.name:26s} " + " ".join(f"{r:{w}.4f}" for r, w in zip(ratios, (7, 9, 10, 7, 13))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
