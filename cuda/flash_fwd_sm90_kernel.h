// The sm90 forward: TMA loads into a shared-memory ring completed on mbarriers, wgmma on two consumer
// warpgroups, two producer warps (setmaxnreg), a persistent grid taking (q block, head) tiles longest-first.
//
// The walk: per tile, the slices of the q block's list in ascending id, in groups (consecutive slices with
// disjoint rows and key spans less than a tile apart, walked once over the union of their keys; a slice alone
// otherwise), per group the key tiles its rows attend, ONE online softmax across all of them. Producers and
// consumers walk the same steps (scheduler_sm90.h, FwdStep) and meet on the ring's barriers:
//   tile warp:      for each tile: its record -> tile_full[tile % 2], its Q -> q_full[tile % 2], during the
//                   tile before (Q is double-buffered), taken claim_lead steps before that tile's end
//                   (claim_next; at its start when it is that short).
//   K/V warp:       for each tile (its record): for each step j: K(j) -> k_full[j], V(j) -> v_full[j].
//   consumer wg:    S(j) = Q K(j)^T (SS wgmma) is issued, then O += P(j-1) V(j-1) (RS wgmma, P from
//                   registers); the softmax of S(j) runs while the PV wgmma of step j-1 is in flight
//                   (FA3's intra-warpgroup overlap); O is rescaled once that wgmma has landed. A tile's
//                   last PV and the next tile's first S are issued together, so that the epilogue (O to
//                   shared memory, the TMA store) runs under that S instead of between two turns.
//   ping-pong:      the two consumer warpgroups take turns to issue their wgmmas (named barriers
//                   kSchedBarrier + cw, FA3's scheduler barrier), so one warpgroup's softmax runs while
//                   the other's GEMMs occupy the tensor cores, and their epilogues are staggered too.
// Head dim 256 (FwdSm90Tile<256>): key tiles of 80, one Q buffer which also stages the output (released to
// the tile warp after the epilogue's store has read it), no intra-warpgroup overlap (registers: O alone is
// 128 per thread): S(j) and O += P(j) V(j) are a turn each, the ping-pong hides the softmax.
// Each consumer warpgroup owns 64 rows; a thread holds rows 16 w + g and 16 w + g + 8 of them (w the warp in
// the warpgroup), i.e. the mma.sync C layout, so mask.h / softmax.h helpers apply with MT = 1.
// Exact masking: tiles not wholly inside the slice for the warpgroup's 64 rows are masked per cell.
// Empty rows: O = 0, lse = -inf (OnlineSoftmax semantics). Out-of-range rows and keys read as zeros (TMA
// fill) and are masked or clipped on store.
#pragma once

#include "block_lists.h"
#include "epilogue.h"
#include "mask.h"
#include "params.h"
#include "scheduler_sm90.h"
#include "sm90_ptx.h"
#include "sm90_wgmma.h"
#include "softmax.h"
#include "tile_size_sm90.h"

namespace magi_jax::cuda {

// Online softmax over the two rows a consumer thread holds, with the rescale of O split from the update so
// that it can wait for the PV wgmma in flight.
// A row whose max grows by at most kRescaleSlack (log2 units) keeps its old max: its probabilities may then
// reach 2^kRescaleSlack, harmless in fp32 and as bf16 / fp16 P (their relative precision does not depend on
// the magnitude, and 2^8 is far from fp16's limit), and O and the row sum need no rescale (alpha 1). Once a
// row's max has settled, a few steps into a walk, O is no longer rescaled at all (NeedsRescale).
constexpr float kRescaleSlack = 8.0f;
// The bound on a thread's sum over a row's cells of one step under which the step keeps the rows' maxima
// without computing its own (Sm90RowSoftmax::ExpKeepingMax): every probability is then at most 2^14, within
// fp16's range as P.
constexpr float kKeptMaxSum = 16384.0f;

struct Sm90RowSoftmax {
  // m: the rows' maxima (raw logits); b: the exponentials' base, m * scale_log2 (0 while m is -inf), kept
  // beside m so that a step keeping the maxima does not remake it.
  float m[2], b[2], l[2];

  MAGI_DEV Sm90RowSoftmax() {
    m[0] = m[1] = -INFINITY;
    b[0] = b[1] = 0.0f;
    l[0] = l[1] = 0.0f;
  }

  // Max of a row's 2 NT values (half: which of the thread's two rows) as a pairwise tree: depth
  // log2(2 NT) instead of a chain of 2 NT dependent FMNMX (17 deep at NT 16, on the softmax's critical path).
  template <int NT>
  MAGI_DEV static float RowMax(const float (&s)[NT][4], int half) {
    float v[NT];
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) v[ni] = fmaxf(s[ni][2 * half], s[ni][2 * half + 1]);
#pragma unroll
    for (int w = 1; w < NT; w *= 2)
#pragma unroll
      for (int ni = 0; ni + w < NT; ni += 2 * w) v[ni] = fmaxf(v[ni], v[ni + w]);
    return v[0];
  }

