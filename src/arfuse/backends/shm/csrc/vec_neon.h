// NEON (aarch64 Advanced SIMD; + BF16's conversion where the CPU has it) forms of the row
// kernels: 4 fp32 lanes per vector, the same values as the scalar forms in conversions.h. See
// vec.h for the interface. The sum of squares in its 32 lanes (lane = h % 32): eight 4-wide
// accumulators, acc[q] holding lanes 4q..4q+3, each lane added up in order of h. bf16 widens
// by a shift-left-long (one instruction), so it goes 4 elements at a time in element order
// like fp32 and fp16.
//
// NaN: aarch64 returns a signaling operand's NaN before a quiet one's and makes a positive
// default NaN, where the kernel's rule (conversions.h) is x86's; so every operation whose
// NaN result reaches an output goes through add_o, mul_o or div_o here, which put the rule's
// NaN into the lanes whose result is a NaN (a vector without one is left as it is). The
// squares of the sum of squares (r * r: one operand) and the e2m1 codes (a NaN's sign is
// dropped) need no rule.
//
// Conversions: fcvtn/fcvtl for fp16 and bfcvtn for bf16 round to nearest even and keep
// denormals in the environment float_env.h sets for a call (FPCR.FZ, FZ16, AH and RMode
// zero); a NaN keeps its sign and the top of its payload, made quiet, as f32_to_fp16 and
// f32_to_bf16 state (tests/test_isa_paths.py). Without BF16, bf16 is rounded in integers.
//
// Outputs are stored cached: no streaming store has been measured on Arm (memory_access.h).
#pragma once

#include <arm_neon.h>

#include <cstddef>
#include <cstdint>

#include "conversions.h"
#include "memory_access.h"

namespace arfuse {
namespace isa {

constexpr int kWide = 4;  // fp32 lanes per vector

#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
constexpr const char* kIsa = "neon+bf16";
#else
constexpr const char* kIsa = "neon";
#endif

constexpr int64_t stream_output_min_bytes(int /*dtype*/) { return INT64_MAX; }

using F32s = float32x4_t;  // the fp32 vector (moe.h)
inline F32s broadcast(float v) { return vdupq_n_f32(v); }

inline uint32x4_t bits(float32x4_t v) { return vreinterpretq_u32_f32(v); }
inline float32x4_t floats(uint32x4_t u) { return vreinterpretq_f32_u32(u); }
inline uint32x4_t is_nan(float32x4_t v) { return vmvnq_u32(vceqq_f32(v, v)); }

// r = a op b under the kernel's NaN rule (conversions.h): where r is a NaN, a's NaN made quiet
// if a is one, else b's, else kDefaultNaNBits.
inline float32x4_t nan_rule(float32x4_t a, float32x4_t b, float32x4_t r) {
  const uint32x4_t r_nan = is_nan(r);
  if (vmaxvq_u32(r_nan) == 0) return r;
  const uint32x4_t quiet = vdupq_n_u32(0x400000u);
  uint32x4_t fix = vbslq_u32(is_nan(b), vorrq_u32(bits(b), quiet), vdupq_n_u32(kDefaultNaNBits));
  fix = vbslq_u32(is_nan(a), vorrq_u32(bits(a), quiet), fix);
  return floats(vbslq_u32(r_nan, fix, bits(r)));
}
inline float32x4_t add_o(float32x4_t a, float32x4_t b) { return nan_rule(a, b, vaddq_f32(a, b)); }
inline float32x4_t mul_o(float32x4_t a, float32x4_t b) { return nan_rule(a, b, vmulq_f32(a, b)); }
inline float32x4_t div_o(float32x4_t a, float32x4_t b) { return nan_rule(a, b, vdivq_f32(a, b)); }

inline float32x4_t bf16x4_widen(uint16x4_t b) { return floats(vshll_n_u16(b, 16)); }
// The bf16 bits of 4 floats, rounded to nearest even (a NaN made quiet, sign and top of the
// payload kept).
inline uint16x4_t bf16x4_pack(float32x4_t v) {
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
  return vreinterpret_u16_bf16(vcvt_bf16_f32(v));
#else
  const uint32x4_t u = bits(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t rounded = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), lsb));
  const uint32x4_t quiet = vorrq_u32(u, vdupq_n_u32(0x400000));
  return vshrn_n_u32(vbslq_u32(is_nan(v), quiet, rounded), 16);
#endif
}

