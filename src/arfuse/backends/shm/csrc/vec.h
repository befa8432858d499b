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
// row_sum is shared by the vector headers (row_sum.h, over each one's pass1). Each vector
// header also gives moe.h its fp32 vector (F32s) and broadcast(v).
//
// Which header: the one the build names (build.py passes -DARFUSE_ISA_<NAME> with the target
// options of that instruction set: the best the host has, or ARFUSE_SHM_ISA), never the
// compiler's own target macros: an aarch64 compiler always defines __ARM_NEON, and the scalar
// path must stay buildable there. AVX-512 needs F, BW, VL and DQ (vfpclassps); AVX512_BF16 is
// used where the compiler targets it, as Arm's BF16 conversions (+bf16) are in vec_neon.h.
#pragma once

#if defined(ARFUSE_ISA_AVX512)
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
      defined(__AVX512DQ__))
#error "ARFUSE_ISA_AVX512 needs -mavx512f -mavx512bw -mavx512vl -mavx512dq"
#endif
#include "vec_avx512.h"
#include "row_sum.h"
#define ARFUSE_VEC_LANES 16  // fp32 lanes of isa::Vec
#elif defined(ARFUSE_ISA_AVX2)
#if !defined(__AVX2__)
#error "ARFUSE_ISA_AVX2 needs -mavx2"
#endif
#include "vec_avx2.h"
#include "row_sum.h"
#define ARFUSE_VEC_LANES 8
#elif defined(ARFUSE_ISA_NEON)
#if !defined(__aarch64__)
#error "ARFUSE_ISA_NEON is aarch64's"
#endif
#include "vec_neon.h"
#include "row_sum.h"
#define ARFUSE_VEC_LANES 4
#elif defined(ARFUSE_ISA_SCALAR)
#include "vec_scalar.h"
#else
#error "build.py names the instruction set: -DARFUSE_ISA_AVX512, _AVX2, _NEON or _SCALAR"
#endif

// GCC 12 for aarch64 (12.2, Debian 12's) dies with an internal compiler error in
// vect_transform_reduction vectorising a std::fmax reduction of values widened from a narrower
// type (nvfp4_block_scalar's 16 bf16 elements), at -O2 as at -O3: that function is kept from
// its loop vectorizer. GCC 13 (13.3) and 14 (14.2) vectorise it, and give the same bytes
// (scripts/arm_check.sh, ARM_GCC=13 or 14); GCCs before 12 keep the attribute, untried.
#if defined(__aarch64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#define ARFUSE_NO_LOOP_VECTORIZE __attribute__((optimize("no-tree-loop-vectorize")))
#else
#define ARFUSE_NO_LOOP_VECTORIZE
#endif
