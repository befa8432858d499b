// No vector instructions (a CPU without AVX2, or another architecture): every row function
// handles nothing and the scalar loops of epilogue.h do all the work. See vec.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "conversions.h"

namespace arfuse {
namespace isa {

constexpr const char* kIsa = "scalar";

// Auto mode never streams outputs here: the scalar op is bound by its arithmetic, and streaming
// stores measured alike (see ShmComm::streams_outputs).
constexpr int64_t stream_output_min_bytes(int /*dtype*/) { return INT64_MAX; }

template <int D> struct Has { static constexpr bool value = false; };

template <int D, bool NORM, bool RES, int SUM>
inline int64_t row_sum(const typename Elem<D>::T* const*, int, int64_t,
                       const typename Elem<D>::T*, typename Elem<D>::T*, float*,
                       typename Elem<D>::T*) {
  return 0;
}
template <int D, bool kStream = false>
inline int64_t row_scale(const typename Elem<D>::T*, const float*, int64_t, float,
                         typename Elem<D>::T*) {
  return 0;
}
template <int D>
inline int64_t gain_row(const typename Elem<D>::T*, float, int64_t, float*) { return 0; }
template <int D>
inline int64_t fp8_row(const typename Elem<D>::T*, float, int64_t, uint8_t*) { return 0; }
template <int D>
inline int64_t convert_row(const float*, int64_t, typename Elem<D>::T*) { return 0; }
template <int D>
inline int64_t amax_row(const typename Elem<D>::T*, int64_t, float*) { return 0; }
template <int D>
inline int64_t fp8_div_row(const typename Elem<D>::T*, float, int64_t, uint8_t*) { return 0; }
template <int D>
inline bool nvfp4_block(const typename Elem<D>::T*, float, uint8_t*, uint8_t*) { return false; }


}  // namespace isa
}  // namespace arfuse
