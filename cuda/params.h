// Kernel parameters: raw pointers and sizes, passed by value to every kernel.
#pragma once

#include <cstdint>

namespace magi_jax::cuda {

// The mask, as the custom call receives it (device arrays; ranges are clamped when read).
struct SliceArgs {
  const int32_t* q_ranges;  // [N, 2]
  const int32_t* k_ranges;  // [N, 2]
  const int32_t* types;     // [N]
  int num_slices;
  int tq, tk;
};

// For each block of `block` positions along one axis, the ascending ids of the slices touching it
// (compressed rows). When offsets[num_blocks] > capacity the ids did not fit and consumers scan the
// slice array instead (same order, same result, slower).
enum Axis : int { kAxisQ = 0, kAxisK = 1 };
struct BlockLists {
  const int64_t* offsets;  // [num_blocks + 1]
  const int32_t* ids;      // [capacity]
  int64_t capacity;
  int axis, block;
};

struct FwdParams {
  const void *q, *k, *v;
  void* out;
  float* lse;
  SliceArgs slices;
  BlockLists lists;  // q blocks of kQBlock rows
  int hq, hkv;
  int kv_row_heads;  // heads from one key's row of k (or v) to the next: hkv, or 2 hkv when K and V are packed
  int v_head_pitch;  // elements from one head of v to the next: Dv, or D when packed (V: a head's first Dv)
  float scale, softcap;
  int sm_margin;  // SMs the persistent sm90 grid leaves to kernels beside it (a collective in flight)
  // An earlier call's out [Tq, Hq, D] (q's dtype) and lse [Tq, Hq] to merge with (epilogue.h
  // MergeWithPrevious), aliased to out and lse; null: none.
  const void* out_prev;
  const float* lse_prev;
  // [Tq, Hq]: each row's largest logit over this call's keys (-inf: none), not merged with an earlier call's;
  // null: not tracked (the sm90 kernel's instantiation without it).
  float* max_logit;
};

// A second key source for the sm90 backward (cuda/flash_bwd_sm90_kernel.h): keys [row, Tk) of the
// problem are rows [0, Tk - row) of k2, v2, their gradients dk2, dv2 ([Tk - row, Hkv, D]); row < 0: none.
// row_heads: heads from one row of them to the next (0: Hkv; 2 Hkv when K and V are packed side by side).
// Their heads are D wide; where v has its own head dim Dv (MLA's 128 beside 192; packed only), V and dV are
// each head's first Dv columns (dv2's others are left as they are: 2D memsets of them cost 3% of an MLA
// backward).
struct KeySplit {
  const void *k2 = nullptr, *v2 = nullptr;
  void *dk2 = nullptr, *dv2 = nullptr;
  int64_t row = -1;
  int row_heads = 0;
};

struct BwdParams {
  const void *q, *k, *v, *out, *dout;
  const float *lse, *dlse;
  void *dq, *dk, *dv;
  float* delta;     // [Tq, Hq]: rowsum(dout * out) - dlse
  float* dq_accum;  // [Tq, Hq, D] fp32, scaled, for the atomic path; null on the deterministic one
  SliceArgs slices;
  BlockLists q_lists;  // q blocks (deterministic dq kernel)
  BlockLists k_lists;  // k blocks (dk/dv kernel)
  int hq, hkv;
  float scale, softcap;
  // fp32, zeroed: the sm90 dK/dV kernel's GQA split adds dK (scaled), dV into them (BwdSm90GqaSplit,
  // launch.h); null otherwise. Rows of the call's sole key source, accum_row_heads heads apart (0: Hkv; 2 Hkv
  // for a second source with K and V packed, dV's heads after dK's in each row, as dk2 holds them).
  float *dk_accum, *dv_accum;
  int accum_row_heads;
};

}  // namespace magi_jax::cuda
