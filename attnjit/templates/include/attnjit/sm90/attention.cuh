// attnjit/sm90/attention.cuh: the sm90 kernel family (sm_90a): warp-specialized batch prefill over a paged or
// ragged KV cache with wgmma.
//
// The work item, its masks and output rows (attnjit/work.cuh), the Q/K/V copies (attnjit/kv_load.cuh) and the
// split-KV merge (attnjit/split.cuh) are the shared ones; this header holds the sm90 roles:
//   * producer warpgroup (128 threads, few registers): per work item, Q (by TMA or cp.async, sm90/producer.cuh)
//     into one of Q_STAGES tiles (the
//     next item's Q loads while the consumers finish this one), then the item's
//     K and V tiles into two rings of NUM_STAGES stages (order K0, K1, V0, K2, V1, ...: the order the consumers use
//     them), page ids one tile ahead in registers. Each copy batch completes on an mbarrier
//     (cp.async.mbarrier.arrive); the consumers release a stage on its "empty" mbarrier.
//   * two (tile q192kv64: three) consumer warpgroups (64 packed rows each, most registers): S = Q K^T by wgmma from
//     shared memory, online softmax in registers, O += P V by wgmma with P from registers. Within a warpgroup the
//     softmax of tile j runs while the tensor cores compute P(j-1) V(j-1); between the warpgroups one named barrier
//     each hands the tensor cores on round a ring (ping-pong for two), so one's softmax hides under the others'
//     GEMMs.
//   * a persistent grid: every CTA takes the plan's work items in list order, claiming each from a counter (or by
//     stride gridDim.x; the work order, sm90/producer.cuh).
// Math as in fa2 (base-2 online softmax, lse = m + log2 d, a row with no visible key gives o = 0, lse = -inf; a
// sink starts the softmax, attnjit/work.cuh).
#pragma once
#include "attnjit/common.cuh"
#include "attnjit/kv_load.cuh"
#include "attnjit/sm90/producer.cuh"
#include "attnjit/sm90/tma.cuh"
#include "attnjit/sm90/traits.cuh"
#include "attnjit/sm90/walk.cuh"
#include "attnjit/sm90/wgmma.cuh"
#include "attnjit/split.cuh"
#include "attnjit/variant.cuh"
#include "attnjit/work.cuh"

namespace attnjit {
namespace sm90 {

// ---- consumers --------------------------------------------------------------------------------------------------

template <typename Tr, typename P>
struct Consumer {
  using Traits = Tr;
  using Params = P;
  using T = typename Tr::TM;  // the wgmma's type (fp16 over an fp8 cache)
  using TO = typename Tr::TO;
  using V = typename Tr::Variant;
  static constexpr int D = Tr::HEAD_DIM;
  static constexpr int N = Tr::CTA_KV;

  WorkItem<Tr, P> it;
  const Smem<Tr>& sm;
  const int wg;                 // 0 or 1: which 64 rows of the Q tile
  const unsigned ctid;          // 0..255 over both consumers
  const int lane, row0;         // row0: this thread's first row in the Q tile (the other is row0 + 8)
  int qstage = 0;               // the Q tile of the current item
  float o[D / 2];               // O accumulator, wgmma m64nD layout: block j holds cols 8j + 2(lane%4) + {0,1}
  float s[N / 2];               // S accumulator (then P in fp32), m64nN layout
  uint32_t pf[N / 16][4];       // P as the A operand of P V (bf16/fp16 pairs), one k16 slice per entry
  float m[2], l[2], alpha[2];   // running max (log2 units), this thread's partial row sums, last rescale
  bool rescale = false;         // some row of this warp has a new max: O must be multiplied by alpha
  float qinv[2] = {1.f, 1.f};   // fp8: 2^-e of this thread's two Q rows (their fp16 conversion's scale)
  float v_scale = 1.f;          // fp8: the value scale of this item's kv head, applied to the output
  // the Q stage whose output rows this thread stored by TMA (the warpgroup's first thread), its read by the TMA unit
  // and the stage's release waited for at the next item (Q_STAGES >= 2: that item's Q is in the other stage); -1 none
  int o_pending = -1;

  __device__ Consumer(const P& p, const Smem<Tr>& smem, int wg_)
      : it(p),
        sm(smem),
        wg(wg_),
        ctid(threadIdx.x - 128),
        lane(threadIdx.x % 32),
        row0(wg_ * Tr::WG_ROWS + ((threadIdx.x % 128) / 32) * 16 + (threadIdx.x % 32) / 4) {}

