// Thin wrappers over the sm_80+ instructions the FFA kernels are built from: cp.async (global -> shared,
// 16 bytes, zero-filling rows past the end), ldmatrix (plain and transposed), mma.sync m16n8k16 with fp32
// accumulators, and the fast exp2. Every fragment layout below is the PTX ISA's for m16n8k16:
//   A 16x16 (4 regs): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8  (2 regs): b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C 16x8  (4 fp32): c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)        g = lane / 4, t = lane % 4
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#define MAGI_DEV __device__ __forceinline__

namespace magi_jax::cuda {

MAGI_DEV uint32_t SmemAddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Programmatic dependent launch (sm_90; launch.h LaunchKernel): a chained kernel may start while the kernel
// before it on the stream is still running, so that the launch latency between the small preparation kernels
// and the attention kernel passes under the previous kernel. It must wait here before it touches anything
// that kernel (or, transitively, anything before it on the stream) writes; for a kernel launched plainly the
// wait returns at once.
MAGI_DEV void WaitPriorGrid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
// Lets the next chained kernel be launched now; its CTAs then wait in WaitPriorGrid until this grid is done.
MAGI_DEV void LaunchDependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// 16 bytes global -> shared; src_bytes = 0 writes zeros and reads nothing.
MAGI_DEV void CpAsync16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(smem)), "l"(gmem),
               "r"(src_bytes));
}
MAGI_DEV void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
MAGI_DEV void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 matrices; lanes 8i..8i+7 give the row addresses of matrix i, which lands in r[i].
MAGI_DEV void Ldmatrix4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(smem)));
}
MAGI_DEV void Ldmatrix4Trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(smem)));
}

// Element traits: the mma flavour and the packing of two floats into one 32-bit A/B register.
template <typename T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
  static MAGI_DEV uint32_t Pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static MAGI_DEV void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static MAGI_DEV float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
};

template <>
struct Elem<__half> {
  static MAGI_DEV uint32_t Pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static MAGI_DEV void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static MAGI_DEV float ToFloat(__half x) { return __half2float(x); }
};

// 2^x; ex2.approx flushes subnormals and maps -inf to 0, which the online softmax relies on.
MAGI_DEV float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace magi_jax::cuda
