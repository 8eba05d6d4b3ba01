// Building blocks of the CPU kernels: element conversion, a small float matmul, block lists and a
// parallel loop on XLA's thread pool. Kept apart from the attention algorithm in ffa_cpu.cc.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "slice_geometry.h"

namespace magi_jax::cpu {

// 16-bit floats travel as raw bits; conversions are exact or round to nearest even.
struct Bf16 { uint16_t bits; };
struct Half { uint16_t bits; };

inline float ToFloat(float x) { return x; }
inline float ToFloat(Bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float ToFloat(Half x) {
  uint32_t sign = uint32_t(x.bits & 0x8000) << 16, exp = (x.bits >> 10) & 0x1f, man = x.bits & 0x3ff, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise the mantissa
    int e = -1;
    do { ++e; man <<= 1; } while ((man & 0x400) == 0);
    u = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> T FromFloat(float f);
template <> inline float FromFloat<float>(float f) { return f; }
template <> inline Bf16 FromFloat<Bf16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return Bf16{uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fff + ((u >> 16) & 1);
  return Bf16{uint16_t(u >> 16)};
}
template <> inline Half FromFloat<Half>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
  if (a > 0x7f800000) return Half{uint16_t(sign | 0x7e00)};
  if (a >= 0x477ff000) return Half{uint16_t(sign | 0x7c00)};  // rounds to infinity
  if (a < 0x38800000) {                                      // subnormal or zero in fp16
    float mag;
    std::memcpy(&mag, &a, 4);
    // Adding 0.5 aligns the fp16 subnormal step (2^-24) with float's unit in the last place,
    // so the hardware rounding to nearest even does the work.
    float shifted = mag + 0.5f;
    uint32_t s;
    std::memcpy(&s, &shifted, 4);
    return Half{uint16_t(sign | (s - 0x3f000000))};
  }
  uint32_t odd = (a >> 13) & 1;
  a += 0xc8000fff + odd;  // rebias exponent (-112 << 23) and round to nearest even
  return Half{uint16_t(sign | (a >> 13))};
}

// 16 floats as one GCC / Clang vector (one AVX-512 register, two AVX2 ones, four SSE ones).
typedef float Floats16 __attribute__((vector_size(64)));

// C[M][N] (+)= A[M][K] * B[K][N], all row-major and contiguous. Each C element sums its K products in order
// (no reassociation: results identical from run to run). Blocks of 4 rows x 16 columns of C stay in vector
// registers over the K loop (one row of B loaded, four broadcasts of A, four vector multiply-adds); the edges
// go one row at a time. The block is written with GCC / Clang vector types: left to the auto-vectoriser, the
// same loops were vectorised across rows with shuffles, 3x slower than the plain row loop.
inline void MatMul(const float* a, const float* b, float* c, int m, int k, int n, bool accumulate) {
  constexpr int kRows = 4, kCols = 16;
  if (!accumulate) std::fill(c, c + int64_t(m) * n, 0.0f);
  int i = 0;
  for (; i + kRows <= m; i += kRows) {
    const float* ai = a + int64_t(i) * k;
    int j = 0;
    for (; j + kCols <= n; j += kCols) {
      Floats16 acc[kRows];
      for (int r = 0; r < kRows; ++r) std::memcpy(&acc[r], c + int64_t(i + r) * n + j, sizeof(Floats16));
      for (int p = 0; p < k; ++p) {
        Floats16 bp;
        std::memcpy(&bp, b + int64_t(p) * n + j, sizeof(Floats16));
        for (int r = 0; r < kRows; ++r) acc[r] += ai[int64_t(r) * k + p] * bp;
      }
      for (int r = 0; r < kRows; ++r) std::memcpy(c + int64_t(i + r) * n + j, &acc[r], sizeof(Floats16));
    }
    for (int r = 0; r < kRows && j < n; ++r) {   // the columns past the last whole block
      float* ci = c + int64_t(i + r) * n;
      for (int p = 0; p < k; ++p) {
        const float ap = ai[int64_t(r) * k + p];
        const float* bp = b + int64_t(p) * n;
        for (int x = j; x < n; ++x) ci[x] += ap * bp[x];
      }
    }
  }
  for (; i < m; ++i) {   // the rows past the last whole block
    float* ci = c + int64_t(i) * n;
    const float* ai = a + int64_t(i) * k;
    for (int p = 0; p < k; ++p) {
      const float ap = ai[p];
      const float* bp = b + int64_t(p) * n;
      for (int x = 0; x < n; ++x) ci[x] += ap * bp[x];
    }
  }
}

// The largest of row[0, n) (-inf for none), 16 lanes at a time: a scalar max chain waits on each compare.
inline float RowMax(const float* row, int64_t n) {
  constexpr float kNegInf = -__builtin_inff();
  Floats16 lanes = Floats16{} + kNegInf;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    Floats16 x;
    std::memcpy(&x, row + j, sizeof(x));
    lanes = lanes > x ? lanes : x;
  }
  float mx = kNegInf;
  for (int x = 0; x < 16; ++x) mx = std::max(mx, lanes[x]);
  for (; j < n; ++j) mx = std::max(mx, row[j]);
  return mx;
}

// For each block of `block` positions along one axis, the ascending ids of the slices whose range on
// that axis touches the block (compressed rows).
struct BlockLists {
  std::vector<int64_t> offsets;  // [num_blocks + 1]
  std::vector<int32_t> ids;
  int64_t size(int64_t b) const { return offsets[b + 1] - offsets[b]; }
};

// `range_of(slice)` gives the [begin, end) a slice covers on the axis; empty ranges are skipped.
template <typename RangeOf>
BlockLists MakeBlockLists(const std::vector<Slice>& slices, int64_t length, int64_t block, RangeOf range_of) {
  int64_t nb = (length + block - 1) / block;
  BlockLists lists;
  lists.offsets.assign(nb + 1, 0);
  for (const Slice& s : slices) {
    auto [b, e] = range_of(s);
    if (b >= e) continue;
    for (int64_t x = b / block; x <= (e - 1) / block; ++x) ++lists.offsets[x + 1];
  }
  for (int64_t x = 0; x < nb; ++x) lists.offsets[x + 1] += lists.offsets[x];
  lists.ids.resize(lists.offsets[nb]);
  std::vector<int64_t> cursor(lists.offsets.begin(), lists.offsets.end() - 1);
  for (size_t i = 0; i < slices.size(); ++i) {
    auto [b, e] = range_of(slices[i]);
    if (b >= e) continue;
    for (int64_t x = b / block; x <= (e - 1) / block; ++x) lists.ids[cursor[x]++] = int32_t(i);
  }
  return lists;
}

// How many workers ParallelFor runs n tasks on: the caller and the pool's threads, at most one per task.
template <typename Pool>
int NumWorkers(Pool& pool, int64_t n) {
  return int(std::max<int64_t>(1, std::min<int64_t>(n, pool.num_threads())));
}

// Runs fn(task, worker) for task in [0, n) on the calling thread (worker 0) and NumWorkers - 1 tasks
// scheduled on `pool` (XLA's intra-op thread pool: no threads made per call, none beyond XLA's count). Each
// task writes disjoint outputs, so the result does not depend on the schedule. Returns once every task has
// run; a pool thread that starts later finds none left (the shared counters outlive the call), so a busy
// pool only leaves the caller more to do.
template <typename Pool>
void ParallelFor(Pool& pool, int64_t n, const std::function<void(int64_t, int)>& fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable all_done;
  };
  auto state = std::make_shared<State>();
  auto run = [state, n, &fn](int worker) {
    for (int64_t t; (t = state->next.fetch_add(1)) < n;) {
      fn(t, worker);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->all_done.notify_all();
      }
    }
  };
  const int workers = NumWorkers(pool, n);
  for (int w = 1; w < workers; ++w) pool.Schedule([run, w] { run(w); });
  run(0);
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_done.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace magi_jax::cpu
