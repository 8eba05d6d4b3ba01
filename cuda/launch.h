// Host-side launchers: grids, shared memory, template instantiation (one .cu per kernel family).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "block_lists.h"
#include "params.h"

namespace magi_jax::cuda {

// The current device's SM count: the strided grids (backward preprocess, dQ convert, range ops) size
// themselves by it.
inline cudaError_t CurrentDeviceSms(int* sms) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

// The strided grid of the memory-bound kernels (flash_bwd_preprocess.h, the max_logit fill): ~60 registers a
// thread, so 4 CTAs of 256 threads per SM at once; never more CTAs than there are iterations.
inline cudaError_t StridedGrid(int64_t iterations, unsigned* grid) {
  int sms = 0;
  if (cudaError_t err = CurrentDeviceSms(&sms); err != cudaSuccess) return err;
  *grid = unsigned(std::min<int64_t>(iterations, int64_t(sms) * 4));
  return cudaSuccess;
}

// Whether environment variable `name` is set to `value`: the launchers' measuring switches, read at every
// call so that one process can time both settings side by side (bench/kernel.py).
inline bool EnvEquals(const char* name, const char* value) {
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, value) == 0;
}

// What a launch follows on the stream. kAnything (a copy, a memset, an event wait, another library's kernel):
// a plain launch, which starts once all of it is done. kOurKernel: a kernel of this library, launched plainly
// or itself chained (and so done only after all before it): the launch is a programmatic dependent of it
// (ptx.h WaitPriorGrid, which the kernel must call before it reads what came before), so that its launch
// latency passes under that kernel. Only right after a kernel: a chained launch is not held back by a copy
// or an event wait between.
enum class Follows { kAnything, kOurKernel };

// kernel<<<grid, block, smem, stream>>>(args...), chained where it follows one of our kernels. MAGI_JAX_PDL=0
// launches everything plainly (bench/kernel.py column ffa@MAGI_JAX_PDL=0).
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         Follows follows, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attr;
  config.numAttrs = follows == Follows::kOurKernel && !EnvEquals("MAGI_JAX_PDL", "0") ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename T, int D>
cudaError_t LaunchFwd(const FwdParams& p, cudaStream_t stream);

// x[0, n) = -inf (launched plainly): a merging forward's max_logit before the kernel writes the rows it visits.
cudaError_t LaunchFillNegInf(float* x, int64_t n, cudaStream_t stream);

// delta = rowsum(dout * out) - dlse over [Tq, Hq].
template <typename T, int D>
cudaError_t LaunchBwdDelta(const BwdParams& p, cudaStream_t stream);

template <typename T, int D>
cudaError_t LaunchBwdDkDv(const BwdParams& p, bool atomic_dq, cudaStream_t stream);

template <typename T, int D>
cudaError_t LaunchBwdDq(const BwdParams& p, cudaStream_t stream);

// The sm90 forward (TMA + wgmma, warp-specialised, persistent longest-first; launch_fwd_sm90.cu). It builds
// p.lists itself into `lists` (LaunchFwd needs them built: BuildBlockLists). scratch: FwdSm90ScratchInts(tq)
// int32 of device memory. Returns cudaErrorNotSupported, having enqueued nothing, when the inputs do not suit
// TMA (unaligned pointers, no keys, no tensor-map entry point): the caller then runs LaunchFwd. D 256
// (instantiated here only: LaunchFwd has no D 256) takes inputs without keys too. Dv: v's and out's head dim
// (192 with 128 besides Dv = D; the handlers' dispatch).
int64_t FwdSm90ScratchInts(int64_t tq);
template <typename T, int D, int Dv = D>
cudaError_t LaunchFwdSm90(const FwdParams& p, const ListBuffers& lists, int32_t* scratch, cudaStream_t stream);

// The sm90 dK/dV kernel (TMA + wgmma, warp-specialised; launch_bwd_sm90.cu), with dQ added into p.dq_accum
// by TMA reduce-adds when reduce_dq (else dq comes from LaunchBwdDq). Returns cudaErrorNotSupported, having
// enqueued nothing, when the inputs do not suit TMA: the caller then runs LaunchBwdDkDv. `split`: a second
// key source (KeySplit); its row must be a multiple of the kernel's keys per CTA (BwdSm90Tile<D>::kBlockN:
// 128, 64 at D 256), else cudaErrorNotSupported. scratch: BwdSm90ScratchInts(tk, hq) int32 of device memory
// (the CTAs' longest-first tile order; a tile per q head in the GQA split). With p.dk_accum, p.dv_accum
// given, the GQA split (below), which must apply to the call (else cudaErrorInvalidValue): dK, dV are added
// into them, not written to p.dk, p.dv.
// Dv: v's, dout's and dv's head dim (192 with 128 besides Dv = D: dQ by reduce-adds, no GQA split, a second
// key source only packed, else cudaErrorInvalidValue).
int64_t BwdSm90ScratchInts(int64_t tk, int64_t hq);
template <typename T, int D, int Dv = D>
cudaError_t LaunchBwdDkDvSm90(const BwdParams& p, bool reduce_dq, int32_t* scratch, cudaStream_t stream,
                              const KeySplit& split = KeySplit{});

// Whether the sm90 dK/dV kernel's GQA split applies (flash_bwd_sm90_kernel.h kGqaSplit: a CTA per (k block,
// q head), its dK, dV reduce-added into fp32 accumulators laid out as the key source's gradients
// (BwdParams::dk_accum) that the caller zeroes before the launch and converts after, LaunchDqConvert): head dim
// 128, dQ by reduce-adds, one key source holding every key (the first, or the second: a staged distributed
// backward's stage call), more q heads than kv heads, and either fewer (k block, kv head) tiles than the
// device's SMs (a CTA per kv head leaves SMs idle) or, for groups of 4 or more, a group's Q and dO (tq rows of
// `group` q heads) over an L2 section's budget (tile_order.h L2SectionBudget), where the sections of kv heads keep
// no kv head's walk in L2.
// MAGI_JAX_SM90_BWD_GQA_SPLIT=1 takes it wherever it can run, =0 never. Read by the handler (to carve the
// accumulators) and checked by the launcher, at every call.
cudaError_t BwdSm90GqaSplit(int d, int elem_bytes, int64_t tq, int64_t tk, int64_t hq, int64_t hkv, bool reduce_dq,
                            bool two_sources, bool* split);

template <typename T>
cudaError_t LaunchDqConvert(const float* acc, T* dq, int64_t n, cudaStream_t stream);

}  // namespace magi_jax::cuda
