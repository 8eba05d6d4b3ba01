// The sm90 backward's dK/dV kernel: TMA loads into a shared-memory ring completed on mbarriers, wgmma on two
// consumer warpgroups, a producer warp (setmaxnreg). One CTA per (k block of 128 keys, kv head), like the
// mma.sync dk/dv kernel (flash_bwd_dkdv_kernel.h), whose walk it shares (scheduler.h, KvStep): every slice
// of the k block's list, every q head of the GQA group, every row tile of 64 rows attending the keys.
// Only the producer walks; it hands each step (first row, q head, the slice) to the consumers in shared
// memory (BwdSm90Step), and ends the walk with one row_full phase without data (kStepEnd).
//   producer warp:  K, V once -> kv_full; per step, after row_empty[stage]: Q, dO by TMA -> row_full[stage],
//                   then lse (log2 units, +inf for empty rows), delta and the step by plain stores, and the
//                   arrival on row_full[stage]
//   consumer wg w:  keys [64 w, 64 w + 64) of the block (wgmma M = 64); per step
//                   S^T = K Q^T, dP^T = V dO^T (SS, both K-major, N = 64 rows),
//                   P^T = exp2(S^T scale - lse), dS^T = P^T (dP^T - delta) (exact mask per cell unless the
//                   tile is interior for the warpgroup's 64 keys),
//                   dV += P^T dO, dK += dS^T Q (RS: P^T / dS^T packed in registers; dO, Q MN-major),
//                   kDq: dS^T -> smem (swizzled, three buffers), named-barrier handshake with the other
//                   consumer (dQ(i) is issued a step late, beside dK / dV(i + 1): see the consumer loop),
//                   dQ = dS K (SS, A = dS^T MN-major, B = K MN-major), scaled dQ -> the warpgroup's fp32
//                   staging buffer, one TMA reduce-add (cp.reduce.async.bulk.tensor .add) of the 64 x 64
//                   box into the accumulator. The steps are software-pipelined (see the consumer loop):
//                   S^T(i+1) is issued behind dQ(i-1), P^T(i) is computed while dP^T(i) runs, and the Q / dO
//                   stage is released once dV / dK have landed.
// A consumer thread holds keys 16 v + g and 16 v + g + 8 of its warpgroup's 64 (v the warp in the
// warpgroup), columns (rows of q) 8 i + 2 t (+1): the mma.sync C layout, so mask.h's MaskRows applies with
// the key intervals of KeyInterval. dQ split: D 128, warpgroup w computes dQ columns [64 w, 64 w + 64) over
// all 128 keys (N = 64, 8 k steps); D 64, warpgroup w computes all 64 columns over its own 64 keys (both
// warpgroups add into the accumulator). Either way the dQ accumulator is 32 registers.
// dQ reduce: rather than 16 float2 atomics per thread per step (REDG, each a scattered 32-byte L2 atomic),
// the threads store their fragment into the warpgroup's buffer (conflict-free, StoreDq), fence.proxy.async,
// a warpgroup barrier, and one thread issues the box (rows past Tq skipped by TMA, as the atomics skipped
// them). The buffer is rewritten one step later, after the issuing thread's cp.async.bulk.wait_group.read,
// which the following handshake sync (all of the warpgroup's threads) orders before every thread's stores:
// no extra barrier.
// Epilogue: dK (scaled) and dV packed into the (now idle) Q / dO rings in the 128-byte swizzle, one TMA store
// per 64-column chunk and warpgroup (keys past the end clipped by TMA).
// GQA split (kGqaSplit, D 128 with kDq): a CTA per (k block, q head) instead of per (k block, kv head), so
// that the tile order's L2 sections hold one q head's Q / dO rather than the whole group's
// (launch_bwd_sm90.cu). The walk and the mainloop are those of a group of 1; the CTAs of a kv head's q heads
// each add their dK, dV partials into fp32 accumulators by TMA reduce-adds (staged like the split-D dQ:
// 32-column boxes through dq_buf), which the handler converts to the output dtype afterwards (handlers.cu).
#pragma once

#include "block_lists.h"
#include "mask.h"
#include "params.h"
#include "scheduler.h"
#include "sm90_ptx.h"
#include "sm90_wgmma.h"
#include "softmax.h"
#include "tile_size_sm90.h"

namespace magi_jax::cuda {

struct BwdSm90Params {
  CUtensorMap q_map, do_map;    // [Tq, Hq, D] as (D, Hq, Tq), boxes (64, 1, kBlockM)
  CUtensorMap k_map, v_map;     // [Tk, Hkv, D], boxes (64, 1, kBlockN)
  CUtensorMap dk_map, dv_map;   // [Tk, Hkv, D], boxes (64, 1, kKeysPerWarpgroup)
  CUtensorMap dq_map;           // dq_accum [Tq, Hq, D] fp32 as (32, D / 32, Hq, Tq), boxes (32, kDqBoxCols / 32, 1, kBlockM)
  // Warpgroup 1 starts its walk once warpgroup 0 has computed its first P^T, dS^T (MAGI_JAX_SM90_BWD_STAGGER,
  // default 1): half a step apart, one warpgroup's softmax runs under the other's GEMMs. Only with dQ (kDq):
  // without it the warpgroups never wait for each other within the walk.
  int stagger;
  // A second key source (the fetched rows of a distributed backward): keys [split_row, Tk) are rows
  // [0, Tk - split_row) of k2, v2 and their gradients go to dk2, dv2. split_row is a multiple of kBlockN
  // (a CTA's keys come from one source); INT_MAX without a second source.
  CUtensorMap k2_map, v2_map, dk2_map, dv2_map;
  int split_row;
  // The CTAs' tiles, k block + num_kb * kv head, in the grid's linear order: longest first in L2 sections
  // (launch_bwd_sm90.cu); nullptr: the grid's own order (k block blockIdx.x, kv head blockIdx.y).
  const int32_t* tiles;
  int num_kb;
  BwdParams base;
  // The GQA split's accumulators (kGqaSplit; the CTAs' tiles are then k block + num_kb * q head):
  // base.dk_accum, base.dv_accum [Tk, Hkv, D] fp32 (rows base.accum_row_heads heads apart) as (32, D / 32,
  // Hkv, Tk), boxes (32, 1, 1, kKeysPerWarpgroup). Last, so that the fields above keep their offsets (the
  // other kernels' code unchanged).
  CUtensorMap dk_accum_map, dv_accum_map;
};

// The maps holding a CTA's keys (from key c0 on) and the row of c0 in them.
struct KeySource {
  const CUtensorMap *k, *v, *dk, *dv;
  int row;
};
MAGI_DEV KeySource CtaKeySource(const BwdSm90Params& p, int64_t c0) {
  if (c0 >= p.split_row) return {&p.k2_map, &p.v2_map, &p.dk2_map, &p.dv2_map, int(c0 - p.split_row)};
  return {&p.k_map, &p.v_map, &p.dk_map, &p.dv_map, int(c0)};
}

// fp32 C fragments (64 x 64) -> A register fragments of the four k16 steps (as the forward's PackP).
template <typename T>
MAGI_DEV void PackA64(const float (&s)[8][4], uint32_t (&a)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    a[kk][0] = Elem<T>::Pack(s[2 * kk][0], s[2 * kk][1]);
    a[kk][1] = Elem<T>::Pack(s[2 * kk][2], s[2 * kk][3]);
    a[kk][2] = Elem<T>::Pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[kk][3] = Elem<T>::Pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// acc = A B^T over the head dim, A (BN rows) and B (BM rows) K-major in 128-byte swizzle chunks of 64
// columns: the k16 steps of S^T = K Q^T and of dP^T = V dO^T, as one commit group (the caller fences).
template <typename T, int N, int D, int BN, int BM, int NT>
MAGI_DEV void IssueKMajorSS(float (&acc)[NT][4], uint64_t da, uint64_t db) {
  Wgmma<T, N>::template SSZero<0, 0>(acc, da, db);
#pragma unroll
  for (int kk = 1; kk < D / 16; ++kk) {
    const uint32_t off_a = (kk / 4) * (BN * 128) + (kk % 4) * 32, off_b = (kk / 4) * (BM * 128) + (kk % 4) * 32;
    Wgmma<T, N>::template SS<0, 0>(acc, DescAdd(da, off_a), DescAdd(db, off_b), 1);
  }
  WgmmaCommit();
}

// acc += A B over kSteps k16 steps, A K-major (P^T or dS^T, [keys][rows]: steps 32 bytes apart) and B MN-major
// (a dO or Q stage: steps 2048 bytes apart): dV += P^T dO, dK += dS^T Q. Not committed (the caller groups).
template <typename T, int N, int kSteps, int NT>
MAGI_DEV void AccumulateSS(float (&acc)[NT][4], uint64_t da, uint64_t db) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
    Wgmma<T, N>::template SS<0, 1>(acc, DescAdd(da, kk * 32), DescAdd(db, kk * 2048), 1);
}

// acc = A B over kSteps k16 steps, both MN-major (steps 2048 bytes apart): dQ = dS K with A the dS^T buffer and B
// the K tile. Not committed (the caller groups).
template <typename T, int N, int kSteps, int NT>
MAGI_DEV void IssueDqSS(float (&acc)[NT][4], uint64_t da, uint64_t db) {
  Wgmma<T, N>::template SSZero<1, 1>(acc, da, db);
#pragma unroll
  for (int kk = 1; kk < kSteps; ++kk)
    Wgmma<T, N>::template SS<1, 1>(acc, DescAdd(da, kk * 2048), DescAdd(db, kk * 2048), 1);
}

// A warpgroup's dQ buffer is the dq_map box: 128-byte lines ordered (row, 32-column chunk c), line
// l = 2 row + c, its 16-byte units XOR-ed by l & 7 (TMA's 128-byte swizzle; the buffer is 1024-byte
// aligned). Thread (g, t) of warp w stores row r = 16 w + 8 half + g, columns 8 di + 2 t (+1), di = 4 c + a:
// l & 7 = 2 (g & 3) + c, so the byte offset is
//   (32 w + 2 g) * 128 + 2048 half + 128 c + ((8 t ^ 32 (g & 3)) ^ (32 a + 16 c)):
// one per-thread base (DqStoreBase), XOR-ed by a constant per (c, a), plus an immediate per (half, c).
// A half-warp's float2 stores (g = 0..3, t = 0..3) then hit 8 distinct units, all 32 banks: g sits in the
// XOR's upper two bits, t / 2 in the lowest.
// Computed where it is used (%laneid is read by a volatile asm: not hoisted), not held across the consumer
// loop, which sits at R229 of its 232 registers: one more live register put the D 128 kernels into spills.
MAGI_DEV uint32_t DqStoreBase(const void* buf, int wwarp) {
  uint32_t lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  const uint32_t g = lane >> 2, t = lane & 3;
  return SmemAddr(buf) + (32u * wwarp + 2u * g) * 128u + ((8u * t) ^ (32u * (g & 3)));
}
// The 16 float2 of a thread's scaled dQ fragment (64 rows x 64 columns C layout) into the buffer.
MAGI_DEV void StoreDq(uint32_t base, const float (&dq)[8][4], float scale) {
#pragma unroll
  for (int di = 0; di < 8; ++di) {
    const int c = di / 4, a = di % 4;
    const uint32_t addr = (base ^ uint32_t(32 * a + 16 * c)) + 128u * c;
#pragma unroll
    for (int half = 0; half < 2; ++half)
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr + 2048u * half), "f"(dq[di][2 * half] * scale),
                   "f"(dq[di][2 * half + 1] * scale)
                   : "memory");
  }
}

