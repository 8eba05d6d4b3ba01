// Thin wrappers over the sm_90(a) instructions of the Hopper path: mbarriers, the tensor-memory accelerator
// (cp.async.bulk.tensor loads completing on an mbarrier, stores and reduce-adds in bulk groups), proxy
// fences, named barriers, setmaxnreg and the wgmma fence / commit / wait, plus shared-memory matrix
// descriptors.
// Written against the PTX ISA directly (no CuTe), see NOTES.md "sm90 path" for why.
#pragma once

#include <cuda.h>  // CUtensorMap (a 128-byte opaque struct; no driver library is linked)

#include <cstdint>

#include "ptx.h"

namespace magi_jax::cuda {

// The dynamic shared buffer aligned up to 1024 bytes (the 128-byte swizzle atoms), by an offset added to
// `raw` rather than through an integer round trip: the compiler then keeps every pointer derived from it in the
// shared state space, so their plain loads are LDS. Through uintptr_t they were generic LD.E, waited for on
// the long scoreboard: the backward's step info and lse / delta reads, ~10% of its stall samples (ncu, causal
// 32k).
MAGI_DEV unsigned char* AlignSmem1024(unsigned char* raw) {
  return raw + ((1024u - (SmemAddr(raw) & 1023u)) & 1023u);
}

// ------------------------------------------------------------------------------------------- mbarriers

MAGI_DEV void MbarInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count));
}
// Makes the initialisations visible to the async proxy (TMA) before any use; follow with a CTA barrier.
MAGI_DEV void MbarInitFence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

MAGI_DEV void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddr(bar)) : "memory");
}
// MbarArrive by the threads with `pred` only, predicated inside one asm statement: no branch (a branch between
// a wgmma commit and the wait that retires it made ptxas lose count of the commit groups).
MAGI_DEV void MbarArriveIf(uint64_t* bar, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(
                   SmemAddr(bar)),
               "r"(int(pred))
               : "memory");
}
// The producer's arrival announcing `bytes` of TMA transactions to complete the current phase.
MAGI_DEV void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(bytes)
               : "memory");
}
// Announces `bytes` of TMA transactions for the current phase without arriving: the TMA can be issued before
// the data the producer writes itself, whose arrival (MbarArrive, a release) then completes the phase.
MAGI_DEV void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(bytes)
               : "memory");
}
// Waits until the phase with this parity has completed (a fresh barrier counts its phase "-1", parity 1,
// as complete, so producers start waiting on the empty barriers with parity 1). The retry loop stays inside
// one asm statement: a C++ loop would be a divergent path to ptxas, which then serialises the wgmmas.
MAGI_DEV void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n" ::"r"(
          SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

// A ring position: stage index and the parity of its current phase.
template <int kStages>
struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  MAGI_DEV void Advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// ------------------------------------------------------------------------------------------------ TMA

MAGI_DEV void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// A 3-d box into L2 only (no shared memory, no barrier): warms a later load of it.
MAGI_DEV void TmaPrefetchL2(const CUtensorMap* map, int x, int y, int z) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(x), "r"(y), "r"(z)
               : "memory");
}

// A 3-d box (x innermost) global -> shared, completing `bar`'s transaction count. Out-of-bounds elements
// (rows past the tensor's end) are written as zeros and still count towards the bytes.
MAGI_DEV void TmaLoad3d(void* smem, const CUtensorMap* map, uint64_t* bar, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
          SmemAddr(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(x), "r"(y), "r"(z)
      : "memory");
}

// A 3-d box shared -> global; elements outside the tensor are not written.
MAGI_DEV void TmaStore3d(const CUtensorMap* map, const void* smem, int x, int y, int z) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(SmemAddr(smem)), "r"(x), "r"(y), "r"(z)
               : "memory");
}
// A 4-d box shared -> global, added element-wise (fp32 .add; each element's add is atomic, so boxes of
// several CTAs may overlap); elements outside the tensor are skipped. Same bulk-group completion as the
// store: the buffer may be rewritten after BulkWaitRead, the adds are visible after BulkWait.
MAGI_DEV void TmaReduceAdd4d(const CUtensorMap* map, const void* smem, int x, int y, int z, int w) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(SmemAddr(smem)), "r"(x), "r"(y), "r"(z), "r"(w)
      : "memory");
}
MAGI_DEV void BulkCommit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until the committed bulk stores have finished reading shared memory (the buffer may be reused).
// A thread without bulk groups passes straight through.
MAGI_DEV void BulkWaitRead() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until the committed bulk stores are complete.
MAGI_DEV void BulkWait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA, wgmma) reads.
MAGI_DEV void FenceProxyAsyncShared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ----------------------------------------------------------------------------- named barriers, registers

