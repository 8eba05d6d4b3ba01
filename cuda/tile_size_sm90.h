// Tile shapes and the shared-memory plan of the sm90 (TMA + wgmma, warp-specialised) forward.
//
// A CTA is 3 warpgroups: warpgroup 0 produces (one warp issues the TMA loads, the rest exit after giving
// back their registers), warpgroups 1 and 2 consume, each owning 64 of the 128 rows of a q block (wgmma M is
// 64 per warpgroup). Keys come in tiles of kBlockN through a kStages-deep ring of K and V buffers.
// Every tile is stored in 64-column chunks ([rows][64], 128 bytes a row) in the 128-byte swizzle layout, as
// TMA writes it and wgmma reads it (sm90_ptx.h, SmemDesc128B). Head dim 96 fills its second chunk half: TMA
// loads zeros past column 96 and stores nothing there, and the GEMMs read only the 96 columns (S in six k16
// steps, O += P V at wgmma N 96), so the forward does 3/4 of D 128's work in D 128's buffers. Head dim 192
// (MLA's q / k) is D 256's plan on three whole chunks.
#pragma once

#include <cstdint>

#include "scheduler_sm90.h"
#include "tile_size.h"

namespace magi_jax::cuda {

// The registers of a CTA of `threads` threads (__launch_bounds__(threads, 1): 65536 / threads per thread, in
// units of 8), the pool that setmaxnreg moves registers within: an increase beyond it never completes (a
// backward with 48 + 232 for 384 threads hung on its first GPU run, branch bwd-chain).
constexpr int kSetMaxNRegPool(int threads) { return 65536 / threads / 8 * 8 * threads; }

//
// Head dim 256 (FA3's hopper/ choice for it: 128 x 80, P V from registers, intra-warpgroup overlap on):
// key tiles of 80 (S is 64 x 80 per warpgroup: wgmma N 80; O += P V is N 256 in five k16 steps), one Q
// buffer (64 KB), K and V 2 stages x 40 KB each: 229,376 B of tiles. No room for a separate O staging
// buffer (64 KB): each consumer warpgroup stages its 64 output rows in its own 64 rows of the Q buffer
// (kOInQ), which it stops reading once its last S has landed; the Q buffer is then released (q_empty) only
// after the TMA store has read it, so the next tile's Q load waits for both epilogues. Registers per
// consumer thread: O 64 x 256 fp32 = 128, S 40, P (packed) 20 while PV(j-1) runs under the softmax of
// S(j): 188 + the walk, masks and descriptors, within the 232 of setmaxnreg.
// Head dim 192: the same plan on three chunks (Q 48 KB, K and V 2 stages x 30 KB each: 172,032 B of tiles;
// O 96 registers; S in twelve k16 steps, O += P V at N 192).
// Dv, v's (and out's) head dim, where it differs from D: MLA's q / k 192 with v 128 (FA3's hdim 192 / 128).
// V tiles of Dv columns (2 stages x 20 KB), O 64 registers, O += P V at N Dv; the room this leaves takes an
// output staging buffer of its own (32 KB: Q 48 + K 60 + V 40 + O 32 KB), so that the intra-warpgroup overlap
// runs (O 64 + S 40 + P 20 registers), with the one Q buffer released after each tile's last S (the next
// tile's Q load waits for it). Measured +3-7% forward against O staged in Q without the overlap (NOTES.md,
// thirty-ninth session); the softcap instantiation spills 8 bytes.
template <int D, int Dv = D>
struct FwdSm90Tile {
  static constexpr int kBlockM = 128;  // = kQBlock: the q-block slice lists serve both forward kernels
  static constexpr int kBlockN = D <= 128 ? 128 : 80;
  static constexpr int kStages = D <= 64 ? 4 : 2;
  // Two Q buffers: the producer loads the next tile's Q while this tile's mainloop runs (with one, the load
  // could only start once both warpgroups had issued this tile's last S, and its latency showed at every
  // tile start: a per-tile cost that weighs most on short walks, varlen and sliding windows). D 256: one.
  static constexpr int kQStages = D <= 128 ? 2 : 1;
  // With two: the next tile is taken when the K/V warp has this many steps of the tile before left to issue
  // (flash_fwd_sm90_kernel.h, claim_next): late enough for the L2 sharing of long tiles, early enough that
  // the claim, decode and Q load (a few microseconds) stay under the tile's last steps. The default of
  // FwdSm90Params::claim_lead (MAGI_JAX_SM90_CLAIM_LEAD sets it: launch_fwd_sm90.cu).
  static constexpr int kClaimLead = 4;
  // The output is staged in the Q buffer (D 256, above) instead of a buffer of its own.
  static constexpr bool kOInQ = D > 128 && Dv == D;  // Dv < D: a buffer of its own (above)
  // The inter-warpgroup ping-pong (flash_fwd_sm90_kernel.h; the kernel's kPingPong switches it off for all).
  static constexpr bool kPingPong = true;
  // The intra-warpgroup overlap (the softmax of S(j) under the PV wgmma of step j - 1): S(j) and P(j - 1)
  // live at once. D 256: off (O 128 + S 40 + P 20 registers spilled 232 bytes at 232 per thread, still
  // 56 with key tiles of 64); the ping-pong alone hides the softmax there, as each warpgroup's GEMMs per
  // step take about twice as long as its softmax. D 192 with Dv 128: on (above).
  static constexpr bool kIntraWgOverlap = D <= 128 || Dv <= 128;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kRowsPerWarpgroup = kBlockM / kConsumerWarpgroups;
  static constexpr int kChunks = (D + 63) / 64;
  static constexpr int kCols = kChunks * 64;  // a tile row in shared memory, D padded to whole chunks
  static constexpr int kVChunks = (Dv + 63) / 64;  // V's and O's, as kChunks
  static constexpr int kVCols = kVChunks * 64;
  // setmaxnreg: 128 x 40 + 256 x 232 = 64512 registers, the CTA's pool (168 per thread at launch).
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;

