// attnjit/attention.cuh: batch attention over a paged or ragged KV cache (prefill, decode, mixed batches).
//
// Work decomposition (decided on the host by plan()):
//   * GQA packing: the GROUP query heads that share KV head `kv_head` are packed into the row dimension, so
//     packed row r of a request is query token r / GROUP, query head kv_head * GROUP + r % GROUP. Every K/V
//     byte loaded into shared memory serves the whole group.
//   * A work item is (request, q tile of CTA_Q packed rows, KV range [kv_begin, kv_end)). CTAs walk the
//     (item, KV head) pairs, item-major so the longest-first order of the list holds across heads, with stride
//     gridDim.x (a fixed grid can serve any work list, which is what CUDA-graph replay needs).
//   * A request whose history is split into chunks writes fp32 partial states (o, lse) to a workspace; the
//     last CTA of each split group (an atomic ticket) merges the group's partials and writes the output, so a
//     split costs no second launch. Unsplit requests write the output directly.
//
// Math, per packed row: s_j = q.k_j, visible iff j < kv_len and (!CAUSAL or j <= kv_len - qo_len + token)
// (bottom-right aligned). Online softmax in base 2 with the scale sm_scale*log2(e) folded in:
//   m = max_j s_j*scale2,  d = sum_j 2^(s_j*scale2 - m),  o = sum_j 2^(s_j*scale2 - m) v_j / d,  lse = m + log2(d)
// which is lse = log2(sum_j exp(sm_scale * s_j)). A row with no visible key yields o = 0, lse = -inf.
//
// Inner loop (per warp): S = Q K^T with mma.sync m16n8k16 (A = Q rows from shared memory via ldmatrix, B = K
// rows via ldmatrix), mask only on boundary/diagonal tiles, online softmax in registers, O += P V (A = P
// re-packed from the S accumulators, B = V via ldmatrix.trans). K/V tiles arrive through a NUM_STAGES-deep
// cp.async pipeline; page ids are staged in shared memory by cp.async 2*NUM_STAGES-2 tiles ahead of the copy
// that needs them, so no thread ever waits on a page-table load in the loop. Shared-memory addresses are
// precomputed per lane (see q_row_off), so an ldmatrix costs one integer op.
#pragma once
#include "attnjit/common.cuh"
#include "attnjit/merge_state.cuh"
#include "attnjit/paged.cuh"

