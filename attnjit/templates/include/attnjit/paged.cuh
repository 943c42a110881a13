// attnjit/paged.cuh: addressing a paged KV cache.
//
// A cache is [num_pages, page_size, H_kv, D] (NHD) or [num_pages, H_kv, page_size, D] (HND) per K and V; the
// K and V of one 5-D tensor [num_pages, 2, ...] are two such views with a doubled page stride. Token j of a
// request lives at page indices[indptr[req] + j / PAGE_SIZE], slot j % PAGE_SIZE (page order is logical order).
//
// PAGE_SIZE is a compile-time constant from 1 to 1024, not necessarily a power of two (vLLM's hybrid models use
// sizes such as 528). page_of / slot_of divide by it: a shift and a mask for a power of two (the code the loaders
// were tuned with), an unsigned multiply-high and a shift otherwise. A KV tile of CTA_KV tokens (a power of two,
// starting at a multiple of CTA_KV) either holds whole pages, lies within one page, or, when neither divides the
// other (48 or 528 against 64), starts mid-page and spans up to pages_per_tile() pages.
#pragma once
#include <stdint.h>

namespace attnjit {

// Element offset of (page, slot, head, 0). `stride_page` and `stride_inner` are run-time strides in elements:
// stride_inner is the slot stride for NHD (H_kv * D when contiguous) and the head stride for HND
// (page_size * D when contiguous); the innermost of (slot, head) has stride HEAD_DIM.
template <bool HND, int HEAD_DIM>
__device__ __forceinline__ int64_t paged_offset(int64_t page, int slot, int head, int64_t stride_page,
                                                int64_t stride_inner) {
  if constexpr (HND) {
    return page * stride_page + head * stride_inner + static_cast<int64_t>(slot) * HEAD_DIM;
  } else {
    return page * stride_page + slot * stride_inner + static_cast<int64_t>(head) * HEAD_DIM;
  }
}

__host__ __device__ constexpr int ilog2(int x) { return x <= 1 ? 0 : 1 + ilog2(x / 2); }

__host__ __device__ constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// The page and the slot of logical token j >= 0.
template <int PAGE_SIZE>
__device__ __forceinline__ int page_of(int j) {
  if constexpr (is_pow2(PAGE_SIZE)) return j >> ilog2(PAGE_SIZE);
  else return static_cast<int>(static_cast<unsigned>(j) / static_cast<unsigned>(PAGE_SIZE));
}
template <int PAGE_SIZE>
__device__ __forceinline__ int slot_of(int j) {
  if constexpr (is_pow2(PAGE_SIZE)) return j & (PAGE_SIZE - 1);
  else return static_cast<int>(static_cast<unsigned>(j) % static_cast<unsigned>(PAGE_SIZE));
}

// Whether tiles of cta_kv tokens and pages nest (one divides the other).
__host__ __device__ constexpr bool pages_nest(int cta_kv, int page_size) {
  return cta_kv % page_size == 0 || page_size % cta_kv == 0;
}

// Page ids a tile of cta_kv tokens starting at a multiple of cta_kv can touch: cta_kv / page_size whole pages, or
// one page holding the tile, or (neither divides the other) up to (cta_kv - 1) / page_size + 2 (a tile that starts
// mid-page crosses ceil((cta_kv - 1) / page_size) page boundaries at most). fa2.Tile.smem has the same formula.
__host__ __device__ constexpr int pages_per_tile(int cta_kv, int page_size) {
  return cta_kv % page_size == 0 ? cta_kv / page_size
         : page_size % cta_kv == 0 ? 1
                                    : (cta_kv - 1) / page_size + 2;
}

}  // namespace attnjit
