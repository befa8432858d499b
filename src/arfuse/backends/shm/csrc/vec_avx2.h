// AVX2 (+ F16C for fp16) forms of the row kernels: 8 fp32 lanes per vector, the same
// rounding as the scalar forms in conversions.h. See vec.h for the interface. The sum of
// squares in its 32 lanes (lane = h % 32): four 8-wide accumulators, each lane added up in
// order of h (which lanes each holds: see pass1).
//
// Outputs are stored cached, and with streaming stores from stream_output_min_bytes (below)
// on, where the op gained by them, the next op's read included; the copy into the slot
// chooses per size (CopyTuner in protocol.h).
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

constexpr int kWide = 8;  // fp32 lanes per vector

// Auto mode's smallest total of a call's own outputs (bytes) to store with streaming stores
// (see ShmComm::streams_outputs): where this build's op turned faster with them, the next op's
// first read included (docs/design.md 6, streaming output stores). bf16, rounded in integer arithmetic 8 lanes at
// a time, keeps the core busy enough that a read for ownership costs little until far larger
// sizes.
constexpr int64_t stream_output_min_bytes(int dtype) {
  return dtype == kBF16 ? int64_t(64) << 20 : int64_t(16) << 20;
}

#if defined(__F16C__)
constexpr const char* kIsa = "avx2+f16c";
#else
constexpr const char* kIsa = "avx2";
#endif

using F32s = __m256;  // the fp32 vector (moe.h)
inline F32s broadcast(float v) { return _mm256_set1_ps(v); }

// a + b and a * b with a as the instruction's first source: a NaN result is a's NaN if a is
// one, else b's (see add_o in conversions.h); the compiler may not swap the operands.
inline __m256 add_o(__m256 a, __m256 b) {
  __m256 r;
  asm("vaddps %2, %1, %0" : "=x"(r) : "x"(a), "xm"(b));
  return r;
}
inline __m256 mul_o(__m256 a, __m256 b) {
  __m256 r;
  asm("vmulps %2, %1, %0" : "=x"(r) : "x"(a), "xm"(b));
  return r;
}

inline __m256 bf16x8_load(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// Round to the nearest bf16 (ties to even; NaN stays a quiet NaN), kept as fp32 whose low 16
// bits are zero: rounding and widening back cost nothing more.
inline __m256 bf16x8_round32(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  __m256i picked = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm256_castsi256_ps(_mm256_and_si256(picked, _mm256_set1_epi32(int(0xffff0000u))));
}
inline __m128i bf16x8_narrow(__m256 rounded) {  // the bf16 bits of already rounded values
  __m256i t = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}
inline __m128i bf16x8_round(__m256 v) { return bf16x8_narrow(bf16x8_round32(v)); }

// pack: round 8 floats to the dtype (its bits); unpack: back to floats; put: store the bits.
template <int D> struct Vec;
template <> struct Vec<kBF16> {
  static constexpr bool ok = true;
  using B = __m128i;
  static __m256 round(__m256 v) { return bf16x8_round32(v); }
  static B narrow(__m256 rounded) { return bf16x8_narrow(rounded); }
  static B pack(__m256 v) { return bf16x8_round(v); }
  static __m256 unpack(B b) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
  static __m256 load(const uint16_t* p) { return bf16x8_load(p); }
  static void put(uint16_t* p, B b) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b); }
};
template <> struct Vec<kFP32> {
  static constexpr bool ok = true;
  using B = __m256;
  static __m256 round(__m256 v) { return v; }
  static B narrow(__m256 rounded) { return rounded; }
  static B pack(__m256 v) { return v; }
  static __m256 unpack(B b) { return b; }
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static void put(float* p, B b) { _mm256_storeu_ps(p, b); }
};
#if defined(__F16C__)
template <> struct Vec<kFP16> {
  static constexpr bool ok = true;
  using B = __m128i;
  static B pack(__m256 v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static __m256 round(__m256 v) { return _mm256_cvtph_ps(pack(v)); }
  static B narrow(__m256 rounded) { return pack(rounded); }
  static __m256 unpack(B b) { return _mm256_cvtph_ps(b); }
  static __m256 load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void put(uint16_t* p, B b) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b); }
};
#else
template <> struct Vec<kFP16> { static constexpr bool ok = false; };
#endif

template <int D> struct Has { static constexpr bool value = Vec<D>::ok; };

