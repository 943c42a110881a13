// attnjit/variant.cuh: the variant policy every kernel family calls at the same hook points.
//
// The default attention has no hook. A variant (rendered by the template from an attnjit.Variant, see
// templates/_variant.jinja) has the same members with some HAS_* true and the hook methods; every hook call site in
// every family is `if constexpr` on these flags, so NoVariant compiles to the kernel without hooks.
//
// The element transforms are called in pairs (query_transform_pair / key_transform_pair: dims d and d + HEAD_DIM/2,
// each seeing the other as its `pair`), in place on the tile in shared memory, before any matmul reads it. The sink
// (HAS_SINK) is the row's extra softmax logit: the online softmax starts from it (attnjit/work.cuh, sink_log2).
#pragma once

namespace attnjit {

struct NoVariant {
  static constexpr bool HAS_QUERY_TRANSFORM = false, HAS_KEY_TRANSFORM = false, HAS_LOGITS_TRANSFORM = false,
                        HAS_LOGITS_MASK = false, HAS_OUTPUT_TRANSFORM = false, HAS_KV_START = false, HAS_SINK = false,
                        HAS_LOGITS_SCALE = false, USE_SOFTMAX = true, MASK_FROM_KV_START = false;
  template <typename P>
  __device__ explicit NoVariant(const P&) {}
};

}  // namespace attnjit
