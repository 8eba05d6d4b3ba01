// Tile shapes per kernel and head dim, and the shared-memory each kernel needs. One place to tune.
//
// Forward: a CTA owns kBlockM query rows of one head; 4 warps, each 32 rows (two m16 tiles that share
// every K/V fragment it loads, halving shared-memory traffic per flop); keys in tiles of kBlockN.
// Backward dk/dv: a CTA owns kBlockN keys of one kv head; 8 warps, each 16 keys, so S^T, P^T, dS^T stay
// in registers as the A operand of dV += P^T dO and dK += dS^T Q; rows stream in tiles of kBlockM.
// Backward dq (deterministic path): like the forward, 8 warps of 16 rows, keys in tiles of kBlockN.
#pragma once

#include "smem.h"

namespace magi_jax::cuda {

template <int D>
struct FwdTile {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = D <= 64 ? 128 : 64;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;
  // Q (reused for the output staging), K, V.
  static constexpr int kSmemBytes = (SmemElems<kBlockM, D>() + 2 * SmemElems<kBlockN, D>()) * 2;
};

template <int D>
struct BwdKvTile {
  static constexpr int kBlockN = 128;  // keys per CTA
  static constexpr int kBlockM = 64;   // rows per step
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  // K, V, Q x2, dO x2 (double-buffered rows), dS^T, then lse/delta x2.
  static constexpr int kSmemBytes =
      (2 * SmemElems<kBlockN, D>() + 4 * SmemElems<kBlockM, D>() + SmemElems<kBlockN, kBlockM>()) * 2 + 4 * kBlockM * 4;
};

template <int D>
struct BwdQTile {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 64;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  // Q, dO, then K and V double-buffered.
  static constexpr int kSmemBytes = (2 * SmemElems<kBlockM, D>() + 4 * SmemElems<kBlockN, D>()) * 2;
};

// The head dims of the mma.sync kernels (their shared-memory rows are whole 128-byte lines); the sm90
// kernels alone run 96, 192 and 256.
constexpr bool HasMmaKernels(int d) { return d == 64 || d == 128; }

// The forward and the dq kernel share one block size, so one set of q-block slice lists serves both.
static_assert(FwdTile<128>::kBlockM == BwdQTile<128>::kBlockM, "q-block lists are shared");
constexpr int kQBlock = 128;
constexpr int kKBlock = 128;

}  // namespace magi_jax::cuda