// bf16, 16 at a time, split into even and odd elements: the even ones are the low halves of
// the 32-bit words (shifted up, that is their fp32 value), the odd ones the high halves
// (masked); packing puts them back with a shift and an or. No shuffle on the way in or out
// (the 8-wide form needs two per load).
struct BF16x16 {
  __m256 even, odd;
  static BF16x16 load(const uint16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))))};
  }
  // the bf16 bits of even, odd (already bf16 values: their low 16 bits are zero)
  static __m256i bits(__m256 even, __m256 odd) {
    const __m256i low = _mm256_srli_epi32(_mm256_castps_si256(even), 16);
    return _mm256_or_si256(low, _mm256_castps_si256(odd));
  }
  static void put(uint16_t* p, __m256 even, __m256 odd) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits(even, odd));
  }
  // even and odd rounded and stored in element order
  static void store_rounded(uint16_t* p, __m256 even, __m256 odd) {
    put(p, bf16x8_round32(even), bf16x8_round32(odd));
  }
};
using BF16Pair = BF16x16;  // the bf16 form without widening shuffles (moe.h reads it)

// 16 bf16 elements at h of the first pass (see pass1_step); acc_even and acc_odd take the
// squares of its even and odd elements.
template <int W, bool NORM, bool RES, int SUM>
inline void bf16_pass1_step(const uint16_t* const* rows, int world, int64_t h,
                            const uint16_t* res, uint16_t* dst, uint16_t* sum_dst,
                            __m256& acc_even, __m256& acc_odd) {
  const int ranks = W > 0 ? W : world;
  prefetch_step(rows, ranks, h, dst, SUM != kSlotNone ? sum_dst : nullptr);
  BF16x16 a = BF16x16::load(rows[0] + h);
  for (int j = 1; j < ranks; ++j) {
    const BF16x16 b = BF16x16::load(rows[j] + h);
    a.even = add_o(a.even, b.even);
    a.odd = add_o(a.odd, b.odd);
  }
  // one input (W == 1) holds bf16 values already: rounding them again changes nothing
  // that the rounding after the residual add below would not (it also quiets a signaling
  // NaN); without a residual, or with the sum for the result slot (SUM), it is rounded
  __m256 even = a.even, odd = a.odd;
  if constexpr (!(W == 1 && NORM && RES && SUM == kSlotNone)) {
    even = bf16x8_round32(a.even);
    odd = bf16x8_round32(a.odd);
  }
  if constexpr (SUM == kSlotSum || (!NORM && SUM != kSlotNone)) {
    BF16x16::put(sum_dst + h, even, odd);
  }
  if constexpr (NORM) {
    if constexpr (RES) {
      const BF16x16 b = BF16x16::load(res + h);
      even = bf16x8_round32(add_o(even, b.even));
      odd = bf16x8_round32(add_o(odd, b.odd));
    }
    acc_even = add_o(acc_even, _mm256_mul_ps(even, even));
    acc_odd = add_o(acc_odd, _mm256_mul_ps(odd, odd));
  }
  BF16x16::put(dst + h, even, odd);
  if constexpr (NORM && SUM == kSlotResidualOut) BF16x16::put(sum_dst + h, even, odd);
}

// 8 elements at h of the first pass: sum the ranks (rank order); plain: store the rounded
// sum; norm: round, add the residual, round, store residual_out and add the squares of r to
// acc. SUM (SlotStore): also store the rounded sum or residual_out in sum_dst (the two-shot
// result slot). W is the world
// size when known at compile time (0: not).
template <int D, int W, bool NORM, bool RES, int SUM>
inline void pass1_step(const typename Elem<D>::T* const* rows, int world, int64_t h,
                       const typename Elem<D>::T* res, typename Elem<D>::T* dst,
                       typename Elem<D>::T* sum_dst, __m256& acc) {
  // res and dst may be the same row (residual updated in place): each lane reads res[h]
  // before it writes dst[h], and no other lane's store touches res.
  using V = Vec<D>;
  prefetch_step(rows, W > 0 ? W : world, h, dst, SUM != kSlotNone ? sum_dst : nullptr);
  __m256 a;
  if constexpr (W == 1) {
    a = V::load(rows[0] + h);
  } else if constexpr (W == 2) {
    a = add_o(V::load(rows[0] + h), V::load(rows[1] + h));
  } else if constexpr (W == 4) {
    a = add_o(add_o(add_o(V::load(rows[0] + h), V::load(rows[1] + h)), V::load(rows[2] + h)),
              V::load(rows[3] + h));
  } else {
    a = V::load(rows[0] + h);
    for (int j = 1; j < world; ++j) a = add_o(a, V::load(rows[j] + h));
  }
  if constexpr (!NORM) {
    const auto s = V::pack(a);
    V::put(dst + h, s);
    if constexpr (SUM != kSlotNone) V::put(sum_dst + h, s);
  } else {
    // one input: values of T already (see bf16_pass1_step), unless the sum is stored too
    __m256 pre = W == 1 && SUM == kSlotNone ? a : V::round(a);
    if constexpr (SUM == kSlotSum) V::put(sum_dst + h, V::narrow(pre));
    if constexpr (RES) pre = add_o(pre, V::load(res + h));
    __m256 r = V::round(pre);
    const auto rb = V::narrow(r);
    V::put(dst + h, rb);
    if constexpr (SUM == kSlotResidualOut) V::put(sum_dst + h, rb);
    acc = add_o(acc, _mm256_mul_ps(r, r));
  }
}

