// Backward launchers and their instantiations (bf16, fp16) x (D 64, 128); delta also for D 96, 192 and 256.
#include "flash_bwd_dkdv_kernel.h"
#include "flash_bwd_dq_kernel.h"
#include "flash_bwd_preprocess.h"
#include "launch.h"

namespace magi_jax::cuda {

template <typename T, int D>
cudaError_t LaunchBwdDelta(const BwdParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.slices.tq) * p.hq;
  if (rows == 0) return cudaSuccess;
  constexpr int kRowsPerIter = kElementwiseThreads / kDeltaLanes<D> * kDeltaUnroll;
  unsigned grid = 0;
  if (cudaError_t err = StridedGrid((rows + kRowsPerIter - 1) / kRowsPerIter, &grid); err != cudaSuccess) return err;
  BwdDeltaKernel<T, D><<<grid, kElementwiseThreads, 0, stream>>>(
      static_cast<const T*>(p.out), static_cast<const T*>(p.dout), p.dlse, p.delta, rows);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t LaunchBwdDkDv(const BwdParams& p, bool atomic_dq, cudaStream_t stream) {
  using Tile = BwdKvTile<D>;
  const int num_blocks = NumBlocks(p.slices.tk, Tile::kBlockN);
  if (num_blocks == 0 || p.hkv == 0) return cudaSuccess;
  auto kernel = atomic_dq ? FlashBwdDkDvKernel<T, D, true> : FlashBwdDkDvKernel<T, D, false>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      err != cudaSuccess)
    return err;
  kernel<<<dim3(num_blocks, p.hkv), Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t LaunchBwdDq(const BwdParams& p, cudaStream_t stream) {
  using Tile = BwdQTile<D>;
  const int num_blocks = NumBlocks(p.slices.tq, Tile::kBlockM);
  if (num_blocks == 0 || p.hq == 0) return cudaSuccess;
  auto kernel = FlashBwdDqKernel<T, D>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      err != cudaSuccess)
    return err;
  kernel<<<dim3(num_blocks, p.hq), Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchDqConvert(const float* acc, T* dq, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t per_iter = int64_t(kElementwiseThreads) * 8 * kDeltaUnroll;
  unsigned grid = 0;
  if (cudaError_t err = StridedGrid((n + per_iter - 1) / per_iter, &grid); err != cudaSuccess) return err;
  // Right after the dK/dV kernel.
  return LaunchKernel(DqConvertKernel<T>, grid, kElementwiseThreads, 0, stream, Follows::kOurKernel, acc, dq, n);
}

#define MAGI_INSTANTIATE_BWD(T, D)                                                      \
  template cudaError_t LaunchBwdDelta<T, D>(const BwdParams&, cudaStream_t);          \
  template cudaError_t LaunchBwdDkDv<T, D>(const BwdParams&, bool, cudaStream_t);     \
  template cudaError_t LaunchBwdDq<T, D>(const BwdParams&, cudaStream_t);
MAGI_INSTANTIATE_BWD(__nv_bfloat16, 64)
MAGI_INSTANTIATE_BWD(__nv_bfloat16, 128)
MAGI_INSTANTIATE_BWD(__half, 64)
MAGI_INSTANTIATE_BWD(__half, 128)
// Head dims 96, 192 and 256: delta only (their dK/dV and dQ come from the sm90 kernel, launch_bwd_sm90.cu).
template cudaError_t LaunchBwdDelta<__nv_bfloat16, 96>(const BwdParams&, cudaStream_t);
template cudaError_t LaunchBwdDelta<__half, 96>(const BwdParams&, cudaStream_t);
template cudaError_t LaunchBwdDelta<__nv_bfloat16, 192>(const BwdParams&, cudaStream_t);
template cudaError_t LaunchBwdDelta<__half, 192>(const BwdParams&, cudaStream_t);
template cudaError_t LaunchBwdDelta<__nv_bfloat16, 256>(const BwdParams&, cudaStream_t);
template cudaError_t LaunchBwdDelta<__half, 256>(const BwdParams&, cudaStream_t);
template cudaError_t LaunchDqConvert<__nv_bfloat16>(const float*, __nv_bfloat16*, int64_t, cudaStream_t);
template cudaError_t LaunchDqConvert<__half>(const float*, __half*, int64_t, cudaStream_t);

}  // namespace magi_jax::cuda