  // S = Q K^T over the head dim: D/16 k-slices, each a wgmma from the two 128-byte-swizzled tiles.
  // (Each descriptor is built once from the tile's base and moved along by constants: the start address is the
  // low 14-bit field, in 16-byte units, and no k-slice offset carries out of it.)
  __device__ __forceinline__ void issue_qk(int stage) {
    const uint64_t a0 = smem_desc(smem_u32(sm.q(qstage)) + wg * Tr::WG_ROWS * 128, 16, 1024);
    const uint64_t b0 = smem_desc(smem_u32(sm.k(stage)), 16, Tr::KV_GS);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint64_t a = a0 + (((kk / 4) * Tr::Q_STEP + (kk % 4) * 32) >> 4);
      const uint64_t b = b0 + (((kk / 4) * Tr::KV_STEP + (kk % 4) * 32) >> 4);
      wgmma_ss<N, T>(s, a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }

  // O += P V over the tile's first NN kv rows: NN/16 k-slices, V MN-major (rows are kv tokens, 64-column blocks
  // KV_STEP apart, 8-row groups KV_GS).
  template <int NN = N>
  __device__ __forceinline__ void issue_pv(int stage) {
    const uint64_t b0 = smem_desc(smem_u32(sm.v(stage)), Tr::KV_STEP, Tr::KV_GS);
#pragma unroll
    for (int kk = 0; kk < NN / 16; ++kk) wgmma_rs<D, T>(o, pf[kk], b0 + ((kk * 2 * Tr::KV_GS) >> 4));
    wgmma_commit();
  }

  // Row r's sm_scale, as a logits transform sees it (and its logits_scale is given): fp8, times the Q row's 2^-e.
  __device__ __forceinline__ float row_sm_scale(float scale2, int r) const {
    const float sm_scale = scale2 * (1.f / kLog2e);
    return Tr::Q_TO_HALF ? sm_scale * qinv[r] : sm_scale;
  }

  // Logits hooks and masks, then the online softmax of tile `tile`'s first NN columns in place (S becomes P, fp32).
  template <int NN = N>
  __device__ __forceinline__ void softmax(int tile, float scale2) {
    const int kv0 = it.kv_begin + tile * N;
    const int col0 = kv0 + 2 * (lane % 4);  // this thread's first column; block j adds 8j, element e adds e
    if constexpr (V::HAS_LOGITS_TRANSFORM) {  // logit = sm_scale * q.k, transformed by the variant
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int pr = it.packed_row0 + row0 + 8 * r;
        const float sm_r = row_sm_scale(scale2, r);
        const float rel_r = float(col0 - it.q_pos_of(pr));  // rel_pos of column col0; one I2F per row, not per logit
#pragma unroll
        for (int j = 0; j < NN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            s[4 * j + 2 * r + e] = it.var.logits_transform(s[4 * j + 2 * r + e] * sm_r, s[4 * j + 2 * r + e], sm_r,
                                                           it.q_pos_of(pr),
                                                           col0 + 8 * j + e, rel_r + float(8 * j + e), it.qo_len,
                                                           it.kv_len, it.req, it.qo_head_of(pr), it.kv_head);
      }
    }
    if (it.tile_needs_mask(kv0)) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int pr = it.packed_row0 + row0 + 8 * r;
        const int last = it.last_visible(pr / Tr::GROUP) - col0;  // the last visible column, relative to col0
#pragma unroll
        for (int j = 0; j < NN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            bool hidden = 8 * j + e > last;
            if constexpr (V::HAS_LOGITS_MASK)
              hidden = hidden || !it.var.logits_mask(it.q_pos_of(pr), col0 + 8 * j + e, it.qo_len, it.kv_len, it.req,
                                                     it.qo_head_of(pr), it.kv_head);
            if (hidden) s[4 * j + 2 * r + e] = neg_inf();
          }
      }
    }
    if constexpr (!V::USE_SOFTMAX) {  // the transformed logit is the weight; hidden keys weigh 0
#pragma unroll
      for (int i = 0; i < NN / 2; ++i)
        if (s[i] == neg_inf()) s[i] = 0.f;
      return;
    } else {
      bool moved = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // the logits may already be scaled (transformed); fp8: the Q row's 2^-e
        const float sc = V::HAS_LOGITS_TRANSFORM ? it.transformed_log2_scale(row_sm_scale(scale2, r))
                         : Tr::Q_TO_HALF                 ? scale2 * qinv[r]
                                                         : scale2;
        float raw = neg_inf();  // the max of the raw logits, scaled once (sc > 0)
#pragma unroll
        for (int j = 0; j < NN / 8; ++j) raw = fmaxf(raw, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 1));
        raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 2));
        float mx;
        if constexpr (Tr::TAU == 0) {
          mx = fmaxf(m[r], raw * sc);
        } else {  // a max within TAU of the running one leaves it (and O) as they are
          const float cand = raw * sc;
          mx = cand > m[r] + static_cast<float>(Tr::TAU) ? cand : m[r];
        }
        const float m_safe = mx == neg_inf() ? 0.f : mx;
        alpha[r] = fast_exp2(m[r] - m_safe);
        moved |= mx != m[r];
        m[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = fast_exp2(fmaf(s[4 * j + 2 * r + e], sc, -m_safe));
            s[4 * j + 2 * r + e] = x;
            sum += x;
          }
        l[r] = l[r] * alpha[r] + sum;
      }
      rescale = __any_sync(0xffffffffu, moved);  // warp-uniform: the rescale below is skipped or done by all lanes
    }
  }

  __device__ __forceinline__ void rescale_o() {
    if constexpr (V::USE_SOFTMAX) {
      if (!rescale) return;  // no row max of this warp moved since the last tile: alpha is 1 everywhere
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[4 * j + 0] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    }
  }

  // P (fp32 in s) -> the A fragments of P V: k-slice kk holds columns 16kk .. 16kk+15 = S blocks 2kk, 2kk+1.
  template <int NN = N>
  __device__ __forceinline__ void pack_p() {
#pragma unroll
    for (int kk = 0; kk < NN / 16; ++kk) {
      pf[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pf[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pf[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pf[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  }

  __device__ __forceinline__ void release(uint64_t* bar) {
    if (lane == 0) mbar_arrive(bar);  // one arrival per warp (the barrier counts the consumers' warps)
  }

  // The variant's key transform of K(tile) in stage `stage`, by both consumer warpgroups (each a share of the rows),
  // right after the tile lands and before either issues S = Q K^T on it: generic-proxy writes, fenced for the async
  // proxy (wgmma) and synchronized across the 256 consumer threads. (Not the producer: at 24-56 registers it cannot
  // hold a row pair in fp32 with sin/cos, and it would have to wait for its own copies; the consumers have the
  // registers. The price is one consumer barrier per tile, which realigns the two warpgroups' ping-pong.)
  __device__ __forceinline__ void transform_k(int tile, int stage) {
    if constexpr (V::HAS_KEY_TRANSFORM) {
      transform_k_tile<Tr, T>(it, sm.k(stage), it.kv_begin + tile * N, ctid, Tr::CONSUMER_THREADS);
      fence_proxy_async();
      named_sync(Tr::BAR_CONSUMERS, Tr::CONSUMER_THREADS);
    }
  }

  // My turn at the tensor cores, and handing it to the next consumer (a ring of CONSUMERS; for two, wg ^ 1 is the
  // same ring without the signed modulo's instructions).
  __device__ __forceinline__ void take_turn() const { named_sync(Tr::BAR_TURN + wg, Tr::TURN_THREADS); }
  __device__ __forceinline__ void pass_turn() const {
    named_arrive(Tr::BAR_TURN + (Tr::CONSUMERS == 2 ? wg ^ 1 : (wg + 1) % Tr::CONSUMERS), Tr::TURN_THREADS);
  }

  // Pipeline steps: a tile's K (or V) waited for, and its stage handed back once the wgmma reading it completed.
  __device__ __forceinline__ void wait_full(uint64_t* bar, uint32_t phase) {
    mbar_wait(bar, phase);
    fence_proxy_async();  // the producer's cp.async writes, visible to the wgmma (async proxy)
  }
  __device__ __forceinline__ void done_with_k(Ring<Tr::NUM_STAGES>& kr) {
    fence_operands<N / 2>(s);
    release(sm.k_empty(kr.stage));
    kr.advance();
  }
  __device__ __forceinline__ void done_with_v(Ring<Tr::NUM_STAGES>& vr) {
    fence_operands<D / 2>(o);
    release(sm.v_empty(vr.stage));
    vr.advance();
  }
  // S = Q K^T of the ring's current K tile (tile `tile` of the item, after the variant's key transform), in this
  // consumer's turn.
  __device__ __forceinline__ void qk_turn(const Ring<Tr::NUM_STAGES>& kr, int tile) {
    wait_full(sm.k_full(kr.stage), kr.phase);
    transform_k(tile, kr.stage);
    take_turn();
    wgmma_fence();
    issue_qk(kr.stage);
  }
  // O += P V of the ring's current V tile (whose data has arrived: wait_full), in a turn already taken.
  template <int NN = N>
  __device__ __forceinline__ void pv_issue(const Ring<Tr::NUM_STAGES>& vr) {
    wgmma_fence();
    issue_pv<NN>(vr.stage);
  }

  // S(j) alone in a turn, then its softmax over its first NN columns: P(j) packed for P V.
  template <int NN = N>
  __device__ __forceinline__ void s_alone(Ring<Tr::NUM_STAGES>& kr, int j, float scale2) {
    qk_turn(kr, j);
    pass_turn();
    wgmma_wait<0>();
    done_with_k(kr);
    softmax<NN>(j, scale2);
    pack_p<NN>();
  }
  // P V of the packed P alone in a turn (O rescaled by that tile's alpha first).
  template <int NN = N>
  __device__ __forceinline__ void pv_alone(Ring<Tr::NUM_STAGES>& vr) {
    rescale_o();
    wait_full(sm.v_full(vr.stage), vr.phase);
    take_turn();
    pv_issue<NN>(vr);
    pass_turn();
    wgmma_wait<0>();
    done_with_v(vr);
  }

  // The item's kv tiles, one at a time: S(j), its softmax, P(j) V(j); each GEMM one turn at the tensor cores.
  // (For head_dim 256, whose 128 O registers leave no room for S(j) and P(j-1) at once.)
  __device__ __forceinline__ void mainloop_serial(Ring<Tr::NUM_STAGES>& kr, Ring<Tr::NUM_STAGES>& vr, float scale2) {
    for (int j = 0; j < it.num_tiles; ++j) {
      s_alone(kr, j, scale2);
      pv_alone(vr);
    }
  }

  // Whether the item's last tile runs narrow: its visible keys (those below kv_stop) all lie in its first
  // Tr::NARROW columns. Warp-uniform (from num_tiles, which is, and the record's fields, the same in every lane).
  __device__ __forceinline__ bool narrow_last() const {
    if constexpr (Tr::NARROW == 0) {
      return false;
    } else {
      const bool narrow = it.num_tiles > 0 && it.kv_stop - (it.kv_begin + (it.num_tiles - 1) * N) <= Tr::NARROW;
      return __shfl_sync(0xffffffffu, narrow, 0);
    }
  }

  // Tile j (>= 1) of the item: S(j) and P(j-1) V(j-1) issued in one turn, the softmax of S(j) over its first NN
  // columns under P(j-1) V(j-1), then P(j) packed; P(j) V(j) is left to the next step (tile j-1 is never narrow).
  template <int NN = N>
  __device__ __forceinline__ void step(Ring<Tr::NUM_STAGES>& kr, Ring<Tr::NUM_STAGES>& vr, int j, float scale2) {
    qk_turn(kr, j);
    rescale_o();  // by tile j-1's alpha, before P(j-1) V(j-1) adds to O
    wait_full(sm.v_full(vr.stage), vr.phase);
    pv_issue(vr);
    pass_turn();
    if constexpr (Tr::CHAIN) release_stored();  // the last item's output rows, read by now (a no-op but at j = 1)
    wgmma_wait<1>();  // S(j) is ready; P(j-1) V(j-1) may still run
    done_with_k(kr);
    softmax<NN>(j, scale2);
    wgmma_wait<0>();
    done_with_v(vr);
    pack_p<NN>();
  }

  // The item's tiles from `from` (1, or 0 where S(0) is not yet done) on: each full tile's S(j) issued with
  // P(j-1) V(j-1), its softmax under it; a narrow last tile (narrow) as in mainloop, alone in its turn at
  // Tr::NARROW columns. Returns with the last tile's P packed and its P V not issued (walk_chained issues it alone,
  // or with the next item's S(0)).
  __device__ __forceinline__ void tiles_from(Ring<Tr::NUM_STAGES>& kr, Ring<Tr::NUM_STAGES>& vr, int from,
                                             bool narrow, float scale2) {
    const int nf = it.num_tiles - (narrow ? 1 : 0);  // the full-width tiles
    if (from == 0 && nf > 0) s_alone(kr, 0, scale2);
    for (int j = 1; j < nf; ++j) step(kr, vr, j, scale2);
    if constexpr (Tr::NARROW > 0) {
      if (narrow && nf >= from) {  // (a chained item's narrow S(0) is done)
        if (nf > 0) pv_alone(vr);
        s_alone<Tr::NARROW>(kr, nf, scale2);
      }
    }
  }

  // The item's kv tiles: S(j) and P(j-1) V(j-1) issued together; the softmax of S(j) runs under P(j-1) V(j-1). A
  // narrow last tile (narrow_last) runs after the others, alone in its turns at Tr::NARROW columns. (The walk
  // without chaining; walk_chained has its own, tiles_from.)
  __device__ __forceinline__ void mainloop(Ring<Tr::NUM_STAGES>& kr, Ring<Tr::NUM_STAGES>& vr, float scale2) {
    if constexpr (!Tr::OVERLAP) return mainloop_serial(kr, vr, scale2);
    const bool narrow = narrow_last();
    const int n = it.num_tiles - (narrow ? 1 : 0);  // the full-width tiles
    if (n > 0) {
      s_alone(kr, 0, scale2);
      for (int j = 1; j < n; ++j) step(kr, vr, j, scale2);
      pv_alone(vr);
    }
    if constexpr (Tr::NARROW > 0) {
      if (narrow) {
        s_alone<Tr::NARROW>(kr, n, scale2);
        pv_alone<Tr::NARROW>(vr);
      }
    }
  }

  // This warpgroup's rows of the output, staged in its rows of the Q tile, by 16-byte stores (rows past the
  // request's end are not written).
  __device__ __forceinline__ void store_staged(const WorkItem<Tr, P>& w, const uint8_t* stage) {
    constexpr int CHUNKS = D / 8;
    constexpr int ROWS_PER_STEP = 128 / CHUNKS;
    const int wtid = static_cast<int>(ctid % 128);
    const int c = wtid % CHUNKS;
#pragma unroll
    for (int k = 0; k < Tr::WG_ROWS / ROWS_PER_STEP; ++k) {
      const int row = wg * Tr::WG_ROWS + k * ROWS_PER_STEP + wtid / CHUNKS;
      const int pr = w.packed_row0 + row;
      if (pr < w.rows_total)
        *reinterpret_cast<uint4*>(w.out_ptr(pr, c)) =
            *reinterpret_cast<const uint4*>(stage + tile_offset<Tr::Q_PITCH, Tr::Q_STEP>(row, c));
    }
  }

  // Normalize and write item w's rows (its Q tile in stage qs; m and l hold its rows' softmax): the output through
  // this warpgroup's (now free) rows of the Q tile, then one TMA store of them (sm90/tma.cuh: the run's output
  // descriptor, and all 64 rows inside the request) or 16-byte stores; or a split item's fp32 partial state
  // straight to the workspace.
  __device__ __forceinline__ void epilogue(const WorkItem<Tr, P>& w, int qs) {
    float inv[2], lse[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float d = l[r];
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      d += __shfl_xor_sync(0xffffffffu, d, 2);
      if constexpr (V::USE_SOFTMAX) {
        inv[r] = row_rcp(d);
        lse[r] = row_lse(m[r], d);
      } else {
        inv[r] = 1.f;
        lse[r] = 0.f;
      }
      if constexpr (Tr::FP8_KV) inv[r] *= v_scale;  // o = v_scale * sum_j p_j v_j; lse is unaffected
    }
    if (w.pslot < 0) {
      uint8_t* stage = sm.q(qs);
      bool by_tma = false;  // warp-uniform (the item's fields)
      if constexpr (tma_o<Tr>())
        by_tma = (w.p.tma_flags & kTmaO) && w.packed_row0 + (wg + 1) * Tr::WG_ROWS <= w.rows_total;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        const int pr = w.packed_row0 + row;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          float x0 = o[4 * j + 2 * r] * inv[r], x1 = o[4 * j + 2 * r + 1] * inv[r];
          if constexpr (V::HAS_OUTPUT_TRANSFORM) {
            const int col = 8 * j + 2 * (lane % 4);
            if (pr < w.rows_total) {
              x0 = w.var.output_transform(x0, col, w.q_pos_of(pr), w.qo_len, w.kv_len, w.req, w.qo_head_of(pr),
                                           w.kv_head);
              x1 = w.var.output_transform(x1, col + 1, w.q_pos_of(pr), w.qo_len, w.kv_len, w.req,
                                           w.qo_head_of(pr), w.kv_head);
            }
          }
          *reinterpret_cast<uint32_t*>(stage + tile_offset<Tr::Q_PITCH, Tr::Q_STEP>(row, j) + 4 * (lane % 4)) =
              pack2<TO>(x0, x1);
        }
        if (lane % 4 == 0 && pr < w.rows_total) w.write_lse(pr, lse[r]);
      }
      if (by_tma) fence_proxy_async();  // the staging writes, visible to the TMA unit (async proxy)
      named_sync(Tr::BAR_EPILOGUE + wg, 128);
      if (by_tma) {
        if (ctid % 128 == 0) {
          tma_o_rows<Tr>(w, &w.p.tma_o, smem_u32(stage) + wg * Tr::WG_ROWS * 128, wg * Tr::WG_ROWS);
          o_pending = qs;
        }
      } else {
        store_staged(w, stage);
      }
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int pr = w.packed_row0 + row0 + 8 * r;
        if (pr >= w.rows_total) continue;
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
          w.write_partial2(pr, 8 * j + 2 * (lane % 4), o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r],
                            lse[r], j == 0 && lane % 4 == 0);
      }
    }
  }

  // The current item's softmax log2 scale (sm_scale2, times an fp8 cache's k scale of its kv head); an fp8 cache's
  // value scale of that head into v_scale (per-KV-head scales: float32 [H_kv], or 0; the scalar k_scale is in
  // sm_scale2).
  __device__ __forceinline__ float item_scales(const P& p, float sm_scale2, int head) {
    float scale2 = sm_scale2;
    if constexpr (Tr::FP8_KV) {
      if (p.scale_k) scale2 *= reinterpret_cast<const float*>(p.scale_k)[head];
      v_scale = static_cast<float>(p.scale_v_value);
      if (p.scale_v) v_scale *= reinterpret_cast<const float*>(p.scale_v)[head];
    }
    return scale2;
  }

  // Pair i (item i / heads, kv head i % heads) as the current item, its Q landed in Q stage `stage`: its record
  // read, the variant's query transform and (SCALES) an fp8 cache's scales applied. Returns its softmax's log2 scale
  // (the run's, sm_scale2, times an fp8 cache's k scale; without SCALES, item_scales gives it).
  template <bool SCALES = true>
  __device__ __forceinline__ float begin_item(const P& p, int i, int stage, float sm_scale2) {
    const int heads = static_cast<int>(p.num_kv_heads);
    const int head = i % heads;
    it.kv_head = head;
    it.setup(i / heads);
    // what steers the loops, broadcast from lane 0 (the values are the same in every lane): the compiler then
    // knows the ring positions are warp-uniform and keeps the wgmma descriptors in uniform registers
    it.num_tiles = __shfl_sync(0xffffffffu, it.num_tiles, 0);
    qstage = stage;
    fence_proxy_async();
    if constexpr (V::HAS_QUERY_TRANSFORM) {
      transform_q_tile<Tr>(it, sm.q(qstage), ctid, Tr::CONSUMER_THREADS);
      fence_proxy_async();
      named_sync(Tr::BAR_CONSUMERS, Tr::CONSUMER_THREADS);
    }
    const float scale2 = SCALES ? item_scales(p, sm_scale2, head) : sm_scale2;
    if constexpr (Tr::Q_TO_HALF) {  // this warpgroup's 64 Q rows (all its wgmma reads) into fp16, each times 2^e
      q_rows_to_half_rows<Tr, Tr::WG_ROWS, 128, 2>(sm.q(qstage), sm.qinv(), wg * Tr::WG_ROWS, ctid % 128);
      fence_proxy_async();
      named_sync(Tr::BAR_EPILOGUE + wg, 128);
      qinv[0] = sm.qinv()[row0];
      qinv[1] = sm.qinv()[row0 + 8];
    }
    return scale2;
  }

  __device__ __forceinline__ void zero_o() {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  }

  // The current item's online softmax started: no key yet, or its rows' sinks.
  __device__ __forceinline__ void reset_softmax() {
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.f;
    alpha[0] = alpha[1] = 1.f;
    if constexpr (V::HAS_SINK) {  // the online softmax starts from the sink (work.cuh): m = sink2, d = 1
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float s2 = it.sink_log2(it.packed_row0 + row0 + 8 * r);
        if (s2 != neg_inf()) {
          m[r] = s2;
          // l holds each thread's share of the row sum (the quad adds them); a NaN sink makes the sum NaN, so
          // the row's o is NaN (row_rcp) even with no visible key
          l[r] = lane % 4 == 0 ? (s2 == s2 ? 1.f : s2) : 0.f;
        }
      }
    }
  }

  // After item w's epilogue (its Q tile in stage qs): every consumer thread's Q and staging reads are done (a TMA
  // store's thread: once the unit read its rows, now where the next item needs this Q stage, else later:
  // release_stored); a split group's last item merges it.
  __device__ __forceinline__ void end_item(const WorkItem<Tr, P>& w, int qs) {
    if (Tr::Q_STAGES == 1 && o_pending >= 0) release_stored();
    else if (o_pending < 0) mbar_arrive(sm.q_empty(qs));
    if (w.nchunks > 1 && last_of_group(w, ctid, [] { named_sync(Tr::BAR_CONSUMERS, Tr::CONSUMER_THREADS); }))
      merge_group<Tr::CONSUMER_THREADS, Tr::CTA_Q>(w, ctid);
  }

  __device__ __forceinline__ void run(const P& p) {
    const float sm_scale2 = static_cast<float>(p.sm_scale_log2);
    if (wg == Tr::CONSUMERS - 1) pass_turn();  // the first consumer takes the first turn
    if constexpr (tma_o<Tr>())
      if (ctid % 128 == 0 && (p.tma_flags & kTmaO)) tma_prefetch(&p.tma_o);
    if constexpr (Tr::CHAIN) walk_chained(*this, p, sm_scale2);
    else walk_items(*this, p, sm_scale2);
    release_stored();  // (the shared memory must outlive the TMA unit's reads of it)
  }

  // Item w's rows written (an fp8 cache's: by the value scale item_scales last read, w's) and its Q stage handed back.
  __device__ __forceinline__ void write_item(const WorkItem<Tr, P>& w, int qs) {
    epilogue(w, qs);
    end_item(w, qs);
  }

  // The Q stage of this thread's last TMA store handed back to the producer, once the unit has read its rows.
  __device__ __forceinline__ void release_stored() {
    if constexpr (tma_o<Tr>()) {
      if (o_pending >= 0) {
        tma_o_read();
        mbar_arrive(sm.q_empty(o_pending));
        o_pending = -1;
      }
    }
  }
};

