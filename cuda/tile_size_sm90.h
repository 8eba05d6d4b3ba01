// Tile shapes and the shared-memory plan of the sm90 (TMA + wgmma, warp-specialised) forward.
//
// A CTA is 3 warpgroups: warpgroup 0 produces (one warp issues the TMA loads, the rest exit after giving
// back their registers), warpgroups 1 and 2 consume, each owning 64 of the 128 rows of a q block (wgmma M is
// 64 per warpgroup). Keys come in tiles of kBlockN through a kStages-deep ring of K and V buffers.
// Every tile is stored in 64-column chunks ([rows][64], 128 bytes a row) in the 128-byte swizzle layout, as
// TMA writes it and wgmma reads it (sm90_ptx.h, SmemDesc128B).
#pragma once

#include <cstdint>

#include "tile_size.h"

namespace magi_jax::cuda {

template <int D>
struct FwdSm90Tile {
  static constexpr int kBlockM = 128;  // = kQBlock: the q-block slice lists serve both forward kernels
  static constexpr int kBlockN = 128;
  static constexpr int kStages = D <= 64 ? 4 : 2;
  // Two Q buffers: the producer loads the next tile's Q while this tile's mainloop runs (with one, the load
  // could only start once both warpgroups had issued this tile's last S, and its latency showed at every
  // tile start: a per-tile cost that weighs most on short walks, varlen and sliding windows).
  static constexpr int kQStages = 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kRowsPerWarpgroup = kBlockM / kConsumerWarpgroups;
  static constexpr int kChunks = D / 64;
  // setmaxnreg: 128 x 40 + 256 x 232 = 64512 <= 65536 registers.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;

  static constexpr uint32_t kQBytes = kBlockM * D * 2;
  static constexpr uint32_t kKvBytes = kBlockN * D * 2;  // one K or V tile
  static constexpr uint32_t kOBytes = kBlockM * D * 2;   // output staging, kRowsPerWarpgroup rows per consumer
  static constexpr uint32_t kQOffset = 0;
  static constexpr uint32_t kKOffset = kQOffset + kQStages * kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kKvBytes;
  static constexpr uint32_t kOOffset = kVOffset + kStages * kKvBytes;
  static constexpr uint32_t kBarOffset = kOOffset + kOBytes;
  static constexpr uint32_t kBarBytes = 256;
  // + 1024 so that the kernel can align the dynamic buffer to the 1024 bytes the swizzle atoms need.
  static constexpr int kSmemBytes = int(kBarOffset + kBarBytes + 1024);

  static_assert(kBlockM == kQBlock, "the forward kernels share the q-block slice lists");
  static_assert(D % 64 == 0, "tiles are loaded in 64-column chunks");
  static_assert(kSmemBytes <= 227 * 1024, "fits one CTA per SM");
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 65536, "register file");
};

// The mbarriers and the tile ring, at kBarOffset.
template <int kStages, int kQStages>
struct FwdSm90Barriers {
  uint64_t q_full[kQStages], q_empty[kQStages];
  uint64_t k_full[kStages], k_empty[kStages];
  uint64_t v_full[kStages], v_empty[kStages];
  uint64_t tile_full[2], tile_empty[2];
  int tile[2];
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
template <int D>
struct BwdSm90Tile {
  static constexpr int kBlockN = 128;  // keys per CTA (= kKBlock: the k-block slice lists are shared)
  static constexpr int kBlockM = 64;   // q rows per step
  static constexpr int kStages = 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kKeysPerWarpgroup = kBlockN / kConsumerWarpgroups;
  static constexpr int kChunks = D / 64;
  // setmaxnreg: 128 x 40 + 256 x 232 = 64512 <= 65536 registers.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;

  static constexpr uint32_t kKvBytes = kBlockN * D * 2;   // K or V, [kChunks][kBlockN][64]
  static constexpr uint32_t kRowBytes = kBlockM * D * 2;  // one Q or dO stage, [kChunks][kBlockM][64]
  static constexpr uint32_t kDsBytes = kBlockN * kBlockM * 2;  // dS^T [kBlockN keys][kBlockM rows], swizzled
  static constexpr uint32_t kKOffset = 0;
  static constexpr uint32_t kVOffset = kKOffset + kKvBytes;
  static constexpr uint32_t kQOffset = kVOffset + kKvBytes;
  static constexpr uint32_t kDoOffset = kQOffset + kStages * kRowBytes;
  static constexpr uint32_t kLseOffset = kDoOffset + kStages * kRowBytes;  // float [kStages][kBlockM] lse (log2)
  static constexpr uint32_t kDeltaOffset = kLseOffset + kStages * kBlockM * 4;
  static constexpr uint32_t kDsOffset = kLseOffset + 1024;  // [2] dS^T buffers (double-buffered)
  // dQ staging, one per consumer warpgroup: its 64 rows x 64 columns of fp32 dQ as the box of the dq_accum
  // tensor map (32 columns, 2 column chunks, 1 head, 64 rows: 128-byte lines ordered (row, chunk)) in the
  // 128-byte swizzle, read by the TMA reduce-add.
  static constexpr uint32_t kDqBytes = kBlockM * 64 * 4;
  static constexpr uint32_t kDqOffset = kDsOffset + 2 * kDsBytes;
  static constexpr uint32_t kBarOffset = kDqOffset + kConsumerWarpgroups * kDqBytes;
  static constexpr uint32_t kBarBytes = 256;
  static constexpr int kSmemBytes = int(kBarOffset + kBarBytes + 1024);

  static_assert(kBlockN == kKBlock, "the dk/dv kernels share the k-block slice lists");
  static_assert(2 * kStages * kBlockM * 4 <= 1024, "lse / delta region");
  static_assert(kDsOffset % 1024 == 0 && kDqOffset % 1024 == 0, "swizzle atoms are 1024-byte aligned");
  static_assert(kStages * kRowBytes >= kKvBytes, "dK / dV are staged in the Q / dO rings for the TMA store");
  static_assert(kSmemBytes <= 227 * 1024, "fits one CTA per SM");
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 65536, "register file");
};

template <int kStages>
struct BwdSm90Barriers {
  uint64_t kv_full;
  uint64_t row_full[kStages], row_empty[kStages];
};

}  // namespace magi_jax::cuda
