// attnjit/fa2/mma.cuh: the fa2 family's tensor-core fragments (mma.sync m16n8k16, ldmatrix) and its row-contiguous
// swizzled tile layout.
#pragma once
#include "attnjit/common.cuh"

namespace attnjit {

// The B operand of an m16n8k16 mma whose 16x8 tile is all ones: A x ones puts each row's sum in every column.
template <typename T>
__device__ __forceinline__ uint32_t ones2() {
  return is_bf16<T>::value ? 0x3f803f80u : 0x3c003c00u;
}

// ---- tensor-core fragments (mma.sync m16n8k16, ldmatrix) ------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c[16x8 f32] += a[16x16 T, row] * b[16x8 T, col]
template <typename T>
__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, const uint32_t* b) {
  if constexpr (is_bf16<T>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Byte offset of the 16-byte chunk `chunk` of row `row` in a [rows][CHUNKS*8] tile of 16-bit elements,
// XOR-swizzled so that 8 consecutive rows at one logical chunk land in 8 different bank groups
// (conflict-free ldmatrix and cp.async). Needs CHUNKS >= 8, i.e. head_dim >= 64.
template <int CHUNKS>
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  static_assert(CHUNKS >= 8 && (CHUNKS & (CHUNKS - 1)) == 0, "swizzle needs a power-of-two row of >= 8 chunks");
  return static_cast<uint32_t>((row * CHUNKS + (chunk ^ (row & 7))) * 16);
}

}  // namespace attnjit
