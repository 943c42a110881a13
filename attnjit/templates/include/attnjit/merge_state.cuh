// attnjit/merge_state.cuh: combining attention states (o, lse) over disjoint key sets.
//
// A state is (o, lse) with o the softmax-weighted value average over its keys and lse = log2(sum_j exp(s_j))
// (base 2). Merging normalizes the weights before combining, so no intermediate overflows:
//   m = max_i lse_i;  w_i = 2^(lse_i - m);  z = sum_i w_i;  o = sum_i (w_i / z) o_i;  lse = m + log2(z).
// An empty key set is (0, -inf); merging with it is the identity, and merging only empty sets gives (0, -inf). A
// state whose lse is NaN (a NaN input, an invalid logits_scale: row_lse) makes the merge NaN, o and lse, never
// the empty set's (0, -inf) that the max alone (fmaxf drops a NaN) would give when every state is NaN.
#pragma once
#include "attnjit/common.cuh"

namespace attnjit {

// Merges n states for 8 consecutive elements of o: lse_at(i) is state i's lse, load(i, float[8]) reads its o.
// Writes the merged o to out8 and returns the merged lse. An empty state's o (lse -inf) is never read; every other
// state's is, however small its weight.
template <typename LseFn, typename LoadFn>
__device__ __forceinline__ float merge_n(int64_t n, LseFn lse_at, LoadFn load, float* out8) {
#pragma unroll
  for (int e = 0; e < 8; ++e) out8[e] = 0.f;
  float m = neg_inf();
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float l = lse_at(i);
    m = fmaxf(m, l);
    nan |= l != l;
  }
  if (nan) {
#pragma unroll
    for (int e = 0; e < 8; ++e) out8[e] = __int_as_float(0x7fffffff);
    return __int_as_float(0x7fffffff);
  }
  if (m == neg_inf()) return neg_inf();
  float z = 0.f;
  for (int64_t i = 0; i < n; ++i) z += exp2f(lse_at(i) - m);
  const float inv_z = 1.f / z;
  for (int64_t i = 0; i < n; ++i) {
    const float l = lse_at(i);
    if (l == neg_inf()) continue;  // an empty state; a finite one whose weight underflows to 0 is still read, so
    const float w = exp2f(l - m) * inv_z;  // a NaN in its o reaches the sum (0 * NaN), as in the split merges
    float v[8];
    load(i, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) out8[e] += w * v[e];
  }
  return m + log2f(z);
}

// One thread per 8 elements of one (row, head). Returns false for threads past the end.
template <int HEAD_DIM>
__device__ __forceinline__ bool merge_thread_coords(int64_t num_rows, int64_t num_heads, int64_t& row,
                                                    int64_t& head, int& vec) {
  constexpr int VEC_PER_ROW = HEAD_DIM / 8;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row_head = tid / VEC_PER_ROW;
  vec = static_cast<int>(tid % VEC_PER_ROW);
  if (row_head >= num_rows * num_heads) return false;
  row = row_head / num_heads;
  head = row_head % num_heads;
  return true;
}

// v_out = merge(v_a, v_b) per (row, head); v_out may alias v_a (in-place merge). mask (optional, one bool per
// row): rows with mask[row] == false are left untouched.
template <typename T, int HEAD_DIM, typename P>
__device__ __forceinline__ void merge_two_body(const P& p) {
  int64_t row, head;
  int vec;
  if (!merge_thread_coords<HEAD_DIM>(p.num_rows, p.num_heads, row, head, vec)) return;
  if (p.mask != 0 && !reinterpret_cast<const bool*>(p.mask)[row]) return;
  const float la = reinterpret_cast<const float*>(p.lse_a)[row * p.lse_a_stride_n + head * p.lse_a_stride_h];
  const float lb = reinterpret_cast<const float*>(p.lse_b)[row * p.lse_b_stride_n + head * p.lse_b_stride_h];
  const T* va = reinterpret_cast<const T*>(p.v_a) + row * p.v_a_stride_n + head * p.v_a_stride_h + vec * 8;
  const T* vb = reinterpret_cast<const T*>(p.v_b) + row * p.v_b_stride_n + head * p.v_b_stride_h + vec * 8;
  float out[8];
  const float lse = merge_n(
      2, [&](int64_t i) { return i == 0 ? la : lb; }, [&](int64_t i, float* v) { load8<T>(i == 0 ? va : vb, v); },
      out);
  store8<T>(reinterpret_cast<T*>(p.v_out) + row * p.v_out_stride_n + head * p.v_out_stride_h + vec * 8, out);
  if (vec == 0) reinterpret_cast<float*>(p.lse_out)[row * p.lse_out_stride_n + head * p.lse_out_stride_h] = lse;
}

