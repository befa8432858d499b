// The expert step of the MoE patterns (docs/design.md 3.12): each rank combines its expert rows
// into the rows it then all-reduces, written straight into its input slot (the copy of x that
// a plain call makes is what this replaces). In fp32, in the documented order, each product
// and each sum rounded on its own (add_o / mul_o: no fused multiply-add, the NaN rule of
// conversions.h), so every ISA path writes the bytes arfuse.moe's torch reference does:
//
//   dst[t] = T(((sum over k of scale[k] * row[k]) * routed) + add[t])
//
// with the sum starting from +0, the rows skipped that a finalize index marks -1, the multiply
// by `routed` only when it is not 1 (x * 1 is x, NaN included, for the values a sum can hold)
// and `add` (the shared expert, or a reduction's token input) only when given.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

#include "conversions.h"
#include "signature.h"
#include "vec.h"

namespace arfuse {

struct ExpertRows {  // one token's terms
  const void* const* rows;  // fan_in rows of T (nullptr: skipped)
  const float* scales;      // fan_in scales
  int fan_in;
};

#if defined(ARFUSE_VEC_LANES)
#if ARFUSE_VEC_LANES == 16
inline __m512 broadcast_f32(float v) { return _mm512_set1_ps(v); }
#else
inline __m256 broadcast_f32(float v) { return _mm256_set1_ps(v); }
#endif

// [0, n) of a row in whole vectors, four at a time where they fit; returns how many it did.
template <int D>
int64_t combine_vectors(const ExpertRows& e, float routed, bool scale_routed,
                        const typename Elem<D>::T* add, typename Elem<D>::T* dst, int64_t n) {
  using T = typename Elem<D>::T;
  using V = isa::Vec<D>;
  constexpr int64_t kLanes = ARFUSE_VEC_LANES;
  const auto routed_v = broadcast_f32(routed);
  int64_t h = 0;
  for (; h + kLanes <= n; h += kLanes) {
    auto acc = broadcast_f32(0.0f);
    for (int k = 0; k < e.fan_in; ++k) {
      if (e.rows[k] == nullptr) continue;
      const T* row = static_cast<const T*>(e.rows[k]) + h;
      acc = isa::add_o(acc, isa::mul_o(broadcast_f32(e.scales[k]), V::load(row)));
    }
    if (scale_routed) acc = isa::mul_o(acc, routed_v);
    if (add != nullptr) acc = isa::add_o(acc, V::load(add + h));
    V::put(dst + h, V::pack(acc));
  }
  return h;
}
#endif

// One token's row of `hidden`: the vector form where this build has one, then the scalar tail
// (the same values: conversions.h's scalar forms round alike).
template <int D>
void combine_row(const ExpertRows& e, float routed, const typename Elem<D>::T* add,
                 typename Elem<D>::T* dst, int64_t hidden) {
  using T = typename Elem<D>::T;
  const bool scale_routed = routed != 1.0f;
  int64_t h = 0;
#if defined(ARFUSE_VEC_LANES)
  if constexpr (isa::Has<D>::value) {
    h = combine_vectors<D>(e, routed, scale_routed, add, dst, hidden);
  }
#endif
  for (; h < hidden; ++h) {
    float acc = 0.0f;
    for (int k = 0; k < e.fan_in; ++k) {
      if (e.rows[k] == nullptr) continue;
      acc = add_o(acc, mul_o(e.scales[k], Elem<D>::load(static_cast<const T*>(e.rows[k])[h])));
    }
    if (scale_routed) acc = mul_o(acc, routed);
    if (add != nullptr) acc = add_o(acc, Elem<D>::load(add[h]));
    dst[h] = Elem<D>::store(acc);
  }
}

// The entries (moe.cpp; bound in bindings.cpp as moe_finalize and moe_reduce). They release
// the GIL while they compute; finalize returns why an index is out of range ("" when none is:
// then it wrote dst).
std::string moe_finalize(const at::Tensor& dst, const at::Tensor& expanded, const at::Tensor& index,
                  const at::Tensor& scales, const std::optional<at::Tensor>& shared,
                  double routed);
void moe_reduce(const at::Tensor& dst, const at::Tensor& active, const at::Tensor& scales,
                const at::Tensor& token_input);

}  // namespace arfuse