// The first pass over [0, n32) of a row or of a segment of one (n32 a multiple of 32): the
// squares go on into the lane sums in lanes (the caller zeroes them for a new row). acc[q]
// holds lanes 8q..8q+7 (bf16: the even and the odd lanes of 0-15, then of 16-31).
template <int D, int W, bool NORM, bool RES, int SUM>
void pass1(const typename Elem<D>::T* const* rows, int world, int64_t n32,
           const typename Elem<D>::T* res, typename Elem<D>::T* dst,
           typename Elem<D>::T* sum_dst, float* lanes) {
  static_assert(kSumLanes == 4 * kWide, "four accumulators of 8 lanes");
  __m256 acc[4];
  if constexpr (D == kBF16) {
    for (int half = 0; half < 2; ++half) {  // lanes 16 * half + 0..15 -> even, odd
      const __m256 a = _mm256_loadu_ps(lanes + 16 * half);
      const __m256 b = _mm256_loadu_ps(lanes + 16 * half + kWide);
      // per 128 bits: 0 2 8 10 | 4 6 12 14 (and 1 3 9 11 | 5 7 13 15); then 64-bit pairs in order
      const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
      const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      acc[2 * half] = _mm256_castpd_ps(
          _mm256_permute4x64_pd(_mm256_castps_pd(even), _MM_SHUFFLE(3, 1, 2, 0)));
      acc[2 * half + 1] = _mm256_castpd_ps(
          _mm256_permute4x64_pd(_mm256_castps_pd(odd), _MM_SHUFFLE(3, 1, 2, 0)));
    }
  } else {
    for (int q = 0; q < 4; ++q) acc[q] = _mm256_loadu_ps(lanes + q * kWide);
  }
  if constexpr (D == kBF16) {
    for (int64_t h = 0; h < n32; h += 32) {
      bf16_pass1_step<W, NORM, RES, SUM>(rows, world, h, res, dst, sum_dst, acc[0], acc[1]);
      bf16_pass1_step<W, NORM, RES, SUM>(rows, world, h + 16, res, dst, sum_dst, acc[2],
                                         acc[3]);
    }
    for (int half = 0; half < 2; ++half) {  // the 16 at 16 * half: even = acc[2 * half]
      // e0 o0 e1 o1 | e4 o4 e5 o5 and e2 o2 e3 o3 | e6 o6 e7 o7, then 128-bit halves in order
      const __m256 low = _mm256_unpacklo_ps(acc[2 * half], acc[2 * half + 1]);
      const __m256 high = _mm256_unpackhi_ps(acc[2 * half], acc[2 * half + 1]);
      _mm256_storeu_ps(lanes + 16 * half, _mm256_permute2f128_ps(low, high, 0x20));
      _mm256_storeu_ps(lanes + 16 * half + kWide, _mm256_permute2f128_ps(low, high, 0x31));
    }
  } else {
    for (int64_t h = 0; h < n32; h += 32) {
      for (int q = 0; q < 4; ++q) {
        pass1_step<D, W, NORM, RES, SUM>(rows, world, h + q * kWide, res, dst, sum_dst, acc[q]);
      }
    }
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(lanes + q * kWide, acc[q]);
  }
}