  // Whole boxes: TMA counts the zeros it fills past D toward the transaction bytes.
  static constexpr uint32_t kQBytes = kBlockM * kCols * 2;
  static constexpr uint32_t kKBytes = kBlockN * kCols * 2;  // one K tile
  static constexpr uint32_t kVBytes = kBlockN * kVCols * 2;  // one V tile
  static constexpr uint32_t kOBytes = kOInQ ? 0 : kBlockM * kVCols * 2;  // output staging (kOInQ: none of its own)
  static constexpr uint32_t kQOffset = 0;
  static constexpr uint32_t kKOffset = kQOffset + kQStages * kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kKBytes;
  static constexpr uint32_t kOOffset = kOInQ ? kQOffset : kVOffset + kStages * kVBytes;
  static constexpr uint32_t kBarOffset = kVOffset + kStages * kVBytes + kOBytes;
  // The output staging of consumer warpgroup cw starts at kOOffset + cw * kOWgBytes, its 64-column chunks
  // kOChunkBytes apart ([rows][64], 128B swizzle, as the out map's box): a buffer of its own is
  // [warpgroup][chunk][64 rows][64]; in the Q buffer ([chunk][128 rows][64]) the warpgroup's own Q rows.
  static constexpr int kOWgBytes = kOInQ ? kRowsPerWarpgroup * 128 : kRowsPerWarpgroup * kVCols * 2;
  static constexpr int kOChunkBytes = kOInQ ? kBlockM * 128 : kRowsPerWarpgroup * 128;
  static constexpr uint32_t kBarBytes = 384;  // FwdSm90Barriers: up to 26 mbarriers, two tile records and walks
  // + 1024 so that the kernel can align the dynamic buffer to the 1024 bytes the swizzle atoms need.
  static constexpr int kSmemBytes = int(kBarOffset + kBarBytes + 1024);

  static_assert(kBlockM == kQBlock, "the forward kernels share the q-block slice lists");
  static_assert(D % 64 == 0 || D == 96, "tiles are loaded in 64-column chunks; 96 is the one partial chunk");
  static_assert(Dv == D || (Dv % 64 == 0 && Dv < D), "a smaller v in whole chunks");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "O += P V takes k16 steps; S is one wgmma N");
  static_assert((kBlockN * 128) % 1024 == 0 && kKBytes % 1024 == 0, "swizzle atoms are 1024-byte aligned");
  static_assert(!kOInQ || kQStages == 1, "the Q buffer doubles as O staging only when there is one");
  static_assert(kSmemBytes <= 227 * 1024, "fits one CTA per SM");
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kSetMaxNRegPool(kThreads),
                "setmaxnreg.inc waits forever for registers beyond the CTA's pool");
};

// The mbarriers and the tile ring (one FwdTileRecord per slot), at kBarOffset.
template <int kStages, int kQStages>
struct FwdSm90Barriers {
  uint64_t q_full[kQStages], q_empty[kQStages];
  uint64_t k_full[kStages], k_empty[kStages];
  uint64_t v_full[kStages], v_empty[kStages];
  uint64_t tile_full[2], tile_empty[2];
  // The K/V warp is claim_lead steps from a tile's end: the tile warp may take the tile after (two Q buffers).
  uint64_t claim_next[2];
  FwdTileRecord tile[2];
  int tail_first;  // the scheduler's last-section start (TailSectionStart), set before the first tile
  int tiles;       // the tiles the call visits (VisitedTiles), set with it
  // Beside each tile record, its q block's SliceWalk positions (begin, end, listed), from which the K/V warp
  // makes its walk instead of loading the list's offsets at every tile start: that load's latency stood
  // before the tile's first K load, which the consumers waited for at the tile boundary. Kept apart from the
  // records, which the consumers read: a longer record with the consumers' walks made from it too moved
  // their register allocation (causal 32k +4.7% cycles, cuda/NOTES.md "Tile boundaries and CTA starts").
  int walk[2][3];
};


