// The forward kernel: one CTA per (q block, q head). It walks every slice touching its rows (the q-block
// slice list) and, for each, the key tiles those rows attend, with ONE online softmax across all of them:
// overlapping slices merge exactly and no cross-CTA merge is needed (DESIGN.md section 1).
//
// Pipeline per key tile (FlashAttention-2 style, single-buffered K and V): V(j) is fetched while
// S = Q K(j)^T and the softmax run, K(j + 1) while O += P V(j) runs.
#pragma once

#include "block_lists.h"
#include "epilogue.h"
#include "mask.h"
#include "params.h"
#include "scheduler.h"
#include "smem.h"
#include "softmax.h"
#include "tile_size.h"
#include "warp_gemm.h"

namespace magi_jax::cuda {

template <typename T, int D>
__global__ void __launch_bounds__(FwdTile<D>::kThreads, 2) FlashFwdKernel(FwdParams p) {
  using Tile = FwdTile<D>;
  constexpr int BM = Tile::kBlockM, BN = Tile::kBlockN, kThreads = Tile::kThreads, MT = Tile::kMTiles;
  constexpr int NT = BN / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sq = reinterpret_cast<T*>(smem_raw);
  T* sk = sq + SmemElems<BM, D>();
  T* sv = sk + SmemElems<BN, D>();

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const TileCoord tile = FwdTileOrder(NumBlocks(p.slices.tq, BM));
  const int qb = tile.block, h = tile.head, hk = h / (p.hq / p.hkv);
  const int tq = p.slices.tq, tk = p.slices.tk;
  const int64_t r0 = int64_t(qb) * BM;
  const int64_t q_stride = int64_t(p.hq) * D, kv_stride = int64_t(p.kv_row_heads) * D;
  const T* q = static_cast<const T*>(p.q) + r0 * q_stride + int64_t(h) * D;
  const T* k = static_cast<const T*>(p.k) + int64_t(hk) * D;
  const T* v = static_cast<const T*>(p.v) + int64_t(hk) * D;

  LoadTileAsync<BM, D, kThreads>(sq, q, q_stride, int(tq - r0), tid);
  CpAsyncCommit();

  const bool softcap = p.softcap > 0.0f;
  const float scale_log2 = (softcap ? 1.0f : p.scale) * kLog2e;
  float acc[MT][DT][4];
  Zero(acc);
  OnlineSoftmax<MT> softmax;
  const int warp_row0 = warp * Tile::kRowsPerWarp;

  const SliceWalk walk(p.slices, p.lists, qb);
  for (int cur = walk.First(p.slices); cur >= 0; cur = walk.Next(p.slices, cur)) {
    const Slice s = LoadSlice(p.slices.q_ranges, p.slices.k_ranges, p.slices.types, walk.SliceId(cur), tq, tk);
    int64_t rb, re;
    RowsIn(s, r0, BM, &rb, &re);
    if (rb >= re) continue;
    int kb, ke;
    {
      int64_t b, e;
      KeySpan(s, rb, re, &b, &e);
      kb = int(b);
      ke = int(e);
    }
    if (kb >= ke) continue;
    int lo[MT * 2], hi[MT * 2];
#pragma unroll
    for (int r = 0; r < MT * 2; ++r) RowInterval(s, r0 + warp_row0 + (r >> 1) * 16 + (r & 1) * 8 + g, &lo[r], &hi[r]);
    // Key tiles [c0, c0 + BN) with c0 in [interior_lo, interior_hi] need no per-cell mask.
    const TileRange interior = InteriorKeyTiles(s, r0, BM, BN);

    LoadTileAsync<BN, D, kThreads>(sk, k + int64_t(kb) * kv_stride, kv_stride, tk - kb, tid);
    CpAsyncCommit();
    for (int c0 = kb; c0 < ke; c0 += BN) {
      CpAsyncWait<0>();
      __syncthreads();  // K(j) landed; every warp is done with V(j - 1)
      LoadTileAsync<BN, D, kThreads>(sv, v + int64_t(c0) * kv_stride, kv_stride, tk - c0, tid);
      CpAsyncCommit();

      float sc[MT][NT][4];
      Zero(sc);
      GemmABt<T, MT, NT, D, D, D>(sc, sq, warp_row0, sk, 0, lane);
      if (softcap) ApplySoftcap(sc, p.scale, p.softcap);
      if (!interior.Contains(c0)) MaskRows(sc, lo, hi, c0, t);
      softmax.Update(sc, acc, scale_log2);

      CpAsyncWait<0>();
      __syncthreads();  // V(j) landed; every warp is done with K(j)
      if (c0 + BN < ke) {
        LoadTileAsync<BN, D, kThreads>(sk, k + int64_t(c0 + BN) * kv_stride, kv_stride, tk - c0 - BN, tid);
        CpAsyncCommit();
      }
      GemmRegB<T, MT, DT, NT, D>(acc, sc, sv, 0, lane);
    }
  }

  float lse[MT * 2];
  softmax.Finish(acc, scale_log2, lse);
  if (p.max_logit != nullptr && t == 0) {
    // The softmax's maxima are exact here, over raw scores (or softcapped logits, whose scale is 1).
    const float unit = softcap ? 1.0f : p.scale;
#pragma unroll
    for (int r = 0; r < MT * 2; ++r) {
      const int64_t row = r0 + warp_row0 + (r >> 1) * 16 + (r & 1) * 8 + g;
      if (row < tq) p.max_logit[row * p.hq + h] = softmax.m[r] == -INFINITY ? -INFINITY : softmax.m[r] * unit;
    }
  }
  if (p.out_prev != nullptr)
    MergeWithPrevious<T, MT, DT>(acc, lse, static_cast<const T*>(p.out_prev), p.lse_prev, r0 + warp_row0, tq, p.hq,
                                 h, tid & 31);
  CpAsyncWait<0>();
  __syncthreads();  // Q is free (and nothing is in flight): stage the output there
  StoreRowsAndLse<T, MT, DT, BM, D, kThreads>(acc, lse, sq, static_cast<T*>(p.out) + r0 * q_stride + int64_t(h) * D,
                                               q_stride, p.lse + r0 * p.hq + h, p.hq, int(tq - r0), warp_row0, tid);
}

}  // namespace magi_jax::cuda
