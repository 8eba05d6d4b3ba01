// The persistent, longest-first tile scheduler of the sm90 forward.
//
// Tiles are (q block, q head), in L2 sections: the heads are cut into sections of `section_heads` (whole
// GQA groups, as many kv heads as fit half of L2 with all their keys), section after section; within a
// section, tile i is q block order[i / heads], head i % heads (the heads of one q block side by side).
// So the ~one tile per SM in flight read the K/V of a few heads, which stay in L2 while every q block of
// those heads passes: with all heads at once, many short documents (varlen, batches of 4k) streamed
// their K/V from DRAM again for every q block (ncu, causal 4k x 8: L2 hit rate 28%, DRAM 80% busy).
// The last section is wider (`TailSectionStart`): the longest tiles of a section start when it starts, so
// in a last section of little work per SM they trailed the grid (shared question 16k: +10%; the host model
// cuda/tools/sched_sim.py). It merges the last heads until it holds kTailWaves times the longest tile per
// CTA: LPT over those heads, the L2 locality of the sections kept for the rest.
// `order` lists the q blocks by decreasing work, work being the number
// of key tiles the block's slices visit (plus one for the epilogue), built on the device from the q-block
// slice lists by two small kernels: FwdWorkKernel (a warp per q block) and LaunchLongestFirst's counting sort
// (one CTA, tile_order.cu; ties in any order, which changes when a tile runs, never its result).
// The grid is one CTA per SM; each CTA takes its tiles, the first too, by atomicAdd(counter, 1): greedy
// longest-processing-time-first, the classic 4/3-approximation of the optimal makespan. A CTA whose SM is
// held by a collective when the call starts (sm_margin 0 beside a transfer) joins late with the next tile.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "block_lists.h"
#include "mask.h"
#include "params.h"
#include "tile_order.h"

