// Which slices touch a block of rows (q axis) or keys (k axis), built on the device from the (possibly
// traced) ranges, and the iterator the attention kernels walk them with.
//
// Build: two small kernels, a warp per block voting over the slices 32 at a time (staged through shared
// memory): the count, then the fill, each CTA summing the counts before its blocks for their offsets (no
// scan kernel); ids come out in ascending slice order, so every consumer sees a fixed order and results are
// reproducible. No host synchronisation: the total is only known on the device, so the ids buffer has a
// fixed capacity and, if it overflows, the kernels scan the slice array instead.
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

  // The walk of block x whose ids lie at [begin, begin + count) when listed: for the list kernels, whose
  // offsets are not complete yet, and the forward's K/V warp, which takes the tile warp's. Not a delegate of
  // the constructor above: the attention kernels' code moves with any change to it (cuda/NOTES.md, "Slice
  // lists in fewer kernels").
  MAGI_DEV SliceWalk(const BlockLists& lists, int x, int64_t begin_, int count, bool listed) {
    ids = lists.ids;
    axis = lists.axis;
    x0 = x * lists.block;
    x1 = x0 + lists.block;
    csr = listed;
    begin = listed ? int(begin_) : 0;
    end = listed ? int(begin_) + count : 0;
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

// What the list kernels write: the lists (offsets [num_blocks + 1], ids [capacity]) and, between the count
// and the fill, each block's count.
struct ListBuffers {
  int64_t* offsets;
  int32_t* ids;
  int32_t* counts;  // [num_blocks]
  int64_t capacity;
  int axis, block;
  __host__ __device__ BlockLists View() const { return {offsets, ids, capacity, axis, block}; }
};

// The list kernels' blocks per CTA, a warp each.
constexpr int kListWarps = 16;

// The slices touching the warp's block [x0, x0 + block), in ascending id order: visit(pos, id) for each (pos
// counting from 0); returns how many. The CTA stages kListWarps * 32 slices' ranges at a time, each warp
// votes over them 32 at a time. CTA-collective (every thread of kListWarps warps; `active` false for the
// warps without a block).
template <typename Visit>
MAGI_DEV int VisitTouchingSlices(const SliceArgs& a, int axis, int x0, int block, bool active, Visit&& visit) {
  constexpr int kStage = kListWarps * 32;
  __shared__ int2 ranges[kStage];
  const int lane = threadIdx.x & 31;
  const int x1 = x0 + block;
  int count = 0;
  for (int base = 0; base < a.num_slices; base += kStage) {
    const int i = base + int(threadIdx.x);
    int b = 0, e = 0;  // past the last slice: empty, touching no block
    if (i < a.num_slices) AxisRange(a, axis, i, &b, &e);
    ranges[threadIdx.x] = make_int2(b, e);
    __syncthreads();
    const int n = min(kStage, a.num_slices - base);
    if (active) {
      for (int j = 0; j < n; j += 32) {
        const int2 r = ranges[j + lane];
        const bool touches = r.x < r.y && r.x < x1 && r.y > x0;
        const unsigned vote = __ballot_sync(0xffffffffu, touches);
        if (touches) visit(count + __popc(vote & ((1u << lane) - 1u)), base + j + lane);
        count += __popc(vote);
      }
    }
    __syncthreads();
  }
  return count;
}

// Where the fill put a block's list.
struct ListPlace {
  int x;  // the warp's block; num_blocks or more: none
  int64_t begin;
  int count;
  bool listed;  // all blocks' ids fit the capacity
};

// The fill: offsets and ids of the CTA's blocks, from the counts (the count kernel's). Each CTA sums the
// counts of all blocks (the total: whether the ids fit) and of those before its own (their first offset).
// CTA-collective (kListWarps warps).
MAGI_DEV ListPlace FillListsOfCta(const SliceArgs& a, const ListBuffers& lists, int num_blocks) {
  __shared__ unsigned long long sums[2][kListWarps];
  __shared__ int counts[kListWarps];
  const int lane = threadIdx.x & 31, warp = int(threadIdx.x >> 5);
  const int first = blockIdx.x * kListWarps;
  unsigned long long total = 0, before = 0;
  for (int i = int(threadIdx.x); i < num_blocks; i += kListWarps * 32) {
    const unsigned long long c = unsigned(lists.counts[i]);
    total += c;
    if (i < first) before += c;
  }
  for (int o = 16; o > 0; o >>= 1) {
    total += __shfl_xor_sync(0xffffffffu, total, o);
    before += __shfl_xor_sync(0xffffffffu, before, o);
  }
  if (lane == 0) {
    sums[0][warp] = total;
    sums[1][warp] = before;
    counts[warp] = first + warp < num_blocks ? lists.counts[first + warp] : 0;
  }
  __syncthreads();
  total = before = 0;
  for (int w = 0; w < kListWarps; ++w) {
    total += sums[0][w];
    before += sums[1][w];
  }
  ListPlace place{first + warp, int64_t(before), 0, total <= static_cast<unsigned long long>(lists.capacity)};
  for (int w = 0; w < warp; ++w) place.begin += counts[w];
  const bool active = place.x < num_blocks;
  int32_t* ids = lists.ids + place.begin;
  const bool write = active && place.listed;
  place.count = VisitTouchingSlices(a, lists.axis, place.x * lists.block, lists.block, active,
                                    [&](int pos, int id) { if (write) ids[pos] = id; });
  if (active && lane == 0) {
    lists.offsets[place.x + 1] = place.begin + place.count;
    if (place.x == 0) lists.offsets[0] = 0;
  }
  return place;
}

// The count kernel, launched plainly (it follows anything): lists.counts. Returns the launch status.
cudaError_t LaunchListCount(const SliceArgs& args, const ListBuffers& lists, cudaStream_t stream);

// Fills lists.offsets and lists.ids for the lists' axis: the count kernel, then the fill chained to it.
// Returns the launch status.
cudaError_t BuildBlockLists(const SliceArgs& args, const ListBuffers& lists, cudaStream_t stream);

}  // namespace magi_jax::cuda
