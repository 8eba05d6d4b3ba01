// The FFA custom-call interface shared by every platform (CPU in ffi/, CUDA in cuda/).
//
// Targets (registered per platform under the same names):
//   magi_jax_ffa_fwd: (q, k, v, q_ranges, k_ranges, attn_type_map, out_prev, lse_prev) -> (out, lse, max_logit)
//   magi_jax_ffa_bwd: (q, k, v, out, dout, lse, dlse, q_ranges, k_ranges, attn_type_map, k2, v2)
//                     -> (dq, dk, dv, dk2, dv2)
// The backward's k2, v2 [Tk2, Hkv, D] (Tk2 may be 0) are a second key source: the keys the ranges index are
// concat(k, k2), and dk2, dv2 are the gradients of k2, v2 (the fetched rows of a distributed backward, which
// then need no concatenation in memory).
// The backward's attribute kv2_packed: the second source packed the same way, k2 [Tk2, 2 Hkv, D] (v2 the same
// array) and its gradients dk2 [Tk2, 2 Hkv, D] (dK and dV side by side per row; dv2 an empty placeholder).
// The forward's attribute kv_packed: k is [Tk, 2 Hkv, D], K in heads [0, Hkv) and V in [Hkv, 2 Hkv) of each
// row (a group collective's receive buffer, [Tk, 2, Hkv, D], as is); v is the same array (only k is read).
// Shapes: q/out/dout/dq [Tq, Hq, D]; k/v/dk/dv [Tk, Hkv, D]; lse and dlse (the cotangent of lse, used when
// partial results are merged by lse) [Tq, Hq] float32; v may have its own head dim Dv: v / dv [Tk, Hkv, Dv],
// out / dout [Tq, Hq, Dv] (on CUDA D 192 with Dv 128, MLA's shapes). Packed with Dv < D (out's head dim in
// the forward, v's in the backward), V is each V head's first Dv columns and the rest padding: unread, and
// unspecified in dk2 (the caller drops it);
// ranges int32 [N, 2] (half-open); attn_type_map int32 [N] (0 FULL, 1 CAUSAL, 2 INV_CAUSAL, 3 BI_CAUSAL).
// q, k, v share one dtype (bf16, fp16, fp32); out and the gradients have the inputs' dtype.
// The forward's max_logit: each row's largest logit over this call's keys (-inf: none), [Tq, Hq] float32, or
// empty when not wanted (the kernels then do not track it). Not merged with an earlier call's (out_prev):
// the caller takes the maximum.
// Logits: scale * q.k, or softcap * tanh(scale * q.k / softcap) when softcap > 0. Rows covered by several
// slices take one softmax over all their keys, a cell counting once per covering slice. Empty rows: out 0,
// lse -inf, zero gradients. Ranges outside [0, T] are clamped; reversed ranges are empty.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace magi_jax {

namespace ffi = xla::ffi;

enum MaskType : int32_t { kFull = 0, kCausal = 1, kInvCausal = 2, kBiCausal = 3 };

// Appends the forward arguments, attributes and results to a binding that already holds the
// platform's context (a stream on CUDA, nothing on CPU).
template <typename Binding>
auto BindFfaFwd(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()                    // k
      .template Arg<ffi::AnyBuffer>()                    // v
      .template Arg<ffi::Buffer<ffi::S32>>()             // q_ranges [N, 2]
      .template Arg<ffi::Buffer<ffi::S32>>()             // k_ranges [N, 2]
      .template Arg<ffi::Buffer<ffi::S32>>()             // attn_type_map [N]
      .template Arg<ffi::AnyBuffer>()                    // out_prev: an earlier call's out to merge with, or empty
      .template Arg<ffi::AnyBuffer>()                    // lse_prev: its lse [Tq, Hq] float32, or empty
      .template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("sm_margin")              // SMs the persistent forward leaves free
      .template Attr<bool>("kv_packed")                  // k holds K and V side by side per row (above)
      .template Ret<ffi::AnyBuffer>()                    // out
      .template Ret<ffi::Buffer<ffi::F32>>()             // lse [Tq, Hq]
      .template Ret<ffi::Buffer<ffi::F32>>();            // max_logit [Tq, Hq], or empty (above)
}

template <typename Binding>
auto BindFfaBwd(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()                    // k
      .template Arg<ffi::AnyBuffer>()                    // v
      .template Arg<ffi::AnyBuffer>()                    // out
      .template Arg<ffi::AnyBuffer>()                    // dout
      .template Arg<ffi::Buffer<ffi::F32>>()             // lse
      .template Arg<ffi::Buffer<ffi::F32>>()             // dlse
      .template Arg<ffi::Buffer<ffi::S32>>()             // q_ranges
      .template Arg<ffi::Buffer<ffi::S32>>()             // k_ranges
      .template Arg<ffi::Buffer<ffi::S32>>()             // attn_type_map
      .template Arg<ffi::AnyBuffer>()                    // k2
      .template Arg<ffi::AnyBuffer>()                    // v2
      .template Arg<ffi::AnyBuffer>()                    // dq_in: float32 [Tq, Hq, D] dq adds to, or empty
      .template Arg<ffi::AnyBuffer>()                    // delta_in: float32 [Tq, Hq] rowsum(dout out) - dlse, or empty
      .template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<bool>("deterministic")
      .template Attr<bool>("dq_f32")                    // dq returned unrounded in float32 (dq_in + dq)
      .template Attr<bool>("kv2_packed")                // k2 and dk2 hold K and V side by side per row (above)
      .template Ret<ffi::AnyBuffer>()                    // dq
      .template Ret<ffi::AnyBuffer>()                    // dk
      .template Ret<ffi::AnyBuffer>()                    // dv
      .template Ret<ffi::AnyBuffer>()                    // dk2
      .template Ret<ffi::AnyBuffer>();                   // dv2
}

