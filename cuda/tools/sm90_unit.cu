// A standalone check of the sm90 building blocks, without JAX: TMA 3-d loads in the 128-byte swizzle,
// the shared-memory descriptors, SS wgmma (S = Q K^T, K-major both) and RS wgmma (O = P V, V MN-major),
// and the swizzled TMA store of O, each against a host reference. One warpgroup, one 64 x 128 tile, per
// head dim. The backward's two new operand forms too: Y = P[:, :64] Q (RS, B = a 64-row tile MN-major with
// N = D, as dV += P^T dO and dK += dS^T Q) and Z = K[:, :64]^T V[:, :64] (SS with A MN-major, tnspA = 1, as
// dQ = dS K reads dS^T). Build and run on the GPU machine (cuda/device_run.sh does, with SUITE=sm90):
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Icuda cuda/tools/sm90_unit.cu -o /tmp/sm90_unit
//   /tmp/sm90_unit
// Prints one line per check and "sm90_unit: PASS" or "sm90_unit: FAIL".
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "sm90_ptx.h"
#include "sm90_wgmma.h"

using namespace magi_jax::cuda;
using T = __nv_bfloat16;

constexpr int kM = 64, kN = 128;  // S tile: 64 rows x 128 keys; O: 64 x D

struct UnitMaps {
  CUtensorMap q, k, v, o;
};

template <int D>
__global__ void __launch_bounds__(128) UnitKernel(const __grid_constant__ UnitMaps maps, float* s_out, float* o_out,
                                                  float* y_out, float* z_out, int head, int row0) {
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sq = smem;                    // [D/64][64][64]
  unsigned char* sk = sq + kM * D * 2;         // [D/64][128][64]
  unsigned char* sv = sk + kN * D * 2;         // [D/64][128][64]
  unsigned char* so = sv + kN * D * 2;         // [D/64][64][64]
  uint64_t* bar = reinterpret_cast<uint64_t*>(so + kM * D * 2);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  if (tid == 0) {
    MbarInit(bar, 1);
    MbarInitFence();
  }
  __syncthreads();
  if (tid == 0) {
    MbarArriveExpectTx(bar, (kM + 2 * kN) * D * 2);
    for (int c = 0; c < D / 64; ++c) {
      TmaLoad3d(sq + c * kM * 128, &maps.q, bar, 64 * c, head, row0);
      TmaLoad3d(sk + c * kN * 128, &maps.k, bar, 64 * c, head, 0);
      TmaLoad3d(sv + c * kN * 128, &maps.v, bar, 64 * c, head, 0);
    }
  }
  MbarWait(bar, 0);

  float s[kN / 8][4];
  const uint64_t dq = SmemDesc128B(sq, 16), dk = SmemDesc128B(sk, 16), dv = SmemDesc128B(sv, kN * 128);
  WgmmaFence();
  Wgmma<T, kN>::SSZero<0, 0>(s, dq, dk);
#pragma unroll
  for (int kk = 1; kk < D / 16; ++kk)
    Wgmma<T, kN>::SS<0, 0>(s, DescAdd(dq, (kk / 4) * (kM * 128) + (kk % 4) * 32),
                           DescAdd(dk, (kk / 4) * (kN * 128) + (kk % 4) * 32), 1);
  WgmmaCommit();
  WgmmaWait<0>();
  FenceRegs(s);
  const int r = w * 16 + g;
#pragma unroll
  for (int i = 0; i < kN / 8; ++i) {
    const int c = 8 * i + 2 * t;
    s_out[r * kN + c] = s[i][0];
    s_out[r * kN + c + 1] = s[i][1];
    s_out[(r + 8) * kN + c] = s[i][2];
    s_out[(r + 8) * kN + c + 1] = s[i][3];
  }
  // P = S / 16 (rounded to bf16 as the kernel does), O = P V.
  uint32_t pa[kN / 16][4];
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    pa[kk][0] = Elem<T>::Pack(s[2 * kk][0] / 16, s[2 * kk][1] / 16);
    pa[kk][1] = Elem<T>::Pack(s[2 * kk][2] / 16, s[2 * kk][3] / 16);
    pa[kk][2] = Elem<T>::Pack(s[2 * kk + 1][0] / 16, s[2 * kk + 1][1] / 16);
    pa[kk][3] = Elem<T>::Pack(s[2 * kk + 1][2] / 16, s[2 * kk + 1][3] / 16);
  }
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  FenceRegs(o);
  FenceRegs(pa);
  WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) Wgmma<T, D>::template RS<1>(o, pa[kk], DescAdd(dv, kk * 2048), 1);
  WgmmaCommit();
  WgmmaWait<0>();
  FenceRegs(o);
  // O straight from registers (checks the RS wgmma), and through the swizzled staging + TMA store into
  // rows [row0, row0 + 64) of the o tensor (checks the epilogue path).
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int c = 8 * i + 2 * t;
    o_out[r * D + c] = o[i][0];
    o_out[r * D + c + 1] = o[i][1];
    o_out[(r + 8) * D + c] = o[i][2];
    o_out[(r + 8) * D + c + 1] = o[i][3];
    unsigned char* base = so + (c / 64) * (kM * 128);
    *reinterpret_cast<uint32_t*>(base + Swizzle128B(r, c % 64)) = Elem<T>::Pack(o[i][0], o[i][1]);
    *reinterpret_cast<uint32_t*>(base + Swizzle128B(r + 8, c % 64)) = Elem<T>::Pack(o[i][2], o[i][3]);
  }
  FenceProxyAsyncShared();
  __syncthreads();
  if (tid == 0) {
    for (int c = 0; c < D / 64; ++c) TmaStore3d(&maps.o, so + c * (kM * 128), 64 * c, head, row0);
    BulkCommit();
    BulkWait();
  }
  // Backward forms. Y = P[:, :64] Q[:64 rows]: A = the first four k16 fragments of P, B = the Q tile
  // MN-major (LBO = the 64-column chunk stride kM * 128, k16 step 2048 bytes).
  float y[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) y[i][0] = y[i][1] = y[i][2] = y[i][3] = 0.0f;
  const uint64_t dq_mn = SmemDesc128B(sq, kM * 128);
  FenceRegs(y);
  FenceRegs(pa);
  WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) Wgmma<T, D>::template RS<1>(y, pa[kk], DescAdd(dq_mn, kk * 2048), 1);
  WgmmaCommit();
  WgmmaWait<0>();
  FenceRegs(y);
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int c = 8 * i + 2 * t;
    y_out[r * D + c] = y[i][0];
    y_out[r * D + c + 1] = y[i][1];
    y_out[(r + 8) * D + c] = y[i][2];
    y_out[(r + 8) * D + c + 1] = y[i][3];
  }
  // Z = K[:, :64]^T V[:, :64]: A = the K tile's first chunk read MN-major (tnspA = 1), B = V's, N = 64.
  float z[8][4];
  const uint64_t dk_mn = SmemDesc128B(sk, kN * 128), dv_mn = SmemDesc128B(sv, kN * 128);
  WgmmaFence();
  Wgmma<T, 64>::SSZero<1, 1>(z, dk_mn, dv_mn);
