// Shared-memory tiles: row-major [rows][kCols] 16-bit elements, each row padded by 16 bytes, so the eight
// row addresses of one ldmatrix fall in eight different bank groups (conflict-free, plain and transposed).
// Padding rather than an XOR swizzle keeps every fragment address a per-thread base plus a compile-time
// offset (an immediate in LDSM), which saves the registers a swizzle's per-k addresses would take.
// Tiles are filled from [T, H, D] global tensors with cp.async.
#pragma once

#include <cstdint>

#include "ptx.h"

namespace magi_jax::cuda {

// Row stride (elements) of a tile with kCols columns, and its size.
template <int kCols>
__host__ __device__ constexpr int SmemStride() {
  static_assert(kCols % 64 == 0, "rows span whole 128-byte lines before the padding");
  return kCols + 8;
}
template <int kRows, int kCols>
__host__ __device__ constexpr int SmemElems() { return kRows * SmemStride<kCols>(); }

// Element offset of (row, col) in a tile with kCols columns.
template <int kCols>
MAGI_DEV int TileOffset(int row, int col) { return row * SmemStride<kCols>() + col; }

// Copies kRows rows of one head ([kRows][kCols], row r at gmem + r * row_stride) into a tile; rows at or
// past valid_rows are zero-filled. Issued by kThreads threads; the caller commits.
template <int kRows, int kCols, int kThreads, typename T>
MAGI_DEV void LoadTileAsync(T* smem, const T* gmem, int64_t row_stride, int valid_rows, int tid) {
  constexpr int kChunksPerRow = kCols / 8, kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(kThreads % kChunksPerRow == 0 && kRows % kRowsPerPass == 0, "whole rows per pass");
  const int row = tid / kChunksPerRow, col = (tid % kChunksPerRow) * 8;
  T* dst = smem + TileOffset<kCols>(row, col);
  const T* src = gmem + row * row_stride + col;
  const int64_t pass_stride = kRowsPerPass * row_stride;
#pragma unroll
  for (int i = 0; i < kRows / kRowsPerPass; ++i) {
    const bool valid = row + i * kRowsPerPass < valid_rows;
    CpAsync16(dst + i * kRowsPerPass * SmemStride<kCols>(), valid ? src : gmem, valid ? 16 : 0);
    src += pass_stride;
  }
}

// Copies a tile to global rows [0, valid_rows) with 16-byte stores (after a barrier).
template <int kRows, int kCols, int kThreads, typename T>
MAGI_DEV void StoreTile(T* gmem, const T* smem, int64_t row_stride, int valid_rows, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int chunk = tid + i * kThreads;
    const int row = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
    if (row < valid_rows)
      *reinterpret_cast<uint4*>(gmem + row * row_stride + col) =
          *reinterpret_cast<const uint4*>(smem + TileOffset<kCols>(row, col));
  }
}

}  // namespace magi_jax::cuda
