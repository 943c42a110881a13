// attnjit/fa2/attention.cuh: the fa2 kernel family (mma.sync m16n8k16 + cp.async; sm_80 and up): batch attention
// over a paged or ragged KV cache (prefill, decode, mixed batches).
//
// The work item, its masks and output rows (attnjit/work.cuh), the Q/K/V loaders (attnjit/kv_load.cuh) and the
// split-KV merge (attnjit/split.cuh) are shared with the other families; this header holds what is fa2's own: the
// warp-level fragment math of the mainloop and the epilogue.
//
// Math, per packed row: s_j = q.k_j over the visible keys (attnjit/work.cuh). Online softmax in base 2 with the
// scale sm_scale*log2(e) folded in:
//   m = max_j s_j*scale2,  d = sum_j 2^(s_j*scale2 - m),  o = sum_j 2^(s_j*scale2 - m) v_j / d,  lse = m + log2(d)
// which is lse = log2(sum_j exp(sm_scale * s_j)). A row with no visible key yields o = 0, lse = -inf. A sink
// (attnjit/work.cuh) is the row's first key with a zero value: m = sink2, d = 1 before the first tile.
//
// Inner loop (per warp): S = Q K^T with mma.sync m16n8k16 (A = Q rows from shared memory via ldmatrix, B = K
// rows via ldmatrix), mask only on boundary/diagonal tiles, online softmax in registers, O += P V (A = P
// re-packed from the S accumulators, B = V via ldmatrix.trans). K/V tiles arrive through a NUM_STAGES-deep
// cp.async pipeline; page ids are staged in shared memory by cp.async 2*NUM_STAGES-2 tiles ahead of the copy
// that needs them, so no thread ever waits on a page-table load in the loop. Shared-memory addresses are
// precomputed per lane (see q_row_off), so an ldmatrix costs one integer op.
#pragma once
#include "attnjit/common.cuh"
#include "attnjit/fa2/fp8_frags.cuh"
#include "attnjit/fa2/mma.cuh"
#include "attnjit/fa2/softmax.cuh"
#include "attnjit/fa2/traits.cuh"
#include "attnjit/kv_load.cuh"
#include "attnjit/merge_state.cuh"
#include "attnjit/split.cuh"
#include "attnjit/variant.cuh"
#include "attnjit/work.cuh"

namespace attnjit {


// One CTA of the fa2 family: WorkItem (the item in logical coordinates) plus the mma.sync mainloop and epilogue.
template <typename Tr, typename P>
struct AttentionCTA : WorkItem<Tr, P> {
  using Item = WorkItem<Tr, P>;
  using T = typename Tr::T;
  using TKV = typename Tr::TKV;
  using TM = std::conditional_t<Tr::FP8_IN_REGS, __half, T>;  // the mma's type (fp8: fa2/fp8_frags.cuh)
  using TO = typename Tr::TO;
  static constexpr int D = Tr::HEAD_DIM;
  static constexpr int CHUNKS = Tr::CHUNKS;
  using V = typename Tr::Variant;
  using Item::p, Item::var, Item::kv_head, Item::req, Item::qo_len, Item::kv_len, Item::rows_total,
      Item::packed_row0, Item::kv_begin, Item::kv_stop, Item::num_tiles, Item::q_begin, Item::pslot,
      Item::nchunks, Item::setup, Item::q_pos_of, Item::qo_head_of, Item::out_head, Item::write_partial2,
      Item::write_lse, Item::write_out8, Item::transform_out8, Item::partial_row, Item::out_ptr;

  uint8_t* smem;
  const int lane, warp_q, warp_kv;

