// attnjit/fa2/fp8_frags.cuh: an fp8 KV cache read straight into the mma's 16-bit operands, in registers.
//
// The staged fp8 tile (rows of KV_ROW_BYTES, attnjit/kv_load.cuh) is read with ldmatrix as if its bytes were 16-bit
// pairs: an 8x8 matrix of b16 is 8 rows of 16 fp8 values. A thread (g = lane / 4, t = lane % 4) gets the 32-bit
// word t of row g, so the bytes land in an order the m16n8k16 fragments do not have; two reorderings of summed or
// stored axes make them fit with no shuffle:
//
// K (B of S = Q K^T, rows = keys, k = dims): the thread holds dims 4t .. 4t + 3 of key g of a 16-dim block, and the
//   fragment wants k = 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1). The dot product sums over the dims, so Q takes the
//   same order: mma k 2t + j is dim 4t + j, mma k 2t + 8 + j is dim 4t + 2 + j (q_frag_fp8_order).
// V (B of O += P V, k = keys, n = dims): with .trans the thread holds b16 (keys 2t, 2t + 1) x (dims 2g, 2g + 1),
//   bytes [k 2t d 2g, k 2t d 2g+1, k 2t+1 d 2g, k 2t+1 d 2g+1]. One byte permutation gives the key pair of dim 2g
//   and that of dim 2g + 1: so a 16-dim block is two n8 tiles, its even dims and its odd dims (o[2c] and o[2c + 1]).
//   The thread's accumulators of block c hold dims 16c + 4t + {0, 2} (even tile) and + {1, 3} (odd tile): the
//   epilogue reads them through fp8_o_col / the CTA's o_pair, in dim order.
//
// The mma runs in fp16 whatever q's type: fp8 -> fp16 is one instruction per two values (F2FP), and to bf16 it is
// three more. A bf16 q becomes fp16 once per work item, in the Q tile (q_rows_to_half): each row times 2^e, e chosen
// so the row's largest |q| lies in [2^14, 2^15), so nothing overflows fp16 and every element keeps 11 significant
// bits, at least bf16's 8, down to 2^-29 of the row's largest (below that, fp16 subnormals: terms under 2^-24 of the
// row's largest product, where the fp32 accumulation rounds them off anyway). S is multiplied back by 2^-e (exact).
// P (in [0, 1]) is fp16 too: 11 bits, where bf16 has 8.
#pragma once
#include "attnjit/common.cuh"
#include "attnjit/fa2/mma.cuh"
#include "attnjit/fp8.cuh"
#include "attnjit/kv_load.cuh"

namespace attnjit {

// K fragments of 16 keys x 16 KB dims (KB = 2, or 1: fewer live registers): `addr` is this lane's row (key
// (lane / 8) % 2 * 8 + lane % 8) at its chunk: the first (KB = 1) or, for lane / 16 = 1, the second of the 32 bytes
// (G::stage8_y16 gives where in the staged row). b[j]: n-tile j % 2 (keys 8 (j % 2) ..) of dim block j / 2, in the
// Q order above.
template <typename TKV, int KB, bool H1>
__device__ __forceinline__ void k_frags_fp8(uint32_t addr, uint32_t (&b)[2 * KB][2]) {
  static_assert(KB == 1 || KB == 2, "one or two 16-dim blocks");
  uint32_t w[2 * KB];
  if constexpr (KB == 2) ldmatrix_x4(w, addr);
  else ldmatrix_x2(w, addr);
#pragma unroll
  for (int j = 0; j < 2 * KB; ++j) fp8x4_to_half2x2<TKV, H1>(w[j], b[j]);  // bytes 0, 1 -> b0; bytes 2, 3 -> b1
}

// V fragments of 16 keys x 32 dims at the same lane addressing: b[h][par] is the B fragment of dim block h's
// even (par 0) or odd (par 1) dims, keys 0..15 (b0 from keys 0-7, b1 from keys 8-15).
template <typename TKV, bool H1>
__device__ __forceinline__ void v_frags_fp8(uint32_t addr, uint32_t (&b)[2][2][2]) {
  uint32_t w[4];
  ldmatrix_x4_trans(w, addr);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // [d 2g of k 2t, d 2g of k 2t+1, d 2g+1 of k 2t, d 2g+1 of k 2t+1]: the even dim's key pair, the odd dim's
    uint32_t lo[2], hi[2];
    fp8x4_to_half2x2<TKV, H1>(__byte_perm(w[2 * h], 0u, 0x3120), lo);      // keys 0-7
    fp8x4_to_half2x2<TKV, H1>(__byte_perm(w[2 * h + 1], 0u, 0x3120), hi);  // keys 8-15
    b[h][0][0] = lo[0], b[h][0][1] = hi[0], b[h][1][0] = lo[1], b[h][1][1] = hi[1];
  }
}

