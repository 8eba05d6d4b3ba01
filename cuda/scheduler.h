// Which tile a CTA owns, and the order of the steps inside a dk/dv CTA.
//
// Grids are (blocks, heads). The forward takes q blocks last-first: under causal-like masks the last
// blocks of a document carry the most keys, and starting the longest tiles first shortens the tail.
// The dk/dv kernel takes k blocks first-first for the same reason (the first keys have the most rows).
// (The sm90 kernels order their tiles longest first on the device instead: tile_order.h.)
#pragma once

#include "block_lists.h"
#include "mask.h"
#include "ptx.h"

namespace magi_jax::cuda {

struct TileCoord {
  int block, head;
};

MAGI_DEV TileCoord FwdTileOrder(int num_blocks) { return {num_blocks - 1 - int(blockIdx.x), int(blockIdx.y)}; }
MAGI_DEV TileCoord KvTileOrder() { return {int(blockIdx.x), int(blockIdx.y)}; }

// One step of a dk/dv CTA: rows [rb, rb + kBlockM) of q head (kv head * group + head) against the CTA's
// keys [c0, c1), inside slice s. Steps run slice by slice (ascending id), head by head, row tile by row tile.
struct KvStep {
  int cur;  // slice cursor; -1 when the walk is over
  Slice s;
  int64_t rb_all, re_all;  // rows of s attending some key of the CTA
  int head;
  int64_t rb;
};

// The first step at or after slice cursor `cur`; sets st->cur = -1 when none.
MAGI_DEV void StartSlice(const SliceWalk& walk, const SliceArgs& a, int64_t c0, int64_t c1, int cur, KvStep* st) {
  for (; cur >= 0; cur = walk.Next(a, cur)) {
    const Slice s = LoadSlice(a.q_ranges, a.k_ranges, a.types, walk.SliceId(cur), a.tq, a.tk);
    const int64_t cb = s.ks > c0 ? s.ks : c0, ce = s.ke < c1 ? s.ke : c1;
    if (cb >= ce) continue;
    int64_t rb, re;
    RowSpan(s, cb, ce, &rb, &re);
    if (rb >= re) continue;
    st->cur = cur;
    st->s = s;
    st->rb_all = rb;
    st->re_all = re;
    st->head = 0;
    st->rb = rb;
    return;
  }
  st->cur = -1;
}

// The steps of a dk/dv CTA over keys [c0, c1) (the walk above), plus one for its K / V loads and dK / dV
// stores: the work of the sm90 backward's longest-first order (launch_bwd_sm90.cu). Warp-collective.
MAGI_DEV int KvBlockWork(const SliceWalk& walk, const SliceArgs& a, int64_t c0, int64_t c1, int group, int block_m) {
  int work = 1;
  KvStep st;
  for (StartSlice(walk, a, c0, c1, walk.First(a), &st); st.cur >= 0;
       StartSlice(walk, a, c0, c1, walk.Next(a, st.cur), &st))
    work += group * int((st.re_all - st.rb_all + block_m - 1) / block_m);
  return work;
}

MAGI_DEV void AdvanceStep(const SliceWalk& walk, const SliceArgs& a, int64_t c0, int64_t c1, int group,
                          int block_m, KvStep* st) {
  st->rb += block_m;
  if (st->rb < st->re_all) return;
  st->rb = st->rb_all;
  if (++st->head < group) return;
  StartSlice(walk, a, c0, c1, walk.Next(a, st->cur), st);
}

}  // namespace magi_jax::cuda
