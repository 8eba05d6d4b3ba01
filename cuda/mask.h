// Slice masks on fragments. A thread holds a few rows (forward, dq) or a few keys (dk/dv) of each tile;
// it keeps the [lo, hi) interval of each (DESIGN.md section 1 via slice_geometry.h) and masks a cell when
// its column falls outside. Tiles wholly inside the slice skip the per-cell test (see *Interior).
#pragma once

#include <climits>
#include <type_traits>

#include <cuda_fp16.h>

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

// fp16 bits of a small non-negative integer (exact below 2048): the column offsets as f16x2 immediates.
__host__ __device__ constexpr uint32_t HalfBits(int n) {
  int e = 0;
  while ((2 << e) <= n) ++e;
  return n == 0 ? 0u : uint32_t(((e + 15) << 10) | ((n << (10 - e)) & 0x3ff));
}

// A bound clamped to [0, 128] (the columns compared lie in [0, 8 NT), NT <= 16) in both halves of an f16x2.
// In asm: as C++, LLVM hoisted the clamps out of the masked steps' branch into every step.
MAGI_DEV uint32_t BoundPair(int b) {
  uint32_t pair;
  asm("{\n.reg .s32 c;\n.reg .f16 h;\nmax.s32 c, %1, 0;\nmin.s32 c, c, 128;\ncvt.rn.f16.s32 h, c;\n"
      "mov.b32 %0, {h, h};\n}\n" : "=r"(pair) : "r"(b));
  return pair;
}

// Cells (k, k + 1) of one row kept or set to -inf by one f16x2 comparison of (k, k + 1) against a bound in
// both halves (HSETP2: two predicates per instruction, against an ISETP per cell). kBelow: keep k < bound,
// else keep k >= bound.
template <bool kBelow>
MAGI_DEV void KeepPair(float& s0, float& s1, uint32_t k_pair, uint32_t bound_pair) {
  if constexpr (kBelow)
    asm("{\n.reg .pred p, q;\nsetp.lt.f16x2 p|q, %2, %3;\nselp.f32 %0, %0, 0fFF800000, p;\n"
        "selp.f32 %1, %1, 0fFF800000, q;\n}\n" : "+f"(s0), "+f"(s1) : "r"(k_pair), "r"(bound_pair));
  else
    asm("{\n.reg .pred p, q;\nsetp.ge.f16x2 p|q, %2, %3;\nselp.f32 %0, %0, 0fFF800000, p;\n"
        "selp.f32 %1, %1, 0fFF800000, q;\n}\n" : "+f"(s0), "+f"(s1) : "r"(k_pair), "r"(bound_pair));
}

// MaskRows for whole warps (warp-collective: all 32 lanes, warp-uniform flow), comparing only the bounds
// that cut some cell of the warp's tile. A masked tile is mostly cut on one side (a causal diagonal: hi; a
// window's or a document's first keys: lo): there a row's two cells of an 8-column group take one f16x2
// comparison (KeepPair); both sides cost an ISETP per cell and side (the two-sided MaskRows made a masked
// step's softmax ~1.6x an interior one's: 224 more instructions for 64 cells at D 128).
// Bounds relative to the thread's first column: cell (ni, e) is at offset 8 ni + (e & 1), an immediate.
template <int MT, int NT>
MAGI_DEV void MaskRowsWarp(float (&s)[MT][NT][4], const int (&lo)[MT * 2], const int (&hi)[MT * 2], int c0, int t) {
  static_assert(NT <= 16, "BoundPair clamps to the 128 columns of NT <= 16");
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
  // Each side's bound pairs, then per row and 8-column group one KeepPair a side. Both sides as two KeepPairs
  // cost what an ISETP per cell and side did; written as C++ compares, LLVM hoisted them out of their branch
  // into the loop top of the forward (133 ISETP a step, interior steps too).
  auto keep = [&](auto below, const int (&bound)[MT * 2]) {
    uint32_t pair[MT * 2];
#pragma unroll
    for (int r = 0; r < MT * 2; ++r) pair[r] = BoundPair(bound[r]);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          KeepPair<decltype(below)::value>(s[mi][ni][2 * half], s[mi][ni][2 * half + 1],
                                           HalfBits(8 * ni) | (HalfBits(8 * ni + 1) << 16), pair[mi * 2 + half]);
  };
  if (cut_lo) keep(std::false_type{}, rlo);
  if (cut_hi) keep(std::true_type{}, rhi);
}

}  // namespace magi_jax::cuda
