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
using isa::F32s;  // the build's fp32 vector (vec.h)
inline F32s broadcast_f32(float v) { return isa::broadcast(v); }

// How the rows of dtype D are read and written: kElems elements as kParts fp32 vectors.
template <int D>
struct Chunk {  // one isa::Vec
  using T = typename Elem<D>::T;
  static constexpr int kParts = 1;
  static constexpr int64_t kElems = ARFUSE_VEC_LANES;
  static void load(const T* p, F32s* v) { v[0] = isa::Vec<D>::load(p); }
  static void store(T* p, const F32s* v) { isa::Vec<D>::put(p, isa::Vec<D>::pack(v[0])); }
};
template <>
struct Chunk<kBF16> {  // even and odd elements apart: no widening shuffle per load
  static constexpr int kParts = 2;
  static constexpr int64_t kElems = 2 * ARFUSE_VEC_LANES;
  static void load(const uint16_t* p, F32s* v) {
    const isa::BF16Pair pair = isa::BF16Pair::load(p);
    v[0] = pair.even;
    v[1] = pair.odd;
  }
  static void store(uint16_t* p, const F32s* v) { isa::BF16Pair::store_rounded(p, v[0], v[1]); }
};

// kChunks chunks at h: the sums of the rows' scaled elements, each lane in k order, then
// routed scaling and `add`, rounded into dst.
template <int D, int kChunks>
inline void combine_step(const typename Elem<D>::T* const* rows, const F32s* scales, int terms,
                         float routed, bool scale_routed, const typename Elem<D>::T* add,
                         typename Elem<D>::T* dst, int64_t h) {
  using C = Chunk<D>;
  constexpr int kVecs = kChunks * C::kParts;
  F32s acc[kVecs], v[kVecs];
  for (int i = 0; i < kVecs; ++i) acc[i] = broadcast_f32(0.0f);
  for (int k = 0; k < terms; ++k) {
    for (int c = 0; c < kChunks; ++c) C::load(rows[k] + h + c * C::kElems, v + c * C::kParts);
    for (int i = 0; i < kVecs; ++i) acc[i] = isa::add_o(acc[i], isa::mul_o(scales[k], v[i]));
  }
  if (scale_routed) {
    const F32s r = broadcast_f32(routed);
    for (int i = 0; i < kVecs; ++i) acc[i] = isa::mul_o(acc[i], r);
  }
  if (add != nullptr) {
    for (int c = 0; c < kChunks; ++c) C::load(add + h + c * C::kElems, v + c * C::kParts);
    for (int i = 0; i < kVecs; ++i) acc[i] = isa::add_o(acc[i], v[i]);
  }
  for (int c = 0; c < kChunks; ++c) C::store(dst + h + c * C::kElems, acc + c * C::kParts);
}

// [0, n) of a row in whole chunks; returns how many elements it did. The rows a finalize
// index skips are dropped and the scales broadcast once per token; each step then keeps four
// vectors' sums going at once (one sum alone waits on its own adds and leaves the loads idle).
template <int D>
int64_t combine_vectors(const ExpertRows& e, float routed, bool scale_routed,
                        const typename Elem<D>::T* add, typename Elem<D>::T* dst, int64_t n) {
  using T = typename Elem<D>::T;
  using C = Chunk<D>;
  constexpr int kChunks = 4 / C::kParts;
  const T* rows[signature::kMaxMoeFanIn];
  F32s scales[signature::kMaxMoeFanIn];
  int terms = 0;
  for (int k = 0; k < e.fan_in; ++k) {
    if (e.rows[k] == nullptr) continue;
    rows[terms] = static_cast<const T*>(e.rows[k]);
    scales[terms++] = broadcast_f32(e.scales[k]);
  }
  int64_t h = 0;
  for (; h + kChunks * C::kElems <= n; h += kChunks * C::kElems) {
    combine_step<D, kChunks>(rows, scales, terms, routed, scale_routed, add, dst, h);
  }
  for (; h + C::kElems <= n; h += C::kElems) {
    combine_step<D, 1>(rows, scales, terms, routed, scale_routed, add, dst, h);
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