// The sm90 backward's dK/dV kernel (flash_bwd_sm90_kernel.h): a CTA per (k block of kBlockN keys, kv head),
// 3 warpgroups: warpgroup 0 produces (one warp: TMA of K, V once, then Q, dO of each row tile, lse/delta by
// plain stores), warpgroups 1 and 2 consume, each owning kKeysPerWarpgroup of the keys (wgmma M = 64).
// Row tiles of kBlockM q rows come through a kStages-deep ring; dQ leaves through one fp32 staging buffer per
// consumer warpgroup and a TMA reduce-add. Register plan per consumer thread (D 128):
// dK, dV accumulators 64 x 128 fp32 / 128 threads = 64 + 64; S^T and dP^T (64 keys x 64 rows) 32 + 32;
// the bf16 A fragments of P^T and dS^T 16 + 16 (S^T / dP^T die when packed); dQ (64 rows x 64 columns)
// 32. Peak: 192 during S/dP (dK, dV, S, dP) and during dQ (dK, dV, P, dS, dQ), + ~30 addresses and loop
// state, under 232. D 64: 32 + 32 + 32 + 32 + 32.
//
// Head dim 256 (kSplitD): dK, dV of 64 keys x 256 columns would be 128 + 128 registers per thread, so the two
// consumer warpgroups split D instead of the keys: a CTA owns 64 keys (half a k block of the slice lists),
// warpgroup w holds dK, dV for all 64 keys x columns [128 w, 128 w + 128) (64 + 64 registers). S^T, dP^T
// (64 keys x 64 rows) are split by rows: warpgroup w computes both for rows [32 w, 32 w + 32) (wgmma N 32,
// 16 + 16 registers, the full D 256 contraction), applies the mask, P^T, dS^T, and writes them (bf16) into
// shared memory; after a barrier of both warpgroups, dV, dK (N 128) and dQ (64 rows x its 128 columns, N 128,
// 64 registers while dK, dV live: 192 at the peak) read both from there (SS). FA3's hdim-256 backward splits
// the same GEMMs between its two warpgroups (by keys, with swapAB for dK/dV/dQ). Shared memory: K, V 32 KB
// each, Q, dO 2 stages x 32 KB each, P^T and dS^T 8 KB each (single-buffered: a barrier before they are
// rewritten), dQ staging 8 KB per warpgroup (64 rows x 32 columns fp32, 4 TMA reduce-adds per step and
// warpgroup), lse/delta 1 KB: 230,656 B + 1024 for the alignment.
// Head dim 96: D 128's plan, the tiles' second chunk half filled (TMA's zeros past column 96, as the forward):
// S^T and dP^T take six k16 steps, dV += P^T dO and dK += dS^T Q are wgmma N 96, dQ stays two N 64 halves
// per warpgroup (its columns 96-127 are zeros, and the reduce-add stores nothing past column 96).
// Head dim 192 (MLA's q / k, v at 192 or 128): 64-key CTAs as D 256, but the warpgroups take roles a step
// apart instead of halves of every GEMM (flash_bwd_sm90_kernel.h BwdSm90RolesConsumer): warpgroup 0 computes
// S^T, dP^T for all 64 rows, the softmax and dV (registers: dV Dv / 2 + S^T, dP^T 32 + 32), warpgroup 1 dK and
// dQ at N 192 (96 + 96). The two dS^T buffers alternate by step; warpgroup 1 alone stages dQ, its six boxes
// at once (48 KB), and waits once a step for the last reduce-adds' read. Dv (v's head dim, MLA's 128): V and
// the dO stages at Dv columns, dP^T over Dv, dV at N Dv.
template <int D, int Dv = D>
struct BwdSm90Tile {
  static constexpr bool kSplitD = D > 128;  // 64-key CTAs: D 256 splits the columns, D 192 the roles (kRoles)
  static constexpr bool kRoles = D == 192;
  static constexpr int kBlockN = kSplitD ? 64 : 128;  // keys per CTA (kKBlock / kBlockN CTAs per slice list)
  static constexpr int kBlockM = 64;   // q rows per step
  static constexpr int kStages = 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  // Keys whose dK / dV rows a warpgroup holds (kSplitD: all of them; D 256 half of the columns each, D 192 dV
  // in warpgroup 0 and dK in warpgroup 1).
  static constexpr int kKeysPerWarpgroup = kSplitD ? kBlockN : kBlockN / kConsumerWarpgroups;
  static constexpr int kChunks = (D + 63) / 64;
  static constexpr int kCols = kChunks * 64;  // a tile row in shared memory (D 96: as the forward's, zero-filled)
  static constexpr int kVChunks = (Dv + 63) / 64;  // V's and dO's, as kChunks
  static constexpr int kVCols = kVChunks * 64;
  // setmaxnreg: 128 x 40 + 256 x 232 = 64512 registers, the CTA's pool (168 per thread at launch).
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;

