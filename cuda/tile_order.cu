// tile_order.h's host side: the L2 section budget, and the blocks of a longest-first order sorted on the device.
#include "tile_order.h"

#include <cstdlib>

#include "launch.h"

namespace magi_jax::cuda {
namespace {

constexpr int kOrderThreads = 1024;
constexpr int kOrderWarps = kOrderThreads / 32;
constexpr int kBuckets = 4096;

// An exclusive scan of one int per thread across the sort's CTA of 32 warps: shuffles within each warp, then
// one warp scans the warps' sums (three barriers; a Hillis-Steele scan over the CTA took twenty).
static_assert(kOrderWarps == 32, "ExclusiveScan: one warp scans the warps' sums, a lane each");
__device__ int ExclusiveScan(int value, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int sum = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, sum, d);
      if (lane >= d) sum += up;
    }
    warp_sums[lane] = sum - warp_sums[lane];  // the warps before this one
  }
  __syncthreads();
  return warp_sums[warp] + inclusive - value;
}

// A counting sort over kBuckets buckets, the largest work in the first: count, an exclusive scan of the
// counts (each thread kPer consecutive buckets), placement. Beside the count, the total, the largest and the
// live blocks (OrderOutputs), summed in registers and reduced once at the end: a 64-bit shared-memory atomic
// is a compare-and-swap loop (ATOMS.CAST.SPIN.64), and 256 blocks spinning on one made the sort 14 us
// (5.7 us since, on an H200: BENCHMARKS.md 2026-12-04, "The longest-first sort").
__global__ void __launch_bounds__(kOrderThreads) LongestFirstKernel(const int32_t* work, int n, bool last_first,
                                                                   OrderOutputs out) {
  __shared__ int count[kBuckets];
  __shared__ int warp_sums[kOrderWarps];
  __shared__ unsigned long long warp_totals[kOrderWarps];
  __shared__ int warp_longest[kOrderWarps], warp_live[kOrderWarps];
  constexpr int kPer = kBuckets / kOrderThreads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  WaitPriorGrid();
  LaunchDependents();
  unsigned long long total = 0;
  int longest = 0, live = 0;
  auto bucket = [](int w) { return kBuckets - 1 - min(w, kBuckets - 1); };
  if (last_first) {
    for (int x = tid; x < n; x += kOrderThreads) out.order[x] = n - 1 - x;
  } else {
    for (int b = tid; b < kBuckets; b += kOrderThreads) count[b] = 0;
    __syncthreads();
    for (int x = tid; x < n; x += kOrderThreads) {
      const int w = work[x];
      atomicAdd(&count[bucket(w)], 1);
      total += static_cast<unsigned long long>(w);
      longest = max(longest, w);
      live += w > 1;
    }
    __syncthreads();
    int local = 0;
    for (int i = 0; i < kPer; ++i) local += count[tid * kPer + i];
    int run = ExclusiveScan(local, warp_sums);
    for (int i = 0; i < kPer; ++i) {
      const int c = count[tid * kPer + i];
      count[tid * kPer + i] = run;
      run += c;
    }
    __syncthreads();
    // Placement: the lanes of a warp with one bucket take their places by one atomic (equal work is the rule:
    // a window's q blocks all fall in one bucket, whose lanes a plain atomic would serialise).
    for (int base = tid - lane; base < n; base += kOrderThreads) {
      const int x = base + lane;
      const int b = x < n ? bucket(work[x]) : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, b);
      const int leader = __ffs(peers) - 1;
      int first = 0;
      if (lane == leader && b >= 0) first = atomicAdd(&count[b], __popc(peers));
      first = __shfl_sync(0xffffffffu, first, leader);
      if (b >= 0) out.order[first + __popc(peers & ((1u << lane) - 1))] = x;
    }
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) {
    total += __shfl_xor_sync(0xffffffffu, total, d);
    longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, d));
    live += __shfl_xor_sync(0xffffffffu, live, d);
  }
  if (lane == 0) {
    warp_totals[warp] = total;
    warp_longest[warp] = longest;
    warp_live[warp] = live;
  }
  __syncthreads();
  if (tid == 0) {
    for (int i = 1; i < kOrderWarps; ++i) {
      total += warp_totals[i];
      longest = max(longest, warp_longest[i]);
      live += warp_live[i];
    }
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