// What the producer tells the consumers about a step (the consumers do not walk the slice lists: the walk's
// ~25 loop-carried registers would not fit beside the pipelined accumulators). In the barrier region, one per
// stage, written by the producer's lane 0 before its row_full arrival (release) and read after the consumers'
// row_full wait (acquire); rewritten only after the stage's row_empty phase.
struct BwdSm90Step {
  int32_t rb, head, flags, type;  // first row, q head, 0 or kStepEnd, slice type
  int32_t qs, qe, ks, ke;         // the slice, clamped as LoadSlice clamps it
};
constexpr int32_t kStepEnd = 4;  // no step: the walk is over (a row_full phase without data)

// The 64-key consumers' read of a step record {first row, q head, flags}: lane 0's values, broadcast (a value
// read from shared memory is not known to be warp-uniform: branching on it would make the wgmmas "divergent").
MAGI_DEV void ReadStepRecord(const BwdSm90Step* step, int& rb, int& head, int& flags) {
  uint32_t r, h, f;
  [[maybe_unused]] uint32_t type;  // the record's fourth field, loaded with the others (one v4 load)
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r), "=r"(h), "=r"(f), "=r"(type)
               : "r"(SmemAddr(step))
               : "memory");
  rb = __shfl_sync(0xffffffffu, int(r), 0);
  head = __shfl_sync(0xffffffffu, int(h), 0);
  flags = __shfl_sync(0xffffffffu, int(f), 0);
}

// Barrier region layout (Tile::kBarBytes): the mbarriers, then the steps, then per consumer warpgroup and
// step parity the (q head, first row) of a dQ box, then the CTA's (k block, kv head) (kGqaSplit: (k block,
// q head, kv head)).
template <int kStages>
struct BwdSm90Region {
  static constexpr uint32_t kStepOffset = 64;
  static constexpr uint32_t kDqCoordOffset = kStepOffset + kStages * sizeof(BwdSm90Step);
  static constexpr uint32_t kTileOffset = kDqCoordOffset + 4 * 8;
  static constexpr uint32_t kBytes = kTileOffset + 12;
  static_assert(sizeof(BwdSm90Barriers<kStages>) <= kStepOffset, "mbarriers fit before the steps");
};

// The CTA's k block (field 0) or kv head (field 1; kGqaSplit: the q head, its kv head in field 2), which
// thread 0 decodes into the barrier region (kTileOffset) at the start. Read where used, by a volatile load:
// held in registers across the consumer loop (at R229 of its 232), they put the kernels into spills.
MAGI_DEV int CtaTile(uint32_t tile_addr, int field) {
  int v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(tile_addr + 4u * field) : "memory");
  return v;
}

// ------------------------------------------------------------------------------- per-step math (both consumers)
// A consumer thread (g, t) of warp wwarp holds S^T / dP^T for keys k0 + 16 wwarp + g (+ 8) x the step's rows
// r0 + 8 ni + 2 t (+ 1), ni < NT (the C layout of an m64nNk16 wgmma with N = 8 NT).

// The exact mask of the step's slice on S^T, unless the keys [k0, k0 + nk) x rows [r0, r0 + 8 NT) tile is
// interior. The test is lane 0's: a branch on a value read from shared memory would not be uniform to ptxas.
template <int NT>
MAGI_DEV void MaskStep(float (&s)[1][NT][4], const BwdSm90Step& info, int64_t k0, int nk, int r0, int wwarp, int g,
                       int t) {
  Slice sl;
  sl.qs = info.qs;
  sl.qe = info.qe;
  sl.ks = info.ks;
  sl.ke = info.ke;
  sl.type = info.type;
  const bool interior = __shfl_sync(0xffffffffu, int(KeyTileInterior(sl, k0, nk, r0, 8 * NT)), 0) != 0;
  if (!interior) {
    const int64_t key = k0 + wwarp * 16 + g;  // this thread's keys: key, key + 8
    int klo[2], khi[2];
    KeyInterval(sl, key, &klo[0], &khi[0]);
    KeyInterval(sl, key + 8, &klo[1], &khi[1]);
    MaskRowsWarp<1, NT>(s, klo, khi, r0, t);
  }
}

// P^T = exp2(S^T scale_log2 - lse), lse_s: the step's lse (log2 units) from row r0.
template <int NT>
MAGI_DEV void ExpScores(float (&s)[1][NT][4], const float* lse_s, int t, float scale_log2) {
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    const float2 l2 = *reinterpret_cast<const float2*>(lse_s + ni * 8 + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][ni][e] = Exp2(s[0][ni][e] * scale_log2 - ((e & 1) ? l2.y : l2.x));
  }
}

// dS^T = P^T (dP^T - delta) into dp, s holding P^T (ExpScores). delta: the step's, at this thread's column
// pairs (rows 8 ni + 2 t, + 1), read from shared memory (LoadDelta) before the wait for dP^T, so that the
// subtractions after that wait wait on nothing else (ncu put ~10% of the consumers' stall samples on them
// when they read delta there).
template <int NT>
MAGI_DEV void LoadDelta(const float* delta_s, int t, float2 (&delta)[NT]) {
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) delta[ni] = *reinterpret_cast<const float2*>(delta_s + ni * 8 + 2 * t);
}
template <int NT>
MAGI_DEV void DsFromProbs(const float (&s)[1][NT][4], float (&dp)[1][NT][4], const float2 (&delta)[NT]) {
#pragma unroll
  for (int ni = 0; ni < NT; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[0][ni][e] = s[0][ni][e] * (dp[0][ni][e] - ((e & 1) ? delta[ni].y : delta[ni].x));
}

// With softcap: s holds the capped score and becomes P^T here; dS^T takes the softcap derivative (0 on
// masked cells). delta is read here, after the wait (before it, the D 128 kernels spilled).
template <int NT>
MAGI_DEV void SoftcapProbsAndDs(float (&s)[1][NT][4], float (&dp)[1][NT][4], const float* lse_s, const float* delta_s,
                                int t, float scale_log2, float cap) {
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    const float2 dl = *reinterpret_cast<const float2*>(delta_s + ni * 8 + 2 * t);
    const float2 l2 = *reinterpret_cast<const float2*>(lse_s + ni * 8 + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = s[0][ni][e];
      const float prob = Exp2(x * scale_log2 - ((e & 1) ? l2.y : l2.x));
      const float ds = prob * (dp[0][ni][e] - ((e & 1) ? dl.y : dl.x));
      const float th = x / cap;
      s[0][ni][e] = prob;
      dp[0][ni][e] = x == -INFINITY ? 0.0f : ds * (1.0f - th * th);
    }
  }
}