namespace attnjit {

// The default attention: no hook. A variant (rendered by the template from an attnjit.Variant) has the same
// members with some HAS_* true and the hook methods; every hook call site below is `if constexpr`, so NoVariant
// compiles to the kernel without hooks.
struct NoVariant {
  static constexpr bool HAS_QUERY_TRANSFORM = false, HAS_LOGITS_TRANSFORM = false, HAS_LOGITS_MASK = false,
                        HAS_OUTPUT_TRANSFORM = false, HAS_KV_START = false, USE_SOFTMAX = true;
  template <typename P>
  __device__ explicit NoVariant(const P&) {}
};

// Every tile and stage constant of one kernel instance.
template <typename T_, typename TO_, int HEAD_DIM_, int GROUP_, bool CAUSAL_, bool PAGED_, int PAGE_SIZE_,
          bool HND_, int NUM_WARPS_Q_, int NUM_WARPS_KV_, int NUM_MMA_Q_, int NUM_MMA_KV_, int NUM_STAGES_,
          typename VARIANT_ = NoVariant>
struct AttentionTraits {
  using T = T_;    // q, k, v element type
  using TO = TO_;  // output element type
  using Variant = VARIANT_;  // hook policy (NoVariant: plain softmax attention)
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int GROUP = GROUP_;  // query heads per KV head
  static constexpr bool CAUSAL = CAUSAL_;
  static constexpr bool PAGED = PAGED_;
  static constexpr int PAGE_SIZE = PAGE_SIZE_;
  static constexpr int PAGE_SHIFT = ilog2(PAGE_SIZE_);
  static constexpr bool HND = HND_;
  static constexpr int NUM_WARPS_Q = NUM_WARPS_Q_;    // warps splitting the q rows of a tile
  static constexpr int NUM_WARPS_KV = NUM_WARPS_KV_;  // warps splitting the kv columns of a tile
  static constexpr int NUM_MMA_Q = NUM_MMA_Q_;        // m16 row blocks per warp
  static constexpr int NUM_MMA_KV = NUM_MMA_KV_;      // 16-column kv blocks per warp per tile
  static constexpr int NUM_STAGES = NUM_STAGES_;      // cp.async pipeline depth for K/V tiles
  static constexpr int NUM_WARPS = NUM_WARPS_Q * NUM_WARPS_KV;
  static constexpr int NUM_THREADS = 32 * NUM_WARPS;
  static constexpr int WARP_ROWS = NUM_MMA_Q * 16;
  static constexpr int WARP_COLS = NUM_MMA_KV * 16;
  static constexpr int CTA_Q = NUM_WARPS_Q * WARP_ROWS;    // packed rows per work item
  static constexpr int CTA_KV = NUM_WARPS_KV * WARP_COLS;  // kv tokens per pipeline stage
  static constexpr int CHUNKS = HEAD_DIM / 8;              // 16-byte chunks per row
  static constexpr int ROW_BYTES = HEAD_DIM * 2;           // one row of a Q/K/V tile in shared memory
  // page ids of a KV tile, staged in shared memory by cp.async several tiles ahead of their use
  static constexpr int PAGES_PER_TILE = PAGED ? (CTA_KV > PAGE_SIZE ? CTA_KV / PAGE_SIZE : 1) : 0;
  static constexpr int PAGE_RING = 2 * NUM_STAGES;         // tiles whose page ids are resident
  static constexpr int PAGE_SMEM = (PAGE_RING * PAGES_PER_TILE * 4 + 127) / 128 * 128;
  static constexpr int Q_SMEM = CTA_Q * HEAD_DIM * 2;
  static constexpr int KV_TILE_SMEM = CTA_KV * HEAD_DIM * 2;  // one of K or V, one stage
  static constexpr int PIPE_SMEM = 2 * NUM_STAGES * KV_TILE_SMEM;
  // cross-warp merge scratch (NUM_WARPS_KV > 1), reusing the pipeline's memory after the main loop:
  // normalized o [NUM_WARPS_KV][CTA_Q][HEAD_DIM] f32, then lse [NUM_WARPS_KV][CTA_Q] f32
  static constexpr int MERGE_SMEM = NUM_WARPS_KV > 1 ? NUM_WARPS_KV * CTA_Q * (HEAD_DIM + 1) * 4 : 0;
  static constexpr int SMEM_BYTES = Q_SMEM + PAGE_SMEM + (PIPE_SMEM > MERGE_SMEM ? PIPE_SMEM : MERGE_SMEM);
  // tile loads (Q, K, V): 8 threads per row, thread t copies chunks t % 8 + 8 j (j < CHUNKS / 8) of one row, so
  // 8 neighbouring threads write 8 different bank groups, and one address serves a row's CHUNKS / 8 copies
  static constexpr int LOAD_CPT = CHUNKS / 8;                     // 16-byte copies per thread per row
  static constexpr int KV_ROWS_PER_PASS = NUM_THREADS / 8;        // rows one pass of the CTA's threads covers
  static constexpr int KV_PASSES = CTA_KV / KV_ROWS_PER_PASS;
  static constexpr bool Q_IN_REGS = NUM_MMA_Q * (HEAD_DIM / 16) * 4 <= 32;

  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM >= 64, "head_dim must be a multiple of 16, at least 64");
  static_assert(NUM_THREADS % 8 == 0 && CHUNKS % 8 == 0, "a cp.async pass must cover whole rows");
  static_assert(CTA_Q % KV_ROWS_PER_PASS == 0 || KV_ROWS_PER_PASS % CTA_Q == 0, "q rows and load passes must nest");
  static_assert(CTA_KV % KV_ROWS_PER_PASS == 0, "the kv tile must be a whole number of cp.async passes");
  static_assert(NUM_STAGES >= 2, "the K/V pipeline needs at least two stages");
  static_assert(NUM_WARPS_Q == 1 || NUM_WARPS_KV == 1, "warps split either q rows or kv columns, not both");
  static_assert(GROUP >= 1, "group size must be positive");
  static_assert(!PAGED || PAGE_SIZE >= CTA_KV || CTA_KV % PAGE_SIZE == 0, "a KV tile must hold whole pages");
  static_assert(PAGES_PER_TILE <= NUM_THREADS, "one thread per staged page id");
};

// Thread-local accumulators of one warp: NUM_MMA_Q row blocks of 16 rows; each thread holds rows
// lane/4 and lane/4 + 8 of each block (index r = 0, 1).
template <typename Tr>
struct WarpState {
  float o[Tr::NUM_MMA_Q][Tr::HEAD_DIM / 8][4];  // unnormalized output, mma C layout
  float m[Tr::NUM_MMA_Q][2];                    // running max of s*scale2 (log2 units)
  float d[Tr::NUM_MMA_Q][2];                    // running sum of 2^(s*scale2 - m) over the row (every lane of a quad)

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) {
#pragma unroll
      for (int dt = 0; dt < Tr::HEAD_DIM / 8; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mq][dt][e] = 0.f;
      }
      m[mq][0] = m[mq][1] = neg_inf();
      d[mq][0] = d[mq][1] = 0.f;
    }
  }
};

