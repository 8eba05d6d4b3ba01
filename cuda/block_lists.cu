// Device construction of the per-block slice lists (see block_lists.h).
#include "block_lists.h"
#include "launch.h"

namespace magi_jax::cuda {
namespace {

__global__ void __launch_bounds__(kListWarps * 32) CountKernel(SliceArgs args, ListBuffers lists, int num_blocks) {
  LaunchDependents();
  const int x = blockIdx.x * kListWarps + int(threadIdx.x >> 5);
  const int count = VisitTouchingSlices(args, lists.axis, x * lists.block, lists.block, x < num_blocks,
                                        [](int, int) {});
  if (x < num_blocks && (threadIdx.x & 31) == 0) lists.counts[x] = count;
}

__global__ void __launch_bounds__(kListWarps * 32) FillKernel(SliceArgs args, ListBuffers lists, int num_blocks) {
  WaitPriorGrid();  // the counts
  LaunchDependents();
  FillListsOfCta(args, lists, num_blocks);
}

int AxisBlocks(const SliceArgs& args, const ListBuffers& lists) {
  return NumBlocks(lists.axis == kAxisQ ? args.tq : args.tk, lists.block);
}

}  // namespace

cudaError_t LaunchListCount(const SliceArgs& args, const ListBuffers& lists, cudaStream_t stream) {
  const int num_blocks = AxisBlocks(args, lists);
  if (num_blocks == 0) return cudaMemsetAsync(lists.offsets, 0, sizeof(int64_t), stream);
  return LaunchKernel(CountKernel, NumBlocks(num_blocks, kListWarps), kListWarps * 32, 0, stream, Follows::kAnything,
                      args, lists, num_blocks);
}

cudaError_t BuildBlockLists(const SliceArgs& args, const ListBuffers& lists, cudaStream_t stream) {
  if (cudaError_t err = LaunchListCount(args, lists, stream); err != cudaSuccess) return err;
  const int num_blocks = AxisBlocks(args, lists);
  if (num_blocks == 0) return cudaSuccess;
  return LaunchKernel(FillKernel, NumBlocks(num_blocks, kListWarps), kListWarps * 32, 0, stream, Follows::kOurKernel,
                      args, lists, num_blocks);
}

}  // namespace magi_jax::cuda
