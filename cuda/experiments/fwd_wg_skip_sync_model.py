"""A model of the synchronisation in fwd_wg_skip.patch (no GPU needed): can the forward deadlock when each
consumer warpgroup passes over the key tiles its rows do not attend?

Three programs run as far as they can, in turn, until all end (pass) or none can move (deadlock):
  - the K/V producer loads K then V of every key tile in walk order into a ring of STAGES stages; a stage's
    next fill waits for both warpgroups' releases of its previous use;
  - two consumer warpgroups, as the patched kernel orders its waits, turns and releases: a computed step
    waits for its K and the previous step's V, takes a turn (S(j) and PV(j - 1)), then releases K(j) and
    V(j - 1); a skipped tile waits for its K, releases it, takes a bare turn, then waits for its V and
    releases it; at most STAGES - 1 tiles are skipped in a row; a tile's leading tiles are skipped before
    the turn that issues its first S (only when its first group is one slice; the group's last tile stays).
Turns alternate strictly between the warpgroups (warpgroup 1 first hands warpgroup 0 its turn), as the
named-barrier ping-pong does. Walks and needs are random.

    python cuda/experiments/fwd_wg_skip_sync_model.py [seed] [--variant first_form|no_cap]

The patch's order passes every trial; the two variants fail: the first form (both releases before the bare
turn, as first written) and skipping without the cap.
"""

from __future__ import annotations

import argparse
import random

STAGES = 4


def consumer(wg: int, tiles: list, variant: str) -> list[tuple]:
    """One warpgroup's operations over the CTA's tiles; a tile is (groups, first group is one slice), a group a
    list of (needed by warpgroup 0, needed by warpgroup 1) per key tile."""
    ops: list[tuple] = [("hand_first_turn",)] if wg == 1 else []
    cap = STAGES if variant == "no_cap" else STAGES - 1
    skips, prev, base = 0, None, 0

    def skip(j: int) -> None:
        nonlocal skips
        if variant == "first_form":
            ops.extend([("wait", "k", j), ("wait", "v", j), ("release", "k", j), ("release", "v", j), ("turn",)])
        else:
            ops.extend([("wait", "k", j), ("release", "k", j), ("turn",), ("wait", "v", j), ("release", "v", j)])
        skips += 1

    for groups, single_first in tiles:
        steps = [need[wg] for group in groups for need in group]
        lead = 0
        if single_first:
            first_group = [need[wg] for need in groups[0]]
            lead = min(first_group.index(True) if True in first_group else len(first_group),
                       len(first_group) - 1, cap - skips)
        for j in range(lead):
            skip(base + j)
        first = base + lead
        # The turn issuing the tile's first S, beside the previous tile's last PV.
        ops.extend(([("wait", "v", prev)] if prev is not None else []) + [("wait", "k", first), ("turn",)])
        ops.extend([("release", "v", prev)] if prev is not None else [])
        ops.append(("release", "k", first))
        skips, prev = 0, first
        for i in range(lead + 1, len(steps)):
            j = base + i
            if not steps[i] and skips < cap:
                skip(j)
                continue
            ops.extend([("wait", "k", j), ("wait", "v", prev), ("turn",), ("release", "k", j), ("release", "v", prev)])
            skips, prev = 0, j
        base += len(steps)
    ops.extend([("wait", "v", prev), ("turn",), ("release", "v", prev)])  # the last PV, no next tile
    if wg == 0:
        ops.append(("take_last_turn",))
    return ops


def runs_to_the_end(tiles: list, variant: str) -> bool:
    """Whether all three programs end, with as many turns in each warpgroup."""
    total = sum(len(group) for groups, _ in tiles for group in groups)
    programs = [consumer(0, tiles, variant), consumer(1, tiles, variant),
                [("load", kind, j) for j in range(total) for kind in ("k", "v")]]
    at = [0, 0, 0]
    loaded: set[tuple[str, int]] = set()
    releases: dict[tuple[str, int], int] = {}
    turns, handed = [0, 0], False
    moved = True
    while moved:
        moved = False
        for e, program in enumerate(programs):
            while at[e] < len(program):
                op = program[at[e]]
                if op[0] == "wait":
                    go = (op[1], op[2]) in loaded
                elif op[0] == "release":
                    releases[op[1:]] = releases.get(op[1:], 0) + 1
                    go = True
                elif op[0] == "hand_first_turn":
                    handed = go = True
                elif op[0] == "turn":
                    go = (handed and turns[1] >= turns[0]) if e == 0 else turns[0] > turns[1]
                    turns[e] += go
                elif op[0] == "take_last_turn":
                    go = turns[1] >= turns[0]
                else:  # load
                    go = op[2] < STAGES or releases.get((op[1], op[2] - STAGES), 0) == 2
                    if go:
                        loaded.add(op[1:])
                if not go:
                    break
                at[e] += 1
                moved = True
    return all(a == len(p) for a, p in zip(at, programs)) and turns[0] == turns[1]


def random_tiles(rng: random.Random) -> list:
    return [([[(rng.random() < 0.7, rng.random() < 0.7) for _ in range(rng.randint(1, 12))]
              for _ in range(rng.randint(1, 3))], rng.random() < 0.6) for _ in range(rng.randint(1, 6))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("seed", type=int, nargs="?", default=0)
    ap.add_argument("--variant", choices=["patch", "first_form", "no_cap"], default="patch")
    ap.add_argument("--trials", type=int, default=20000)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    failed = sum(not runs_to_the_end(random_tiles(rng), a.variant) for _ in range(a.trials))
    print(f"{a.variant}: {a.trials} random walks, {failed} deadlocked or unpaired")


if __name__ == "__main__":
    main()
