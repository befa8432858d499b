// The vector kernels for the instruction set this build targets. Each vec_<isa>.h provides the
// same interface in namespace arfuse::isa, and everything else calls only that interface:
//
//   kIsa                                 name of the instruction set (for doctor / logs)
//   Has<D>::value                        whether dtype D has vector forms here
//   row_sum<D, NORM, RES>(rows, ranks, n, res, dst, lanes)        first pass over one row
//   row_scale<D>(r, gain, n, inv, out)                           second pass (RMSNorm)
//   gain_row<D>(w, weight_bias, n, gain)                          weight_bias + f32(w)
//   fp8_row<D>(out, inv_scale, n, dst)                            e4m3 codes
//   nvfp4_block<D>(v16, gs, codes8, sf) -> bool                    one block of 16
//   stream_copy(dst, src, n)                                      non-temporal memcpy
//
// The row functions return how many leading elements they handled (a multiple of kLanes;
// 0 when there is no vector form) and the caller finishes the rest with the scalar forms of
// conversions.h, which compute the same values in the same order (lane = h % 8). An AVX-512
// (or NEON) version is one more header here and one more line below.
#pragma once

#if defined(__AVX2__)
#include "vec_avx2.h"
#else
#include "vec_scalar.h"
#endif
