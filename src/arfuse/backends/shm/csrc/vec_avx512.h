// AVX-512 (F, BW, VL, DQ; + BF16 where the CPU has it) forms of the row kernels: 16 fp32
// lanes per vector, the same values as the scalar forms in conversions.h. See vec.h for the
// interface.
//
// The sum of squares in its 32 lanes (lane = h % 32): two 16-wide accumulators, each lane
// added up in order of h as the scalar loop does. fp32 and fp16 go 16 elements at a time in
// element order (elements h..h+15 of each 32 to the first accumulator, h+16..h+31 to the
// second). bf16 goes 32 at a time split into even and odd elements (BF16x32): widening is then
// a shift or a mask instead of a shuffle (the shuffle port bounded the loop), and the two
// accumulators hold lanes 0, 2, ..., 30 and 1, 3, ..., 31. Packing interleaves them back.
//
// bf16 rounding: vcvtneps2bf16 (AVX512_BF16) rounds to nearest even and makes a NaN quiet with
// the payload rule of f32_to_bf16 ((bits >> 16) | 0x40: checked in tests/test_isa_paths.py),
// but it treats denormal inputs as zero, which f32_to_bf16 (and torch) do not. So it is used
// only for vectors without a denormal; a vector with one takes the integer rounding, as the
// AVX2 and scalar forms do. 16 at a time, one vfpclassps per vector looks for a denormal; 32 at
// a time (BF16x32), the 32 rounded words are tested for zero first (one test instead of two
// vfpclassps, on the port the conversion and the shuffles share): a normal float never rounds
// to a zero bf16, so only a vector with a zero word can hold a denormal, and only then are the
// inputs classified. fp16 uses AVX512F's vcvtps2ph/vcvtph2ps,
// the F16C instructions on 16 lanes (AVX512_FP16 adds nothing the kernel needs).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "conversions.h"
#include "memory_access.h"

namespace arfuse {
namespace isa {

#if defined(__AVX512BF16__)
constexpr const char* kIsa = "avx512+bf16";
#else
constexpr const char* kIsa = "avx512";
#endif

constexpr int kWide = 16;  // fp32 lanes per vector

// Auto mode's smallest total of a call's own outputs (bytes) to store with streaming stores
// (see ShmComm::streams_outputs): where this build's op turned faster with them, the next op's
// first read included (docs/design.md 6, streaming output stores).
constexpr int64_t stream_output_min_bytes(int /*dtype*/) { return int64_t(16) << 20; }

inline __m512i splat(int v) { return _mm512_set1_epi32(v); }

using F32s = __m512;  // the fp32 vector (moe.h)
inline F32s broadcast(float v) { return _mm512_set1_ps(v); }

// a + b and a * b with a as the instruction's first source: a NaN result is a's NaN if a is
// one, else b's (see add_o in conversions.h); the compiler may not swap the operands.
inline __m512 add_o(__m512 a, __m512 b) {
  __m512 r;
  asm("vaddps %2, %1, %0" : "=v"(r) : "v"(a), "vm"(b));
  return r;
}
inline __m512 mul_o(__m512 a, __m512 b) {
  __m512 r;
  asm("vmulps %2, %1, %0" : "=v"(r) : "v"(a), "vm"(b));
  return r;
}
inline __m256 add_o(__m256 a, __m256 b) {
  __m256 r;
  asm("vaddps %2, %1, %0" : "=v"(r) : "v"(a), "vm"(b));
  return r;
}
inline __m512 as_ps(__m512i v) { return _mm512_castsi512_ps(v); }
inline __m512i as_si(__m512 v) { return _mm512_castps_si512(v); }

// bf16 bits (16 in a __m256i) -> fp32: word i to the high half of lane i, zeros below, in one
// vpermw (zero-extend and shift would take a shuffle and a shift; measured 3% on a whole row)
inline __m512 bf16_widen(__m256i b) {
  const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0,
                                       6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
  return as_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, _mm512_castsi256_si512(b)));
}

