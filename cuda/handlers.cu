// CUDA handlers of the FFA custom calls (interface: ffi/ffa_interface.h), exported as MagiFfaFwdCuda and
// MagiFfaBwdCuda and registered by magi_jax/_ffi.py for platform "CUDA".
//
// Each handler checks shapes, takes its temporaries (slice lists, delta, the fp32 dq accumulator, the GQA
// split's dk / dv accumulators) from the FFI scratch allocator, and enqueues kernels on the XLA stream; it
// never synchronises with the host.
// Not marked command-buffer compatible: scratch allocation inside a handler is outside that contract
// (api.h, Traits::kCmdBufferCompatible); passing the temporaries as extra results would qualify it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "block_lists.h"
#include "ffa_interface.h"
#include "launch.h"
#include "tile_size.h"

namespace magi_jax::cuda {
namespace {

ffi::Error CudaFailure(const char* what, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("magi_jax CUDA ") + what + ": " + cudaGetErrorString(err));
}

// Calls fn(T{}, std::integral_constant<int, D>{}) for the supported element types and head dims.
template <typename Fn>
ffi::Error DispatchTypeAndDim(ffi::DataType dtype, int64_t d, Fn&& fn) {
  auto by_dim = [&](auto tag) -> ffi::Error {
    switch (d) {
      case 64: return fn(tag, std::integral_constant<int, 64>{});
      case 96: return fn(tag, std::integral_constant<int, 96>{});
      case 128: return fn(tag, std::integral_constant<int, 128>{});
      case 192: return fn(tag, std::integral_constant<int, 192>{});
      case 256: return fn(tag, std::integral_constant<int, 256>{});
      default:
        return ffi::Error::InvalidArgument("q: head_dim " + std::to_string(d) +
                                           " is not supported by the CUDA kernels (64, 96, 128, 192 or 256)");
    }
  };
  switch (dtype) {
    case ffi::BF16: return by_dim(__nv_bfloat16{});
    case ffi::F16: return by_dim(__half{});
    default: return ffi::Error::InvalidArgument("q, k, v: the CUDA kernels take bfloat16 or float16");
  }
}

// DispatchTypeAndDim's refusal alone, before any allocation or kernel.
ffi::Error CheckTypeAndDim(ffi::DataType dtype, int64_t d) {
  return DispatchTypeAndDim(dtype, d, [](auto, auto) { return ffi::Error::Success(); });
}

// Hands out aligned pieces of one scratch allocation.
class Carver {
 public:
  static constexpr size_t kAlign = 256;
  static size_t Round(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
  // XLA's scratch allocator accepts alignments up to 16 bytes: ask for kAlign more and align here.
  static std::optional<Carver> Allocate(ffi::ScratchAllocator& scratch, size_t bytes) {
    auto mem = scratch.Allocate(bytes + kAlign, 16);
    if (!mem.has_value()) return std::nullopt;
    const uintptr_t p = reinterpret_cast<uintptr_t>(*mem);
    return Carver(reinterpret_cast<void*>((p + kAlign - 1) / kAlign * kAlign));
  }
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* Take(size_t count) {
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += Round(count * sizeof(T));
    return p;
  }

 private:
  char* base_;
  size_t used_ = 0;
};

struct ListSizes {
  int64_t num_blocks, capacity;
  size_t Bytes() const {
    return Carver::Round((num_blocks + 1) * 8) + Carver::Round(capacity * 4) + Carver::Round(num_blocks * 4);
  }
};

// Whether the sm90 kernels (TMA + wgmma forward and dK/dV, launch_{fwd,bwd}_sm90.cu) run: by default, and
// always where they are the only ones (sm90_only: head dims 96, 192, 256); MAGI_JAX_FFA_KERNEL=mma selects
// the mma.sync ones (also the fallback where the sm90 launch declines an input). Read at every call (a
// getenv), like the capacity below, so that one process can compare both (bench/kernel.py) and tests can
// switch it; an unknown value is an error, not a silent default.
ffi::ErrorOr<bool> UseSm90(bool sm90_only) {
  const char* env = std::getenv("MAGI_JAX_FFA_KERNEL");
  const std::string name = env == nullptr ? "" : env;
  if (name.empty() || name == "sm90") return true;
  if (name == "mma") return sm90_only;
  return ffi::Error::InvalidArgument("MAGI_JAX_FFA_KERNEL: '" + name + "' is not a kernel (sm90 or mma)");
}

// Head dims 96, 192 and 256 have one CUDA forward and one backward each, the sm90 ones (TMA + wgmma; the
// mma.sync kernels have no tiles for them: HasMmaKernels), so they take them whatever MAGI_JAX_FFA_KERNEL says,
// on an sm_90 GPU (the only target this library is built for); anything else gets a clear error before any
// kernel runs. Their backward is the dK/dV kernel with dQ by TMA reduce-add: deterministic=False only.
ffi::Error CheckSm90ForHeadDim(int64_t d) {
  int device = 0, major = 0, minor = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return CudaFailure("device", err);
  if (cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      err != cudaSuccess)
    return CudaFailure("device", err);
  if (cudaError_t err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
      err != cudaSuccess)
    return CudaFailure("device", err);
  if (major != 9 || minor != 0)
    return ffi::Error::InvalidArgument("q: head_dim " + std::to_string(d) +
                                       " needs an sm_90 (Hopper) GPU on CUDA, got sm_" +
                                       std::to_string(major * 10 + minor));
  return ffi::Error::Success();
}

// MAGI_JAX_CUDA_LIST_CAPACITY caps the ids buffer (tests use 0 to exercise the kernels' scan path).
ListSizes SizeLists(int64_t length, int block, int64_t num_slices) {
  const int64_t nb = (length + block - 1) / block;
  int64_t capacity = ListCapacity(num_slices, nb);
  if (const char* env = std::getenv("MAGI_JAX_CUDA_LIST_CAPACITY"); env != nullptr && *env != '\0')
    capacity = std::max<int64_t>(1, std::min<int64_t>(capacity, std::atoll(env)));
  return {nb, capacity};
}

ListBuffers TakeLists(Carver& carver, const ListSizes& sizes, int axis, int block) {
  int64_t* offsets = carver.Take<int64_t>(sizes.num_blocks + 1);
  int32_t* ids = carver.Take<int32_t>(sizes.capacity);
  int32_t* counts = carver.Take<int32_t>(sizes.num_blocks);
  return {offsets, ids, counts, sizes.capacity, axis, block};
}

// The kernels index tokens with int; positions up to 2^31 - 2^16 leave room for a block past the end.
ffi::Error CheckSizes(const FfaDims& dims) {
  constexpr int64_t kMaxTokens = (int64_t(1) << 31) - (int64_t(1) << 16);
  if (dims.tq > kMaxTokens || dims.tk > kMaxTokens || dims.num_slices > kMaxTokens)
    return ffi::Error::InvalidArgument("q, k: more than 2^31 - 2^16 tokens or slices");
  return ffi::Error::Success();
}

// An input the Python wrapper aliases to an output (updated in place): copied over only if XLA did not alias it.
cudaError_t CopyUnlessAliased(void* out, const void* in, size_t bytes, cudaStream_t stream) {
  return out == in ? cudaSuccess : cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream);
}

// rows x heads x width bytes of [rows, heads, ...] tensors whose heads are pitch bytes apart and rows row_heads
// heads apart (a second key source's rows, packed or not, to and from their concatenation with the first's).
cudaError_t CopyHeads(void* dst, size_t dst_pitch, size_t dst_row_heads, const void* src, size_t src_pitch,
                      size_t src_row_heads, size_t width, size_t heads, size_t rows, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cudaMemcpy3DParms copy{};
  copy.srcPtr = make_cudaPitchedPtr(const_cast<void*>(src), src_pitch, width, src_row_heads);
  copy.dstPtr = make_cudaPitchedPtr(dst, dst_pitch, width, dst_row_heads);
  copy.extent = make_cudaExtent(width, heads, rows);
  copy.kind = cudaMemcpyDeviceToDevice;
  return cudaMemcpy3DAsync(&copy, stream);
}

SliceArgs MakeSliceArgs(const FfaDims& dims, const ffi::Buffer<ffi::S32>& q_ranges,
                        const ffi::Buffer<ffi::S32>& k_ranges, const ffi::Buffer<ffi::S32>& types) {
  return {q_ranges.typed_data(), k_ranges.typed_data(), types.typed_data(), int(dims.num_slices), int(dims.tq),
          int(dims.tk)};
}

ffi::Error FfaFwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::S32> q_ranges, ffi::Buffer<ffi::S32> k_ranges,
                      ffi::Buffer<ffi::S32> types, ffi::AnyBuffer out_prev, ffi::AnyBuffer lse_prev,
                      float softmax_scale, float softcap, int32_t sm_margin, bool kv_packed,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                      ffi::Result<ffi::Buffer<ffi::F32>> max_logit) {
  auto dims = CheckFfaInputs(q, k, v, q_ranges, k_ranges, types, kv_packed);
  if (dims.has_error()) return dims.error();
  if (kv_packed) dims->dv = PackedVHeadDim(*out, dims->d);
  if (auto err = CheckForwardOut(*out, q, dims->dv); err.failure()) return err;
  if (auto err = CheckSizes(*dims); err.failure()) return err;
  if (sm_margin < 0) return ffi::Error::InvalidArgument("sm_margin: must be >= 0");
  auto merge = CheckMergeInputs(*out, out_prev, lse_prev);
  if (merge.has_error()) return merge.error();
  auto wants_max = CheckMaxLogitOut(*max_logit, q);
  if (wants_max.has_error()) return wants_max.error();

  if (auto err = CheckTypeAndDim(q.element_type(), dims->d); err.failure()) return err;
  // v of its own head dim: MLA's q / k 192 with v 128 (FwdSm90Tile's Dv); any other pair is padded by the caller.
  const bool v_apart = dims->dv != dims->d;
  if (v_apart && !(dims->d == 192 && dims->dv == 128))
    return ffi::Error::InvalidArgument("v: head_dim " + std::to_string(dims->dv) + " differs from q's " +
                                       std::to_string(dims->d) + "; the CUDA forward takes v at q's head dim, or "
                                       "192 with 128");
  const bool sm90_only = !HasMmaKernels(int(dims->d));
  if (sm90_only) {
    if (auto err = CheckSm90ForHeadDim(dims->d); err.failure()) return err;
  }

  const SliceArgs args = MakeSliceArgs(*dims, q_ranges, k_ranges, types);
  const ListSizes q_sizes = SizeLists(dims->tq, kQBlock, dims->num_slices);
  const auto use_sm90 = UseSm90(sm90_only);
  if (use_sm90.has_error()) return use_sm90.error();
  const bool sm90 = *use_sm90;
  const size_t sm90_bytes = sm90 ? Carver::Round(FwdSm90ScratchInts(dims->tq) * 4) : 0;
  auto carver_or = Carver::Allocate(scratch, q_sizes.Bytes() + sm90_bytes);
  if (!carver_or.has_value())
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "magi_jax: no scratch memory for the slice lists");
  Carver& carver = *carver_or;
  FwdParams p{};
  const ListBuffers q_lists = TakeLists(carver, q_sizes, kAxisQ, kQBlock);
  p.lists = q_lists.View();
  int32_t* sm90_scratch = sm90 ? carver.Take<int32_t>(FwdSm90ScratchInts(dims->tq)) : nullptr;

  p.q = q.untyped_data();
  p.k = k.untyped_data();
  // Packed: V is the second half of each row of k.
  p.v = kv_packed ? static_cast<const char*>(p.k) + dims->hkv * dims->d * ffi::ByteWidth(k.element_type())
                  : v.untyped_data();
  p.kv_row_heads = int(kv_packed ? 2 * dims->hkv : dims->hkv);
  p.v_head_pitch = int(kv_packed ? dims->d : dims->dv);
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.slices = args;
  p.hq = int(dims->hq);
  p.hkv = int(dims->hkv);
  p.scale = softmax_scale;
  p.softcap = softcap;
  p.sm_margin = sm_margin;
  // Merged in place: the kernels read out_prev, lse_prev from out, lse.
  if (*merge) {
    if (cudaError_t err = CopyUnlessAliased(out->untyped_data(), out_prev.untyped_data(), out->size_bytes(), stream);
        err != cudaSuccess)
      return CudaFailure("out_prev", err);
    if (cudaError_t err = CopyUnlessAliased(lse->untyped_data(), lse_prev.untyped_data(), lse->size_bytes(), stream);
        err != cudaSuccess)
      return CudaFailure("lse_prev", err);
    p.out_prev = out->untyped_data();
    p.lse_prev = lse->typed_data();
  }
  if (*wants_max) {
    p.max_logit = max_logit->typed_data();
    // A merging sm90 call does not visit the q blocks without keys in it: their rows are -inf from here.
    if (*merge)
      if (cudaError_t err = LaunchFillNegInf(p.max_logit, max_logit->element_count(), stream); err != cudaSuccess)
        return CudaFailure("max_logit", err);
  }
  return DispatchTypeAndDim(q.element_type(), dims->d, [&](auto tag, auto dim) -> ffi::Error {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    if constexpr (!HasMmaKernels(D)) {
      // No mma.sync fallback: inputs TMA cannot take (a pointer not 16-byte aligned, no tensor-map entry
      // point in the driver) are an error.
      cudaError_t err = cudaErrorNotSupported;
      if constexpr (D == 192)
        err = v_apart ? LaunchFwdSm90<T, 192, 128>(p, q_lists, sm90_scratch, stream)
                      : LaunchFwdSm90<T, D>(p, q_lists, sm90_scratch, stream);
      else
        err = LaunchFwdSm90<T, D>(p, q_lists, sm90_scratch, stream);
      if (err == cudaErrorNotSupported)
        return ffi::Error::InvalidArgument(
            "q: head_dim " + std::to_string(D) + " runs on the sm90 (TMA) forward only, which needs q, k, v "
            "and out 16-byte aligned and a driver with cuTensorMapEncodeTiled");
      if (err != cudaSuccess) return CudaFailure("forward (sm90)", err);
      return ffi::Error::Success();
    } else {
      if (sm90) {
        // cudaErrorNotSupported: nothing enqueued, the inputs do not suit TMA; the mma.sync kernel runs.
        const cudaError_t err = LaunchFwdSm90<T, D>(p, q_lists, sm90_scratch, stream);
        if (err == cudaSuccess) return ffi::Error::Success();
        if (err != cudaErrorNotSupported) return CudaFailure("forward (sm90)", err);
      }
      // The sm90 launcher builds the lists itself (its fill also takes each q block's work); here, for the
      // mma.sync kernel.
      if (cudaError_t err = BuildBlockLists(args, q_lists, stream); err != cudaSuccess)
        return CudaFailure("slice lists", err);
      if (cudaError_t err = LaunchFwd<T, D>(p, stream); err != cudaSuccess) return CudaFailure("forward", err);
      return ffi::Error::Success();
    }
  });
}

