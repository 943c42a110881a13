// attnjit/split.cuh: split-KV groups, shared by every kernel family. The chunks of one (request, q tile, KV head)
// each write a normalized fp32 partial state (o, lse) per (token, head) to workspace slots; the CTA that finishes
// its group last (an atomic ticket) merges them in one pass and writes the output, so a split costs no second
// launch. The merge follows attnjit/merge_state.cuh's rule (normalized weights; an empty state is the identity).
//
// Both functions run on NUM_THREADS threads of the CTA numbered tid = 0..NUM_THREADS-1 (all of them in fa2; the
// consumer warpgroups in sm90) and synchronize them with `sync` (a CTA barrier, or a named barrier over them).
#pragma once
#include "attnjit/common.cuh"

namespace attnjit {

// Returns true in every participating thread of the CTA that finished its group last (all partials are then
// visible to it). The ticket counter is reset by the last taker, so the counters are zero again for the next run.
template <typename Item, typename Sync>
__device__ __forceinline__ bool last_of_group(const Item& it, unsigned tid, Sync sync) {
  __shared__ int last;
  __threadfence();  // this CTA's partial writes, visible device-wide before the ticket
  sync();
  if (tid == 0) {
    int* counter = reinterpret_cast<int*>(it.p.merge_counters) + static_cast<int64_t>(it.group) * it.p.num_kv_heads +
                   it.kv_head;
    last = atomicAdd(counter, 1) == it.nchunks - 1;
    if (last) *counter = 0;  // every chunk has taken its ticket: reset for the next run (graph replay)
  }
  sync();
  if (last) __threadfence();
  return last;
}

// Merge the nchunks partial states of every row of this (request, q tile, kv head) and write the output.
// Threads are split into SUB-lane teams per (row, 16-byte chunk) item, each lane folding every SUB-th state
// online (one pass, loads independent), then the team combines by shuffles.
template <int NUM_THREADS, int CTA_Q, typename Item>
__device__ __forceinline__ void merge_group(const Item& it, unsigned tid) {
  using V = typename Item::V;
  constexpr int D = Item::D;
  constexpr int CHUNKS = D / 8;
  const auto& p = it.p;
  const int rows = min(CTA_Q, it.rows_total - it.packed_row0);
  const int items = rows * CHUNKS;
  int sub = 1;  // lanes per item: a power of two <= 32 that keeps every thread busy
  while (sub < 32 && items * sub * 2 <= NUM_THREADS) sub *= 2;
  const float* tmp_o = reinterpret_cast<const float*>(p.tmp_o);
  const float* tmp_lse = reinterpret_cast<const float*>(p.tmp_lse);
  const int teams = NUM_THREADS / sub;
  const int my_sub = tid % sub;
  for (int base = 0; base < items; base += teams) {  // uniform trip count: shuffles below are warp-wide
    const int item = base + static_cast<int>(tid) / sub;
    const bool active = item < items;
    const int pr = it.packed_row0 + (active ? item / CHUNKS : 0);
    const int c = active ? item % CHUNKS : 0;
    const int64_t head = it.out_head(pr);
    const int64_t tok = pr / Item::GROUP_SIZE;
    float m = neg_inf(), z = 0.f, acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    if (active) {
#pragma unroll 8
      for (int k = my_sub; k < it.nchunks; k += sub) {
        const int64_t row =
            (static_cast<int64_t>(it.pslot0) + static_cast<int64_t>(k) * it.qo_len + tok) * p.num_qo_heads + head;
        const float l = __ldcg(tmp_lse + row);
        const float4 lo = __ldcg(reinterpret_cast<const float4*>(tmp_o + row * D + c * 8));
        const float4 hi = __ldcg(reinterpret_cast<const float4*>(tmp_o + row * D + c * 8 + 4));
        const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        if constexpr (!V::USE_SOFTMAX) {  // partial sums add up
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += x[e];
          m = 0.f, z = 1.f;
          continue;
        }
        if (l == neg_inf()) continue;
        const float m_new = fmaxf(m, l);
        const float a = fast_exp2(m - m_new), w = fast_exp2(l - m_new);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = acc[e] * a + w * x[e];
        z = z * a + w;
        m = m_new;
      }
    }
    for (int off = 1; off < sub; off *= 2) {
      if constexpr (!V::USE_SOFTMAX) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], off);
        continue;
      }
      const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
      const float z2 = __shfl_xor_sync(0xffffffffu, z, off);
      const float m_new = fmaxf(m, m2);
      const float m_safe = m_new == neg_inf() ? 0.f : m_new;
      const float a = fast_exp2(m - m_safe), b = fast_exp2(m2 - m_safe);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = acc[e] * a + __shfl_xor_sync(0xffffffffu, acc[e], off) * b;
      z = z * a + z2 * b;
      m = m_new;
    }
    if (active && my_sub == 0) {
      float lse = 0.f;
      if constexpr (V::USE_SOFTMAX) {
        const float inv = z > 0.f ? 1.f / z : 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= inv;
        lse = row_lse(m, z);
      }
      it.transform_out8(pr, c, acc);
      it.write_out8(pr, c, acc);
      if (c == 0) it.write_lse(pr, lse);
    }
  }
}

}  // namespace attnjit
