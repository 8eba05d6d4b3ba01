// Host-side launchers: grids, shared memory, template instantiation (one .cu per kernel family).
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace magi_jax::cuda {

template <typename T, int D>
cudaError_t LaunchFwd(const FwdParams& p, cudaStream_t stream);

// delta = rowsum(dout * out) - dlse over [Tq, Hq].
template <typename T, int D>
cudaError_t LaunchBwdDelta(const BwdParams& p, cudaStream_t stream);

template <typename T, int D>
cudaError_t LaunchBwdDkDv(const BwdParams& p, bool atomic_dq, cudaStream_t stream);

template <typename T, int D>
cudaError_t LaunchBwdDq(const BwdParams& p, cudaStream_t stream);

template <typename T>
cudaError_t LaunchDqConvert(const float* acc, T* dq, int64_t n, cudaStream_t stream);

}  // namespace magi_jax::cuda
