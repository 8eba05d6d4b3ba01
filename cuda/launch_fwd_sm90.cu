// The sm90 forward's launcher: tensor maps (built here on the host from device pointers and static shapes:
// no synchronisation), the q blocks' lists (block_lists.h: the count, then the fill here with each block's
// work), the longest-first tile order (the sort, tile_order.cu), the persistent grid, and the instantiations
// (bf16, fp16) x (D 64, 96, 128, 192, 256; D 192 with v of 128 too).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "flash_fwd_sm90_kernel.h"
#include "launch.h"
#include "tile_order.h"
#include "tma_map.h"

namespace magi_jax::cuda {
namespace {

// ------------------------------------------------------------------------------------------ tile order

// The fill of the q blocks' lists (block_lists.h), then the work of each, the key tiles it visits plus one
// (scheduler_sm90.h): a warp per q block, walking the list it has just written.
template <int BN>
__global__ void __launch_bounds__(kListWarps * 32) FwdFillAndWorkKernel(SliceArgs args, ListBuffers lists,
                                                                       int num_blocks, int group_gap,
                                                                       int32_t* work) {
  WaitPriorGrid();  // the counts
  LaunchDependents();
  const ListPlace place = FillListsOfCta(args, lists, num_blocks);
  if (place.x >= num_blocks) return;  // whole warps leave together
  __syncwarp();  // the block's ids, written by every lane, are read by every lane
  const SliceWalk walk(lists.View(), place.x, place.begin, place.count, place.listed);
  const int w = FwdBlockWork(args, walk, place.x, kQBlock, BN, group_gap);
  if ((threadIdx.x & 31) == 0) work[place.x] = w;
}


// MAGI_JAX_SM90_SCHED, for measuring the scheduler's share (bench/kernel.py ffa_natural, ffa_grid): "lpt"
// (default: persistent, longest first), "natural" (persistent, q blocks last-first), "grid" (one CTA per
// tile, last-first: not persistent).
enum class Sched { kLpt, kNatural, kGrid };
Sched SchedFromEnv() {
  if (EnvEquals("MAGI_JAX_SM90_SCHED", "natural")) return Sched::kNatural;
  if (EnvEquals("MAGI_JAX_SM90_SCHED", "grid")) return Sched::kGrid;
  return Sched::kLpt;
}

// MAGI_JAX_SM90_CLAIM_LEAD, for measuring the tile claim's timing side by side (bench/kernel.py
// "ffa@MAGI_JAX_SM90_CLAIM_LEAD=0"): the claim lead in steps, FwdSm90Tile::kClaimLead when unset; 0 takes a
// tile after the last K/V load of the one before, a lead longer than any walk at the start of the one before.
int ClaimLeadFromEnv(int fallback) {
  const char* env = std::getenv("MAGI_JAX_SM90_CLAIM_LEAD");
  if (env == nullptr || *env == '\0') return fallback;
  return int(std::clamp<long long>(std::atoll(env), 0, 1 << 30));
}

// MAGI_JAX_SM90_GROUPS=0, for measuring the groups of slices side by side (bench/kernel.py
// "ffa@MAGI_JAX_SM90_GROUPS=0"): every slice walked alone, as before groups (scheduler_sm90.h FwdStepFrom).
int GroupGapFromEnv(int tile) { return EnvEquals("MAGI_JAX_SM90_GROUPS", "0") ? kNoGroups : tile; }

// Q heads per L2 section (scheduler_sm90.h): whole GQA groups whose K and V (head dims d, dv), all tk keys of
// them, fit L2SectionBudget; at least one group.
int SectionHeads(const FwdParams& p, int d, int dv, int elem_bytes, int device) {
  const int64_t budget = L2SectionBudget(device);
  const int group = p.hq / p.hkv;
  const int64_t kv_head_bytes = std::max<int64_t>(1, int64_t(p.slices.tk) * (d + dv) * elem_bytes);
  const int64_t kv_heads = std::clamp<int64_t>(budget / kv_head_bytes, 1, p.hkv);
  return int(kv_heads) * group;
}

}  // namespace

// [work stats: 2 x uint64][counter][live blocks][work: num_blocks][order: num_blocks] (the stats first: 8-byte
// aligned).
int64_t FwdSm90ScratchInts(int64_t tq) { return 2 * ((tq + kQBlock - 1) / kQBlock) + 6; }

template <typename T, int D, int Dv>
cudaError_t LaunchFwdSm90(const FwdParams& p, const ListBuffers& lists, int32_t* scratch, cudaStream_t stream) {
  using Tile = FwdSm90Tile<D, Dv>;
  const int num_blocks = NumBlocks(p.slices.tq, Tile::kBlockM);
  if (num_blocks == 0 || p.hq == 0) return cudaSuccess;
  // What TMA needs; anything else is left to the mma.sync kernel (nothing has been enqueued yet).
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  // No keys: D 64 / 128 leave it to the mma.sync kernel; D 96, 192 and 256 have no other kernel, so their K
  // and V maps are made over q instead (never read: with no keys every slice's key span is empty, the walks
  // have no step, and the epilogue writes O = 0, lse = -inf).
  const bool no_keys = p.slices.tk == 0;
  if (encode == nullptr || (no_keys && HasMmaKernels(D)) || !Aligned16(p.q) || (!no_keys && !Aligned16(p.k)) ||
      (!no_keys && !Aligned16(p.v)) || !Aligned16(p.out))
    return cudaErrorNotSupported;
  const void* k_base = no_keys ? p.q : p.k;
  const void* v_base = no_keys ? p.q : p.v;
  const int kv_rows = no_keys ? p.slices.tq : p.slices.tk, kv_heads = no_keys ? p.hq : p.hkv;
  const int kv_row_heads = no_keys ? p.hq : p.kv_row_heads;
  FwdSm90Params sp{};
  if (!EncodeMap<T>(encode, &sp.q_map, p.q, p.slices.tq, p.hq, D, Tile::kBlockM) ||
      !EncodeMap<T>(encode, &sp.k_map, k_base, kv_rows, kv_heads, D, Tile::kBlockN, kv_row_heads) ||
      !EncodeMap<T>(encode, &sp.v_map, v_base, kv_rows, kv_heads, Dv, Tile::kBlockN, kv_row_heads,
                    no_keys ? D : p.v_head_pitch) ||
      !EncodeMap<T>(encode, &sp.out_map, p.out, p.slices.tq, p.hq, Dv, Tile::kRowsPerWarpgroup))
    return cudaErrorNotSupported;
  int device = 0, sms = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); err != cudaSuccess)
    return err;

  auto* stats = reinterpret_cast<unsigned long long*>(scratch);
  int32_t* counter = scratch + 4;
  int32_t* live = counter + 1;
  int32_t* work = live + 1;
  int32_t* order = work + num_blocks;
  const Sched sched = SchedFromEnv();
  const int group_gap = GroupGapFromEnv(Tile::kBlockN);
  // The lists' count (launched plainly), then the fill and work, the order and the attention kernel, each
  // chained to the kernel before (launch.h LaunchKernel), so that no launch latency separates them; the order
  // kernel also writes the stats, live and the counter.
  if (cudaError_t err = LaunchListCount(p.slices, lists, stream); err != cudaSuccess) return err;
  if (cudaError_t err = LaunchKernel(FwdFillAndWorkKernel<Tile::kBlockN>, NumBlocks(num_blocks, kListWarps),
                                     kListWarps * 32, 0, stream, Follows::kOurKernel, p.slices, lists, num_blocks,
                                     group_gap, work);
      err != cudaSuccess)
    return err;
  if (cudaError_t err = LaunchLongestFirst(work, num_blocks, sched != Sched::kLpt, {order, stats, live, counter},
                                           stream);
      err != cudaSuccess)
    return err;

  sp.base = p;
  sp.order = order;
  sp.counter = counter;
  // A merging call leaves the rows of q blocks without keys as they are: their tiles, last in the order, are
  // not visited (a distributed stage call has many: 4720 of 8192 on rank 0 of the 2-GPU bench).
  sp.live_blocks = p.out_prev != nullptr && sched == Sched::kLpt ? live : nullptr;
  sp.num_tiles = num_blocks * p.hq;
  sp.section_heads = SectionHeads(p, D, Dv, int(sizeof(T)), device);
  sp.work_stats = stats;
  sp.work = work;
  sp.claim_lead = ClaimLeadFromEnv(Tile::kClaimLead);
  sp.prefetch_last = EnvEquals("MAGI_JAX_SM90_PREFETCH_LAST", "0") ? 0 : 1;
  sp.group_gap = group_gap;
  // [softcap][max_logit]
  using Kernel = decltype(&FlashFwdSm90Kernel<T, D, Dv, false, false>);
  const Kernel kernels[2][2] = {
      {FlashFwdSm90Kernel<T, D, Dv, false, false>, FlashFwdSm90Kernel<T, D, Dv, false, true>},
      {FlashFwdSm90Kernel<T, D, Dv, true, false>, FlashFwdSm90Kernel<T, D, Dv, true, true>}};
  const Kernel kernel = kernels[p.softcap > 0.0f][p.max_logit != nullptr];
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      err != cudaSuccess)
    return err;
  // A persistent CTA holds its SM to the end: the SMs it must leave to a collective running beside it are
  // left out of the grid (at least one CTA stays).
  const int ctas = std::max(1, sms - p.sm_margin);
  const int grid = sp.num_tiles < ctas || sched == Sched::kGrid ? sp.num_tiles : ctas;
  return LaunchKernel(kernel, grid, Tile::kThreads, Tile::kSmemBytes, stream, Follows::kOurKernel, sp);
}

#define MAGI_INSTANTIATE_FWD_SM90(D, DV)                                                                       \
  template cudaError_t LaunchFwdSm90<__nv_bfloat16, D, DV>(const FwdParams&, const ListBuffers&, int32_t*,      \
                                                           cudaStream_t);                                       \
  template cudaError_t LaunchFwdSm90<__half, D, DV>(const FwdParams&, const ListBuffers&, int32_t*, cudaStream_t);
MAGI_INSTANTIATE_FWD_SM90(64, 64)
MAGI_INSTANTIATE_FWD_SM90(128, 128)
// Head dims 96, 192 and 256: the only CUDA forwards for them (the mma.sync kernel has none; handlers.cu); 192
// with v of 128 (MLA) too.
MAGI_INSTANTIATE_FWD_SM90(96, 96)
MAGI_INSTANTIATE_FWD_SM90(192, 192)
MAGI_INSTANTIATE_FWD_SM90(192, 128)
MAGI_INSTANTIATE_FWD_SM90(256, 256)
#undef MAGI_INSTANTIATE_FWD_SM90

}  // namespace magi_jax::cuda
