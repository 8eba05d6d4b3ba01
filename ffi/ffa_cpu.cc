// Flexible flash attention on the CPU: blockwise online softmax over the slices that touch each block.
//
// Forward: one task per (q block, q head) walks every slice touching its rows and, for each, only the key
// blocks those rows attend; one online softmax spans all of them, so overlapping slices merge exactly.
// Backward: dq by the same walk; dk/dv by the mirror walk, one task per (k block, kv head) over the rows
// attending its keys. Every output element has one owner task: no atomics, deterministic by construction.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "ffa_cpu.h"

namespace magi_jax::cpu {
namespace {

constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Params {
  FfaDims dims;
  float scale, softcap;
  std::vector<Slice> slices;
  int64_t kv_row_heads = 0;  // heads from one key's row of K (or V) to the next: hkv, 2 hkv when packed
  int64_t v_head_pitch = 0;  // elements from one head of V to the next: dv, or d when packed
};

Params MakeParams(const FfaDims& dims, float scale, float softcap, const ffi::Buffer<ffi::S32>& q_ranges,
                  const ffi::Buffer<ffi::S32>& k_ranges, const ffi::Buffer<ffi::S32>& types) {
  Params p{dims, scale, softcap, {}, dims.hkv, dims.dv};
  p.slices.reserve(dims.num_slices);
  for (int64_t i = 0; i < dims.num_slices; ++i)
    p.slices.push_back(LoadSlice(q_ranges.typed_data(), k_ranges.typed_data(), types.typed_data(), i, dims.tq,
                                 dims.tk));
  return p;
}

// Rows [b, e) of head h of a [T, H, D] tensor, converted to float [e - b][D]; pitch: elements from one head to
// the next where a head holds more than the d read (0: d).
template <typename T>
void LoadRows(const T* x, int64_t heads, int64_t d, int64_t h, int64_t b, int64_t e, float* dst, int64_t pitch = 0) {
  pitch = pitch > 0 ? pitch : d;
  for (int64_t r = b; r < e; ++r) {
    const T* src = x + (r * heads + h) * pitch;
    for (int64_t j = 0; j < d; ++j) dst[(r - b) * d + j] = ToFloat(src[j]);
  }
}

// The same rows transposed to [D][e - b].
template <typename T>
void LoadRowsTransposed(const T* x, int64_t heads, int64_t d, int64_t h, int64_t b, int64_t e, float* dst) {
  int64_t n = e - b;
  for (int64_t r = b; r < e; ++r) {
    const T* src = x + (r * heads + h) * d;
    for (int64_t j = 0; j < d; ++j) dst[j * n + (r - b)] = ToFloat(src[j]);
  }
}

// Turns raw scores q.k into logits in place (scale, then softcap) and masks cells outside each row's
// keys with -inf. Rows are [r0, r0 + m), columns [c0, c0 + n) of slice s.
void MakeLogits(const Params& p, const Slice& s, int64_t r0, int64_t m, int64_t c0, int64_t n, float* scores) {
  for (int64_t i = 0; i < m; ++i) {
    int64_t lo, hi;
    RowKeys(s, r0 + i, &lo, &hi);
    float* row = scores + i * n;
    // The row's keys are one run [b, e) of its columns: masked before and after, scaled (vectorised) within.
    const int64_t b = std::clamp(lo - c0, int64_t(0), n), e = std::max(b, std::clamp(hi - c0, int64_t(0), n));
    std::fill(row, row + b, kNegInf);
    if (p.softcap > 0.0f) {
      for (int64_t j = b; j < e; ++j) row[j] = p.softcap * std::tanh(row[j] * p.scale / p.softcap);
    } else {
      for (int64_t j = b; j < e; ++j) row[j] *= p.scale;
    }
    std::fill(row + e, row + n, kNegInf);
  }
}

// Per-worker scratch, sized once per call. Tiles are float; sums across tiles are double, so that the
// CPU kernel is at least as accurate as naive attention in float32 (the tolerance rule's yardstick).
struct Scratch {
  std::vector<float> q, kt, k, v, vt, s, dp, tile, dout, m, delta, lse;
  std::vector<double> acc, l;
  explicit Scratch(int64_t d) {
    for (auto* buf : {&q, &dout, &tile, &kt, &k, &v, &vt}) buf->resize(std::max(kBlockQ, kBlockK) * d);
    acc.resize(std::max(kBlockQ, kBlockK) * d);
    s.resize(kBlockQ * kBlockK);
    dp.resize(kBlockQ * kBlockK);
    for (auto* buf : {&m, &delta, &lse}) buf->resize(std::max(kBlockQ, kBlockK));
    l.resize(std::max(kBlockQ, kBlockK));
  }
};

// acc[i] += tile[i] for n elements (float tile into a double accumulator).
inline void AddTile(const float* tile, double* acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += tile[i];
}

// Slice s restricted to rows [rb, re): the span of keys they attend, [*kb, *ke).
// Bounds are monotone in the row, so the first row gives the lowest key and the last row the highest.
void KeySpan(const Slice& s, int64_t rb, int64_t re, int64_t* kb, int64_t* ke) {
  int64_t unused;
  RowKeys(s, rb, kb, &unused);
  RowKeys(s, re - 1, &unused, ke);
}

// Keys [cb, ce) of slice s: the span of rows attending them, [*rb, *re).
void RowSpan(const Slice& s, int64_t cb, int64_t ce, int64_t* rb, int64_t* re) {
  int64_t unused;
  KeyRows(s, cb, rb, &unused);
  KeyRows(s, ce - 1, &unused, re);
}

BlockLists QBlockLists(const Params& p) {
  return MakeBlockLists(p.slices, p.dims.tq, kBlockQ, [](const Slice& s) {
    return std::pair<int64_t, int64_t>(s.qs, s.ke > s.ks ? s.qe : s.qs);
  });
}

BlockLists KBlockLists(const Params& p) {
  return MakeBlockLists(p.slices, p.dims.tk, kBlockK, [](const Slice& s) {
    return std::pair<int64_t, int64_t>(s.ks, s.qe > s.qs ? s.ke : s.ks);
  });
}

// out_prev, lse_prev (null: none): an earlier call's results over the same rows, merged into this one's.
// max_logit (null: not wanted): each row's largest logit over this call's keys, the softmax's running max.
template <typename T>
void Forward(ffi::ThreadPool& pool, const Params& p, const T* q, const T* k, const T* v, T* out, float* lse,
             float* max_logit, const T* out_prev, const float* lse_prev) {
  const auto& [tq, tk, hq, hkv, d, n, dv] = p.dims;
  const int64_t group = hq / hkv;
  BlockLists lists = QBlockLists(p);
  const int64_t nqb = (tq + kBlockQ - 1) / kBlockQ;
  std::vector<Scratch> scratch(NumWorkers(pool, nqb * hq), Scratch(std::max(d, dv)));

  ParallelFor(pool, nqb * hq, [&](int64_t task, int worker) {
    Scratch& w = scratch[worker];
    const int64_t qb = task / hq, h = task % hq, r0 = qb * kBlockQ, r1 = std::min(tq, r0 + kBlockQ);
    const int64_t m = r1 - r0;
    LoadRows(q, hq, d, h, r0, r1, w.q.data());
    std::fill(w.acc.begin(), w.acc.begin() + m * dv, 0.0);
    std::fill(w.m.begin(), w.m.begin() + m, kNegInf);
    std::fill(w.l.begin(), w.l.begin() + m, 0.0);
    for (int64_t x = lists.offsets[qb]; x < lists.offsets[qb + 1]; ++x) {
      const Slice& s = p.slices[lists.ids[x]];
      const int64_t rb = std::max(r0, s.qs), re = std::min(r1, s.qe);
      int64_t kb, ke;
      KeySpan(s, rb, re, &kb, &ke);
      for (int64_t c0 = kb; c0 < ke; c0 += kBlockK) {
        const int64_t nc = std::min(ke, c0 + kBlockK) - c0, mr = re - rb;
        LoadRowsTransposed(k, p.kv_row_heads, d, h / group, c0, c0 + nc, w.kt.data());
        LoadRows(v, p.kv_row_heads, dv, h / group, c0, c0 + nc, w.v.data(), p.v_head_pitch);
        MatMul(w.q.data() + (rb - r0) * d, w.kt.data(), w.s.data(), int(mr), int(d), int(nc), false);
        MakeLogits(p, s, rb, mr, c0, nc, w.s.data());
        for (int64_t i = 0; i < mr; ++i) {  // online softmax update of row rb + i
          float* row = w.s.data() + i * nc;
          const float mx = RowMax(row, nc);
          const int64_t ri = rb - r0 + i;
          const float m_new = std::max(w.m[ri], mx);
          if (m_new == kNegInf) {
            std::fill(row, row + nc, 0.0f);
            continue;
          }
          const double alpha = std::exp(double(w.m[ri]) - m_new);
          double sum = 0.0;
          for (int64_t j = 0; j < nc; ++j) sum += (row[j] = std::exp(row[j] - m_new));
          w.l[ri] = w.l[ri] * alpha + sum;
          w.m[ri] = m_new;
          for (int64_t j = 0; j < dv; ++j) w.acc[ri * dv + j] *= alpha;
        }
        MatMul(w.s.data(), w.v.data(), w.tile.data(), int(mr), int(nc), int(dv), false);
        AddTile(w.tile.data(), w.acc.data() + (rb - r0) * dv, mr * dv);
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      const bool empty = w.l[i] == 0.0;
      const int64_t at = (r0 + i) * hq + h;
      double wc = empty ? 0.0 : 1.0 / w.l[i], wp = 0.0;  // weights of this call's sums and of out_prev
      double row_lse = empty ? kNegInf : w.m[i] + std::log(w.l[i]);
      if (out_prev != nullptr) {
        const double lp = lse_prev[at], top = std::max(row_lse, lp);
        if (top != kNegInf) {
          const double a = std::exp(row_lse - top), b = std::exp(lp - top);
          wc *= a / (a + b);
          wp = b / (a + b);
          row_lse = top + std::log(a + b);
        }
      }
      T* o = out + at * dv;
      const T* prev = out_prev == nullptr ? nullptr : out_prev + at * dv;
      for (int64_t j = 0; j < dv; ++j)
        o[j] = FromFloat<T>(float(w.acc[i * dv + j] * wc + (prev ? wp * ToFloat(prev[j]) : 0.0)));
      lse[at] = float(row_lse);
      if (max_logit != nullptr) max_logit[at] = w.m[i];
    }
  });
}

// Probabilities and score gradients of one (rows x keys) tile: on entry s holds raw scores and dp holds
// dout.v; on exit s holds P and dp holds dS = dlogit/dscore * P * (dP - delta), ready for dq/dk.
void TileGradients(const Params& p, const Slice& s, int64_t rb, int64_t mr, int64_t c0, int64_t nc,
                   const float* lse, const float* delta, float* sc, float* dp) {
  MakeLogits(p, s, rb, mr, c0, nc, sc);
  for (int64_t i = 0; i < mr; ++i) {
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t x = i * nc + j;
      if (sc[x] == kNegInf) {
        sc[x] = dp[x] = 0.0f;
        continue;
      }
      const float logit = sc[x];
      const float prob = std::exp(logit - lse[i]);
      float ds = prob * (dp[x] - delta[i]) * p.scale;
      if (p.softcap > 0.0f) {
        const float t = logit / p.softcap;
        ds *= 1.0f - t * t;
      }
      sc[x] = prob;
      dp[x] = ds;
    }
  }
}

// dq in TDq: T, or float32 when chained (dq_in, if not null, added before the store). delta_in, if not
// null, is delta as given (out, dout's product and dlse are then not read for it).
template <typename T, typename TDq>
void Backward(ffi::ThreadPool& pool, const Params& p, const T* q, const T* k, const T* v, const T* out,
              const T* dout, const float* lse, const float* dlse, const float* dq_in, const float* delta_in, TDq* dq,
              T* dk, T* dv) {
  const auto& [tq, tk, hq, hkv, d, n, dv_dim] = p.dims;  // v, dv, out, dout: rows of dv_dim
  const int64_t group = hq / hkv;
  // delta = rowsum(dout * out) - dlse: the softmax-gradient correction of every (row, head); lse's own
  // cotangent enters here because d lse / d logit = P.
  std::vector<float> delta(tq * hq);
  if (delta_in != nullptr) {
    std::copy(delta_in, delta_in + tq * hq, delta.begin());
  } else {
    ParallelFor(pool, hq, [&](int64_t h, int) {
      for (int64_t r = 0; r < tq; ++r) {
        double acc = 0.0;
        for (int64_t j = 0; j < dv_dim; ++j)
          acc += double(ToFloat(dout[(r * hq + h) * dv_dim + j])) * ToFloat(out[(r * hq + h) * dv_dim + j]);
        delta[r * hq + h] = float(acc - dlse[r * hq + h]);
      }
    });
  }
  auto row_stats = [&](Scratch& w, int64_t h, int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      w.lse[r - b] = lse[r * hq + h];
      w.delta[r - b] = delta[r * hq + h];
    }
  };

