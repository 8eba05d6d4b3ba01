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
  static constexpr uint32_t kKOffset = kQOffset + kQBytes;
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
template <int kStages>
struct FwdSm90Barriers {
  uint64_t q_full, q_empty;
  uint64_t k_full[kStages], k_empty[kStages];
  uint64_t v_full[kStages], v_empty[kStages];
  uint64_t tile_full[2], tile_empty[2];
  int tile[2];
};

}  // namespace magi_jax::cuda