  // s (raw logits, masked cells -inf) -> unnormalised probabilities; alpha is the factor O must take.
  // Both rows' maxima first, their quad shuffles side by side, then the exponentials: row 1's reduction
  // no longer waits for row 0's.
  template <int NT>
  MAGI_DEV void Update(float (&s)[NT][4], float scale_log2, float (&alpha)[2]) {
    float mx[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) mx[half] = fmaxf(m[half], RowMax(s, half));
#pragma unroll
    for (int lane_mask = 1; lane_mask <= 2; lane_mask *= 2)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], lane_mask));
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // False for a row's first keys (m -inf: the difference is +inf, or NaN for a row still without keys).
      const bool keep = (mx[half] - m[half]) * scale_log2 <= kRescaleSlack;
      const float mn = keep ? m[half] : mx[half];
      const float base = mn == -INFINITY ? 0.0f : mn * scale_log2;
      // 1 while O and the row sum are still zero (m -inf): not 2^(-inf * scale_log2 - base), which is 0, or
      // NaN for a zero scale.
      alpha[half] = keep || m[half] == -INFINITY ? 1.0f : Exp2(m[half] * scale_log2 - base);
      m[half] = mn;
      b[half] = base;
      float sum = 0.0f;
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          const float p = Exp2(s[ni][e] * scale_log2 - base);
          s[ni][e] = p;
          sum += p;
        }
      l[half] = l[half] * alpha[half] + sum;
    }
  }

  // s -> probabilities against the rows' current maxima, without this step's row max: that max (a 6-deep
  // FMNMX tree and two shuffle rounds) is what stands between S landing and the first exponential, ~13% of a
  // consumer warp's time in the causal 32k profile. Returns whether that holds for this thread: each of its
  // row sums (sum, not yet added) at most kKeptMaxSum, which bounds every probability (p >= 0). A row without
  // a max yet (m -inf) is taken against 0 when it has keys here and this thread's sum is at least 1: its
  // largest probability is then at least 1 / (2 NT), so 0 can stand as its max (Keep sets it), at most
  // log2(2 NT) above the true one: P keeps its precision (the first keys of a window's last rows, in most of
  // its tiles' second steps, no longer fall back). Rows with no keys yet nor here pass with nothing added
  // (cells -inf). Otherwise the caller recomputes S and runs Update.
  template <int NT>
  MAGI_DEV bool ExpKeepingMax(float (&s)[NT][4], float scale_log2, const bool (&has_keys)[2], float (&sum)[2]) const {
    sum[0] = sum[1] = 0.0f;
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[ni][e] = Exp2(s[ni][e] * scale_log2 - b[e >> 1]);
        sum[e >> 1] += s[ni][e];
      }
    // Predicates, not branches (&, not &&).
    return (sum[0] <= kKeptMaxSum) & (sum[1] <= kKeptMaxSum) &
           ((m[0] != -INFINITY) | !has_keys[0] | (sum[0] >= 1.0f)) &
           ((m[1] != -INFINITY) | !has_keys[1] | (sum[1] >= 1.0f));
  }
  // After a step that ExpKeepingMax took for the whole warpgroup: the sums added, 0 the max of rows that had
  // their first keys in it (the same on the row's four threads: has_keys is the row's).
  MAGI_DEV void Keep(const float (&sum)[2], const bool (&has_keys)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      l[half] += sum[half];
      if (m[half] == -INFINITY && has_keys[half]) m[half] = 0.0f;
    }
  }

  // Whether any row of the warp takes a factor other than 1 (warp-uniform: the caller branches on it with no
  // wgmma in flight).
  MAGI_DEV static bool NeedsRescale(const float (&alpha)[2]) {
    return __any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f);
  }

  template <int DT>
  MAGI_DEV static void Rescale(float (&o)[DT][4], const float (&alpha)[2]) {
#pragma unroll
    for (int di = 0; di < DT; ++di) {
      o[di][0] *= alpha[0];
      o[di][1] *= alpha[0];
      o[di][2] *= alpha[1];
      o[di][3] *= alpha[1];
    }
  }

  // Normalises O; lse in natural log, -inf (and O = 0) for rows without keys.
  template <int DT>
  MAGI_DEV void Finish(float (&o)[DT][4], float scale_log2, float (&lse)[2]) {
    float inv[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float total = QuadSum(l[half]);
      const bool empty = !(total > 0.0f);
      inv[half] = empty ? 0.0f : 1.0f / total;
      lse[half] = empty ? -INFINITY : (m[half] * scale_log2 + __log2f(total)) * kLn2;
    }
    Rescale(o, inv);
  }
};

// Named barriers (0 is __syncthreads): 1 + cw the epilogue of consumer warpgroup cw (128 threads);
// kSchedBarrier + cw its turn to issue wgmmas (256 threads: its own 128 sync, the other's 128 arrive).
constexpr int kEpilogueBarrier = 1;
constexpr int kSchedBarrier = 3;
// kKeptMaxBarrier + cw: consumer warpgroup cw's vote on keeping the rows' maxima (128 threads).
constexpr int kKeptMaxBarrier = 5;
// The inter-warpgroup ping-pong on (false: both warpgroups issue freely, the behaviour before it; a one-line
// switch to tell a ping-pong problem, hang or slowdown, from anything else).
constexpr bool kPingPong = true;

