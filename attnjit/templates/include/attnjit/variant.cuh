// attnjit/variant.cuh: the variant policy every kernel family calls at the same hook points.
//
// The default attention has no hook. A variant (rendered by the template from an attnjit.Variant, see
// templates/_variant.jinja) has the same members with some HAS_* true and the hook methods; every hook call site in
// every family is `if constexpr` on these flags, so NoVariant compiles to the kernel without hooks.
#pragma once

namespace attnjit {

struct NoVariant {
  static constexpr bool HAS_QUERY_TRANSFORM = false, HAS_LOGITS_TRANSFORM = false, HAS_LOGITS_MASK = false,
                        HAS_OUTPUT_TRANSFORM = false, HAS_KV_START = false, USE_SOFTMAX = true;
  template <typename P>
  __device__ explicit NoVariant(const P&) {}
};

}  // namespace attnjit
