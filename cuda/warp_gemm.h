// Warp-level GEMMs on m16n8k16 fragments (ptx.h has the layouts), the building blocks of every mainloop.
// Tiles in shared memory are swizzled row-major (smem.h); a warp's C block is MT x NT fragments.
#pragma once

#include "ptx.h"
#include "smem.h"

namespace magi_jax::cuda {

// C += A B^T with A rows [a_row0, a_row0 + 16 MT) of a [.][kColsA] tile and B rows [b_row0, b_row0 + 8 NT)
// of a [.][kColsB] tile, contracting over columns [0, kK). (S = Q K^T, S^T = K Q^T, dP = dO V^T, ...)
template <typename T, int MT, int NT, int kK, int kColsA, int kColsB>
MAGI_DEV void GemmABt(float (&c)[MT][NT][4], const T* sa, int a_row0, const T* sb, int b_row0, int lane) {
  static_assert(NT % 2 == 0, "B fragments are loaded in pairs");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
      Ldmatrix4(a[mi], sa + TileOffset<kColsA>(a_row0 + mi * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      Ldmatrix4(b, sb + TileOffset<kColsB>(b_row0 + np * 16 + (lane & 7) + (lane >> 4) * 8,
                                               kk * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        Elem<T>::Mma(c[mi][2 * np], a[mi], b[0], b[1]);
        Elem<T>::Mma(c[mi][2 * np + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// C += A B with A given as fp32 C fragments [MT][KN][4] (rows x KN*8 columns, e.g. P or dS, rounded to T
// here) and B rows [0, KN*8) (the contraction) x columns [0, 8 NT) of a [.][kColsB] tile, starting at
// b_row0. (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q.)
template <typename T, int MT, int NT, int KN, int kColsB>
MAGI_DEV void GemmRegB(float (&c)[MT][NT][4], const float (&a)[MT][KN][4], const T* sb, int b_row0, int lane) {
  static_assert(NT % 2 == 0 && KN % 2 == 0, "fragments are paired");
#pragma unroll
  for (int kk = 0; kk < KN / 2; ++kk) {
    uint32_t ar[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      ar[mi][0] = Elem<T>::Pack(a[mi][2 * kk][0], a[mi][2 * kk][1]);
      ar[mi][1] = Elem<T>::Pack(a[mi][2 * kk][2], a[mi][2 * kk][3]);
      ar[mi][2] = Elem<T>::Pack(a[mi][2 * kk + 1][0], a[mi][2 * kk + 1][1]);
      ar[mi][3] = Elem<T>::Pack(a[mi][2 * kk + 1][2], a[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      Ldmatrix4Trans(b, sb + TileOffset<kColsB>(b_row0 + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                    np * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        Elem<T>::Mma(c[mi][2 * np], ar[mi], b[0], b[1]);
        Elem<T>::Mma(c[mi][2 * np + 1], ar[mi], b[2], b[3]);
      }
    }
  }
}

// C += A B with A stored transposed in shared memory (sat is [kK][kColsA], A[m][k] = sat[k][m]; rows of C
// are columns [a_col0, a_col0 + 16 MT) of sat) and B a [kK][kColsB] tile, columns [b_col0, b_col0 + 8 NT).
// (dQ += dS K from dS^T staged by the dk/dv kernel.)
template <typename T, int MT, int NT, int kK, int kColsA, int kColsB>
MAGI_DEV void GemmAtB(float (&c)[MT][NT][4], const T* sat, int a_col0, const T* sb, int b_col0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
      Ldmatrix4Trans(a[mi], sat + TileOffset<kColsA>(kk * 16 + (lane & 7) + (lane >> 4) * 8,
                                                         a_col0 + mi * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      Ldmatrix4Trans(b, sb + TileOffset<kColsB>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                    b_col0 + np * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        Elem<T>::Mma(c[mi][2 * np], a[mi], b[0], b[1]);
        Elem<T>::Mma(c[mi][2 * np + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

template <int MT, int NT>
MAGI_DEV void Zero(float (&c)[MT][NT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][j][e] = 0.0f;
}

}  // namespace magi_jax::cuda
