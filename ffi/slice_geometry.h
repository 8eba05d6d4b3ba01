// Which keys a query row of one slice attends, and which rows attend a key (DESIGN.md section 1).
// Shared by the CPU kernels and the CUDA kernels, hence the host/device qualifier.
#pragma once

#include <cstdint>

#include "ffa_interface.h"

#if defined(__CUDACC__)
#define MAGI_HD __host__ __device__ __forceinline__
#else
#define MAGI_HD inline
#endif

namespace magi_jax {

struct Slice {
  int64_t qs, qe, ks, ke;
  int32_t type;
};

MAGI_HD int64_t Clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Reads slice i, clamping ranges into [0, tq] x [0, tk]; a reversed range becomes empty.
MAGI_HD Slice LoadSlice(const int32_t* q_ranges, const int32_t* k_ranges, const int32_t* types, int64_t i,
                        int64_t tq, int64_t tk) {
  Slice s;
  s.qs = Clamp(q_ranges[2 * i], 0, tq);
  s.qe = Clamp(q_ranges[2 * i + 1], s.qs, tq);
  s.ks = Clamp(k_ranges[2 * i], 0, tk);
  s.ke = Clamp(k_ranges[2 * i + 1], s.ks, tk);
  s.type = types[i];
  return s;
}

MAGI_HD bool HasLowerDiagonal(int32_t type) { return type == kInvCausal || type == kBiCausal; }
MAGI_HD bool HasUpperDiagonal(int32_t type) { return type == kCausal || type == kBiCausal; }

// Keys [*lo, *hi) attended by row q (qs <= q < qe); both bounds are non-decreasing in q.
MAGI_HD void RowKeys(const Slice& s, int64_t q, int64_t* lo, int64_t* hi) {
  *lo = HasLowerDiagonal(s.type) ? s.ks + (q - s.qs) : s.ks;
  *hi = HasUpperDiagonal(s.type) ? s.ke - (s.qe - q - 1) : s.ke;
  if (*lo < s.ks) *lo = s.ks;
  if (*hi > s.ke) *hi = s.ke;
}

// Rows [*lo, *hi) attending key k (ks <= k < ke); both bounds are non-decreasing in k.
MAGI_HD void KeyRows(const Slice& s, int64_t k, int64_t* lo, int64_t* hi) {
  *lo = HasUpperDiagonal(s.type) ? k - (s.ke - s.qe) : s.qs;
  *hi = HasLowerDiagonal(s.type) ? k - s.ks + s.qs + 1 : s.qe;
  if (*lo < s.qs) *lo = s.qs;
  if (*hi > s.qe) *hi = s.qe;
}

}  // namespace magi_jax
