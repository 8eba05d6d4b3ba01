// Logits and the online softmax on fragments. A row's 8 NT columns of a tile are spread over the four
// threads of a quad (lanes 4g..4g+3), so row reductions finish with two xor-shuffles.
#pragma once

#include <cmath>

#include "ptx.h"

namespace magi_jax::cuda {

// Softcap: raw scores -> softcap * tanh(scale * s / softcap), after which the logit scale is 1.
template <int MT, int NT>
MAGI_DEV void ApplySoftcap(float (&s)[MT][NT][4], float scale, float softcap) {
  const float inner = scale / softcap;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][ni][e] = softcap * tanhf(s[mi][ni][e] * inner);
}

MAGI_DEV float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
MAGI_DEV float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Running max m (of the values in s, before scaling) and per-thread partial sums l of 2^(s * scale_log2 -
// m * scale_log2) for MT * 2 rows; the output accumulator is rescaled as the max grows. Masked cells are
// -inf and contribute 0; a row with no key yet keeps m = -inf, l = 0.
template <int MT>
struct OnlineSoftmax {
  float m[MT * 2], l[MT * 2];

  MAGI_DEV OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < MT * 2; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.0f;
    }
  }

  // Turns s into probabilities (unnormalised) and rescales acc.
  template <int NT, int DT>
  MAGI_DEV void Update(float (&s)[MT][NT][4], float (&acc)[MT][DT][4], float scale_log2) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mi * 2 + half;
        float mx = m[r];
#pragma unroll
        for (int ni = 0; ni < NT; ++ni) mx = fmaxf(mx, fmaxf(s[mi][ni][2 * half], s[mi][ni][2 * half + 1]));
        mx = QuadMax(mx);
        const float base = mx == -INFINITY ? 0.0f : mx * scale_log2;
        const float alpha = Exp2(m[r] * scale_log2 - base);
        m[r] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            const float p = Exp2(s[mi][ni][e] * scale_log2 - base);
            s[mi][ni][e] = p;
            sum += p;
          }
        l[r] = l[r] * alpha + sum;
#pragma unroll
        for (int di = 0; di < DT; ++di) {
          acc[mi][di][2 * half] *= alpha;
          acc[mi][di][2 * half + 1] *= alpha;
        }
      }
  }

  // Normalises acc and returns the natural-log lse of each row (-inf, with acc zeroed, for rows with no key).
  template <int DT>
  MAGI_DEV void Finish(float (&acc)[MT][DT][4], float scale_log2, float (&lse)[MT * 2]) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mi * 2 + half;
        const float total = QuadSum(l[r]);
        const bool empty = !(total > 0.0f);
        const float inv = empty ? 0.0f : 1.0f / total;
        lse[r] = empty ? -INFINITY : (m[r] * scale_log2 + __log2f(total)) * kLn2;
#pragma unroll
        for (int di = 0; di < DT; ++di) {
          acc[mi][di][2 * half] *= inv;
          acc[mi][di][2 * half + 1] *= inv;
        }
      }
  }
};

}  // namespace magi_jax::cuda
