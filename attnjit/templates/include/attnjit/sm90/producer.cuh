// attnjit/sm90/producer.cuh: the sm90 family's shared-memory map, its rings, the work order both roles walk, and the
// producer warpgroup: Q, K and V copied (paged or ragged, attnjit/kv_load.cuh; by TMA where a tile allows,
// attnjit/sm90/tma.cuh) into the tiles the consumers' wgmma read, each batch completing on an mbarrier; an fp8
// cache copied as stored into those tiles and converted there.
#pragma once
#include "attnjit/common.cuh"
#include "attnjit/kv_load.cuh"
#include "attnjit/sm90/tma.cuh"
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
  __device__ __forceinline__ float* qinv() const { return reinterpret_cast<float*>(base + Tr::QINV_OFF); }
  __device__ __forceinline__ uint64_t* bar(int i) const { return reinterpret_cast<uint64_t*>(base + Tr::BAR_OFF) + i; }
  __device__ __forceinline__ uint64_t* q_full(int s) const { return bar(s); }
  __device__ __forceinline__ uint64_t* q_empty(int s) const { return bar(Tr::Q_STAGES + s); }
  __device__ __forceinline__ uint64_t* k_full(int s) const { return bar(KV_BAR + s); }
  __device__ __forceinline__ uint64_t* k_empty(int s) const { return bar(KV_BAR + Tr::NUM_STAGES + s); }
  __device__ __forceinline__ uint64_t* v_full(int s) const { return bar(KV_BAR + 2 * Tr::NUM_STAGES + s); }
  __device__ __forceinline__ uint64_t* v_empty(int s) const { return bar(KV_BAR + 3 * Tr::NUM_STAGES + s); }
  // the work order's slots (below): each Q stage's pair, and the producer's claim
  __device__ __forceinline__ int* pair(int s) const { return reinterpret_cast<int*>(base + Tr::PAIR_OFF) + s; }
  __device__ __forceinline__ int* claim() const { return reinterpret_cast<int*>(base + Tr::PAIR_OFF) + Tr::Q_STAGES; }
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

// ---- the work order ---------------------------------------------------------------------------------------------
// Both roles walk the same (item, kv head) pairs of the plan's list, item-major: pair i is item i / heads, head
// i % heads. CTA c's first pair is c; with p.work_claims each later one is claimed from the counter at
// work_count[1] by the producer's thread 0 (its atomicAdd issued as the pair before starts, so its latency hides
// under that pair's copies). The list is longest first, so claiming is LPT; a fixed stride (c, c + grid, ...,
// p.work_claims == 0) gives CTA 0 the longest pair of every round of the grid: up to 6% above the mean work at
// causal 1 x 8192 (RESULTS.md, run 94). The producer hands each pair it copies to the consumers in its Q stage's
// slot (written before a release arrival on the stage's q_full, whose count includes it) and -1 after the last; the
// last CTA to finish (work_count[2] counts them) zeroes both counters for the next run (graph replays included).
template <typename P>
__device__ __forceinline__ int pair_count(const P& p) {
  return *reinterpret_cast<const int32_t*>(p.work_count) * static_cast<int>(p.num_kv_heads);
}

template <typename Tr, typename P, typename F>
__device__ __forceinline__ void producer_pairs(const P& p, const Smem<Tr>& sm, unsigned tid, F&& f) {
  // (the counters' address, the mode and the count are read from the parameters where used: registers are short
  // here, and the next pair lives in one only until f stashes it, after its Q copy and before its tile loop)
  int i = static_cast<int>(blockIdx.x);
  while (i < pair_count(p)) {
    int next = 0;
    if (tid == 0)
      next = static_cast<int>(gridDim.x) +
             (p.work_claims ? atomicAdd(reinterpret_cast<int32_t*>(p.work_count) + 1, 1) : i);
    bool stashed = false;
    const auto stash = [&] {
      if (tid == 0) *sm.claim() = next;
      stashed = true;
    };
    f(i, stash);  // f calls stash() once (where the pair is skipped, it may not)
    if (!stashed) stash();
    named_sync(Tr::BAR_PRODUCER, 128);  // the slot's write is visible
    i = *sm.claim();
    named_sync(Tr::BAR_PRODUCER, 128);  // every thread has read it: the next pair's stash may write it again
  }
  if (p.work_claims && tid == 0) {
    int32_t* const counters = reinterpret_cast<int32_t*>(p.work_count) + 1;  // work_count[1], [2]
    __threadfence();  // this CTA's claims, before its finish
    if (atomicAdd(counters + 1, 1) == static_cast<int>(gridDim.x) - 1) {  // every CTA has claimed its last
      atomicExch(counters, 0);
      atomicExch(counters + 1, 0);
    }
  }
}