  __device__ AttentionCTA(const P& params, uint8_t* smem_)
      : Item(params),
        smem(smem_),
        lane(threadIdx.x % 32),
        warp_q((threadIdx.x / 32) % Tr::NUM_WARPS_Q),
        warp_kv((threadIdx.x / 32) / Tr::NUM_WARPS_Q) {
    const uint32_t x = lane & 7;
    q_row_off = (warp_q * Tr::WARP_ROWS + lane % 16) * Tr::ROW_BYTES;
    k_row_off = (warp_kv * Tr::WARP_COLS + lane % 8 + (lane / 16) * 8) * Tr::ROW_BYTES;
    v_row_off = (warp_kv * Tr::WARP_COLS + lane % 8 + ((lane / 8) % 2) * 8) * Tr::ROW_BYTES;
    yq16 = ((lane / 16) ^ x) << 4;
    yk16 = (((lane / 8) % 2) ^ x) << 4;
    kv8_row_off = (warp_kv * Tr::WARP_COLS + lane % 8 + ((lane / 8) % 2) * 8) * Tr::KV_ROW_BYTES;
    y8_16 = Tr::stage8_y16(lane);
  }

  // per-thread byte offsets of the rows this lane addresses with ldmatrix, and the XOR term of its chunk
  // (swizzle(row, chunk) = row * ROW_BYTES + ((chunk ^ (row & 7)) << 4), and every such row has row & 7 == lane & 7,
  // so chunk 2 * j + h maps to ((j << 5) ^ y16) with y16 = (h ^ (lane & 7)) << 4)
  uint32_t q_row_off, k_row_off, v_row_off, yq16, yk16;
  // fp8 in registers: this lane's ldmatrix row of a staged K or V tile (fa2/fp8_frags.cuh), for K and V alike, and
  // its chunks' XOR term (Tr::stage8_y16)
  uint32_t kv8_row_off, y8_16;

  __device__ __forceinline__ uint8_t* q_smem() const { return smem; }
  __device__ __forceinline__ int32_t* page_smem() const { return reinterpret_cast<int32_t*>(smem + Tr::Q_SMEM); }
  __device__ __forceinline__ float* q_scale_smem() const { return reinterpret_cast<float*>(smem + Tr::Q_SMEM + Tr::PAGE_SMEM); }
  __device__ __forceinline__ uint8_t* pipe_smem() const { return smem + Tr::Q_SMEM + Tr::PAGE_SMEM + Tr::QSCALE_SMEM; }
  // the ring's K and V of a stage, as stored (fp8: staging tiles of HEAD_DIM-byte rows)
  __device__ __forceinline__ uint8_t* k_smem(int stage) const { return pipe_smem() + stage * Tr::KV_STAGE_SMEM; }
  __device__ __forceinline__ uint8_t* v_smem(int stage) const {
    return pipe_smem() + (Tr::NUM_STAGES + stage) * Tr::KV_STAGE_SMEM;
  }
  // the 16-bit K and V tiles the mainloop reads: the stage's own, or (fp8) the one converted tile after the ring
  __device__ __forceinline__ uint8_t* k_tile(int stage) const {
    if constexpr (Tr::FP8_KV) return pipe_smem() + 2 * Tr::NUM_STAGES * Tr::KV_STAGE_SMEM;
    else return k_smem(stage);
  }
  __device__ __forceinline__ uint8_t* v_tile(int stage) const {
    if constexpr (Tr::FP8_WARP_OWNED) return k_tile(stage);  // V replaces this warp's K rows after S = Q K^T
    else if constexpr (Tr::FP8_KV) return k_tile(stage) + Tr::KV_TILE_SMEM;
    else return v_smem(stage);
  }
  // fp8, warps splitting the kv tile: this warp's rows of a staged tile into the 16-bit tile
  __device__ __forceinline__ void dequant_own_rows(const uint8_t* staged, int stage) const {
    __syncwarp();  // every lane is done reading the rows this overwrites
    dequant_rows<Tr, Tr::WARP_COLS, 32, 4>(staged, k_tile(stage), warp_kv * Tr::WARP_COLS, lane);
    __syncwarp();
  }

  // fp8 KV: the value scale of this item's kv head (k_scale is folded into scale2), applied to the output
  float v_scale = 1.f;
  // bf16 q over fp8 (Tr::Q_TO_HALF): 2^-e of this lane's row (mq, r), what its logits are multiplied by
  __device__ __forceinline__ float q_row_scale(int mq, int r) const {
    return q_scale_smem()[warp_q * Tr::WARP_ROWS + mq * 16 + lane / 4 + 8 * r];
  }

  // ---- compute one tile -----------------------------------------------------------------------------------

