// attnjit/sm90/tma.cuh: the sm90 family's TMA copies (cp.async.bulk.tensor): the producer's Q tiles, and K/V tiles
// where a tile is whole boxes of contiguous rows (a ragged cache, or pages of a multiple of 16 tokens that nest with
// the tile); the consumers' output rows, where a warpgroup's 64 rows all belong to the request.
//
// The host encodes one CUtensorMap per tensor (attnjit/tma.py, the driver's cuTensorMapEncodeTiled) into the
// kernel's parameter struct (a __grid_constant__, so the descriptors' addresses are valid for the copies) and sets
// tma_flags where each one is usable for this run; else the producer copies with cp.async, as without TMA.
//   Q:   3-D {d, qo head, token}; box {64, GROUP, CTA_Q / GROUP}: the box's 128-byte lines are packed rows
//        (token-major, GROUP heads each), which is the Q tile's row order when an item starts on a token.
//   K/V: paged 4-D {d, kv head, slot, page} (NHD) or {d, slot, kv head, page} (HND); ragged 3-D {d, kv head,
//        token}: the dims in memory order (each stride nests the ones below it); a box is TMA_ROWS rows (tokens)
//        of one head. Interleaved tiles (Sm90Traits::KV_INTERLEAVED: paged NHD, pages of 16k tokens smaller than
//        the tile): 5-D {d % 64, slot % 8, kv head x 64-column block, slot / 8, page}, one box a page with all of
//        its column blocks, landing in the tile's 8-row groups (a page of 16 tokens at d 128: one 4 KB box, not
//        two of 2 KB).
//   O:   3-D {d, qo head, token} as Q; box {64, GROUP, WG_ROWS / GROUP}: one consumer warpgroup's rows, staged
//        in its rows of the Q tile (the epilogue's layout is the Q tile's). A box writes every row it covers (the
//        TMA unit clips only at the tensor's end), so only a warpgroup whose rows all lie inside the request
//        stores by TMA; the request's last, partial rows take the 16-byte stores.
// Every box is written with the 128-byte swizzle, which is the tile layout the wgmma descriptors read
// (attnjit/kv_load.cuh tile_offset) when the box lands 1024-byte aligned: box j of a tile at j * TMA_ROWS * 128
// bytes (interleaved tiles: j * TMA_ROWS / 8 * KV_GS), so TMA_ROWS is a multiple of 8. Out-of-range rows are
// zero-filled by the TMA unit, but the producer only takes TMA for a K/V tile whose rows all hold the request's data
// (rows past kv_stop but before kv_len are the request's own keys: finite, hidden by the mask, P = 0 for them); a
// tile reaching past kv_len is copied with cp.async, whose zero fill keeps hidden values finite.
#pragma once
#include <cstddef>

#include "attnjit/common.cuh"
#include "attnjit/kv_load.cuh"
#include "attnjit/sm90/wgmma.cuh"

