// attnjit/kv_load.cuh: copying Q, K and V tiles (paged or ragged) into shared memory with cp.async, shared by every
// kernel family. A family describes its tiles with a geometry struct G:
//   T (q and the tiles' 16-bit type), TKV (the cache's element type: T, or fp8), HEAD_DIM, GROUP, CTA_Q, CTA_KV,
//   PAGED, PAGE_SIZE, HND, PAGES_PER_TILE, PAGE_RING,
//   LOAD_THREADS (threads that copy, numbered tid = 0..LOAD_THREADS-1), GATHER_PAGE_BASE (gather_page_base: small
//   pages addressed from per-thread bases),
//   Q_PITCH, Q_STEP, KV_PITCH, KV_STEP, KV_GS (the tile layouts, see tile_offset).
// Threads copy 8 to a row: thread tid copies chunks tid % 8 + 8 j (j < HEAD_DIM / 64) of rows tid / 8 + s * RPP
// (RPP = LOAD_THREADS / 8 rows per pass), so 8 neighbouring threads write 8 different bank groups and one address
// serves a row's HEAD_DIM / 64 copies.
//
// Paged KV: page ids of a tile are staged in a shared ring (PAGE_RING tiles of PAGES_PER_TILE ids) by cp.async some
// tiles ahead of the copies that read them, so no thread waits on a page-table load when it issues a tile. Slot k
// of a tile's ring entry holds page page_of(kv0) + k (any page size, attnjit/paged.cuh).
//
// An fp8 cache (TKV of one byte) is copied as stored into a staging tile, byte x of row r at G::stage8_offset(r, x)
// (fa2: rows of KV_ROW_BYTES; sm90: inside the 16-bit tile it becomes; the same 8 threads per row, each
// HEAD_DIM / 8 bytes: 8- or 16-byte copies). The family reads it from there into its mma operands
// (fa2/fp8_frags.cuh), or converts it into the 16-bit swizzled layout the mainloop reads (dequant_rows here, the
// sm90 producer in place).
#pragma once
#include "attnjit/common.cuh"
#include "attnjit/fp8.cuh"
#include "attnjit/paged.cuh"

namespace attnjit {

// Shared-memory tiles are rows of HEAD_DIM elements in 16-byte chunks, XOR-swizzled within groups of 8 chunks
// (128 bytes) so that 8 consecutive rows at one chunk land in 8 different bank groups. Byte offset of chunk c of
// row r:  (r / 8) * GS + (r % 8) * PITCH + (c / 8) * STEP + ((c % 8) ^ (r % 8)) * 16  (GS = 8 * PITCH: r * PITCH).
//   fa2:  PITCH = 2 * HEAD_DIM (a row is contiguous), STEP = 128.
//   sm90: PITCH = 128, STEP = rows * 128: HEAD_DIM / 64 column blocks of [rows][64], which is wgmma's and TMA's
//         128-byte swizzle when the tile is 1024-byte aligned; K/V tiles of paged NHD kernels interleaved
//         (Sm90Traits::KV_INTERLEAVED): STEP = 1024, GS = HEAD_DIM / 64 * 1024, [r / 8][c / 8][r % 8][128 B].
template <int PITCH, int STEP, int GS = 8 * PITCH>
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
  const int r = GS == 8 * PITCH ? row * PITCH : (row >> 3) * GS + (row & 7) * PITCH;
  return static_cast<uint32_t>(r + (chunk >> 3) * STEP + (((chunk & 7) ^ (row & 7)) << 4));
}

