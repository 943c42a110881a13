// attnjit/sm90/wgmma.cuh: Hopper primitives of the sm90 family (sm_90a): wgmma and its shared-memory descriptors,
// mbarriers, named barriers, setmaxnreg and the proxy fence.
#pragma once
#include "attnjit/common.cuh"

namespace attnjit {
namespace sm90 {

// ---- wgmma ---------------------------------------------------------------------------------------------------

// Shared-memory matrix descriptor of a tile in the 128-byte swizzle layout (attnjit/kv_load.cuh, PITCH = 128):
// start address, leading and stride byte offsets (16-byte units), swizzle mode 1 (128 B) in bits 62-63.
//   K-major operand (Q, K: rows of 64 contiguous k elements): LBO unused (1), SBO = the stride between 8-row
//   groups (1024: 8 rows of 128 B; interleaved K/V tiles, Sm90Traits::KV_GS).
//   MN-major operand (V: rows are k = kv tokens, 64 contiguous n = head-dim elements per 128-byte row): LBO = the
//   stride between 64-column blocks, SBO = the stride between 8-row groups (1024, or KV_GS).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
         (static_cast<uint64_t>(sbo_bytes >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads or writes of r across the asm statements around a wgmma.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
template <int N, typename R>
__device__ __forceinline__ void fence_operands(R* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_operand(r[i]);
}

template <int N, typename T>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t a, uint64_t b, int scale_d);
template <int N, typename T>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t b);

// Generic-proxy writes to shared memory (cp.async, st.shared) made visible to the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- barriers --------------------------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Arrives on `bar` once every cp.async this thread issued so far has landed (the barrier's count includes it).
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Waits until the phase of parity `parity` has completed (a fresh barrier's parity-1 phase counts as completed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// Named barriers (0 is __syncthreads): `count` threads (a multiple of 32) meet at barrier `id`.
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Register budgets per warpgroup role (needs __launch_bounds__(threads, 1); each role one branch).
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

#include "attnjit/sm90/wgmma_ops.cuh"

}  // namespace sm90
}  // namespace attnjit
