// tile_order.h's host side: the L2 section budget, and the blocks of a longest-first order sorted on the device.
#include "tile_order.h"

#include <cstdlib>

namespace magi_jax::cuda {
namespace {

constexpr int kOrderThreads = 1024;
constexpr int kBuckets = 4096;

// A counting sort over kBuckets buckets, the largest work in the first: count, an exclusive scan of the
// counts (each thread sums kPer consecutive buckets, then a Hillis-Steele scan of the sums), placement.
__global__ void __launch_bounds__(kOrderThreads) LongestFirstKernel(const int32_t* work, int n, bool last_first,
                                                                   int32_t* order) {
  __shared__ int count[kBuckets];
  __shared__ int partial[kOrderThreads];
  constexpr int kPer = kBuckets / kOrderThreads;
  const int tid = threadIdx.x;
  if (last_first) {
    for (int x = tid; x < n; x += kOrderThreads) order[x] = n - 1 - x;
    return;
  }
  for (int b = tid; b < kBuckets; b += kOrderThreads) count[b] = 0;
  __syncthreads();
  for (int x = tid; x < n; x += kOrderThreads) atomicAdd(&count[kBuckets - 1 - min(work[x], kBuckets - 1)], 1);
  __syncthreads();
  int local = 0;
  for (int i = 0; i < kPer; ++i) local += count[tid * kPer + i];
  partial[tid] = local;
  __syncthreads();
  for (int stride = 1; stride < kOrderThreads; stride *= 2) {
    const int add = tid >= stride ? partial[tid - stride] : 0;
    __syncthreads();
    partial[tid] += add;
    __syncthreads();
  }
  int run = partial[tid] - local;
  for (int i = 0; i < kPer; ++i) {
    const int c = count[tid * kPer + i];
    count[tid * kPer + i] = run;
    run += c;
  }
  __syncthreads();
  for (int x = tid; x < n; x += kOrderThreads)
    order[atomicAdd(&count[kBuckets - 1 - min(work[x], kBuckets - 1)], 1)] = x;
}

}  // namespace

int64_t L2SectionBudget(int device) {
  if (const char* env = std::getenv("MAGI_JAX_SM90_L2_BYTES")) return std::atoll(env);
  int l2 = 0;
  if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess) l2 = 0;
  return l2 / 2;
}

cudaError_t LaunchLongestFirst(const int32_t* work, int n, bool last_first, int32_t* order, cudaStream_t stream) {
  LongestFirstKernel<<<1, kOrderThreads, 0, stream>>>(work, n, last_first, order);
  return cudaGetLastError();
}

}  // namespace magi_jax::cuda