namespace magi_jax::cuda {

struct FwdSm90Params {
  CUtensorMap q_map, k_map, v_map, out_map;  // [T, H, D] as (D, H, T); boxes (64, 1, rows), 128B swizzle
  FwdParams base;
  const int32_t* order;  // [num q blocks]: q blocks by decreasing work
  int32_t* counter;      // zeroed before the launch
  int num_tiles;         // q blocks x hq
  // The number of q blocks with keys (FwdWorkKernel), for a merging call: the tiles of the others are
  // skipped (the order lists them last). Null: every tile is visited.
  const int32_t* live_blocks;
  int section_heads;     // q heads per L2 section: a multiple of hq / hkv
  // [0] the work of one head's q blocks, [1] the largest q block's (written by the order kernel, tile_order.h
  // OrderOutputs; zero when the work is not computed: no tail merge)
  const unsigned long long* work_stats;
  const int32_t* work;  // [num q blocks]: each q block's work (FwdBlockWork: its steps plus one)
  int claim_lead;       // steps (FwdSm90Tile::kClaimLead)
  int group_gap;        // FwdStepFrom's: the key tile (kBlockN), or kNoGroups (MAGI_JAX_SM90_GROUPS=0)
  // 1 (MAGI_JAX_SM90_PREFETCH_LAST=0: 0): the tile warp prefetches into L2 the K / V of the last key tile of a
  // taken tile's first group, beside its Q: a causal walk's diagonal, whose first reader is this q block, so its
  // K / V come from DRAM late in the walk otherwise (sliding window -0.7% cycles, cuda/NOTES.md).
  int prefetch_last;
};

// A group_gap no two key spans are within: every slice walked alone (the walk before groups, for A/B).
constexpr int kNoGroups = -(1 << 30);

// A step is one key tile [c0, c0 + bn) of a group of slices for the rows [r0, r0 + bm) of a q block. A group
// is a run of consecutive slices of the block's list (cursors cur .. last) whose rows in the block are
// disjoint and ascending and whose key spans overlap or lie less than a tile apart; its tiles cover the
// union of those spans from its first key. Each row of the block then belongs to at most one slice of the
// group, whose interval masks it (GroupRowMasks), and a key tile two slices need is computed once: a q
// block across two documents, across a window's causal head and its band, or across two blocks of
// block-causal attention walked its tiles once per slice (cuda/tools/tile_waste.py: block causal computed
// 1.077x its area, 1.046x so; sliding window 1.196x, 1.160x).
struct FwdStep {
  int cur, last;  // the group's first and last slice cursors; cur -1 when the walk is over
  Slice s;        // the group's first slice
  int c0, ke;
};

// The first group at or after slice cursor `cur`, its slices' key spans less than `gap` keys apart (the key
// tile; kNoGroups: none joins). Warp-collective (SliceWalk).
MAGI_DEV void FwdStepFrom(const SliceWalk& walk, const SliceArgs& a, int64_t r0, int bm, int gap, int cur,
                          FwdStep* st) {
  for (; cur >= 0; cur = walk.Next(a, cur)) {
    const Slice s = LoadSlice(a.q_ranges, a.k_ranges, a.types, walk.SliceId(cur), a.tq, a.tk);
    int64_t rb, re;
    RowsIn(s, r0, bm, &rb, &re);
    if (rb >= re) continue;
    int64_t kb, ke;
    KeySpan(s, rb, re, &kb, &ke);
    if (kb >= ke) continue;
    st->cur = st->last = cur;
    st->s = s;
    // Join the slices after it while they qualify (a slice without keys here ends the group: the next
    // group's search skips it).
    int64_t rows_end = re;
    for (int n = walk.Next(a, cur); n >= 0; n = walk.Next(a, n)) {
      const Slice m = LoadSlice(a.q_ranges, a.k_ranges, a.types, walk.SliceId(n), a.tq, a.tk);
      int64_t mb, me;
      RowsIn(m, r0, bm, &mb, &me);
      if (mb < rows_end || mb >= me) break;
      int64_t mkb, mke;
      KeySpan(m, mb, me, &mkb, &mke);
      if (mkb >= mke || mkb - ke >= gap || kb - mke >= gap) break;
      st->last = n;
      rows_end = me;
      kb = mkb < kb ? mkb : kb;
      ke = mke > ke ? mke : ke;
    }
    st->c0 = int(kb);
    st->ke = int(ke);
    return;
  }
  st->cur = -1;
}

// Advances to the next step; returns true when it starts a new group (or ends the walk).
MAGI_DEV bool FwdStepNext(const SliceWalk& walk, const SliceArgs& a, int64_t r0, int bm, int bn, int gap,
                          FwdStep* st) {
  st->c0 += bn;
  if (st->c0 < st->ke) return false;
  FwdStepFrom(walk, a, r0, bm, gap, walk.Next(a, st->last), st);
  return true;
}

// The mask of a group (FwdStep) for a warpgroup's rows [wr0, wr0 + wm), of which a thread holds row and
// row + 8: each row's keys [lo, hi) in its slice (empty in none), and the key tiles needing no per-cell mask
// (every row of the warpgroup in the group, attending the whole tile). A group of one slice reads nothing
// more; a larger one loads its other slices (warp-collective: SliceWalk).
MAGI_DEV void GroupRowMasks(const SliceWalk& walk, const SliceArgs& a, const FwdStep& st, int64_t wr0, int wm,
                            int bn, int64_t row, int (&lo)[2], int (&hi)[2], TileRange* interior) {
  RowInterval(st.s, row, &lo[0], &hi[0]);
  RowInterval(st.s, row + 8, &lo[1], &hi[1]);
  if (st.last == st.cur) {
    *interior = InteriorKeyTiles(st.s, wr0, wm, bn);
    return;
  }
  // The tiles interior for every slice's own rows of the warpgroup, if the slices hold all of its rows.
  TileRange in{INT_MIN, INT_MAX};
  int covered = 0;
  for (int c = st.cur;; c = walk.Next(a, c)) {
    const Slice m = c == st.cur ? st.s : LoadSlice(a.q_ranges, a.k_ranges, a.types, walk.SliceId(c), a.tq, a.tk);
    if (c != st.cur) {
      if (row >= m.qs && row < m.qe) RowInterval(m, row, &lo[0], &hi[0]);
      if (row + 8 >= m.qs && row + 8 < m.qe) RowInterval(m, row + 8, &lo[1], &hi[1]);
    }
    int64_t rb, re;
    RowsIn(m, wr0, wm, &rb, &re);
    if (rb < re) {
      const TileRange own = InteriorKeyTiles(m, rb, int(re - rb), bn);
      covered += int(re - rb);
      in.lo = own.lo > in.lo ? own.lo : in.lo;
      in.hi = own.hi < in.hi ? own.hi : in.hi;
    }
    if (c == st.last) break;
  }
  *interior = covered == wm ? in : TileRange{1, 0};
}

// Key tiles visited by q block qb (the same walk as the kernel), plus one. Warp-collective.
MAGI_DEV int FwdBlockWork(const SliceArgs& a, const SliceWalk& walk, int qb, int bm, int bn, int gap) {
  const int64_t r0 = int64_t(qb) * bm;
  int work = 1;
  FwdStep st;
  for (FwdStepFrom(walk, a, r0, bm, gap, walk.First(a), &st); st.cur >= 0;
       FwdStepFrom(walk, a, r0, bm, gap, walk.Next(a, st.last), &st))
    work += (st.ke - st.c0 + bn - 1) / bn;
  return work;
}

// What the producer publishes per tile in the tile ring: the tile and its first step, which the producer
// finds anyway for its own loads. A consumer starts the tile from shared memory alone, with no global load
// before its first S (it used to load the step's slice itself: a memory latency at every tile start, ahead
// of the first wgmma, in both warpgroups at once).
struct FwdTileRecord {
  int tile;         // the decoded tile, q block * hq + head; num_tiles: no more tiles
  int cur, last;    // the first group's slice cursors; cur < 0: the tile has no step (the fields below unset)
  int qs, qe, ks, ke, type;  // its first slice, clamped (Slice; sizes are < 2^31, CheckSizes)
  int c0, step_ke;  // its key span in the q block (FwdStep::c0, ke)
  int steps;        // its key tiles, all slices (the K/V warp's claim_next arrival counts them down)

