// attnjit/paged.cuh: addressing a paged KV cache.
//
// A cache is [num_pages, page_size, H_kv, D] (NHD) or [num_pages, H_kv, page_size, D] (HND) per K and V; the
// K and V of one 5-D tensor [num_pages, 2, ...] are two such views with a doubled page stride. Token j of a
// request lives at page indices[indptr[req] + j / PAGE_SIZE], slot j % PAGE_SIZE (page order is logical order).
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

}  // namespace attnjit
