// The sm90 backward's dK/dV launcher (flash_bwd_sm90_kernel.h): tensor maps built on the host from device
// pointers and static shapes (no synchronisation), the tile order, a grid of (k blocks, kv heads), the
// instantiations (bf16, fp16) x (D 64, 96, 128, 192, 256) x (dQ by TMA reduce-add or not), and at D 128 the GQA
// split's (k blocks, q heads). D 192, 256: 64-key CTAs (BwdSm90Tile::kSplitD).
//
// Tile order: one CTA per (k block, kv head), taken by the hardware in grid order. In k-block order, head
// after head, the last head's heaviest k blocks started when most of the grid was done and trailed it: a
// stage call of the distributed backward, whose remote keys' work is very uneven, by ~8%, shared question
// 16k by ~13% (the host model cuda/tools/sched_sim.py --pass bwd). So the CTAs take their tiles from a list
// built on the device, as the forward's scheduler orders its own (tile_order.h): k blocks longest first
// (work: KvBlockWork, the CTA's row steps), kv heads in L2 sections whose Q and dO fit L2SectionBudget (the
// CTAs in flight share them), the last section wider. MAGI_JAX_SM90_BWD_ORDER=grid keeps the grid's order
// (bench/kernel.py ffa_bwd_grid). The GQA split (BwdSm90GqaSplit) orders (k block, q head) tiles the same way,
// with sections of q heads.
#include <algorithm>
#include <climits>

#include "flash_bwd_sm90_kernel.h"
#include "launch.h"
#include "tile_order.h"
#include "tma_map.h"