  static constexpr uint32_t kKvBytes = kBlockN * kCols * 2;     // K, [kChunks][kBlockN][64] (and V where Dv = D)
  static constexpr uint32_t kVBytes = kBlockN * kVCols * 2;     // V, [kVChunks][kBlockN][64]
  static constexpr uint32_t kRowBytes = kBlockM * kCols * 2;    // one Q stage, [kChunks][kBlockM][64]
  static constexpr uint32_t kDoRowBytes = kBlockM * kVCols * 2; // one dO stage, [kVChunks][kBlockM][64]
  // dS^T [kBlockN keys][kBlockM rows], swizzled. Three: a warpgroup's dQ(i) is issued one step late, beside
  // dK / dV(i + 1), and the other warpgroup may still read dS^T(i) when this one writes dS^T(i + 2)
  // (flash_bwd_sm90_kernel.h, the consumer loop). kSplitD: two (D 256 P^T then dS^T; D 192 dS^T of
  // alternate steps).
  static constexpr uint32_t kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kDsBuffers = kSplitD ? 2 : 3;
  static constexpr uint32_t kKOffset = 0;
  static constexpr uint32_t kVOffset = kKOffset + kKvBytes;
  static constexpr uint32_t kQOffset = kVOffset + kVBytes;
  static constexpr uint32_t kDoOffset = kQOffset + kStages * kRowBytes;
  static constexpr uint32_t kLseOffset = kDoOffset + kStages * kDoRowBytes;  // float [kStages][kBlockM] lse (log2)
  static constexpr uint32_t kDeltaOffset = kLseOffset + kStages * kBlockM * 4;
  static constexpr uint32_t kDsOffset = kLseOffset + 1024;  // [kDsBuffers] dS^T buffers
  // dQ staging, one per consumer warpgroup: its 64 rows x 64 columns of fp32 dQ as the box of the dq_accum
  // tensor map (32 columns, 2 column chunks, 1 head, 64 rows: 128-byte lines ordered (row, chunk)) in the
  // 128-byte swizzle, read by the TMA reduce-add.
  // kSplitD: 64 rows x 32 columns (the box (32, 1, 1, 64)); D 256: the warpgroup's 128 columns in four boxes.
  static constexpr int kDqBoxCols = kSplitD ? 32 : 64;
  static constexpr uint32_t kDqBytes = kBlockM * kDqBoxCols * 4;
  // Boxes a warpgroup stages at once: at D 192 all of a step's six (warpgroup 1's alone, 48 KB), so that a
  // step waits once for the last reduce-adds' read of the buffer (issued a step before), not once per box
  // behind the box just issued (-16% of the MLA backward, BENCHMARKS.md 2026-12-06 14:03 UTC); at D 256 one
  // per warpgroup (shared memory full).
  static constexpr int kDqStagedBoxes = kRoles ? D / kDqBoxCols : 1;
  static constexpr uint32_t kDqStageBytes = kDqStagedBoxes * kDqBytes;
  static constexpr uint32_t kDqOffset = kDsOffset + kDsBuffers * kDsBytes;
  static constexpr uint32_t kBarOffset = kDqOffset + (kRoles ? 1 : kConsumerWarpgroups) * kDqStageBytes;
  static constexpr uint32_t kBarBytes = 256;
  static constexpr int kSmemBytes = int(kBarOffset + kBarBytes + 1024);

  static_assert(kKBlock % kBlockN == 0, "the dk/dv kernels share the k-block slice lists");
  static_assert(2 * kStages * kBlockM * 4 <= 1024, "lse / delta region");
  static_assert(kDsOffset % 1024 == 0 && kDqOffset % 1024 == 0, "swizzle atoms are 1024-byte aligned");
  static_assert(kStages * kRowBytes >= kKvBytes && kStages * kDoRowBytes >= kVBytes,
                "dK / dV are staged in the Q / dO rings for the TMA store");
  static_assert(Dv == D || (kRoles && Dv == 128), "a v head dim of its own: MLA's 192 / 128");
  static_assert(kSmemBytes <= 227 * 1024, "fits one CTA per SM");
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kSetMaxNRegPool(kThreads),
                "setmaxnreg.inc waits forever for registers beyond the CTA's pool");
};

template <int kStages>
struct BwdSm90Barriers {
  uint64_t kv_full;
  uint64_t row_full[kStages], row_empty[kStages];
};

}  // namespace magi_jax::cuda