namespace attnjit {

// A CUtensorMap: 128 opaque bytes, 64-byte aligned (cuda.h's CUtensorMap_st), filled by the host.
struct alignas(64) TensorMap {
  uint64_t opaque[16];
};

namespace sm90 {

// tma_flags bits (attnjit/tma.py FLAG_*)
constexpr int64_t kTmaKV = 1, kTmaQ = 2, kTmaO = 4;

// Whether traits Tr can copy Q / K / V tiles with TMA (the spec's part; the run's part is tma_flags).
template <typename Tr>
__host__ __device__ constexpr bool tma_q() {
  return !Tr::FP8_KV && Tr::CTA_Q % Tr::GROUP == 0 && Tr::GROUP <= 256 && Tr::CTA_Q / Tr::GROUP <= 256;
}
template <typename Tr>
__host__ __device__ constexpr bool tma_o() {  // the output's box: a warpgroup's rows, whole tokens, 16-bit
  return tma_q<Tr>() && Tr::WG_ROWS % Tr::GROUP == 0 && sizeof(typename Tr::TO) == 2;
}
template <typename Tr>
__host__ __device__ constexpr int tma_rows() {  // rows (tokens) of one K/V box
  return Tr::PAGED && Tr::PAGE_SIZE < Tr::CTA_KV ? Tr::PAGE_SIZE : Tr::CTA_KV;
}
template <typename Tr>
__host__ __device__ constexpr bool tma_kv() {
  // paged: pages nest with the tile and the cp.async loader's passes (its fallback tiles read pass page ids)
  return !Tr::FP8_KV && tma_rows<Tr>() % 8 == 0 && (!Tr::PAGED || pass_in_page<Tr>());
}

// Whether a TMA kernel's V tiles are gathered by the producer's cp.async while its K tiles come by TMA: where a tile
// is several boxes (pages smaller than the tile: 16 boxes of 16 rows a tile at page 16), the TMA unit delivers them
// slower than the consumers use them. (Run 128, H100: a ragged kernel made to copy 16-row boxes ran causal 8x2048 at
// 544 TFLOP/s against 585 with whole-tile boxes, which is where the paged kernel ran; computing the page ids instead
// of reading them gained 1%.) Split between the two paths, each carries half the tile: run 129 (H100, causal, page
// 16) 8x2048 547 TFLOP/s against 533 with V by TMA, 1x8192 596 against 572, 32x512 345 against 332. Interleaved
// tiles (Tr::KV_INTERLEAVED) take a box a page with all of its column blocks, half as many boxes of twice the
// bytes, and there V by TMA wins: run 147 (H100) 8x2048 583 against 565 with V gathered, 1x8192 656 against 630,
// 32x512 391 against 380.
template <typename Tr>
__host__ __device__ constexpr bool tma_v_gather() {
  return tma_kv<Tr>() && Tr::PAGED && tma_rows<Tr>() < Tr::CTA_KV && !Tr::KV_INTERLEAVED;
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void tma_prefetch(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3)
      : "memory");
}

__device__ __forceinline__ void tma_load_5d(uint32_t dst, const TensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], "
      "[%2];\n" ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3), "r"(c4)
      : "memory");
}