template <typename Tr, typename P>
__device__ __forceinline__ void attention_body(const P& p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Smem<Tr> sm{smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u)};
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < Tr::Q_STAGES; ++s) {
      mbar_init(sm.q_full(s), 129);  // the producer's 128 threads and its thread 0's pair (sm90/producer.cuh)
      mbar_init(sm.q_empty(s), Tr::CONSUMER_THREADS);
    }
#pragma unroll
    for (int s = 0; s < Tr::NUM_STAGES; ++s) {
      mbar_init(sm.k_full(s), 128);
      mbar_init(sm.k_empty(s), Tr::CONSUMERS * 4);
      mbar_init(sm.v_full(s), 128);
      mbar_init(sm.v_empty(s), Tr::CONSUMERS * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    setmaxnreg_dec<Tr::PRODUCER_REGS>();
    producer<Tr>(p, sm);
  } else {
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    // the warpgroup index broadcast from lane 0: the compiler then knows it is warp-uniform, so the wgmma
    // descriptors built from it stay in uniform registers (no per-wgmma R2UR moves)
    Consumer<Tr, P> c(p, sm, __shfl_sync(0xffffffffu, (static_cast<int>(threadIdx.x) - 128) / 128, 0));
    c.run(p);
  }
}

}  // namespace sm90
}  // namespace attnjit