// P (fp32 C fragments of a 64 x kBlockN tile) -> the A register fragments of the k16 steps of O += P V.
template <typename T, int NT>
MAGI_DEV void PackP(const float (&s)[NT][4], uint32_t (&pa)[NT / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    pa[kk][0] = Elem<T>::Pack(s[2 * kk][0], s[2 * kk][1]);
    pa[kk][1] = Elem<T>::Pack(s[2 * kk][2], s[2 * kk][3]);
    pa[kk][2] = Elem<T>::Pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[kk][3] = Elem<T>::Pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// kSoftcap: the launcher picks the instantiation (p.base.softcap > 0). A template parameter rather than a
// branch per step: the softcap path's tanhf sequences set the consumers' register peak, and with both paths in
// one kernel ptxas kept the row sums of every step in local memory (a 28-byte spill at D 128).
// Dv: v's and out's head dim (FwdSm90Tile). kMaxLogit: each row's largest logit is tracked and written to
// p.base.max_logit (an instantiation of its own: the kept-max step computes no row max, and the default
// kernels' code stays as it is).
template <typename T, int D, int Dv, bool kSoftcap, bool kMaxLogit>
__global__ void __launch_bounds__(FwdSm90Tile<D, Dv>::kThreads, 1) FlashFwdSm90Kernel(const __grid_constant__ FwdSm90Params p) {
  using Tile = FwdSm90Tile<D, Dv>;
  constexpr int BM = Tile::kBlockM, BN = Tile::kBlockN, kStages = Tile::kStages, kChunks = Tile::kChunks;
  constexpr int kVChunks = Tile::kVChunks;
  constexpr int WM = Tile::kRowsPerWarpgroup;
  // Arrivals that free a Q buffer or a K / V stage (release, below): each consumer warp at D 64 / 128, each
  // warpgroup at D 256.
  constexpr int kReleasesPerStage = Tile::kConsumerWarpgroups * (Tile::kIntraWgOverlap ? 4 : 1);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle atoms need 1024-byte alignment; the dynamic buffer's own alignment is not promised.
  unsigned char* smem = AlignSmem1024(smem_raw);
  unsigned char* sq = smem + Tile::kQOffset;
  unsigned char* sk = smem + Tile::kKOffset;
  unsigned char* sv = smem + Tile::kVOffset;
  unsigned char* so = smem + Tile::kOOffset;
  auto& bars = *reinterpret_cast<FwdSm90Barriers<kStages, Tile::kQStages>*>(smem + Tile::kBarOffset);
  static_assert(sizeof(FwdSm90Barriers<kStages, Tile::kQStages>) <= Tile::kBarBytes, "the barrier region");

  // Warp-uniform by construction (a broadcast), which ptxas needs to see to keep the wgmmas asynchronous.
  const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), wg = warp >> 2;
  const FwdParams& fp = p.base;
  const SliceArgs& args = fp.slices;
  WaitPriorGrid();  // launched chained to the order kernel (launch_fwd_sm90.cu)

  if (tid == 0) {
    for (int i = 0; i < Tile::kQStages; ++i) {
      MbarInit(&bars.q_full[i], 1);
      MbarInit(&bars.q_empty[i], kReleasesPerStage);
    }
    for (int i = 0; i < kStages; ++i) {
      MbarInit(&bars.k_full[i], 1);
      MbarInit(&bars.v_full[i], 1);
      MbarInit(&bars.k_empty[i], kReleasesPerStage);
      MbarInit(&bars.v_empty[i], kReleasesPerStage);
    }
    for (int i = 0; i < 2; ++i) {
      MbarInit(&bars.tile_full[i], 1);
      MbarInit(&bars.tile_empty[i], Tile::kConsumerThreads + 1);  // and the K/V warp (below)
      MbarInit(&bars.claim_next[i], 1);
    }
    bars.tail_first = TailSectionStart(p, int(gridDim.x));
    bars.tiles = VisitedTiles(p);
    MbarInitFence();
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------------------------------------ producers
    // Two warps: the tile warp (1) takes the tiles, publishes their records and loads their Q; the K/V warp (0)
    // follows the records and streams each tile's keys, walking the tile itself. One warp doing both could make
    // the next tile's record and Q only after this tile's last K/V load (decode: three dependent global loads;
    // Q from DRAM), and on short walks the consumers waited for them at tile starts; the decode inside the K/V
    // loop also spilled its 40 registers. Split, each warp holds only what it needs (cuda/NOTES.md, "The tile
    // warp").
    SetMaxRegsDec<Tile::kProducerRegs>();
    if (warp >= 2) return;
    if (warp == 1) {
      // -------------------------------------------------------------------------------------------- tile warp
      if (lane == 0) PrefetchTensorMap(&p.q_map);
      PipeState<2> slot;
      PipeState<Tile::kQStages> qs;
      const int tiles = bars.tiles;
      while (true) {
        // Two Q buffers: a tile is taken once its Q buffer is free (its tile two back is done, the one before
        // has just started), one tile ahead of the consumers: no earlier, which keeps the longest-first greedy
        // order's tail. One Q buffer (D 192, 256): free only once the tile before is done with it (its last
        // S; its epilogue's store where O is staged in it), so the tile is taken and its record made first,
        // and its Q waits.
        if constexpr (Tile::kQStages == 2) MbarWait(&bars.q_empty[qs.stage], qs.phase ^ 1);
        // ... and once the K/V warp is p.claim_lead steps from the end of the tile before: a long tile's
        // successor is taken near its end, not at its start, so the tiles in flight on the grid stay close in
        // the order and share their keys in L2 (causal 32k taken at the start: 10% more DRAM bytes, L2 hit
        // 95.7% for 96.3%, -1.5%); a short tile's successor (a walk of claim_lead steps or fewer) still at its
        // start, its record and Q a tile ahead (sliding window: +9%). Tile n waits for tile n - 1's arrival
        // on claim_next[n % 2]; tile 0's, the phase before the first, is complete.
        if constexpr (Tile::kQStages == 2) MbarWait(&bars.claim_next[qs.stage], qs.phase ^ qs.stage ^ 1);
        // Every tile, the first too, comes from the counter: a CTA that starts late (its SM held by a collective
        // running beside the call) takes the next tile in line instead of one of the longest.
        int tile = 0;
        if (lane == 0) tile = atomicAdd(p.counter, 1);
        tile = __shfl_sync(0xffffffffu, tile, 0);
        int qb = 0, h = 0;
        if (tile < tiles) DecodeTile(p, bars.tail_first, tiles, tile, &qb, &h);
        const SliceWalk walk(args, fp.lists, qb);  // q block 0 past the last tile: read, not walked
        FwdStep first;
        first.cur = -1;
        if (tile < tiles) FwdStepFrom(walk, args, int64_t(qb) * BM, BM, p.group_gap, walk.First(args), &first);
        if (lane == 0) {
          MbarWait(&bars.tile_empty[slot.stage], slot.phase ^ 1);
          const int decoded = tile < tiles ? qb * fp.hq + h : p.num_tiles;
          const int steps = first.cur < 0 ? 0 : p.work[qb] - 1;
          bars.tile[slot.stage] = FwdTileRecord::Of(args, walk, decoded, first, steps);
          bars.walk[slot.stage][0] = walk.begin;
          bars.walk[slot.stage][1] = walk.end;
          bars.walk[slot.stage][2] = walk.csr;
          MbarArrive(&bars.tile_full[slot.stage]);
        }
        slot.Advance();
        if (tile >= tiles) break;
        if (lane == 0) {
          if constexpr (Tile::kQStages == 1) MbarWait(&bars.q_empty[qs.stage], qs.phase ^ 1);
          if (first.cur < 0) {
            MbarArrive(&bars.q_full[qs.stage]);  // a tile without keys reads no Q: the phase completes bare
          } else {
            if (p.prefetch_last) {  // the first group's last key tile, into L2 (FwdSm90Params::prefetch_last)
              const int last = first.c0 + (first.ke - first.c0 - 1) / BN * BN;
              const int hk = h / (fp.hq / fp.hkv);
#pragma unroll
              for (int c = 0; c < kChunks; ++c) {
                TmaPrefetchL2(&p.k_map, 64 * c, hk, last);
                if (c < kVChunks) TmaPrefetchL2(&p.v_map, 64 * c, hk, last);
              }
            }
            MbarArriveExpectTx(&bars.q_full[qs.stage], Tile::kQBytes);
            unsigned char* sq_stage = sq + qs.stage * Tile::kQBytes;
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
              TmaLoad3d(sq_stage + c * (BM * 128), &p.q_map, &bars.q_full[qs.stage], 64 * c, h, qb * BM);
          }
        }
        qs.Advance();
      }
      return;
    }
    // --------------------------------------------------------------------------------------------- K/V warp
    if (lane == 0) {
      PrefetchTensorMap(&p.k_map);
      PrefetchTensorMap(&p.v_map);
      PrefetchTensorMap(&p.out_map);
    }
    PipeState<kStages> kv;
    PipeState<2> slot;
    const int claim_lead = p.claim_lead;
    int claim = 1;  // tile m arrives on claim_next[(m + 1) % 2] (the tile warp's waits, above)
    while (true) {
      // The tile's record; its slot is released once read (with the consumers' arrivals: the tile warp
      // rewrites it only after both have read it).
      MbarWait(&bars.tile_full[slot.stage], slot.phase);
      const int tile = bars.tile[slot.stage].tile;
      FwdStep st = bars.tile[slot.stage].Step();
      int left = bars.tile[slot.stage].steps;  // steps not yet issued
      const int qb = tile / fp.hq, hk = tile % fp.hq / (fp.hq / fp.hkv);
      const int* pos = bars.walk[slot.stage];  // the tile warp's walk: no list load before the first K
      const SliceWalk walk(fp.lists, qb, pos[0], pos[1] - pos[0], pos[2] != 0);
      __syncwarp();
      if (lane == 0) MbarArrive(&bars.tile_empty[slot.stage]);
      slot.Advance();
      if (tile >= p.num_tiles) break;
      // One arrival per tile: at its start when its walk is claim_lead steps or shorter, else claim_lead steps
      // from its end (at the end at the latest, were the count ever too high).
      auto release_claim = [&] {
        if constexpr (Tile::kQStages == 2) {
          if (lane == 0) MbarArrive(&bars.claim_next[claim]);
          claim ^= 1;
        }
      };
      if (left <= claim_lead) release_claim();
      const int64_t r0 = int64_t(qb) * BM;
      for (; st.cur >= 0; FwdStepNext(walk, args, r0, BM, BN, p.group_gap, &st)) {
        if (lane == 0) {
          MbarWait(&bars.k_empty[kv.stage], kv.phase ^ 1);
          MbarArriveExpectTx(&bars.k_full[kv.stage], Tile::kKBytes);
#pragma unroll
          for (int c = 0; c < kChunks; ++c)
            TmaLoad3d(sk + kv.stage * Tile::kKBytes + c * (BN * 128), &p.k_map, &bars.k_full[kv.stage], 64 * c, hk,
                      st.c0);
          MbarWait(&bars.v_empty[kv.stage], kv.phase ^ 1);
          MbarArriveExpectTx(&bars.v_full[kv.stage], Tile::kVBytes);
#pragma unroll
          for (int c = 0; c < kVChunks; ++c)
            TmaLoad3d(sv + kv.stage * Tile::kVBytes + c * (BN * 128), &p.v_map, &bars.v_full[kv.stage], 64 * c, hk,
                      st.c0);
        }
        kv.Advance();
        if (--left == claim_lead) release_claim();
      }
      if (left > claim_lead) release_claim();
    }
    return;
  }

  // ------------------------------------------------------------------------------------------- consumers
  SetMaxRegsInc<Tile::kConsumerRegs>();
  constexpr int NT = BN / 8, DT = Dv / 8;  // O's column groups: v's head dim
  static_assert(DT % 2 == 0, "O leaves by 16 columns (StMatrixX4)");
  const int cw = wg - 1, ctid = tid - 128, wtid = tid & 127, wwarp = wtid >> 5, g = lane >> 2, t = lane & 3;
  (void)ctid;
  const int tq = args.tq;
  constexpr bool softcap = kSoftcap;
  const float scale_log2 = (softcap ? 1.0f : fp.scale) * kLog2e;
  // Descriptor bases: K and V of stage 0 (stages kKBytes, kVBytes apart); Q's is made per tile (its buffer).
  // Descriptors as their low 32 bits (start address >> 4, LBO), offsets added there: the high half (SBO
  // 1024, 128B swizzle) is one constant for all of them, and the 14-bit address field does not carry
  // (shared memory < 256 KB; DescAdd assumes the same).
  const uint64_t desc_k_full = SmemDesc128B(sk, 16);
  const uint32_t desc_hi = uint32_t(desc_k_full >> 32);  // a constant after folding
  const uint32_t desc_k = uint32_t(desc_k_full);
  const uint32_t desc_v = uint32_t(SmemDesc128B(sv, BN * 128));
  auto desc = [desc_hi](uint32_t lo) { return (uint64_t(desc_hi) << 32) | lo; };
  // This warpgroup's output staging: kVChunks chunks of [64 rows][64] (128B swizzle) kOChunkBytes apart; with
  // kOInQ (D 256) its own 64 rows of the Q buffer.
  unsigned char* so_wg = so + cw * Tile::kOWgBytes;

  PipeState<kStages> kv;
  // Tiles taken so far: Q buffer and tile-ring slot q_iter % 2, phase (q_iter / 2) % 2 (both rings have two
  // slots and advance once per tile; with one Q buffer (D 256) its phase is q_iter % 2). One register (not
  // two PipeStates and a descriptor kept across tiles): the D 64 consumers sit at the register limit (the
  // tile slot's own PipeState was spilled there).
  uint32_t q_iter = 0;
  // Ping-pong: warpgroup 0 takes the first turn, given by warpgroup 1 below; every later turn is handed over
  // after a batch of wgmmas is issued (sched_sync / sched_arrive below). Both warpgroups walk the same steps
  // of the same tiles (the walk is per q block), so the turns pair up; warpgroup 0 takes the one left over
  // after the loop, leaving both barriers as they started.
  auto sched_sync = [&]() {
    if constexpr (kPingPong && Tile::kPingPong) NamedBarrierSync(kSchedBarrier + cw, Tile::kConsumerThreads);
  };
  auto sched_arrive = [&]() {
    if constexpr (kPingPong && Tile::kPingPong) NamedBarrierArrive(kSchedBarrier + (cw ^ 1), Tile::kConsumerThreads);
  };
  // The next tile: waits for its record and its Q and returns its id (>= num_tiles: the end). Its record
  // stays in its slot ((q_iter - 1) % 2) until the tile starts (the producer rewrites a slot only two tiles
  // later).
  auto next_tile = [&]() -> int {
    const int slot = int(q_iter & 1);
    const uint32_t slot_phase = (q_iter >> 1) & 1;
    MbarWait(&bars.tile_full[slot], slot_phase);
    const int tile = __shfl_sync(0xffffffffu, bars.tile[slot].tile, 0);  // uniform, visibly
    if (tile >= p.num_tiles) {
      MbarArrive(&bars.tile_empty[slot]);
      return tile;
    }
    MbarWait(&bars.q_full[Tile::kQStages == 2 ? slot : 0], Tile::kQStages == 2 ? slot_phase : q_iter & 1);
    ++q_iter;
    return tile;
  };
  // The first K of the tile taken last (next_tile), before the turn that issues its first S; none for a tile
  // without keys or past the last one (the producer loads nothing for them).
  auto wait_first_k = [&](int tile) {
    if (tile < p.num_tiles && bars.tile[(q_iter - 1) & 1].cur >= 0) MbarWait(&bars.k_full[kv.stage], kv.phase);
  };
  // The descriptor of this warpgroup's 64 rows of the Q buffer of the tile taken last.
  auto desc_q_of = [&]() -> uint32_t {
    const int q_stage = Tile::kQStages == 2 ? int((q_iter - 1) & 1) : 0;
    return uint32_t(SmemDesc128B(sq + q_stage * Tile::kQBytes + cw * (WM * 128), 16));
  };
  // S(j) = Q K(j)^T for the current stage, issued (not waited). The caller has waited for K (and for V
  // when PV follows) before taking the turn (FA3's order): a warpgroup holding the turn should not sit on
  // a TMA. Recomputed at each step (OpaqueZero): held across the loop, the 64-bit descriptors take 14
  // registers.
  float s[1][NT][4];
  auto issue_s = [&](uint32_t desc_q) {
    const uint32_t dk = desc_k + ((kv.stage * Tile::kKBytes) >> 4);
    const uint32_t dq = desc_q + OpaqueZero();
    WgmmaFence();
    Wgmma<T, BN>::template SSZero<0, 0>(s[0], desc(dq), desc(dk));
#pragma unroll
    for (int kk = 1; kk < D / 16; ++kk) {
      const uint32_t off_q = (kk / 4) * (BM * 128) + (kk % 4) * 32, off_k = (kk / 4) * (BN * 128) + (kk % 4) * 32;
      Wgmma<T, BN>::template SS<0, 0>(s[0], desc(dq + (off_q >> 4)), desc(dk + (off_k >> 4)), 1);
    }
    WgmmaCommit();
  };

  if (cw == 1) sched_arrive();  // warpgroup 0's first turn
  int tile = next_tile();
  // With the intra-warpgroup overlap, a tile's first S is issued in the turn before the tile starts: the
  // previous tile's last turn, beside its last PV (so that its epilogue runs under that S), or this one for
  // the CTA's first tile. Where the next tile has no keys or there is none, that S multiplies whatever the
  // buffers hold and is discarded: no branch between a commit and its wait (ptxas serialised every wgmma
  // of the kernel across one, C7514, in the backward).
  if constexpr (Tile::kIntraWgOverlap) {
    wait_first_k(tile);
    sched_sync();
    issue_s(desc_q_of());
    sched_arrive();
    WgmmaWait<0>();
  }
  while (tile < p.num_tiles) {
    const int slot = int((q_iter - 1) & 1);
    const int q_stage = Tile::kQStages == 2 ? slot : 0;
    // The q block and head from the record's qb * hq + h: ptxas recomputes them where used instead of
    // holding them across the mainloop (held as two fields, the D 64 consumers spilled).
    const int qb = tile / fp.hq, h = tile % fp.hq;
    const int64_t r0 = int64_t(qb) * BM;
    const int64_t wr0 = r0 + cw * WM;                 // the warpgroup's first row
    const int64_t row = wr0 + wwarp * 16 + g;          // this thread's rows: row, row + 8

    float o[DT][4];
#pragma unroll
    for (int di = 0; di < DT; ++di) o[di][0] = o[di][1] = o[di][2] = o[di][3] = 0.0f;
    uint32_t pa[NT / 2][4];
    Sm90RowSoftmax softmax;
    float row_max[2] = {-INFINITY, -INFINITY};  // kMaxLogit: this thread's cells of its two rows so far
    int lo[2], hi[2];
    TileRange interior{1, 0};

    // The first step from the record (shared memory); the walk serves the slices after it (its loads are
    // waited for only where the first slice ends).
    FwdStep st = bars.tile[slot].Step();
    MbarArrive(&bars.tile_empty[slot]);  // after the record is read (the arrive releases the slot)
    const SliceWalk walk(args, fp.lists, qb);
    // Per group of slices (FwdStep): the two rows' key intervals and the key tiles needing no per-cell mask.
    auto start_group = [&]() { GroupRowMasks(walk, args, st, wr0, WM, BN, row, lo, hi, &interior); };
    // O += P(j) V(j) from the stage `at`, issued (not waited; V waited for by the caller).
    auto issue_pv = [&](const PipeState<kStages>& at) {
      const uint32_t dv = desc_v + ((at.stage * Tile::kVBytes) >> 4);
      // Each wgmma batch has its own wgmma.fence, and the register fences (empty asm writing o and pa) go
      // before it (C7519 otherwise: ptxas injects its own warpgroup.arrive).
      FenceRegs(o);
      FenceRegs(pa);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < NT / 2; ++kk) Wgmma<T, Dv>::template RS<1>(o, pa[kk], desc(dv + ((kk * 2048) >> 4)), 1);
      WgmmaCommit();
    };
    // The softmax of S(j) in parts: mask_s applies the softcap and the mask and says which rows have keys in
    // the step; the full pass (softmax_full: the tile's first step, D 256) then runs the update, alpha the
    // factor O takes before the next PV. The overlapped mainloop instead takes the exponentials against the
    // rows' current maxima (keep_max) and keeps them if the whole warpgroup may (a warp alone cannot take the
    // other path: it issues a wgmma); else it computes S(j) again (its K is still in its stage) and makes the
    // full pass, rare once the rows' maxima have settled.
    auto mask_s = [&](bool (&has_keys)[2]) {
      const int c0 = st.c0;
      FenceRegs(s[0]);
      if constexpr (softcap) ApplySoftcap(s, fp.scale, fp.softcap);
      has_keys[0] = has_keys[1] = true;
      if (!interior.Contains(c0)) {
        MaskRowsWarp<1, NT>(s, lo, hi, c0, t);
#pragma unroll
        for (int r = 0; r < 2; ++r) has_keys[r] = lo[r] < hi[r] && lo[r] < c0 + BN && hi[r] > c0;
      }
      if constexpr (kMaxLogit) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
          row_max[half] = fmaxf(row_max[half], Sm90RowSoftmax::RowMax(s[0], half));
      }
    };
    auto softmax_full = [&](float (&alpha)[2]) {
      bool has_keys[2];
      mask_s(has_keys);
      softmax.Update(s[0], scale_log2, alpha);
    };
    auto keep_max = [&](const bool (&has_keys)[2]) -> bool {
      float sum[2];
      const bool ok = softmax.ExpKeepingMax(s[0], scale_log2, has_keys, sum);
      // The vote's answer is the same on every thread; __all_sync lets ptxas see that it is warp-uniform (else the
      // branch on it counts as divergent, and the wgmma descriptors leave the uniform registers: R2UR per wgmma).
      if (!__all_sync(0xffffffffu, NamedBarrierAll(kKeptMaxBarrier + cw, 128, ok))) return false;
      softmax.Keep(sum, has_keys);
      return true;
    };
    // A Q buffer or K / V stage is free once every consumer is done with it (kReleasesPerStage arrivals; every
    // consumer warp passes every release). At D 64 / 128 each warp's elected lane arrives: a predicated
    // arrive, no branch (one arrival per warpgroup, by its first warp, cost a taken branch per release in
    // the other three). At D 256 thread 0 of each warpgroup (an elected lane there measured +1.1%).
    auto release = [&](uint64_t* bar) {
      if constexpr (Tile::kIntraWgOverlap) {
        if (ElectOne()) MbarArrive(bar);
      } else if (wtid == 0) {
        MbarArrive(bar);
      }
    };
    // The next step of the walk in two parts. next_step (a branch: ptxas schedules within a basic block, so
    // this call, placed between the softmax and the wait for PV, keeps that wait behind the softmax, below)
    // moves to the group's next key tile, or at the group's end finds the cursor after it (kGroupEnd);
    // next_group then takes the group from that cursor and makes its masks, after P is packed, where S's
    // registers are free (the whole walk beside S(j)'s probabilities took the consumers to the register
    // limit: ptxas re-read the thread index in every step, +1.4-3% cycles on walks without groups).
    constexpr int kWalkOver = 0, kSameGroup = 1, kGroupEnd = 2;
    int next_cur = -1;
    auto next_step = [&]() -> int {
      st.c0 += BN;
      if (st.c0 < st.ke) return kSameGroup;
      next_cur = walk.Next(args, st.last);
      return kGroupEnd;
    };
    auto next_group = [&]() -> int {
      FwdStepFrom(walk, args, r0, BM, p.group_gap, next_cur, &st);
      if (st.cur < 0) return kWalkOver;
      start_group();
      return kSameGroup;
    };

    // Turns: a step's S and PV are one batch (sync before S, arrive after PV); the tile's last PV and the
    // next tile's first S are one batch. Same count in both warpgroups.
    //
    // Step j (FA3's intra-warpgroup overlap, its order): wait K(j), V(j-1); take the turn; issue S(j) and
    // O += P(j-1) V(j-1); hand the turn over; wait for S(j) (PV(j-1) may still run); release K(j); softmax of
    // S(j) -> P(j), alpha(j); next step (a branch); wait for PV(j-1); release V(j-1); O *= alpha(j) where
    // some row's max grew by more than kRescaleSlack (rare once the maxima have settled); pack P(j).
    // The wait for PV(j-1) must stay after the softmax: in one basic block with it, ptxas hoisted that
    // WARPGROUP.DEPBAR above the whole softmax (its successors, the O rescale and the P packs into the
    // registers PV(j-1) reads, made it the critical path), so the softmax never overlapped PV within the
    // warpgroup. FA3 rescales O in the turn, between the two GEMM batches, under S(j); here it is mostly
    // skipped, and the turn holds only the two issues.
    if constexpr (Tile::kIntraWgOverlap) {
      if (st.cur >= 0) {
        start_group();
        release(&bars.k_empty[kv.stage]);
        float alpha[2];
        softmax_full(alpha);  // alpha 1: O is still zero
        PackP<T, NT>(s[0], pa);
        PipeState<kStages> prev = kv;
        kv.Advance();
        int more = next_step();
        if (more == kGroupEnd) more = next_group();
        while (more != kWalkOver) {
          MbarWait(&bars.k_full[kv.stage], kv.phase);
          MbarWait(&bars.v_full[prev.stage], prev.phase);
          sched_sync();
          issue_s(desc_q_of());
          issue_pv(prev);
          sched_arrive();
          WgmmaWait<1>();  // S(j) has landed
          // The usual path: the mask, the exponentials, the vote, the rest of the step. The rare ones (S again,
          // then the full pass through the same mask lines: mask_s once in the loop) are reached by goto, so
          // that the usual path no longer jumps over the full update (ptxas still lays S again out right after
          // the vote). rescale, not NeedsRescale's vote: alpha is 1 on the usual path.
          bool full = false, rescale = false;  // rescale: O takes alpha (after a full pass only)
        softmax_pass:
          {
            bool has_keys[2];
            mask_s(has_keys);
            if (full) goto full_update;
            if (!keep_max(has_keys)) goto again;
          }
        rest_of_step:
          {
            release(&bars.k_empty[kv.stage]);
            const PipeState<kStages> done = prev;
            prev = kv;
            kv.Advance();
            more = next_step();
            WgmmaWait<0>();  // O += P(j-1) V(j-1) has landed
            FenceRegs(o);
            release(&bars.v_empty[done.stage]);
            // O takes alpha(j) before PV(j): here, with nothing in flight, where a branch costs nothing (rarely
            // taken once the rows' maxima have settled).
            if (rescale) Sm90RowSoftmax::Rescale(o, alpha);
            PackP<T, NT>(s[0], pa);
            if (more == kGroupEnd) more = next_group();
          }
          continue;
        again:
          issue_s(desc_q_of());  // S(j) again
          WgmmaWait<0>();
          full = true;
          goto softmax_pass;
        full_update:
          softmax.Update(s[0], scale_log2, alpha);
          rescale = Sm90RowSoftmax::NeedsRescale(alpha);
          goto rest_of_step;
        }
        // The last S wgmma has landed (kOInQ: the buffer is released after the epilogue's store instead).
        if constexpr (!Tile::kOInQ) release(&bars.q_empty[q_stage]);
        tile = next_tile();
        MbarWait(&bars.v_full[prev.stage], prev.phase);  // V and the next tile's K before the turn
        wait_first_k(tile);
        sched_sync();
        issue_pv(prev);
        issue_s(desc_q_of());  // the next tile's first S: the epilogue below runs under it
        sched_arrive();
        WgmmaWait<1>();  // the last PV has landed
        FenceRegs(o);
        release(&bars.v_empty[prev.stage]);
      } else {
        if constexpr (!Tile::kOInQ) release(&bars.q_empty[q_stage]);
        tile = next_tile();
        wait_first_k(tile);
        sched_sync();
        issue_s(desc_q_of());
        sched_arrive();
        if (fp.out_prev != nullptr) {  // a merging call's tile without keys: nothing written (below)
          WgmmaWait<0>();
          continue;
        }
      }
    } else {
      // Without the intra-warpgroup overlap (D 256, FA3's loop for that case): step j is two turns, S(j)
      // and then O += P(j) V(j), each waited for; the other warpgroup's GEMMs run under this one's softmax
      // (ping-pong). Only S or P is live next to O (128 + 40 registers).
      if (st.cur < 0 && fp.out_prev != nullptr) {  // a merging call's tile without keys: nothing written
        release(&bars.q_empty[q_stage]);
        tile = next_tile();
        continue;
      }
      if (st.cur >= 0) start_group();
      while (st.cur >= 0) {
        MbarWait(&bars.k_full[kv.stage], kv.phase);
        sched_sync();
        issue_s(desc_q_of());
        sched_arrive();
        WgmmaWait<0>();
        release(&bars.k_empty[kv.stage]);
        float alpha[2];
        softmax_full(alpha);
        if (Sm90RowSoftmax::NeedsRescale(alpha)) Sm90RowSoftmax::Rescale(o, alpha);
        PackP<T, NT>(s[0], pa);
        MbarWait(&bars.v_full[kv.stage], kv.phase);
        sched_sync();
        issue_pv(kv);
        sched_arrive();
        WgmmaWait<0>();
        FenceRegs(o);
        release(&bars.v_empty[kv.stage]);
        kv.Advance();
        if (next_step() == kGroupEnd) next_group();
      }
      if constexpr (!Tile::kOInQ) release(&bars.q_empty[q_stage]);
    }

    // -------------------------------------------------------------------------------------------- epilogue
    // Not for a merging call's tiles without keys (passed over above): out and lse hold the earlier call's
    // values in place (a distributed stage call has many such tiles: q blocks none of whose rows need
    // fetched keys).
    float lse[2];
    softmax.Finish(o, scale_log2, lse);
    if (fp.out_prev != nullptr)
      MergeWithPrevious<T, 1, DT>(reinterpret_cast<float(&)[1][DT][4]>(o), lse, static_cast<const T*>(fp.out_prev),
                                  fp.lse_prev, wr0 + wwarp * 16, tq, fp.hq, h, lane);
    if (wtid == 0) BulkWaitRead();  // the previous tile's store has read the staging buffer
    NamedBarrierSync(kEpilogueBarrier + cw, 128);
    // O by 16 columns, four 8x8 matrices per instruction (StMatrixX4): lane l addresses row 16 wwarp + (l & 15),
    // columns + 8 (l / 16); columns di * 8 .. + 15 lie in one 64-column chunk (di even).
#pragma unroll
    for (int di = 0; di < DT; di += 2) {
      const int col = di * 8 + (lane >> 4) * 8, r = wwarp * 16 + (lane & 15);
      StMatrixX4(SmemAddr(so_wg + (col / 64) * Tile::kOChunkBytes) + Swizzle128B(r, col % 64),
                 Elem<T>::Pack(o[di][0], o[di][1]), Elem<T>::Pack(o[di][2], o[di][3]),
                 Elem<T>::Pack(o[di + 1][0], o[di + 1][1]), Elem<T>::Pack(o[di + 1][2], o[di + 1][3]));
    }
    FenceProxyAsyncShared();
    NamedBarrierSync(kEpilogueBarrier + cw, 128);
    if (wtid == 0) {
#pragma unroll
      for (int c = 0; c < kVChunks; ++c) TmaStore3d(&p.out_map, so_wg + c * Tile::kOChunkBytes, 64 * c, h, int(wr0));
      BulkCommit();
      if constexpr (Tile::kOInQ) {
        // The staging rows are this warpgroup's Q rows: the next tile's Q may land once the store has read them.
        BulkWaitRead();
        MbarArrive(&bars.q_empty[q_stage]);
      }
    }
    if (t == 0) {
      if (row < tq) fp.lse[row * fp.hq + h] = lse[0];
      if (row + 8 < tq) fp.lse[(row + 8) * fp.hq + h] = lse[1];
    }
    if constexpr (kMaxLogit) {
      // Raw scores (softcapped logits, whose scale is 1) to logits; the row's four threads' maxima joined.
      const float unit = softcap ? 1.0f : fp.scale;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float mx = QuadMax(row_max[half]);
        row_max[half] = mx == -INFINITY ? -INFINITY : mx * unit;
      }
      if (t == 0) {
        if (row < tq) fp.max_logit[row * fp.hq + h] = row_max[0];
        if (row + 8 < tq) fp.max_logit[(row + 8) * fp.hq + h] = row_max[1];
      }
    }
    if constexpr (Tile::kIntraWgOverlap) WgmmaWait<0>();  // the next tile's first S (or the discarded one)
    else tile = next_tile();
  }
  if (cw == 0) sched_sync();  // the turn warpgroup 1 handed over last
  if (wtid == 0) BulkWait();
}

}  // namespace magi_jax::cuda