// Round to the nearest bf16 with integer arithmetic (ties to even; NaN stays a quiet NaN,
// (bits >> 16) | 0x40), kept as fp32 whose low 16 bits are zero: f32_to_bf16 on 16 lanes.
inline __m512 bf16_round32_int(__m512 v) {
  const __m512i u = as_si(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), splat(1));
  __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(splat(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, u, splat(0x400000));
  return as_ps(_mm512_and_si512(rounded, splat(int(0xffff0000u))));
}

// The bf16 bits of v, rounded as f32_to_bf16 does.
inline __m256i bf16_pack(__m512 v) {
#if defined(__AVX512BF16__)
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) == 0, 1)) {  // 0x20: denormal
    const __m256bh b = _mm512_cvtneps_pbh(v);
    __m256i bits;
    std::memcpy(&bits, &b, sizeof(bits));
    return bits;
  }
#endif
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(as_si(bf16_round32_int(v)), 16));
}

// pack: round 16 floats to the dtype (its bits); unpack: back to floats; put: store the bits.
template <int D> struct Vec;
template <> struct Vec<kBF16> {
  using B = __m256i;
  static B pack(__m512 v) { return bf16_pack(v); }
  static __m512 unpack(B b) { return bf16_widen(b); }
  static __m512 load(const uint16_t* p) {
    return bf16_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void put(uint16_t* p, B b) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); }
};
template <> struct Vec<kFP16> {
  using B = __m256i;
  static B pack(__m512 v) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static __m512 unpack(B b) { return _mm512_cvtph_ps(b); }
  static __m512 load(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void put(uint16_t* p, B b) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); }
};
template <> struct Vec<kFP32> {
  using B = __m512;
  static B pack(__m512 v) { return v; }
  static __m512 unpack(B b) { return b; }
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static void put(float* p, B b) { _mm512_storeu_ps(p, b); }
};

template <int D> struct Has { static constexpr bool value = true; };

// bf16, 32 at a time: the even elements are the low halves of the 32-bit words (shifted up,
// that is their fp32 value), the odd ones the high halves (masked): no shuffle to widen.
struct BF16x32 {
  __m512 even, odd;
  static BF16x32 of(__m512i bits) {
    return {as_ps(_mm512_slli_epi32(bits, 16)), as_ps(_mm512_and_si512(bits, splat(int(0xffff0000u))))};
  }
  static BF16x32 load(const uint16_t* p) { return of(_mm512_loadu_si512(p)); }
  static void put(uint16_t* p, __m512i bits) { _mm512_storeu_si512(p, bits); }
  // The bf16 bits of even and odd in element order, rounded as f32_to_bf16 does (a zero
  // word: a zero input or a flushed denormal, see the top of this file).
  __m512i pack() const {
#if defined(__AVX512BF16__)
    const __m512bh both = _mm512_cvtne2ps_pbh(odd, even);  // words 0-15 even, 16-31 odd
    __m512i bits;
    std::memcpy(&bits, &both, sizeof(bits));
    if (__builtin_expect(_mm512_testn_epi16_mask(bits, _mm512_set1_epi16(0x7fff)) == 0, 1) ||
        (_mm512_fpclass_ps_mask(even, 0x20) | _mm512_fpclass_ps_mask(odd, 0x20)) == 0) {
      const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                             25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                             18, 2, 17, 1, 16, 0);
      return _mm512_permutexvar_epi16(order, bits);
    }
#endif
    return _mm512_or_si512(_mm512_srli_epi32(as_si(bf16_round32_int(even)), 16),
                           as_si(bf16_round32_int(odd)));
  }
  // even and odd rounded and stored in element order
  static void store_rounded(uint16_t* p, __m512 even, __m512 odd) {
    put(p, BF16x32{even, odd}.pack());
  }
};
using BF16Pair = BF16x32;  // the bf16 form without widening shuffles (moe.h reads it)

