// attnjit/fa2/softmax.cuh: the fa2 family's per-warp state and the online softmax of one tile's S, in registers.
#pragma once
#include "attnjit/common.cuh"

namespace attnjit {

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

// Online softmax of one tile's S (in place: S becomes P); O is rescaled only when some row's max moved.
// scale2: the log2 scale of S (sm_scale * log2 e; after a logits transform, WorkItem::transformed_log2_scale).
// q_row_scale(mq, r): what the logits of this lane's row (mq, r) are multiplied by beyond scale2 (fp8 with bf16 q:
// the row's 2^-e, fa2/fp8_frags.cuh; read only then).
template <typename Tr, typename RowScale>
__device__ __forceinline__ void softmax_update(float (&s)[Tr::NUM_MMA_Q][Tr::NUM_MMA_KV * 2][4], WarpState<Tr>& st,
                                               float scale2, const RowScale& q_row_scale) {
  using V = typename Tr::Variant;
  float alpha[Tr::NUM_MMA_Q][2];
  bool moved = false;
#pragma unroll
  for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // the max of the raw logits, scaled once (scale2 > 0: plan() checks sm_scale; a transform's is NaN unless > 0)
      float raw = neg_inf();
#pragma unroll
      for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt) raw = fmaxf(raw, fmaxf(s[mq][nt][2 * r], s[mq][nt][2 * r + 1]));
      raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 1));
      raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 2));
      float sc = scale2;
      if constexpr (Tr::Q_TO_HALF && !V::HAS_LOGITS_TRANSFORM) sc *= q_row_scale(mq, r);
      const float mx = fmaxf(st.m[mq][r], raw * sc);
      const float m_safe = mx == neg_inf() ? 0.f : mx;
      alpha[mq][r] = fast_exp2(st.m[mq][r] - m_safe);
      moved |= mx != st.m[mq][r];
      st.m[mq][r] = mx;
#pragma unroll
      for (int nt = 0; nt < Tr::NUM_MMA_KV * 2; ++nt)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) s[mq][nt][e] = fast_exp2(fmaf(s[mq][nt][e], sc, -m_safe));
      st.d[mq][r] *= alpha[mq][r];  // pv() adds this tile's row sums
    }
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int mq = 0; mq < Tr::NUM_MMA_Q; ++mq)
#pragma unroll
      for (int dt = 0; dt < Tr::HEAD_DIM / 8; ++dt) {
        st.o[mq][dt][0] *= alpha[mq][0];
        st.o[mq][dt][1] *= alpha[mq][0];
        st.o[mq][dt][2] *= alpha[mq][1];
        st.o[mq][dt][3] *= alpha[mq][1];
      }
  }
}


}  // namespace attnjit