namespace magi_jax::cuda {
namespace {

constexpr int kWorkWarps = 8;
constexpr int kTileThreads = 256;

// The work of k block kb, KvBlockWork (BN keys, row steps of BM). A warp per k block.
template <int BN, int BM>
__global__ void __launch_bounds__(kWorkWarps * 32) BwdWorkKernel(SliceArgs args, BlockLists lists, int num_kb,
                                                                 int group, int32_t* work) {
  LaunchDependents();  // launched plainly (it follows the delta pass or its copy): the sort may start
  const int kb = blockIdx.x * kWorkWarps + int(threadIdx.x >> 5);
  if (kb >= num_kb) return;  // whole warps leave together
  const SliceWalk walk(args, lists, kb / (kKBlock / BN));
  const int64_t c0 = int64_t(kb) * BN;
  const int w = KvBlockWork(walk, args, c0, c0 + BN, group, BM);
  if ((threadIdx.x & 31) == 0) work[kb] = w;
}

// tiles[t] = k block + num_kb * head of the grid's t-th CTA (SectionTile over the tiles' heads: kv heads, or
// q heads in the GQA split; sections of `per`).
__global__ void __launch_bounds__(kTileThreads) BwdTilesKernel(const int32_t* order, int num_kb, int heads, int per,
                                                               const unsigned long long* stats, int ctas,
                                                               int32_t* tiles) {
  WaitPriorGrid();  // the order and its stats
  LaunchDependents();
  const int64_t t = int64_t(blockIdx.x) * kTileThreads + threadIdx.x;
  if (t >= int64_t(num_kb) * heads) return;
  const int tail_first = TailFirstHead(heads, 1, per, stats[0], stats[1], ctas);
  int kb, hk;
  SectionTile(order, num_kb, heads, per, tail_first, int(t), &kb, &hk);
  tiles[t] = kb + num_kb * hk;
}

// The order's scratch, in int32: [stats: 2 x uint64][work: num_kb][order: num_kb][tiles: num_kb x heads].
int64_t OrderInts(int64_t num_kb, int64_t heads) { return 4 + 2 * num_kb + num_kb * heads; }

// What a tile head's CTAs read of Q and dO: all tq rows of the `group` q heads each walks. The L2 sections hold
// as many tile heads as fit the budget; the GQA split's L2 term (BwdSm90GqaSplit) asks whether one kv head's
// group alone does.
int64_t TileHeadQdoBytes(int64_t tq, int d, int elem_bytes, int64_t group) { return tq * d * elem_bytes * 2 * group; }

// Enqueues the longest-first tile list into scratch and returns it (sp.tiles); nullptr when the grid keeps
// its own order (no scratch, MAGI_JAX_SM90_BWD_ORDER=grid, or more tiles than int32 indexes). heads: the
// tiles' heads, each CTA walking `group` q heads (kv heads and the GQA group; the GQA split: q heads and 1).
template <int BN, int BM>
cudaError_t BuildTileOrder(const BwdParams& p, int num_kb, int heads, int group, int d, int elem_bytes,
                           int32_t* scratch, cudaStream_t stream, const int32_t** tiles_out) {
  *tiles_out = nullptr;
  if (scratch == nullptr || EnvEquals("MAGI_JAX_SM90_BWD_ORDER", "grid") || int64_t(num_kb) * heads >= INT_MAX)
    return cudaSuccess;
  int device = 0, sms = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (cudaError_t err = CurrentDeviceSms(&sms); err != cudaSuccess) return err;
  // heads per section: their Q and dO, all tq rows of the q heads a tile walks, fit the budget; at least one.
  const int64_t head_bytes = std::max<int64_t>(1, TileHeadQdoBytes(p.slices.tq, d, elem_bytes, group));
  const int per = int(std::clamp<int64_t>(L2SectionBudget(device) / head_bytes, 1, heads));
  auto* stats = reinterpret_cast<unsigned long long*>(scratch);
  int32_t* work = scratch + 4;
  int32_t* order = work + num_kb;
  int32_t* tiles = order + num_kb;
  // The sort, the tiles and the dK/dV kernel are chained launches (launch.h LaunchKernel): no launch latency
  // between them.
  if (cudaError_t err = LaunchKernel(BwdWorkKernel<BN, BM>, (num_kb + kWorkWarps - 1) / kWorkWarps, kWorkWarps * 32,
                                     0, stream, Follows::kAnything, p.slices, p.k_lists, num_kb, group, work);
      err != cudaSuccess)
    return err;
  if (cudaError_t err = LaunchLongestFirst(work, num_kb, false, {order, stats, nullptr, nullptr}, stream);
      err != cudaSuccess)
    return err;
  const int64_t num_tiles = int64_t(num_kb) * heads;
  if (cudaError_t err = LaunchKernel(BwdTilesKernel, unsigned((num_tiles + kTileThreads - 1) / kTileThreads),
                                     kTileThreads, 0, stream, Follows::kOurKernel, order, num_kb, heads, per, stats,
                                     sms, tiles);
      err != cudaSuccess)
    return err;
  *tiles_out = tiles;
  return cudaSuccess;
}

// The fp32 dq accumulator [t, h, d] as (32, d / 32, h, t) in boxes of (32, box_cols / 32, 1, box_rows):
// box_cols (64; head dim 256: 32) columns of box_rows rows in 128-byte lines ordered (row, 32-column chunk),
// 128-byte swizzle (the kernel's StoreDq / StoreDqBox32). The swizzle needs inner boxes of at most 128 bytes,
// hence the 32-column split; ordering the lines (row, chunk) makes the kernel's staging stores conflict-free.
// Rows past t are skipped by the reduce.
// The GQA split's dK / dV accumulators [tk, hkv, d] take the same shape (box_cols 32, 64-key boxes).
// row_heads: heads from one row to the next (0: h; the GQA split's accumulators of a packed second source).
bool EncodeDqAccumMap(PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap* map, float* base, int t, int h,
                      int d, int box_cols, int box_rows, int row_heads = 0) {
  const cuuint64_t dims[4] = {32, cuuint64_t(d / 32), cuuint64_t(h), cuuint64_t(t)};
  const cuuint64_t strides[3] = {32 * 4, cuuint64_t(d) * 4,
                                 cuuint64_t(row_heads > 0 ? row_heads : h) * d * 4};  // bytes, dims 1-3
  const cuuint32_t box[4] = {32, cuuint32_t(box_cols / 32), 1, cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

// Worst case over the head dims (64-key CTAs, D 256) and the tiles' heads (q heads, the GQA split).
int64_t BwdSm90ScratchInts(int64_t tk, int64_t hq) { return OrderInts((tk + 63) / 64, hq); }

cudaError_t BwdSm90GqaSplit(int d, int elem_bytes, int64_t tq, int64_t tk, int64_t hq, int64_t hkv, bool reduce_dq,
                            bool two_sources, bool* split) {
  *split = false;
  if (d != 128 || !reduce_dq || two_sources || hkv <= 0 || hq <= hkv || EnvEquals("MAGI_JAX_SM90_BWD_GQA_SPLIT", "0"))
    return cudaSuccess;
  if (EnvEquals("MAGI_JAX_SM90_BWD_GQA_SPLIT", "1")) {
    *split = true;
    return cudaSuccess;
  }
  int device = 0, sms = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (cudaError_t err = CurrentDeviceSms(&sms); err != cudaSuccess) return err;
  // Fewer (k block, kv head) tiles than SMs leave SMs idle for the whole kernel; a CTA per q head fills them.
  const bool idle_sms = NumBlocks(tk, BwdSm90Tile<128>::kBlockN) * hkv < sms;
  // A group's Q and dO over the L2 budget: a CTA per q head walks one head's. Not for groups of 2: there the
  // split's fp32 dK / dV reduce-adds, memset and convert outweigh the L2 it saves (32k tokens, 16 / 8 heads:
  // the split 8-9% slower on an H100, BENCHMARKS.md 2026-12-06).
  const int64_t group = hq / hkv;
  const bool l2_bound = group >= 4 && TileHeadQdoBytes(tq, d, elem_bytes, group) > L2SectionBudget(device);
  *split = idle_sms || l2_bound;
  return cudaSuccess;
}

template <typename T, int D, int Dv>
cudaError_t LaunchBwdDkDvSm90(const BwdParams& p, bool reduce_dq, int32_t* scratch, cudaStream_t stream,
                              const KeySplit& split) {
  using Tile = BwdSm90Tile<D, Dv>;
  const int num_blocks = NumBlocks(p.slices.tk, Tile::kBlockN);
  if (num_blocks == 0 || p.hkv == 0) return cudaSuccess;
  // What TMA needs; anything else is left to the mma.sync kernel (nothing has been enqueued yet).
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  const bool two = split.row >= 0;
  const bool first = !two || split.row > 0;  // keys in the first source (none: an empty k, whatever its pointer)
  if (encode == nullptr || p.slices.tq == 0 || !Aligned16(p.q) || !Aligned16(p.dout) ||
      (first && (!Aligned16(p.k) || !Aligned16(p.v) || !Aligned16(p.dk) || !Aligned16(p.dv))))
    return cudaErrorNotSupported;
  // v of its own head dim: dQ by reduce-adds, no GQA split, a second source only packed (the handler refuses
  // the rest).
  if (Dv != D && ((two && split.row_heads == 0) || !reduce_dq || p.dk_accum != nullptr)) return cudaErrorInvalidValue;
  // Head dims without mma.sync kernels (96, 192, 256) have no deterministic dq kernel to pair with: dQ is
  // always reduce-added here, and only those instantiations are compiled.
  if (!HasMmaKernels(D) && !reduce_dq) return cudaErrorInvalidValue;
  if (two && (split.row % Tile::kBlockN != 0 || split.row > p.slices.tk || !Aligned16(split.k2) ||
              !Aligned16(split.v2) || !Aligned16(split.dk2) || !Aligned16(split.dv2)))
    return cudaErrorNotSupported;
  BwdSm90Params sp{};
  const int tq = p.slices.tq, tk = two ? int(split.row) : p.slices.tk, tk2 = p.slices.tk - tk;
  if (!EncodeMap<T>(encode, &sp.q_map, p.q, tq, p.hq, D, Tile::kBlockM) ||
      !EncodeMap<T>(encode, &sp.do_map, p.dout, tq, p.hq, Dv, Tile::kBlockM))
    return cudaErrorNotSupported;
  // The first source's maps; none when every key is the second source's (a staged distributed backward's
  // stage call: no CTA reads them).
  if (first && (!EncodeMap<T>(encode, &sp.k_map, p.k, tk, p.hkv, D, Tile::kBlockN) ||
                 !EncodeMap<T>(encode, &sp.v_map, p.v, tk, p.hkv, Dv, Tile::kBlockN) ||
                 !EncodeMap<T>(encode, &sp.dk_map, p.dk, tk, p.hkv, D, Tile::kKeysPerWarpgroup) ||
                 !EncodeMap<T>(encode, &sp.dv_map, p.dv, tk, p.hkv, Dv, Tile::kKeysPerWarpgroup)))
    return cudaErrorNotSupported;
  sp.split_row = INT_MAX;
  if (two && tk2 > 0) {
    // K and V packed side by side: a row stride of 2 Hkv heads, each D wide (V and dV: its first Dv columns).
    const int rh = split.row_heads;
    if (!EncodeMap<T>(encode, &sp.k2_map, split.k2, tk2, p.hkv, D, Tile::kBlockN, rh) ||
        !EncodeMap<T>(encode, &sp.v2_map, split.v2, tk2, p.hkv, Dv, Tile::kBlockN, rh, D) ||
        !EncodeMap<T>(encode, &sp.dk2_map, split.dk2, tk2, p.hkv, D, Tile::kKeysPerWarpgroup, rh) ||
        !EncodeMap<T>(encode, &sp.dv2_map, split.dv2, tk2, p.hkv, Dv, Tile::kKeysPerWarpgroup, rh, D))
      return cudaErrorNotSupported;
    sp.split_row = tk;
  }
  if (reduce_dq && (!Aligned16(p.dq_accum) || !EncodeDqAccumMap(encode, &sp.dq_map, p.dq_accum, tq, p.hq, D,
                                                                 Tile::kDqBoxCols, Tile::kBlockM)))
    return cudaErrorNotSupported;
  // The GQA split, where the caller gives the accumulators (having asked BwdSm90GqaSplit): it must apply here
  // too, else the caller would convert accumulators that nothing added into. One source holds every key (the
  // first, or the second from key 0: split_row 0), so a CTA's keys c0.. are rows c0.. of the accumulators.
  bool gqa = false;
  if (p.dk_accum != nullptr || p.dv_accum != nullptr) {
    if (cudaError_t err = BwdSm90GqaSplit(D, int(sizeof(T)), tq, p.slices.tk, p.hq, p.hkv, reduce_dq,
                                          first && two && tk2 > 0, &gqa);
        err != cudaSuccess)
      return err;
    if (!gqa || p.dk_accum == nullptr || p.dv_accum == nullptr) return cudaErrorInvalidValue;
    // 32-column boxes of the warpgroup's 64 keys (the kernel's StoreDqBox32 through dq_buf).
    const int rows = p.slices.tk, rh = p.accum_row_heads;
    if (!Aligned16(p.dk_accum) || !Aligned16(p.dv_accum) ||
        !EncodeDqAccumMap(encode, &sp.dk_accum_map, p.dk_accum, rows, p.hkv, D, 32, Tile::kKeysPerWarpgroup, rh) ||
        !EncodeDqAccumMap(encode, &sp.dv_accum_map, p.dv_accum, rows, p.hkv, D, 32, Tile::kKeysPerWarpgroup, rh))
      return cudaErrorNotSupported;
  }
  sp.base = p;
  sp.num_kb = num_blocks;
  // MAGI_JAX_SM90_BWD_STAGGER=0: both consumer warpgroups start their walk together.
  sp.stagger = EnvEquals("MAGI_JAX_SM90_BWD_STAGGER", "0") ? 0 : 1;
  const bool softcap = p.softcap > 0.0f;
  auto kernel = softcap ? FlashBwdSm90Kernel<T, D, true, true, false, Dv>
                        : FlashBwdSm90Kernel<T, D, true, false, false, Dv>;
  if constexpr (HasMmaKernels(D))
    if (!reduce_dq)
      kernel = softcap ? FlashBwdSm90Kernel<T, D, false, true, false, Dv>
                       : FlashBwdSm90Kernel<T, D, false, false, false, Dv>;
  if constexpr (D == 128 && Dv == D)  // BwdSm90GqaSplit: D 128 with reduce_dq only
    if (gqa)
      kernel = softcap ? FlashBwdSm90Kernel<T, D, true, true, true> : FlashBwdSm90Kernel<T, D, true, false, true>;
  // The tiles' heads: kv heads, each CTA walking its group's q heads; the GQA split: q heads, one each.
  const int heads = gqa ? p.hq : p.hkv, group = gqa ? 1 : p.hq / p.hkv;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      err != cudaSuccess)
    return err;
  if (cudaError_t err = BuildTileOrder<Tile::kBlockN, Tile::kBlockM>(p, num_blocks, heads, group, D, int(sizeof(T)),
                                                                     scratch, stream, &sp.tiles);
      err != cudaSuccess)
    return err;
  // Chained to the tiles' kernel where there is one; else it follows the delta pass or a copy (the GQA
  // split: the accumulators' memset).
  return LaunchKernel(kernel, dim3(num_blocks, heads), Tile::kThreads, Tile::kSmemBytes, stream,
                      sp.tiles != nullptr ? Follows::kOurKernel : Follows::kAnything, sp);
}

#define MAGI_INSTANTIATE_BWD_SM90(T, D, ...) \
  template cudaError_t LaunchBwdDkDvSm90<T, D, ##__VA_ARGS__>(const BwdParams&, bool, int32_t*, cudaStream_t, const KeySplit&);
MAGI_INSTANTIATE_BWD_SM90(__nv_bfloat16, 64)
MAGI_INSTANTIATE_BWD_SM90(__nv_bfloat16, 128)
MAGI_INSTANTIATE_BWD_SM90(__half, 64)
MAGI_INSTANTIATE_BWD_SM90(__half, 128)
// Head dims 96, 192 and 256: the only CUDA dK/dV kernels for them (the mma.sync ones have none; handlers.cu).
MAGI_INSTANTIATE_BWD_SM90(__nv_bfloat16, 96)
MAGI_INSTANTIATE_BWD_SM90(__half, 96)
MAGI_INSTANTIATE_BWD_SM90(__nv_bfloat16, 192)
MAGI_INSTANTIATE_BWD_SM90(__half, 192)
MAGI_INSTANTIATE_BWD_SM90(__nv_bfloat16, 192, 128)  // MLA: v of 128
MAGI_INSTANTIATE_BWD_SM90(__half, 192, 128)
MAGI_INSTANTIATE_BWD_SM90(__nv_bfloat16, 256)
MAGI_INSTANTIATE_BWD_SM90(__half, 256)

}  // namespace magi_jax::cuda