template <typename Tr, typename P>
struct AttentionCTA {
  using T = typename Tr::T;
  using TO = typename Tr::TO;
  static constexpr int D = Tr::HEAD_DIM;
  static constexpr int CHUNKS = Tr::CHUNKS;

  using V = typename Tr::Variant;
  const P& p;
  const V var;
  uint8_t* smem;
  const int lane, warp_q, warp_kv;
  int kv_head;
  // the current work item
  int req, qo_len, kv_len, rows_total, packed_row0, kv_begin, kv_stop, num_tiles;
  int64_t q_begin, kv_base;  // kv_base: page-table offset (paged) or first kv token (ragged)
  int pslot;                 // partial slot of this item's first token (-1: write the output)
  int pslot0, nchunks, group;  // split group: chunk 0's slot, chunks, ticket counter index

  __device__ AttentionCTA(const P& params, uint8_t* smem_)
      : p(params),
        var(params),
        smem(smem_),
        lane(threadIdx.x % 32),
        warp_q((threadIdx.x / 32) % Tr::NUM_WARPS_Q),
        warp_kv((threadIdx.x / 32) / Tr::NUM_WARPS_Q),
        kv_head(0) {
    const uint32_t x = lane & 7;
    q_row_off = (warp_q * Tr::WARP_ROWS + lane % 16) * Tr::ROW_BYTES;
    k_row_off = (warp_kv * Tr::WARP_COLS + lane % 8 + (lane / 16) * 8) * Tr::ROW_BYTES;
    v_row_off = (warp_kv * Tr::WARP_COLS + lane % 8 + ((lane / 8) % 2) * 8) * Tr::ROW_BYTES;
    yq16 = ((lane / 16) ^ x) << 4;
    yk16 = (((lane / 8) % 2) ^ x) << 4;
  }

  // per-thread byte offsets of the rows this lane addresses with ldmatrix, and the XOR term of its chunk
  // (swizzle(row, chunk) = row * ROW_BYTES + ((chunk ^ (row & 7)) << 4), and every such row has row & 7 == lane & 7,
  // so chunk 2 * j + h maps to ((j << 5) ^ y16) with y16 = (h ^ (lane & 7)) << 4)
  uint32_t q_row_off, k_row_off, v_row_off, yq16, yk16;

