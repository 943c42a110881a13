// attnjit/append_kv.cuh: write new tokens' K and V into their pages.
//
// Token i of the append batch belongs to request batch_indices[i] at position positions[i] (its index in
// that request's KV sequence, counted from 0). It lands at page kv_indices[kv_indptr[b] + pos / PAGE_SIZE],
// slot pos % PAGE_SIZE. A token whose position falls outside the request's pages (or whose page-table entry lies
// outside kv_indices, or whose page id is outside the cache) is not written: the kernel never reads or writes out
// of bounds (validate on the host with check=True, which raises instead).
#pragma once
#include "attnjit/common.cuh"
#include "attnjit/paged.cuh"

namespace attnjit {

// One thread per 16 bytes (8 16-bit or 16 fp8 elements) of one (token, head) row of K and of V. T is the cache's
// element type; the new keys and values have the same type (an fp8 cache takes fp8 tokens, quantized by the caller).
template <typename T, int HEAD_DIM, int PAGE_SIZE, bool HND, typename P>
__device__ __forceinline__ void append_kv_body(const P& p) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16 bytes
  constexpr int VEC_PER_ROW = HEAD_DIM / VEC;
  static_assert(HEAD_DIM % VEC == 0, "a row is whole 16-byte vectors");
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t token_head = tid / VEC_PER_ROW;
  const int vec = static_cast<int>(tid % VEC_PER_ROW);
  if (token_head >= p.nnz * p.num_heads) return;
  const int64_t token = token_head / p.num_heads;
  const int head = static_cast<int>(token_head % p.num_heads);
  const int b = reinterpret_cast<const int32_t*>(p.batch_indices)[token];
  const int pos = reinterpret_cast<const int32_t*>(p.positions)[token];
  if (b < 0 || b >= p.batch_size || pos < 0) return;
  const int32_t* indptr = reinterpret_cast<const int32_t*>(p.kv_indptr);
  const int64_t iter = indptr[b] + page_of<PAGE_SIZE>(pos);  // any page size 1..1024 (attnjit/paged.cuh)
  // an indptr past kv_indices' ends (check=False reads none of it on the host) would read a stray id, which could
  // name another request's page: such a token is not written
  if (iter >= indptr[b + 1] || iter < 0 || iter >= p.num_indices) return;
  const int64_t page = reinterpret_cast<const int32_t*>(p.kv_indices)[iter];
  if (page < 0 || page >= p.num_pages) return;
  const int64_t dst = paged_offset<HND, HEAD_DIM>(page, slot_of<PAGE_SIZE>(pos), head, p.cache_stride_page,
                                                  p.cache_stride_inner) + vec * VEC;
  const int64_t src_k = token * p.k_stride_n + head * p.k_stride_h + vec * VEC;
  const int64_t src_v = token * p.v_stride_n + head * p.v_stride_h + vec * VEC;
  const uint4 k = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(p.k) + src_k);
  const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(p.v) + src_v);
  *reinterpret_cast<uint4*>(reinterpret_cast<T*>(p.k_cache) + dst) = k;
  *reinterpret_cast<uint4*>(reinterpret_cast<T*>(p.v_cache) + dst) = v;
}

}  // namespace attnjit