__device__ __forceinline__ void tma_store_3d(const TensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// The item's output rows [row0, row0 + WG_ROWS), staged at shared address src (their rows of the Q tile), by one
// thread, after every thread that staged them fenced its writes for the async proxy and met it at a barrier. The
// staging rows may be written again (the Q tile handed back to the producer) only after tma_o_read; the global
// writes complete on their own (nothing in the kernel reads them).
template <typename Tr, typename Item>
__device__ __forceinline__ void tma_o_rows(const Item& it, const TensorMap* map, uint32_t src, int row0) {
  const int head = it.kv_head * Tr::GROUP;
  const int tok = static_cast<int>(it.q_begin) + (it.packed_row0 + row0) / Tr::GROUP;
#pragma unroll
  for (int c = 0; c < Tr::HEAD_DIM / 64; ++c) tma_store_3d(map, src + c * Tr::Q_STEP, c * 64, head, tok);
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until the TMA unit has read the staging rows of this thread's stores.
__device__ __forceinline__ void tma_o_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// The item's Q tile at shared address dst, completing on `bar` (one thread: it also arrives with the bytes).
template <typename Tr, typename Item>
__device__ __forceinline__ void tma_q_tile(const Item& it, const TensorMap* map, uint32_t dst, uint64_t* bar) {
  mbar_arrive_expect_tx(bar, Tr::Q_BYTES);
  const int head = it.kv_head * Tr::GROUP;
  const int tok = static_cast<int>(it.q_begin) + it.packed_row0 / Tr::GROUP;
#pragma unroll
  for (int c = 0; c < Tr::HEAD_DIM / 64; ++c) tma_load_3d(dst + c * Tr::Q_STEP, map, bar, c * 64, head, tok);
}

// Whether tile `tile` of the item is copied by TMA: every row holds the request's data (see the top).
template <typename Tr, typename Item>
__device__ __forceinline__ bool tma_tile(const Item& it, int64_t flags, int tile) {
  if constexpr (!tma_kv<Tr>()) return false;
  return (flags & kTmaKV) && it.kv_begin + (tile + 1) * Tr::CTA_KV <= it.kv_len;
}

// The box of a K/V tile that producer thread tid issues (and holds the page id of): box j by lane j / 4 of warp
// j % 4, so a tile's boxes are issued from all four producer warps at once, not one after another from one warp.
// (Run 129, H100, causal, V gathered: page 16's 8 boxes a column block from four warps ran 8x2048 at 563 TFLOP/s
// against 547 from one warp, 1x8192 602 against 596.)
__device__ __forceinline__ int tma_box_of(unsigned tid) { return static_cast<int>((tid % 32) * 4 + tid / 32); }

// A TMA kernel's page ids: the thread of box j (tma_box_of) holds box j's page of a tile (one register a tile, where
// the cp.async loader's RegPageIds hold a tile's passes in every thread). Ragged: none.
template <typename Tr, typename Item>
__device__ __forceinline__ int lane_page_id(const Item& it, int tile, unsigned tid) {
  if constexpr (!Tr::PAGED) {
    return 0;
  } else {
    constexpr int ROWS = tma_rows<Tr>();
    const int box = tma_box_of(tid);
    const int j = it.kv_begin + tile * Tr::CTA_KV + box * ROWS;  // the box's first row
    const int32_t* indices = reinterpret_cast<const int32_t*>(it.p.kv_indices) + it.kv_base;
    return box < Tr::CTA_KV / ROWS && j < it.kv_len ? __ldg(indices + page_of<Tr::PAGE_SIZE>(j)) : 0;
  }
}

// K or V tile `tile` at shared address dst, completing on `bar`, by the producer warpgroup: thread 0 arrives with
// the tile's bytes, the thread of box j < boxes (tma_box_of) issues box j (page: its lane_page_id) of every
// 64-column block, every other thread arrives. (A box may land before thread 0's arrival sets the bytes to expect:
// the barrier's transaction count may go below zero meanwhile, and its phase cannot complete before thread 0 has
// arrived.) Paged pages of a tile: whole pages (kv0 is page-aligned) or one page's rows (kv0 % PAGE_SIZE).
template <typename Tr, typename Item>
__device__ __forceinline__ void tma_kv_tile(const Item& it, const TensorMap* map, uint32_t dst, uint64_t* bar,
                                            int tile, int page, unsigned tid) {
  constexpr int ROWS = tma_rows<Tr>();
  constexpr int BOXES = Tr::CTA_KV / ROWS;
  static_assert(BOXES <= 128, "a box per producer thread");
  if (tid == 0) mbar_arrive_expect_tx(bar, Tr::KV_BYTES);
  else mbar_arrive(bar);
  const int j = tma_box_of(tid);
  if constexpr (Tr::KV_INTERLEAVED) {
    // one box a page: {64, 8 rows, BLOCKS column blocks, ROWS / 8 row groups, 1 page} of the 5-D map
    // {d, slot % 8, kv head x column block, slot / 8, page} (attnjit/tma.py), landing as the page's row groups
    static_assert(ROWS == Tr::PAGE_SIZE && ROWS % 8 == 0, "interleaved tiles are whole pages of 8-row groups");
    if (j < BOXES) tma_load_5d(dst + j * (ROWS / 8) * Tr::KV_GS, map, bar, 0, 0, it.kv_head * Tr::BLOCKS, 0, page);
  } else if (j < BOXES) {
    const int kv0 = it.kv_begin + tile * Tr::CTA_KV;
    const uint32_t to = dst + j * ROWS * 128;
#pragma unroll
    for (int c = 0; c < Tr::HEAD_DIM / 64; ++c) {
      if constexpr (Tr::PAGED) {
        const int slot = Tr::PAGE_SIZE > Tr::CTA_KV ? kv0 % Tr::PAGE_SIZE : 0;
        if constexpr (Tr::HND) tma_load_4d(to + c * Tr::KV_STEP, map, bar, c * 64, slot, it.kv_head, page);
        else tma_load_4d(to + c * Tr::KV_STEP, map, bar, c * 64, it.kv_head, slot, page);
      } else {
        tma_load_3d(to + c * Tr::KV_STEP, map, bar, c * 64, it.kv_head, static_cast<int>(it.kv_base) + kv0);
      }
    }
  }
}

}  // namespace sm90
}  // namespace attnjit