  __device__ __forceinline__ uint8_t* q_smem() const { return smem; }
  __device__ __forceinline__ int32_t* page_smem() const { return reinterpret_cast<int32_t*>(smem + Tr::Q_SMEM); }
  __device__ __forceinline__ uint8_t* pipe_smem() const { return smem + Tr::Q_SMEM + Tr::PAGE_SMEM; }
  __device__ __forceinline__ uint8_t* k_smem(int stage) const { return pipe_smem() + stage * Tr::KV_TILE_SMEM; }
  __device__ __forceinline__ uint8_t* v_smem(int stage) const {
    return pipe_smem() + (Tr::NUM_STAGES + stage) * Tr::KV_TILE_SMEM;
  }

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
    num_tiles = kv_stop > kv_begin ? (kv_stop - kv_begin + Tr::CTA_KV - 1) / Tr::CTA_KV : 0;
    return packed_row0 < rows_total;
  }

  // ---- loads --------------------------------------------------------------------------------------------

  __device__ __forceinline__ void load_q() {
    const T* q = reinterpret_cast<const T*>(p.q);
    constexpr int RPP = Tr::KV_ROWS_PER_PASS;  // rows one pass of the CTA's threads covers
    const int c0 = threadIdx.x % 8, r0 = threadIdx.x / 8;
    const uint32_t base = smem_u32(q_smem());
    if constexpr (RPP % Tr::GROUP == 0 && Tr::CTA_Q % RPP == 0 && Tr::CTA_Q % Tr::GROUP == 0) {
      // rows r0 + k * RPP of one thread share a query head and advance by RPP / GROUP tokens: one 64-bit add each
      const int pr0 = packed_row0 + r0;
      const T* src0 = q + (q_begin + pr0 / Tr::GROUP) * p.q_stride_n +
                      (static_cast<int64_t>(kv_head) * Tr::GROUP + pr0 % Tr::GROUP) * p.q_stride_h + c0 * 8;
      const int64_t step = (RPP / Tr::GROUP) * p.q_stride_n;
#pragma unroll
      for (int k = 0; k < Tr::CTA_Q / RPP; ++k) {
        const bool valid = pr0 + k * RPP < rows_total;
        const T* src = valid ? src0 + k * step : q;
        const uint32_t dst = base + swizzle<CHUNKS>(r0 + k * RPP, c0);
#pragma unroll
        for (int j = 0; j < Tr::LOAD_CPT; ++j) cp_async_16(dst + j * 128, src + j * 64, valid);
      }
    } else {
      for (int r = r0; r < Tr::CTA_Q; r += RPP) {
        const int pr = packed_row0 + r;
        const bool valid = pr < rows_total;
        const int64_t tok = q_begin + pr / Tr::GROUP;
        const int64_t h = static_cast<int64_t>(kv_head) * Tr::GROUP + pr % Tr::GROUP;
        const T* src = valid ? q + tok * p.q_stride_n + h * p.q_stride_h + c0 * 8 : q;
        const uint32_t dst = base + swizzle<CHUNKS>(r, c0);
#pragma unroll
        for (int j = 0; j < Tr::LOAD_CPT; ++j) cp_async_16(dst + j * 128, src + j * 64, valid);
      }
    }
  }

  // Stage the page ids of tile `tile` into its ring slot (cp.async, joins the caller's commit group).
  __device__ __forceinline__ void stage_pages(int tile) const {
    if constexpr (Tr::PAGED) {
      if (threadIdx.x < Tr::PAGES_PER_TILE) {
        const int kv0 = kv_begin + tile * Tr::CTA_KV;
        const int k = static_cast<int>(threadIdx.x);
        const bool valid = kv0 + k * Tr::PAGE_SIZE < kv_stop;
        const int32_t* src = reinterpret_cast<const int32_t*>(p.kv_indices) + kv_base + (kv0 >> Tr::PAGE_SHIFT) + k;
        const uint32_t dst = smem_u32(page_smem() + (tile % Tr::PAGE_RING) * Tr::PAGES_PER_TILE + k);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst),
                     "l"(valid ? src : reinterpret_cast<const int32_t*>(p.kv_indices)), "r"(valid ? 4 : 0));
      }
    }
  }

  // Copy K and V rows of tile `tile` into pipeline stage `stage` (its page ids must be resident).
  // Thread t copies chunks t % 8 + 8 j of rows r0 + s * KV_ROWS_PER_PASS (r0 = t / 8), pass s < KV_PASSES.
  // Rows past kv_stop are zero-filled (src-size 0): hidden keys must still have finite V.
  __device__ __forceinline__ void issue_kv(int tile, int stage) const {
    constexpr int RPP = Tr::KV_ROWS_PER_PASS;
    const T* k = reinterpret_cast<const T*>(p.k);
    const T* v = reinterpret_cast<const T*>(p.v);
    const int kv0 = kv_begin + tile * Tr::CTA_KV;
    const int c0 = threadIdx.x % 8;
    const int r0 = static_cast<int>(threadIdx.x) / 8;
    const uint32_t dst0 = r0 * Tr::ROW_BYTES + ((c0 ^ (r0 & 7)) << 4);  // rows r0 + s * RPP: same r & 7
    const uint32_t ks = smem_u32(k_smem(stage)), vs = smem_u32(v_smem(stage));
    const int32_t* pages = page_smem() + (tile % Tr::PAGE_RING) * Tr::PAGES_PER_TILE;
    // paged, a pass within one page: pass s reads page id (s * RPP) / PAGE_SIZE of the tile (a constant index)
    // at slot slot0 + r0 + (s * RPP) % PAGE_SIZE. Invalid rows keep an in-bounds address: their page id was
    // zero-filled when staged, or is the tile's own page.
    constexpr bool PASS_IN_PAGE = Tr::PAGED && RPP <= Tr::PAGE_SIZE && (RPP & (RPP - 1)) == 0;
    int64_t thread_off = 0, slot_stride = 0;
    if constexpr (PASS_IN_PAGE) {
      slot_stride = Tr::HND ? D : p.kv_stride_1;
      const int64_t head_stride = Tr::HND ? p.kv_stride_1 : D;
      const int slot0 = Tr::PAGE_SIZE > Tr::CTA_KV ? (kv0 & (Tr::PAGE_SIZE - 1)) : 0;
      thread_off = (slot0 + r0) * slot_stride + kv_head * head_stride + c0 * 8;
    } else if constexpr (!Tr::PAGED) {
      thread_off = (kv_base + kv0 + r0) * p.kv_stride_0 + static_cast<int64_t>(kv_head) * p.kv_stride_1 + c0 * 8;
    }
#pragma unroll
    for (int s = 0; s < Tr::KV_PASSES; ++s) {
      const int r = r0 + s * RPP;
      const bool valid = kv0 + r < kv_stop;
      int64_t off;
      if constexpr (PASS_IN_PAGE) {
        const int page = pages[(s * RPP) >> Tr::PAGE_SHIFT];
        off = page * p.kv_stride_0 + thread_off + ((s * RPP) & (Tr::PAGE_SIZE - 1)) * slot_stride;
      } else if constexpr (Tr::PAGED) {
        const int j = kv0 + r;
        const int page = pages[(j >> Tr::PAGE_SHIFT) - (kv0 >> Tr::PAGE_SHIFT)];
        off = paged_offset<Tr::HND, D>(page, j & (Tr::PAGE_SIZE - 1), kv_head, p.kv_stride_0, p.kv_stride_1);
        off = valid ? off + c0 * 8 : 0;
      } else {
        off = valid ? thread_off + static_cast<int64_t>(s * RPP) * p.kv_stride_0 : 0;
      }
      const uint32_t dst = RPP % 8 == 0 ? dst0 + s * RPP * Tr::ROW_BYTES : swizzle<CHUNKS>(r, c0);
#pragma unroll
      for (int j = 0; j < Tr::LOAD_CPT; ++j) {
        cp_async_16(ks + dst + j * 128, k + off + j * 64, valid);
        cp_async_16(vs + dst + j * 128, v + off + j * 64, valid);
      }
    }
  }

  // ---- variant hooks ---------------------------------------------------------------------------------------

  __device__ __forceinline__ int q_pos_of(int pr) const { return kv_len - qo_len + pr / Tr::GROUP; }
  __device__ __forceinline__ int qo_head_of(int pr) const { return kv_head * Tr::GROUP + pr % Tr::GROUP; }

  // Apply the variant's query transform to the Q tile in shared memory (once per work item, before use).
  __device__ __forceinline__ void transform_q() const {
    for (int i = threadIdx.x; i < Tr::CTA_Q * CHUNKS; i += Tr::NUM_THREADS) {
      const int r = i / CHUNKS, c = i % CHUNKS;
      const int pr = packed_row0 + r;
      if (pr >= rows_total) continue;
      T* ptr = reinterpret_cast<T*>(q_smem() + swizzle<CHUNKS>(r, c));
      float x[8];
      load8<T>(ptr, x);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        x[e] = var.query_transform(x[e], c * 8 + e, q_pos_of(pr), qo_len, kv_len, req, qo_head_of(pr), kv_head);
      store8<T>(ptr, x);
    }
  }

  // Output transform of 8 consecutive elements of a final output row.
  __device__ __forceinline__ void transform_out8(int pr, int chunk, float* x) const {
    if constexpr (V::HAS_OUTPUT_TRANSFORM) {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        x[e] = var.output_transform(x[e], chunk * 8 + e, q_pos_of(pr), qo_len, kv_len, req, qo_head_of(pr), kv_head);
    }
  }

  // ---- compute one tile -----------------------------------------------------------------------------------

  __device__ __forceinline__ void load_q_frag(uint32_t (&a)[4], int mq, int kd) const {
    ldmatrix_x4(a, smem_u32(q_smem()) + q_row_off + mq * 16 * Tr::ROW_BYTES + ((kd << 5) ^ yq16));
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
    const uint32_t ks = smem_u32(k_smem(stage));
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

    const int kv0 = kv_begin + tile * Tr::CTA_KV;
    const int col0 = kv0 + warp_kv * Tr::WARP_COLS + 2 * (lane % 4);  // this lane's first column in the tile
    if constexpr (V::HAS_LOGITS_TRANSFORM) {  // logit = sm_scale * q.k, transformed by the variant
      const float sm_scale = scale2 * (1.f / kLog2e);
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int pr = packed_row0 + warp_q * Tr::WARP_ROWS + mq * 16 + lane / 4 + 8 * r;
#pragma unroll
          for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              s[mq][nt][2 * r + e] = var.logits_transform(s[mq][nt][2 * r + e] * sm_scale, q_pos_of(pr),
                                                          col0 + nt * 8 + e, qo_len, kv_len, req, qo_head_of(pr),
                                                          kv_head);
        }
    }

    // mask the boundary and the causal diagonal (only tiles that reach past either), and the variant's mask
    const int diag = kv_len - qo_len;  // token t sees j <= diag + t
    const int first_token = packed_row0 / Tr::GROUP;
    const bool need_mask = V::HAS_LOGITS_MASK || kv0 + Tr::CTA_KV > kv_stop ||
                           (Tr::CAUSAL && kv0 + Tr::CTA_KV - 1 > diag + first_token);
    if (need_mask) {
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
          int last = kv_stop - 1;  // the last visible column, relative to col0
          if constexpr (Tr::CAUSAL) last = min(last, diag + tok);
          last -= col0;
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
      softmax_update(s, st, scale2);
    }
    pv(s, stage, st);
  }

  // Online softmax of one tile's S (in place: S becomes P); O is rescaled only when some row's max moved.
  __device__ __forceinline__ void softmax_update(float (&s)[Tr::NUM_MMA_Q][Tr::NUM_MMA_KV * 2][4],
                                                 WarpState<Tr>& st, float scale2) const {
    if constexpr (V::HAS_LOGITS_TRANSFORM) scale2 = kLog2e;  // the logits are already scaled
    float alpha[Tr::NUM_MMA_Q][2];
    bool moved = false;
#pragma unroll
    for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // the max of the raw logits, scaled once (scale2 > 0: plan() checks sm_scale, a transform uses log2 e)
        float raw = neg_inf();
#pragma unroll
        for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt) raw = fmaxf(raw, fmaxf(s[mq][nt][2 * r], s[mq][nt][2 * r + 1]));
        raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 1));
        raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 2));
        const float mx = fmaxf(st.m[mq][r], raw * scale2);
        const float m_safe = mx == neg_inf() ? 0.f : mx;
        alpha[mq][r] = fast_exp2(st.m[mq][r] - m_safe);
        moved |= mx != st.m[mq][r];
        st.m[mq][r] = mx;