// The sum over the ranks of 16 elements at h, in rank order.
template <int D, int W>
inline __m512 rank_sum(const typename Elem<D>::T* const* rows, int world, int64_t h) {
  using V = Vec<D>;
  __m512 a = V::load(rows[0] + h);
  if constexpr (W == 2) {
    a = add_o(a, V::load(rows[1] + h));
  } else if constexpr (W == 4) {
    a = add_o(a, V::load(rows[1] + h));
    a = add_o(a, V::load(rows[2] + h));
    a = add_o(a, V::load(rows[3] + h));
  } else if constexpr (W != 1) {
    for (int j = 1; j < world; ++j) a = add_o(a, V::load(rows[j] + h));
  }
  return a;
}

// 16 elements at h of the first pass (fp32, fp16): sum the ranks (rank order); plain: store
// the rounded sum; norm: round, add the residual, round, store residual_out and add the
// squares of r to acc. SUM (SlotStore): also store the rounded sum or residual_out in
// sum_dst (the two-shot result slot).
// W is the world size when known at compile time (0: not).
template <int D, int W, bool NORM, bool RES, int SUM>
inline void pass1_step(const typename Elem<D>::T* const* rows, int world, int64_t h,
                       const typename Elem<D>::T* res, typename Elem<D>::T* dst,
                       typename Elem<D>::T* sum_dst, __m512& acc) {
  // res and dst may be the same row (residual updated in place): each lane reads res[h]
  // before it writes dst[h], and no other lane's store touches res.
  using V = Vec<D>;
  prefetch_step(rows, W > 0 ? W : world, h, dst, SUM != kSlotNone ? sum_dst : nullptr);
  const __m512 a = rank_sum<D, W>(rows, world, h);
  if constexpr (!NORM) {
    const typename V::B s = V::pack(a);
    V::put(dst + h, s);
    if constexpr (SUM != kSlotNone) V::put(sum_dst + h, s);
  } else {
    // one input (W == 1) holds values of T already: rounding them again changes nothing
    // that the rounding after the residual add would not (it also quiets a signaling NaN)
    __m512 pre = a;
    if constexpr (W != 1 || SUM != kSlotNone) {
      const typename V::B s = V::pack(a);
      if constexpr (SUM == kSlotSum) V::put(sum_dst + h, s);
      pre = V::unpack(s);
    }
    if constexpr (RES) pre = add_o(pre, V::load(res + h));
    const typename V::B rb = V::pack(pre);
    V::put(dst + h, rb);
    if constexpr (SUM == kSlotResidualOut) V::put(sum_dst + h, rb);
    const __m512 r = V::unpack(rb);
    acc = add_o(acc, _mm512_mul_ps(r, r));
  }
}

// 32 bf16 elements at h of the first pass, the same steps on even and odd elements; acc_even
// and acc_odd take the squares of lanes 0, 2, ..., 30 and 1, 3, ..., 31.
template <int W, bool NORM, bool RES, int SUM>
inline void bf16_pass1_step(const uint16_t* const* rows, int world, int64_t h,
                            const uint16_t* res, uint16_t* dst, uint16_t* sum_dst,
                            __m512& acc_even, __m512& acc_odd) {
  prefetch_step(rows, W > 0 ? W : world, h, dst, SUM != kSlotNone ? sum_dst : nullptr);
  BF16x32 a = BF16x32::load(rows[0] + h);
  for (int j = 1; j < (W > 0 ? W : world); ++j) {
    const BF16x32 b = BF16x32::load(rows[j] + h);
    a.even = add_o(a.even, b.even);
    a.odd = add_o(a.odd, b.odd);
  }
  if constexpr (!NORM) {
    const __m512i s = a.pack();
    BF16x32::put(dst + h, s);
    if constexpr (SUM != kSlotNone) BF16x32::put(sum_dst + h, s);
  } else {
    BF16x32 pre = a;  // one input: bf16 values already (see pass1_step)
    if constexpr (W != 1 || SUM != kSlotNone) {
      const __m512i s = a.pack();
      if constexpr (SUM == kSlotSum) BF16x32::put(sum_dst + h, s);
      pre = BF16x32::of(s);
    }
    if constexpr (RES) {
      const BF16x32 b = BF16x32::load(res + h);
      pre.even = add_o(pre.even, b.even);
      pre.odd = add_o(pre.odd, b.odd);
    }
    const __m512i rb = pre.pack();
    BF16x32::put(dst + h, rb);
    if constexpr (SUM == kSlotResidualOut) BF16x32::put(sum_dst + h, rb);
    const BF16x32 r = BF16x32::of(rb);
    acc_even = add_o(acc_even, _mm512_mul_ps(r.even, r.even));
    acc_odd = add_o(acc_odd, _mm512_mul_ps(r.odd, r.odd));
  }
}

