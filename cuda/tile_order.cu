// The longest-first order of the sm90 forward's q blocks (scheduler_sm90.h), and the scheduler switch: a
// counting sort of blocks by decreasing work in one CTA, work clamped to kBuckets - 1; ties in any order
// (that changes when a block runs, never its result). The backward's k blocks run in key order: longest
// first gained nothing there (BENCHMARKS.md 2026-11-30 04:53 UTC), its grid is not persistent.
#include <cstdlib>
#include <cstring>

#include "launch.h"

namespace magi_jax::cuda {
namespace {

constexpr int kOrderThreads = 1024;
constexpr int kBuckets = 4096;

__global__ void __launch_bounds__(kOrderThreads) OrderByWorkKernel(const int32_t* work, int num_blocks,
                                                                   bool last_first, int32_t* order) {
  __shared__ int count[kBuckets];
  __shared__ int partial[kOrderThreads];
  constexpr int kPer = kBuckets / kOrderThreads;
  const int tid = threadIdx.x;
  if (last_first) {
    for (int x = tid; x < num_blocks; x += kOrderThreads) order[x] = num_blocks - 1 - x;
    return;
  }
  for (int b = tid; b < kBuckets; b += kOrderThreads) count[b] = 0;
  __syncthreads();
  // Bucket kBuckets - 1 - min(work, kBuckets - 1): the largest work lands first.
  for (int x = tid; x < num_blocks; x += kOrderThreads)
    atomicAdd(&count[kBuckets - 1 - min(work[x], kBuckets - 1)], 1);
  __syncthreads();
  // Exclusive scan of count: each thread sums kPer consecutive buckets, a Hillis-Steele scan of the sums.
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
  for (int x = tid; x < num_blocks; x += kOrderThreads)
    order[atomicAdd(&count[kBuckets - 1 - min(work[x], kBuckets - 1)], 1)] = x;
}

}  // namespace

Sm90Sched Sm90SchedFromEnv() {
  const char* env = std::getenv("MAGI_JAX_SM90_SCHED");
  if (env == nullptr) return Sm90Sched::kLpt;
  if (std::strcmp(env, "natural") == 0) return Sm90Sched::kNatural;
  if (std::strcmp(env, "grid") == 0) return Sm90Sched::kGrid;
  return Sm90Sched::kLpt;
}

cudaError_t LaunchOrderByWork(const int32_t* work, int num_blocks, bool last_first, int32_t* order,
                              cudaStream_t stream) {
  OrderByWorkKernel<<<1, kOrderThreads, 0, stream>>>(work, num_blocks, last_first, order);
  return cudaGetLastError();
}

}  // namespace magi_jax::cuda