#pragma unroll
  for (int kk = 1; kk < kN / 16; ++kk) Wgmma<T, 64>::SS<1, 1>(z, DescAdd(dk_mn, kk * 2048), DescAdd(dv_mn, kk * 2048), 1);
  WgmmaCommit();
  WgmmaWait<0>();
  FenceRegs(z);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = 8 * i + 2 * t;
    z_out[r * 64 + c] = z[i][0];
    z_out[r * 64 + c + 1] = z[i][1];
    z_out[(r + 8) * 64 + c] = z[i][2];
    z_out[(r + 8) * 64 + c + 1] = z[i][3];
  }
}

static PFN_cuTensorMapEncodeTiled_v12000 Encoder() {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
}

static bool Encode(CUtensorMap* map, void* base, int t, int h, int d, int box_rows) {
  const cuuint64_t dims[3] = {cuuint64_t(d), cuuint64_t(h), cuuint64_t(t)};
  const cuuint64_t strides[2] = {cuuint64_t(d) * 2, cuuint64_t(h) * d * 2};
  const cuuint32_t box[3] = {64, 1, cuuint32_t(box_rows)}, es[3] = {1, 1, 1};
  return Encoder()(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, dims, strides, box, es,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

static float Bf(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Head dim D, 2 heads per tensor (head 1 is used: checks the head coordinate), q/o of tq rows with the
// tile at row0 (tq < row0 + 64 checks the zero fill and the clipped store).
template <int D>
static bool Check(int tq, int row0) {
  constexpr int H = 2, kHead = 1;
  std::mt19937 rng(D + tq);
  std::normal_distribution<float> normal;
  const int tk = kN;
  std::vector<T> q(size_t(tq) * H * D), k(size_t(tk) * H * D), v(size_t(tk) * H * D), o(size_t(tq) * H * D);
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = __float2bfloat16(normal(rng));
  for (auto& e : o) e = __float2bfloat16(-7.0f);
  T *dq, *dk, *dv, *dout;
  float *ds, *dos, *dy, *dz;
  cudaMalloc(&dq, q.size() * 2);
  cudaMalloc(&dk, k.size() * 2);
  cudaMalloc(&dv, v.size() * 2);
  cudaMalloc(&dout, o.size() * 2);
  cudaMalloc(&ds, kM * kN * 4);
  cudaMalloc(&dos, kM * D * 4);
  cudaMalloc(&dy, kM * D * 4);
  cudaMalloc(&dz, 64 * 64 * 4);
  cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dout, o.data(), o.size() * 2, cudaMemcpyHostToDevice);
  UnitMaps maps;
  const bool ok = Encode(&maps.q, dq, tq, H, D, kM) && Encode(&maps.k, dk, tk, H, D, kN) &&
                  Encode(&maps.v, dv, tk, H, D, kN) && Encode(&maps.o, dout, tq, H, D, kM);
  if (!ok) {
    std::printf("D %d: tensor map encoding failed\n", D);
    return false;
  }
  const int smem = (2 * kM + 2 * kN) * D * 2 + 64 + 1024;
  cudaFuncSetAttribute(UnitKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  UnitKernel<D><<<1, 128, smem>>>(maps, ds, dos, dy, dz, kHead, row0);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("D %d: kernel failed: %s\n", D, cudaGetErrorString(err));
    return false;
  }
  std::vector<float> s(kM * kN), os(kM * D), ys(kM * D), zs(64 * 64);
  cudaMemcpy(ys.data(), dy, ys.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(zs.data(), dz, zs.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(os.data(), dos, os.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(o.data(), dout, o.size() * 2, cudaMemcpyDeviceToHost);
  auto at = [&](const std::vector<T>& x, int row, int col) {
    return __bfloat162float(x[(size_t(row) * H + kHead) * D + col]);
  };
  double s_err = 0, o_err = 0, store_err = 0, s_max = 0, o_max = 0;
  std::vector<float> p(kM * kN);
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kN; ++j) {
      double ref = 0;
      for (int c = 0; c < D; ++c) ref += (row0 + i < tq ? at(q, row0 + i, c) : 0.0) * at(k, j, c);
      s_err = std::fmax(s_err, std::fabs(ref - s[i * kN + j]));
      s_max = std::fmax(s_max, std::fabs(ref));
      p[i * kN + j] = Bf(s[i * kN + j] / 16);
    }
  for (int i = 0; i < kM; ++i)
    for (int c = 0; c < D; ++c) {
      double ref = 0;
      for (int j = 0; j < kN; ++j) ref += double(p[i * kN + j]) * at(v, j, c);
      o_err = std::fmax(o_err, std::fabs(ref - os[i * D + c]));
      o_max = std::fmax(o_max, std::fabs(ref));
      if (row0 + i < tq) store_err = std::fmax(store_err, std::fabs(Bf(os[i * D + c]) - at(o, row0 + i, c)));
    }
  double y_err = 0, y_max = 0, z_err = 0, z_max = 0;
  for (int i = 0; i < kM; ++i)
    for (int c = 0; c < D; ++c) {
      double ref = 0;
      for (int j = 0; j < 64; ++j) ref += double(p[i * kN + j]) * (row0 + j < tq ? at(q, row0 + j, c) : 0.0);
      y_err = std::fmax(y_err, std::fabs(ref - ys[i * D + c]));
      y_max = std::fmax(y_max, std::fabs(ref));
    }
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < 64; ++n) {
      double ref = 0;
      for (int j = 0; j < kN; ++j) ref += double(at(k, j, m)) * at(v, j, n);
      z_err = std::fmax(z_err, std::fabs(ref - zs[m * 64 + n]));
      z_max = std::fmax(z_max, std::fabs(ref));
    }
  const bool bwd_pass = y_err <= 1e-3 * y_max + 1e-3 && z_err <= 1e-3 * z_max + 1e-3;
  std::printf("D %3d tq %3d row0 %2d: backward forms: Y = P Q (B MN-major, 64-row tile) max err %.2e (|Y| %.1f); "
              "Z = K^T V (A MN-major) max err %.2e (|Z| %.1f): %s\n",
              D, tq, row0, y_err, y_max, z_err, z_max, bwd_pass ? "ok" : "WRONG");
  // Rows of o outside [row0, row0 + 64) and head 0 keep their -7.
  int clobbered = 0;
  for (int row = 0; row < tq; ++row)
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < D; ++c)
        if ((h != kHead || row < row0 || row >= row0 + kM) && __bfloat162float(o[(size_t(row) * H + h) * D + c]) != -7.0f)
          ++clobbered;
  const bool pass = bwd_pass && s_err <= 1e-3 * s_max + 1e-3 && o_err <= 1e-3 * o_max + 1e-3 && store_err == 0 && clobbered == 0;
  std::printf("D %3d tq %3d row0 %2d: S = QK^T max err %.2e (|S| %.1f); O = PV max err %.2e (|O| %.1f); "
              "TMA store mismatches %.2e, clobbered %d: %s\n",
              D, tq, row0, s_err, s_max, o_err, o_max, store_err, clobbered, pass ? "ok" : "WRONG");
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  cudaFree(ds);
  cudaFree(dos);
  cudaFree(dy);
  cudaFree(dz);
  return pass;
}

int main() {
  if (Encoder() == nullptr) {
    std::printf("sm90_unit: no cuTensorMapEncodeTiled entry point\nsm90_unit: FAIL\n");
    return 1;
  }
  bool ok = true;
  ok &= Check<64>(200, 64);
  ok &= Check<128>(200, 64);
  ok &= Check<128>(100, 64);  // rows 100..127 of the tile are past the end: zero-filled, store clipped
  std::printf("sm90_unit: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