// Q rows of item `it` (packed rows packed_row0 .. + CTA_Q) into the tile at shared address `base`; rows past the
// item are zero-filled.
template <typename G, typename Item>
__device__ __forceinline__ void gather_q(const Item& it, uint32_t base, unsigned tid) {
  using T = typename G::T;
  const auto& p = it.p;
  const T* q = reinterpret_cast<const T*>(p.q);
  constexpr int RPP = G::LOAD_THREADS / 8;  // rows one pass of the loading threads covers
  constexpr int CPT = G::HEAD_DIM / 64;     // 16-byte copies per thread per row
  const int c0 = tid % 8, r0 = tid / 8;
  if constexpr (RPP % G::GROUP == 0 && G::CTA_Q % RPP == 0 && G::CTA_Q % G::GROUP == 0) {
    // rows r0 + k * RPP of one thread share a query head and advance by RPP / GROUP tokens: one 64-bit add each
    const int pr0 = it.packed_row0 + r0;
    const T* src0 = q + (it.q_begin + pr0 / G::GROUP) * p.q_stride_n +
                    (static_cast<int64_t>(it.kv_head) * G::GROUP + pr0 % G::GROUP) * p.q_stride_h + c0 * 8;
    const int64_t step = (RPP / G::GROUP) * p.q_stride_n;
    const uint32_t dst0 = base + tile_offset<G::Q_PITCH, G::Q_STEP>(r0, c0);  // rows r0 + k * RPP: same r & 7
#pragma unroll
    for (int k = 0; k < G::CTA_Q / RPP; ++k) {
      const bool valid = pr0 + k * RPP < it.rows_total;
      const T* src = valid ? src0 + k * step : q;
      const uint32_t dst = RPP % 8 == 0 ? dst0 + k * RPP * G::Q_PITCH
                                        : base + tile_offset<G::Q_PITCH, G::Q_STEP>(r0 + k * RPP, c0);
#pragma unroll
      for (int j = 0; j < CPT; ++j) cp_async_16(dst + j * G::Q_STEP, src + j * 64, valid);
    }
  } else {
    for (int r = r0; r < G::CTA_Q; r += RPP) {
      const int pr = it.packed_row0 + r;
      const bool valid = pr < it.rows_total;
      const int64_t tok = it.q_begin + pr / G::GROUP;
      const int64_t h = static_cast<int64_t>(it.kv_head) * G::GROUP + pr % G::GROUP;
      const T* src = valid ? q + tok * p.q_stride_n + h * p.q_stride_h + c0 * 8 : q;
      const uint32_t dst = base + tile_offset<G::Q_PITCH, G::Q_STEP>(r, c0);
#pragma unroll
      for (int j = 0; j < CPT; ++j) cp_async_16(dst + j * G::Q_STEP, src + j * 64, valid);
    }
  }
}

// Apply the variant's query transform to the Q tile in shared memory (once per work item, before use), on
// `nthreads` threads. A thread transforms both chunks of a rotation pair (c and c + CHUNKS/2: dims d and d + D/2),
// two elements (4 bytes) of each at a time, reading both before it writes either, so the in-place transform has no
// race between the halves of a row and holds few registers (it runs beside the live O accumulators).
template <typename G, typename Item>
__device__ __forceinline__ void transform_q_tile(const Item& it, uint8_t* q_tile, unsigned tid, int nthreads) {
  using T = typename G::T;
  constexpr int HALF = G::HEAD_DIM / 16;  // chunks in half a row
#pragma unroll 1
  for (int i = tid; i < G::CTA_Q * HALF; i += nthreads) {
    const int r = i / HALF, c = i % HALF;
    const int pr = it.packed_row0 + r;
    if (pr >= it.rows_total) continue;
    uint32_t* lo = reinterpret_cast<uint32_t*>(q_tile + tile_offset<G::Q_PITCH, G::Q_STEP>(r, c));
    uint32_t* hi = reinterpret_cast<uint32_t*>(q_tile + tile_offset<G::Q_PITCH, G::Q_STEP>(r, c + HALF));
    const int q_pos = it.q_pos_of(pr), qo_head = it.qo_head_of(pr);
#pragma unroll 1
    for (int w = 0; w < 4; ++w) {
      const float2 a = unpack2<T>(lo[w]), b = unpack2<T>(hi[w]);
      float a0 = a.x, a1 = a.y, b0 = b.x, b1 = b.y;
      const int d = c * 8 + 2 * w;
      it.var.query_transform_pair(a0, b0, d, d + G::HEAD_DIM / 2, q_pos, it.qo_len, it.kv_len, it.req, qo_head,
                                  it.kv_head);
      it.var.query_transform_pair(a1, b1, d + 1, d + 1 + G::HEAD_DIM / 2, q_pos, it.qo_len, it.kv_len, it.req,
                                  qo_head, it.kv_head);
      lo[w] = pack2<T>(a0, a1);
      hi[w] = pack2<T>(b0, b1);
    }
  }
}