// --------------------------------------------------------------------------- head dim 256 (kSplitD, !kRoles)
// The consumers of BwdSm90Tile<256> (tile_size_sm90.h): the CTA owns 64 keys; consumer warpgroup cw computes
// S^T, dP^T for rows [32 cw, 32 cw + 32) of the step's 64 (wgmma N 32, all 64 keys, the full D contraction),
// the mask, P^T and dS^T, and writes both (bf16, [64 keys][64 rows], 128-byte swizzle) into shared memory;
// after a barrier of both warpgroups it accumulates dV, dK for all 64 keys x its 128 columns from 128 cw (SS,
// A = P^T / dS^T K-major, B = dO / Q MN-major, N 128) and computes dQ = dS K for the 64 rows x the same
// columns (A = dS^T MN-major, B = K MN-major), drained as four boxes of 64 x 32 fp32, one at a time through
// its staging buffer, and TMA reduce-adds. Per step and warpgroup (nothing in flight across steps; at D 192
// issuing the next S^T, dP^T before the drain was 37% slower):
//   row_full wait | S^T, dP^T (two commit groups) | wait<1>: mask, P^T | wait<0>: dS^T | barrier 5 (the last
//   step's readers of P^T / dS^T are done) | P^T, dS^T -> smem, fence | barrier 1 | dV, dK | dQ | wait<1>:
//   release the Q / dO stage | wait<0> | drain dQ
// Registers per thread: dK, dV 64 + 64; S^T, dP^T 16 + 16; dQ 64 (S^T / dP^T dead by then): peak 192.
// Named barriers: 1 and 5 (both consumer warpgroups), 3 + cw (the warpgroup's dQ staging), 2 (epilogue).
// Thread (g, t) of warp w stores row r = 16 w + 8 half + g, columns 8 i + 2 t (+1) of a 64 x 32 fp32 box in
// the 128-byte swizzle (128-byte lines, one per row, 16-byte units XOR-ed by r & 7 = g): two wavefronts a
// warp store, the minimum for 256 bytes. Box j: columns [32 j, 32 j + 32) of a 64-row C fragment (dQ here;
// dK, dV of the GQA split's epilogue).
template <int DT>
MAGI_DEV void StoreDqBox32(unsigned char* buf, int wwarp, int g, int t, const float (&dq)[DT][4], int j,
                           float scale) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 16 * wwarp + 8 * half + g;
      const uint32_t addr = SmemAddr(buf) + uint32_t(r) * 128u + (uint32_t((2 * i + (t >> 1)) ^ g) << 4) + 8u * (t & 1);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(dq[4 * j + i][2 * half] * scale),
                   "f"(dq[4 * j + i][2 * half + 1] * scale)
                   : "memory");
    }
}

// Thread (g, t) of warp w's part of a 64-row C fragment: columns col, col + 1 (col = 8 di + 2 t) of rows r and
// r + 8 (r = 16 w + g, plus the fragment's first row), scaled and packed to T, into a [chunks][BN rows][64]
// tile in the 128-byte swizzle from chunk chunk0: the epilogues stage dK, dV so for their TMA stores.
template <typename T, int BN>
MAGI_DEV void StageCFragment(unsigned char* buf, int chunk0, int r, int col, const float (&c)[4], float scale) {
  const int chunk = chunk0 + col / 64;
  const uint32_t o0 = chunk * (BN * 128) + Swizzle128B(r, col % 64);
  const uint32_t o1 = chunk * (BN * 128) + Swizzle128B(r + 8, col % 64);
  *reinterpret_cast<uint32_t*>(buf + o0) = Elem<T>::Pack(c[0] * scale, c[1] * scale);
  *reinterpret_cast<uint32_t*>(buf + o1) = Elem<T>::Pack(c[2] * scale, c[3] * scale);
}

