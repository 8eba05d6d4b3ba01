// Tensor maps for the sm90 kernels' TMA: the driver's encoder (through the runtime's entry-point query: no
// driver library is linked) and the one map shape they use, a [t, h, d] tensor as (d, h, t) in boxes of
// (64, 1, rows) in the 128-byte swizzle. Host code, shared by launch_fwd_sm90.cu and launch_bwd_sm90.cu.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace magi_jax::cuda {

inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      return PFN_cuTensorMapEncodeTiled_v12000(nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

template <typename T>
constexpr CUtensorMapDataType kTmaType = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                   : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;

// A [t, h, d] tensor as (d, h, t), boxes of (64, 1, box_rows) in the 128-byte swizzle; zeros past the end.
// row_heads: heads from one row to the next when a row holds more than the h mapped (K and V packed);
// head_pitch: elements from one head to the next when a head holds more than the d mapped (0: d; V of MLA's
// 128 columns packed beside K's 192).
template <typename T>
inline bool EncodeMap(PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap* map, const void* base, int t, int h,
                      int d, int box_rows, int row_heads = 0, int head_pitch = 0) {
  const cuuint64_t pitch = head_pitch > 0 ? head_pitch : d;
  const cuuint64_t dims[3] = {cuuint64_t(d), cuuint64_t(h), cuuint64_t(t)};
  const cuuint64_t strides[2] = {pitch * 2, cuuint64_t(row_heads > 0 ? row_heads : h) * pitch * 2};  // bytes
  const cuuint32_t box[3] = {64, 1, cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode(map, kTmaType<T>, 3, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace magi_jax::cuda