// Second pass: out = T((r * inv) * gain), r read back from residual_out (exact: it holds r
// in T), gain as gain_row laid it out.
template <int D, bool kStream = false>
int64_t row_scale(const typename Elem<D>::T* r, const float* __restrict gain, int64_t n,
                  float inv, typename Elem<D>::T* out) {
  if constexpr (!Vec<D>::ok) {
    return 0;
  } else {
    using V = Vec<D>;
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t k = 0;
    if constexpr (D == kBF16) {  // gain holds [0, n / 16 * 16) in BF16x16 order
      for (; k + 16 <= n; k += 16) {
        if constexpr (!kStream) prefetch_write(out + k);  // see memory_access.h
        const BF16x16 v = BF16x16::load(r + k);
        const __m256 even = mul_o(mul_o(v.even, vinv), _mm256_loadu_ps(gain + k));
        const __m256 odd = mul_o(mul_o(v.odd, vinv), _mm256_loadu_ps(gain + k + 8));
        put_bits<kStream>(out + k, BF16x16::bits(bf16x8_round32(even), bf16x8_round32(odd)));
      }
    }
    for (; k + kWide <= n; k += kWide) {
      if constexpr (!kStream) prefetch_write(out + k);
      __m256 scaled = mul_o(V::load(r + k), vinv);
      put_bits<kStream>(out + k, V::pack(mul_o(scaled, _mm256_loadu_ps(gain + k))));
    }
    return k;
  }
}

// gain = weight_bias + f32(w), in the order row_scale reads it (BF16x16 order for bf16).
template <int D>
int64_t gain_row(const typename Elem<D>::T* w, float weight_bias, int64_t n, float* gain) {
  if constexpr (!Vec<D>::ok) {
    return 0;
  } else {
    const __m256 vb = _mm256_set1_ps(weight_bias);
    int64_t k = 0;
    if constexpr (D == kBF16) {
      for (; k + 16 <= n; k += 16) {
        const BF16x16 v = BF16x16::load(w + k);
        _mm256_storeu_ps(gain + k, _mm256_add_ps(vb, v.even));
        _mm256_storeu_ps(gain + k + 8, _mm256_add_ps(vb, v.odd));
      }
    }
    for (; k + kWide <= n; k += kWide) {
      _mm256_storeu_ps(gain + k, _mm256_add_ps(vb, Vec<D>::load(w + k)));
    }
    return k;
  }
}

// src rounded to T, 8 at a time (a test hook: the vector rounding against the scalar one).
template <int D>
int64_t convert_row(const float* src, int64_t n, typename Elem<D>::T* dst) {
  if constexpr (!Vec<D>::ok) {
    return 0;
  } else {
    int64_t h = 0;
    for (; h + kWide <= n; h += kWide) {
      Vec<D>::put(dst + h, Vec<D>::pack(_mm256_loadu_ps(src + h)));
    }
    return h;
  }
}

// 8 floats -> 8 e4m3 codes in the low 8 bytes; the same rounding as f32_to_e4m3.
inline __m128i e4m3x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256 a = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  const __m256i au = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(au, 20), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(
      au, _mm256_add_epi32(_mm256_set1_epi32(int(e4m3::kRoundBias)), lsb));
  const __m256i normal = _mm256_or_si256(
      _mm256_slli_epi32(
          _mm256_sub_epi32(_mm256_srli_epi32(r, 23), _mm256_set1_epi32(int(e4m3::kRebias))), 3),
      _mm256_and_si256(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(7)));
  // below kMinNormal: a * kSubnormalSteps rounded to an integer, nearest even
  const __m256 t = _mm256_add_ps(_mm256_mul_ps(a, _mm256_set1_ps(e4m3::kSubnormalSteps)),
                                 _mm256_set1_ps(e4m3::kIntegerRounding));
  const __m256i small = _mm256_sub_epi32(_mm256_castps_si256(t),
                                         _mm256_set1_epi32(int(e4m3::kIntegerRoundingBits)));
  const __m256 is_small = _mm256_cmp_ps(a, _mm256_set1_ps(e4m3::kMinNormal), _CMP_LT_OQ);
  __m256i code = _mm256_blendv_epi8(normal, small, _mm256_castps_si256(is_small));
  code = _mm256_min_epi32(code, _mm256_set1_epi32(int(e4m3::kMaxCode)));  // saturate
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(int(e4m3::kNaNCode)),
                            _mm256_castps_si256(nan));
  code = _mm256_or_si256(code, sign);
  const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(code),
                                       _mm256_extracti128_si256(code, 1));
  return _mm_packus_epi16(w16, w16);
}

template <int D>
int64_t fp8_row(const typename Elem<D>::T* out, float inv_scale, int64_t n, uint8_t* dst) {
  if constexpr (!Vec<D>::ok) {
    return 0;
  } else {
    const __m256 vs = _mm256_set1_ps(inv_scale);
    int64_t h = 0;
    for (; h + kWide <= n; h += kWide) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + h),
                       e4m3x8(_mm256_mul_ps(Vec<D>::load(out + h), vs)));
    }
    return h;
  }
}

