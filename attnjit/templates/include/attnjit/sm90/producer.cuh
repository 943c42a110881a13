// attnjit/sm90/producer.cuh: the sm90 family's shared-memory map, its rings, the work order both roles walk, and the
// producer warpgroup: Q, K and V copied (paged or ragged, attnjit/kv_load.cuh) into the tiles the consumers' wgmma
// read, each batch completing on an mbarrier; an fp8 cache through a staging ring that the producer converts.
#pragma once
#include "attnjit/common.cuh"
#include "attnjit/kv_load.cuh"
#include "attnjit/sm90/traits.cuh"
#include "attnjit/sm90/wgmma.cuh"
#include "attnjit/work.cuh"

namespace attnjit {
namespace sm90 {

template <typename Tr>
struct Smem {
  uint8_t* base;  // 1024-byte aligned
  static constexpr int KV_BAR = 2 * Tr::Q_STAGES;  // the first K/V barrier
  __device__ __forceinline__ uint8_t* q(int s) const { return base + s * Tr::Q_BYTES; }
  __device__ __forceinline__ uint8_t* k(int s) const { return base + Tr::K_OFF + s * Tr::KV_BYTES; }
  __device__ __forceinline__ uint8_t* v(int s) const { return base + Tr::V_OFF + s * Tr::KV_BYTES; }
  __device__ __forceinline__ uint8_t* stage8(int s) const { return base + Tr::STAGE8_OFF + s * Tr::STAGE8_BYTES; }
  __device__ __forceinline__ float* qinv() const { return reinterpret_cast<float*>(base + Tr::QINV_OFF); }
  __device__ __forceinline__ uint64_t* bar(int i) const { return reinterpret_cast<uint64_t*>(base + Tr::BAR_OFF) + i; }
  __device__ __forceinline__ uint64_t* q_full(int s) const { return bar(s); }
  __device__ __forceinline__ uint64_t* q_empty(int s) const { return bar(Tr::Q_STAGES + s); }
  __device__ __forceinline__ uint64_t* k_full(int s) const { return bar(KV_BAR + s); }
  __device__ __forceinline__ uint64_t* k_empty(int s) const { return bar(KV_BAR + Tr::NUM_STAGES + s); }
  __device__ __forceinline__ uint64_t* v_full(int s) const { return bar(KV_BAR + 2 * Tr::NUM_STAGES + s); }
  __device__ __forceinline__ uint64_t* v_empty(int s) const { return bar(KV_BAR + 3 * Tr::NUM_STAGES + s); }
};

// A position in a ring of S stages: the stage and the parity of its current use.
template <int S>
struct Ring {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == S) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The work both roles walk, in the same order: (item, kv head) pairs, item-major, strided by the grid. The item
// count is read again per item (an L1 hit) rather than held: at head_dim 256 the producer has 24 registers.
template <typename P, typename F>
__device__ __forceinline__ void for_each_item(const P& p, F&& f) {
  const int heads = static_cast<int>(p.num_kv_heads);
  for (int i = blockIdx.x; i < *reinterpret_cast<const int32_t*>(p.work_count) * heads; i += gridDim.x)
    f(i / heads, i % heads);
}

// ---- producer ---------------------------------------------------------------------------------------------------

template <typename Tr, typename P>
__device__ __forceinline__ void produce(const P& p, const Smem<Tr>& sm) {
  WorkItem<Tr, P> it(p);
  const unsigned tid = threadIdx.x;  // 0..127
  Ring<Tr::NUM_STAGES> kr, vr;
  Ring<Tr::Q_STAGES> qr;
  for_each_item(p, [&](int w, int head) {
    it.kv_head = head;
    if (!it.setup(w)) return;
    mbar_wait(sm.q_empty(qr.stage), qr.phase ^ 1);  // the consumers are done with that Q tile (and its O staging)
    gather_q<Tr>(it, smem_u32(sm.q(qr.stage)), tid);
    mbar_arrive_cp_async(sm.q_full(qr.stage));
    qr.advance();
    RegPageIds<Tr::KV_PASSES> next, cur, prev;
    if (it.num_tiles > 0) load_page_ids<Tr>(it, 0, next, tid);
    for (int t = 0; t < it.num_tiles; ++t) {
      cur = next;
      if (t + 1 < it.num_tiles) load_page_ids<Tr>(it, t + 1, next, tid);  // in flight while this tile issues
      mbar_wait(sm.k_empty(kr.stage), kr.phase ^ 1);
      gather_kv<Tr, true, false>(it, t, smem_u32(sm.k(kr.stage)), 0u, cur, tid);
      mbar_arrive_cp_async(sm.k_full(kr.stage));
      kr.advance();
      if (t > 0) {
        mbar_wait(sm.v_empty(vr.stage), vr.phase ^ 1);
        gather_kv<Tr, false, true>(it, t - 1, 0u, smem_u32(sm.v(vr.stage)), prev, tid);
        mbar_arrive_cp_async(sm.v_full(vr.stage));
        vr.advance();
      }
      prev = cur;
    }
    if (it.num_tiles > 0) {
      mbar_wait(sm.v_empty(vr.stage), vr.phase ^ 1);
      gather_kv<Tr, false, true>(it, it.num_tiles - 1, 0u, smem_u32(sm.v(vr.stage)), prev, tid);
      mbar_arrive_cp_async(sm.v_full(vr.stage));
      vr.advance();
    }
  });
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// ---- producer, fp8 cache ----------------------------------------------------------------------------------------
// Each K or V tile (a "unit", in the order the 16-bit producer copies them) is copied as stored into one of two
// staging slots, then converted by the producer's 128 threads into its ring stage as fp16 (dequant_rows), fenced for
// the async proxy (wgmma) and released with a plain mbarrier arrival. Copies run one unit ahead: unit n + 1's
// copies are in flight while unit n is converted, across work items too (each unit one cp.async group). Two named
// barriers per unit: before a slot is refilled (everyone has converted what it held) and before it is converted
// (everyone's copies have landed).
template <typename Tr>
struct Fp8Stager {
  const Smem<Tr> sm;
  const unsigned tid;
  Ring<Tr::NUM_STAGES> kr, vr;
  int slot = 0;     // the staging slot of the next copy
  int pending = 0;  // the unit copied into slot ^ 1 and not yet converted: 0 none, 1 K, 2 V

  // Copy the next unit (issue(staging address) issues this thread's copies), then convert the pending one.
  template <typename Issue>
  __device__ __forceinline__ void unit(bool is_v, Issue&& issue) {
    named_sync(Tr::BAR_PRODUCER, 128);  // the slot's last unit is converted by every thread
    issue(smem_u32(sm.stage8(slot)));
    cp_async_commit();
    convert<1>();
    pending = is_v ? 2 : 1;
    slot ^= 1;
  }

  // Convert the pending unit (GROUPS: cp.async groups that may still be in flight, those issued after it).
  template <int GROUPS>
  __device__ __forceinline__ void convert() {
    if (pending == 0) return;
    cp_async_wait<GROUPS>();
    named_sync(Tr::BAR_PRODUCER, 128);  // every thread's copies of the unit have landed
    if (pending == 2) into(vr, sm.v(vr.stage), sm.v_empty(vr.stage), sm.v_full(vr.stage));
    else into(kr, sm.k(kr.stage), sm.k_empty(kr.stage), sm.k_full(kr.stage));
    pending = 0;
  }

  __device__ __forceinline__ void into(Ring<Tr::NUM_STAGES>& r, uint8_t* dst, uint64_t* empty, uint64_t* full) {
    mbar_wait(empty, r.phase ^ 1);
    dequant_rows<Tr, Tr::CTA_KV, 128, 2, typename Tr::TM>(sm.stage8(slot ^ 1), dst, 0, tid);
    fence_proxy_async();  // the conversion's writes, visible to the consumers' wgmma
    mbar_arrive(full);
    r.advance();
  }
};

template <typename Tr, typename P>
__device__ __forceinline__ void produce_fp8(const P& p, const Smem<Tr>& sm) {
  WorkItem<Tr, P> it(p);
  const unsigned tid = threadIdx.x;  // 0..127
  Fp8Stager<Tr> st{sm, tid};
  Ring<Tr::Q_STAGES> qr;
  for_each_item(p, [&](int w, int head) {
    it.kv_head = head;
    if (!it.setup(w)) return;
    // one Q tile: the consumers free it only after this item's last V, which must not wait for the next item
    if constexpr (Tr::Q_STAGES == 1) st.template convert<0>();
    mbar_wait(sm.q_empty(qr.stage), qr.phase ^ 1);
    gather_q<Tr>(it, smem_u32(sm.q(qr.stage)), tid);  // joins the next unit's cp.async group
    mbar_arrive_cp_async(sm.q_full(qr.stage));
    qr.advance();
    RegPageIds<Tr::KV_PASSES> next, cur, prev;
    if (it.num_tiles > 0) load_page_ids<Tr>(it, 0, next, tid);
    for (int t = 0; t < it.num_tiles; ++t) {
      cur = next;
      if (t + 1 < it.num_tiles) load_page_ids<Tr>(it, t + 1, next, tid);
      st.unit(false, [&](uint32_t dst) { gather_kv<Tr, true, false>(it, t, dst, 0u, cur, tid); });
      if (t > 0) st.unit(true, [&](uint32_t dst) { gather_kv<Tr, false, true>(it, t - 1, 0u, dst, prev, tid); });
      prev = cur;
    }
    if (it.num_tiles > 0)
      st.unit(true, [&](uint32_t dst) { gather_kv<Tr, false, true>(it, it.num_tiles - 1, 0u, dst, prev, tid); });
  });
  st.template convert<0>();
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

template <typename Tr, typename P>
__device__ __forceinline__ void producer(const P& p, const Smem<Tr>& sm) {
  if constexpr (Tr::FP8_KV) produce_fp8<Tr>(p, sm);
  else produce<Tr>(p, sm);
}

}  // namespace sm90
}  // namespace attnjit