// The first pass over [0, n32) of a row or of a segment of one (n32 a multiple of 32): the
// squares go on into the lane sums in lanes (the caller zeroes them for a new row).
template <int D, int W, bool NORM, bool RES, int SUM>
void pass1(const typename Elem<D>::T* const* rows, int world, int64_t n32,
           const typename Elem<D>::T* res, typename Elem<D>::T* dst,
           typename Elem<D>::T* sum_dst, float* lanes) {
  static_assert(kSumLanes == 2 * kWide, "two accumulators of 16 lanes");
  __m512 acc0, acc1;
  if constexpr (D == kBF16) {  // acc0: lanes 0, 2, ..., 30; acc1: lanes 1, 3, ..., 31
    const __m512 low = _mm512_loadu_ps(lanes), high = _mm512_loadu_ps(lanes + kWide);
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4,
                                          2, 0);
    acc0 = _mm512_permutex2var_ps(low, even, high);
    acc1 = _mm512_permutex2var_ps(low, _mm512_add_epi32(even, splat(1)), high);
  } else {
    acc0 = _mm512_loadu_ps(lanes);
    acc1 = _mm512_loadu_ps(lanes + kWide);
  }
  if constexpr (D == kBF16) {
    for (int64_t h = 0; h < n32; h += 32) {
      bf16_pass1_step<W, NORM, RES, SUM>(rows, world, h, res, dst, sum_dst, acc0, acc1);
    }
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16,
                                         0);  // even i at 2i, odd i (index 16 + i) at 2i + 1
    _mm512_storeu_ps(lanes, _mm512_permutex2var_ps(acc0, low, acc1));
    _mm512_storeu_ps(lanes + kWide,
                     _mm512_permutex2var_ps(acc0, _mm512_add_epi32(low, splat(8)), acc1));
  } else {
    for (int64_t h = 0; h < n32; h += 32) {
      pass1_step<D, W, NORM, RES, SUM>(rows, world, h, res, dst, sum_dst, acc0);
      pass1_step<D, W, NORM, RES, SUM>(rows, world, h + kWide, res, dst, sum_dst, acc1);
    }
    _mm512_storeu_ps(lanes, acc0);
    _mm512_storeu_ps(lanes + kWide, acc1);
  }
}

// Second pass: out = T((r * inv) * gain), r read back from residual_out (exact: it holds r
// in T), gain as gain_row laid it out (element order).
template <int D, bool kStream = false>
int64_t row_scale(const typename Elem<D>::T* r, const float* __restrict gain, int64_t n,
                  float inv, typename Elem<D>::T* out) {
  using V = Vec<D>;
  const __m512 vinv = _mm512_set1_ps(inv);
  int64_t k = 0;
  if constexpr (D == kBF16) {  // gain holds [0, n / 32 * 32) in BF16x32 order
    for (; k + 32 <= n; k += 32) {
      if constexpr (!kStream) prefetch_write(out + k);  // see memory_access.h
      BF16x32 v = BF16x32::load(r + k);
      v.even = mul_o(mul_o(v.even, vinv), _mm512_loadu_ps(gain + k));
      v.odd = mul_o(mul_o(v.odd, vinv), _mm512_loadu_ps(gain + k + kWide));
      put_bits<kStream>(out + k, v.pack());
    }
    return k;
  }
  for (; k + kWide <= n; k += kWide) {
    if constexpr (!kStream) prefetch_write(out + k);
    const __m512 scaled = mul_o(V::load(r + k), vinv);
    put_bits<kStream>(out + k, V::pack(mul_o(scaled, _mm512_loadu_ps(gain + k))));
  }
  return k;
}

