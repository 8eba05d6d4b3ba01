// tile_order.h's host side: the L2 section budget, and the blocks of a longest-first order sorted on the device.
#include "tile_order.h"

#include <cstdlib>

#include "launch.h"

namespace magi_jax::cuda {
namespace {

constexpr int kOrderThreads = 1024;
constexpr int kBuckets = 4096;

// A counting sort over kBuckets buckets, the largest work in the first: count, an exclusive scan of the
// counts (each thread sums kPer consecutive buckets, then a Hillis-Steele scan of the sums), placement.
// Beside the count, the total, the largest and the live blocks (OrderOutputs).
__global__ void __launch_bounds__(kOrderThreads) LongestFirstKernel(const int32_t* work, int n, bool last_first,
                                                                   OrderOutputs out) {
  __shared__ int count[kBuckets];
  __shared__ int partial[kOrderThreads];
  __shared__ unsigned long long total;
  __shared__ int longest, live;
  constexpr int kPer = kBuckets / kOrderThreads;
  const int tid = threadIdx.x;
  WaitPriorGrid();
  LaunchDependents();
  if (tid == 0) {
    total = 0;
    longest = 0;
    live = 0;
  }
  auto bucket = [](int w) { return kBuckets - 1 - min(w, kBuckets - 1); };
  if (last_first) {
    for (int x = tid; x < n; x += kOrderThreads) out.order[x] = n - 1 - x;
  } else {
    for (int b = tid; b < kBuckets; b += kOrderThreads) count[b] = 0;
    __syncthreads();
    for (int x = tid; x < n; x += kOrderThreads) {
      const int w = work[x];
      atomicAdd(&count[bucket(w)], 1);
      atomicAdd(&total, static_cast<unsigned long long>(w));
      atomicMax(&longest, w);
      if (w > 1) atomicAdd(&live, 1);
    }
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
    for (int x = tid; x < n; x += kOrderThreads) out.order[atomicAdd(&count[bucket(work[x])], 1)] = x;
  }
  __syncthreads();
  if (tid == 0) {
    if (out.stats != nullptr) {
      out.stats[0] = total;
      out.stats[1] = static_cast<unsigned long long>(longest);
    }
    if (out.live != nullptr) *out.live = live;
    if (out.counter != nullptr) *out.counter = 0;
  }
}

}  // namespace

int64_t L2SectionBudget(int device) {
  if (const char* env = std::getenv("MAGI_JAX_SM90_L2_BYTES")) return std::atoll(env);
  int l2 = 0;
  if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess) l2 = 0;
  return l2 / 2;
}

cudaError_t LaunchLongestFirst(const int32_t* work, int n, bool last_first, const OrderOutputs& out,
                               cudaStream_t stream) {
  return LaunchKernel(LongestFirstKernel, 1, kOrderThreads, 0, stream, Follows::kOurKernel, work, n, last_first,
                      out);
}

}  // namespace magi_jax::cuda
