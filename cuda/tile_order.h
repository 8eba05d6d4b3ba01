// Longest-first tile orders, shared by the sm90 forward (scheduler_sm90.h: persistent CTAs taking tiles from
// a counter) and the sm90 backward (launch_bwd_sm90.cu: one CTA per tile, the grid in this order). A tile is
// (block, head); a block's work is counted on the device, the blocks sorted by decreasing work
// (LaunchLongestFirst), and the tiles taken in L2 sections of heads, the last section wider (TailFirstHead,
// SectionTile). Nothing synchronises with the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ptx.h"

namespace magi_jax::cuda {

// The last section's work, in units of the longest tile's per CTA (the model, cuda/tools/sched_sim.py:
// <= 0.5% over the LPT bound on the bench cases with 1.5, against up to 10% with plain sections).
constexpr float kTailWaves = 1.5f;

// The first head of the wider last section: the longest tiles of a section start when the section starts, so
// a last section with little work per CTA would leave them trailing the grid; it takes the last heads until
// it holds kTailWaves times the longest tile per CTA. heads: the tiles' heads, moved in whole groups of
// `group`; per: heads per regular section (a multiple of group); total: the work of one head's blocks;
// longest: the largest block's (0 total: no merge); ctas: the CTAs running at once. A multiple of per.
MAGI_DEV int TailFirstHead(int heads, int group, int per, unsigned long long total, unsigned long long longest,
                           int ctas) {
  int tail = per;
  if (total > 0) {
    const double need = ceil(double(kTailWaves) * ctas * double(longest) / double(total));
    tail = max(tail, need >= heads ? heads : (int(need) + group - 1) / group * group);
  }
  return tail >= heads ? 0 : (heads - tail) / per * per;
}

// Tile t -> (block, head): sections of `per` heads before head tail_first, then one section of the rest;
// within a section, tile i is block order[i / width], head first + i % width (a block's heads side by side).
MAGI_DEV void SectionTile(const int32_t* order, int num_blocks, int heads, int per, int tail_first, int t,
                          int* block, int* h) {
  const int regular = tail_first * num_blocks;  // tiles in the regular sections
  int first, width, i;
  if (t < regular) {
    const int per_section = num_blocks * per, section = t / per_section;
    first = section * per;
    width = per;
    i = t - section * per_section;
  } else {
    first = tail_first;
    width = heads - tail_first;
    i = t - regular;
  }
  *block = order[i / width];
  *h = first + i % width;
}

// The bytes one L2 section's heads may keep in L2: half of the device's L2 (MAGI_JAX_SM90_L2_BYTES overrides
// it, for tests and measurements).
int64_t L2SectionBudget(int device);

// What the order kernel writes: the order; beside it (each where not null) stats[0] the work of all blocks and
// stats[1] the largest (TailFirstHead's total and longest; zeros with last_first), *live the blocks with any
// step (work > 1), and *counter = 0 (the forward's persistent CTAs take their tiles from it). Computed in the
// sort's one CTA rather than by atomics in the work kernels, so that nothing needs zeroing before them.
struct OrderOutputs {
  int32_t* order;
  unsigned long long* stats;
  int32_t* live;
  int32_t* counter;
};

// The n blocks by decreasing work[] (a counting sort in one CTA, work clamped to 4095; ties in any order, which
// changes when a tile runs, never its result); with last_first, blocks n - 1 down to 0 instead (work not
// read). Chained (launch.h LaunchKernel): it follows the work kernel, or the lists' when there is none.
cudaError_t LaunchLongestFirst(const int32_t* work, int n, bool last_first, const OrderOutputs& out,
                               cudaStream_t stream);

}  // namespace magi_jax::cuda
