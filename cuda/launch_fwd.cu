// Forward launcher and its instantiations (bf16, fp16) x (D 64, 128); the -inf fill of max_logit.
#include "flash_fwd_kernel.h"
#include "launch.h"

namespace magi_jax::cuda {

template <typename T, int D>
cudaError_t LaunchFwd(const FwdParams& p, cudaStream_t stream) {
  using Tile = FwdTile<D>;
  const int num_blocks = NumBlocks(p.slices.tq, Tile::kBlockM);
  if (num_blocks == 0 || p.hq == 0) return cudaSuccess;
  auto kernel = FlashFwdKernel<T, D>;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      err != cudaSuccess)
    return err;
  kernel<<<dim3(num_blocks, p.hq), Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

__global__ void FillNegInfKernel(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = -INFINITY;
}

cudaError_t LaunchFillNegInf(float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  unsigned grid = 0;
  if (cudaError_t err = StridedGrid((n + kThreads - 1) / kThreads, &grid); err != cudaSuccess) return err;
  FillNegInfKernel<<<grid, kThreads, 0, stream>>>(x, n);
  return cudaGetLastError();
}

template cudaError_t LaunchFwd<__nv_bfloat16, 64>(const FwdParams&, cudaStream_t);
template cudaError_t LaunchFwd<__nv_bfloat16, 128>(const FwdParams&, cudaStream_t);
template cudaError_t LaunchFwd<__half, 64>(const FwdParams&, cudaStream_t);
template cudaError_t LaunchFwd<__half, 128>(const FwdParams&, cudaStream_t);

}  // namespace magi_jax::cuda