// S = Q K^T of one staged fp8 K tile, in fp16. ks: this lane's ldmatrix row of the tile (the CTA's kv8_row_off),
// y16 its chunks' XOR term (G::stage8_y16); a_frag(mq, kd, a) gives Q's fragment of row block mq and dim block kd
// in the K order (q_frag_fp8_order). KB 16-dim blocks per K load: two (one ldmatrix.x4) where one row block leaves
// registers to spare.
template <typename G, typename AFrag>
__device__ __forceinline__ void s_tile_fp8(float (&s)[G::NUM_MMA_Q][G::NUM_MMA_KV * 2][4], uint32_t ks,
                                           uint32_t y16, const AFrag& a_frag) {
  constexpr int KB = G::NUM_MMA_Q == 1 ? 2 : 1;
#pragma unroll
  for (int kb = 0; kb < G::HEAD_DIM / 16 / KB; ++kb) {
    uint32_t a[G::NUM_MMA_Q][KB][4];
#pragma unroll
    for (int mq = 0; mq < G::NUM_MMA_Q; ++mq)
#pragma unroll
      for (int h = 0; h < KB; ++h) a_frag(mq, KB * kb + h, a[mq][h]);
#pragma unroll
    for (int mkv = 0; mkv < G::NUM_MMA_KV; ++mkv) {
      uint32_t b[2 * KB][2];
      k_frags_fp8<typename G::TKV, KB, KB == 2>(ks + mkv * 16 * G::KV_ROW_BYTES + ((kb * 16 * KB) ^ y16), b);
#pragma unroll
      for (int mq = 0; mq < G::NUM_MMA_Q; ++mq)
#pragma unroll
        for (int j = 0; j < 2 * KB; ++j) mma_16816<__half>(s[mq][2 * mkv + j % 2], a[mq][j / 2], b[j]);
    }
  }
}

// O += P V of 16 keys of one staged fp8 V tile, in fp16: dim block c's even dims into o[2c], its odd dims into
// o[2c + 1]. a: P's fragments (fp16); v_addr: this lane's ldmatrix row of the 16 keys, y16 its chunks' XOR term.
template <typename G>
__device__ __forceinline__ void pv_block_fp8(float (&o)[G::NUM_MMA_Q][G::HEAD_DIM / 8][4],
                                             const uint32_t (&a)[G::NUM_MMA_Q][4], uint32_t v_addr, uint32_t y16) {
#pragma unroll
  for (int c2 = 0; c2 < G::HEAD_DIM / 32; ++c2) {
    uint32_t b[2][2][2];
    v_frags_fp8<typename G::TKV, G::NUM_MMA_Q == 1>(v_addr + ((c2 * 32) ^ y16), b);
#pragma unroll
    for (int mq = 0; mq < G::NUM_MMA_Q; ++mq)
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_16816<__half>(o[mq][4 * c2 + j], a[mq], b[j / 2][j % 2]);
  }
}

// 16-byte shared-memory store and load of four words (asm volatile: the compiler neither forwards the stored values
// nor moves the load above the barrier between them)
__device__ __forceinline__ void sts_v4(uint32_t addr, const uint32_t (&v)[4]) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}
__device__ __forceinline__ void lds_v4(uint32_t addr, uint32_t (&v)[4]) {
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(addr)
               : "memory");
}

// The A fragment of Q rows row, row + 8 and 16-dim block kd in the K order above, from a 16-bit tile of ROW_BYTES
// rows swizzled as fa2's tiles (chunk c of row r at ((c ^ (r & 7)) << 4)); row % 8 == lane / 4.
template <int ROW_BYTES>
__device__ __forceinline__ void q_frag_fp8_order(const uint8_t* tile, int row, int kd, int lane, uint32_t (&a)[4]) {
  const int t = lane % 4;
  const uint32_t off = (((2 * kd + t / 2) ^ (row & 7)) << 4) + (t & 1) * 8;  // dims 16 kd + 4t .. + 3
  const uint2 lo = *reinterpret_cast<const uint2*>(tile + row * ROW_BYTES + off);
  const uint2 hi = *reinterpret_cast<const uint2*>(tile + (row + 8) * ROW_BYTES + off);
  a[0] = lo.x, a[1] = hi.x, a[2] = lo.y, a[3] = hi.y;
}

// A bf16 Q tile (CTA_Q rows, fa2's swizzle) into fp16 in place, row r times 2^e_r (above); row_inv[r] = 2^-e_r:
// TPR threads per row (a power of two <= 8) each convert CHUNKS / TPR 16-byte chunks (attnjit/kv_load.cuh).
template <typename G>
__device__ __forceinline__ void q_rows_to_half(uint8_t* tile, float* row_inv, unsigned tid) {
  constexpr int TPR = G::NUM_THREADS / G::CTA_Q >= 8 ? 8 : G::NUM_THREADS / G::CTA_Q >= 4 ? 4 : 1;
  q_rows_to_half_rows<G, G::CTA_Q, G::NUM_THREADS, TPR>(tile, row_inv, 0, tid);
}

// The first of the two dims accumulator pair dt (0 .. D / 8) of a lane holds: pair 2c + h is (o[2c][2r + h],
// o[2c + 1][2r + h]), dims 16c + 4t + 2h and + 1.
__device__ __forceinline__ int fp8_o_col(int dt, int lane) { return (dt / 2) * 16 + 4 * (lane % 4) + 2 * (dt & 1); }

// The values of that pair, from one row block's accumulators o[D / 8][4] (row half r).
template <int NT>
__device__ __forceinline__ float2 fp8_o_pair(const float (&o)[NT][4], int dt, int r) {
  return make_float2(o[dt & ~1][2 * r + (dt & 1)], o[dt | 1][2 * r + (dt & 1)]);
}

}  // namespace attnjit