// Problem sizes, read from the buffers once the shapes are checked.
struct FfaDims {
  int64_t tq, tk, hq, hkv, d, num_slices;
  int64_t dv;  // v's head dim
};

inline ffi::Error CheckSameShape(const char* name, const ffi::AnyBuffer& a, const ffi::AnyBuffer& ref) {
  auto da = a.dimensions(), dr = ref.dimensions();
  bool same = da.size() == dr.size() && a.element_type() == ref.element_type();
  for (size_t i = 0; same && i < da.size(); ++i) same = da[i] == dr[i];
  if (!same) return ffi::Error::InvalidArgument(std::string(name) + ": shape or dtype differs from its pair");
  return ffi::Error::Success();
}

// Checks ranks and shape agreement of the forward inputs (the Python wrapper gives clearer errors first;
// this guards direct callers of the custom call). kv_packed: k (and v, the same buffer) is [Tk, 2 Hkv, D];
// otherwise v may be [Tk, Hkv, Dv] with its own head dim (the handlers say which pairs they run).
inline ffi::ErrorOr<FfaDims> CheckFfaInputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                            const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& q_ranges,
                                            const ffi::Buffer<ffi::S32>& k_ranges,
                                            const ffi::Buffer<ffi::S32>& types, bool kv_packed = false) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 3) return ffi::Error::InvalidArgument("q and k must be [T, H, D]");
  if (!kv_packed) {
    if (vd.size() != 3 || vd[0] != kd[0] || vd[1] != kd[1] || v.element_type() != k.element_type())
      return ffi::Error::InvalidArgument("v: must be [Tk, Hkv, Dv] with k's tokens, heads and dtype");
  } else if (auto err = CheckSameShape("v", v, k); err.failure()) {
    return err;
  }
  if (k.element_type() != q.element_type()) return ffi::Error::InvalidArgument("k: dtype differs from q");
  if (kv_packed && kd[1] % 2 != 0)
    return ffi::Error::InvalidArgument("k: kv_packed needs k (and v, the same) [Tk, 2 Hkv, D]");
  FfaDims dims{qd[0], kd[0], qd[1], kv_packed ? kd[1] / 2 : kd[1], qd[2], 0, kv_packed ? kd[2] : vd[2]};
  if (kd[2] != dims.d) return ffi::Error::InvalidArgument("k: head dim differs from q");
  if (dims.hkv == 0 || dims.hq % dims.hkv != 0)
    return ffi::Error::InvalidArgument("q heads must be a multiple of k heads");
  auto qr = q_ranges.dimensions(), kr = k_ranges.dimensions(), td = types.dimensions();
  if (qr.size() != 2 || qr[1] != 2 || kr.size() != 2 || kr[1] != 2 || kr[0] != qr[0] || td.size() != 1 ||
      td[0] != qr[0])
    return ffi::Error::InvalidArgument("q_ranges/k_ranges must be [N, 2] and attn_type_map [N]");
  dims.num_slices = qr[0];
  return dims;
}

// Packed K and V (kv_packed): v's head dim is out's, V each V head's first Dv columns (D when out's is not a
// head dim up to D, which CheckForwardOut then refuses).
inline int64_t PackedVHeadDim(const ffi::AnyBuffer& out, int64_t d) {
  auto od = out.dimensions();
  return od.size() == 3 && od[2] > 0 && od[2] <= d ? od[2] : d;
}

// out (the forward's result, the backward's input): [Tq, Hq, Dv] in q's dtype.
inline ffi::Error CheckForwardOut(const ffi::AnyBuffer& out, const ffi::AnyBuffer& q, int64_t dv) {
  auto od = out.dimensions(), qd = q.dimensions();
  if (od.size() != 3 || od[0] != qd[0] || od[1] != qd[1] || od[2] != dv || out.element_type() != q.element_type())
    return ffi::Error::InvalidArgument("out: must be [Tq, Hq, Dv] (v's head dim) in q's dtype");
  return ffi::Error::Success();
}

