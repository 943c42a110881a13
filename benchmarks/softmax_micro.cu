// The sm90 consumer's softmax alone, and beside another warpgroup's wgmma: cycles per 64 x 128 tile per warp.
// (benchmarks/softmax_micro.py builds and runs it; RESULTS.md, run 54, has what it measured.)
//
// soft_*: each warp of the launch runs the consumer's online softmax of a 64 x 128 S tile (a thread's 2 rows x 32
// columns, as Consumer::softmax; the MODE bits pick its parts) over its registers `iters` times. bg_*: warpgroup 0
// runs the full softmax while warpgroup 1 runs 1500 groups of wgmma from zeroed shared memory (BG: 1 the 8 SS
// m64n128k16 of S = Q K^T, 2 the 8 RS m64n128k16 of O += P V, 3 both); bg_alone and bg_two time those groups with
// no softmax, by one warpgroup and by two at once. c[warp] gets cycles per softmax (or per group); c[8 * 132 + ...]
// the cycles spent issuing a group.
#include <cuda_bf16.h>
#include <stdint.h>

#include "attnjit/sm90/wgmma.cuh"

namespace {
using namespace attnjit::sm90;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

enum : int { MAX = 1, EXP = 2, SUM = 4, PACK = 8, RESCALE = 16, FULL = 31 };

// Consumer::softmax + rescale_o + pack_p on registers; the asm statements stand in for the wgmma that writes S
template <int MODE>
__device__ void softmax_loop(long long* c, int iters, float scale) {
  float s[64], o[64];
  uint32_t pf[32] = {};
  for (int i = 0; i < 64; ++i) {
    s[i] = ((threadIdx.x * 7 + i * 13) % 97) * -0.01f;
    o[i] = i;
  }
  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f}, alpha[2];
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(s[i]));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
      if (MODE & MAX) {
        float raw = neg_inf();
#pragma unroll
        for (int j = 0; j < 16; ++j) raw = fmaxf(raw, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 1));
        raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 2));
        mx = fmaxf(m[r], raw * scale);
      }
      const float ms = mx == neg_inf() ? 0.f : mx;
      alpha[r] = ex2(m[r] - ms);
      m[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = fmaf(s[4 * j + 2 * r + e], scale, -ms);
          if (MODE & EXP) x = ex2(x);
          s[4 * j + 2 * r + e] = x;
          if (MODE & SUM) sum += x;
        }
      l[r] = l[r] * alpha[r] + sum;
    }
    if (MODE & RESCALE) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o[4 * j] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    }
    if (MODE & PACK) {
#pragma unroll
      for (int k = 0; k < 32; ++k) pf[k] = pack2(s[2 * k], s[2 * k + 1]);
#pragma unroll
      for (int k = 0; k < 32; ++k) asm volatile("" ::"r"(pf[k]));
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(o[i]));
  }
  const long long t1 = clock64();
  float acc = l[0] + l[1];  // everything computed reaches the store, so nothing is optimized away
  for (int i = 0; i < 64; ++i) acc += s[i] + o[i];
  for (int k = 0; k < 32; ++k) acc += __uint_as_float(pf[k]);
  if (threadIdx.x % 32 == 0) c[blockIdx.x * 8 + threadIdx.x / 32] = acc == 12345.f ? 0 : (t1 - t0);
}

constexpr int SMEM = 98304;  // Q (16 KB), K (32 KB), V (32 KB) tiles and slack, zeroed
constexpr int GROUPS = 1500;

// wgmma groups as a consumer issues them (fixed count: every warp of the warpgroup runs the same .aligned wgmma)
template <int BG>
__device__ void gemm_loop(long long* c, const uint8_t* smem) {
  float s[64], o[64];
  uint32_t pf[8][4];
  for (int i = 0; i < 64; ++i) s[i] = o[i] = 0.f;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) pf[i][j] = 0;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint64_t a0 = smem_desc(base, 16, 1024), b0 = smem_desc(base + 16384, 16, 1024);
  const uint64_t v0 = smem_desc(base + 49152, 128 * 128, 1024);
  long long issue = 0;
  const long long t0 = clock64();
  for (int n = 0; n < GROUPS; ++n) {
    const long long ti = clock64();
    wgmma_fence();
    if (BG & 1) {
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        wgmma_ss<128, __nv_bfloat16>(s, a0 + (((kk / 4) * 8192 + (kk % 4) * 32) >> 4),
                                     b0 + (((kk / 4) * 16384 + (kk % 4) * 32) >> 4), 1);
    }
    if (BG & 2) {
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) wgmma_rs<128, __nv_bfloat16>(o, pf[kk], v0 + ((kk * 16 * 128) >> 4));
    }
    wgmma_commit();
    asm volatile("" ::: "memory");
    issue += clock64() - ti;
    wgmma_wait<0>();
    fence_operands<64>(s);
    fence_operands<64>(o);
  }
  const long long t1 = clock64();
  float acc = 0.f;
  for (int i = 0; i < 64; ++i) acc += s[i] + o[i];
  if (threadIdx.x % 32 == 0) {
    const int at = blockIdx.x * 8 + threadIdx.x / 32;
    c[at] = acc == 1234.f ? 0 : (t1 - t0) / GROUPS;
    c[132 * 8 + at] = issue / GROUPS;
  }
}

// BG: 0 softmax only; 1-3 softmax (warpgroup 0) beside wgmma groups (warpgroup 1); 4 one warpgroup's groups
// alone; 5 two warpgroups' groups at once
template <int BG>
__device__ void beside(long long* c, int iters, float scale) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (int i = threadIdx.x; i < SMEM / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (BG == 5) return gemm_loop<3>(c, smem);
  if (wg == 0) {
    if (BG != 4) softmax_loop<FULL>(c, iters, scale);
  } else if (BG != 0) {
    gemm_loop<BG == 4 ? 3 : BG>(c, smem);
  }
}
}  // namespace

#define SOFT(NAME, MODE) \
  extern "C" __global__ void __launch_bounds__(256, 1) NAME(long long* c, int n, float s) { softmax_loop<MODE>(c, n, s); }
SOFT(soft_full, FULL)
SOFT(soft_no_pack, FULL & ~PACK)
SOFT(soft_no_rescale, FULL & ~RESCALE)
SOFT(soft_no_exp, FULL & ~EXP)
SOFT(soft_exp_only, EXP)
SOFT(soft_max_only, MAX)
#define BESIDE(NAME, BG) \
  extern "C" __global__ void __launch_bounds__(256, 1) NAME(long long* c, int n, float s) { beside<BG>(c, n, s); }
BESIDE(bg_none, 0)
BESIDE(bg_ss, 1)
BESIDE(bg_rs, 2)
BESIDE(bg_both, 3)
BESIDE(bg_alone, 4)
BESIDE(bg_two, 5)
