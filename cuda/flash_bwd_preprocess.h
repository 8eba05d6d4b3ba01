// Small memory-bound kernels around the backward: delta = rowsum(dout * out) - dlse before, and the fp32
// dq accumulator -> T after (atomic path).
#pragma once

#include <cstdint>

#include "params.h"
#include "ptx.h"

namespace magi_jax::cuda {

constexpr int kElementwiseThreads = 256;

// Both kernels stride a grid of a few CTAs per SM over their rows, kDeltaUnroll groups per iteration with
// all the group's loads issued first (a CTA per 16 rows with one load each ran at half the bandwidth).
constexpr int kDeltaUnroll = 4;

// Lanes per (row, head): the largest power of two dividing D / 8 (a shuffle group inside a warp), each lane
// D / 8 / lanes 16-byte loads: D / 8 lanes with one at 64, 128, 256; 4 lanes with three at 96, 8 at 192.
template <int D>
constexpr int kDeltaLanes = (D / 8) & -(D / 8);

// One group of kDeltaLanes<D> lanes per (row, head), 16-byte loads, a shuffle reduction inside the group; a
// grid of a few CTAs per SM strides over the rows.
template <typename T, int D>
__global__ void __launch_bounds__(kElementwiseThreads) BwdDeltaKernel(const T* out, const T* dout,
                                                                      const float* dlse, float* delta,
                                                                      int64_t rows) {
  constexpr int kLanes = kDeltaLanes<D>, kLoads = D / 8 / kLanes, kRowsPerPass = kElementwiseThreads / kLanes;
  constexpr int kRowsPerIter = kRowsPerPass * kDeltaUnroll;
  static_assert(kLoads * kLanes * 8 == D, "whole 16-byte loads");
  const int sub = threadIdx.x % kLanes;
  for (int64_t base = int64_t(blockIdx.x) * kRowsPerIter; base < rows; base += int64_t(gridDim.x) * kRowsPerIter) {
    uint4 a[kDeltaUnroll][kLoads], b[kDeltaUnroll][kLoads];
#pragma unroll
    for (int u = 0; u < kDeltaUnroll; ++u) {
      const int64_t row = base + u * kRowsPerPass + threadIdx.x / kLanes;
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        a[u][l] = b[u][l] = make_uint4(0, 0, 0, 0);
        if (row < rows) {
          a[u][l] = *reinterpret_cast<const uint4*>(out + row * D + (l * kLanes + sub) * 8);
          b[u][l] = *reinterpret_cast<const uint4*>(dout + row * D + (l * kLanes + sub) * 8);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kDeltaUnroll; ++u) {
      const int64_t row = base + u * kRowsPerPass + threadIdx.x / kLanes;
      float sum = 0.0f;
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        const T* x = reinterpret_cast<const T*>(&a[u][l]);
        const T* y = reinterpret_cast<const T*>(&b[u][l]);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += Elem<T>::ToFloat(x[i]) * Elem<T>::ToFloat(y[i]);
      }
#pragma unroll
      for (int off = kLanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (sub != 0 || row >= rows) continue;
      delta[row] = sum - dlse[row];
    }
  }
}

// dq = T(dq_accum), 8 elements per thread (n is a multiple of 8).
template <typename T>
__global__ void __launch_bounds__(kElementwiseThreads) DqConvertKernel(const float* acc, T* dq, int64_t n) {
  constexpr int64_t kPerPass = int64_t(kElementwiseThreads) * 8, kPerIter = kPerPass * kDeltaUnroll;
  WaitPriorGrid();  // a chained launch (launch.h LaunchKernel): the dK/dV kernel's dQ
  for (int64_t base = int64_t(blockIdx.x) * kPerIter; base < n; base += int64_t(gridDim.x) * kPerIter) {
    float4 a[kDeltaUnroll][2];
#pragma unroll
    for (int u = 0; u < kDeltaUnroll; ++u) {
      const int64_t i = base + u * kPerPass + threadIdx.x * 8;
      if (i < n) {
        a[u][0] = *reinterpret_cast<const float4*>(acc + i);
        a[u][1] = *reinterpret_cast<const float4*>(acc + i + 4);
      }
    }
#pragma unroll
    for (int u = 0; u < kDeltaUnroll; ++u) {
      const int64_t i = base + u * kPerPass + threadIdx.x * 8;
      if (i >= n) continue;
      uint4 packed;
      packed.x = Elem<T>::Pack(a[u][0].x, a[u][0].y);
      packed.y = Elem<T>::Pack(a[u][0].z, a[u][0].w);
      packed.z = Elem<T>::Pack(a[u][1].x, a[u][1].y);
      packed.w = Elem<T>::Pack(a[u][1].z, a[u][1].w);
      *reinterpret_cast<uint4*>(dq + i) = packed;
    }
  }
}

}  // namespace magi_jax::cuda