template <typename T, int D, bool kSoftcap>
MAGI_DEV void BwdSm90SplitDConsumer(const BwdSm90Params& p, unsigned char* smem, uint32_t tile_addr, int cw) {
  using Tile = BwdSm90Tile<D>;
  constexpr int BN = Tile::kBlockN, BM = Tile::kBlockM, kStages = Tile::kStages;
  constexpr int kWgCols = D / 2;  // the warpgroup's columns of dK, dV and dQ, from kWgCols cw
  constexpr int kHalfM = BM / 2, DT = kWgCols / 8, NT = kHalfM / 8;
  const int col0 = cw * kWgCols;
  static_assert(NT % 2 == 0, "P^T and dS^T leave by 16 columns (StMatrixX4)");
  static_assert(BN == 64 && BM == 64 && D == 256 && Tile::kDqStagedBoxes == 1,
                "the split-D consumer is written for 64 keys, 64 rows, D 256, one dQ box at a time");
  static_assert(Tile::kDqBoxCols == 32, "dQ leaves in boxes of 32 columns");
  using Region = BwdSm90Region<kStages>;
  unsigned char* sk = smem + Tile::kKOffset;
  unsigned char* sv = smem + Tile::kVOffset;
  unsigned char* sq = smem + Tile::kQOffset;
  unsigned char* sdo = smem + Tile::kDoOffset;
  const float* slse = reinterpret_cast<const float*>(smem + Tile::kLseOffset);
  const float* sdelta = reinterpret_cast<const float*>(smem + Tile::kDeltaOffset);
  unsigned char* sp = smem + Tile::kDsOffset;                    // P^T [64 keys][64 rows]
  unsigned char* sds = smem + Tile::kDsOffset + Tile::kDsBytes;  // dS^T [64 keys][64 rows]
  unsigned char* dq_buf = smem + Tile::kDqOffset + cw * Tile::kDqStageBytes;
  auto& bars = *reinterpret_cast<BwdSm90Barriers<kStages>*>(smem + Tile::kBarOffset);
  BwdSm90Step* steps = reinterpret_cast<BwdSm90Step*>(smem + Tile::kBarOffset + Region::kStepOffset);
  const BwdParams& bp = p.base;
  const int tid = threadIdx.x, lane = tid & 31, wtid = tid & 127, wwarp = wtid >> 5, g = lane >> 2, t = lane & 3;
  constexpr bool softcap = kSoftcap;
  const float scale_log2 = (softcap ? 1.0f : bp.scale) * kLog2e;

  // S^T = K Q^T, dP^T = V dO^T: A = K / V (all 64 keys, K-major), B = the warpgroup's 32 rows of the Q / dO
  // stage (K-major; 32 rows = 4 KB, swizzle-atom aligned).
  const uint64_t desc_k = SmemDesc128B(sk, 16), desc_v = SmemDesc128B(sv, 16);
  const uint64_t desc_q_k = SmemDesc128B(sq + cw * (kHalfM * 128), 16);
  const uint64_t desc_do_k = SmemDesc128B(sdo + cw * (kHalfM * 128), 16);
  // dV += P^T dO, dK += dS^T Q: A K-major ([keys][rows]), B = the warpgroup's 64-column chunks of the stage
  // (from chunk 2 cw), MN-major (LBO = the chunk stride).
  const uint64_t desc_p = SmemDesc128B(sp, 16), desc_ds = SmemDesc128B(sds, 16);
  const uint64_t desc_do_mn = SmemDesc128B(sdo + 2 * cw * (BM * 128), BM * 128);
  const uint64_t desc_q_mn = SmemDesc128B(sq + 2 * cw * (BM * 128), BM * 128);
  // dQ = dS K: A = dS^T MN-major, B = K's 64-column chunks of the warpgroup's dQ columns, MN-major.
  const uint64_t desc_ds_mn = SmemDesc128B(sds, 64 * 128);
  const uint64_t desc_k_mn = SmemDesc128B(sk + col0 / 64 * (BN * 128), BN * 128);

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int di = 0; di < DT; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[di][e] = 0.0f;
#pragma unroll
  for (int di = 0; di < DT; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) dv[di][e] = 0.0f;

  MbarWait(&bars.kv_full, 0);
  PipeState<kStages> ps;
  for (;;) {
    MbarWait(&bars.row_full[ps.stage], ps.phase);
    int rb, head, flags;
    ReadStepRecord(&steps[ps.stage], rb, head, flags);
    if (flags & kStepEnd) break;
    const uint32_t stage_off = ps.stage * Tile::kRowBytes, do_stage_off = ps.stage * Tile::kDoRowBytes;
    float s[1][NT][4], dp[1][NT][4];
    {
      const uint64_t dq_k = DescAdd(desc_q_k, stage_off), ddo_k = DescAdd(desc_do_k, do_stage_off);
      WgmmaFence();
      IssueKMajorSS<T, kHalfM, D, BN, BM>(s[0], desc_k, dq_k);
      IssueKMajorSS<T, kHalfM, D, BN, BM>(dp[0], desc_v, ddo_k);
    }
    const int row0 = cw * kHalfM;  // the warpgroup's first row of the step's 64
    const float* lse_s = slse + ps.stage * BM + row0;
    const float* delta_s = sdelta + ps.stage * BM + row0;
    WgmmaWait<1>();  // S^T has landed, dP^T still runs
    FenceRegs(s[0]);
    if constexpr (softcap) ApplySoftcap(s, bp.scale, bp.softcap);
    MaskStep<NT>(s, steps[ps.stage], int64_t(CtaTile(tile_addr, 0)) * BN, BN, rb + row0, wwarp, g, t);
    float2 delta[NT];
    if constexpr (!softcap) {
      ExpScores<NT>(s, lse_s, t, scale_log2);
      LoadDelta<NT>(delta_s, t, delta);
    }
    WgmmaWait<0>();  // dP^T has landed
    FenceRegs(dp[0]);
    if constexpr (softcap) SoftcapProbsAndDs<NT>(s, dp, lse_s, delta_s, t, scale_log2, bp.softcap);
    else DsFromProbs<NT>(s, dp, delta);
    // Both warpgroups have retired the last step's wgmmas (wait<0> below): P^T / dS^T may be rewritten.
    NamedBarrierSync(5, Tile::kConsumerThreads);
    {
      // Column pairs ni, ni + 1 of keys [16 wwarp, 16 wwarp + 16) as four 8x8 matrices (StMatrixX4): lane l
      // addresses key 16 wwarp + 8 ((l / 8) & 1) + l % 8, columns + 8 (l / 16).
      const int kr = wwarp * 16 + (lane & 15), dc = (lane >> 4) * 8;
#pragma unroll
      for (int ni = 0; ni < NT; ni += 2) {
        const int col = row0 + ni * 8 + dc;
        StMatrixX4(SmemAddr(sp) + Swizzle128B(kr, col), Elem<T>::Pack(s[0][ni][0], s[0][ni][1]),
                   Elem<T>::Pack(s[0][ni][2], s[0][ni][3]), Elem<T>::Pack(s[0][ni + 1][0], s[0][ni + 1][1]),
                   Elem<T>::Pack(s[0][ni + 1][2], s[0][ni + 1][3]));
        StMatrixX4(SmemAddr(sds) + Swizzle128B(kr, col), Elem<T>::Pack(dp[0][ni][0], dp[0][ni][1]),
                   Elem<T>::Pack(dp[0][ni][2], dp[0][ni][3]), Elem<T>::Pack(dp[0][ni + 1][0], dp[0][ni + 1][1]),
                   Elem<T>::Pack(dp[0][ni + 1][2], dp[0][ni + 1][3]));
      }
    }
    FenceProxyAsyncShared();
    NamedBarrierSync(1, Tile::kConsumerThreads);  // both warpgroups' rows of P^T, dS^T are in place
    float dq[DT][4];
    {
      const uint64_t ddo_mn = DescAdd(desc_do_mn, do_stage_off), dq_mn = DescAdd(desc_q_mn, stage_off);
      FenceRegs(dv);
      FenceRegs(dk);
      WgmmaFence();
      AccumulateSS<T, kWgCols, BM / 16>(dv, desc_p, ddo_mn);
      AccumulateSS<T, kWgCols, BM / 16>(dk, desc_ds, dq_mn);
      WgmmaCommit();
      IssueDqSS<T, kWgCols, BN / 16>(dq, desc_ds_mn, desc_k_mn);
      WgmmaCommit();
      WgmmaWait<1>();  // dV, dK have landed: the Q / dO stage is free (dQ reads K and dS^T only)
      FenceRegs(dv);
      FenceRegs(dk);
      MbarArriveIf(&bars.row_empty[ps.stage], wtid == 0);
    }
    WgmmaWait<0>();
    FenceRegs(dq);
#pragma unroll
    for (int j = 0; j < kWgCols / 32; ++j) {
      BulkWaitRead();  // the last reduce-add has read the buffer (only wtid 0 has bulk groups)
      NamedBarrierSync(3 + cw, 128);
      StoreDqBox32(dq_buf, wwarp, g, t, dq, j, bp.scale);
      FenceProxyAsyncShared();
      NamedBarrierSync(3 + cw, 128);  // the box is in dq_buf
      if (wtid == 0) {
        TmaReduceAdd4d(&p.dq_map, dq_buf, 0, col0 / 32 + j, head, rb);
        BulkCommit();
      }
      __syncwarp();
    }
    ps.Advance();
  }

  // Epilogue: every wgmma of both warpgroups is done and the producer has nothing in flight: the Q / dO rings
  // are free. dK (x scale) into the Q ring, dV into the dO ring, [chunks][64 keys][64], 128-byte swizzle;
  // the warpgroup stores its own chunks.
  NamedBarrierSync(2, Tile::kConsumerThreads);
  unsigned char* stage_k = sq;
  unsigned char* stage_v = sdo;
  // The warpgroup's chunks, from 2 cw.
#pragma unroll
  for (int di = 0; di < DT; ++di)
    StageCFragment<T, BN>(stage_k, 2 * cw, wwarp * 16 + g, di * 8 + 2 * t, dk[di], bp.scale);
#pragma unroll
  for (int di = 0; di < DT; ++di) StageCFragment<T, BN>(stage_v, 2 * cw, wwarp * 16 + g, di * 8 + 2 * t, dv[di], 1.0f);
  FenceProxyAsyncShared();
  NamedBarrierSync(3 + cw, 128);
  if (wtid == 0) {
    const int kb = CtaTile(tile_addr, 0), hk = CtaTile(tile_addr, 1);
    const KeySource src = CtaKeySource(p, int64_t(kb) * BN);
#pragma unroll
    for (int c = 2 * cw; c < 2 * cw + kWgCols / 64; ++c) TmaStore3d(src.dk, stage_k + c * (BN * 128), 64 * c, hk, src.row);
#pragma unroll
    for (int c = 2 * cw; c < 2 * cw + kWgCols / 64; ++c) TmaStore3d(src.dv, stage_v + c * (BN * 128), 64 * c, hk, src.row);
    BulkCommit();
    // Until the stores (and this thread's dQ reduce-adds) have read shared memory, not until they have
    // landed: the grid's end makes them visible to the next kernel (the dq convert), as CUTLASS's epilogues
    // rely on; the SM's next CTA starts a write latency sooner.
    BulkWaitRead();
  }
}

