// CUDA range gather and range scatter-add (interface: ffi/range_ops_interface.h), exported as
// MagiRangeGatherCuda, MagiRangeScatterAddCuda and MagiRangeScatterAddIntoCuda and registered by
// magi_jax/_ffi.py for platform "CUDA".
// They pack and unpack the buffers of the group collectives (magi_jax/comm.py).
//
// One kernel in "gather form" serves both: a CTA owns blocks of kRows output rows x (threads * kVec) columns
// of one array (a grid of the resident CTAs striding over the row blocks); for each block it keeps them in
// float registers, walks the range table in order (staged through shared memory) and adds every input row
// that a range maps into its rows; then it rounds once and stores. Every output element
// has one owner: no atomics, no pre-zeroing, deterministic sums, each output byte written once (the "into"
// variant reads and writes only the rows some range covers).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "launch.h"
#include "range_ops_interface.h"

namespace magi_jax::cuda {
namespace {

constexpr int kRows = 8;           // output rows per CTA
constexpr int kVec = 4;            // consecutive elements per thread
constexpr int kMaxThreads = 256;
constexpr int kRangeTile = 256;    // ranges staged in shared memory at a time

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

// kAligned: every array's feature count and row strides are multiples of kVec (rows then start on
// kVec-element boundaries).
// kInto: out already holds the initial values; rows no range covers are not touched, covered rows become
// out + sum.
template <typename Tin, typename Tout, bool kAligned, bool kInto>
__global__ void __launch_bounds__(kMaxThreads, 2)
    RangeSumKernel(const int32_t* __restrict__ ranges, int num_ranges, bool gather,
                   const __grid_constant__ Arrays arrays, int64_t in_rows,
                   int64_t out_rows) {
  __shared__ int3 spans[kRangeTile];  // (in_start, out_start - r0, len) clipped; len 0 when it misses the CTA
  const int j = blockIdx.z;  // arrays is a __grid_constant__: indexed in parameter space, no local copy
  const Tin* in = static_cast<const Tin*>(arrays.in[j]);
  Tout* out = static_cast<Tout*>(arrays.out[j]);
  const int64_t f = arrays.features[j], in_stride = arrays.in_stride[j], out_stride = arrays.out_stride[j];
  const int64_t col = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * kVec;
  const int n_cols = int(min(int64_t(kVec), f - col));

  // The CTA strides over blocks of kRows output rows: after its first block the range table comes from L1,
  // so a block costs one memory latency (its rows' loads) instead of two (the table, then the rows).
#pragma unroll 1
  for (int64_t r0 = int64_t(blockIdx.x) * kRows; r0 < out_rows; r0 += int64_t(gridDim.x) * kRows) {
    float acc[kRows][kVec];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[r][e] = 0.0f;

    uint32_t covered = 0;  // bit r: some range maps into CTA row r (the same in every thread)
    for (int base = 0; base < num_ranges; base += kRangeTile) {
      const int n = min(kRangeTile, num_ranges - base);
      __syncthreads();  // the previous tile's (or block's) spans are read
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int64_t s = ranges[3 * (base + i)], e = ranges[3 * (base + i) + 1], d = ranges[3 * (base + i) + 2];
        const int64_t in0 = gather ? s : d, out0 = gather ? d : s;
        // Clip to both arrays and to this CTA's rows [r0, r0 + kRows).
        const int64_t lo = max(max(int64_t(0), -in0), max(-out0, r0 - out0));
        const int64_t hi = min(min(e - s, in_rows - in0), min(out_rows - out0, r0 + kRows - out0));
        spans[i] = hi > lo ? make_int3(int(in0 + lo), int(out0 + lo - r0), int(hi - lo)) : make_int3(0, 0, 0);
      }
      __syncthreads();
      if (n_cols <= 0) continue;
      for (int i = 0; i < n; ++i) {
        const int3 sp = spans[i];
        if (sp.z == 0) continue;
        const Tin* first = in + (int64_t(sp.x) - sp.y) * in_stride + col;  // the input row of CTA row 0
        // Every row's load first, then the adds: the loads are in flight together instead of one latency each.
        float v[kRows][kVec];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (r >= sp.y && r < sp.y + sp.z) Load<kAligned>(first + r * in_stride, n_cols, v[r]);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r >= sp.y && r < sp.y + sp.z) {
            covered |= 1u << r;
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[r][e] += v[r][e];
          }
        }
      }
    }
    if (n_cols <= 0) continue;  // no return: the other threads' next block has barriers
    Tout* dst = out + r0 * out_stride + col;
    const int rows = int(min(int64_t(kRows), out_rows - r0));
    if constexpr (kInto) {
      // The initial values, all loaded before any store (a store could alias a later row's load otherwise).
      float old[kRows][kVec];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (r < rows && (covered >> r & 1u)) Load<kAligned>(dst + r * out_stride, n_cols, old[r]);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (r < rows && (covered >> r & 1u)) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[r][e] += old[r][e];
          Store<kAligned>(dst + r * out_stride, n_cols, acc[r]);
        }
    } else {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (r < rows) Store<kAligned>(dst + r * out_stride, n_cols, acc[r]);
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
  const int64_t row_blocks = (out_rows + kRows - 1) / kRows;
  const unsigned col_blocks = unsigned((vecs + threads - 1) / threads);
  auto launch = [&](auto kernel) -> cudaError_t {
    // As many CTAs as are resident at once (the kernel strides over the row blocks), never more than blocks.
    int sms = 0, per_sm = 0;
    if (cudaError_t err = CurrentDeviceSms(&sms); err != cudaSuccess) return err;
    if (cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0);
        err != cudaSuccess)
      return err;
    const int64_t resident = std::max<int64_t>(1, int64_t(sms) * std::max(per_sm, 1) / (col_blocks * num_arrays));
    const dim3 grid(unsigned(std::min(row_blocks, resident)), col_blocks, unsigned(num_arrays));
    kernel<<<grid, threads, 0, stream>>>(ranges, num_ranges, gather, arrays, in_rows, out_rows);
    return cudaGetLastError();
  };
  if (aligned)
    return into ? launch(RangeSumKernel<Tin, Tout, true, true>) : launch(RangeSumKernel<Tin, Tout, true, false>);
  return into ? launch(RangeSumKernel<Tin, Tout, false, true>) : launch(RangeSumKernel<Tin, Tout, false, false>);
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
