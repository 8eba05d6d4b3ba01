// Which slices touch a block of rows (q axis) or keys (k axis), built on the device from the (possibly
// traced) ranges, and the iterator the attention kernels walk them with.
//
// Build: three small kernels (count per block, scan, fill), O(num_blocks x num_slices) cheap tests with
// the slices staged through shared memory; ids come out in ascending slice order, so every consumer sees a
// fixed order and results are reproducible. No host synchronisation: the total is only known on the device,
// so the ids buffer has a fixed capacity and, if it overflows, the kernels scan the slice array instead.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"
#include "ptx.h"
#include "slice_geometry.h"

namespace magi_jax::cuda {

// The half-open range slice i covers on the axis; empty when the slice has no cells.
MAGI_DEV void AxisRange(const SliceArgs& a, int axis, int i, int* b, int* e) {
  const Slice s = LoadSlice(a.q_ranges, a.k_ranges, a.types, i, a.tq, a.tk);
  const bool cells = s.qe > s.qs && s.ke > s.ks;
  *b = int(axis == kAxisQ ? s.qs : s.ks);
  *e = cells ? int(axis == kAxisQ ? s.qe : s.ke) : *b;
}

// The slices touching block x, in ascending id order. Cursors are positions in the ids array (CSR mode)
// or slice ids (scan mode); -1 ends the walk. Every call must be made by all 32 lanes of a warp with the
// same arguments (scan mode votes over 32 slices at a time). The slice arrays are passed to each call
// rather than kept, so that they stay in the kernel's parameter space.
struct SliceWalk {
  const int32_t* ids;
  int begin, end;  // CSR mode: the block's positions in ids
  int x0, x1;      // the block's extent on the axis
  int axis;
  bool csr;

  MAGI_DEV SliceWalk(const SliceArgs& a, const BlockLists& lists, int x) {
    ids = lists.ids;
    axis = lists.axis;
    x0 = x * lists.block;
    x1 = x0 + lists.block;
    const int length = lists.axis == kAxisQ ? a.tq : a.tk;
    const int64_t total = lists.offsets[(length + lists.block - 1) / lists.block];
    csr = total <= lists.capacity;
    begin = csr ? int(lists.offsets[x]) : 0;
    end = csr ? int(lists.offsets[x + 1]) : 0;
  }

  MAGI_DEV int First(const SliceArgs& a) const { return Next(a, -1); }

  MAGI_DEV int Next(const SliceArgs& a, int cursor) const {
    if (csr) {
      const int n = cursor < 0 ? begin : cursor + 1;
      return n < end ? n : -1;
    }
    const int lane = threadIdx.x & 31;
    for (int base = cursor + 1; base < a.num_slices; base += 32) {
      const int i = base + lane;
      bool touches = false;
      if (i < a.num_slices) {
        int b, e;
        AxisRange(a, axis, i, &b, &e);
        touches = b < e && b < x1 && e > x0;
      }
      const unsigned vote = __ballot_sync(0xffffffffu, touches);
      if (vote) return base + __ffs(vote) - 1;
    }
    return -1;
  }

  MAGI_DEV int SliceId(int cursor) const { return csr ? ids[cursor] : cursor; }
};

__host__ __device__ inline int NumBlocks(int length, int block) { return (length + block - 1) / block; }

// Ids capacity for a list of num_blocks blocks: exact worst case when small, else capped (the kernels
// then scan). 4M ids = 16 MB.
inline int64_t ListCapacity(int64_t num_slices, int64_t num_blocks) {
  const int64_t worst = num_slices * num_blocks;
  const int64_t cap = int64_t(1) << 22;
  return worst < cap ? (worst > 0 ? worst : 1) : cap;
}

// Fills offsets [num_blocks + 1] and ids [capacity] for the axis. Enqueued on stream; returns the launch
// status.
cudaError_t BuildBlockLists(const SliceArgs& args, int axis, int block, int64_t* offsets, int32_t* ids,
                            int64_t capacity, cudaStream_t stream);

}  // namespace magi_jax::cuda
