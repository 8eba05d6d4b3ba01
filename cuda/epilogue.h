// Epilogues: fp32 fragments -> T, staged through shared memory for 16-byte coalesced global stores.
#pragma once

#include "ptx.h"
#include "smem.h"

namespace magi_jax::cuda {

// Writes the fragments [MT][DT][4] of a warp's rows (row0 + 16 mi + 8 half + g) into a swizzled [.][D] tile.
template <typename T, int MT, int DT, int D>
MAGI_DEV void FragmentsToSmem(const float (&acc)[MT][DT][4], T* smem, int row0, float mul, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int di = 0; di < DT; ++di)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + mi * 16 + half * 8 + g, col = di * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(smem + TileOffset<D>(row, col)) =
            Elem<T>::Pack(acc[mi][di][2 * half] * mul, acc[mi][di][2 * half + 1] * mul);
      }
}

// A forward that continues an earlier call over the same rows (FwdParams::out_prev, lse_prev; a distributed
// forward's stage call after its host call) merges the two per row before storing: out = (out_prev
// e^lse_prev + o e^lse) / (e^lse_prev + e^lse), lse = log of the denominator, in float32 on the normalised
// fragments [MT][DT][4] (rows row0 + 16 mi + 8 half + g, columns 8 di + 2 t, + 1; rows from tq on are
// skipped). Rows with no key in either call stay 0 / -inf. All of a row's loads are issued before its adds.
template <typename T, int MT, int DT>
MAGI_DEV void MergeWithPrevious(float (&o)[MT][DT][4], float (&lse)[MT * 2], const T* prev, const float* lse_prev,
                                int64_t row0, int64_t tq, int hq, int h, int lane) {
  constexpr int D = DT * 8;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < MT * 2; ++r) {
    const int mi = r >> 1, half = r & 1;
    const int64_t row = row0 + mi * 16 + half * 8 + g;
    if (row >= tq) continue;
    const T* src = prev + (row * hq + h) * D + 2 * t;
    uint32_t raw[DT];
#pragma unroll
    for (int di = 0; di < DT; ++di) raw[di] = *reinterpret_cast<const uint32_t*>(src + di * 8);
    const float lp = lse_prev[row * hq + h], m = fmaxf(lse[r], lp);
    float wc = 0.0f, wp = 0.0f, merged = -INFINITY;
    if (m != -INFINITY) {
      wc = __expf(lse[r] - m);
      wp = __expf(lp - m);
      const float sum = wc + wp;
      merged = m + __logf(sum);
      wc /= sum;
      wp /= sum;
    }
#pragma unroll
    for (int di = 0; di < DT; ++di) {
      const T* p = reinterpret_cast<const T*>(&raw[di]);
      o[mi][di][2 * half] = o[mi][di][2 * half] * wc + Elem<T>::ToFloat(p[0]) * wp;
      o[mi][di][2 * half + 1] = o[mi][di][2 * half + 1] * wc + Elem<T>::ToFloat(p[1]) * wp;
    }
    lse[r] = merged;
  }
}

// The forward epilogue: out rows [0, valid_rows) of the CTA (row stride out_stride) and their lse (stride
// lse_stride). Call after a barrier that frees `stage` ([BM][D]).
template <typename T, int MT, int DT, int BM, int D, int kThreads>
MAGI_DEV void StoreRowsAndLse(const float (&acc)[MT][DT][4], const float (&lse)[MT * 2], T* stage, T* out,
                              int64_t out_stride, float* lse_out, int64_t lse_stride, int valid_rows, int row0,
                              int tid) {
  const int lane = tid & 31;
  FragmentsToSmem<T, MT, DT, D>(acc, stage, row0, 1.0f, lane);
  if ((lane & 3) == 0) {
#pragma unroll
    for (int r = 0; r < MT * 2; ++r) {
      const int row = row0 + (r >> 1) * 16 + (r & 1) * 8 + (lane >> 2);
      if (row < valid_rows) lse_out[row * lse_stride] = lse[r];
    }
  }
  __syncthreads();
  StoreTile<BM, D, kThreads>(out, stage, out_stride, valid_rows, tid);
}

}  // namespace magi_jax::cuda