  // dq: one task per (q block, q head).
  BlockLists qlists = QBlockLists(p);
  const int64_t nqb = (tq + kBlockQ - 1) / kBlockQ;
  std::vector<Scratch> scratch(NumWorkers(pool, nqb * hq), Scratch(std::max(d, dv_dim)));
  ParallelFor(pool, nqb * hq, [&](int64_t task, int worker) {
    Scratch& w = scratch[worker];
    const int64_t qb = task / hq, h = task % hq, r0 = qb * kBlockQ, r1 = std::min(tq, r0 + kBlockQ);
    std::fill(w.acc.begin(), w.acc.begin() + (r1 - r0) * d, 0.0);
    for (int64_t x = qlists.offsets[qb]; x < qlists.offsets[qb + 1]; ++x) {
      const Slice& s = p.slices[qlists.ids[x]];
      const int64_t rb = std::max(r0, s.qs), re = std::min(r1, s.qe), mr = re - rb;
      int64_t kb, ke;
      KeySpan(s, rb, re, &kb, &ke);
      if (kb >= ke) continue;
      LoadRows(q, hq, d, h, rb, re, w.q.data());
      LoadRows(dout, hq, dv_dim, h, rb, re, w.dout.data());
      row_stats(w, h, rb, re);
      for (int64_t c0 = kb; c0 < ke; c0 += kBlockK) {
        const int64_t nc = std::min(ke, c0 + kBlockK) - c0;
        LoadRowsTransposed(k, hkv, d, h / group, c0, c0 + nc, w.kt.data());
        LoadRows(k, hkv, d, h / group, c0, c0 + nc, w.k.data());
        LoadRowsTransposed(v, hkv, dv_dim, h / group, c0, c0 + nc, w.vt.data());
        MatMul(w.q.data(), w.kt.data(), w.s.data(), int(mr), int(d), int(nc), false);
        MatMul(w.dout.data(), w.vt.data(), w.dp.data(), int(mr), int(dv_dim), int(nc), false);
        TileGradients(p, s, rb, mr, c0, nc, w.lse.data(), w.delta.data(), w.s.data(), w.dp.data());
        MatMul(w.dp.data(), w.k.data(), w.tile.data(), int(mr), int(nc), int(d), false);
        AddTile(w.tile.data(), w.acc.data() + (rb - r0) * d, mr * d);
      }
    }
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < d; ++j) {
        const int64_t at = (r * hq + h) * d + j;
        dq[at] = FromFloat<TDq>(float(w.acc[(r - r0) * d + j]) + (dq_in ? dq_in[at] : 0.0f));
      }
  });