// Apply the variant's key transform to the K tile at `k_tile` (keys kv0 .. kv0 + CTA_KV - 1, elements of T) in
// shared memory, on `nthreads` threads, pairs as in transform_q_tile but two elements (4 bytes) of each half: it
// runs in the main loop beside the O accumulators, so it must hold few registers. Rows at or past kv_stop are
// zero-filled and hidden: left alone. The caller makes the tile resident before and synchronizes the threads after
// (and, where an async-proxy reader such as wgmma follows, fences the proxies).
template <typename G, typename T = typename G::T, typename Item>
__device__ __forceinline__ void transform_k_tile(const Item& it, uint8_t* k_tile, int kv0, unsigned tid, int nthreads) {
  constexpr int HALF = G::HEAD_DIM / 16;
#pragma unroll 1
  for (int i = tid; i < G::CTA_KV * HALF; i += nthreads) {
    const int r = i / HALF, c = i % HALF;
    const int kv_pos = kv0 + r;
    if (kv_pos >= it.kv_stop) continue;
    uint32_t* lo = reinterpret_cast<uint32_t*>(k_tile + tile_offset<G::KV_PITCH, G::KV_STEP, G::KV_GS>(r, c));
    uint32_t* hi = reinterpret_cast<uint32_t*>(k_tile + tile_offset<G::KV_PITCH, G::KV_STEP, G::KV_GS>(r, c + HALF));
#pragma unroll 1
    for (int w = 0; w < 4; ++w) {
      const float2 a = unpack2<T>(lo[w]), b = unpack2<T>(hi[w]);
      float a0 = a.x, a1 = a.y, b0 = b.x, b1 = b.y;
      const int d = c * 8 + 2 * w;
      it.var.key_transform_pair(a0, b0, d, d + G::HEAD_DIM / 2, kv_pos, it.qo_len, it.kv_len, it.req, it.kv_head);
      it.var.key_transform_pair(a1, b1, d + 1, d + 1 + G::HEAD_DIM / 2, kv_pos, it.qo_len, it.kv_len, it.req,
                                it.kv_head);
      lo[w] = pack2<T>(a0, a1);
      hi[w] = pack2<T>(b0, b1);
    }
  }
}

// Stage the page ids of tile `tile` into its ring slot (cp.async; joins the caller's commit group).
template <typename G, typename Item>
__device__ __forceinline__ void stage_page_ids(const Item& it, int tile, int32_t* ring, unsigned tid) {
  if constexpr (G::PAGED) {
    if (tid < G::PAGES_PER_TILE) {
      const int kv0 = it.kv_begin + tile * G::CTA_KV;
      const int k = static_cast<int>(tid);
      const int page0 = page_of<G::PAGE_SIZE>(kv0);
      // page k starts before kv_stop (nesting pages: kv0 is page-aligned or inside the tile's one page)
      const bool valid = pages_nest(G::CTA_KV, G::PAGE_SIZE) ? kv0 + k * G::PAGE_SIZE < it.kv_stop
                                                             : (page0 + k) * G::PAGE_SIZE < it.kv_stop;
      const int32_t* indices = reinterpret_cast<const int32_t*>(it.p.kv_indices);
      const int32_t* src = indices + it.kv_base + page0 + k;
      const uint32_t dst = smem_u32(ring + (tile % G::PAGE_RING) * G::PAGES_PER_TILE + k);
      cp_async_ca<4>(dst, valid ? src : indices, valid);
    }
  }
}

