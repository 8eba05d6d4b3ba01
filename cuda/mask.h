// Slice masks on fragments. A thread holds a few rows (forward, dq) or a few keys (dk/dv) of each tile;
// it keeps the [lo, hi) interval of each (DESIGN.md section 1 via slice_geometry.h) and masks a cell when
// its column falls outside. Tiles wholly inside the slice skip the per-cell test (see *Interior).
#pragma once

#include <climits>

#include "ptx.h"
#include "slice_geometry.h"

namespace magi_jax::cuda {

// Keys [lo, hi) of row r of slice s; empty when r is not one of the slice's rows.
MAGI_DEV void RowInterval(const Slice& s, int64_t r, int* lo, int* hi) {
  if (r < s.qs || r >= s.qe) {
    *lo = INT_MAX;
    *hi = INT_MIN;
    return;
  }
  int64_t a, b;
  RowKeys(s, r, &a, &b);
  *lo = int(a);
  *hi = int(b);
}

// Rows [lo, hi) attending key c of slice s; empty when c is not one of the slice's keys.
MAGI_DEV void KeyInterval(const Slice& s, int64_t c, int* lo, int* hi) {
  if (c < s.ks || c >= s.ke) {
    *lo = INT_MAX;
    *hi = INT_MIN;
    return;
  }
  int64_t a, b;
  KeyRows(s, c, &a, &b);
  *lo = int(a);
  *hi = int(b);
}

// The slice's rows among [r0, r0 + m): [*rb, *re), empty when rb >= re.
MAGI_DEV void RowsIn(const Slice& s, int64_t r0, int m, int64_t* rb, int64_t* re) {
  *rb = s.qs > r0 ? s.qs : r0;
  *re = s.qe < r0 + m ? s.qe : r0 + m;
}

// Keys [*kb, *ke) attended by some row of [rb, re) (bounds are monotone in the row).
MAGI_DEV void KeySpan(const Slice& s, int64_t rb, int64_t re, int64_t* kb, int64_t* ke) {
  int64_t unused;
  RowKeys(s, rb, kb, &unused);
  RowKeys(s, re - 1, &unused, ke);
}

// Rows [*rb, *re) attending some key of [cb, ce).
MAGI_DEV void RowSpan(const Slice& s, int64_t cb, int64_t ce, int64_t* rb, int64_t* re) {
  int64_t unused;
  KeyRows(s, cb, rb, &unused);
  KeyRows(s, ce - 1, &unused, re);
}

// Tile starts c0 with lo <= c0 <= hi (an empty range when lo > hi).
struct TileRange {
  int lo, hi;
  MAGI_DEV bool Contains(int c0) const { return c0 >= lo && c0 <= hi; }
};

// The key tiles [c0, c0 + n) that every row of [r0, r0 + m) attends in full (all rows slice rows).
MAGI_DEV TileRange InteriorKeyTiles(const Slice& s, int64_t r0, int m, int n) {
  if (r0 < s.qs || r0 + m > s.qe) return {1, 0};
  int64_t lo_last, hi_first, unused;
  RowKeys(s, r0 + m - 1, &lo_last, &unused);
  RowKeys(s, r0, &unused, &hi_first);
  return {int(lo_last), int(hi_first - n)};
}

// The row tiles [r0, r0 + m) attending every key of [c0, c0 + n) in full (all keys slice keys).
MAGI_DEV TileRange InteriorRowTiles(const Slice& s, int64_t c0, int n, int m) {
  if (c0 < s.ks || c0 + n > s.ke) return {1, 0};
  int64_t lo_last, hi_first, unused;
  KeyRows(s, c0 + n - 1, &lo_last, &unused);
  KeyRows(s, c0, &unused, &hi_first);
  return {int(lo_last), int(hi_first - m)};
}

// True when every row of [r0, r0 + m) is a slice row attending every key of [c0, c0 + n).
MAGI_DEV bool RowTileInterior(const Slice& s, int64_t r0, int m, int64_t c0, int n) {
  if (r0 < s.qs || r0 + m > s.qe) return false;
  int64_t lo_last, hi_first, unused;
  RowKeys(s, r0 + m - 1, &lo_last, &unused);
  RowKeys(s, r0, &unused, &hi_first);
  return lo_last <= c0 && hi_first >= c0 + n;
}

// True when every key of [c0, c0 + n) is a slice key attended by every row of [r0, r0 + m).
MAGI_DEV bool KeyTileInterior(const Slice& s, int64_t c0, int n, int64_t r0, int m) {
  if (c0 < s.ks || c0 + n > s.ke) return false;
  int64_t lo_last, hi_first, unused;
  KeyRows(s, c0 + n - 1, &lo_last, &unused);
  KeyRows(s, c0, &unused, &hi_first);
  return lo_last <= r0 && hi_first >= r0 + m;
}

// Masks S fragments [MT][NT][4] of rows (mi, half) with intervals lo/hi[mi * 2 + half]; columns start at
// c0 + 8 ni + 2 t.
template <int MT, int NT>
MAGI_DEV void MaskRows(float (&s)[MT][NT][4], const int (&lo)[MT * 2], const int (&hi)[MT * 2], int c0, int t) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = c0 + ni * 8 + 2 * t + (e & 1), r = mi * 2 + (e >> 1);
        if (c < lo[r] || c >= hi[r]) s[mi][ni][e] = -INFINITY;
      }
}

// MaskRows for whole warps (warp-collective: all 32 lanes, warp-uniform flow), comparing only the bounds
// that cut some cell of the warp's tile. A masked tile is mostly cut on one side (a causal diagonal: hi; a
// window's or a document's first keys: lo), and each side costs an ISETP per cell: the two-sided MaskRows
// made a masked step's softmax ~1.6x an interior one's (224 more instructions for 64 cells at D 128).
// Bounds relative to the thread's first column: cell (ni, e) is at offset 8 ni + (e & 1), an immediate.
template <int MT, int NT>
MAGI_DEV void MaskRowsWarp(float (&s)[MT][NT][4], const int (&lo)[MT * 2], const int (&hi)[MT * 2], int c0, int t) {
  constexpr int kLastOffset = 8 * (NT - 1) + 1;
  int rlo[MT * 2], rhi[MT * 2];
  bool cut_lo = false, cut_hi = false;
#pragma unroll
  for (int r = 0; r < MT * 2; ++r) {
    rlo[r] = lo[r] - c0 - 2 * t;
    rhi[r] = hi[r] - c0 - 2 * t;
    cut_lo |= rlo[r] > 0;
    cut_hi |= rhi[r] <= kLastOffset;
  }
  cut_lo = __any_sync(0xffffffffu, cut_lo);
  cut_hi = __any_sync(0xffffffffu, cut_hi);
  auto apply = [&](auto keep) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!keep(ni * 8 + (e & 1), mi * 2 + (e >> 1))) s[mi][ni][e] = -INFINITY;
  };
  if (cut_lo && cut_hi) {
    apply([&](int k, int r) { return k >= rlo[r] && k < rhi[r]; });
  } else if (cut_lo) {
    apply([&](int k, int r) { return k >= rlo[r]; });
  } else if (cut_hi) {
    apply([&](int k, int r) { return k < rhi[r]; });
  }
}

}  // namespace magi_jax::cuda