// The producer's thread 0: pair i (or -1: the end) into Q stage `stage`'s slot, and its arrival on q_full.
template <typename Tr>
__device__ __forceinline__ void publish_pair(const Smem<Tr>& sm, int stage, int i) {
  *sm.pair(stage) = i;
  mbar_arrive(sm.q_full(stage));  // a release: the slot's write is visible to every consumer past the wait
}

// After the producer's last pair: the end, once the consumers are done with that Q stage (all 128 threads).
template <typename Tr>
__device__ __forceinline__ void publish_end(const Smem<Tr>& sm, const Ring<Tr::Q_STAGES>& qr, unsigned tid) {
  mbar_wait(sm.q_empty(qr.stage), qr.phase ^ 1);
  if (tid == 0) publish_pair(sm, qr.stage, -1);
  mbar_arrive(sm.q_full(qr.stage));
}

// The consumers' side: the pair the producer published in Q stage qr (-1: the end), once its Q has landed.
template <typename Tr>
__device__ __forceinline__ int next_pair(const Smem<Tr>& sm, const Ring<Tr::Q_STAGES>& qr) {
  mbar_wait(sm.q_full(qr.stage), qr.phase);
  // from lane 0 (the value is every lane's): the compiler then knows it is warp-uniform
  return __shfl_sync(0xffffffffu, *static_cast<volatile int*>(sm.pair(qr.stage)), 0);
}

// The pairs the producer published, each with its Q stage, until the end.
template <typename Tr, typename F>
__device__ __forceinline__ void consumer_pairs(const Smem<Tr>& sm, F&& f) {
  Ring<Tr::Q_STAGES> qr;
  for (;;) {
    const int i = next_pair<Tr>(sm, qr);
    if (i < 0) return;
    f(i, qr.stage);
    qr.advance();
  }
}

// ---- producer ---------------------------------------------------------------------------------------------------

// The 16-bit producer's page ids, a tile ahead: every thread's copy passes (RegPageIds), or, in a TMA kernel, one
// per lane of the first warp (lane_page_id; the odd cp.async tile loads its passes' ids when it comes).
template <typename Tr, typename Item, bool LANES = tma_kv<Tr>()>
struct TilePageIds {
  RegPageIds<Tr::KV_PASSES> next, cur, prev;
  __device__ __forceinline__ void fetch(const Item& it, int tile, unsigned tid) { load_page_ids<Tr>(it, tile, next, tid); }
  __device__ __forceinline__ void take() { cur = next; }
  __device__ __forceinline__ void keep() { prev = cur; }
  template <bool IS_V>
  __device__ __forceinline__ void copy(const Item& it, int tile, uint32_t dst, uint64_t* full, unsigned tid) const {
    gather_kv<Tr, !IS_V, IS_V>(it, tile, IS_V ? 0u : dst, IS_V ? dst : 0u, IS_V ? prev : cur, tid);
    mbar_arrive_cp_async(full);
  }
};
template <typename Tr, typename Item>
struct TilePageIds<Tr, Item, true> {
  int next = 0, cur = 0, prev = 0;
  __device__ __forceinline__ void fetch(const Item& it, int tile, unsigned tid) { next = lane_page_id<Tr>(it, tile, tid); }
  __device__ __forceinline__ void take() { cur = next; }
  __device__ __forceinline__ void keep() { prev = cur; }
  // by TMA where tma_tile says so (V: not where tma_v_gather), else by every thread's cp.async (each arrives once
  // its copies land)
  template <bool IS_V>
  __device__ __forceinline__ void copy(const Item& it, int tile, uint32_t dst, uint64_t* full, unsigned tid) const {
    if (tma_tile<Tr>(it, it.p.tma_flags, tile) && !(IS_V && tma_v_gather<Tr>())) {
      tma_kv_tile<Tr>(it, IS_V ? &it.p.tma_v : &it.p.tma_k, dst, full, tile, IS_V ? prev : cur, tid);
    } else {
      RegPageIds<Tr::KV_PASSES> here;
      load_page_ids<Tr>(it, tile, here, tid);
      gather_kv<Tr, !IS_V, IS_V>(it, tile, IS_V ? 0u : dst, IS_V ? dst : 0u, here, tid);
      mbar_arrive_cp_async(full);
    }
  }
};

