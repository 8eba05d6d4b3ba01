// The range-op custom-call interface shared by every platform (CPU in ffi/, CUDA in cuda/): the packing and
// unpacking of the group collectives (magi_jax/comm.py).
//
// A range table is int32 [M, 3], one row (src_start, src_end, dst_start) per contiguous range: rows
// [src_start, src_end) of the "source" side correspond to rows [dst_start, dst_start + src_end - src_start) of
// the "destination" side. Empty rows (src_end <= src_start) are padding. Parts of a range outside either
// array are skipped.
//
// Targets (registered per platform under the same names; n arrays of one leading length, 1 <= n <= 4):
//   magi_jax_range_gather:      (ranges, x_0 .. x_n-1) -> (y_0 .. y_n-1)
//       y_j[dst_start + t] = x_j[src_start + t]        (destination rows no range covers are zero)
//   magi_jax_range_scatter_add: (ranges, y_0 .. y_n-1) -> (x_0 .. x_n-1)
//       x_j[src_start + t] += y_j[dst_start + t]       (starting from zero)
//   magi_jax_range_scatter_add_into: (ranges, y_0 .. y_n-1, init_0 .. init_n-1) -> (x_0 .. x_n-1)
//       the same starting from init_j, which x_j aliases (input_output_aliases): only rows some range
//       covers are read and written, each as init + sum in float32, rounded once
// The two are transposes of each other. A row that several ranges write receives their sum, added in float32
// in the order of the table (deterministic; the output is rounded once). Inputs are [T_in, ...] and outputs
// [T_out, ...] with the same trailing shape; the output dtype is the input's or float32. Dtypes: float32,
// bfloat16, float16.
// Attribute `packed`: the n arrays of one side share a buffer [T, n, ...], array j being [:, j] (rows of the
// n arrays side by side: K and V of a key in one row of a group collective's buffer). The packed side is the
// gather's output (one result) and the scatter-adds' y (one input, before the inits).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace magi_jax {

namespace ffi = xla::ffi;

inline constexpr int kMaxRangeArrays = 4;

// Appends the arguments and results to a binding that already holds the platform's context.
template <typename Binding>
auto BindRangeOp(Binding binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>()  // ranges [M, 3]
      .RemainingArgs()                                             // inputs, [T_in, ...] each
      .RemainingRets()                                             // outputs, [T_out, ...] each
      .template Attr<bool>("packed");
}

// One array pair of a range op, as the kernels see it: rows of `features` elements, `in_stride` and
// `out_stride` elements apart (features, or n x features on a packed side).
struct RangeArray {
  const void* in;
  void* out;
  int64_t features;
  const void* init;  // scatter_add_into: the values out starts from (normally out itself, aliased)
  int64_t in_stride, out_stride;
};

struct RangeOpDims {
  int64_t num_ranges, in_rows, out_rows, num_arrays;
  ffi::DataType in_type, out_type;
};

// Checks the table and the arrays (as many inputs as outputs, or twice as many with `into`: the inits
// follow the inputs and match the outputs; one leading length per side, equal trailing shapes, supported
// dtypes; `packed`: one buffer [T, n, ...] on the packed side, `gather` telling which) and fills `arrays`.
inline ffi::ErrorOr<RangeOpDims> CheckRangeOp(const char* op, const ffi::Buffer<ffi::S32>& ranges,
                                              const ffi::RemainingArgs& ins, const ffi::RemainingRets& outs,
                                              RangeArray* arrays, bool into, bool packed, bool gather) {
  const std::string name(op);
  auto rd = ranges.dimensions();
  if (rd.size() != 2 || rd[1] != 3) return ffi::Error::InvalidArgument(name + ": ranges must be int32 [M, 3]");
  const bool packed_in = packed && !gather, packed_out = packed && gather;
  const size_t n = packed_out ? ins.size() : outs.size();
  const size_t want_ins = (packed_in ? 1 : n) + (into ? n : 0), want_outs = packed_out ? 1 : n;
  if (n < 1 || n > size_t(kMaxRangeArrays) || ins.size() != want_ins || outs.size() != want_outs)
    return ffi::Error::InvalidArgument(name + ": takes 1 to 4 arrays (and as many inits) and returns as many" +
                                       (packed ? " (one packed buffer [T, n, ...] on the packed side)" : ""));
  RangeOpDims dims{rd[0], -1, -1, int64_t(n), ffi::DataType::INVALID, ffi::DataType::INVALID};
  for (size_t j = 0; j < n; ++j) {
    auto in = ins.get<ffi::AnyBuffer>(packed_in ? 0 : j);
    auto out = outs.get<ffi::AnyBuffer>(packed_out ? 0 : j);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    auto id = in->dimensions(), od = (*out)->dimensions();
    // A packed buffer's axis 1 is the array index: its trailing shape starts at axis 2.
    const size_t ia = packed_in ? 2 : 1, oa = packed_out ? 2 : 1;
    if ((packed_in && (id.size() < 2 || id[1] != int64_t(n))) || (packed_out && (od.size() < 2 || od[1] != int64_t(n))))
      return ffi::Error::InvalidArgument(name + ": the packed buffer must be [T, " + std::to_string(n) + ", ...]");
    if (id.size() < 1 || id.size() - ia != od.size() - oa)
      return ffi::Error::InvalidArgument(name + ": input and output " + std::to_string(j) +
                                         " must have the same rank >= 1");
    int64_t features = 1;
    for (size_t a = 0; a + ia < id.size(); ++a) {
      if (id[ia + a] != od[oa + a])
        return ffi::Error::InvalidArgument(name + ": input and output " + std::to_string(j) +
                                           " differ beyond the leading axis");
      features *= id[ia + a];
    }
    if (j == 0) {
      dims.in_rows = id[0];
      dims.out_rows = od[0];
      dims.in_type = in->element_type();
      dims.out_type = (*out)->element_type();
    } else if (id[0] != dims.in_rows || od[0] != dims.out_rows || in->element_type() != dims.in_type ||
               (*out)->element_type() != dims.out_type) {
      return ffi::Error::InvalidArgument(name + ": all arrays must share leading lengths and dtypes");
    }
    const int64_t in_step = packed_in ? int64_t(j) * features * ffi::ByteWidth(in->element_type()) : 0;
    const int64_t out_step = packed_out ? int64_t(j) * features * ffi::ByteWidth((*out)->element_type()) : 0;
    arrays[j] = RangeArray{static_cast<const char*>(in->untyped_data()) + in_step,
                           static_cast<char*>((*out)->untyped_data()) + out_step, features, nullptr,
                           packed_in ? int64_t(n) * features : features,
                           packed_out ? int64_t(n) * features : features};
    if (into) {
      auto init = ins.get<ffi::AnyBuffer>((packed_in ? 1 : n) + j);
      if (init.has_error()) return init.error();
      auto nd = init->dimensions();
      bool same = nd.size() == od.size() && init->element_type() == (*out)->element_type();
      for (size_t a = 0; same && a < nd.size(); ++a) same = nd[a] == od[a];
      if (!same) return ffi::Error::InvalidArgument(name + ": init " + std::to_string(j) + " differs from its output");
      arrays[j].init = init->untyped_data();
    }
  }
  auto supported = [](ffi::DataType t) {
    return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
  };
  if (!supported(dims.in_type)) return ffi::Error::InvalidArgument(name + ": dtype must be f32, bf16 or f16");
  if (dims.out_type != dims.in_type && dims.out_type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(name + ": the output dtype must be the input's or float32");
  return dims;
}

}  // namespace magi_jax