// ------------------------------------------------------------------------------------- head dim 192 (kRoles)
// The consumers of BwdSm90Tile<192, Dv> (tile_size_sm90.h): the CTA owns 64 keys and the warpgroups take
// roles, a step apart, rather than halves of every GEMM (as D 256's split-D consumers above: both in step,
// the tensor cores idle through both softmaxes). Warpgroup 0 computes S^T, dP^T for the step's 64 rows (wgmma
// N 64, as D 128's warpgroups do for theirs), the mask, P^T, dS^T, writes dS^T (bf16) into buffer i % 2 and
// accumulates dV += P^T dO from registers (RS, N Dv); warpgroup 1 takes dS^T(i) from there and accumulates dK
// += dS^T Q (N 192) and computes dQ = dS K (N 192), drained as six 64 x 32 boxes staged at once. While
// warpgroup 1 runs step i's GEMMs, warpgroup 0 runs step i + 1's softmax. Per step:
//   warpgroup 0: row_full wait | S^T, dP^T | wait<1>: mask, P^T | wait<0>: dS^T | dV (RS) | sync consumed(i - 2)
//                | dS^T -> buffer i % 2, arrive ready(i) | wait<0>: release the Q / dO stage
//   warpgroup 1: row_full wait | sync ready(i) | dK, dQ | wait<1>: release the stage | wait<0>: arrive
//                consumed(i) | drain dQ
// Named barriers ready(i) kReady + i % 2 and consumed(i) kConsumed + i % 2 (warpgroup 1 arrives for steps -2
// and -1 at its start, warpgroup 0 syncs for the last two steps at its end: every barrier completes).
// Registers per thread: warpgroup 0 dV Dv / 2 + S^T, dP^T 32 + 32 + fragments; warpgroup 1 dK 96 + dQ 96.
template <typename T, int D, int Dv, bool kSoftcap>
MAGI_DEV void BwdSm90RolesConsumer(const BwdSm90Params& p, unsigned char* smem, uint32_t tile_addr, int cw) {
  using Tile = BwdSm90Tile<D, Dv>;
  constexpr int BN = Tile::kBlockN, BM = Tile::kBlockM, kStages = Tile::kStages;
  constexpr int DT = D / 8, VT = Dv / 8, kBoxes = D / Tile::kDqBoxCols;
  static_assert(BN == 64 && BM == 64 && D == 192 && Tile::kDsBuffers == 2 && Tile::kDqStagedBoxes == kBoxes,
                "the roles consumer is written for 64 keys, 64 rows, D 192, two dS^T buffers, all dQ boxes staged");
  constexpr int kReady = 6, kConsumed = 8;  // named barriers 6, 7 and 8, 9 (by step parity)
  using Region = BwdSm90Region<kStages>;
  unsigned char* sk = smem + Tile::kKOffset;
  unsigned char* sv = smem + Tile::kVOffset;
  unsigned char* sq = smem + Tile::kQOffset;
  unsigned char* sdo = smem + Tile::kDoOffset;
  const float* slse = reinterpret_cast<const float*>(smem + Tile::kLseOffset);
  const float* sdelta = reinterpret_cast<const float*>(smem + Tile::kDeltaOffset);
  unsigned char* sds = smem + Tile::kDsOffset;  // dS^T [2][64 keys][64 rows]
  unsigned char* dq_buf = smem + Tile::kDqOffset;
  auto& bars = *reinterpret_cast<BwdSm90Barriers<kStages>*>(smem + Tile::kBarOffset);
  BwdSm90Step* steps = reinterpret_cast<BwdSm90Step*>(smem + Tile::kBarOffset + Region::kStepOffset);
  const BwdParams& bp = p.base;
  const int tid = threadIdx.x, lane = tid & 31, wtid = tid & 127, wwarp = wtid >> 5, g = lane >> 2, t = lane & 3;
  constexpr bool softcap = kSoftcap;
  const float scale_log2 = (softcap ? 1.0f : bp.scale) * kLog2e;
  const int64_t k0 = int64_t(CtaTile(tile_addr, 0)) * BN;

  MbarWait(&bars.kv_full, 0);
  PipeState<kStages> ps;
  int i = 0;  // the step
  if (cw == 0) {
    // S^T = K Q^T, dP^T = V dO^T (A K-major: the 64 keys; B K-major: the stage's 64 rows); dV += P^T dO (A the
    // P^T fragments, B the dO stage MN-major, LBO the 64-column chunk stride).
    const uint64_t desc_k = SmemDesc128B(sk, 16), desc_v = SmemDesc128B(sv, 16);
    const uint64_t desc_q_k = SmemDesc128B(sq, 16), desc_do_k = SmemDesc128B(sdo, 16);
    const uint64_t desc_do_mn = SmemDesc128B(sdo, BM * 128);
    float dv[VT][4];
#pragma unroll
    for (int di = 0; di < VT; ++di)
#pragma unroll
      for (int e = 0; e < 4; ++e) dv[di][e] = 0.0f;
    float s[1][8][4], dp[1][8][4];
    uint32_t pa[4][4], dsa[4][4];
    for (;; ++i) {
      MbarWait(&bars.row_full[ps.stage], ps.phase);
      int rb, head, flags;
      ReadStepRecord(&steps[ps.stage], rb, head, flags);
      if (flags & kStepEnd) break;
      const uint32_t q_off = ps.stage * Tile::kRowBytes, do_off = ps.stage * Tile::kDoRowBytes;
      WgmmaFence();
      IssueKMajorSS<T, 64, D, BN, BM>(s[0], desc_k, DescAdd(desc_q_k, q_off));
      IssueKMajorSS<T, 64, Dv, BN, BM>(dp[0], desc_v, DescAdd(desc_do_k, do_off));
      const float* lse_s = slse + ps.stage * BM;
      const float* delta_s = sdelta + ps.stage * BM;
      WgmmaWait<1>();  // S^T has landed, dP^T still runs
      FenceRegs(s[0]);
      if constexpr (softcap) ApplySoftcap(s, bp.scale, bp.softcap);
      MaskStep<8>(s, steps[ps.stage], k0, BN, rb, wwarp, g, t);
      float2 delta[8];
      if constexpr (!softcap) {
        ExpScores<8>(s, lse_s, t, scale_log2);
        LoadDelta<8>(delta_s, t, delta);
      }
      WgmmaWait<0>();  // dP^T has landed
      FenceRegs(dp[0]);
      if constexpr (softcap) SoftcapProbsAndDs<8>(s, dp, lse_s, delta_s, t, scale_log2, bp.softcap);
      else DsFromProbs<8>(s, dp, delta);
      PackA64<T>(s[0], pa);
      PackA64<T>(dp[0], dsa);
      FenceRegs(dv);
      FenceRegs(pa);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        Wgmma<T, Dv>::template RS<1>(dv, pa[kk], DescAdd(DescAdd(desc_do_mn, do_off), kk * 2048), 1);
      WgmmaCommit();
      // dS^T(i) into buffer i % 2 once warpgroup 1 is done with dS^T(i - 2), while dV runs. Four 8x8
      // matrices per 16 columns (StMatrixX4, the A fragments' order): lane l addresses key 16 wwarp +
      // 8 ((l / 8) & 1) + l % 8, columns + 8 (l / 16).
      NamedBarrierSync(kConsumed + (i & 1), Tile::kConsumerThreads);
      {
        const uint32_t ds_buf = SmemAddr(sds + (i & 1) * Tile::kDsBytes);
        const int kr = wwarp * 16 + (lane & 15), dc = (lane >> 4) * 8;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          StMatrixX4(ds_buf + Swizzle128B(kr, kk * 16 + dc), dsa[kk][0], dsa[kk][1], dsa[kk][2], dsa[kk][3]);
      }
      FenceProxyAsyncShared();
      NamedBarrierArrive(kReady + (i & 1), Tile::kConsumerThreads);
      WgmmaWait<0>();  // dV has landed: this warpgroup is done with the Q / dO stage
      FenceRegs(dv);
      MbarArriveIf(&bars.row_empty[ps.stage], wtid == 0);
      ps.Advance();
    }
    // Warpgroup 1's arrivals for the last two steps (or its two at the start, without steps).
    NamedBarrierSync(kConsumed + (i & 1), Tile::kConsumerThreads);
    NamedBarrierSync(kConsumed + ((i + 1) & 1), Tile::kConsumerThreads);
    // Epilogue: the Q / dO rings are free once both warpgroups are here; dV into the dO ring,
    // [chunks][64 keys][64], 128-byte swizzle.
    NamedBarrierSync(2, Tile::kConsumerThreads);
#pragma unroll
    for (int di = 0; di < VT; ++di) StageCFragment<T, BN>(sdo, 0, wwarp * 16 + g, di * 8 + 2 * t, dv[di], 1.0f);
  } else {
    // dK += dS^T Q: A = dS^T K-major ([keys][rows]), B = the Q stage MN-major; dQ = dS K: A = dS^T MN-major,
    // B = K MN-major; both N 192.
    const uint64_t desc_q_mn = SmemDesc128B(sq, BM * 128);
    const uint64_t desc_k_mn = SmemDesc128B(sk, BN * 128);
    float dk[DT][4];
#pragma unroll
    for (int di = 0; di < DT; ++di)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[di][e] = 0.0f;
    // consumed(-2), consumed(-1): both buffers are free.
    NamedBarrierArrive(kConsumed, Tile::kConsumerThreads);
    NamedBarrierArrive(kConsumed + 1, Tile::kConsumerThreads);
    for (;; ++i) {
      MbarWait(&bars.row_full[ps.stage], ps.phase);
      int rb, head, flags;
      ReadStepRecord(&steps[ps.stage], rb, head, flags);
      if (flags & kStepEnd) break;
      NamedBarrierSync(kReady + (i & 1), Tile::kConsumerThreads);  // dS^T(i) is in buffer i % 2
      unsigned char* ds_buf = sds + (i & 1) * Tile::kDsBytes;
      const uint64_t desc_ds = SmemDesc128B(ds_buf, 16), desc_ds_mn = SmemDesc128B(ds_buf, 64 * 128);
      const uint64_t dq_mn = DescAdd(desc_q_mn, ps.stage * Tile::kRowBytes);
      float dq[DT][4];
      FenceRegs(dk);
      WgmmaFence();
      AccumulateSS<T, D, BM / 16>(dk, desc_ds, dq_mn);
      WgmmaCommit();
      IssueDqSS<T, D, BN / 16>(dq, desc_ds_mn, desc_k_mn);
      WgmmaCommit();
      WgmmaWait<1>();  // dK has landed: the Q stage is free (dQ reads K and dS^T only)
      FenceRegs(dk);
      MbarArriveIf(&bars.row_empty[ps.stage], wtid == 0);
      WgmmaWait<0>();
      FenceRegs(dq);
      NamedBarrierArrive(kConsumed + (i & 1), Tile::kConsumerThreads);  // dS^T(i)'s buffer is free
      BulkWaitRead();  // the last step's reduce-adds have read dq_buf (only wtid 0 has bulk groups)
      NamedBarrierSync(4, 128);
#pragma unroll
      for (int j = 0; j < kBoxes; ++j) StoreDqBox32(dq_buf + j * Tile::kDqBytes, wwarp, g, t, dq, j, bp.scale);
      FenceProxyAsyncShared();
      NamedBarrierSync(4, 128);  // the boxes are in dq_buf
      if (wtid == 0) {
#pragma unroll
        for (int j = 0; j < kBoxes; ++j) TmaReduceAdd4d(&p.dq_map, dq_buf + j * Tile::kDqBytes, 0, j, head, rb);
        BulkCommit();
      }
      __syncwarp();
      ps.Advance();
    }
    // Epilogue: dK (x scale) into the Q ring.
    NamedBarrierSync(2, Tile::kConsumerThreads);
#pragma unroll
    for (int di = 0; di < DT; ++di) StageCFragment<T, BN>(sq, 0, wwarp * 16 + g, di * 8 + 2 * t, dk[di], bp.scale);
  }
  FenceProxyAsyncShared();
  NamedBarrierSync(3 + cw, 128);
  if (wtid == 0) {
    const int kb = CtaTile(tile_addr, 0), hk = CtaTile(tile_addr, 1);
    const KeySource src = CtaKeySource(p, int64_t(kb) * BN);
    if (cw == 0) {
#pragma unroll
      for (int c = 0; c < Dv / 64; ++c) TmaStore3d(src.dv, sdo + c * (BN * 128), 64 * c, hk, src.row);
    } else {
#pragma unroll
      for (int c = 0; c < D / 64; ++c) TmaStore3d(src.dk, sq + c * (BN * 128), 64 * c, hk, src.row);
    }
    BulkCommit();
    BulkWaitRead();  // the stores and the dQ reduce-adds have read shared memory
  }
}