  // The record of `tile` whose first step is `first` (found by the walk). The slice is loaded again here
  // (an L1 hit) rather than taken from first.s: kept from the walk to the slot's wait, its fields took the
  // producer's 40 registers into spills.
  MAGI_DEV static FwdTileRecord Of(const SliceArgs& a, const SliceWalk& walk, int tile, const FwdStep& first,
                                   int steps) {
    if (first.cur < 0) return {tile, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    const Slice s = LoadSlice(a.q_ranges, a.k_ranges, a.types, walk.SliceId(first.cur), a.tq, a.tk);
    return {tile, first.cur, first.last, int(s.qs), int(s.qe), int(s.ks), int(s.ke), s.type, first.c0, first.ke,
            steps};
  }
  MAGI_DEV FwdStep Step() const {
    FwdStep st;
    st.cur = cur;
    st.last = last;
    st.s = Slice{qs, qe, ks, ke, type};
    st.c0 = c0;
    st.ke = step_ke;
    return st;
  }
};

// The first head of the wider last section (tile_order.h).
MAGI_DEV int TailSectionStart(const FwdSm90Params& p, int ctas) {
  return TailFirstHead(p.base.hq, p.base.hq / p.base.hkv, p.section_heads, p.work_stats[0], p.work_stats[1], ctas);
}

// The tiles the call visits: all of them, or those of the q blocks with keys (live_blocks).
MAGI_DEV int VisitedTiles(const FwdSm90Params& p) {
  return p.live_blocks != nullptr ? *p.live_blocks * p.base.hq : p.num_tiles;
}

// Tile t < tiles (VisitedTiles) -> (q block, head) (tile_order.h SectionTile).
MAGI_DEV void DecodeTile(const FwdSm90Params& p, int tail_first, int tiles, int t, int* qb, int* h) {
  SectionTile(p.order, tiles / p.base.hq, p.base.hq, p.section_heads, tail_first, t, qb, h);
}

}  // namespace magi_jax::cuda
