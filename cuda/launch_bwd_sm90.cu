// The sm90 backward's dK/dV launcher (flash_bwd_sm90_kernel.h): tensor maps built on the host from device
// pointers and static shapes (no synchronisation), a grid of (k blocks, kv heads), the instantiations
// (bf16, fp16) x (D 64, 128, 256) x (dQ by TMA reduce-add or not). D 256: 64-key CTAs (BwdSm90Tile::kSplitD).
#include <climits>

#include "flash_bwd_sm90_kernel.h"
#include "launch.h"
#include "tma_map.h"

namespace magi_jax::cuda {
namespace {

// The fp32 dq accumulator [t, h, d] as (32, d / 32, h, t) in boxes of (32, box_cols / 32, 1, box_rows):
// box_cols (64; head dim 256: 32) columns of box_rows rows in 128-byte lines ordered (row, 32-column chunk),
// 128-byte swizzle (the kernel's StoreDq / StoreDqBox32). The swizzle needs inner boxes of at most 128 bytes, hence the 32-column split; ordering the
// lines (row, chunk) makes the kernel's staging stores conflict-free. Rows past t are skipped by the reduce.
bool EncodeDqAccumMap(PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap* map, float* base, int t, int h,
                      int d, int box_cols, int box_rows) {
  const cuuint64_t dims[4] = {32, cuuint64_t(d / 32), cuuint64_t(h), cuuint64_t(t)};
  const cuuint64_t strides[3] = {32 * 4, cuuint64_t(d) * 4, cuuint64_t(h) * d * 4};  // bytes, dims 1-3
  const cuuint32_t box[4] = {32, cuuint32_t(box_cols / 32), 1, cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

template <typename T, int D>
cudaError_t LaunchBwdDkDvSm90(const BwdParams& p, bool reduce_dq, cudaStream_t stream, const KeySplit& split) {
  using Tile = BwdSm90Tile<D>;
  const int num_blocks = NumBlocks(p.slices.tk, Tile::kBlockN);
  if (num_blocks == 0 || p.hkv == 0) return cudaSuccess;
  // What TMA needs; anything else is left to the mma.sync kernel (nothing has been enqueued yet).
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  const bool two = split.row >= 0;
  const bool first = !two || split.row > 0;  // keys in the first source (none: an empty k, whatever its pointer)
  if (encode == nullptr || p.slices.tq == 0 || !Aligned16(p.q) || !Aligned16(p.dout) ||
      (first && (!Aligned16(p.k) || !Aligned16(p.v) || !Aligned16(p.dk) || !Aligned16(p.dv))))
    return cudaErrorNotSupported;
  if (two && (split.row % Tile::kBlockN != 0 || split.row > p.slices.tk || !Aligned16(split.k2) ||
              !Aligned16(split.v2) || !Aligned16(split.dk2) || !Aligned16(split.dv2)))
    return cudaErrorNotSupported;
  BwdSm90Params sp{};
  const int tq = p.slices.tq, tk = two ? int(split.row) : p.slices.tk, tk2 = p.slices.tk - tk;
  if (!EncodeMap<T>(encode, &sp.q_map, p.q, tq, p.hq, D, Tile::kBlockM) ||
      !EncodeMap<T>(encode, &sp.do_map, p.dout, tq, p.hq, D, Tile::kBlockM))
    return cudaErrorNotSupported;
  // The first source's maps; none when every key is the second source's (a staged distributed backward's
  // stage call: no CTA reads them).
  if (first && (!EncodeMap<T>(encode, &sp.k_map, p.k, tk, p.hkv, D, Tile::kBlockN) ||
                 !EncodeMap<T>(encode, &sp.v_map, p.v, tk, p.hkv, D, Tile::kBlockN) ||
                 !EncodeMap<T>(encode, &sp.dk_map, p.dk, tk, p.hkv, D, Tile::kKeysPerWarpgroup) ||
                 !EncodeMap<T>(encode, &sp.dv_map, p.dv, tk, p.hkv, D, Tile::kKeysPerWarpgroup)))
    return cudaErrorNotSupported;
  sp.split_row = INT_MAX;
  if (two && tk2 > 0) {
    const int rh = split.row_heads;  // K and V packed side by side: a row stride of 2 Hkv heads
    if (!EncodeMap<T>(encode, &sp.k2_map, split.k2, tk2, p.hkv, D, Tile::kBlockN, rh) ||
        !EncodeMap<T>(encode, &sp.v2_map, split.v2, tk2, p.hkv, D, Tile::kBlockN, rh) ||
        !EncodeMap<T>(encode, &sp.dk2_map, split.dk2, tk2, p.hkv, D, Tile::kKeysPerWarpgroup, rh) ||
        !EncodeMap<T>(encode, &sp.dv2_map, split.dv2, tk2, p.hkv, D, Tile::kKeysPerWarpgroup, rh))
      return cudaErrorNotSupported;
    sp.split_row = tk;
  }
  if (reduce_dq && (!Aligned16(p.dq_accum) || !EncodeDqAccumMap(encode, &sp.dq_map, p.dq_accum, tq, p.hq, D,
                                                                 Tile::kDqBoxCols, Tile::kBlockM)))
    return cudaErrorNotSupported;
  sp.base = p;
  auto kernel = reduce_dq ? FlashBwdSm90Kernel<T, D, true> : FlashBwdSm90Kernel<T, D, false>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      err != cudaSuccess)
    return err;
  kernel<<<dim3(num_blocks, p.hkv), Tile::kThreads, Tile::kSmemBytes, stream>>>(sp);
  return cudaGetLastError();
}

template cudaError_t LaunchBwdDkDvSm90<__nv_bfloat16, 64>(const BwdParams&, bool, cudaStream_t, const KeySplit&);
template cudaError_t LaunchBwdDkDvSm90<__nv_bfloat16, 128>(const BwdParams&, bool, cudaStream_t, const KeySplit&);
template cudaError_t LaunchBwdDkDvSm90<__half, 64>(const BwdParams&, bool, cudaStream_t, const KeySplit&);
template cudaError_t LaunchBwdDkDvSm90<__half, 128>(const BwdParams&, bool, cudaStream_t, const KeySplit&);
template cudaError_t LaunchBwdDkDvSm90<__nv_bfloat16, 256>(const BwdParams&, bool, cudaStream_t, const KeySplit&);
template cudaError_t LaunchBwdDkDvSm90<__half, 256>(const BwdParams&, bool, cudaStream_t, const KeySplit&);

}  // namespace magi_jax::cuda