  // dk, dv: one task per (k block, kv head), over every q head of its group, so each task owns its rows
  // of dk and dv. Tiles are rows x keys as in the forward; P and dS are transposed to accumulate.
  BlockLists klists = KBlockLists(p);
  const int64_t nkb = (tk + kBlockK - 1) / kBlockK;
  std::vector<Scratch> kscratch(NumWorkers(pool, nkb * hkv), Scratch(std::max(d, dv_dim)));
  ParallelFor(pool, nkb * hkv, [&](int64_t task, int worker) {
    Scratch& w = kscratch[worker];
    const int64_t kblk = task / hkv, hk = task % hkv, c0 = kblk * kBlockK, c1 = std::min(tk, c0 + kBlockK);
    const int64_t nc = c1 - c0;
    std::vector<double> dk_acc(nc * d, 0.0), dv_acc(nc * dv_dim, 0.0);
    std::vector<float> pt(kBlockQ * kBlockK), dst(kBlockQ * kBlockK);
    for (int64_t x = klists.offsets[kblk]; x < klists.offsets[kblk + 1]; ++x) {
      const Slice& s = p.slices[klists.ids[x]];
      const int64_t cb = std::max(c0, s.ks), ce = std::min(c1, s.ke), mc = ce - cb;
      int64_t rb_all, re_all;
      RowSpan(s, cb, ce, &rb_all, &re_all);
      if (rb_all >= re_all) continue;
      LoadRowsTransposed(k, hkv, d, hk, cb, ce, w.kt.data());
      LoadRowsTransposed(v, hkv, dv_dim, hk, cb, ce, w.vt.data());
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t rb = rb_all; rb < re_all; rb += kBlockQ) {
          const int64_t re = std::min(re_all, rb + kBlockQ), mr = re - rb;
          LoadRows(q, hq, d, h, rb, re, w.q.data());
          LoadRows(dout, hq, dv_dim, h, rb, re, w.dout.data());
          row_stats(w, h, rb, re);
          MatMul(w.q.data(), w.kt.data(), w.s.data(), int(mr), int(d), int(mc), false);
          MatMul(w.dout.data(), w.vt.data(), w.dp.data(), int(mr), int(dv_dim), int(mc), false);
          TileGradients(p, s, rb, mr, cb, mc, w.lse.data(), w.delta.data(), w.s.data(), w.dp.data());
          for (int64_t i = 0; i < mr; ++i)
            for (int64_t j = 0; j < mc; ++j) {
              pt[j * mr + i] = w.s[i * mc + j];
              dst[j * mr + i] = w.dp[i * mc + j];
            }
          MatMul(pt.data(), w.dout.data(), w.tile.data(), int(mc), int(mr), int(dv_dim), false);
          AddTile(w.tile.data(), dv_acc.data() + (cb - c0) * dv_dim, mc * dv_dim);
          MatMul(dst.data(), w.q.data(), w.tile.data(), int(mc), int(mr), int(d), false);
          AddTile(w.tile.data(), dk_acc.data() + (cb - c0) * d, mc * d);
        }
      }
    }
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t j = 0; j < d; ++j) dk[(c * hkv + hk) * d + j] = FromFloat<T>(float(dk_acc[(c - c0) * d + j]));
      for (int64_t j = 0; j < dv_dim; ++j)
        dv[(c * hkv + hk) * dv_dim + j] = FromFloat<T>(float(dv_acc[(c - c0) * dv_dim + j]));
    }
  });
}