template <typename Tr, typename P>
__device__ __forceinline__ void produce(const P& p, const Smem<Tr>& sm) {
  using Item = WorkItem<Tr, P>;
  Item it(p);
  const unsigned tid = threadIdx.x;  // 0..127
  Ring<Tr::NUM_STAGES> kr, vr;
  Ring<Tr::Q_STAGES> qr;
  constexpr bool TMA_Q = tma_q<Tr>();
  if (tid == 0) {
    if (TMA_Q && (p.tma_flags & kTmaQ)) tma_prefetch(&p.tma_q);
    if (tma_kv<Tr>() && (p.tma_flags & kTmaKV)) {
      tma_prefetch(&p.tma_k);
      tma_prefetch(&p.tma_v);
    }
  }
  producer_pairs<Tr>(p, sm, tid, [&](int i, auto&& stash) {
    const int heads = static_cast<int>(p.num_kv_heads);  // (from the parameters: registers are short here)
    it.kv_head = i % heads;
    if (!it.setup(i / heads)) return;
    mbar_wait(sm.q_empty(qr.stage), qr.phase ^ 1);  // the consumers are done with that Q tile (and its O staging)
    if (tid == 0) publish_pair(sm, qr.stage, i);
    if (TMA_Q && (p.tma_flags & kTmaQ)) {
      if (tid == 0) tma_q_tile<Tr>(it, &p.tma_q, smem_u32(sm.q(qr.stage)), sm.q_full(qr.stage));
      else mbar_arrive(sm.q_full(qr.stage));
    } else {
      gather_q<Tr>(it, smem_u32(sm.q(qr.stage)), tid);
      mbar_arrive_cp_async(sm.q_full(qr.stage));
    }
    qr.advance();
    stash();
    TilePageIds<Tr, Item> ids;
    if (it.num_tiles > 0) ids.fetch(it, 0, tid);
    for (int t = 0; t < it.num_tiles; ++t) {
      ids.take();
      if (t + 1 < it.num_tiles) ids.fetch(it, t + 1, tid);  // in flight while this tile issues
      mbar_wait(sm.k_empty(kr.stage), kr.phase ^ 1);
      ids.template copy<false>(it, t, smem_u32(sm.k(kr.stage)), sm.k_full(kr.stage), tid);
      kr.advance();
      if (t > 0) {
        mbar_wait(sm.v_empty(vr.stage), vr.phase ^ 1);
        ids.template copy<true>(it, t - 1, smem_u32(sm.v(vr.stage)), sm.v_full(vr.stage), tid);
        vr.advance();
      }
      ids.keep();
    }
    if (it.num_tiles > 0) {
      mbar_wait(sm.v_empty(vr.stage), vr.phase ^ 1);
      ids.template copy<true>(it, it.num_tiles - 1, smem_u32(sm.v(vr.stage)), sm.v_full(vr.stage), tid);
      vr.advance();
    }
  });
  publish_end(sm, qr, tid);
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// ---- producer, fp8 cache ----------------------------------------------------------------------------------------
// Each K or V tile (a "unit", in the 16-bit producer's order) is copied as stored into its own ring stage, row r's
// bytes in row r's slots of the stage's upper column blocks (Sm90Traits::stage8_offset). LAG units later, once its
// copies have landed, each producer warp converts its rows of it in place into the 16-bit tile (fp16), fences the
// writes for the async proxy (wgmma) and arrives on its mbarrier (128 arrivals). So LAG + 1 units' copies are in flight
// while one is converted, across work items too, with no shared memory beyond the 16-bit rings.
//
// In place: the 8 threads of a row read all of its fp8 bytes, meet (__syncwarp: they are lanes of one warp), then
// write its 16-bit chunks. Every byte a row's conversion reads or writes lies in that row's slots, so rows need no
// other ordering. (Deadlock-free: with rings of two or more stages, the stage a unit waits for is released by the
// consumers using units older than the LAG pending ones; the Q tile is handled in produce_fp8.)

template <typename Tr>
__device__ __forceinline__ void dequant_in_place(uint8_t* stage, unsigned tid) {
  using TKV = typename Tr::TKV;
  static_assert(std::is_same<typename Tr::TM, __half>::value, "the sm90 fp8 tiles are fp16");
  constexpr int B = Tr::BLOCKS;
  constexpr int RPP = 128 / 8;       // rows per pass of the 128 threads (8 a row)
  // a warp converts exactly the rows its own lanes copied (convert_oldest waits for them with a __syncwarp only)
  static_assert(Tr::LOAD_THREADS == 128 && RPP == Tr::LOAD_THREADS / 8, "gather_kv's rows: thread t, row t / 8");
  constexpr int U = B >= 4 ? 1 : 2;  // passes whose reads go before their writes
  static_assert(Tr::CTA_KV % (RPP * U) == 0, "whole passes");
  const int c = static_cast<int>(tid % 8), r0 = static_cast<int>(tid / 8);
  if constexpr (B == 2) {
    // The row's 128 fp8 bytes fill its block-1 slot: a thread reads 16 of them (a warp, its 4 rows' 512
    // contiguous bytes) and writes 16-bit chunks 2 c (lo) and 2 c + 1 (hi), the row's threads with c >= 4 the odd
    // one first, so each store's 8 chunks of a row fill 8 distinct bank groups (chunks 8 apart share them).
    const bool odd_first = c >= 4;
#pragma unroll 1
    for (int p = 0; p < Tr::CTA_KV / RPP; p += U) {
      uint4 raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        raw[u] = *reinterpret_cast<const uint4*>(stage + Tr::stage8_offset(r0 + (p + u) * RPP, 16 * c));
      __syncwarp();  // every lane of the row has read what these writes overwrite
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int row = r0 + (p + u) * RPP;
        const uint2 lo = make_uint2(raw[u].x, raw[u].y), hi = make_uint2(raw[u].z, raw[u].w);
        const int k = 2 * c + (odd_first ? 1 : 0);
        *reinterpret_cast<uint4*>(stage + tile_offset<Tr::KV_PITCH, Tr::KV_STEP, Tr::KV_GS>(row, k)) =
            fp8x8_to_half<TKV, true>(odd_first ? hi : lo);
        *reinterpret_cast<uint4*>(stage + tile_offset<Tr::KV_PITCH, Tr::KV_STEP, Tr::KV_GS>(row, k ^ 1)) =
            fp8x8_to_half<TKV, true>(odd_first ? lo : hi);
      }
    }
  } else {
    // 8 bytes a thread (registers are short at head_dim 256), in groups of G blocks: the dims one slot holds.
    // Slot g (block B / 2 + g, B >= 2) holds blocks 2 g and 2 g + 1's bytes; in order, the blocks a group writes
    // were read before the last __syncwarp. Head_dim 64: the row's 64 bytes in its slot's upper half.
    constexpr int G = B >= 2 ? 2 : 1;
#pragma unroll 1
    for (int p = 0; p < Tr::CTA_KV / RPP; p += U) {
#pragma unroll
      for (int g = 0; g < B / G; ++g) {
        uint2 raw[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int b = 0; b < G; ++b)  // dims 64 (g G + b) + 8 c .. + 7 of the row
            raw[u][b] = *reinterpret_cast<const uint2*>(stage + Tr::stage8_offset(r0 + (p + u) * RPP,
                                                                                  64 * (g * G + b) + 8 * c));
        __syncwarp();
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int b = 0; b < G; ++b)
            *reinterpret_cast<uint4*>(stage + tile_offset<Tr::KV_PITCH, Tr::KV_STEP, Tr::KV_GS>(r0 + (p + u) * RPP,
                                                                                    8 * (g * G + b) + c)) =
                fp8x8_to_half<TKV, false>(raw[u][b]);
      }
    }
  }
}

