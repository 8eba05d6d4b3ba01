// Range gather and range scatter-add on the CPU (interface: range_ops_interface.h).
//
// All three are one loop in "gather form": each task owns a block of output rows, walks the range table in
// order, and adds the rows of every range that lands in its block into a float accumulator; the block is
// then rounded once to the output dtype (into: added to the row's value, rows no range covers left as they
// are). Every output row has one owner task: deterministic, no atomics.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "range_ops_cpu.h"

namespace magi_jax::cpu {
namespace {

constexpr int64_t kRowBlock = 64;

// One range as the walk sees it: rows [out_start, out_start + len) of the output take rows
// [in_start, in_start + len) of the input.
struct Span {
  int64_t in_start, out_start, len;
};

// The table clipped to both arrays. `gather`: src side is the input; scatter-add: the output.
std::vector<Span> LoadSpans(const int32_t* ranges, int64_t m, bool gather, int64_t in_rows, int64_t out_rows) {
  std::vector<Span> spans;
  spans.reserve(m);
  for (int64_t i = 0; i < m; ++i) {
    int64_t s = ranges[3 * i], e = ranges[3 * i + 1], d = ranges[3 * i + 2];
    int64_t in0 = gather ? s : d, out0 = gather ? d : s, len = e - s;
    // Clip so that both [in0, in0 + len) and [out0, out0 + len) lie inside their arrays.
    int64_t lo = std::max<int64_t>({0, -in0, -out0});
    int64_t hi = std::min<int64_t>({len, in_rows - in0, out_rows - out0});
    if (hi > lo) spans.push_back({in0 + lo, out0 + lo, hi - lo});
  }
  return spans;
}

template <typename Tin, typename Tout>
void RunRangeOp(ffi::ThreadPool& pool, const std::vector<Span>& spans, const RangeArray& a, int64_t out_rows) {
  const Tin* in = static_cast<const Tin*>(a.in);
  Tout* out = static_cast<Tout*>(a.out);
  const Tout* init = static_cast<const Tout*>(a.init);
  const int64_t f = a.features, blocks = (out_rows + kRowBlock - 1) / kRowBlock;
  // into: out is a whole array of its own (scatter-adds are packed on the input side only).
  if (init != nullptr && init != out) std::memcpy(out, init, sizeof(Tout) * out_rows * f);  // not aliased
  std::vector<std::vector<float>> acc(NumWorkers(pool, blocks));
  ParallelFor(pool, blocks, [&](int64_t b, int worker) {
    const int64_t r0 = b * kRowBlock, r1 = std::min(out_rows, r0 + kRowBlock);
    std::vector<float>& buf = acc[worker];
    buf.assign((r1 - r0) * f, 0.0f);
    bool covered[kRowBlock] = {};
    for (const Span& s : spans) {
      const int64_t lo = std::max(r0, s.out_start), hi = std::min(r1, s.out_start + s.len);
      for (int64_t r = lo; r < hi; ++r) {
        const Tin* src = in + (s.in_start + (r - s.out_start)) * a.in_stride;
        float* dst = buf.data() + (r - r0) * f;
        for (int64_t j = 0; j < f; ++j) dst[j] += ToFloat(src[j]);
        covered[r - r0] = true;
      }
    }
    for (int64_t r = r0; r < r1; ++r) {
      if (init != nullptr && !covered[r - r0]) continue;  // into: untouched rows keep their values
      const float* row = buf.data() + (r - r0) * f;
      Tout* o = out + r * a.out_stride;
      for (int64_t j = 0; j < f; ++j) o[j] = FromFloat<Tout>(row[j] + (init != nullptr ? ToFloat(o[j]) : 0.0f));
    }
  });
}

// Calls fn(tag) with the element type of `dtype` (already checked by CheckRangeOp).
template <typename Fn>
void DispatchRangeType(ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::BF16: fn(Bf16{}); break;
    case ffi::DataType::F16: fn(Half{}); break;
    default: fn(float{}); break;
  }
}

ffi::Error RangeOp(ffi::ThreadPool& pool, const char* name, bool gather, ffi::Buffer<ffi::S32> ranges,
                   ffi::RemainingArgs ins, ffi::RemainingRets outs, bool packed, bool into = false) {
  RangeArray arrays[kMaxRangeArrays];
  auto dims = CheckRangeOp(name, ranges, ins, outs, arrays, into, packed, gather);
  if (dims.has_error()) return dims.error();
  const std::vector<Span> spans =
      LoadSpans(ranges.typed_data(), dims->num_ranges, gather, dims->in_rows, dims->out_rows);
  for (int64_t j = 0; j < dims->num_arrays; ++j) {
    DispatchRangeType(dims->in_type, [&](auto in_tag) {
      using Tin = decltype(in_tag);
      if (dims->out_type == dims->in_type) {
        RunRangeOp<Tin, Tin>(pool, spans, arrays[j], dims->out_rows);
      } else {
        RunRangeOp<Tin, float>(pool, spans, arrays[j], dims->out_rows);
      }
    });
  }
  return ffi::Error::Success();
}

ffi::Error RangeGatherImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ranges, ffi::RemainingArgs ins,
                           ffi::RemainingRets outs, bool packed) {
  return RangeOp(pool, "magi_jax_range_gather", true, ranges, ins, outs, packed);
}

ffi::Error RangeScatterAddImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ranges, ffi::RemainingArgs ins,
                               ffi::RemainingRets outs, bool packed) {
  return RangeOp(pool, "magi_jax_range_scatter_add", false, ranges, ins, outs, packed);
}

ffi::Error RangeScatterAddIntoImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ranges, ffi::RemainingArgs ins,
                                   ffi::RemainingRets outs, bool packed) {
  return RangeOp(pool, "magi_jax_range_scatter_add_into", false, ranges, ins, outs, packed, true);
}

}  // namespace
}  // namespace magi_jax::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiRangeGatherCpu, magi_jax::cpu::RangeGatherImpl,
                              magi_jax::BindRangeOp(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiRangeScatterAddCpu, magi_jax::cpu::RangeScatterAddImpl,
                              magi_jax::BindRangeOp(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiRangeScatterAddIntoCpu, magi_jax::cpu::RangeScatterAddIntoImpl,
                              magi_jax::BindRangeOp(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