// Calls fn with the element type of the buffer as a template tag.
template <typename Fn>
ffi::Error DispatchDtype(ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ffi::F32: fn(float{}); return ffi::Error::Success();
    case ffi::BF16: fn(Bf16{}); return ffi::Error::Success();
    case ffi::F16: fn(Half{}); return ffi::Error::Success();
    default: return ffi::Error::InvalidArgument("q, k, v: dtype must be float32, bfloat16 or float16");
  }
}

template <typename T>
T* Data(const ffi::AnyBuffer& b) { return reinterpret_cast<T*>(b.untyped_data()); }
template <typename T>
T* Data(ffi::Result<ffi::AnyBuffer>& b) { return reinterpret_cast<T*>(b->untyped_data()); }

ffi::Error FfaFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::S32> q_ranges, ffi::Buffer<ffi::S32> k_ranges, ffi::Buffer<ffi::S32> types,
                      ffi::AnyBuffer out_prev, ffi::AnyBuffer lse_prev, float softmax_scale, float softcap,
                      int32_t /*sm_margin: a GPU launch setting*/, bool kv_packed,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                      ffi::Result<ffi::Buffer<ffi::F32>> max_logit) {
  auto dims = CheckFfaInputs(q, k, v, q_ranges, k_ranges, types, kv_packed);
  if (dims.has_error()) return dims.error();
  if (kv_packed) dims->dv = PackedVHeadDim(*out, dims->d);
  if (auto err = CheckForwardOut(*out, q, dims->dv); err.failure()) return err;
  auto merge = CheckMergeInputs(*out, out_prev, lse_prev);
  if (merge.has_error()) return merge.error();
  auto wants_max = CheckMaxLogitOut(*max_logit, q);
  if (wants_max.has_error()) return wants_max.error();
  Params p = MakeParams(*dims, softmax_scale, softcap, q_ranges, k_ranges, types);
  if (kv_packed) {
    p.kv_row_heads = 2 * dims->hkv;
    p.v_head_pitch = dims->d;
  }
  return DispatchDtype(q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* v_data = kv_packed ? Data<T>(k) + dims->hkv * dims->d : Data<T>(v);
    Forward<T>(pool, p, Data<T>(q), Data<T>(k), v_data, Data<T>(out), lse->typed_data(),
               *wants_max ? max_logit->typed_data() : nullptr, *merge ? Data<T>(out_prev) : nullptr,
               *merge ? Data<float>(lse_prev) : nullptr);
  });
}