#pragma unroll
        for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) s[mq][nt][e] = fast_exp2(fmaf(s[mq][nt][e], scale2, -m_safe));
        st.d[mq][r] *= alpha[mq][r];  // pv() adds this tile's row sums
      }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          st.o[mq][dt][0] *= alpha[mq][0];
          st.o[mq][dt][1] *= alpha[mq][0];
          st.o[mq][dt][2] *= alpha[mq][1];
          st.o[mq][dt][3] *= alpha[mq][1];
        }
    }
  }

  // O += P V
  __device__ __forceinline__ void pv(const float (&s)[Tr::NUM_MMA_Q][Tr::NUM_MMA_KV * 2][4], int stage,
                                     WarpState<Tr>& st) const {
    const uint32_t vs = smem_u32(v_smem(stage));
    // softmax row sums of this tile on the tensor cores (P x ones), from the same rounded P that multiplies V:
    // one mma per 16x16 block instead of an add per element, and every lane of a quad gets its rows' sums
    float rs[Tr::NUM_MMA_Q][4];
#pragma unroll
    for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) rs[mq][0] = rs[mq][1] = rs[mq][2] = rs[mq][3] = 0.f;
    const uint32_t ones[2] = {ones2<T>(), ones2<T>()};
#pragma unroll
    for (int kk = 0; kk < Tr::NUM_MMA_KV; ++kk) {
      uint32_t a[Tr::NUM_MMA_Q][4];
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) {
        a[mq][0] = pack2<T>(s[mq][2 * kk][0], s[mq][2 * kk][1]);
        a[mq][1] = pack2<T>(s[mq][2 * kk][2], s[mq][2 * kk][3]);
        a[mq][2] = pack2<T>(s[mq][2 * kk + 1][0], s[mq][2 * kk + 1][1]);
        a[mq][3] = pack2<T>(s[mq][2 * kk + 1][2], s[mq][2 * kk + 1][3]);
        if constexpr (V::USE_SOFTMAX) mma_16816<T>(rs[mq], a[mq], ones);
      }
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
    if constexpr (V::USE_SOFTMAX) {
#pragma unroll
      for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq) {
        st.d[mq][0] += rs[mq][0];
        st.d[mq][1] += rs[mq][2];
      }
    }
  }

  // ---- output ---------------------------------------------------------------------------------------------

  // Output row of packed row pr: token q_begin + pr / GROUP, query head kv_head * GROUP + pr % GROUP.
  __device__ __forceinline__ int64_t out_head(int pr) const {
    return static_cast<int64_t>(kv_head) * Tr::GROUP + pr % Tr::GROUP;
  }

  // 2 consecutive fp32 elements (col, col+1) of packed row pr's partial state, and its lse when lse_writer.
  __device__ __forceinline__ void write_partial2(int pr, int col, float x0, float x1, float lse, bool lse_writer) const {
    const int64_t row = (static_cast<int64_t>(pslot) + pr / Tr::GROUP) * p.num_qo_heads + out_head(pr);
    *reinterpret_cast<float2*>(reinterpret_cast<float*>(p.tmp_o) + row * D + col) = make_float2(x0, x1);
    if (lse_writer) reinterpret_cast<float*>(p.tmp_lse)[row] = lse;
  }

  __device__ __forceinline__ void write_lse(int pr, float lse) const {
    if (p.lse != 0) reinterpret_cast<float*>(p.lse)[(q_begin + pr / Tr::GROUP) * p.num_qo_heads + out_head(pr)] = lse;
  }

  // 8 consecutive output elements (16 bytes) of packed row pr.
  __device__ __forceinline__ void write_out8(int pr, int chunk, const float* x) const {
    store8<TO>(reinterpret_cast<TO*>(p.o) + (q_begin + pr / Tr::GROUP) * p.o_stride_n + out_head(pr) * p.o_stride_h +
                   chunk * 8,
               x);
  }

  // What a row's accumulated o is multiplied by, and the row's lse (softmax: 1/d and m + log2 d; a fully hidden
  // row gives 0 and -inf; no softmax: the sum stands, lse 0).
  __device__ __forceinline__ void state_scale(const WarpState<Tr>& st, int mq, int r, float& inv, float& lse) const {
    if constexpr (V::USE_SOFTMAX) {
      const float dd = st.d[mq][r];
      inv = dd > 0.f ? fast_rcp(dd) : 0.f;
      lse = dd > 0.f ? st.m[mq][r] + fast_log2(dd) : neg_inf();
    } else {
      inv = 1.f;
      lse = 0.f;
    }
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
            uint8_t* row_stage = stage + row * Tr::ROW_BYTES + 4 * (lane % 4);
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
              float x0 = st.o[mq][dt][2 * r] * inv, x1 = st.o[mq][dt][2 * r + 1] * inv;
              if constexpr (V::HAS_OUTPUT_TRANSFORM) {
                const int col = dt * 8 + 2 * (lane % 4);
                if (pr < rows_total) {
                  x0 = var.output_transform(x0, col, q_pos_of(pr), qo_len, kv_len, req, qo_head_of(pr), kv_head);
                  x1 = var.output_transform(x1, col + 1, q_pos_of(pr), qo_len, kv_len, req, qo_head_of(pr), kv_head);
                }
              }
              *reinterpret_cast<uint32_t*>(row_stage + ((dt ^ (row & 7)) << 4)) = pack2<TO>(x0, x1);
            }
            if (lane % 4 == 0 && pr < rows_total) write_lse(pr, lse);
          }
        __syncwarp();
        // lane l stores chunk l % CHUNKS of rows l / CHUNKS + k * (32 / CHUNKS): one 64-bit row address per k
        static_assert(32 % CHUNKS == 0, "a warp stores whole rows per step");
        constexpr int ROWS_PER_STEP = 32 / CHUNKS;
        const int c = lane % CHUNKS;
        TO* out = reinterpret_cast<TO*>(p.o);
