// The dk/dv kernel: one CTA per (k block, kv head). It walks every slice touching its keys (the k-block
// slice list), every q head of its group, and the row tiles attending its keys, accumulating dK and dV in
// registers: each CTA owns its rows of dk and dv, so they need no atomics and are deterministic.
//
// Each warp owns 16 keys and computes the transposed tiles S^T = K Q^T and dP^T = V dO^T, so P^T and dS^T
// are already A operands (registers) of dV += P^T dO and dK += dS^T Q. Row tiles (Q, dO, lse, delta) are
// double-buffered: the next step's rows load during this step's five GEMMs.
// kAtomicDq: also dQ += dS K, through dS^T staged in shared memory, added to an fp32 accumulator with
// atomics (fast, not bitwise reproducible); otherwise the dq kernel computes dq separately.
#pragma once

#include "block_lists.h"
#include "mask.h"
#include "params.h"
#include "scheduler.h"
#include "smem.h"
#include "softmax.h"
#include "tile_size.h"
#include "warp_gemm.h"
#include "epilogue.h"

namespace magi_jax::cuda {

template <typename T, int D, bool kAtomicDq>
__global__ void __launch_bounds__(BwdKvTile<D>::kThreads, 1) FlashBwdDkDvKernel(BwdParams p) {
  using Tile = BwdKvTile<D>;
  constexpr int BN = Tile::kBlockN, BM = Tile::kBlockM, kThreads = Tile::kThreads;
  constexpr int NR = BM / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sk = reinterpret_cast<T*>(smem_raw);
  constexpr int kRowTile = SmemElems<BM, D>();
  T* sv = sk + SmemElems<BN, D>();
  T* sq = sv + SmemElems<BN, D>();  // [2][BM][D]
  T* sdo = sq + 2 * kRowTile;       // [2][BM][D]
  T* sds = sdo + 2 * kRowTile;      // [BN][BM]: dS^T
  float* slse = reinterpret_cast<float*>(sds + SmemElems<BN, BM>());  // [2][BM], log2 units; +inf: empty row
  float* sdelta = slse + 2 * BM;                          // [2][BM]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const TileCoord tile = KvTileOrder();
  const int hk = tile.head, group = p.hq / p.hkv;
  const int tq = p.slices.tq, tk = p.slices.tk;
  const int64_t c0 = int64_t(tile.block) * BN, c1 = c0 + BN;
  const int64_t q_stride = int64_t(p.hq) * D, kv_stride = int64_t(p.hkv) * D;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  const float* lse = p.lse;
  const float* delta = p.delta;
  const int hq = p.hq;

  LoadTileAsync<BN, D, kThreads>(sk, static_cast<const T*>(p.k) + c0 * kv_stride + int64_t(hk) * D, kv_stride,
                                 int(tk - c0), tid);
  LoadTileAsync<BN, D, kThreads>(sv, static_cast<const T*>(p.v) + c0 * kv_stride + int64_t(hk) * D, kv_stride,
                                 int(tk - c0), tid);
  CpAsyncCommit();

  // Rows of one step into buffer b: Q, dO (async), lse in log2 units and delta.
  auto load_rows = [&](const KvStep& st, int b) {
    const int h = hk * group + st.head;
    const int64_t offset = st.rb * q_stride + int64_t(h) * D;
    LoadTileAsync<BM, D, kThreads>(sq + b * kRowTile, q + offset, q_stride, int(tq - st.rb), tid);
    LoadTileAsync<BM, D, kThreads>(sdo + b * kRowTile, dout + offset, q_stride, int(tq - st.rb), tid);
    if (tid < BM) {
      const int64_t row = st.rb + tid;
      float l2 = INFINITY, dl = 0.0f;
      if (row < tq) {
        const float l = lse[row * hq + h];
        l2 = l == -INFINITY ? INFINITY : l * kLog2e;
        dl = delta[row * hq + h];
      }
      slse[b * BM + tid] = l2;
      sdelta[b * BM + tid] = dl;
    }
  };

  const SliceWalk walk(p.slices, p.k_lists, tile.block);
  KvStep st;
  StartSlice(walk, p.slices, c0, c1, walk.First(p.slices), &st);
  if (st.cur >= 0) load_rows(st, 0);
  CpAsyncCommit();

  const bool softcap = p.softcap > 0.0f;
  const float scale_log2 = (softcap ? 1.0f : p.scale) * kLog2e;
  float dk[1][DT][4], dv[1][DT][4];
  Zero(dk);
  Zero(dv);
  const int key0 = warp * 16;
  int klo[2], khi[2], interval_cur = -1;
  int buf = 0;

  while (st.cur >= 0) {
    CpAsyncWait<0>();
    __syncthreads();  // this step's rows landed; every warp is done with the previous step
    KvStep next = st;
    AdvanceStep(walk, p.slices, c0, c1, group, BM, &next);
    if (next.cur >= 0) load_rows(next, buf ^ 1);
    CpAsyncCommit();
    if (st.cur != interval_cur) {
      interval_cur = st.cur;
#pragma unroll
      for (int half = 0; half < 2; ++half) KeyInterval(st.s, c0 + key0 + half * 8 + g, &klo[half], &khi[half]);
    }
    const T* sqb = sq + buf * kRowTile;
    const T* sdob = sdo + buf * kRowTile;

    float sc[1][NR][4], dp[1][NR][4];
    Zero(sc);
    Zero(dp);
    GemmABt<T, 1, NR, D, D, D>(sc, sk, key0, sqb, 0, lane);   // S^T = K Q^T
    GemmABt<T, 1, NR, D, D, D>(dp, sv, key0, sdob, 0, lane);  // dP^T = V dO^T
    if (softcap) ApplySoftcap(sc, p.scale, p.softcap);
    if (!KeyTileInterior(st.s, c0, BN, st.rb, BM)) MaskRows(sc, klo, khi, int(st.rb), t);
#pragma unroll
    for (int ni = 0; ni < NR; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = ni * 8 + 2 * t + (e & 1);
        const float x = sc[0][ni][e];
        const float prob = Exp2(x * scale_log2 - slse[buf * BM + row]);
        float ds = prob * (dp[0][ni][e] - sdelta[buf * BM + row]);
        if (softcap) {
          const float th = x / p.softcap;
          ds = x == -INFINITY ? 0.0f : ds * (1.0f - th * th);
        }
        sc[0][ni][e] = prob;
        dp[0][ni][e] = ds;
      }
    GemmRegB<T, 1, DT, NR, D>(dv, sc, sdob, 0, lane);  // dV += P^T dO
    if constexpr (kAtomicDq) {
      T* ds_rows = sds;
#pragma unroll
      for (int ni = 0; ni < NR; ++ni)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          *reinterpret_cast<uint32_t*>(ds_rows + TileOffset<BM>(key0 + half * 8 + g, ni * 8 + 2 * t)) =
              Elem<T>::Pack(dp[0][ni][2 * half], dp[0][ni][2 * half + 1]);
    }
    GemmRegB<T, 1, DT, NR, D>(dk, dp, sqb, 0, lane);  // dK += dS^T Q
    if constexpr (kAtomicDq) {
      __syncthreads();  // dS^T complete
      constexpr int QT = D / 16;  // each warp: 16 rows x D / 2 columns of dQ
      const int m0 = (warp & 3) * 16, d0 = (warp >> 2) * (D / 2);
      float dq[1][QT][4];
      Zero(dq);
      GemmAtB<T, 1, QT, BN, BM, D>(dq, sds, m0, sk, d0, lane);  // dQ = dS K
      const int h = hk * group + st.head;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = st.rb + m0 + half * 8 + g;
        if (row < tq) {
          float* dst = p.dq_accum + row * q_stride + int64_t(h) * D + d0 + 2 * t;
#pragma unroll
          for (int di = 0; di < QT; ++di)
            atomicAdd(reinterpret_cast<float2*>(dst + di * 8),
                      make_float2(dq[0][di][2 * half] * p.scale, dq[0][di][2 * half + 1] * p.scale));
        }
      }
    }
    st = next;
    buf ^= 1;
  }

  CpAsyncWait<0>();
  __syncthreads();  // the row buffers are free: stage dK in sq, dV in sdo ([BN][D] each)
  FragmentsToSmem<T, 1, DT, D>(dk, sq, key0, p.scale, lane);
  FragmentsToSmem<T, 1, DT, D>(dv, sdo, key0, 1.0f, lane);
  __syncthreads();
  const int64_t kv_offset = c0 * kv_stride + int64_t(hk) * D;
  StoreTile<BN, D, kThreads>(static_cast<T*>(p.dk) + kv_offset, sq, kv_stride, int(tk - c0), tid);
  StoreTile<BN, D, kThreads>(static_cast<T*>(p.dv) + kv_offset, sdo, kv_stride, int(tk - c0), tid);
}

}  // namespace magi_jax::cuda