// gain = weight_bias + f32(w), in the order row_scale reads it (BF16x32 order for bf16).
template <int D>
int64_t gain_row(const typename Elem<D>::T* w, float weight_bias, int64_t n, float* gain) {
  const __m512 vb = _mm512_set1_ps(weight_bias);
  int64_t k = 0;
  if constexpr (D == kBF16) {
    for (; k + 32 <= n; k += 32) {
      const BF16x32 v = BF16x32::load(w + k);
      _mm512_storeu_ps(gain + k, _mm512_add_ps(vb, v.even));
      _mm512_storeu_ps(gain + k + kWide, _mm512_add_ps(vb, v.odd));
    }
    return k;
  }
  for (; k + kWide <= n; k += kWide) {
    _mm512_storeu_ps(gain + k, _mm512_add_ps(vb, Vec<D>::load(w + k)));
  }
  return k;
}

// src rounded to T, 16 at a time (a test hook: the vector rounding against the scalar one).
template <int D>
int64_t convert_row(const float* src, int64_t n, typename Elem<D>::T* dst) {
  int64_t h = 0;
  for (; h + kWide <= n; h += kWide) {
    Vec<D>::put(dst + h, Vec<D>::pack(_mm512_loadu_ps(src + h)));
  }
  return h;
}

// 16 floats -> 16 e4m3 codes; the same rounding as f32_to_e4m3.
inline __m128i e4m3x16(__m512 v) {
  const __m512i u = as_si(v);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), splat(0x80));
  const __m512i au = _mm512_and_si512(u, splat(0x7fffffff));
  const __m512 a = as_ps(au);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(au, 20), splat(1));
  const __m512i r = _mm512_add_epi32(au, _mm512_add_epi32(splat(int(e4m3::kRoundBias)), lsb));
  const __m512i normal = _mm512_or_si512(
      _mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(r, 23), splat(int(e4m3::kRebias))), 3),
      _mm512_and_si512(_mm512_srli_epi32(r, 20), splat(7)));
  // below kMinNormal: a * kSubnormalSteps rounded to an integer, nearest even
  const __m512 t = _mm512_add_ps(_mm512_mul_ps(a, _mm512_set1_ps(e4m3::kSubnormalSteps)),
                                 _mm512_set1_ps(e4m3::kIntegerRounding));
  const __m512i small = _mm512_sub_epi32(as_si(t), splat(int(e4m3::kIntegerRoundingBits)));
  const __mmask16 is_small =
      _mm512_cmp_ps_mask(a, _mm512_set1_ps(e4m3::kMinNormal), _CMP_LT_OQ);
  __m512i code = _mm512_mask_blend_epi32(is_small, normal, small);
  code = _mm512_min_epi32(code, splat(int(e4m3::kMaxCode)));  // saturate
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  code = _mm512_mask_mov_epi32(code, nan, splat(int(e4m3::kNaNCode)));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}

template <int D>
int64_t fp8_row(const typename Elem<D>::T* out, float inv_scale, int64_t n, uint8_t* dst) {
  const __m512 vs = _mm512_set1_ps(inv_scale);
  int64_t h = 0;
  for (; h + kWide <= n; h += kWide) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + h),
                     e4m3x16(_mm512_mul_ps(Vec<D>::load(out + h), vs)));
  }
  return h;
}

