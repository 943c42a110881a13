// attnjit/common.cuh: element types, 16-byte async copies, fast math: what every kernel family uses.
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

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A softmax row's lse (log2) from its max m and its sum d: -inf where no key is visible (d = 0), and NaN where d is
// NaN (a NaN input, or a logits_scale that is not positive): never the empty row's -inf, which a split-KV merge
// skips as a chunk with no visible key, so a NaN would turn into a finite wrong row.
__device__ __forceinline__ float row_lse(float m, float d) {
  return d > 0.f ? m + fast_log2(d) : d == 0.f ? neg_inf() : d;
}

// What a softmax row's accumulated o is multiplied by: 1/d, 0 where no key is visible (d = 0), and NaN where d is
// NaN, so that the row's o is NaN with its lse even where o summed nothing (a NaN sink with no visible key).
__device__ __forceinline__ float row_rcp(float d) {
  return d > 0.f ? fast_rcp(d) : d == 0.f ? 0.f : d;
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

// 4 or 8 bytes global -> shared (cp.async.ca: the .cg form takes 16 only); when !pred, zero-filled and nothing read.
template <int BYTES>
__device__ __forceinline__ void cp_async_ca(uint32_t dst, const void* src, bool pred) {
  static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes (16: cp_async_16)");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(BYTES),
               "r"(pred ? BYTES : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace attnjit
