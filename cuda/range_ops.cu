// CUDA range gather and range scatter-add (interface: ffi/range_ops_interface.h), exported as
// MagiRangeGatherCuda, MagiRangeScatterAddCuda and MagiRangeScatterAddIntoCuda and registered by
// magi_jax/_ffi.py for platform "CUDA".
// They pack and unpack the buffers of the group collectives (magi_jax/comm.py).
//
// One kernel in "gather form" serves both: a CTA owns chunks of output rows x (threads * kVec) columns of one
// array (a grid of the resident CTAs striding over the chunks); for each block of kRows rows it keeps them in
// float registers, walks the ranges that meet the chunk in table order (staged through shared memory) and
// adds every input row that a range maps into its rows; then it rounds once and stores. Chunks whose rows
// are each covered at most once (the common case) are copied row by row instead. Every output element
// has one owner: no atomics, no pre-zeroing, deterministic sums, each output byte written once (the "into"
// variant reads and writes only the rows some range covers).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "launch.h"
#include "range_ops_interface.h"

namespace magi_jax::cuda {
namespace {

constexpr int kRows = 8;           // output rows per block (a CTA accumulates one block at a time)
constexpr int kVec = 4;            // consecutive elements per thread
constexpr int kMaxThreads = 256;
constexpr int kRangeTile = 256;    // ranges staged in shared memory at a time
constexpr int kChunkBlocks = 4;    // blocks of kRows rows per chunk when the table fits one tile
static_assert(kChunkBlocks * kRows == 32, "a chunk's rows are the bits of a uint32 (ChunkRows)");

struct Arrays {
  const void* in[kMaxRangeArrays];
  void* out[kMaxRangeArrays];
  int64_t features[kMaxRangeArrays];
  int64_t in_stride[kMaxRangeArrays], out_stride[kMaxRangeArrays];  // elements between rows (RangeArray)
};

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T FromF(float x);
template <> __device__ __forceinline__ float FromF<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half FromF<__half>(float x) { return __float2half_rn(x); }

// kVec elements at p (aligned to kVec elements when kAligned) to and from floats.
template <bool kAligned, typename T>
__device__ __forceinline__ void Load(const T* p, int n, float (&v)[kVec]) {
  if constexpr (kAligned && sizeof(T) == 4) {
    const float4 u = *reinterpret_cast<const float4*>(p);
    v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
  } else if constexpr (kAligned && sizeof(T) == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = ToF(h[e]);
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = e < n ? ToF(p[e]) : 0.0f;
  }
}

template <bool kAligned, typename T>
__device__ __forceinline__ void Store(T* p, int n, const float (&v)[kVec]) {
  if constexpr (kAligned && sizeof(T) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (kAligned && sizeof(T) == 2) {
    uint2 u;
    T* h = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int e = 0; e < kVec; ++e) h[e] = FromF<T>(v[e]);
    *reinterpret_cast<uint2*>(p) = u;
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      if (e < n) p[e] = FromF<T>(v[e]);
  }
}

// kVec elements of T as stored (8 bytes for 2-byte types, 16 for float), and as floats.
template <typename T> using RawVec = std::conditional_t<sizeof(T) == 4, float4, uint2>;
template <typename T>
__device__ __forceinline__ RawVec<T> LoadRaw(const T* p) { return *reinterpret_cast<const RawVec<T>*>(p); }
template <typename T>
__device__ __forceinline__ void Unpack(const RawVec<T>& u, float (&v)[kVec]) {
  const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int e = 0; e < kVec; ++e) v[e] = ToF(h[e]);
}

// The ranges of the table that meet output rows [c0, c0 + rows), clipped to both arrays and to those rows,
// into spans[0, m) in table order (the order of the sums): (in_start, out_start - c0, len). Returns m, the
// same in every thread. Reads table entries [base, base + n), n <= kRangeTile; all threads call it.
__device__ __forceinline__ int StageSpans(const int32_t* __restrict__ ranges, int base, int n, bool gather,
                                          int64_t in_rows, int64_t out_rows, int64_t c0, int rows,
                                          int3* spans, int* warp_counts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  int m = 0;
  for (int i0 = 0; i0 < n; i0 += blockDim.x) {
    const int i = i0 + threadIdx.x;
    int3 sp = make_int3(0, 0, 0);
    if (i < n) {
      const int64_t s = ranges[3 * (base + i)], e = ranges[3 * (base + i) + 1], d = ranges[3 * (base + i) + 2];
      const int64_t in0 = gather ? s : d, out0 = gather ? d : s;
      const int64_t lo = max(max(int64_t(0), -in0), max(-out0, c0 - out0));
      const int64_t hi = min(min(e - s, in_rows - in0), min(out_rows - out0, c0 + rows - out0));
      if (hi > lo) sp = make_int3(int(in0 + lo), int(out0 + lo - c0), int(hi - lo));
    }
    // Ordered compaction: a warp's kept entries after those of the warps before it.
    const unsigned kept = __ballot_sync(0xffffffffu, sp.z > 0);
    __syncthreads();  // the previous round's counts (and the caller's previous spans) are read
    if (lane == 0) warp_counts[warp] = __popc(kept);
    __syncthreads();
    int before = m, total = m;
    for (int w = 0; w < warps; ++w) {
      before += w < warp ? warp_counts[w] : 0;
      total += warp_counts[w];
    }
    if (sp.z > 0) spans[before + __popc(kept & ((1u << lane) - 1u))] = sp;
    m = total;
  }
  __syncthreads();
  return m;
}

// The rows [b0, b0 + kRows) of a chunk that a span covers, as bits of (row - b0).
__device__ __forceinline__ uint32_t BlockRows(int3 span, int b0) {
  const int lo = max(span.y - b0, 0), hi = min(span.y + span.z - b0, kRows);
  return hi > lo ? ((1u << hi) - 1u) & ~((1u << lo) - 1u) : 0u;
}

// The rows of a chunk a span covers, as bits of the chunk's rows (kChunkBlocks * kRows = 32 of them).
__device__ __forceinline__ uint32_t ChunkRows(int3 span) {
  return uint32_t(((1ull << (span.y + span.z)) - 1ull) & ~((1ull << span.y) - 1ull));
}

// A chunk whose spans cover each of its rows at most once (a packing table; the partials of one stage): a
// row is a copy (or one add to its initial value), so it needs no float accumulator, and kCopyRows rows'
// loads, inputs and initial values, are in flight together (2x the bytes of the accumulating walk for 2-byte
// types, whose initial values also waited for its inputs). in and out point at this thread's columns, out at
// the chunk's first row; rows: the chunk's rows.
template <typename Tin, typename Tout, bool kInto>
__device__ __forceinline__ void CopyDisjoint(const int3* spans, int m, const Tin* in, int64_t in_stride,
                                             Tout* out, int64_t out_stride, int rows) {
  // 16 loads in flight per thread (an input and an initial value per row for "into"; 8 with float rows).
  constexpr int kCopyRows = (sizeof(Tin) == 2 && sizeof(Tout) == 2 ? 16 : 8) / (kInto ? 2 : 1);
#pragma unroll 1
  for (int p0 = 0; p0 < rows; p0 += kCopyRows) {
    int src[kCopyRows];  // the input row of row p0 + r; -1 when no span covers it
#pragma unroll
    for (int r = 0; r < kCopyRows; ++r) src[r] = -1;
    for (int i = 0; i < m; ++i) {
      const int3 sp = spans[i];
#pragma unroll
      for (int r = 0; r < kCopyRows; ++r)
        if (p0 + r >= sp.y && p0 + r < sp.y + sp.z) src[r] = sp.x + (p0 + r - sp.y);
    }
    RawVec<Tin> x[kCopyRows];
    RawVec<Tout> old[kInto ? kCopyRows : 1];
#pragma unroll
    for (int r = 0; r < kCopyRows; ++r) {
      if (src[r] < 0) continue;
      x[r] = LoadRaw(in + int64_t(src[r]) * in_stride);
      if constexpr (kInto) old[r] = LoadRaw(out + int64_t(p0 + r) * out_stride);
    }
#pragma unroll
    for (int r = 0; r < kCopyRows; ++r) {
      float v[kVec] = {};
      if (src[r] >= 0) {
        Unpack<Tin>(x[r], v);
        if constexpr (kInto) {
          float o[kVec];
          Unpack<Tout>(old[r], o);
#pragma unroll
          for (int e = 0; e < kVec; ++e) v[e] += o[e];
        }
      }
      if (p0 + r < rows && (src[r] >= 0 || !kInto)) Store<true>(out + int64_t(p0 + r) * out_stride, kVec, v);
    }
  }
}

// kAligned: every array's feature count and row strides are multiples of kVec (rows then start on
// kVec-element boundaries).
// kInto: out already holds the initial values; rows no range covers are not touched, covered rows become
// out + sum.
// kOneTile: the table fits one shared-memory tile. A CTA then takes chunks of kChunkBlocks x kRows output
// rows (the grid strides over them), clips the table to the chunk once, and each block of kRows rows walks
// only the ranges that meet the chunk (usually one or two); a chunk whose rows are each covered at most once
// is copied (CopyDisjoint) without the accumulator. A longer table is walked in tiles for each block
// of kRows rows (twice for "into": its covered rows first).
template <typename Tin, typename Tout, bool kAligned, bool kInto, bool kOneTile>
__global__ void __launch_bounds__(kMaxThreads, 2)
    RangeSumKernel(const int32_t* __restrict__ ranges, int num_ranges, bool gather,
                   const __grid_constant__ Arrays arrays, int64_t in_rows,
                   int64_t out_rows) {
  __shared__ int3 spans[kRangeTile];
  __shared__ int warp_counts[kMaxThreads / 32];
  const int j = blockIdx.z;  // arrays is a __grid_constant__: indexed in parameter space, no local copy
  const Tin* in = static_cast<const Tin*>(arrays.in[j]);
  Tout* out = static_cast<Tout*>(arrays.out[j]);
  const int64_t f = arrays.features[j], in_stride = arrays.in_stride[j], out_stride = arrays.out_stride[j];
  const int64_t col = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * kVec;
  const int n_cols = int(min(int64_t(kVec), f - col));
  constexpr int chunk_rows = kOneTile ? kChunkBlocks * kRows : kRows;

#pragma unroll 1
  for (int64_t c0 = int64_t(blockIdx.x) * chunk_rows; c0 < out_rows; c0 += int64_t(gridDim.x) * chunk_rows) {
    const int rows_in_chunk = int(min(int64_t(chunk_rows), out_rows - c0));
    int m = kOneTile ? StageSpans(ranges, 0, num_ranges, gather, in_rows, out_rows, c0, rows_in_chunk, spans,
                                  warp_counts)
                     : 0;
    if constexpr (kOneTile && kAligned) {
      uint32_t seen = 0;
      bool disjoint = true;
      for (int i = 0; i < m; ++i) {
        const uint32_t bits = ChunkRows(spans[i]);
        disjoint &= (seen & bits) == 0;
        seen |= bits;
      }
      if (disjoint) {  // the same in every thread
        if (n_cols > 0)
          CopyDisjoint<Tin, Tout, kInto>(spans, m, in + col, in_stride, out + c0 * out_stride + col, out_stride,
                                         rows_in_chunk);
        continue;
      }
    }
#pragma unroll 1
    for (int b0 = 0; b0 < rows_in_chunk; b0 += kRows) {  // b0: the block's first row in the chunk
      const int rows = min(kRows, rows_in_chunk - b0);
      float acc[kRows][kVec];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[r][e] = 0.0f;
      uint32_t covered = 0;  // bit r: some range maps into block row r (the same in every thread)
      if constexpr (kInto) {
        // The covered rows first, so that their initial values load into acc together with the inputs.
        for (int base = 0; base < num_ranges; base += kRangeTile) {
          if (!kOneTile)
            m = StageSpans(ranges, base, min(kRangeTile, num_ranges - base), gather, in_rows, out_rows, c0,
                           rows_in_chunk, spans, warp_counts);
          for (int i = 0; i < m; ++i) covered |= BlockRows(spans[i], b0);
        }
        const Tout* init = out + (c0 + b0) * out_stride + col;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (n_cols > 0 && r < rows && (covered >> r & 1u)) Load<kAligned>(init + r * out_stride, n_cols, acc[r]);
      }
      for (int base = 0; base < num_ranges; base += kRangeTile) {
        if (!kOneTile)
          m = StageSpans(ranges, base, min(kRangeTile, num_ranges - base), gather, in_rows, out_rows, c0,
                         rows_in_chunk, spans, warp_counts);
        if (n_cols <= 0) continue;
        for (int i = 0; i < m; ++i) {
          const int3 sp = spans[i];
          const int y = sp.y - b0;  // the span's first row in this block's rows (may be negative)
          if (y >= kRows || y + sp.z <= 0) continue;
          const Tin* first = in + (int64_t(sp.x) - y) * in_stride + col;  // the input row of block row 0
          // Every row's load first, then the adds: the loads are in flight together instead of one latency each.
          float v[kRows][kVec];
#pragma unroll
          for (int r = 0; r < kRows; ++r)
            if (r >= y && r < y + sp.z) Load<kAligned>(first + r * in_stride, n_cols, v[r]);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
            if (r >= y && r < y + sp.z)
#pragma unroll
              for (int e = 0; e < kVec; ++e) acc[r][e] += v[r][e];
        }
      }
      if (n_cols <= 0) continue;  // no return: the other threads' next chunk has barriers
      Tout* dst = out + (c0 + b0) * out_stride + col;
      if constexpr (kInto) {
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (r < rows && (covered >> r & 1u)) Store<kAligned>(dst + r * out_stride, n_cols, acc[r]);
      } else {
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (r < rows) Store<kAligned>(dst + r * out_stride, n_cols, acc[r]);
      }
    }
  }
}

template <typename Tin, typename Tout>
cudaError_t LaunchRangeSum(cudaStream_t stream, const int32_t* ranges, int num_ranges, bool gather, bool into,
                           const Arrays& arrays, int num_arrays, int64_t in_rows, int64_t out_rows) {
  int64_t max_f = 0;
  bool aligned = true;
  for (int j = 0; j < num_arrays; ++j) {
    max_f = std::max(max_f, arrays.features[j]);
    aligned &= arrays.features[j] % kVec == 0 && arrays.in_stride[j] % kVec == 0 && arrays.out_stride[j] % kVec == 0;
  }
  if (out_rows == 0 || max_f == 0) return cudaSuccess;
  const int64_t vecs = (max_f + kVec - 1) / kVec;
  const int threads = int(std::min<int64_t>(kMaxThreads, (vecs + 31) / 32 * 32));
  const int chunk_rows = num_ranges <= kRangeTile ? kChunkBlocks * kRows : kRows;
  const int64_t chunks = (out_rows + chunk_rows - 1) / chunk_rows;
  const unsigned col_blocks = unsigned((vecs + threads - 1) / threads);
  auto launch = [&](auto kernel) -> cudaError_t {
    // As many CTAs as are resident at once (the kernel strides over the chunks), never more than chunks.
    int sms = 0, per_sm = 0;
    if (cudaError_t err = CurrentDeviceSms(&sms); err != cudaSuccess) return err;
    if (cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0);
        err != cudaSuccess)
      return err;
    const int64_t resident = std::max<int64_t>(1, int64_t(sms) * std::max(per_sm, 1) / (col_blocks * num_arrays));
    const dim3 grid(unsigned(std::min(chunks, resident)), col_blocks, unsigned(num_arrays));
    kernel<<<grid, threads, 0, stream>>>(ranges, num_ranges, gather, arrays, in_rows, out_rows);
    return cudaGetLastError();
  };
  auto pick = [&](auto aligned_tag) -> cudaError_t {
    constexpr bool kAligned = decltype(aligned_tag)::value;
    if (num_ranges <= kRangeTile)
      return into ? launch(RangeSumKernel<Tin, Tout, kAligned, true, true>)
                  : launch(RangeSumKernel<Tin, Tout, kAligned, false, true>);
    return into ? launch(RangeSumKernel<Tin, Tout, kAligned, true, false>)
                : launch(RangeSumKernel<Tin, Tout, kAligned, false, false>);
  };
  return aligned ? pick(std::true_type{}) : pick(std::false_type{});
}