// Whether a copy pass lies within one page at a page index the compiler knows (pages of at least a pass's rows,
// nesting with the tile): then every thread of pass s reads page (s * RPP) / PAGE_SIZE of the tile, a constant
// index, instead of one page id per row. Other sizes (3, 48, 528 against a 64-token tile) look up each row's page.
template <typename G>
__host__ __device__ constexpr bool pass_in_page() {
  constexpr int RPP = G::LOAD_THREADS / 8;
  return G::PAGED && RPP <= G::PAGE_SIZE && (RPP & (RPP - 1)) == 0 && G::PAGE_SIZE % RPP == 0 &&
         pages_nest(G::CTA_KV, G::PAGE_SIZE);
}

// Whether gather_kv addresses a row of pages smaller than a pass (RPP a multiple of PAGE_SIZE: 1, 2, 4, 8) from
// per-thread bases: the thread's slot in its page is then the same on every pass, so a row's address is the base
// plus its page id times the page stride in bytes (three integer instructions a pass), not the full offset in
// elements, checked and scaled (eleven at page 1, sm_90a). A family opts in with G::GATHER_PAGE_BASE (sm90, where
// its producer has the registers: its copies issue beside the consumers' softmax; fa2 keeps the code it was tuned
// with). Not over an fp8 cache: its producer, which converts the tiles in place, spilled 16 bytes with the bases
// live (page 1, sm_90a).
template <typename G>
__host__ __device__ constexpr bool gather_page_base() {
  constexpr int RPP = G::LOAD_THREADS / 8;
  return G::GATHER_PAGE_BASE && G::PAGED && G::PAGE_SIZE < RPP && RPP % G::PAGE_SIZE == 0 &&
         sizeof(typename G::TKV) == 2;
}

// The page ids of a tile's copy passes, read from the shared ring that stage_page_ids fills.
template <typename G>
struct RingPageIds {
  const int32_t* pages;  // the tile's ring slot
  int kv0, r0;           // the tile's first key, the thread's first row
  __device__ __forceinline__ int operator()(int s) const {
    constexpr int RPP = G::LOAD_THREADS / 8;
    if constexpr (pass_in_page<G>()) return pages[page_of<G::PAGE_SIZE>(s * RPP)];
    return pages[page_of<G::PAGE_SIZE>(kv0 + r0 + s * RPP) - page_of<G::PAGE_SIZE>(kv0)];
  }
};

// The page ids of a tile's copy passes, in registers (load_page_ids fills them straight from the page table).
template <int PASSES>
struct RegPageIds {
  int ids[PASSES];
  __device__ __forceinline__ int operator()(int s) const { return ids[s]; }
};

// Load the page id of each of this thread's copy passes of tile `tile` (0 where the pass has no visible row).
template <typename G, typename Item, int PASSES>
__device__ __forceinline__ void load_page_ids(const Item& it, int tile, RegPageIds<PASSES>& out, unsigned tid) {
  if constexpr (G::PAGED) {
    constexpr int RPP = G::LOAD_THREADS / 8;
    const int32_t* indices = reinterpret_cast<const int32_t*>(it.p.kv_indices) + it.kv_base;
    const int kv0 = it.kv_begin + tile * G::CTA_KV;
#pragma unroll
    for (int s = 0; s < PASSES; ++s) {
      const int j = pass_in_page<G>() ? kv0 + s * RPP : kv0 + static_cast<int>(tid / 8) + s * RPP;
      out.ids[s] = j < it.kv_stop ? __ldg(indices + page_of<G::PAGE_SIZE>(j)) : 0;
    }
  }
}