// A ring position as one counter of uses (the fp8 producer holds four rings in its few registers).
template <int S>
struct CountRing {
  uint32_t n = 0;
  __device__ __forceinline__ int stage() const { return static_cast<int>(n % S); }
  __device__ __forceinline__ uint32_t phase() const { return (n / S) & 1u; }
};

template <typename Tr>
struct Fp8Stager {
  static constexpr int LAG = 2;
  const Smem<Tr> sm;
  const unsigned tid;
  CountRing<Tr::NUM_STAGES> kr, vr;  // where the next K / V unit is copied
  CountRing<Tr::NUM_STAGES> kc, vc;  // the next K / V unit to convert
  uint32_t kinds = 0;                // bit i: the i-th oldest pending unit is V
  int pending = 0;                   // units copied and not converted (<= LAG between calls)

  // Copy the next unit into its stage (issue(stage address) issues this thread's copies), then convert the oldest
  // pending one if more than LAG are in flight.
  template <bool IS_V, typename Issue>
  __device__ __forceinline__ void unit(Issue&& issue) {
    CountRing<Tr::NUM_STAGES>& r = IS_V ? vr : kr;  // a compile-time choice (a runtime one puts the rings in memory)
    mbar_wait(IS_V ? sm.v_empty(r.stage()) : sm.k_empty(r.stage()), r.phase() ^ 1);
    issue(smem_u32(IS_V ? sm.v(r.stage()) : sm.k(r.stage())));
    cp_async_commit();
    ++r.n;
    kinds |= (IS_V ? 1u : 0u) << pending;
    if (++pending > LAG) convert_oldest<LAG>();
  }