// pack: round 4 floats to the dtype (its bits); round: rounded, as floats; narrow: the bits of
// already rounded values; load: 4 elements as floats; put: store the bits.
template <int D> struct Vec;
template <> struct Vec<kBF16> {
  static constexpr bool ok = true;
  using B = uint16x4_t;
  static B pack(float32x4_t v) { return bf16x4_pack(v); }
  static float32x4_t round(float32x4_t v) { return bf16x4_widen(pack(v)); }
  static B narrow(float32x4_t rounded) { return vshrn_n_u32(bits(rounded), 16); }
  static float32x4_t load(const uint16_t* p) { return bf16x4_widen(vld1_u16(p)); }
  static void put(uint16_t* p, B b) { vst1_u16(p, b); }
};
template <> struct Vec<kFP16> {
  static constexpr bool ok = true;
  using B = uint16x4_t;
  static B pack(float32x4_t v) { return vreinterpret_u16_f16(vcvt_f16_f32(v)); }
  static float32x4_t round(float32x4_t v) { return vcvt_f32_f16(vcvt_f16_f32(v)); }
  static B narrow(float32x4_t rounded) { return pack(rounded); }
  static float32x4_t load(const uint16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  static void put(uint16_t* p, B b) { vst1_u16(p, b); }
};
template <> struct Vec<kFP32> {
  static constexpr bool ok = true;
  using B = float32x4_t;
  static B pack(float32x4_t v) { return v; }
  static float32x4_t round(float32x4_t v) { return v; }
  static B narrow(float32x4_t rounded) { return rounded; }
  static float32x4_t load(const float* p) { return vld1q_f32(p); }
  static void put(float* p, B b) { vst1q_f32(p, b); }
};

template <int D> struct Has { static constexpr bool value = Vec<D>::ok; };

// moe.h's bf16 chunk: 8 elements as two vectors (elements 0-3 in `even`, 4-7 in `odd`: the
// expert step is element-wise, so any split that store_rounded undoes serves).
struct BF16Pair {
  float32x4_t even, odd;
  static BF16Pair load(const uint16_t* p) {
    return {Vec<kBF16>::load(p), Vec<kBF16>::load(p + kWide)};
  }
  static void store_rounded(uint16_t* p, float32x4_t even, float32x4_t odd) {
    Vec<kBF16>::put(p, Vec<kBF16>::pack(even));
    Vec<kBF16>::put(p + kWide, Vec<kBF16>::pack(odd));
  }
};

// 4 elements at h of the first pass: sum the ranks (rank order); plain: store the rounded sum;
// norm: round, add the residual, round, store residual_out and add the squares of r to acc.
// SUM (SlotStore): also store the rounded sum or residual_out in sum_dst (the two-shot result
// slot). W is the world size when known at compile time (0: not). res and dst may be the same
// row (residual updated in place): each lane reads res[h] before it writes dst[h].
template <int D, int W, bool NORM, bool RES, int SUM>
inline void pass1_step(const typename Elem<D>::T* const* rows, int world, int64_t h,
                       const typename Elem<D>::T* res, typename Elem<D>::T* dst,
                       typename Elem<D>::T* sum_dst, float32x4_t& acc) {
  using V = Vec<D>;
  const int ranks = W > 0 ? W : world;
  float32x4_t a = V::load(rows[0] + h);
  for (int j = 1; j < ranks; ++j) a = add_o(a, V::load(rows[j] + h));
  if constexpr (!NORM) {
    const auto s = V::pack(a);
    V::put(dst + h, s);
    if constexpr (SUM != kSlotNone) V::put(sum_dst + h, s);
  } else {
    // one input holds values of T already (vec_avx2.h's bf16_pass1_step says why), unless the
    // sum is stored too
    float32x4_t pre = W == 1 && SUM == kSlotNone ? a : V::round(a);
    if constexpr (SUM == kSlotSum) V::put(sum_dst + h, V::narrow(pre));
    if constexpr (RES) pre = add_o(pre, V::load(res + h));
    const float32x4_t r = V::round(pre);
    const auto rb = V::narrow(r);
    V::put(dst + h, rb);
    if constexpr (SUM == kSlotResidualOut) V::put(sum_dst + h, rb);
    acc = add_o(acc, vmulq_f32(r, r));
  }
}

// The first pass over [0, n32) of a row or of a segment of one (n32 a multiple of 32): the
// squares go on into the lane sums in lanes (the caller zeroes them for a new row).
template <int D, int W, bool NORM, bool RES, int SUM>
void pass1(const typename Elem<D>::T* const* rows, int world, int64_t n32,
           const typename Elem<D>::T* res, typename Elem<D>::T* dst,
           typename Elem<D>::T* sum_dst, float* lanes) {
  constexpr int kAcc = kSumLanes / kWide;
  static_assert(kAcc * kWide == kSumLanes, "whole accumulators of lanes");
  float32x4_t acc[kAcc];
  for (int q = 0; q < kAcc; ++q) acc[q] = vld1q_f32(lanes + q * kWide);
  for (int64_t h = 0; h < n32; h += kSumLanes) {
    // a line of every row ahead, per 64 bytes of the widest dtype
    for (int64_t k = 0; k < kSumLanes; k += 16) {
      prefetch_step(rows, W > 0 ? W : world, h + k, dst, SUM != kSlotNone ? sum_dst : nullptr);
    }
    for (int q = 0; q < kAcc; ++q) {
      pass1_step<D, W, NORM, RES, SUM>(rows, world, h + q * kWide, res, dst, sum_dst, acc[q]);
    }
  }
  for (int q = 0; q < kAcc; ++q) vst1q_f32(lanes + q * kWide, acc[q]);
}

// Second pass: out = T((r * inv) * gain), r read back from residual_out (exact: it holds r in
// T), gain as gain_row laid it out (element order). kStream: plain stores here.
template <int D, bool kStream = false>
int64_t row_scale(const typename Elem<D>::T* r, const float* __restrict gain, int64_t n,
                  float inv, typename Elem<D>::T* out) {
  using V = Vec<D>;
  const float32x4_t vinv = vdupq_n_f32(inv);
  int64_t k = 0;
  for (; k + kWide <= n; k += kWide) {
    if (k % 16 == 0) prefetch_write(out + k);
    const float32x4_t scaled = mul_o(V::load(r + k), vinv);
    V::put(out + k, V::pack(mul_o(scaled, vld1q_f32(gain + k))));
  }
  return k;
}

// gain = weight_bias + f32(w), in element order.
template <int D>
int64_t gain_row(const typename Elem<D>::T* w, float weight_bias, int64_t n, float* gain) {
  const float32x4_t vb = vdupq_n_f32(weight_bias);
  int64_t k = 0;
  for (; k + kWide <= n; k += kWide) vst1q_f32(gain + k, add_o(vb, Vec<D>::load(w + k)));
  return k;
}

// src rounded to T, 4 at a time (a test hook: the vector rounding against the scalar one).
template <int D>
int64_t convert_row(const float* src, int64_t n, typename Elem<D>::T* dst) {
  int64_t h = 0;
  for (; h + kWide <= n; h += kWide) Vec<D>::put(dst + h, Vec<D>::pack(vld1q_f32(src + h)));
  return h;
}

// 4 floats -> 4 e4m3 codes (uint32 lanes); the same rounding as f32_to_e4m3.
inline uint32x4_t e4m3x4(float32x4_t v) {
  const uint32x4_t u = bits(v);
  const uint32x4_t sign = vandq_u32(vshrq_n_u32(u, 24), vdupq_n_u32(0x80));
  const uint32x4_t au = vandq_u32(u, vdupq_n_u32(0x7fffffff));
  const float32x4_t a = floats(au);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(au, 20), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(au, vaddq_u32(vdupq_n_u32(e4m3::kRoundBias), lsb));
  const uint32x4_t normal =
      vorrq_u32(vshlq_n_u32(vsubq_u32(vshrq_n_u32(r, 23), vdupq_n_u32(e4m3::kRebias)), 3),
                vandq_u32(vshrq_n_u32(r, 20), vdupq_n_u32(7)));
  // below kMinNormal: a * kSubnormalSteps rounded to an integer, nearest even
  const float32x4_t t = vaddq_f32(vmulq_f32(a, vdupq_n_f32(e4m3::kSubnormalSteps)),
                                  vdupq_n_f32(e4m3::kIntegerRounding));
  const uint32x4_t small = vsubq_u32(bits(t), vdupq_n_u32(e4m3::kIntegerRoundingBits));
  const uint32x4_t is_small = vcltq_f32(a, vdupq_n_f32(e4m3::kMinNormal));
  int32x4_t code = vreinterpretq_s32_u32(vbslq_u32(is_small, small, normal));
  code = vminq_s32(code, vdupq_n_s32(int32_t(e4m3::kMaxCode)));  // saturate (signed, as AVX2)
  uint32x4_t c = vbslq_u32(is_nan(v), vdupq_n_u32(e4m3::kNaNCode), vreinterpretq_u32_s32(code));
  return vorrq_u32(c, sign);
}
// 8 codes (two vectors, element order) as 8 bytes
inline uint8x8_t bytes8(uint32x4_t c0, uint32x4_t c1) {
  return vmovn_u16(vcombine_u16(vmovn_u32(c0), vmovn_u32(c1)));
}

template <int D>
int64_t fp8_row(const typename Elem<D>::T* out, float inv_scale, int64_t n, uint8_t* dst) {
  const float32x4_t vs = vdupq_n_f32(inv_scale);
  int64_t h = 0;
  for (; h + 2 * kWide <= n; h += 2 * kWide) {
    vst1_u8(dst + h, bytes8(e4m3x4(mul_o(Vec<D>::load(out + h), vs)),
                            e4m3x4(mul_o(Vec<D>::load(out + h + kWide), vs))));
  }
  return h;
}

// max |out| over the leading multiple of 4 ignoring NaN (a NaN lane counts as 0; every
// |v| >= 0), in *amax: a maximum, so the same whatever the width.
template <int D>
int64_t amax_row(const typename Elem<D>::T* out, int64_t n, float* amax) {
  float32x4_t mx = vdupq_n_f32(0.0f);
  int64_t h = 0;
  for (; h + kWide <= n; h += kWide) {
    const float32x4_t v = Vec<D>::load(out + h);
    mx = vmaxq_f32(mx, floats(vandq_u32(bits(vabsq_f32(v)), vceqq_f32(v, v))));
  }
  *amax = vmaxvq_f32(mx);
  return h;
}

// e4m3 codes of out / scale (an IEEE division, as fp8_dynamic_quantize).
template <int D>
int64_t fp8_div_row(const typename Elem<D>::T* out, float scale, int64_t n, uint8_t* dst) {
  const float32x4_t vs = vdupq_n_f32(scale);
  int64_t h = 0;
  for (; h + 2 * kWide <= n; h += 2 * kWide) {
    vst1_u8(dst + h, bytes8(e4m3x4(div_o(Vec<D>::load(out + h), vs)),
                            e4m3x4(div_o(Vec<D>::load(out + h + kWide), vs))));
  }
  return h;
}

// 4 floats -> 4 e2m1 codes (uint32 lanes); the same thresholds as f32_to_e2m1. "Not <=" / "not
// <" are "greater" / "greater or equal" for numbers and true for a NaN, which so passes every
// threshold: code 7 (+6, its sign bit dropped), as f32_to_e2m1.
inline uint32x4_t e2m1x4(float32x4_t v) {
  const float32x4_t m = vabsq_f32(v);
  uint32x4_t code = vdupq_n_u32(0);
  for (const E2m1Threshold& t : kE2m1Thresholds) {
    const float32x4_t at = vdupq_n_f32(float(t.at));
    const uint32x4_t hit = vmvnq_u32(t.strict ? vcleq_f32(m, at) : vcltq_f32(m, at));
    code = vsubq_u32(code, hit);  // a hit is all ones: -1
  }
  const uint32x4_t sign = vshlq_n_u32(vshrq_n_u32(bits(v), 31), 3);
  return vorrq_u32(code, vandq_u32(sign, vceqq_f32(v, v)));
}

// One NVFP4 block of 16 (see quantize in epilogue.h for the rule): the 8 code bytes (the even
// element in the low nibble), and the e4m3 block scale in *sf. The amax ignores NaN unless
// all 16 are NaN, as __hmax2 / fmaxf do in FlashInfer.
template <int D>
bool nvfp4_block(const typename Elem<D>::T* v16, float gs, uint8_t* codes8, uint8_t* sf) {
  float32x4_t v[4];
  uint32x4_t any = vdupq_n_u32(0);
  float32x4_t mx = vdupq_n_f32(0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = Vec<D>::load(v16 + i * kWide);
    const uint32x4_t ordered = vceqq_f32(v[i], v[i]);
    any = vorrq_u32(any, ordered);
    mx = vmaxq_f32(mx, floats(vandq_u32(bits(vabsq_f32(v[i])), ordered)));
  }
  const float amax = vmaxvq_u32(any) != 0 ? vmaxvq_f32(mx) : NAN;
  const uint8_t scale = f32_to_e4m3(arfuse::mul_o(gs, amax * kE2m1MaxInverse));
  const float sfq = g_e4m3_decode[scale];
  const float32x4_t es = vdupq_n_f32(sfq != 0.0f ? gs / sfq : 0.0f);
  const uint8x8_t lo = bytes8(e2m1x4(vmulq_f32(v[0], es)), e2m1x4(vmulq_f32(v[1], es)));
  const uint8x8_t hi = bytes8(e2m1x4(vmulq_f32(v[2], es)), e2m1x4(vmulq_f32(v[3], es)));
  const uint8x16_t all = vcombine_u8(lo, hi);
  const uint8x16_t packed = vorrq_u8(vuzp1q_u8(all, all), vshlq_n_u8(vuzp2q_u8(all, all), 4));
  vst1_u8(codes8, vget_low_u8(packed));
  *sf = scale;
  return true;
}

}  // namespace isa
}  // namespace arfuse
