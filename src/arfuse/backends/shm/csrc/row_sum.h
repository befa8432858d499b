// row_sum for the vector headers (vec_avx2.h, vec_avx512.h), each of which defines
// Has<D> and pass1<D, W, NORM, RES, SUM>(rows, world, n32, res, dst, sum_dst, lanes) for the
// first pass over [0, n32): the world size as a compile-time constant where it is 1, 2 or 4
// (the sum over the ranks unrolled), and whole steps of kSumLanes elements, so that the
// scalar tail of epilogue.h continues every lane in order.
#pragma once

#include <cstdint>

#include "conversions.h"

namespace arfuse {
namespace isa {

template <int D, bool NORM, bool RES, int SUM>
int64_t row_sum(const typename Elem<D>::T* const* rows, int ranks, int64_t n,
                const typename Elem<D>::T* res, typename Elem<D>::T* dst, float* lanes,
                typename Elem<D>::T* sum_dst) {
  if constexpr (!Has<D>::value) {
    return 0;
  } else {
    const int64_t n32 = n / kSumLanes * kSumLanes;
    if (ranks == 1) pass1<D, 1, NORM, RES, SUM>(rows, ranks, n32, res, dst, sum_dst, lanes);
    else if (ranks == 2) pass1<D, 2, NORM, RES, SUM>(rows, ranks, n32, res, dst, sum_dst, lanes);
    else if (ranks == 4) pass1<D, 4, NORM, RES, SUM>(rows, ranks, n32, res, dst, sum_dst, lanes);
    else pass1<D, 0, NORM, RES, SUM>(rows, ranks, n32, res, dst, sum_dst, lanes);
    return n32;
  }
}

}  // namespace isa
}  // namespace arfuse
