// attnjit/work.cuh: one work item in logical coordinates, shared by every kernel family.
//
// Work decomposition (decided on the host by plan(), attnjit/ops/scheduler.py):
//   * GQA packing: the GROUP query heads that share KV head `kv_head` are packed into the row dimension, so
//     packed row r of a request is query token r / GROUP, query head kv_head * GROUP + r % GROUP. Every K/V
//     byte loaded into shared memory serves the whole group.
//   * A work item is (request, q tile of CTA_Q packed rows, KV range [kv_begin, kv_end)). CTAs walk the
//     (item, KV head) pairs, item-major so the longest-first order of the list holds across heads, with stride
//     gridDim.x (a fixed grid can serve any work list, which is what CUDA-graph replay needs).
//   * A request whose history is split into chunks writes fp32 partial states (o, lse) to a workspace slot; the
//     last CTA of each split group merges them (attnjit/split.cuh). Unsplit items write the output directly.
//
// Attention sinks (Variant HAS_SINK): a row's sink logit sink_h (natural units, on the scale of sm_scale * q.k)
// joins its softmax denominator as a key whose value vector is zero:
//   o = sum_j 2^(s_j - m) v_j / d,  d = 2^(sink2 - m) + sum_j 2^(s_j - m),  lse = m + log2(d),  sink2 = sink_h log2(e)
// with m the running max over the keys AND sink2. The families start the online softmax from it (m = sink2, d = 1:
// the sink is the row's first "key"), in exactly one partial state of the row: chunk 0 of a split request (and one
// warp of a tile whose warps split the keys), so the split-KV merge (attnjit/split.cuh), an exact combination of
// states over disjoint key sets, counts it once. The lse therefore includes the sink, and (o, lse) is a state that
// merge_state combines exactly with states over other keys; a row with no visible key gives o = 0, lse = sink2.
//
// Visibility, per packed row of token t: key j is visible iff kv_begin <= j < kv_stop and (!CAUSAL or
// j <= kv_len - qo_len + t) (bottom-right aligned), and the variant's mask allows it.
//
// `Tr` is a family's traits struct; this header uses only T, TO, Variant, HEAD_DIM, GROUP, CAUSAL, CTA_Q, CTA_KV.
#pragma once
#include "attnjit/common.cuh"

namespace attnjit {

template <typename Tr, typename P>
struct WorkItem {
  using TO = typename Tr::TO;
  using V = typename Tr::Variant;
  static constexpr int D = Tr::HEAD_DIM;
  static constexpr int GROUP_SIZE = Tr::GROUP;

  const P& p;
  const V var;
  int kv_head;
  // the current work item
  int req, qo_len, kv_len, rows_total, packed_row0, kv_begin, kv_stop, num_tiles;
  int64_t q_begin, kv_base;  // kv_base: page-table offset (paged) or first kv token (ragged)
  int pslot;                 // partial slot of this item's first token (-1: write the output)
  int pslot0, nchunks, group;  // split group: chunk 0's slot, chunks, ticket counter index
  int chunk;                   // this item's chunk of its split group (0: unsplit, or the first chunk)
  int mask_from = 0;           // V::MASK_FROM_KV_START: tiles from this key on need no variant mask for any row

  __device__ explicit WorkItem(const P& params) : p(params), var(params), kv_head(0) {}

  // Read work record w for KV head kv_head; false when the item has no rows (nothing to do).
  __device__ __forceinline__ bool setup(int w) {
    // work record (12 ints, three int4 loads in flight together): {request, q tile, kv begin, kv end,
    // chunk-0 partial slot (-1: unsplit), chunk, chunks, group, first query row, query rows, kv length,
    // page-table offset (paged) or first kv token (ragged)}
    const int4* rec = reinterpret_cast<const int4*>(p.work) + 3 * static_cast<int64_t>(w);
    const int4 a = rec[0], b = rec[1], c = rec[2];
    req = a.x;
    const int qtile = a.y;
    kv_begin = a.z;
    const int kv_end = a.w;
    pslot0 = b.x;
    chunk = b.y;
    nchunks = b.z;
    group = b.w;
    q_begin = c.x;
    qo_len = c.y;
    kv_len = c.z;
    kv_base = c.w;
    pslot = pslot0 >= 0 ? pslot0 + b.y * qo_len : -1;
    rows_total = qo_len * Tr::GROUP;
    packed_row0 = qtile * Tr::CTA_Q;
    kv_stop = kv_end;
    if constexpr (Tr::CAUSAL) {
      const int last_row = min(packed_row0 + Tr::CTA_Q, rows_total) - 1;
      kv_stop = min(kv_stop, kv_len - qo_len + last_row / Tr::GROUP + 1);
    }
    if constexpr (V::HAS_KV_START) {  // skip whole tiles below the first row's lowest visible key
      const int lo = var.kv_start(kv_len - qo_len + packed_row0 / Tr::GROUP, qo_len, kv_len, req, kv_head);
      if (lo > kv_begin) kv_begin = lo / Tr::CTA_KV * Tr::CTA_KV;
    }
    if constexpr (V::HAS_LOGITS_MASK && V::MASK_FROM_KV_START) {  // the bound of the item's last (highest) row
      const int last_row = min(packed_row0 + Tr::CTA_Q, rows_total) - 1;
      mask_from = var.kv_start(kv_len - qo_len + last_row / Tr::GROUP, qo_len, kv_len, req, kv_head);
    }
    num_tiles = kv_stop > kv_begin ? (kv_stop - kv_begin + Tr::CTA_KV - 1) / Tr::CTA_KV : 0;
    return packed_row0 < rows_total;
  }

