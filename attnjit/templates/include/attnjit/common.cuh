// attnjit/common.cuh: element types, 16-byte async copies, ldmatrix/mma wrappers, fast math.
// Plain CUDA C++ (sm_80+); the generator inlines this header into each rendered source.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace attnjit {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// ---- element types ------------------------------------------------------------------------------------

template <typename T>
struct is_bf16 : std::is_same<T, __nv_bfloat16> {};

// Two floats -> one 32-bit register holding two T (low half = a).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (is_bf16<T>::value) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t r) {
  if constexpr (is_bf16<T>::value) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&r));
  }
}

// 8 elements of T (16 bytes) <-> 8 floats.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* out) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = unpack2<T>(w[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float* in) {
  uint4 raw;
  raw.x = pack2<T>(in[0], in[1]);
  raw.y = pack2<T>(in[2], in[3]);
  raw.z = pack2<T>(in[4], in[5]);
  raw.w = pack2<T>(in[6], in[7]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// ---- math -----------------------------------------------------------------------------------------------

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; exact 0 for -inf
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_rcp(float x) {  // 1/x to about 1 ulp (no IEEE slow path)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The B operand of an m16n8k16 mma whose 16x8 tile is all ones: A x ones puts each row's sum in every column.
template <typename T>
__device__ __forceinline__ uint32_t ones2() {
  return is_bf16<T>::value ? 0x3f803f80u : 0x3c003c00u;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- async copies (cp.async, sm_80+) ----------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; when !pred, the 16 bytes are zero-filled and nothing is read.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool pred) {
  const int bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- tensor-core fragments (mma.sync m16n8k16, ldmatrix) ------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
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