// kSoftcap: the launcher picks the instantiation (p.base.softcap > 0), as for the forward: the softcap path's
// tanhf sequences out of the kernels that do not need them. kGqaSplit: a CTA per (k block, q head), see above.
// Dv: v's head dim (BwdSm90Tile).
template <typename T, int D, bool kDq, bool kSoftcap, bool kGqaSplit = false, int Dv = D>
__global__ void __launch_bounds__(BwdSm90Tile<D, Dv>::kThreads, 1)
    FlashBwdSm90Kernel(const __grid_constant__ BwdSm90Params p) {
  using Tile = BwdSm90Tile<D, Dv>;
  constexpr int BN = Tile::kBlockN, BM = Tile::kBlockM, kStages = Tile::kStages, kChunks = Tile::kChunks;
  constexpr int WK = Tile::kKeysPerWarpgroup;
  using Region = BwdSm90Region<kStages>;
  static_assert(Region::kBytes <= Tile::kBarBytes, "the barrier region holds the steps and the dQ coordinates");
  static_assert(!kGqaSplit || (D == 128 && kDq), "the GQA split is written for D 128 with dQ (dq_buf stages it)");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = AlignSmem1024(smem_raw);
  unsigned char* sk = smem + Tile::kKOffset;
  unsigned char* sv = smem + Tile::kVOffset;
  unsigned char* sq = smem + Tile::kQOffset;
  unsigned char* sdo = smem + Tile::kDoOffset;
  float* slse = reinterpret_cast<float*>(smem + Tile::kLseOffset);
  float* sdelta = reinterpret_cast<float*>(smem + Tile::kDeltaOffset);
  unsigned char* sds = smem + Tile::kDsOffset;
  unsigned char* sdq = smem + Tile::kDqOffset;
  auto& bars = *reinterpret_cast<BwdSm90Barriers<kStages>*>(smem + Tile::kBarOffset);
  BwdSm90Step* steps = reinterpret_cast<BwdSm90Step*>(smem + Tile::kBarOffset + Region::kStepOffset);

  const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), wg = warp >> 2;
  const BwdParams& bp = p.base;
  const SliceArgs& args = bp.slices;
  const int group = bp.hq / bp.hkv;
  int* tile_kh = reinterpret_cast<int*>(smem + Tile::kBarOffset + Region::kTileOffset);
  WaitPriorGrid();  // launched chained to the tile order's kernels (launch_bwd_sm90.cu)
  const uint32_t tile_addr = SmemAddr(tile_kh);

  if (tid == 0) {
    MbarInit(&bars.kv_full, 1);
    for (int i = 0; i < kStages; ++i) {
      MbarInit(&bars.row_full[i], 1);
      MbarInit(&bars.row_empty[i], Tile::kConsumerWarpgroups);
    }
    MbarInitFence();
    // The CTA's tile, decoded once for all threads.
    const int64_t cta = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
    const int tile = p.tiles != nullptr ? p.tiles[cta] : int(cta);
    tile_kh[0] = tile % p.num_kb;
    tile_kh[1] = tile / p.num_kb;
    if constexpr (kGqaSplit) tile_kh[2] = tile / p.num_kb / group;
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------------------------------------ producer
    SetMaxRegsDec<Tile::kProducerRegs>();
    if (warp != 0) return;
    // The tile's head: a kv head, or with kGqaSplit a q head (K / V those of its kv head).
    const int kb = CtaTile(tile_addr, 0), th = CtaTile(tile_addr, 1), hk = kGqaSplit ? CtaTile(tile_addr, 2) : th;
    const int64_t c0 = int64_t(kb) * BN, c1 = c0 + BN;
    if (lane == 0) {
      PrefetchTensorMap(&p.q_map);
      PrefetchTensorMap(&p.do_map);
      const KeySource src = CtaKeySource(p, c0);
      MbarArriveExpectTx(&bars.kv_full, Tile::kKvBytes + Tile::kVBytes);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        TmaLoad3d(sk + c * (BN * 128), src.k, &bars.kv_full, 64 * c, hk, src.row);
        if (c < Tile::kVChunks) TmaLoad3d(sv + c * (BN * 128), src.v, &bars.kv_full, 64 * c, hk, src.row);
      }
    }
    const int tq = args.tq, hq = bp.hq;
    PipeState<kStages> ps;
    const SliceWalk walk(args, bp.k_lists, kb / (kKBlock / BN));  // kSplitD: two CTAs per k block's list
    KvStep st;
    for (StartSlice(walk, args, c0, c1, walk.First(args), &st); st.cur >= 0;
         AdvanceStep(walk, args, c0, c1, kGqaSplit ? 1 : group, BM, &st)) {
      const int h = kGqaSplit ? th : hk * group + st.head;
      if (lane == 0) {
        MbarWait(&bars.row_empty[ps.stage], ps.phase ^ 1);
        // Q and dO first: their transfer overlaps the lse / delta loads below (one float per row, stride Hq,
        // a memory latency per step); lane 0's arrival after those stores completes the phase.
        MbarExpectTx(&bars.row_full[ps.stage], Tile::kRowBytes + Tile::kDoRowBytes);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          TmaLoad3d(sq + ps.stage * Tile::kRowBytes + c * (BM * 128), &p.q_map, &bars.row_full[ps.stage], 64 * c, h,
                    int(st.rb));
          if (c < Tile::kVChunks)
            TmaLoad3d(sdo + ps.stage * Tile::kDoRowBytes + c * (BM * 128), &p.do_map, &bars.row_full[ps.stage],
                      64 * c, h, int(st.rb));
        }
      }
      __syncwarp();