// max |out| over the leading multiple of 8 ignoring NaN (a NaN lane counts as 0; every
// |v| >= 0), in *amax.
template <int D>
int64_t amax_row(const typename Elem<D>::T* out, int64_t n, float* amax) {
  if constexpr (!Vec<D>::ok) {
    return 0;
  } else {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    int64_t h = 0;
    for (; h + kWide <= n; h += kWide) {
      const __m256 v = Vec<D>::load(out + h);
      const __m256 ord = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
      mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_and_ps(v, abs_mask), ord));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    *amax = _mm_cvtss_f32(m4);
    return h;
  }
}

// e4m3 codes of out / scale (an IEEE division, as fp8_dynamic_quantize).
template <int D>
int64_t fp8_div_row(const typename Elem<D>::T* out, float scale, int64_t n, uint8_t* dst) {
  if constexpr (!Vec<D>::ok) {
    return 0;
  } else {
    const __m256 vs = _mm256_set1_ps(scale);
    int64_t h = 0;
    for (; h + kWide <= n; h += kWide) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + h),
                       e4m3x8(_mm256_div_ps(Vec<D>::load(out + h), vs)));
    }
    return h;
  }
}

// 8 floats -> 8 e2m1 codes (int32 lanes); the same thresholds as f32_to_e2m1. The unordered
// "not <=" / "not <" comparisons are "greater" / "greater or equal" for numbers and true for a
// NaN, which so passes every threshold: code 7 (+6, its sign bit dropped), as f32_to_e2m1.
inline __m256i e2m1x8(__m256 v) {
  const __m256 m = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  __m256i code = _mm256_setzero_si256();
  auto count = [&](float threshold, bool strict) {
    __m256 hit = strict ? _mm256_cmp_ps(m, _mm256_set1_ps(threshold), _CMP_NLE_UQ)
                        : _mm256_cmp_ps(m, _mm256_set1_ps(threshold), _CMP_NLT_UQ);
    code = _mm256_sub_epi32(code, _mm256_castps_si256(hit));  // a hit is -1
  };
  for (const E2m1Threshold& t : kE2m1Thresholds) count(float(t.at), t.strict);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(_mm256_castps_si256(v), 31), 3);
  return _mm256_or_si256(code, _mm256_and_si256(sign, ordered));
}

// 16 e2m1 codes (two vectors, element order) -> 8 bytes, the even element in the low nibble.
inline __m128i pack_e2m1x16(__m256i c0, __m256i c1) {
  __m256i w16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(c0, c1), 0xd8);
  __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(w16),
                                   _mm256_extracti128_si256(w16, 1));
  __m128i pairs = _mm_maddubs_epi16(bytes, _mm_set1_epi16(0x1001));  // lo + 16 * hi
  return _mm_packus_epi16(pairs, pairs);
}

// One NVFP4 block of 16 (see quantize in epilogue.h for the rule): the 8 code bytes, and the
// e4m3 block scale in *sf. The amax ignores NaN (a NaN lane counts as 0; every |v| >= 0) unless
// all 16 are NaN, as __hmax2 / fmaxf do in FlashInfer.
template <int D>
bool nvfp4_block(const typename Elem<D>::T* v16, float gs, uint8_t* codes8, uint8_t* sf) {
  if constexpr (!Vec<D>::ok) {
    return false;
  } else {
    const __m256 v0 = Vec<D>::load(v16);
    const __m256 v1 = Vec<D>::load(v16 + 8);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 ord0 = _mm256_cmp_ps(v0, v0, _CMP_ORD_Q);
    const __m256 ord1 = _mm256_cmp_ps(v1, v1, _CMP_ORD_Q);
    __m256 mx = _mm256_max_ps(_mm256_and_ps(_mm256_and_ps(v0, abs_mask), ord0),
                              _mm256_and_ps(_mm256_and_ps(v1, abs_mask), ord1));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    if (_mm256_movemask_ps(_mm256_or_ps(ord0, ord1)) == 0) amax = NAN;  // all 16 NaN
    const uint8_t scale = f32_to_e4m3(gs * (amax * kE2m1MaxInverse));
    const float sfq = g_e4m3_decode[scale];
    const __m256 es = _mm256_set1_ps(sfq != 0.0f ? gs / sfq : 0.0f);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes8),
                     pack_e2m1x16(e2m1x8(_mm256_mul_ps(v0, es)),
                                  e2m1x8(_mm256_mul_ps(v1, es))));
    *sf = scale;
    return true;
  }
}

}  // namespace isa
}  // namespace arfuse