// Copy K and V rows of tile `tile` into the tiles at shared addresses ks / vs, reading page ids from page_id(s)
// (RingPageIds or RegPageIds). Rows past kv_stop are zero-filled (src-size 0): hidden keys must still have finite V.
// LOAD_K / LOAD_V: which of the two to copy (a producer that feeds K and V through separate rings copies one).
// fp8: ks / vs are staging tiles, byte x of row r at G::stage8_offset(r, x).
template <typename G, bool LOAD_K = true, bool LOAD_V = true, typename Item, typename PageIds>
__device__ __forceinline__ void gather_kv(const Item& it, int tile, uint32_t ks, uint32_t vs, const PageIds& page_id,
                                          unsigned tid) {
  using TKV = typename G::TKV;
  constexpr int D = G::HEAD_DIM;
  constexpr int RPP = G::LOAD_THREADS / 8;
  constexpr int PASSES = G::CTA_KV / RPP;
  constexpr bool FP8 = is_fp8<TKV>::value;
  // 16-bit: CPT 16-byte copies of 8 elements per thread and row; fp8: CPT copies of CB bytes (8 threads x D / 8)
  constexpr int CB = FP8 ? (D / 8 >= 16 ? 16 : D / 8) : 16;
  constexpr int CPT = FP8 ? D / 8 / CB : D / 64;
  constexpr int COL = FP8 ? CB : 8;  // elements from one thread's first column to its neighbour's
  static_assert(G::CTA_KV % RPP == 0, "the kv tile must be a whole number of copy passes");
  static_assert(sizeof(TKV) == 2 || (FP8 && (CB == 8 || CB == 16)), "KV elements are 16-bit or fp8");
  const auto& p = it.p;
  const TKV* k = reinterpret_cast<const TKV*>(p.k);
  const TKV* v = reinterpret_cast<const TKV*>(p.v);
  const int kv0 = it.kv_begin + tile * G::CTA_KV;
  const int c0 = tid % 8;
  const int r0 = static_cast<int>(tid) / 8;
  // rows r0 + s * RPP: same r & 7 (c0 < 8: no column block)
  const uint32_t dst0 = G::KV_GS == 8 * G::KV_PITCH ? r0 * G::KV_PITCH + ((c0 ^ (r0 & 7)) << 4)
                                                    : tile_offset<G::KV_PITCH, G::KV_STEP, G::KV_GS>(r0, c0);
  // paged, a pass within one page: pass s reads page id (s * RPP) / PAGE_SIZE of the tile (a constant index)
  // at slot slot0 + r0 + (s * RPP) % PAGE_SIZE. Invalid rows keep an in-bounds address: their page id is 0 (the
  // ring's are zero-filled when staged), or the tile's own page.
  constexpr bool PASS_IN_PAGE = pass_in_page<G>();
  int64_t thread_off = 0, slot_stride = 0;
  if constexpr (PASS_IN_PAGE) {
    slot_stride = G::HND ? D : p.kv_stride_1;
    const int64_t head_stride = G::HND ? p.kv_stride_1 : D;
    const int slot0 = G::PAGE_SIZE > G::CTA_KV ? slot_of<G::PAGE_SIZE>(kv0) : 0;
    thread_off = (slot0 + r0) * slot_stride + it.kv_head * head_stride + c0 * COL;
  } else if constexpr (!G::PAGED) {
    thread_off = (it.kv_base + kv0 + r0) * p.kv_stride_0 + static_cast<int64_t>(it.kv_head) * p.kv_stride_1 + c0 * COL;
  }
  // gather_page_base: the thread's row in page 0 (its slot, kv head and columns), in bytes from k and from v; a
  // pass adds its page id (>= 0 and in the cache: plan() and run() check the table; on rows past kv_stop 0 or a
  // valid page, so in bounds) times the stride
  const char *kb = nullptr, *vb = nullptr;
  uint64_t page_bytes = 0;
  if constexpr (gather_page_base<G>()) {
    const int64_t row = paged_offset<G::HND, D>(0, slot_of<G::PAGE_SIZE>(kv0 + r0), it.kv_head, 0, p.kv_stride_1);
    kb = reinterpret_cast<const char*>(k + row + c0 * COL);
    vb = reinterpret_cast<const char*>(v + row + c0 * COL);
    page_bytes = static_cast<uint64_t>(p.kv_stride_0) * sizeof(TKV);
    // opaque to the compiler, which would otherwise fold the bytes back into elements (a multiply-add in elements
    // and a scaled add of the base: five instructions a pass where these take three)
    asm("mov.b64 %0, %0;" : "+l"(page_bytes));
    asm("mov.b64 %0, %0;" : "+l"(kb));
    asm("mov.b64 %0, %0;" : "+l"(vb));
  }
  const int rows_left = it.kv_stop - kv0 - r0;  // row r0 + s * RPP is valid while s * RPP < rows_left
#pragma unroll
  for (int s = 0; s < PASSES; ++s) {
    const int r = r0 + s * RPP;
    const bool valid = gather_page_base<G>() ? s * RPP < rows_left : kv0 + r < it.kv_stop;
    int64_t off = 0;
    const TKV *kr = nullptr, *vr = nullptr;  // gather_page_base: the row's first element, in k and in v
    if constexpr (gather_page_base<G>()) {
      const uint64_t at = static_cast<uint64_t>(static_cast<uint32_t>(page_id(s))) * page_bytes;
      kr = reinterpret_cast<const TKV*>(kb + at);
      vr = reinterpret_cast<const TKV*>(vb + at);
    } else if constexpr (PASS_IN_PAGE) {
      const int page = page_id(s);
      off = page * p.kv_stride_0 + thread_off + slot_of<G::PAGE_SIZE>(s * RPP) * slot_stride;
    } else if constexpr (G::PAGED) {
      const int j = kv0 + r;
      const int page = page_id(s);
      off = paged_offset<G::HND, D>(page, slot_of<G::PAGE_SIZE>(j), it.kv_head, p.kv_stride_0, p.kv_stride_1);
      off = valid ? off + c0 * COL : 0;
    } else {
      off = valid ? thread_off + static_cast<int64_t>(s * RPP) * p.kv_stride_0 : 0;
    }
    if constexpr (!gather_page_base<G>()) {
      kr = k + off;
      vr = v + off;
    }
    if constexpr (FP8) {
#pragma unroll
      for (int j = 0; j < CPT; ++j) {  // copy j: bytes (c0 + 8 j) * CB of the row
        const uint32_t dst = G::stage8_offset(r, (c0 + 8 * j) * CB);
        if constexpr (CB == 16) {
          if constexpr (LOAD_K) cp_async_16(ks + dst, kr + j * 8 * CB, valid);
          if constexpr (LOAD_V) cp_async_16(vs + dst, vr + j * 8 * CB, valid);
        } else {
          if constexpr (LOAD_K) cp_async_ca<8>(ks + dst, kr + j * 8 * CB, valid);
          if constexpr (LOAD_V) cp_async_ca<8>(vs + dst, vr + j * 8 * CB, valid);
        }
      }
    } else {
      const uint32_t dst = RPP % 8 == 0 ? dst0 + s * (RPP / 8) * G::KV_GS
                                        : tile_offset<G::KV_PITCH, G::KV_STEP, G::KV_GS>(r, c0);
#pragma unroll
      for (int j = 0; j < CPT; ++j) {
        if constexpr (LOAD_K) cp_async_16(ks + dst + j * G::KV_STEP, kr + j * 64, valid);
        if constexpr (LOAD_V) cp_async_16(vs + dst + j * G::KV_STEP, vr + j * 64, valid);
      }
    }
  }
}