#pragma unroll
      for (int i = lane; i < BM; i += 32) {
        const int64_t row = st.rb + i;
        float l2 = INFINITY, dl = 0.0f;
        if (row < tq) {
          const float l = bp.lse[row * hq + h];
          l2 = l == -INFINITY ? INFINITY : l * kLog2e;
          dl = bp.delta[row * hq + h];
        }
        slse[ps.stage * BM + i] = l2;
        sdelta[ps.stage * BM + i] = dl;
      }
      if (lane < 2) {  // lane 0: (rb, head, flags, type), lane 1: the slice
        const bool l0 = lane == 0;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(SmemAddr(&steps[ps.stage]) + 16 * lane),
                     "r"(l0 ? int(st.rb) : int(st.s.qs)), "r"(l0 ? h : int(st.s.qe)), "r"(l0 ? 0 : int(st.s.ks)),
                     "r"(l0 ? st.s.type : int(st.s.ke))
                     : "memory");
      }
      __syncwarp();  // the lanes' stores precede lane 0's arrive (release) below
      if (lane == 0) MbarArrive(&bars.row_full[ps.stage]);
      ps.Advance();
    }
    // The end of the walk: one more row_full phase, without data, whose step says kStepEnd.
    if (lane == 0) {
      MbarWait(&bars.row_empty[ps.stage], ps.phase ^ 1);
      steps[ps.stage].flags = kStepEnd;
      MbarArrive(&bars.row_full[ps.stage]);
    }
    return;
  }

  // ------------------------------------------------------------------------------------------- consumers
  SetMaxRegsInc<Tile::kConsumerRegs>();
  // Head dims 192 and 256: their own consumers. Early returns rather than an else around the code below: that
  // code is instantiated for them too but never reached (and dropped), and the D 64 / 128 kernels compile from
  // exactly the source they had (an else block changed their register allocation).
  // Both always reduce-add dQ: these head dims have no deterministic dq kernel (launch_bwd_sm90.cu).
  if constexpr (Tile::kRoles) {
    static_assert(kDq, "D 192 reduce-adds dQ");
    BwdSm90RolesConsumer<T, D, Dv, kSoftcap>(p, smem, tile_addr, wg - 1);
    return;
  } else if constexpr (Tile::kSplitD) {
    static_assert(kDq, "D 256 reduce-adds dQ");
    BwdSm90SplitDConsumer<T, D, kSoftcap>(p, smem, tile_addr, wg - 1);
    return;
  }
  constexpr int DT = D / 8;
  const int cw = wg - 1, wtid = tid & 127, wwarp = wtid >> 5, g = lane >> 2, t = lane & 3;
  constexpr bool softcap = kSoftcap;
  const float scale_log2 = (softcap ? 1.0f : bp.scale) * kLog2e;
  // K-major A operands: the warpgroup's 64 keys of K and V (chunks BN * 128 bytes apart).
  const uint64_t desc_k = SmemDesc128B(sk + cw * (WK * 128), 16);
  const uint64_t desc_v = SmemDesc128B(sv + cw * (WK * 128), 16);
  // Q / dO of stage 0 as K-major B (S^T, dP^T) and as MN-major B (dK, dV: LBO = the 64-column chunk stride).
  const uint64_t desc_q_k = SmemDesc128B(sq, 16), desc_do_k = SmemDesc128B(sdo, 16);
  const uint64_t desc_q_mn = SmemDesc128B(sq, BM * 128), desc_do_mn = SmemDesc128B(sdo, BM * 128);
  // dQ = dS K: A = dS^T ([keys][rows], MN-major), B = K ([keys][D], MN-major), N = 64.
  // Two chunks (D 96, 128): each warpgroup one 64-column half of dQ over the 128 keys; one (D 64): its own keys.
  constexpr bool kDqHalves = kChunks == 2;
  constexpr int kDqSteps = kDqHalves ? BN / 16 : WK / 16;
  const uint64_t desc_ds = SmemDesc128B(sds + (kDqHalves ? 0 : cw * (WK * 128)), 64 * 128);
  const uint64_t desc_k_dq = SmemDesc128B(sk + (kDqHalves ? cw * (BN * 128) : cw * (WK * 128)), BN * 128);
  const int dq_col0 = kDqHalves ? cw * 64 : 0;
  unsigned char* dq_buf = sdq + cw * Tile::kDqStageBytes;
  // The (q head, first row) of the warpgroup's dQ boxes, one per step parity: stashed by the issuing thread
  // (wtid 0) while the step's stage is held and read back by it at the drain, after the stage (and its
  // BwdSm90Step) has been released.
  const uint32_t dq_coord = SmemAddr(smem + Tile::kBarOffset + Region::kDqCoordOffset) + 16 * cw;

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int di = 0; di < DT; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[di][e] = dv[di][e] = 0.0f;

  // Software pipeline, per warpgroup (commit groups in issue order; each wgmma.wait_group depth counts them).
  // Step i, kDq:
  //   finish(i-1): dV, dK(i-1) | the other warpgroup's dS^T(i-2) is in place (sync) | dS^T(i-1) -> smem
  //                (arrive) | dQ(i-2) | wait<1>: dV, dK(i-1) have landed -> release the Q / dO stage of i-1
  //                (its last readers), dQ(i-2) still runs
  //   row_full(i) wait | S^T(i), queued behind dQ(i-2) | wait<0> | drain dQ(i-2) (staging store, TMA
  //   reduce-add) | dP^T(i) | wait<1>: S^T(i) has landed, P^T = exp2(..) while dP^T(i) runs (not with
  //   softcap: dS^T needs the capped score too) | wait<0> | dS^T, pack P^T, dS^T -> finish(i)
  // dQ(i) = dS(i) K reads both warpgroups' dS^T(i) (D 96, 128: the 128 keys; D 64: its own 64), yet issued a
  // step late it waits for the other warpgroup's only then: the warpgroups need not run in step, and warpgroup 1
  // starts half a step behind (p.stagger) so that one's softmax runs under the other's GEMMs (in step, both
  // waited on the same wgmmas and left the tensor cores idle together). The handshake: a warpgroup arrives
  // on its barrier kDsReady + 2 w + (i & 1) once dS^T(i) is in place, the other syncs on it before dQ(i); by
  // step parity, since a warpgroup may arrive for i + 1 before the other has synced for i (never for i + 2:
  // its sync for i + 1 comes first). Three dS^T buffers: when a warpgroup writes dS^T(i) into buffer i % 3,
  // its sync has seen the other's dS^T(i-1), written after that one's drain of dQ(i-3), the buffer's last
  // reader.
  // kDq false: finish retires dV, dK with a wait<0> and releases the stage (kept in flight instead, the P^T /
  // dS^T fragments held across the row_full wait and S^T took the D 128 kernels into 24-byte spills).
  // Nothing is in flight across the loop's back edge (after the wait<0> of dP^T). The drain waits with wait<0>
  // rather than wait<1> (which would let it run under S^T(i)): reading dQ(i-1) after a wait<1> that retires it
  // made ptxas serialise every wgmma of the kernel (C7514), with or without branches in between.
  // Live accumulators per thread (D 128) stay <= 192: dK, dV + P^T, dS^T fragments + dQ; dK, dV + dQ + S^T;
  // dK, dV + S^T, dP^T.
  float dq[8][4];  // kDq: dQ(i-1), in flight from finish(i-1) to the drain
