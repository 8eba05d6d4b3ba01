// The sm90 backward's dK/dV launcher (flash_bwd_sm90_kernel.h): tensor maps built on the host from device
// pointers and static shapes (no synchronisation), a grid of (k blocks, kv heads), the instantiations
// (bf16, fp16) x (D 64, 128) x (atomic dQ or not).
#include "flash_bwd_sm90_kernel.h"
#include "launch.h"
#include "tma_map.h"

namespace magi_jax::cuda {

template <typename T, int D>
cudaError_t LaunchBwdDkDvSm90(const BwdParams& p, bool atomic_dq, cudaStream_t stream) {
  using Tile = BwdSm90Tile<D>;
  const int num_blocks = NumBlocks(p.slices.tk, Tile::kBlockN);
  if (num_blocks == 0 || p.hkv == 0) return cudaSuccess;
  // What TMA needs; anything else is left to the mma.sync kernel (nothing has been enqueued yet).
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr || p.slices.tq == 0 || !Aligned16(p.q) || !Aligned16(p.k) || !Aligned16(p.v) ||
      !Aligned16(p.dout) || !Aligned16(p.dk) || !Aligned16(p.dv))
    return cudaErrorNotSupported;
  BwdSm90Params sp{};
  const int tq = p.slices.tq, tk = p.slices.tk;
  if (!EncodeMap<T>(encode, &sp.q_map, p.q, tq, p.hq, D, Tile::kBlockM) ||
      !EncodeMap<T>(encode, &sp.do_map, p.dout, tq, p.hq, D, Tile::kBlockM) ||
      !EncodeMap<T>(encode, &sp.k_map, p.k, tk, p.hkv, D, Tile::kBlockN) ||
      !EncodeMap<T>(encode, &sp.v_map, p.v, tk, p.hkv, D, Tile::kBlockN) ||
      !EncodeMap<T>(encode, &sp.dk_map, p.dk, tk, p.hkv, D, Tile::kKeysPerWarpgroup) ||
      !EncodeMap<T>(encode, &sp.dv_map, p.dv, tk, p.hkv, D, Tile::kKeysPerWarpgroup))
    return cudaErrorNotSupported;
  sp.base = p;
  auto kernel = atomic_dq ? FlashBwdSm90Kernel<T, D, true> : FlashBwdSm90Kernel<T, D, false>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      err != cudaSuccess)
    return err;
  kernel<<<dim3(num_blocks, p.hkv), Tile::kThreads, Tile::kSmemBytes, stream>>>(sp);
  return cudaGetLastError();
}

template cudaError_t LaunchBwdDkDvSm90<__nv_bfloat16, 64>(const BwdParams&, bool, cudaStream_t);
template cudaError_t LaunchBwdDkDvSm90<__nv_bfloat16, 128>(const BwdParams&, bool, cudaStream_t);
template cudaError_t LaunchBwdDkDvSm90<__half, 64>(const BwdParams&, bool, cudaStream_t);
template cudaError_t LaunchBwdDkDvSm90<__half, 128>(const BwdParams&, bool, cudaStream_t);

}  // namespace magi_jax::cuda