// max |out| over [0, n16) ignoring NaN (a NaN lane counts as 0; every |v| >= 0), in *amax.
template <int D>
int64_t amax_row(const typename Elem<D>::T* out, int64_t n, float* amax) {
  const __m512i abs_mask = splat(0x7fffffff);
  __m512 mx = _mm512_setzero_ps();
  int64_t h = 0;
  for (; h + kWide <= n; h += kWide) {
    const __m512 v = Vec<D>::load(out + h);
    const __mmask16 ord = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    mx = _mm512_mask_max_ps(mx, ord, mx, as_ps(_mm512_and_si512(as_si(v), abs_mask)));
  }
  *amax = _mm512_reduce_max_ps(mx);
  return h;
}

// e4m3 codes of out / scale (an IEEE division, as fp8_dynamic_quantize).
template <int D>
int64_t fp8_div_row(const typename Elem<D>::T* out, float scale, int64_t n, uint8_t* dst) {
  const __m512 vs = _mm512_set1_ps(scale);
  int64_t h = 0;
  for (; h + kWide <= n; h += kWide) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + h),
                     e4m3x16(_mm512_div_ps(Vec<D>::load(out + h), vs)));
  }
  return h;
}

// 16 floats -> 16 e2m1 codes (int32 lanes); the same thresholds as f32_to_e2m1. The unordered
// "not <=" / "not <" comparisons are "greater" / "greater or equal" for numbers and true for a
// NaN, which so passes every threshold: code 7 (+6, its sign bit dropped), as f32_to_e2m1.
inline __m512i e2m1x16(__m512 v) {
  const __m512 m = as_ps(_mm512_and_si512(as_si(v), splat(0x7fffffff)));
  __m512i code = _mm512_setzero_si512();
  const __m512i one = splat(1);
  auto count = [&](float threshold, bool strict) {
    const __mmask16 hit =
        strict ? _mm512_cmp_ps_mask(m, _mm512_set1_ps(threshold), _CMP_NLE_UQ)
               : _mm512_cmp_ps_mask(m, _mm512_set1_ps(threshold), _CMP_NLT_UQ);
    code = _mm512_mask_add_epi32(code, hit, code, one);
  };
  for (const E2m1Threshold& t : kE2m1Thresholds) count(float(t.at), t.strict);
  const __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  const __m512i sign = _mm512_slli_epi32(_mm512_srli_epi32(as_si(v), 31), 3);
  return _mm512_mask_or_epi32(code, ordered, code, sign);
}

// One NVFP4 block of 16 (see quantize_row in epilogue.h for the rule): the 8 code bytes, and
// the e4m3 block scale in *sf. The amax ignores NaN unless all 16 are NaN.
template <int D>
bool nvfp4_block(const typename Elem<D>::T* v16, float gs, uint8_t* codes8, uint8_t* sf) {
  const __m512 v = Vec<D>::load(v16);
  const __mmask16 ord = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  const __m512 mag = as_ps(_mm512_maskz_and_epi32(ord, as_si(v), splat(0x7fffffff)));
  const float amax = ord == 0 ? NAN : _mm512_reduce_max_ps(mag);  // all 16 NaN: NaN
  const uint8_t scale = f32_to_e4m3(gs * (amax * kE2m1MaxInverse));
  const float sfq = g_e4m3_decode[scale];
  const __m512 es = _mm512_set1_ps(sfq != 0.0f ? gs / sfq : 0.0f);
  const __m128i bytes = _mm512_cvtepi32_epi8(e2m1x16(_mm512_mul_ps(v, es)));
  const __m128i pairs = _mm_maddubs_epi16(bytes, _mm_set1_epi16(0x1001));  // lo + 16 * hi
  _mm_storel_epi64(reinterpret_cast<__m128i*>(codes8), _mm_packus_epi16(pairs, pairs));
  *sf = scale;
  return true;
}

}  // namespace isa
}  // namespace arfuse