// 0, unknown to NVVM (a volatile asm is neither folded nor hoisted out of a loop): added to a loop-invariant
// value, it makes the compiler compute that value where it is used instead of holding it in a (uniform)
// register across the loop. ptxas folds the 0 itself but leaves the computation in place.
MAGI_DEV uint32_t OpaqueZero() {
  uint32_t z;
  asm volatile("mov.u32 %0, 0;\n" : "=r"(z));
  return z;
}

// Whether this thread is the one lane that elect.sync picks in its warp (all 32 lanes must call): a choice
// of thread that needs no thread index, so none is re-read (S2R) where registers are short.
MAGI_DEV bool ElectOne() {
  uint32_t elected;
  asm volatile("{\n .reg .pred p;\n elect.sync _|p, 0xffffffff;\n selp.u32 %0, 1, 0, p;\n}\n" : "=r"(elected));
  return elected != 0;
}

MAGI_DEV void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts this thread towards barrier `id` (of `threads` in all) without waiting: the signalling half of a
// handshake whose other side calls NamedBarrierSync with the same count.
MAGI_DEV void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Whether `pred` holds on every one of the `threads` threads that arrive at barrier `id` (bar.red.and: a
// named barrier that also reduces), the same answer on all of them.
MAGI_DEV bool NamedBarrierAll(int id, int threads, bool pred) {
  uint32_t all;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(all)
      : "r"(uint32_t(pred)), "r"(id), "r"(threads)
      : "memory");
  return all != 0;
}

template <int kRegs>
MAGI_DEV void SetMaxRegsInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
MAGI_DEV void SetMaxRegsDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ------------------------------------------------------------------------------------------------ wgmma

MAGI_DEV void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
MAGI_DEV void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
MAGI_DEV void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses of accumulator registers across wgmma issue / wait points.
template <int R, int C>
MAGI_DEV void FenceRegs(float (&x)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) asm volatile("" : "+f"(x[i][j])::"memory");
}
template <int R, int C>
MAGI_DEV void FenceRegs(uint32_t (&x)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}

// Shared-memory matrix descriptor for a tile in the 128-byte swizzle layout TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B: 8-row x 128-byte atoms (1024-byte aligned), row r of an atom at r * 128
// bytes with its 16-byte units XOR-ed by r. Fields: start >> 4 (bits 0-13), leading byte offset >> 4
// (16-29), stride byte offset >> 4 (32-45), swizzle mode 1 = 128B (bits 62-63).
//   K-major operand (rows = M or N, 64 contiguous k per 128 bytes): SBO = 1024 (next 8 rows); LBO is not
//     read for this layout (pass 16); the next k16 step starts 32 bytes further, the next 64-k chunk at the
//     chunk's own base.
//   MN-major operand (rows = k, 64 contiguous m/n per 128 bytes): SBO = 1024 (next 8 k), LBO = the byte
//     distance between 64-column chunks of m/n; the next k16 step starts 2048 bytes further.
MAGI_DEV uint64_t SmemDesc128B(const void* smem, uint32_t lbo_bytes) {
  const uint64_t addr = SmemAddr(smem);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
// The same descriptor moved by `bytes` (a multiple of 16; stays inside the 14-bit address field).
MAGI_DEV uint64_t DescAdd(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// Byte offset of element (row, col) of a [rows][64] 16-bit chunk in the 128-byte swizzle layout.
MAGI_DEV uint32_t Swizzle128B(int row, int col) {
  return uint32_t(row) * 128u + ((uint32_t(col) * 2u) ^ (uint32_t(row & 7) << 4));
}

// Four 8x8 16-bit matrices from a warp's registers into shared memory, one instruction (instead of four
// 32-bit stores per thread): register i of each thread holds its pair of matrix i in the mma C layout (row
// lane / 4, columns 2 (lane % 4) and + 1); lane l gives the address of row l % 8 of matrix l / 8, 16
// contiguous bytes (in the 128-byte swizzle, 8 columns from a multiple of 8 are).
MAGI_DEV void StMatrixX4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

}  // namespace magi_jax::cuda