  __device__ __forceinline__ void load_q_frag(uint32_t (&a)[4], int mq, int kd) const {
    if constexpr (Tr::FP8_IN_REGS)  // the dim order of the fp8 K fragments
      q_frag_fp8_order<Tr::ROW_BYTES>(q_smem(), warp_q * Tr::WARP_ROWS + mq * 16 + lane / 4, kd, lane, a);
    else
      ldmatrix_x4(a, smem_u32(q_smem()) + q_row_off + mq * 16 * Tr::ROW_BYTES + ((kd << 5) ^ yq16));
  }

  // The fp8 order's Q fragments (four 32-bit words from two rows) rewritten into the Q tile as one 16-byte quad per
  // (fragment, lane) and read back with 128-bit loads: ptxas then keeps each fragment in four aligned registers, as
  // the mma's A operand needs, instead of copying it there before every mma (8 moves per 16 dims per warp, a tenth of
  // the decode loop). Once per work item; the Q tile is not read again until the epilogue stages the output in it.
  __device__ __forceinline__ void q_frags_as_quads(uint32_t (&qf)[Tr::NUM_MMA_Q][D / 16][4]) const {
    __syncthreads();  // every warp has its fragments: the tile may be overwritten
    const uint32_t base = smem_u32(q_smem()) + static_cast<uint32_t>(warp_q * Tr::NUM_MMA_Q * (D / 16) * 512 +
                                                                      lane * 16);
    static_assert(Tr::NUM_WARPS_Q * Tr::NUM_MMA_Q * (D / 16) * 512 <= Tr::CTA_Q * Tr::ROW_BYTES, "quads fit in Q");
    if (warp_kv == 0) {  // the warps of one warp_q hold the same fragments
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
        for (int kd = 0; kd < D / 16; ++kd) sts_v4(base + (mq * (D / 16) + kd) * 512, qf[mq][kd]);
    }
    __syncthreads();
#pragma unroll
    for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) lds_v4(base + (mq * (D / 16) + kd) * 512, qf[mq][kd]);
  }

  __device__ __forceinline__ void compute_tile(int tile, int stage, WarpState<Tr>& st,
                                               const uint32_t (&qf)[Tr::Q_IN_REGS ? Tr::NUM_MMA_Q : 1]
                                                                    [Tr::Q_IN_REGS ? D / 16 : 1][4],
                                               float scale2) const {
    float s[Tr::NUM_MMA_Q][Tr::NUM_MMA_KV * 2][4];
#pragma unroll
    for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
      for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mq][nt][e] = 0.f;

    // S = Q K^T
    if constexpr (Tr::FP8_IN_REGS) {
      s_tile_fp8<Tr>(s, smem_u32(k_smem(stage)) + kv8_row_off, y8_16, [&](int mq, int kd, uint32_t(&a)[4]) {
        if constexpr (Tr::Q_IN_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = qf[mq][kd][e];
        } else {
          load_q_frag(a, mq, kd);
        }
      });
      if constexpr (Tr::Q_TO_HALF && V::HAS_LOGITS_TRANSFORM) {  // q rows were scaled by 2^e: the transform sees
        // the logits (without a transform, the softmax folds the 2^-e into its scale)
#pragma unroll
        for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float inv = q_row_scale(mq, r);
#pragma unroll
            for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt) s[mq][nt][2 * r] *= inv, s[mq][nt][2 * r + 1] *= inv;
          }
      }
    } else {
      const uint32_t ks = smem_u32(k_tile(stage));
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {
        uint32_t a[Tr::NUM_MMA_Q][4];
#pragma unroll
        for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) {
          if constexpr (Tr::Q_IN_REGS) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[mq][e] = qf[mq][kd][e];
          } else {
            load_q_frag(a[mq], mq, kd);
          }
        }
        const uint32_t k_addr = ks + k_row_off + ((kd << 5) ^ yk16);