ffi::Error FfaBwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse,
                      ffi::Buffer<ffi::F32> dlse, ffi::Buffer<ffi::S32> q_ranges, ffi::Buffer<ffi::S32> k_ranges,
                      ffi::Buffer<ffi::S32> types, ffi::AnyBuffer k2, ffi::AnyBuffer v2, ffi::AnyBuffer dq_in,
                      ffi::AnyBuffer delta_in, float softmax_scale, float softcap, bool deterministic, bool dq_f32,
                      bool kv2_packed,
                      ffi::Result<ffi::AnyBuffer> dq,
                      ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                      ffi::Result<ffi::AnyBuffer> dk2, ffi::Result<ffi::AnyBuffer> dv2) {
  auto dims = CheckFfaInputs(q, k, v, q_ranges, k_ranges, types);
  if (dims.has_error()) return dims.error();
  if (auto err = CheckForwardOut(out, q, dims->dv); err.failure()) return err;
  if (auto err = CheckSameShape("dout", dout, out); err.failure()) return err;
  auto has_dq_in = CheckDqChain(q, dq_in, *dq, dq_f32, deterministic);
  if (has_dq_in.has_error()) return has_dq_in.error();
  auto has_delta = CheckDeltaIn(q, delta_in);
  if (has_delta.has_error()) return has_delta.error();
  if (auto err = CheckSameShape("dk", *dk, k); err.failure()) return err;
  if (auto err = CheckSameShape("dv", *dv, v); err.failure()) return err;
  auto tk2 = CheckSecondKeys(k, k2, v2, *dk2, *dv2, kv2_packed);
  if (tk2.has_error()) return tk2.error();
  // v of its own head dim: MLA's 192 / 128 on the sm90 kernel (BwdSm90Tile's Dv); a second key source then
  // packed (its V heads D wide, V their first Dv columns).
  const bool v_apart = dims->dv != dims->d;
  if (v_apart && (!(dims->d == 192 && dims->dv == 128) || (*tk2 > 0 && !kv2_packed)))
    return ffi::Error::InvalidArgument("v: head_dim " + std::to_string(dims->dv) + " differs from q's " +
                                       std::to_string(dims->d) + "; the CUDA backward takes v at q's head dim, or "
                                       "192 with 128 and a second key source only packed");
  const int64_t tk1 = dims->tk;
  dims->tk += *tk2;  // the kernels' key space: concat(k, k2)
  if (auto err = CheckSizes(*dims); err.failure()) return err;
  // Head dims 96, 192 and 256: the sm90 dK/dV kernel (at 192 the warpgroups take roles, at 256 they split D)
  // with dQ by TMA reduce-add, whatever MAGI_JAX_FFA_KERNEL says; checked before any allocation or kernel.
  // deterministic=True has no kernel for them: the mma.sync dq kernel's tiles are sized for 64 and 128
  // (magi_jax pads 96 to 128).
  if (auto err = CheckTypeAndDim(q.element_type(), dims->d); err.failure()) return err;
  const bool sm90_only = !HasMmaKernels(int(dims->d));
  if (sm90_only) {
    if (auto err = CheckSm90ForHeadDim(dims->d); err.failure()) return err;
    if (deterministic)
      return ffi::Error::InvalidArgument(
          "q: head_dim " + std::to_string(dims->d) + " has no deterministic CUDA backward (deterministic=True "
          "runs head dims 64 and 128 on the GPU, and 96 padded to 128; deterministic=False runs any)");
  }

  const SliceArgs args = MakeSliceArgs(*dims, q_ranges, k_ranges, types);
  const auto use_sm90 = UseSm90(sm90_only);
  if (use_sm90.has_error()) return use_sm90.error();
  const bool sm90 = *use_sm90;
  const int64_t rows = dims->tq * dims->hq;
  const ListSizes k_sizes = SizeLists(dims->tk, kKBlock, dims->num_slices);
  const ListSizes q_sizes = deterministic ? SizeLists(dims->tq, kQBlock, dims->num_slices) : ListSizes{0, 0};
  const size_t accum_elems = deterministic ? 0 : size_t(rows) * size_t(dims->d);
  // Chained (dq_f32): the accumulator is dq itself, holding dq_in at the start; else scratch, from zero.
  const int64_t order_ints = sm90 ? BwdSm90ScratchInts(dims->tk, dims->hq) : 0;
  // The sm90 kernel's GQA split (launch.h BwdSm90GqaSplit): dk, dv (of the sole key source: k, or k2 for a
  // staged distributed backward's stage call) summed over a CTA per q head in fp32 accumulators, zeroed
  // before the kernel and converted after (convert_kv_accum below).
  bool gqa_split = false;
  if (sm90) {
    if (cudaError_t err = BwdSm90GqaSplit(int(dims->d), int(ffi::ByteWidth(q.element_type())), dims->tq, dims->tk,
                                          dims->hq, dims->hkv, /*reduce_dq=*/!deterministic,
                                          /*two_sources=*/tk1 > 0 && *tk2 > 0, &gqa_split);
        err != cudaSuccess)
      return CudaFailure("dk/dv (sm90) GQA split", err);
  }
  size_t kv_accum_elems = gqa_split ? size_t(dims->tk) * size_t(dims->hkv) * size_t(dims->d) : 0;
  const size_t bytes = Carver::Round(rows * 4) + k_sizes.Bytes() + (deterministic ? q_sizes.Bytes() : 0) +
                       (dq_f32 ? 0 : Carver::Round(accum_elems * 4)) + Carver::Round(order_ints * 4);
  auto carver_or = Carver::Allocate(scratch, bytes + Carver::Round(2 * kv_accum_elems * 4));
  // The split's accumulators (2 Tk Hkv D fp32) are scratch that a CTA per kv head does without: where they do
  // not fit, that kernel runs instead of failing the call.
  if (!carver_or.has_value() && gqa_split) {
    gqa_split = false;
    kv_accum_elems = 0;
    carver_or = Carver::Allocate(scratch, bytes);
  }
  if (!carver_or.has_value())
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "magi_jax: no scratch memory for the backward");
  Carver& carver = *carver_or;

  BwdParams p{};
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.dlse = dlse.typed_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.slices = args;
  p.hq = int(dims->hq);
  p.hkv = int(dims->hkv);
  p.scale = softmax_scale;
  p.softcap = softcap;
  p.delta = carver.Take<float>(rows);
  int32_t* sm90_order = sm90 ? carver.Take<int32_t>(order_ints) : nullptr;
  // Laid out as the gradients they become: dk's rows then dv's, or for a packed second source one block of
  // rows holding dv's heads after dk's, as dk2 does (then one convert covers both).
  const bool accum_packed = *tk2 > 0 && kv2_packed;
  if (gqa_split) {
    p.dk_accum = carver.Take<float>(2 * kv_accum_elems);
    p.dv_accum = p.dk_accum + (accum_packed ? size_t(dims->hkv) * size_t(dims->d) : kv_accum_elems);
    p.accum_row_heads = accum_packed ? int(2 * dims->hkv) : 0;
  }
  const ListBuffers k_lists = TakeLists(carver, k_sizes, kAxisK, kKBlock);
  p.k_lists = k_lists.View();
  if (cudaError_t err = BuildBlockLists(args, k_lists, stream); err != cudaSuccess)
    return CudaFailure("k-block slice lists", err);
  if (deterministic) {
    const ListBuffers q_lists = TakeLists(carver, q_sizes, kAxisQ, kQBlock);
    p.q_lists = q_lists.View();
    if (cudaError_t err = BuildBlockLists(args, q_lists, stream); err != cudaSuccess)
      return CudaFailure("q-block slice lists", err);
  } else {
    p.dq_accum = dq_f32 ? dq->typed_data<float>() : carver.Take<float>(accum_elems);
    const cudaError_t err = *has_dq_in ? CopyUnlessAliased(p.dq_accum, dq_in.untyped_data(), accum_elems * 4, stream)
                                       : cudaMemsetAsync(p.dq_accum, 0, accum_elems * 4, stream);
    if (err != cudaSuccess) return CudaFailure("dq accumulator", err);
  }

  // A second key source: the sm90 dK/dV kernel reads it and writes its gradients in place (KeySplit); every
  // other path (deterministic, mma.sync, a split row the kernel's CTAs cannot take) runs on concat(k, k2) in
  // scratch, copied in before and its dk, dv copied out after.
  KeySplit split;
  if (*tk2 > 0) {
    split = {k2.untyped_data(), v2.untyped_data(), dk2->untyped_data(), dv2->untyped_data(), tk1};
    if (kv2_packed) {  // V (dV) is the second half of each row of k2 (dk2)
      const size_t half = size_t(dims->hkv * dims->d) * ffi::ByteWidth(k.element_type());
      split.v2 = static_cast<const char*>(split.k2) + half;
      split.dv2 = static_cast<char*>(split.dk2) + half;
      split.row_heads = int(2 * dims->hkv);
    }
  }

  return DispatchTypeAndDim(q.element_type(), dims->d, [&](auto tag, auto dim) -> ffi::Error {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    // delta given (a split backward's later calls): copied into the scratch the kernels read (4 bytes a row
    // and head), instead of the preprocess pass over out and dout.
    const cudaError_t delta_err =
        *has_delta ? cudaMemcpyAsync(p.delta, delta_in.untyped_data(), size_t(rows) * 4, cudaMemcpyDeviceToDevice,
                                     stream)
                   : v_apart ? LaunchBwdDelta<T, 128>(p, stream)  // rowsum(dout * out) over v's 128
                             : LaunchBwdDelta<T, D>(p, stream);
    if (delta_err != cudaSuccess) return CudaFailure("delta", delta_err);
    // The GQA split's accumulators: zeroed here, before whichever launch of the sm90 kernel below takes them,
    // and after it converted into dk, dv (the sole source's gradients).
    if (gqa_split)
      if (cudaError_t e = cudaMemsetAsync(p.dk_accum, 0, 2 * kv_accum_elems * 4, stream); e != cudaSuccess)
        return CudaFailure("dk, dv accumulators", e);
    auto convert_kv_accum = [&](void* dk_out, void* dv_out) -> cudaError_t {
      if (accum_packed)
        return LaunchDqConvert<T>(p.dk_accum, static_cast<T*>(dk_out), int64_t(2 * kv_accum_elems), stream);
      if (cudaError_t e = LaunchDqConvert<T>(p.dk_accum, static_cast<T*>(dk_out), int64_t(kv_accum_elems), stream);
          e != cudaSuccess)
        return e;
      return LaunchDqConvert<T>(p.dv_accum, static_cast<T*>(dv_out), int64_t(kv_accum_elems), stream);
    };
    // The sm90 dK/dV kernel at v's head dim.
    auto launch_sm90 = [&](bool reduce_dq, const KeySplit& keys) {
      if constexpr (D == 192)
        if (v_apart) return LaunchBwdDkDvSm90<T, 192, 128>(p, reduce_dq, sm90_order, stream, keys);
      return LaunchBwdDkDvSm90<T, D>(p, reduce_dq, sm90_order, stream, keys);
    };
    bool enqueued = false;  // dK, dV and dQ's reduce-adds, by the sm90 kernel on both key sources
    if (split.row >= 0 && sm90 && !deterministic) {
      const cudaError_t err = launch_sm90(/*reduce_dq=*/true, split);
      if (err != cudaSuccess && err != cudaErrorNotSupported) return CudaFailure("dk/dv (sm90)", err);
      enqueued = err == cudaSuccess;
      if (enqueued && gqa_split)
        if (cudaError_t e = convert_kv_accum(split.dk2, split.dv2); e != cudaSuccess)
          return CudaFailure("dk2, dv2 convert", e);
    }
    if (split.row >= 0 && !enqueued && gqa_split) {  // the concat fallback below writes dk, dv itself
      p.dk_accum = p.dv_accum = nullptr;
      gqa_split = false;
    }
    const bool concat = split.row >= 0 && !enqueued;
    // Bytes of a row of k (dk) and of v (dv); k2's heads are D wide, 2 Hkv a row when packed.
    const size_t hkv = size_t(dims->hkv), head_bytes = D * sizeof(T), v_head_bytes = dims->dv * sizeof(T);
    const size_t row_bytes = hkv * head_bytes, v_row_bytes = hkv * v_head_bytes;
    const size_t row_heads2 = kv2_packed ? 2 * hkv : hkv, tk = size_t(dims->tk);
    if (concat) {
      auto buf = Carver::Allocate(scratch, 2 * Carver::Round(tk * row_bytes) + 2 * Carver::Round(tk * v_row_bytes));
      if (!buf.has_value())
        return ffi::Error(ffi::ErrorCode::kResourceExhausted, "magi_jax: no scratch memory for concat(k, k2)");
      char* kc = buf->Take<char>(tk * row_bytes);
      char* vc = buf->Take<char>(tk * v_row_bytes);
      for (auto [dst, a, b, width] :
           {std::tuple{kc, p.k, split.k2, head_bytes}, {vc, p.v, split.v2, v_head_bytes}}) {
        if (cudaError_t e = cudaMemcpyAsync(dst, a, tk1 * hkv * width, cudaMemcpyDeviceToDevice, stream);
            e != cudaSuccess)
          return CudaFailure("concat(k, k2)", e);
        if (cudaError_t e = CopyHeads(dst + tk1 * hkv * width, width, hkv, b, head_bytes, row_heads2, width, hkv,
                                      size_t(*tk2), stream);
            e != cudaSuccess)
          return CudaFailure("concat(k, k2)", e);
      }
      p.k = kc;
      p.v = vc;
      p.dk = buf->Take<char>(tk * row_bytes);
      p.dv = buf->Take<char>(tk * v_row_bytes);
    }
    if (!enqueued) {
      if constexpr (!HasMmaKernels(D)) {
        // No mma.sync fallback (deterministic=True was refused above). No query rows: dk = dv = 0 (TMA needs
        // a non-empty q map).
        if (dims->tq == 0) {
          if (cudaError_t e = cudaMemsetAsync(p.dk, 0, tk * row_bytes, stream); e != cudaSuccess)
            return CudaFailure("dk", e);
          if (cudaError_t e = cudaMemsetAsync(p.dv, 0, tk * v_row_bytes, stream); e != cudaSuccess)
            return CudaFailure("dv", e);
        } else {
          const cudaError_t err = launch_sm90(/*reduce_dq=*/true, KeySplit{});
          if (err == cudaErrorNotSupported)
            return ffi::Error::InvalidArgument(
                "q: head_dim " + std::to_string(D) + " runs on the sm90 (TMA) backward only, which needs q, k, v, "
                "dout, dk, dv 16-byte aligned, at least one query row and a driver with cuTensorMapEncodeTiled");
          if (err != cudaSuccess) return CudaFailure("dk/dv (sm90)", err);
        }
      } else {
        if (deterministic) {
          if (cudaError_t err = LaunchBwdDq<T, D>(p, stream); err != cudaSuccess) return CudaFailure("dq", err);
        }
        // Default (sm90): the TMA + wgmma dK/dV kernel (dQ by TMA reduce-add unless deterministic; the
        // deterministic dq is the mma.sync dq kernel above). cudaErrorNotSupported: nothing enqueued, the
        // mma.sync dk/dv kernel runs.
        cudaError_t dkdv = cudaErrorNotSupported;
        if (sm90) {
          dkdv = launch_sm90(!deterministic, KeySplit{});
          if (dkdv != cudaSuccess && dkdv != cudaErrorNotSupported) return CudaFailure("dk/dv (sm90)", dkdv);
          // The split's dk, dv (cudaErrorNotSupported: the mma.sync kernel below writes them instead).
          if (gqa_split && dkdv == cudaSuccess)
            if (cudaError_t e = convert_kv_accum(p.dk, p.dv); e != cudaSuccess) return CudaFailure("dk, dv convert", e);
        }
        if (dkdv == cudaErrorNotSupported) {
          if (cudaError_t err = LaunchBwdDkDv<T, D>(p, !deterministic, stream); err != cudaSuccess)
            return CudaFailure("dk/dv", err);
        }
      }
    }
    if (!deterministic && !dq_f32 && accum_elems > 0) {
      if (cudaError_t err = LaunchDqConvert<T>(p.dq_accum, static_cast<T*>(p.dq), int64_t(accum_elems), stream);
          err != cudaSuccess)
        return CudaFailure("dq convert", err);
    }
    if (concat) {
      const char* dkc = static_cast<const char*>(p.dk);
      const char* dvc = static_cast<const char*>(p.dv);
      for (auto [src, a, b, width] : {std::tuple{dkc, dk->untyped_data(), split.dk2, head_bytes},
                                      {dvc, dv->untyped_data(), split.dv2, v_head_bytes}}) {
        if (cudaError_t e = cudaMemcpyAsync(a, src, tk1 * hkv * width, cudaMemcpyDeviceToDevice, stream);
            e != cudaSuccess)
          return CudaFailure("split dk, dk2", e);
        if (cudaError_t e = CopyHeads(b, head_bytes, row_heads2, src + tk1 * hkv * width, width, hkv, width, hkv,
                                      size_t(*tk2), stream);
            e != cudaSuccess)
          return CudaFailure("split dk, dk2", e);
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace magi_jax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiFfaFwdCuda, magi_jax::cuda::FfaFwdImpl,
                              magi_jax::BindFfaFwd(xla::ffi::Ffi::Bind()
                                                       .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                       .Ctx<xla::ffi::ScratchAllocator>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiFfaBwdCuda, magi_jax::cuda::FfaBwdImpl,
                              magi_jax::BindFfaBwd(xla::ffi::Ffi::Bind()
                                                       .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                       .Ctx<xla::ffi::ScratchAllocator>()));