ffi::Error FfaBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dlse,
                      ffi::Buffer<ffi::S32> q_ranges, ffi::Buffer<ffi::S32> k_ranges, ffi::Buffer<ffi::S32> types,
                      ffi::AnyBuffer k2, ffi::AnyBuffer v2, ffi::AnyBuffer dq_in, ffi::AnyBuffer delta_in,
                      float softmax_scale,
                      float softcap, bool deterministic /*always so on the CPU*/, bool dq_f32, bool kv2_packed,
                      ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                      ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dk2,
                      ffi::Result<ffi::AnyBuffer> dv2) {
  auto dims = CheckFfaInputs(q, k, v, q_ranges, k_ranges, types);
  if (dims.has_error()) return dims.error();
  if (auto err = CheckForwardOut(out, q, dims->dv); err.failure()) return err;
  if (auto err = CheckSameShape("dout", dout, out); err.failure()) return err;
  if (auto err = CheckSameShape("dv", *dv, v); err.failure()) return err;
  auto tk2 = CheckSecondKeys(k, k2, v2, *dk2, *dv2, kv2_packed);
  if (tk2.has_error()) return tk2.error();
  if (dims->dv != dims->d && *tk2 > 0 && !kv2_packed)
    return ffi::Error::InvalidArgument("k2: where v has its own head dim, a second key source only packed");
  auto has_dq_in = CheckDqChain(q, dq_in, *dq, dq_f32, deterministic);
  if (has_dq_in.has_error()) return has_dq_in.error();
  auto has_delta = CheckDeltaIn(q, delta_in);
  if (has_delta.has_error()) return has_delta.error();
  const int64_t tk1 = dims->tk;
  dims->tk += *tk2;
  Params p = MakeParams(*dims, softmax_scale, softcap, q_ranges, k_ranges, types);
  const float* dq_add = *has_dq_in ? Data<float>(dq_in) : nullptr;
  const float* delta = *has_delta ? Data<float>(delta_in) : nullptr;
  return DispatchDtype(q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    // dq in T or, chained, in float32.
    auto backward = [&](const T* kk, const T* vv, T* dkk, T* dvv) {
      if (dq_f32)
        Backward<T, float>(pool, p, Data<T>(q), kk, vv, Data<T>(out), Data<T>(dout), lse.typed_data(),
                           dlse.typed_data(), dq_add, delta, Data<float>(dq), dkk, dvv);
      else
        Backward<T, T>(pool, p, Data<T>(q), kk, vv, Data<T>(out), Data<T>(dout), lse.typed_data(),
                       dlse.typed_data(), dq_add, delta, Data<T>(dq), dkk, dvv);
    };
    if (*tk2 == 0) {
      backward(Data<T>(k), Data<T>(v), Data<T>(dk), Data<T>(dv));
      return;
    }
    // Two key sources: the reference path runs on their concatenation. Packed: row r of k2 (dk2) holds K
    // then V (dK then dV), hkv heads of d elements each; V (dV) is each V head's first dv (the rest of dk2's
    // V heads left as they are).
    const int64_t hkv = dims->hkv, d = dims->d, dv_dim = dims->dv, tk = dims->tk;
    const int64_t pitch = (kv2_packed ? 2 : 1) * hkv * d;  // between rows of k2 (dk2)
    T* dv2_data = kv2_packed ? Data<T>(dk2) + hkv * d : Data<T>(dv2);
    const T* v2_data = kv2_packed ? Data<T>(k2) + hkv * d : Data<T>(v2);
    std::vector<T> kc(tk * hkv * d), vc(tk * hkv * dv_dim), dkc(kc.size()), dvc(vc.size());
    std::copy_n(Data<T>(k), tk1 * hkv * d, kc.begin());
    std::copy_n(Data<T>(v), tk1 * hkv * dv_dim, vc.begin());
    for (int64_t r = 0; r < *tk2; ++r) {
      std::copy_n(Data<T>(k2) + r * pitch, hkv * d, kc.begin() + (tk1 + r) * hkv * d);
      for (int64_t h = 0; h < hkv; ++h)
        std::copy_n(v2_data + r * pitch + h * d, dv_dim, vc.begin() + ((tk1 + r) * hkv + h) * dv_dim);
    }
    backward(kc.data(), vc.data(), dkc.data(), dvc.data());
    std::copy_n(dkc.begin(), tk1 * hkv * d, Data<T>(dk));
    std::copy_n(dvc.begin(), tk1 * hkv * dv_dim, Data<T>(dv));
    for (int64_t r = 0; r < *tk2; ++r) {
      std::copy_n(dkc.begin() + (tk1 + r) * hkv * d, hkv * d, Data<T>(dk2) + r * pitch);
      for (int64_t h = 0; h < hkv; ++h)
        std::copy_n(dvc.begin() + ((tk1 + r) * hkv + h) * dv_dim, dv_dim, dv2_data + r * pitch + h * d);
    }
  });
}

}  // namespace
}  // namespace magi_jax::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiFfaFwdCpu, magi_jax::cpu::FfaFwdImpl,
                              magi_jax::BindFfaFwd(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiFfaBwdCpu, magi_jax::cpu::FfaBwdImpl,
                              magi_jax::BindFfaBwd(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
