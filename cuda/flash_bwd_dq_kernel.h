// The deterministic dq kernel: one CTA per (q block, q head), the forward's walk (every slice touching the
// block, the key tiles its rows attend), dQ += dS K accumulated in registers and written once: no atomics,
// bitwise reproducible. 8 warps of 16 rows; K and V tiles double-buffered.
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
__global__ void __launch_bounds__(BwdQTile<D>::kThreads, 1) FlashBwdDqKernel(BwdParams p) {
  using Tile = BwdQTile<D>;
  constexpr int BM = Tile::kBlockM, BN = Tile::kBlockN, kThreads = Tile::kThreads;
  constexpr int NT = BN / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sq = reinterpret_cast<T*>(smem_raw);
  constexpr int kKvTile = SmemElems<BN, D>();
  T* sdo = sq + SmemElems<BM, D>();
  T* sk = sdo + SmemElems<BM, D>();  // [2][BN][D]
  T* sv = sk + 2 * kKvTile;          // [2][BN][D]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const TileCoord tile = FwdTileOrder(NumBlocks(p.slices.tq, BM));
  const int qb = tile.block, h = tile.head, hk = h / (p.hq / p.hkv);
  const int tq = p.slices.tq, tk = p.slices.tk;
  const int64_t r0 = int64_t(qb) * BM;
  const int64_t q_stride = int64_t(p.hq) * D, kv_stride = int64_t(p.hkv) * D;
  const int64_t q_offset = r0 * q_stride + int64_t(h) * D;
  const T* k = static_cast<const T*>(p.k) + int64_t(hk) * D;
  const T* v = static_cast<const T*>(p.v) + int64_t(hk) * D;

  LoadTileAsync<BM, D, kThreads>(sq, static_cast<const T*>(p.q) + q_offset, q_stride, int(tq - r0), tid);
  LoadTileAsync<BM, D, kThreads>(sdo, static_cast<const T*>(p.dout) + q_offset, q_stride, int(tq - r0), tid);
  CpAsyncCommit();

  const int row0 = warp * 16;
  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = r0 + row0 + half * 8 + g;
    lse2[half] = INFINITY;
    delta[half] = 0.0f;
    if (row < tq) {
      const float l = p.lse[row * p.hq + h];
      lse2[half] = l == -INFINITY ? INFINITY : l * kLog2e;
      delta[half] = p.delta[row * p.hq + h];
    }
  }
  auto load_kv = [&](int64_t c, int b) {
    LoadTileAsync<BN, D, kThreads>(sk + b * kKvTile, k + c * kv_stride, kv_stride, int(tk - c), tid);
    LoadTileAsync<BN, D, kThreads>(sv + b * kKvTile, v + c * kv_stride, kv_stride, int(tk - c), tid);
    CpAsyncCommit();
  };

  const bool softcap = p.softcap > 0.0f;
  const float scale_log2 = (softcap ? 1.0f : p.scale) * kLog2e;
  float dq[1][DT][4];
  Zero(dq);
  int buf = 0;

  const SliceWalk walk(p.slices, p.q_lists, qb);
  for (int cur = walk.First(p.slices); cur >= 0; cur = walk.Next(p.slices, cur)) {
    const Slice s = LoadSlice(p.slices.q_ranges, p.slices.k_ranges, p.slices.types, walk.SliceId(cur), tq, tk);
    int64_t rb, re;
    RowsIn(s, r0, BM, &rb, &re);
    if (rb >= re) continue;
    int64_t kb, ke;
    KeySpan(s, rb, re, &kb, &ke);
    if (kb >= ke) continue;
    int lo[2], hi[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) RowInterval(s, r0 + row0 + half * 8 + g, &lo[half], &hi[half]);

    load_kv(kb, buf);
    for (int64_t c0 = kb; c0 < ke; c0 += BN) {
      CpAsyncWait<0>();
      __syncthreads();  // K(j), V(j) landed; every warp is done with tile j - 1
      if (c0 + BN < ke) load_kv(c0 + BN, buf ^ 1);
      const T* skb = sk + buf * kKvTile;
      float sc[1][NT][4], dp[1][NT][4];
      Zero(sc);
      Zero(dp);
      GemmABt<T, 1, NT, D, D, D>(sc, sq, row0, skb, 0, lane);                // S = Q K^T
      GemmABt<T, 1, NT, D, D, D>(dp, sdo, row0, sv + buf * kKvTile, 0, lane);  // dP = dO V^T
      if (softcap) ApplySoftcap(sc, p.scale, p.softcap);
      if (!RowTileInterior(s, r0, BM, c0, BN)) MaskRows(sc, lo, hi, int(c0), t);
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e >> 1;
          const float x = sc[0][ni][e];
          const float prob = Exp2(x * scale_log2 - lse2[half]);
          float ds = prob * (dp[0][ni][e] - delta[half]);
          if (softcap) {
            const float th = x / p.softcap;
            ds = x == -INFINITY ? 0.0f : ds * (1.0f - th * th);
          }
          dp[0][ni][e] = ds;
        }
      GemmRegB<T, 1, DT, NT, D>(dq, dp, skb, 0, lane);  // dQ += dS K
      buf ^= 1;
    }
  }

  CpAsyncWait<0>();
  __syncthreads();
  FragmentsToSmem<T, 1, DT, D>(dq, sq, row0, p.scale, lane);
  __syncthreads();
  StoreTile<BM, D, kThreads>(static_cast<T*>(p.dq) + q_offset, sq, q_stride, int(tq - r0), tid);
}

}  // namespace magi_jax::cuda