// The backward's second key source: k2 like k but for its row count, v2 and the gradients dk2, dv2 like k2;
// packed: k2 and dk2 [Tk2, 2 Hkv, D], v2 the same array as k2, dv2 empty. Returns Tk2.
inline ffi::ErrorOr<int64_t> CheckSecondKeys(const ffi::AnyBuffer& k, const ffi::AnyBuffer& k2,
                                             const ffi::AnyBuffer& v2, const ffi::AnyBuffer& dk2,
                                             const ffi::AnyBuffer& dv2, bool packed) {
  auto kd = k.dimensions(), k2d = k2.dimensions();
  if (k2d.size() != 3 || k2d[1] != (packed ? 2 : 1) * kd[1] || k2d[2] != kd[2] || k2.element_type() != k.element_type())
    return ffi::Error::InvalidArgument(packed ? "k2: packed must be [Tk2, 2 Hkv, D] with k's Hkv, head dim and dtype"
                                              : "k2: must be [Tk2, Hkv, D] with k's heads, head dim and dtype");
  if (auto err = CheckSameShape("v2", v2, k2); err.failure()) return err;
  if (auto err = CheckSameShape("dk2", dk2, k2); err.failure()) return err;
  if (packed && dv2.element_count() != 0)
    return ffi::Error::InvalidArgument("dv2: empty when k2 is packed (dk2 holds dK and dV)");
  if (!packed)
    if (auto err = CheckSameShape("dv2", dv2, k2); err.failure()) return err;
  return k2d[0];
}

// A forward split into calls over disjoint key sets (the distributed forward: host keys, then each stage's)
// merges each call into the previous one's out and lse (given, aliased to out and lse) instead of a merge
// pass after them. Returns whether they are given (both empty: not).
inline ffi::ErrorOr<bool> CheckMergeInputs(const ffi::AnyBuffer& out, const ffi::AnyBuffer& out_prev,
                                           const ffi::AnyBuffer& lse_prev) {
  const bool has_out = out_prev.dimensions().size() == 3, has_lse = lse_prev.dimensions().size() == 2;
  if (!has_out && !has_lse) return false;
  if (auto err = CheckSameShape("out_prev", out_prev, out); err.failure()) return err;
  auto qd = out.dimensions(), ld = lse_prev.dimensions();
  if (!has_lse || ld[0] != qd[0] || ld[1] != qd[1] || lse_prev.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("lse_prev: must be float32 [Tq, Hq] with out_prev");
  return true;
}

// max_logit (the forward's third result): float32 [Tq, Hq], or empty. Returns whether it is wanted.
inline ffi::ErrorOr<bool> CheckMaxLogitOut(const ffi::Buffer<ffi::F32>& max_logit, const ffi::AnyBuffer& q) {
  auto md = max_logit.dimensions(), qd = q.dimensions();
  if (max_logit.element_count() == 0 && md.size() != 2) return false;
  if (md.size() != 2 || md[0] != qd[0] || md[1] != qd[1])
    return ffi::Error::InvalidArgument("max_logit: must be float32 [Tq, Hq], or empty");
  return true;
}

// A backward split into calls over disjoint key sets (the distributed staged backward) chains one float32
// dQ accumulator through them: dq_in (empty: none) is what earlier calls summed, and with dq_f32 the call
// returns dq_in + its own dQ unrounded. Returns whether dq_in is given.
inline ffi::ErrorOr<bool> CheckDqChain(const ffi::AnyBuffer& q, const ffi::AnyBuffer& dq_in, const ffi::AnyBuffer& dq,
                                       bool dq_f32, bool deterministic) {
  const bool has_in = dq_in.element_count() != 0 || dq_in.dimensions().size() == 3;
  auto qd = q.dimensions(), dd = dq.dimensions(), id = dq_in.dimensions();
  bool dq_shape = dd.size() == 3;
  for (size_t i = 0; dq_shape && i < 3; ++i) dq_shape = dd[i] == qd[i];
  if (!dq_shape || dq.element_type() != (dq_f32 ? ffi::DataType::F32 : q.element_type()))
    return ffi::Error::InvalidArgument("dq: must be q's shape, float32 with dq_f32 and q's dtype without");
  if (has_in) {
    bool in_shape = id.size() == 3 && dq_in.element_type() == ffi::DataType::F32;
    for (size_t i = 0; in_shape && i < 3; ++i) in_shape = id[i] == qd[i];
    if (!in_shape) return ffi::Error::InvalidArgument("dq_in: must be float32 of q's shape, or empty");
    if (!dq_f32) return ffi::Error::InvalidArgument("dq_in: needs dq_f32 (the sum stays unrounded)");
  }
  if (dq_f32 && deterministic)
    return ffi::Error::InvalidArgument("dq_f32: not with deterministic (its dQ kernel writes q's dtype)");
  return has_in;
}

// The calls of a split backward share one delta = rowsum(dout * out) - dlse: delta_in (empty: the call
// computes it from out, dout and dlse) is float32 [Tq, Hq]. Returns whether it is given.
inline ffi::ErrorOr<bool> CheckDeltaIn(const ffi::AnyBuffer& q, const ffi::AnyBuffer& delta_in) {
  auto qd = q.dimensions(), dd = delta_in.dimensions();
  if (delta_in.element_count() == 0 && dd.size() != 2) return false;
  if (dd.size() != 2 || dd[0] != qd[0] || dd[1] != qd[1] || delta_in.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("delta_in: must be float32 [Tq, Hq], or empty");
  return true;
}

}  // namespace magi_jax