#pragma unroll
        for (int mkv = 0; mkv < Tr::NUM_MMA_KV; ++mkv) {
          uint32_t b[4];
          ldmatrix_x4(b, k_addr + mkv * 16 * Tr::ROW_BYTES);
#pragma unroll
          for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) {
            mma_16816<T>(s[mq][2 * mkv], a[mq], b);
            mma_16816<T>(s[mq][2 * mkv + 1], a[mq], b + 2);
          }
        }
      }
    }

    const int kv0 = kv_begin + tile * Tr::CTA_KV;
    const int col0 = kv0 + warp_kv * Tr::WARP_COLS + 2 * (lane % 4);  // this lane's first column in the tile
    const float sm_scale = scale2 * (1.f / kLog2e);  // what a transform sees, and what its logits_scale is given
    if constexpr (V::HAS_LOGITS_TRANSFORM) {  // logit = sm_scale * q.k, transformed by the variant
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int pr = packed_row0 + warp_q * Tr::WARP_ROWS + mq * 16 + lane / 4 + 8 * r;
          const float rel_r = float(col0 - q_pos_of(pr));  // rel_pos of column col0 (one I2F per row)
#pragma unroll
          for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              s[mq][nt][2 * r + e] = var.logits_transform(s[mq][nt][2 * r + e] * sm_scale, s[mq][nt][2 * r + e],
                                                          sm_scale, q_pos_of(pr),
                                                          col0 + nt * 8 + e, rel_r + float(nt * 8 + e), qo_len,
                                                          kv_len, req, qo_head_of(pr), kv_head);
        }
    }

    // mask the boundary and the causal diagonal (only tiles that reach past either), and the variant's mask
    if (this->tile_needs_mask(kv0)) {
      // rows mq * 16 + 8 * r of this lane: with GROUP dividing 8 their tokens are this lane's first token plus
      // (mq * 16 + 8 * r) / GROUP, so one register serves them all (four per-row values spilled at 255 registers)
      const int pr0 = packed_row0 + warp_q * Tr::WARP_ROWS + lane / 4;
      int tok0 = pr0 / Tr::GROUP;
      asm volatile("" : "+r"(tok0));  // opaque here: keeps nvcc from hoisting the per-row limits (and spilling them)
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int pr = pr0 + mq * 16 + 8 * r;
          const int tok = 8 % Tr::GROUP == 0 ? tok0 + (mq * 16 + 8 * r) / Tr::GROUP : pr / Tr::GROUP;
          const int last = this->last_visible(tok) - col0;  // the last visible column, relative to col0
#pragma unroll
          for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              bool hidden = nt * 8 + e > last;
              if constexpr (V::HAS_LOGITS_MASK)
                hidden = hidden || !var.logits_mask(q_pos_of(pr), col0 + nt * 8 + e, qo_len, kv_len, req,
                                                    qo_head_of(pr), kv_head);
              if (hidden) s[mq][nt][2 * r + e] = neg_inf();
            }
        }
    }

    if constexpr (!V::USE_SOFTMAX) {  // the transformed logit is the weight; hidden keys weigh 0
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
        for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (s[mq][nt][e] == neg_inf()) s[mq][nt][e] = 0.f;
    } else {
      softmax_update<Tr>(s, st, V::HAS_LOGITS_TRANSFORM ? this->transformed_log2_scale(sm_scale) : scale2,
                         [&](int mq, int r) { return q_row_scale(mq, r); });
    }
    pv(s, stage, st);
  }

  // O += P V
  __device__ __forceinline__ void pv(const float (&s)[Tr::NUM_MMA_Q][Tr::NUM_MMA_KV * 2][4], int stage,
                                     WarpState<Tr>& st) const {
    if constexpr (Tr::FP8_WARP_OWNED) dequant_own_rows(v_smem(stage), stage);
    const uint32_t vs = Tr::FP8_IN_REGS ? 0u : smem_u32(v_tile(stage));
    // softmax row sums of this tile on the tensor cores (P x ones), from the same rounded P that multiplies V:
    // one mma per 16x16 block instead of an add per element, and every lane of a quad gets its rows' sums
    float rs[Tr::NUM_MMA_Q][4];
#pragma unroll
    for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) rs[mq][0] = rs[mq][1] = rs[mq][2] = rs[mq][3] = 0.f;
    const uint32_t ones[2] = {ones2<TM>(), ones2<TM>()};