template <typename Tin>
cudaError_t LaunchByOutType(ffi::DataType out_type, cudaStream_t stream, const int32_t* ranges, int num_ranges,
                            bool gather, bool into, const Arrays& arrays, int num_arrays, int64_t in_rows,
                            int64_t out_rows) {
  if (out_type == ffi::DataType::F32)
    return LaunchRangeSum<Tin, float>(stream, ranges, num_ranges, gather, into, arrays, num_arrays, in_rows,
                                      out_rows);
  return LaunchRangeSum<Tin, Tin>(stream, ranges, num_ranges, gather, into, arrays, num_arrays, in_rows, out_rows);
}

size_t ElementBytes(ffi::DataType t) { return t == ffi::DataType::F32 ? 4 : 2; }

ffi::Error RangeOp(const char* name, bool gather, cudaStream_t stream, ffi::Buffer<ffi::S32> ranges,
                   ffi::RemainingArgs ins, ffi::RemainingRets outs, bool packed, bool into = false) {
  RangeArray list[kMaxRangeArrays];
  auto dims = CheckRangeOp(name, ranges, ins, outs, list, into, packed, gather);
  if (dims.has_error()) return dims.error();
  constexpr int64_t kMaxRows = (int64_t(1) << 31) - kRows;
  if (dims->in_rows > kMaxRows || dims->out_rows > kMaxRows || dims->num_ranges > (int64_t(1) << 30))
    return ffi::Error::InvalidArgument(std::string(name) + ": more than 2^31 rows or 2^30 ranges");
  Arrays arrays{};
  for (int64_t j = 0; j < dims->num_arrays; ++j) {
    arrays.in[j] = list[j].in;
    arrays.out[j] = list[j].out;
    arrays.features[j] = list[j].features;
    arrays.in_stride[j] = list[j].in_stride;
    arrays.out_stride[j] = list[j].out_stride;
    // into: the kernel reads the initial values from out, which XLA aliases to init; copy if it did not.
    if (into && list[j].init != list[j].out) {
      const size_t bytes = size_t(dims->out_rows) * list[j].features * ElementBytes(dims->out_type);
      if (cudaError_t err = cudaMemcpyAsync(list[j].out, list[j].init, bytes, cudaMemcpyDeviceToDevice, stream);
          err != cudaSuccess)
        return ffi::Error(ffi::ErrorCode::kInternal, std::string(name) + ": " + cudaGetErrorString(err));
    }
  }
  const int32_t* table = ranges.typed_data();
  const int m = int(dims->num_ranges), n = int(dims->num_arrays);
  cudaError_t err;
  switch (dims->in_type) {
    case ffi::DataType::BF16:
      err = LaunchByOutType<__nv_bfloat16>(dims->out_type, stream, table, m, gather, into, arrays, n,
                                           dims->in_rows, dims->out_rows);
      break;
    case ffi::DataType::F16:
      err = LaunchByOutType<__half>(dims->out_type, stream, table, m, gather, into, arrays, n, dims->in_rows,
                                    dims->out_rows);
      break;
    default:
      err = LaunchByOutType<float>(dims->out_type, stream, table, m, gather, into, arrays, n, dims->in_rows,
                                   dims->out_rows);
      break;
  }
  if (err != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(name) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error RangeGatherImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ranges, ffi::RemainingArgs ins,
                           ffi::RemainingRets outs, bool packed) {
  return RangeOp("magi_jax_range_gather", true, stream, ranges, ins, outs, packed);
}

ffi::Error RangeScatterAddImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ranges, ffi::RemainingArgs ins,
                               ffi::RemainingRets outs, bool packed) {
  return RangeOp("magi_jax_range_scatter_add", false, stream, ranges, ins, outs, packed);
}

ffi::Error RangeScatterAddIntoImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ranges, ffi::RemainingArgs ins,
                                   ffi::RemainingRets outs, bool packed) {
  return RangeOp("magi_jax_range_scatter_add_into", false, stream, ranges, ins, outs, packed, true);
}

}  // namespace
}  // namespace magi_jax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiRangeGatherCuda, magi_jax::cuda::RangeGatherImpl,
                              magi_jax::BindRangeOp(xla::ffi::Ffi::Bind()
                                                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiRangeScatterAddCuda, magi_jax::cuda::RangeScatterAddImpl,
                              magi_jax::BindRangeOp(xla::ffi::Ffi::Bind()
                                                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiRangeScatterAddIntoCuda, magi_jax::cuda::RangeScatterAddIntoImpl,
                              magi_jax::BindRangeOp(xla::ffi::Ffi::Bind()
                                                        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
