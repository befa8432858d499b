// The vector kernels for the instruction set this build targets. Each vec_<isa>.h provides the
// same interface in namespace arfuse::isa, and everything else calls only that interface:
//
//   kIsa                                 name of the instruction set (for doctor / logs)
//   stream_output_min_bytes(dtype)       auto mode's smallest total of own outputs to
//                                        store with streaming stores (bytes)
//   Has<D>::value                        whether dtype D has vector forms here
//   row_sum<D, NORM, RES, SUM>(rows, ranks, n, res, dst, lanes, sum_dst)
//                                        first pass over one row (SUM, a SlotStore: the
//                                        rounded sum or residual_out also into sum_dst, the
//                                        two-shot result slot); lanes: the
//                                        kSumLanes sums of squares, lane = h % kSumLanes,
//                                        continued (a row may be passed in segments)
//   row_scale<D, kStream>(r, gain, n, inv, out)                  second pass (RMSNorm);
//                                        kStream: streaming stores (out aligned to 64)
//   gain_row<D>(w, weight_bias, n, gain)                          weight_bias + f32(w)
//   fp8_row<D>(out, inv_scale, n, dst)                            e4m3 codes
//   amax_row<D>(out, n, amax)                                     max |out|, NaN ignored
//   fp8_div_row<D>(out, scale, n, dst)                            e4m3 codes of out / scale
//   nvfp4_block<D>(v16, gs, codes8, sf) -> bool                    one block of 16
//   convert_row<D>(src, n, dst)                                   fp32 -> T (a test hook)
//
// The row functions return how many leading elements they handled (0 when there is no vector
// form; row_sum: a multiple of kSumLanes; row_scale: as many as gain_row laid out in its own
// order) and the caller finishes the rest with the scalar forms of conversions.h, which
// compute the same values in the same order (lane = h % kSumLanes).
//
// row_sum is shared by the vector headers (row_sum.h, over each one's pass1).
//
// Which header: the build's target (build.py passes the -m flags of the instruction set it
// builds for: the best the host has, or ARFUSE_SHM_ISA=avx512|avx2|scalar). AVX-512 needs
// F, BW, VL and DQ (vfpclassps); AVX512_BF16 is used where the compiler targets it.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include "vec_avx512.h"
#include "row_sum.h"
#define ARFUSE_VEC_LANES 16  // fp32 lanes of isa::Vec (moe.h picks its broadcast by it)
#elif defined(__AVX2__)
#include "vec_avx2.h"
#include "row_sum.h"
#define ARFUSE_VEC_LANES 8
#else
#include "vec_scalar.h"
#endif
