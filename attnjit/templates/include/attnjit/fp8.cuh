// attnjit/fp8.cuh: an fp8 KV cache (e4m3, e5m2) converted to fp16 (fa2/fp8_frags.cuh: in registers, for the mma)
// or to the kernels' 16-bit type T (dequant_rows: in shared memory, where a key transform rewrites K there).
//
// Conversions are exact: every e4m3 and e5m2 value (but NaN) is an fp16 value, and every fp16 value of that range
// a bf16 one. sm_89 and up convert with the hardware instruction (cvt.rn.f16x2.e4m3x2 / e5m2x2: SASS F2FP); sm_80
// with bit tricks on the packed bytes:
//   e5m2 -> fp16: the byte is the fp16's high byte (same sign, exponent bias 15, the top 2 mantissa bits).
//   e4m3 -> fp16: sign to bit 15, exponent and mantissa (7 bits) to bits 7..13, which is the value * 2^-8 in fp16
//                 (exponent bias 7 vs 15; subnormals map to subnormals), then one exact multiply by 2^8. The bit path
//                 reads e4m3's NaN (0x7f) as 480; the hardware path gives NaN.
// bf16: via fp16 -> float -> bf16, exact.
// The scale of a quantized cache (k_scale, v_scale) is applied outside: k_scale in the logit scale, v_scale on the
// output (attnjit/fa2/attention.cuh), so the converted values are the stored ones.
#pragma once
#include <cuda_fp8.h>

#include "attnjit/common.cuh"

namespace attnjit {

template <typename TKV>
struct is_fp8 : std::integral_constant<bool, sizeof(TKV) == 1> {};

template <typename TKV>
struct is_e5m2 : std::is_same<TKV, __nv_fp8_e5m2> {};

// Two fp8 (low byte = the first) -> two fp16 in one register (low half = the first).
template <typename TKV>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint16_t x) {
  uint32_t h;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (is_e5m2<TKV>::value) {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h) : "h"(x));
  } else {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(x));
  }
#else
  const uint32_t w = x;
  if constexpr (is_e5m2<TKV>::value) {
    h = __byte_perm(w, 0u, 0x1404);  // bytes [0, b0, 0, b1]: each byte is the high byte of its fp16
  } else {
    const uint32_t s = __byte_perm(w, 0u, 0x1404);                    // [0, b0, 0, b1]
    const uint32_t bits = (s & 0x80008000u) | ((s & 0x7f007f00u) >> 1);  // sign | exponent, mantissa at 7..13
    __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&bits), __half2half2(__ushort_as_half(0x5c00)));  // 2^8
    h = *reinterpret_cast<uint32_t*>(&v);
  }
#endif
  return h;
}

// Four fp8 (one 32-bit word) -> two half2: h[0] from bytes 0, 1 and h[1] from bytes 2, 3. On sm_89 and up, H1: the
// high half goes straight into the conversion (SASS R.H1), with no shift to extract it (both conversions in one asm
// block: where registers are short, H1 = false lets the compiler schedule them apart).
template <typename TKV, bool H1 = true>
__device__ __forceinline__ void fp8x4_to_half2x2(uint32_t w, uint32_t (&h)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (H1) {
    if constexpr (is_e5m2<TKV>::value) {
      asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e5m2x2 %0, lo;\n cvt.rn.f16x2.e5m2x2 %1, hi;}"
          : "=r"(h[0]), "=r"(h[1]) : "r"(w));
    } else {
      asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;}"
          : "=r"(h[0]), "=r"(h[1]) : "r"(w));
    }
    return;
  }
#endif
  h[0] = fp8x2_to_half2<TKV>(static_cast<uint16_t>(w & 0xffffu));
  h[1] = fp8x2_to_half2<TKV>(static_cast<uint16_t>(w >> 16));
}

// Two fp8 -> two T (fp16 or bf16) in one register.
template <typename T, typename TKV>
__device__ __forceinline__ uint32_t fp8x2_to(uint16_t x) {
  const uint32_t h = fp8x2_to_half2<TKV>(x);
  if constexpr (is_bf16<T>::value) {
    const float2 f = unpack2<__half>(h);
    return pack2<T>(f.x, f.y);
  } else {
    return h;
  }
}

// Eight fp8 (8 bytes) -> eight T (16 bytes), in order.
template <typename T, typename TKV>
__device__ __forceinline__ uint4 fp8x8_to(uint2 raw) {
  uint4 out;
  out.x = fp8x2_to<T, TKV>(static_cast<uint16_t>(raw.x & 0xffffu));
  out.y = fp8x2_to<T, TKV>(static_cast<uint16_t>(raw.x >> 16));
  out.z = fp8x2_to<T, TKV>(static_cast<uint16_t>(raw.y & 0xffffu));
  out.w = fp8x2_to<T, TKV>(static_cast<uint16_t>(raw.y >> 16));
  return out;
}

// Eight fp8 (8 bytes) -> eight fp16 (16 bytes), in order; H1: each word's high half converted in place (R.H1), with
// no shift or mask to extract it (false where registers are short).
template <typename TKV, bool H1>
__device__ __forceinline__ uint4 fp8x8_to_half(uint2 raw) {
  uint32_t a[2], b[2];
  fp8x4_to_half2x2<TKV, H1>(raw.x, a);
  fp8x4_to_half2x2<TKV, H1>(raw.y, b);
  return make_uint4(a[0], a[1], b[0], b[1]);
}

}  // namespace attnjit