#pragma unroll
        for (int k = 0; k < Tr::WARP_ROWS / ROWS_PER_STEP; ++k) {
          const int row = warp_q * Tr::WARP_ROWS + k * ROWS_PER_STEP + lane / CHUNKS;
          const int pr = packed_row0 + row;
          if (pr < rows_total) {
            const uint4 v = *reinterpret_cast<const uint4*>(stage + swizzle<CHUNKS>(row, c));
            *reinterpret_cast<uint4*>(out + (q_begin + pr / Tr::GROUP) * p.o_stride_n + out_head(pr) * p.o_stride_h +
                                      c * 8) = v;
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
            const int64_t prow = (static_cast<int64_t>(pslot) + pr / Tr::GROUP) * p.num_qo_heads + out_head(pr);
            float* dst = reinterpret_cast<float*>(p.tmp_o) + prow * D + 2 * (lane % 4);
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt)
              *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(st.o[mq][dt][2 * r] * inv, st.o[mq][dt][2 * r + 1] * inv);
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
            const int col = dt * 8 + 2 * (lane % 4);
            *reinterpret_cast<float2*>(dst + col) = make_float2(st.o[mq][dt][2 * r] * inv, st.o[mq][dt][2 * r + 1] * inv);
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

  // ---- split groups: the last CTA to finish merges the group's partial states ----------------------------

  // Returns true in every thread of the CTA that finished its group last (all partials are then visible).
  __device__ __forceinline__ bool last_of_group() const {
    __shared__ int last;
    __threadfence();  // this CTA's partial writes, visible device-wide before the ticket
    __syncthreads();
    if (threadIdx.x == 0) {
      int* counter = reinterpret_cast<int*>(p.merge_counters) + static_cast<int64_t>(group) * p.num_kv_heads + kv_head;
      last = atomicAdd(counter, 1) == nchunks - 1;
      if (last) *counter = 0;  // every chunk has taken its ticket: reset for the next run (graph replay)
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
  }

  // Merge the nchunks partial states of every row of this (request, q tile, kv head) and write the output.
  // Threads are split into SUB-lane teams per (row, 16-byte chunk) item, each lane folding every SUB-th state
  // online (one pass, loads independent), then the team combines by shuffles.
  __device__ __forceinline__ void merge_group() const {
    const int rows = min(Tr::CTA_Q, rows_total - packed_row0);
    const int items = rows * CHUNKS;
    int sub = 1;  // lanes per item: a power of two <= 32 that keeps every thread busy
    while (sub < 32 && items * sub * 2 <= Tr::NUM_THREADS) sub *= 2;
    const float* tmp_o = reinterpret_cast<const float*>(p.tmp_o);
    const float* tmp_lse = reinterpret_cast<const float*>(p.tmp_lse);
    const int teams = Tr::NUM_THREADS / sub;
    const int my_sub = threadIdx.x % sub;
    for (int base = 0; base < items; base += teams) {  // uniform trip count: shuffles below are warp-wide
      const int item = base + static_cast<int>(threadIdx.x) / sub;
      const bool active = item < items;
      const int pr = packed_row0 + (active ? item / CHUNKS : 0);
      const int c = active ? item % CHUNKS : 0;
      const int64_t head = out_head(pr);
      const int64_t tok = pr / Tr::GROUP;
      float m = neg_inf(), z = 0.f, acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
      if (active) {
#pragma unroll 8
        for (int k = my_sub; k < nchunks; k += sub) {
          const int64_t row = (static_cast<int64_t>(pslot0) + static_cast<int64_t>(k) * qo_len + tok) * p.num_qo_heads + head;
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
          lse = z > 0.f ? m + fast_log2(z) : neg_inf();
        }
        transform_out8(pr, c, acc);
        write_out8(pr, c, acc);
        if (c == 0) write_lse(pr, lse);
      }
    }
  }

  // ---- one work item --------------------------------------------------------------------------------------

  __device__ __forceinline__ void run_item(int w, int head, float scale2) {
    kv_head = head;
    if (!setup(w)) return;
    // commit groups, in order: page ids of tiles 0..2S-3 | Q | K/V of tiles 0..S-2 (prologue) | one per
    // iteration i: K/V of tile i+S-1 with the page ids of tile i+2S-2, so every page id lands S-1 iterations
    // before the copy that reads it
    constexpr int S = Tr::NUM_STAGES;
#pragma unroll
    for (int t = 0; t < 2 * S - 2; ++t)
      if (t < num_tiles) stage_pages(t);
    cp_async_commit();
    load_q();
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int t = 0; t < S - 1; ++t) {
      if (t < num_tiles) issue_kv(t, t);
      cp_async_commit();
    }

    WarpState<Tr> st;
    st.init();
    uint32_t qf[Tr::Q_IN_REGS ? Tr::NUM_MMA_Q : 1][Tr::Q_IN_REGS ? D / 16 : 1][4];
    for (int i = 0; i < num_tiles; ++i) {
      cp_async_wait<S - 2>();
      __syncthreads();
      if constexpr (V::HAS_QUERY_TRANSFORM) {
        if (i == 0) {
          transform_q();
          __syncthreads();
        }
      }
      if constexpr (Tr::Q_IN_REGS) {
        if (i == 0) {
#pragma unroll
          for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
            for (int kd = 0; kd < D / 16; ++kd) load_q_frag(qf[mq][kd], mq, kd);
        }
      }
      const int next = i + S - 1;
      if (next < num_tiles) issue_kv(next, next % S);
      if (i + 2 * S - 2 < num_tiles) stage_pages(i + 2 * S - 2);
      cp_async_commit();
      compute_tile(i, i % S, st, qf, scale2);
    }
    cp_async_wait<0>();
    __syncthreads();
    finish(st);
    if (nchunks > 1 && last_of_group()) merge_group();
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