// Convert rows row0 .. row0 + ROWS - 1 of a staged fp8 tile (byte x of row r at G::stage8_offset) into the 16-bit tile `dst` in
// the family's swizzled layout, on THREADS threads (tid < THREADS). A thread reads 8 bytes and writes one 16-byte
// chunk: 8 neighbouring threads read 64 contiguous bytes and write the 8 chunks of one row's 128-byte group (distinct
// banks). UNROLL: chunks in flight per thread (few where the caller holds many live registers).
template <typename G, int ROWS, int THREADS, int UNROLL, typename T = typename G::T>
__device__ __forceinline__ void dequant_rows(const uint8_t* src, uint8_t* dst, int row0, unsigned tid) {
  using TKV = typename G::TKV;
  constexpr int CH = G::HEAD_DIM / 8;  // 8-element chunks per row
  static_assert((ROWS * CH) % THREADS == 0, "every thread converts the same number of chunks");
#pragma unroll UNROLL
  for (int n = 0; n < ROWS * CH / THREADS; ++n) {
    const int i = static_cast<int>(tid) + n * THREADS;
    const int r = row0 + i / CH, c = i % CH;
    const uint2 raw = *reinterpret_cast<const uint2*>(src + G::stage8_offset(r, c * 8));
    *reinterpret_cast<uint4*>(dst + tile_offset<G::KV_PITCH, G::KV_STEP, G::KV_GS>(r, c)) = fp8x8_to<T, TKV>(raw);
  }
}