  // ---- positions (what variant hooks see) --------------------------------------------------------------------

  // A tile's padding rows (pr >= rows_total) still run the hooks (their results are never written): they see the
  // request's last row, so a hook that reads memory by position (the custom mask's bits, a user tensor) stays
  // inside the request's data rather than past the end of the tensor.
  __device__ __forceinline__ int q_pos_of(int pr) const {
    return kv_len - qo_len + min(pr, rows_total - 1) / Tr::GROUP;
  }
  __device__ __forceinline__ int qo_head_of(int pr) const { return kv_head * Tr::GROUP + pr % Tr::GROUP; }

  // Packed row pr's sink logit in log2 units, where this item carries the row's sink (chunk 0); else -inf (no sink).
  __device__ __forceinline__ float sink_log2(int pr) const {
    if constexpr (V::HAS_SINK) {
      if (chunk == 0) return var.sink(q_pos_of(pr), qo_len, kv_len, req, qo_head_of(pr), kv_head) * kLog2e;
    }
    return neg_inf();
  }

  // The softmax's log2 scale of logits the variant transformed: log2 e, times the variant's logits_scale where it
  // declares one (its last logits transform left that factor out; V::logits_scale is NaN unless > 0). sm_scale:
  // the row's, as the transform saw it (with an fp8 query's dequantization where the logits still carry it).
  __device__ __forceinline__ float transformed_log2_scale(float sm_scale) const {
    if constexpr (V::HAS_LOGITS_SCALE) return var.logits_scale(sm_scale) * kLog2e;
    return kLog2e;
  }

  // ---- masks -----------------------------------------------------------------------------------------------

  // Whether the KV tile starting at kv0 holds any hidden key for some row of this item (the boundary, the causal
  // diagonal, or a variant mask): only such tiles pay for masking.
  // A variant whose mask is its kv_start bound (MASK_FROM_KV_START: a sliding window) masks only the tiles that
  // begin below the item's last row's bound (mask_from); any other variant mask, every tile.
  __device__ __forceinline__ bool tile_needs_mask(int kv0) const {
    bool variant_mask = V::HAS_LOGITS_MASK;
    if constexpr (V::HAS_LOGITS_MASK && V::MASK_FROM_KV_START) variant_mask = kv0 < mask_from;
    return variant_mask || kv0 + Tr::CTA_KV > kv_stop ||
           (Tr::CAUSAL && kv0 + Tr::CTA_KV - 1 > kv_len - qo_len + packed_row0 / Tr::GROUP);
  }

  // The last visible key of query token tok (before the variant's mask).
  __device__ __forceinline__ int last_visible(int tok) const {
    int last = kv_stop - 1;
    if constexpr (Tr::CAUSAL) last = min(last, kv_len - qo_len + tok);
    return last;
  }

  // ---- output ---------------------------------------------------------------------------------------------

  // Output row of packed row pr: token q_begin + pr / GROUP, query head kv_head * GROUP + pr % GROUP.
  __device__ __forceinline__ int64_t out_head(int pr) const {
    return static_cast<int64_t>(kv_head) * Tr::GROUP + pr % Tr::GROUP;
  }

  // Row index of packed row pr's partial state in tmp_o / tmp_lse.
  __device__ __forceinline__ int64_t partial_row(int pr) const {
    return (static_cast<int64_t>(pslot) + pr / Tr::GROUP) * p.num_qo_heads + out_head(pr);
  }

  // 2 consecutive fp32 elements (col, col+1) of packed row pr's partial state, and its lse when lse_writer.
  __device__ __forceinline__ void write_partial2(int pr, int col, float x0, float x1, float lse, bool lse_writer) const {
    const int64_t row = partial_row(pr);
    *reinterpret_cast<float2*>(reinterpret_cast<float*>(p.tmp_o) + row * D + col) = make_float2(x0, x1);
    if (lse_writer) reinterpret_cast<float*>(p.tmp_lse)[row] = lse;
  }

  __device__ __forceinline__ void write_lse(int pr, float lse) const {
    if (p.lse != 0) reinterpret_cast<float*>(p.lse)[(q_begin + pr / Tr::GROUP) * p.num_qo_heads + out_head(pr)] = lse;
  }

  // Address of the 8 output elements (16 bytes) of chunk `chunk` of packed row pr.
  __device__ __forceinline__ TO* out_ptr(int pr, int chunk) const {
    return reinterpret_cast<TO*>(p.o) + (q_begin + pr / Tr::GROUP) * p.o_stride_n + out_head(pr) * p.o_stride_h +
           chunk * 8;
  }

  // 8 consecutive output elements (16 bytes) of packed row pr.
  __device__ __forceinline__ void write_out8(int pr, int chunk, const float* x) const { store8<TO>(out_ptr(pr, chunk), x); }

  // Output transform of 8 consecutive elements of a final output row.
  __device__ __forceinline__ void transform_out8(int pr, int chunk, float* x) const {
    if constexpr (V::HAS_OUTPUT_TRANSFORM) {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        x[e] = var.output_transform(x[e], chunk * 8 + e, q_pos_of(pr), qo_len, kv_len, req, qo_head_of(pr), kv_head);
    }
  }
};

}  // namespace attnjit
