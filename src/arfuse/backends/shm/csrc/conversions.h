// Scalar element conversions, each rounding to nearest even as torch does: bf16, fp16 and fp32
// activations, e4m3 (FP8) and e2m1 (NVFP4 element) codes. The vector headers (vec_*.h) compute
// exactly these values, lane by lane.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "numerics.h"       // kSumLanes
#include "quant_outputs.h"  // the formats' numbers
#include "signature.h"      // the dtype codes

namespace arfuse {

// The e4m3 (FP8) rounding, in one place for the scalar form below and the vector forms: round
// to nearest even onto 3 mantissa bits (add kRoundBias and the kept lsb, then shift), rebias
// the exponent, saturate finite values and infinities to kMaxCode; below kMinNormal, steps of
// 1 / kSubnormalSteps. The vector forms round those with the 2^23 trick (kIntegerRounding).
namespace e4m3 {
constexpr float kMax = float(kE4m3Max);     // the largest finite value, code kMaxCode
constexpr uint32_t kMaxCode = 0x7e;
constexpr uint32_t kNaNCode = 0x7f;
constexpr float kMinNormal = 0.015625f;     // 2^-6
constexpr float kSubnormalSteps = 512.0f;   // 2^9
constexpr uint32_t kRoundBias = 0x7ffff;    // half of the 20 dropped mantissa bits, less one
constexpr uint32_t kRebias = 120;           // fp32's exponent bias 127 less e4m3's 7
constexpr float kIntegerRounding = 8388608.0f;  // 2^23: v + 2^23, v in [0, 2^22], rounds v
constexpr uint32_t kIntegerRoundingBits = 0x4b000000;  // the bits of 2^23
}  // namespace e4m3
// The encode-block rule's f32(1 / kE2m1Max) (NVFP4: f32(1/6)).
constexpr float kE2m1MaxInverse = float(1.0 / kE2m1Max);
// What the first pass also stores into the two-shot result slot, from which the other ranks
// finish the owner's rows: nothing, the rounded sum, or residual_out (when the residual is
// the same on every rank, a rank need not read its own to finish another owner's rows).
enum SlotStore { kSlotNone = 0, kSlotSum = 1, kSlotResidualOut = 2 };

inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// NaN propagation, made independent of the compiler and the machine: C++ leaves open which
// NaN an operation with two NaN operands returns, compilers swap the operands of + and *
// freely (to fold a load, say), and machines differ (aarch64 prefers a signaling operand, and
// its default NaN is positive), so the bytes of a NaN could differ between builds. The
// kernel's rule, on every instruction set, is the x86 one, stated in the documented operand
// order: the first operand if it is a NaN, else the second, made quiet; a NaN from numbers
// (inf - inf, 0 * inf, 0 / 0) is kDefaultNaN, x86's default NaN (negative; aarch64's own
// is 0x7fc00000). The scalar forms and the NEON forms apply it explicitly to every NaN result;
// the x86 vector forms issue the instruction with the operands in that order (inline asm),
// which is how x86 computes it.
constexpr uint32_t kDefaultNaNBits = 0xffc00000u;
inline float quiet_nan(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u |= 0x400000u;
  std::memcpy(&x, &u, 4);
  return x;
}
inline float nan_rule(float a, float b) {
  if (std::isnan(a)) return quiet_nan(a);
  return std::isnan(b) ? quiet_nan(b) : float_of(kDefaultNaNBits);
}
inline float add_o(float a, float b) {
  const float r = a + b;
  return r == r ? r : nan_rule(a, b);
}
inline float mul_o(float a, float b) {
  const float r = a * b;
  return r == r ? r : nan_rule(a, b);
}
inline float div_o(float a, float b) {
  const float r = a / b;
  return r == r ? r : nan_rule(a, b);
}

inline float bf16_to_f32(uint16_t v) { return float_of(uint32_t(v) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float fp16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return float_of(sign);
    float v = std::ldexp(float(mant), -24);  // subnormal: exact in fp32
    return sign ? -v : v;
  }
  if (exp == 31) {  // infinity; a NaN made quiet, as vcvtph2ps (and torch's vector path) do
    return float_of(sign | 0x7f800000u | (mant ? 0x400000u : 0u) | (mant << 13));
  }
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_fp16(float f) {
  uint32_t u = bits_of(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {  // NaN: quiet, the top of its payload kept, as vcvtps2ph (and torch)
    return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);          // rounds to inf
  if (a < 0x38800000u) {                                          // fp16 subnormal or zero
    float v = float_of(a) * 16777216.0f;                          // * 2^24, exact
    return uint16_t(sign | uint16_t(std::nearbyint(v)));          // RNE in default mode
  }
  uint32_t mant_round = a + 0xfffu + ((a >> 13) & 1u);
  return uint16_t(sign | uint16_t((mant_round - 0x38000000u) >> 13));
}

template <int D> struct Elem;
template <> struct Elem<kBF16> {
  using T = uint16_t;
  static float load(T v) { return bf16_to_f32(v); }
  static T store(float f) { return f32_to_bf16(f); }
};
template <> struct Elem<kFP16> {
  using T = uint16_t;
  static float load(T v) { return fp16_to_f32(v); }
  static T store(float f) { return f32_to_fp16(f); }
};
template <> struct Elem<kFP32> {
  using T = float;
  static float load(T v) { return v; }
  static T store(float f) { return f; }
};

// e4m3 code -> value (NaN for 0x7f/0xff); filled once by init_tables().
inline float g_e4m3_decode[256];

inline void init_tables() {
  for (int c = 0; c < 256; ++c) {
    int sign = c & 0x80, exp = (c >> 3) & 0xf, mant = c & 7;
    float v;
    if (exp == 0xf && mant == 7) v = NAN;
    else if (exp == 0) v = std::ldexp(float(mant), -9);
    else v = std::ldexp(1.0f + float(mant) / 8.0f, exp - 7);
    g_e4m3_decode[c] = sign ? -v : v;
  }
}

// Round to nearest even, saturate to +-448 (infinities included); NaN -> 0x7f with its sign.
inline uint8_t f32_to_e4m3(float f) {
  uint32_t u = bits_of(f);
  uint8_t sign = uint8_t((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | e4m3::kNaNCode);
  float af = float_of(a);
  if (af >= e4m3::kMax) return uint8_t(sign | e4m3::kMaxCode);
  if (af < e4m3::kMinNormal) {
    return uint8_t(sign | uint8_t(std::nearbyint(af * e4m3::kSubnormalSteps)));
  }
  uint32_t r = a + e4m3::kRoundBias + ((a >> 20) & 1u);
  uint32_t code = (((r >> 23) - e4m3::kRebias) << 3) | ((r >> 20) & 7u);
  if (code > e4m3::kMaxCode) code = e4m3::kMaxCode;
  return uint8_t(sign | code);
}

// Nearest even on {0,.5,1,1.5,2,3,4,6}, saturating (infinities to +-6). NaN -> 0x7 (+6): what
// cvt.rn.satfinite.e2m1x2.f32 gives (e2m1 has no NaN), as in FlashInfer's NVFP4 quantisation.
inline uint8_t f32_to_e2m1(float v) {
  constexpr uint8_t kNaNCode = uint8_t(sizeof(kE2m1Thresholds) / sizeof(kE2m1Thresholds[0]));
  if (std::isnan(v)) return kNaNCode;
  const float m = std::fabs(v);
  uint8_t code = 0;
  for (const E2m1Threshold& t : kE2m1Thresholds) {
    code += t.strict ? m > float(t.at) : m >= float(t.at);
  }
  return uint8_t(code | (std::signbit(v) ? 8 : 0));
}

}  // namespace arfuse