#pragma unroll
    for (int kk = 0; kk < Tr::NUM_MMA_KV; ++kk) {
      uint32_t a[Tr::NUM_MMA_Q][4];
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) {
        a[mq][0] = pack2<TM>(s[mq][2 * kk][0], s[mq][2 * kk][1]);
        a[mq][1] = pack2<TM>(s[mq][2 * kk][2], s[mq][2 * kk][3]);
        a[mq][2] = pack2<TM>(s[mq][2 * kk + 1][0], s[mq][2 * kk + 1][1]);
        a[mq][3] = pack2<TM>(s[mq][2 * kk + 1][2], s[mq][2 * kk + 1][3]);
        if constexpr (V::USE_SOFTMAX) mma_16816<TM>(rs[mq], a[mq], ones);
      }
      if constexpr (Tr::FP8_IN_REGS) {
        pv_block_fp8<Tr>(st.o, a, smem_u32(v_smem(stage)) + kv8_row_off + kk * 16 * Tr::KV_ROW_BYTES, y8_16);
      } else {
        const uint32_t v_addr = vs + v_row_off + kk * 16 * Tr::ROW_BYTES;
#pragma unroll
        for (int dt2 = 0; dt2 < D / 16; ++dt2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_addr + ((dt2 << 5) ^ yq16));
#pragma unroll
          for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) {
            mma_16816<T>(st.o[mq][2 * dt2], a[mq], b);
            mma_16816<T>(st.o[mq][2 * dt2 + 1], a[mq], b + 2);
          }
        }
      }
    }
    if constexpr (V::USE_SOFTMAX) {
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) {
        st.d[mq][0] += rs[mq][0];
        st.d[mq][1] += rs[mq][2];
      }
    }
  }

  // ---- output ---------------------------------------------------------------------------------------------

  // What a row's accumulated o is multiplied by, and the row's lse (softmax: 1/d and m + log2 d, row_rcp and
  // row_lse: a fully hidden row gives 0 and -inf, a NaN d NaN and NaN; no softmax: the sum stands, lse 0).
  __device__ __forceinline__ void state_scale(const WarpState<Tr>& st, int mq, int r, float& inv, float& lse) const {
    if constexpr (V::USE_SOFTMAX) {
      const float dd = st.d[mq][r];
      inv = row_rcp(dd);
      lse = row_lse(st.m[mq][r], dd);
    } else {
      inv = 1.f;
      lse = 0.f;
    }
    if constexpr (Tr::FP8_KV) inv *= v_scale;  // o = v_scale * sum_j p_j v_j (v dequantized); lse is unaffected
  }

  // Accumulator pair dt (0 .. D / 8) of row half r: the values of dims o_col(dt) and o_col(dt) + 1 (fp8 in
  // registers: V's dims come in the order of its fragments, fa2/fp8_frags.cuh)
  __device__ __forceinline__ int o_col(int dt) const {
    if constexpr (Tr::FP8_IN_REGS) return fp8_o_col(dt, lane);
    else return dt * 8 + 2 * (lane % 4);
  }
  __device__ __forceinline__ float2 o_pair(const WarpState<Tr>& st, int mq, int dt, int r) const {
    if constexpr (Tr::FP8_IN_REGS) return fp8_o_pair(st.o[mq], dt, r);
    else return make_float2(st.o[mq][dt][2 * r], st.o[mq][dt][2 * r + 1]);
  }

  __device__ __forceinline__ void finish(WarpState<Tr>& st) {
    if constexpr (Tr::NUM_WARPS_KV == 1) {
      // normalize in registers. An output (the common case) is staged through this warp's rows of the (now free)
      // Q tile so that it leaves in coalesced 16-byte stores; a split item's partial state goes straight to the
      // workspace. The two are separate code paths: interleaved, every CTA fetched both (instruction-cache misses
      // were a tenth of a short prefill's warp time)
      if (pslot < 0) {
        uint8_t* stage = q_smem();
#pragma unroll
        for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = warp_q * Tr::WARP_ROWS + mq * 16 + lane / 4 + 8 * r;
            const int pr = packed_row0 + row;
            float inv, lse;
            state_scale(st, mq, r, inv, lse);
            uint8_t* row_stage = stage + row * Tr::ROW_BYTES;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
              const float2 x = o_pair(st, mq, dt, r);
              float x0 = x.x * inv, x1 = x.y * inv;
              const int col = o_col(dt);
              if constexpr (V::HAS_OUTPUT_TRANSFORM) {
                if (pr < rows_total) {
                  x0 = var.output_transform(x0, col, q_pos_of(pr), qo_len, kv_len, req, qo_head_of(pr), kv_head);
                  x1 = var.output_transform(x1, col + 1, q_pos_of(pr), qo_len, kv_len, req, qo_head_of(pr), kv_head);
                }
              }
              *reinterpret_cast<uint32_t*>(row_stage + (((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2) =
                  pack2<TO>(x0, x1);
            }
            if (lane % 4 == 0 && pr < rows_total) write_lse(pr, lse);
          }
        __syncwarp();
        // lane l stores chunk l % CHUNKS of rows l / CHUNKS + k * (32 / CHUNKS): one 64-bit row address per k
        static_assert(32 % CHUNKS == 0, "a warp stores whole rows per step");
        constexpr int ROWS_PER_STEP = 32 / CHUNKS;
        const int c = lane % CHUNKS;
#pragma unroll
        for (int k = 0; k < Tr::WARP_ROWS / ROWS_PER_STEP; ++k) {
          const int row = warp_q * Tr::WARP_ROWS + k * ROWS_PER_STEP + lane / CHUNKS;
          const int pr = packed_row0 + row;
          if (pr < rows_total) {
            const uint4 v = *reinterpret_cast<const uint4*>(stage + swizzle<CHUNKS>(row, c));
            *reinterpret_cast<uint4*>(out_ptr(pr, c)) = v;
          }
        }
      } else {
#pragma unroll
        for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int pr = packed_row0 + warp_q * Tr::WARP_ROWS + mq * 16 + lane / 4 + 8 * r;
            if (pr >= rows_total) continue;
            float inv, lse;
            state_scale(st, mq, r, inv, lse);
            const int64_t prow = partial_row(pr);
            float* dst = reinterpret_cast<float*>(p.tmp_o) + prow * D;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
              const float2 x = o_pair(st, mq, dt, r);
              *reinterpret_cast<float2*>(dst + o_col(dt)) = make_float2(x.x * inv, x.y * inv);
            }
            if (lane % 4 == 0) reinterpret_cast<float*>(p.tmp_lse)[prow] = lse;
          }
      }
    } else {
      // each warp holds a disjoint kv slice of the same rows: publish normalized states, then merge
      float* so = reinterpret_cast<float*>(smem + Tr::Q_SMEM);
      float* slse = so + Tr::NUM_WARPS_KV * Tr::CTA_Q * D;
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = warp_q * Tr::WARP_ROWS + mq * 16 + lane / 4 + 8 * r;
          float inv, lse;
          state_scale(st, mq, r, inv, lse);
          float* dst = so + (warp_kv * Tr::CTA_Q + row) * D;
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
            const float2 x = o_pair(st, mq, dt, r);
            *reinterpret_cast<float2*>(dst + o_col(dt)) = make_float2(x.x * inv, x.y * inv);
          }
          if (lane % 4 == 0) slse[warp_kv * Tr::CTA_Q + row] = lse;
        }
      __syncthreads();
      for (int i = threadIdx.x; i < Tr::CTA_Q * CHUNKS; i += Tr::NUM_THREADS) {
        const int row = i / CHUNKS, c = i % CHUNKS;
        const int pr = packed_row0 + row;
        if (pr >= rows_total) continue;
        const auto load = [&](int64_t w, float* x) {
          const float4* src = reinterpret_cast<const float4*>(so + (w * Tr::CTA_Q + row) * D + c * 8);
          const float4 lo = src[0], hi = src[1];
          x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
        };
        float out[8];
        float lse = 0.f;
        if constexpr (V::USE_SOFTMAX) {
          lse = merge_n(Tr::NUM_WARPS_KV, [&](int64_t w) { return slse[w * Tr::CTA_Q + row]; }, load, out);
        } else {  // unnormalized weighted sums over disjoint keys add up
#pragma unroll
          for (int e = 0; e < 8; ++e) out[e] = 0.f;
          for (int w = 0; w < Tr::NUM_WARPS_KV; ++w) {
            float x[8];
            load(w, x);
#pragma unroll
            for (int e = 0; e < 8; ++e) out[e] += x[e];
          }
        }
        if (pslot >= 0) {
#pragma unroll
          for (int e = 0; e < 8; e += 2) write_partial2(pr, c * 8 + e, out[e], out[e + 1], lse, c == 0 && e == 0);
        } else {
          transform_out8(pr, c, out);
          write_out8(pr, c, out);
          if (c == 0) write_lse(pr, lse);
        }
      }
    }
  }

  // ---- one work item --------------------------------------------------------------------------------------

  // K and V of tile `tile` into pipeline stage `stage` (its page ids must be resident).
  __device__ __forceinline__ void issue_kv(int tile, int stage) const {
    const RingPageIds<Tr> pages{page_smem() + (tile % Tr::PAGE_RING) * Tr::PAGES_PER_TILE,
                                kv_begin + tile * Tr::CTA_KV, static_cast<int>(threadIdx.x) / 8};
    gather_kv<Tr>(*this, tile, smem_u32(k_smem(stage)), smem_u32(v_smem(stage)), pages, threadIdx.x);
  }

  __device__ __forceinline__ void run_item(int w, int head, float scale2) {
    kv_head = head;
    if constexpr (Tr::FP8_KV) {  // per-KV-head scales (float32 [H_kv], or 0); the scalar k_scale is in scale2
      if (p.scale_k) scale2 *= reinterpret_cast<const float*>(p.scale_k)[head];
      v_scale = static_cast<float>(p.scale_v_value) * (p.scale_v ? reinterpret_cast<const float*>(p.scale_v)[head] : 1.f);
    }
    if (!setup(w)) return;
    // commit groups, in order: page ids of tiles 0..2S-3 | Q | K/V of tiles 0..S-2 (prologue) | one per
    // iteration i: K/V of tile i+S-1 with the page ids of tile i+2S-2, so every page id lands S-1 iterations
    // before the copy that reads it
    constexpr int S = Tr::NUM_STAGES;
#pragma unroll
    for (int t = 0; t < 2 * S - 2; ++t)
      if (t < num_tiles) stage_page_ids<Tr>(*this, t, page_smem(), threadIdx.x);
    cp_async_commit();
    gather_q<Tr>(*this, smem_u32(q_smem()), threadIdx.x);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int t = 0; t < S - 1; ++t) {
      if (t < num_tiles) issue_kv(t, t);
      cp_async_commit();
    }

    if constexpr (Tr::Q_TO_HALF) {  // q (transformed) into fp16 rows scaled by 2^e, for the fp16 mma over fp8 K, V
      cp_async_wait<S - 1>();  // Q's group (only the prologue's K/V may still be in flight)
      __syncthreads();
      if constexpr (V::HAS_QUERY_TRANSFORM) {
        transform_q_tile<Tr>(*this, q_smem(), threadIdx.x, Tr::NUM_THREADS);
        __syncthreads();
      }
      q_rows_to_half<Tr>(q_smem(), q_scale_smem(), threadIdx.x);
      __syncthreads();
    }
    WarpState<Tr> st;
    st.init();
    if constexpr (V::HAS_SINK) {  // the online softmax starts from the sink (work.cuh), in one kv warp's state
      if (warp_kv == 0) {
#pragma unroll
        for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float s2 = this->sink_log2(packed_row0 + warp_q * Tr::WARP_ROWS + mq * 16 + lane / 4 + 8 * r);
            if (s2 != neg_inf()) {
              st.m[mq][r] = s2;
              st.d[mq][r] = s2 == s2 ? 1.f : s2;  // every lane of the quad holds its rows' whole sum; a NaN sink
            }                                       // makes it NaN: the row's o is NaN even with no visible key
          }
      }
    }
    uint32_t qf[Tr::Q_IN_REGS ? Tr::NUM_MMA_Q : 1][Tr::Q_IN_REGS ? D / 16 : 1][4];
    for (int i = 0; i < num_tiles; ++i) {
      cp_async_wait<S - 2>();
      __syncthreads();
      if constexpr (V::HAS_QUERY_TRANSFORM && !Tr::Q_TO_HALF) {  // (Q_TO_HALF: before the loop)
        if (i == 0) {
          transform_q_tile<Tr>(*this, q_smem(), threadIdx.x, Tr::NUM_THREADS);
          __syncthreads();
        }
      }
      const int next = i + S - 1;
      if constexpr (Tr::FP8_WARP_OWNED) {
        // the next copies first (their stage was converted last iteration), then this warp's K rows into the 16-bit
        // tile (its V rows in pv()), which this warp finished reading in compute_tile(i - 1) (fa2/traits.cuh)
        if (next < num_tiles) issue_kv(next, next % S);
        if (i + 2 * S - 2 < num_tiles) stage_page_ids<Tr>(*this, i + 2 * S - 2, page_smem(), threadIdx.x);
        cp_async_commit();
        dequant_own_rows(k_smem(i % S), i % S);
        if constexpr (V::HAS_KEY_TRANSFORM) __syncthreads();  // the transform below reads every warp's rows
      } else if constexpr (Tr::FP8_KV && !Tr::FP8_IN_REGS) {  // K and V into 16-bit tiles every warp reads
        dequant_rows<Tr, Tr::CTA_KV, Tr::NUM_THREADS, 2>(k_smem(i % S), k_tile(i % S), 0, threadIdx.x);
        dequant_rows<Tr, Tr::CTA_KV, Tr::NUM_THREADS, 2>(v_smem(i % S), v_tile(i % S), 0, threadIdx.x);
        __syncthreads();
      }
      if constexpr (V::HAS_KEY_TRANSFORM) {  // K(i) is resident in every thread's view: transform it in place
        transform_k_tile<Tr>(*this, k_tile(i % S), kv_begin + i * Tr::CTA_KV, threadIdx.x, Tr::NUM_THREADS);
        __syncthreads();
      }
      if constexpr (Tr::Q_IN_REGS) {
        if (i == 0) {
#pragma unroll
          for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
            for (int kd = 0; kd < D / 16; ++kd) load_q_frag(qf[mq][kd], mq, kd);
          if constexpr (Tr::FP8_IN_REGS) q_frags_as_quads(qf);
        }
      }
      if constexpr (!Tr::FP8_WARP_OWNED) {  // the stage compute_tile(i - 1) read (fp8: converted above)
        if (next < num_tiles) issue_kv(next, next % S);
        if (i + 2 * S - 2 < num_tiles) stage_page_ids<Tr>(*this, i + 2 * S - 2, page_smem(), threadIdx.x);
        cp_async_commit();
      }
      compute_tile(i, i % S, st, qf, scale2);
    }
    cp_async_wait<0>();
    __syncthreads();
    finish(st);
    if (nchunks > 1 && last_of_group(*this, threadIdx.x, [] { __syncthreads(); }))
      merge_group<Tr::NUM_THREADS, Tr::CTA_Q>(*this, threadIdx.x);
  }
};

template <typename Tr, typename P>
__device__ __forceinline__ void attention_body(const P& p) {
  extern __shared__ __align__(128) uint8_t smem[];
  AttentionCTA<Tr, P> cta(p, smem);
  const int heads = static_cast<int>(p.num_kv_heads);
  // a CUDA-graph wrapper's fixed grid walks the item count in device memory (graphs replay any plan); otherwise
  // the grid is exactly items x heads and work_count is 0, which spares every CTA one dependent global load
  // ahead of its work record
  const int total = p.work_count ? *reinterpret_cast<const int32_t*>(p.work_count) * heads : static_cast<int>(gridDim.x);
  const float scale2 = static_cast<float>(p.sm_scale_log2);
  for (int i = blockIdx.x; i < total; i += gridDim.x) {
    cta.run_item(i / heads, i % heads, scale2);
    __syncthreads();  // shared memory is reused by the next item
  }
}

}  // namespace attnjit