// Rows row_begin .. row_begin + ROWS - 1 of a bf16 Q tile (the family's layout) into fp16 in place, each row times
// 2^e, e chosen so the row's largest |q| lies in [2^14, 2^15) (fa2/fp8_frags.cuh gives the numerics); row_inv[r] =
// 2^-e of row r. THREADS threads (tid < THREADS), TPR per row (a power of two <= 8, within one warp), each convert
// HEAD_DIM / 8 / TPR 16-byte chunks; threads past ROWS * TPR have no row.
template <typename G, int ROWS, int THREADS, int TPR>
__device__ __forceinline__ void q_rows_to_half_rows(uint8_t* tile, float* row_inv, int row_begin, unsigned tid) {
  constexpr int CH = G::HEAD_DIM / 8;
  constexpr int PER = CH / TPR;
  // every pass covers whole rows, and a warp's lanes all convert rows or all skip (the shuffles)
  static_assert(TPR >= 1 && TPR <= 8 && (TPR & (TPR - 1)) == 0 && CH % TPR == 0, "TPR: 1, 2, 4 or 8 per row");
  static_assert((ROWS * TPR) % 32 == 0 && (ROWS * TPR <= THREADS || (ROWS * TPR) % THREADS == 0),
                "whole rows per pass");
#pragma unroll 1
  for (int row = row_begin + static_cast<int>(tid) / TPR; row < row_begin + ROWS; row += THREADS / TPR) {
    const auto chunk = [&](int j) {
      return reinterpret_cast<uint4*>(tile + tile_offset<G::Q_PITCH, G::Q_STEP>(row, tid % TPR + TPR * j));
    };
    float mx = 0.f;
#pragma unroll 4
    for (int j = 0; j < PER; ++j) {
      const uint4 raw = *chunk(j);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = unpack2<__nv_bfloat16>(w[k]);
        mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));  // NaN is skipped here and stays NaN below
      }
    }
#pragma unroll
    for (int off = TPR / 2; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    int ex = 0;
    frexpf(mx, &ex);                                                              // mx = m 2^ex, m in [0.5, 1)
    const int e = mx > 0.f && mx <= 3.0e38f ? min(max(15 - ex, -126), 126) : 0;  // 0: an all-zero or inf row
    const float up = ldexpf(1.f, e);
#pragma unroll 4
    for (int j = 0; j < PER; ++j) {
      const uint4 raw = *chunk(j);
      uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = unpack2<__nv_bfloat16>(w[k]);
        w[k] = pack2<__half>(f.x * up, f.y * up);
      }
      *chunk(j) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (tid % TPR == 0) row_inv[row] = ldexpf(1.f, -e);
  }
}

}  // namespace attnjit
