// Device construction of the per-block slice lists (see block_lists.h).
#include "block_lists.h"
#include "launch.h"

namespace magi_jax::cuda {
namespace {

constexpr int kStage = 256;  // slices staged in shared memory per round; also the threads per CTA

// One thread per block: counts (kFill = false) or writes (kFill = true) the ids of the slices touching it,
// in ascending id order. counts land in offsets[x + 1].
template <bool kFill>
__global__ void __launch_bounds__(kStage) ListKernel(SliceArgs args, int axis, int block, int num_blocks,
                                                     int64_t* offsets, int32_t* ids, int64_t capacity) {
  __shared__ int2 ranges[kStage];
  WaitPriorGrid();  // chained (the fill): the scan's offsets
  LaunchDependents();
  const int x = blockIdx.x * kStage + threadIdx.x;
  const int x0 = x * block, x1 = x0 + block;
  int64_t pos = 0;
  bool write = false;
  if (kFill && x < num_blocks) {
    write = offsets[num_blocks] <= capacity;
    pos = offsets[x];
  }
  if (kFill && !__syncthreads_or(write)) return;
  int64_t count = 0;
  for (int base = 0; base < args.num_slices; base += kStage) {
    const int i = base + threadIdx.x;
    int b = 0, e = 0;
    if (i < args.num_slices) AxisRange(args, axis, i, &b, &e);
    ranges[threadIdx.x] = make_int2(b, e);
    __syncthreads();
    const int n = min(kStage, args.num_slices - base);
    if (x < num_blocks) {
      for (int j = 0; j < n; ++j) {
        const int2 r = ranges[j];
        if (r.x < r.y && r.x < x1 && r.y > x0) {
          if (kFill) {
            if (write) ids[pos++] = base + j;
          } else {
            ++count;
          }
        }
      }
    }
    __syncthreads();
  }
  if (!kFill && x < num_blocks) {
    offsets[x + 1] = count;
    if (x == 0) offsets[0] = 0;
  }
}

// In-place inclusive scan of offsets[1..n] by one CTA (n is the number of blocks: thousands at most).
constexpr int kScanThreads = 1024;
__global__ void __launch_bounds__(kScanThreads) ScanKernel(int64_t* offsets, int n) {
  __shared__ int64_t partial[kScanThreads];
  WaitPriorGrid();
  LaunchDependents();
  const int per = (n + kScanThreads - 1) / kScanThreads;
  const int b = 1 + threadIdx.x * per, e = min(n + 1, b + per);
  int64_t sum = 0;
  for (int i = b; i < e; ++i) sum += offsets[i];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = 1; stride < kScanThreads; stride *= 2) {  // Hillis-Steele over the partial sums
    const int64_t add = threadIdx.x >= stride ? partial[threadIdx.x - stride] : 0;
    __syncthreads();
    partial[threadIdx.x] += add;
    __syncthreads();
  }
  int64_t run = threadIdx.x > 0 ? partial[threadIdx.x - 1] : 0;
  for (int i = b; i < e; ++i) {
    run += offsets[i];
    offsets[i] = run;
  }
}

}  // namespace

cudaError_t BuildBlockLists(const SliceArgs& args, int axis, int block, int64_t* offsets, int32_t* ids,
                            int64_t capacity, cudaStream_t stream) {
  const int num_blocks = NumBlocks(axis == kAxisQ ? args.tq : args.tk, block);
  if (num_blocks == 0) return cudaMemsetAsync(offsets, 0, sizeof(int64_t), stream);
  const int grid = (num_blocks + kStage - 1) / kStage;
  // The first launch follows whatever came before the call; the scan and the fill are chained to it.
  if (cudaError_t err = LaunchKernel(ListKernel<false>, grid, kStage, 0, stream, Follows::kAnything, args, axis, block,
                                     num_blocks, offsets, ids, capacity);
      err != cudaSuccess)
    return err;
  if (cudaError_t err = LaunchKernel(ScanKernel, 1, kScanThreads, 0, stream, Follows::kOurKernel, offsets, num_blocks);
      err != cudaSuccess)
    return err;
  return LaunchKernel(ListKernel<true>, grid, kStage, 0, stream, Follows::kOurKernel, args, axis, block, num_blocks,
                      offsets, ids, capacity);
}

}  // namespace magi_jax::cuda