  // Convert the oldest pending unit (GROUPS: cp.async groups that may stay in flight, the ones issued after it).
  template <int GROUPS>
  __device__ __forceinline__ void convert_oldest() {
    cp_async_wait<GROUPS>();
    // A warp converts the rows its own lanes copied (8 a row, gather_kv's mapping): its lanes' copies landing is
    // all it waits for, so the four warps go at their own pace (a barrier over the 128 held each at the slowest).
    __syncwarp();
    if (kinds & 1u) {
      into(sm.v(vc.stage()), sm.v_full(vc.stage()));
      ++vc.n;
    } else {
      into(sm.k(kc.stage()), sm.k_full(kc.stage()));
      ++kc.n;
    }
    kinds >>= 1;
    --pending;
  }

  __device__ __forceinline__ void flush() {
    while (pending > 0) convert_oldest<0>();
  }

  // At an item's end: all but the newest pending unit. The consumers need them before the item's last P V, and
  // left pending they would wait for the next item's first copies (its setup and page ids: a few thousand cycles,
  // measured at the last tile of every item of 3 or more). Their copies were issued before the newest unit's
  // stage-free wait, so they have usually landed.
  __device__ __forceinline__ void settle() {
    while (pending > 1) convert_oldest<1>();
  }

  __device__ __forceinline__ void into(uint8_t* stage, uint64_t* full) {
    dequant_in_place<Tr>(stage, tid);
    fence_proxy_async();  // the conversion's writes, visible to the consumers' wgmma
    mbar_arrive(full);
  }
};

template <typename Tr, typename P>
__device__ __forceinline__ void produce_fp8(const P& p, const Smem<Tr>& sm) {
  WorkItem<Tr, P> it(p);
  const unsigned tid = threadIdx.x;  // 0..127
  Fp8Stager<Tr> st{sm, tid};
  Ring<Tr::Q_STAGES> qr;
  int item_units = Fp8Stager<Tr>::LAG;  // units the last item issued (a first item has none pending)
  producer_pairs<Tr>(p, sm, tid, [&](int i, auto&& stash) {
    const int heads = static_cast<int>(p.num_kv_heads);  // (from the parameters: registers are short here)
    it.kv_head = i % heads;
    if (!it.setup(i / heads)) return;
    // The Q stage frees when the consumers finish item i + 1 - Q_STAGES; they need its units converted. With two
    // Q stages that holds if the pending units are the last item's own (it issued at least as many); else, and
    // with one Q stage, convert them all first.
    if (Tr::Q_STAGES == 1 || item_units < st.pending) st.flush();
    item_units = 0;
    mbar_wait(sm.q_empty(qr.stage), qr.phase ^ 1);
    if (tid == 0) publish_pair(sm, qr.stage, i);
    gather_q<Tr>(it, smem_u32(sm.q(qr.stage)), tid);  // joins the next unit's cp.async group
    mbar_arrive_cp_async(sm.q_full(qr.stage));
    qr.advance();
    stash();
    RegPageIds<Tr::KV_PASSES> next, cur, prev;
    if (it.num_tiles > 0) load_page_ids<Tr>(it, 0, next, tid);
    for (int t = 0; t < it.num_tiles; ++t) {
      cur = next;
      if (t + 1 < it.num_tiles) load_page_ids<Tr>(it, t + 1, next, tid);
      st.template unit<false>([&](uint32_t dst) { gather_kv<Tr, true, false>(it, t, dst, 0u, cur, tid); });
      if (t > 0)
        st.template unit<true>([&](uint32_t dst) { gather_kv<Tr, false, true>(it, t - 1, 0u, dst, prev, tid); });
      prev = cur;
    }
    if (it.num_tiles > 0) {
      st.template unit<true>(
          [&](uint32_t dst) { gather_kv<Tr, false, true>(it, it.num_tiles - 1, 0u, dst, prev, tid); });
      st.settle();
    }
    item_units = 2 * it.num_tiles;
  });
  st.flush();  // the last pair's units, before the end (the consumers need them to release its Q stage)
  publish_end(sm, qr, tid);
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

template <typename Tr, typename P>
__device__ __forceinline__ void producer(const P& p, const Smem<Tr>& sm) {
  if constexpr (Tr::FP8_KV) produce_fp8<Tr>(p, sm);
  else produce<Tr>(p, sm);
}

}  // namespace sm90
}  // namespace attnjit