#pragma unroll
  for (int di = 0; di < 8; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[di][e] = 0.0f;
  uint32_t pa[4][4], dsa[4][4];  // P^T, dS^T of the step begun, as A fragments

  // The landed dQ(i) -> the warpgroup's staging buffer -> one TMA reduce-add.
  auto drain_dq = [&](int i) {
    StoreDq(DqStoreBase(dq_buf, wwarp), dq, bp.scale);
    FenceProxyAsyncShared();
    NamedBarrierSync(3 + cw, 128);  // the warpgroup's dQ is in dq_buf (barrier 3 + cw: this warpgroup's)
    if (wtid == 0) {
      uint32_t h, rb;
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(h), "=r"(rb) : "r"(dq_coord + 8 * (i & 1)) : "memory");
      // The map address and the box's x / y are loop-invariant; offset by an opaque 0 they are computed here
      // (a few instructions on one thread) rather than hoisted into uniform registers for the whole loop:
      // hoisted, they took the D 128 consumers to UR61 of 63 and into 80-byte spills (even y alone, as
      // z + dq_col0 / 32: keep the 0 inside the division).
      const uint32_t z = OpaqueZero();
      TmaReduceAdd4d(&p.dq_map + z, dq_buf + z, int(z), (int(z) + dq_col0) / 32, int(h), int(rb));
      BulkCommit();
    }
    __syncwarp();
  };

  PipeState<kStages> ps;

  // The step of the current stage: (first row, flags), flags broadcast from lane 0 (a value read from shared
  // memory is not known to be warp-uniform: branching on it would make the wgmmas "divergent").
  auto read_step = [&](int* rb, int* flags) {
    uint32_t r, f;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(r) : "r"(SmemAddr(&steps[ps.stage].rb)) : "memory");
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(f) : "r"(SmemAddr(&steps[ps.stage].flags)) : "memory");
    *rb = int(r);
    *flags = __shfl_sync(0xffffffffu, int(f), 0);
  };

  // S^T = K Q^T of the current stage (commit group S). Descriptors offset by an opaque 0: computed here, not
  // hoisted (CSE between the two call sites would hold 16 64-bit descriptors across the loop: spills).
  float s[1][8][4], dp[1][8][4];
  auto issue_s = [&]() {
    const uint32_t z = OpaqueZero();
    const uint64_t da = desc_k + z, db = DescAdd(desc_q_k, ps.stage * Tile::kRowBytes + z);
    WgmmaFence();
    IssueKMajorSS<T, 64, D, BN, BM>(s[0], da, db);
  };
  // dQ(i) = dS(i) K (commit group dQ), A = dS^T buffer `ds` (i % 3).
  auto issue_dq = [&](int ds) {
    const uint64_t da = DescAdd(desc_ds, uint32_t(ds) * Tile::kDsBytes);
    WgmmaFence();
    IssueDqSS<T, 64, kDqSteps>(dq, da, desc_k_dq);
    WgmmaCommit();
  };
  constexpr int kDsReady = 6;       // named barriers 6..9: (warpgroup, step parity)
  constexpr int kStaggerStart = 10;  // warpgroup 1 waits for warpgroup 0's first softmax

  // The rest of begin(i), after S^T(i) and the drain (see above).
  auto begin_rest = [&](int rb) {
    const uint32_t stage_off = ps.stage * Tile::kRowBytes;
    // dP^T = V dO^T (commit group dP).
    {
      const uint32_t z = OpaqueZero();
      const uint64_t da = desc_v + z, ddo_k = DescAdd(desc_do_k, stage_off + z);
      WgmmaFence();
      IssueKMajorSS<T, 64, D, BN, BM>(dp[0], da, ddo_k);
    }
    const float* lse_s = slse + ps.stage * BM;
    const float* delta_s = sdelta + ps.stage * BM;
    // Pending: S, dP. wait<1>: S^T has landed; P^T = exp2(S^T scale - lse) while dP^T runs (with softcap the
    // exponentials wait for dP^T: dS^T needs the capped score as well as P^T, 32 more live registers).
    WgmmaWait<1>();
    FenceRegs(s[0]);
    if constexpr (softcap) ApplySoftcap(s, bp.scale, bp.softcap);
    const int64_t k0 = int64_t(CtaTile(tile_addr, 0)) * BN + cw * WK;  // the warpgroup's keys
    MaskStep<8>(s, steps[ps.stage], k0, WK, rb, wwarp, g, t);
    float2 delta[8];
    if constexpr (!softcap) {
      ExpScores<8>(s, lse_s, t, scale_log2);
      LoadDelta<8>(delta_s, t, delta);
    }
    WgmmaWait<0>();  // dP^T has landed: nothing in flight
    FenceRegs(dp[0]);
    if constexpr (softcap) SoftcapProbsAndDs<8>(s, dp, lse_s, delta_s, t, scale_log2, bp.softcap);
    else DsFromProbs<8>(s, dp, delta);
    PackA64<T>(s[0], pa);
    PackA64<T>(dp[0], dsa);
  };

  // finish(i) (see above).
  auto finish = [&](int i) {
    const uint32_t stage_off = ps.stage * Tile::kRowBytes;
    // dV += P^T dO, dK += dS^T Q (commit group dKV).
    {
      const uint64_t dq_mn = DescAdd(desc_q_mn, stage_off), ddo_mn = DescAdd(desc_do_mn, stage_off);
      FenceRegs(dv);
      FenceRegs(dk);
      FenceRegs(pa);
      FenceRegs(dsa);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Wgmma<T, D>::template RS<1>(dv, pa[kk], DescAdd(ddo_mn, kk * 2048), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Wgmma<T, D>::template RS<1>(dk, dsa[kk], DescAdd(dq_mn, kk * 2048), 1);
      WgmmaCommit();
    }
    if constexpr (kDq) {
      // The last drain's reduce-add has read dq_buf (only the issuing thread has bulk groups, the others pass;
      // uniform, no lane-dependent branch before the wgmmas); the sync below, of all the warpgroup's threads,
      // orders it before the next drain's stores.
      BulkWaitRead();
      NamedBarrierSync(kDsReady + 2 * (cw ^ 1) + ((i + 1) & 1), Tile::kConsumerThreads);  // dS^T(i-1): in place
      // dS^T rows (keys) of this thread into buffer i % 3, swizzled [BN][BM], while dK / dV run.
      // As four 8x8 matrices per 16 columns (StMatrixX4, the A fragments' order): lane l addresses key
      // 16 wwarp + 8 ((l / 8) & 1) + l % 8 of the warpgroup's, columns + 8 (l / 16).
      const int ds = i % Tile::kDsBuffers;
      const uint32_t ds_buf = SmemAddr(sds + ds * Tile::kDsBytes);
      const int kr = cw * WK + wwarp * 16 + (lane & 15), dc = (lane >> 4) * 8;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        StMatrixX4(ds_buf + Swizzle128B(kr, kk * 16 + dc), dsa[kk][0], dsa[kk][1], dsa[kk][2], dsa[kk][3]);
      FenceProxyAsyncShared();
      NamedBarrierArrive(kDsReady + 2 * cw + (i & 1), Tile::kConsumerThreads);
      // Stash the box's (q head, first row) of step i for its drain: predicated in one asm statement, no
      // branch (see the loop's note on C7514).
      asm volatile(
          "{\n.reg .pred p;\n.reg .b32 r, h;\nsetp.eq.b32 p, %2, 0;\nld.shared.v2.u32 {r, h}, [%1];\n"
          "@p st.shared.v2.u32 [%0], {h, r};\n}\n" ::"r"(dq_coord + 8 * (i & 1)),
          "r"(SmemAddr(&steps[ps.stage].rb)), "r"(wtid)
          : "memory");
      // dQ(i-1), the tail, left in flight (i = 0: on whatever buffer 2 holds, never drained).
      issue_dq(ds == 0 ? Tile::kDsBuffers - 1 : ds - 1);
      // Pending: dKV, dQ. wait<1>: dV / dK have landed (the Q / dO stage and the A fragments are free).
      WgmmaWait<1>();
      FenceRegs(dv);
      FenceRegs(dk);
      MbarArriveIf(&bars.row_empty[ps.stage], wtid == 0);
    } else {
      // No dQ: dV / dK are retired here (kept in flight into the next step, the P^T / dS^T fragments held
      // across the row_full wait and S^T took the D 128 kernels into 24-byte spills).
      WgmmaWait<0>();
      FenceRegs(dv);
      FenceRegs(dk);
      MbarArriveIf(&bars.row_empty[ps.stage], wtid == 0);
    }
  };

  MbarWait(&bars.kv_full, 0);
  int rb, flags;
  MbarWait(&bars.row_full[ps.stage], ps.phase);
  read_step(&rb, &flags);
  if (!(flags & kStepEnd)) {
    if constexpr (kDq) {
      // "dS^T(-1) is in place": the first finish's sync takes this arrival.
      NamedBarrierArrive(kDsReady + 2 * cw + 1, Tile::kConsumerThreads);
      if (p.stagger && cw == 1) NamedBarrierSync(kStaggerStart, Tile::kConsumerThreads);
    }
    issue_s();
    begin_rest(rb);
    if constexpr (kDq)
      if (p.stagger && cw == 0) NamedBarrierArrive(kStaggerStart, Tile::kConsumerThreads);
    for (int i = 0;; ++i) {
      finish(i);
      ps.Advance();
      MbarWait(&bars.row_full[ps.stage], ps.phase);
      read_step(&rb, &flags);
      // S^T of the next step, issued before the walk's end is tested: at the end it multiplies the stale Q of
      // the end's stage and is discarded. No branch may separate the tail's commit from the wait<1> that
      // retires it: across one ptxas lost count of the groups and serialised every wgmma (C7514).
      issue_s();
      // Pending: tail, S^T. wait<0>, not wait<1>: reading dQ after a wait<1> here made ptxas serialise every
      // wgmma (C7514), whatever the branches around it (NOTES: next lever). S^T(i+1) runs on the tensor cores
      // right behind dQ(i-1); the drain follows it.
      WgmmaWait<0>();
      if constexpr (kDq) {
        FenceRegs(dq);
        if (i > 0) drain_dq(i - 1);
      }
      if (flags & kStepEnd) {
        if constexpr (kDq) {
          // dQ of the last step: the other warpgroup's dS^T(i) in place, the last reduce-add has read dq_buf
          // (the sync orders the issuing thread's wait before the drain's stores).
          BulkWaitRead();
          NamedBarrierSync(kDsReady + 2 * (cw ^ 1) + (i & 1), Tile::kConsumerThreads);
          issue_dq(i % Tile::kDsBuffers);
          WgmmaWait<0>();
          FenceRegs(dq);
          drain_dq(i);
        }
        break;
      }
      begin_rest(rb);
    }
  }

  // -------------------------------------------------------------------------------------------- epilogue
  if constexpr (kGqaSplit) {
    // dK (x scale) and dV of the warpgroup's 64 keys reduce-added into the fp32 accumulators, one 64 x 32 box
    // at a time through its own dq_buf, as the split-D consumers drain dQ (nothing of the other warpgroup's is
    // touched: no barrier 2). Each box's sync after the issuing thread's BulkWaitRead orders the last
    // reduce-add's read of dq_buf (the last dQ's, then the previous box's) before the threads' stores.
    const int kb = CtaTile(tile_addr, 0), hk = CtaTile(tile_addr, 2);
    const int row = kb * BN + cw * WK;  // one key source in split mode, from key 0: the accumulators' row
    auto reduce_box = [&](const CUtensorMap* map, const float (&acc)[DT][4], int j, float scale) {
      BulkWaitRead();
      NamedBarrierSync(3 + cw, 128);
      StoreDqBox32(dq_buf, wwarp, g, t, acc, j, scale);
      FenceProxyAsyncShared();
      NamedBarrierSync(3 + cw, 128);  // the box is in dq_buf
      if (wtid == 0) {
        TmaReduceAdd4d(map, dq_buf, 0, j, hk, row);  // keys past Tk skipped by TMA
        BulkCommit();
      }
      __syncwarp();
    };
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      reduce_box(&p.dk_accum_map, dk, j, bp.scale);
      reduce_box(&p.dv_accum_map, dv, j, 1.0f);
    }
    if (wtid == 0) BulkWaitRead();  // the last box has been read before the CTA's shared memory goes
    return;
  }
  // Every wgmma of both warpgroups is done and the producer has nothing in flight: the Q / dO rings are free.
  NamedBarrierSync(2, Tile::kConsumerThreads);
  unsigned char* stage_k = sq;   // [kChunks][BN][64]
  unsigned char* stage_v = sdo;
#pragma unroll
  for (int di = 0; di < DT; ++di) {
    const int r = cw * WK + wwarp * 16 + g, col = di * 8 + 2 * t;
    StageCFragment<T, BN>(stage_k, 0, r, col, dk[di], bp.scale);
    StageCFragment<T, BN>(stage_v, 0, r, col, dv[di], 1.0f);
  }
  FenceProxyAsyncShared();
  NamedBarrierSync(3 + cw, 128);
  if (wtid == 0) {
    const int kb = CtaTile(tile_addr, 0), hk = CtaTile(tile_addr, 1);
    const KeySource src = CtaKeySource(p, int64_t(kb) * BN);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      TmaStore3d(src.dk, stage_k + c * (BN * 128) + cw * (WK * 128), 64 * c, hk, src.row + cw * WK);
      TmaStore3d(src.dv, stage_v + c * (BN * 128) + cw * (WK * 128), 64 * c, hk, src.row + cw * WK);
    }
    BulkCommit();
    // Until the stores (and this thread's dQ reduce-adds) have read shared memory, not until they have
    // landed: the grid's end makes them visible to the next kernel (the dq convert), as CUTLASS's epilogues
    // rely on; the SM's next CTA starts a write latency sooner.
    BulkWaitRead();
  }
}

}  // namespace magi_jax::cuda