// v: [rows, num_states, heads, D], lse: [rows, num_states, heads] -> v_out [rows, heads, D], lse_out [rows, heads]
template <typename T, int HEAD_DIM, typename P>
__device__ __forceinline__ void merge_many_body(const P& p) {
  int64_t row, head;
  int vec;
  if (!merge_thread_coords<HEAD_DIM>(p.num_rows, p.num_heads, row, head, vec)) return;
  const float* lse = reinterpret_cast<const float*>(p.lse) + row * p.lse_stride_n + head * p.lse_stride_h;
  const T* v = reinterpret_cast<const T*>(p.v) + row * p.v_stride_n + head * p.v_stride_h + vec * 8;
  float out[8];
  const float lse_out = merge_n(
      p.num_states, [&](int64_t i) { return lse[i * p.lse_stride_s]; },
      [&](int64_t i, float* x) { load8<T>(v + i * p.v_stride_s, x); }, out);
  store8<T>(reinterpret_cast<T*>(p.v_out) + row * p.v_out_stride_n + head * p.v_out_stride_h + vec * 8, out);
  if (vec == 0) reinterpret_cast<float*>(p.lse_out)[row * p.lse_out_stride_n + head * p.lse_out_stride_h] = lse_out;
}

// (v, lse) <- merge((v, lse), the fp32 partial states a deferred-merge plan wrote for each row), per (row, head):
// row r's chunks lie at slots table[r][0] + c * table[r][1] for c < table[r][2] (a partial state's row is slot * H +
// head, attnjit/work.cuh partial_row); each partial's o is multiplied by partial_scale first. One pass of the
// attention kernel and this one replace the split group's in-kernel merge (attnjit/split.cuh) where that merge,
// done by one CTA per group, would cost more than a second launch over every (row, head) of the batch. One online
// pass over the chunks (split.cuh's merge_group rule), unrolled so that the loads of 8 chunks are in flight at once:
// a pass per statistic (merge_n) would wait out an L2 round trip per chunk, three times.
template <typename T, int HEAD_DIM, typename P>
__device__ __forceinline__ void merge_partials_body(const P& p) {
  int64_t row, head;
  int vec;
  if (!merge_thread_coords<HEAD_DIM>(p.num_rows, p.num_heads, row, head, vec)) return;
  const int* t = reinterpret_cast<const int*>(p.table) + 3 * row;
  const int64_t first = t[0], stride = t[1];
  const int count = t[2];
  T* v = reinterpret_cast<T*>(p.v) + row * p.v_stride_n + head * p.v_stride_h + vec * 8;
  float* lse = reinterpret_cast<float*>(p.lse) + row * p.lse_stride_n + head * p.lse_stride_h;
  const float* tmp_o = reinterpret_cast<const float*>(p.tmp_o);
  const float* tmp_lse = reinterpret_cast<const float*>(p.tmp_lse);
  const float scale = static_cast<float>(p.partial_scale);
  float m = *lse, z = 0.f, acc[8];
  if (m == neg_inf()) {  // an empty state: its o is never read
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  } else {
    load8<T>(v, acc);
    z = 1.f;
  }
#pragma unroll 8
  for (int c = 0; c < count; ++c) {
    const int64_t prow = (first + c * stride) * p.num_heads + head;
    const float l = __ldcg(tmp_lse + prow);
    const float4 lo = __ldcg(reinterpret_cast<const float4*>(tmp_o + prow * HEAD_DIM + vec * 8));
    const float4 hi = __ldcg(reinterpret_cast<const float4*>(tmp_o + prow * HEAD_DIM + vec * 8 + 4));
    if (l == neg_inf()) continue;  // an empty chunk (no visible key): the identity
    const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const float m_new = fmaxf(m, l);
    const float a = fast_exp2(m - m_new), w = fast_exp2(l - m_new);  // a = 0 while m is -inf
    const float ws = w * scale;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = acc[e] * a + ws * x[e];
    z = z * a + w;
    m = m_new;
  }
  const float inv = z > 0.f ? 1.f / z : 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] *= inv;
  store8<T>(v, acc);
  if (vec == 0) *lse = row_lse(m, z);
}

}  // namespace attnjit
