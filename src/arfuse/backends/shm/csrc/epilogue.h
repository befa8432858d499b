// The epilogue of one row: reduce the ranks' rows (rank order), then the residual add, RMSNorm
// and quantisation. Identical on every rank and in one-shot and two-shot mode:
//
//   acc = sum_r f32(x_r) in rank order; sum = T(acc); residual_out = T(f32(sum) + f32(res));
//   r = f32(residual_out); ss = sum of r*r in 32 lanes (lane = h % 32, each in order of h),
//          combined by halving (lane i + lane i + 16 for i < 16, then i + 8, 4, 2, 1);
//   inv = 1 / sqrt(ss / H + eps); out = T((r * inv) * (weight_bias + f32(w)));
//   then quant_out and scale_out from out by the output's rule (quant_outputs.h: its row
//          says the rule, the span of a scale, the floor and where each scale goes).
// The NVFP4 NaN rule is FlashInfer's (trtllm_allreduce_fusion.cuh, cvt_warp_fp16_to_fp4): the
// block amax is taken with __hmax2/__hmax, which return the other operand for a NaN, and the
// codes with cvt.rn.satfinite.e2m1x2.f32, which turns a NaN into +MAX_NORM (cuda_fp4.hpp).
// The vector forms (vec.h) and the scalar loops here compute the same values in the same
// order (lane = h % 32), a NaN included (add_o, mul_o in conversions.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "conversions.h"
#include "layout.h"
#include "memory_access.h"
#include "parallel.h"
#include "vec.h"

namespace arfuse {

struct Call {  // one call's arguments, resolved to raw pointers
  int64_t tokens = 0;
  int64_t hidden = 0;
  int64_t op = 0;  // the op making the call (signature.h)
  int64_t moe = 0;  // a MoE call's word-0 bits (signature.h); x is then its expert step's rows
  const void* residual = nullptr;
  const void* weight = nullptr;
  float eps = 0.0f, weight_bias = 0.0f;
  int output = kOutputNone;  // a code of kQuantOutputs (quant_outputs.h)
  float scale = 0.0f;
  int64_t group_size = 0;  // a per-token-group output's group size (0: none)
  void* out = nullptr;
  void* residual_out = nullptr;
  uint8_t* quant_out = nullptr;
  uint8_t* scale_out = nullptr;
  const float* gain = nullptr;  // weight_bias + f32(w), see compute_gain
  // Streaming stores for out (not when quantising, which reads out back; with RMSNorm from the
  // second pass, rows of whole lines; without, through a staging row) and residual_out
  // (through staging, since the second pass reads the row back). staging: two rows of T,
  // 64-byte aligned. See ShmComm::make_call for when.
  bool stream_out = false;
  bool stream_residual_out = false;
  void* staging = nullptr;
  // Two-shot: the owner's result slot holds its rows' residual_out instead of their sum, and
  // the others finish those rows from it without reading their own residual. Only when the
  // caller promised the residual is the same on every rank (replicated_residual): then both
  // give the same bytes. See ShmComm::make_call.
  bool slot_holds_residual_out = false;
};

// gain = weight_bias + f32(w), once per call instead of once per row.
template <int D>
void compute_gain(const typename Elem<D>::T* w, float weight_bias, int64_t hidden, float* gain) {
  int64_t k = isa::gain_row<D>(w, weight_bias, hidden, gain);
  for (; k < hidden; ++k) gain[k] = add_o(weight_bias, Elem<D>::load(w[k]));
}

// One block of the encode-block rule (NVFP4) in scalar code: the same values as
// isa::nvfp4_block. Always compiled, so that a test can compare it with the vector form on a
// machine that has one.
template <int D>
ARFUSE_NO_LOOP_VECTORIZE void nvfp4_block_scalar(const typename Elem<D>::T* v16, float gs, uint8_t* codes8,
                        uint8_t* sf) {
  float vals[16];
  float amax = NAN;  // fmax(NaN, a) = a: NaN only when all 16 are NaN
  for (int i = 0; i < 16; ++i) {
    vals[i] = Elem<D>::load(v16[i]);
    amax = std::fmax(amax, std::fabs(vals[i]));
  }
  const uint8_t scale = f32_to_e4m3(mul_o(gs, amax * kE2m1MaxInverse));
  const float sfq = g_e4m3_decode[scale];
  const float es = sfq != 0.0f ? gs / sfq : 0.0f;
  for (int i = 0; i < 16; i += 2) {
    const uint8_t lo = f32_to_e2m1(vals[i] * es);
    const uint8_t hi = f32_to_e2m1(vals[i + 1] * es);
    codes8[i / 2] = uint8_t(lo | (hi << 4));
  }
  *sf = scale;
}

// The largest of amax and |v| where |v| is a number: a NaN, signalling or quiet, is skipped
// (std::fmax returns NaN for a signalling NaN), as the vector forms' ordered mask does.
inline float max_ignoring_nan(float amax, float v) {
  const float m = std::fabs(v);
  return m > amax ? m : amax;
}

// The amax of n elements of out ignoring NaN (the vector form, then the scalar rest).
template <int D>
float amax_of(const typename Elem<D>::T* out, int64_t n) {
  float amax = 0.0f;
  int64_t h = isa::amax_row<D>(out, n, &amax);
  for (; h < n; ++h) amax = max_ignoring_nan(amax, Elem<D>::load(out[h]));
  return amax;
}

// e4m3 codes of n elements of out / scale (an IEEE division).
template <int D>
void fp8_divide(const typename Elem<D>::T* out, float scale, int64_t n, uint8_t* dst) {
  int64_t h = isa::fp8_div_row<D>(out, scale, n, dst);
  for (; h < n; ++h) dst[h] = f32_to_e4m3(div_o(Elem<D>::load(out[h]), scale));
}

// The scale of a span whose amax (NaN ignored) is `amax`, by an amax rule of quant_outputs.h;
// *byte: what a byte-wide scale_out stores of it (the power-of-two rule's exponent byte).
inline float span_scale(const QuantOutput& q, float amax, uint8_t* byte) {
  const float floor = float(q.floor);
  if (q.rule == kRuleAmaxOverMax) return std::max(amax / e4m3::kMax, floor);
  if (q.rule == kRuleFloorOverMax) return std::max(amax, floor) / e4m3::kMax;
  uint32_t b = bits_of(std::max(amax / e4m3::kMax, floor));  // kRulePowerOfTwo
  if (b & 0x7fffffu) b = (b + 0x800000u) & 0x7f800000u;
  *byte = uint8_t(b >> 23);
  return float_of(b);
}

// Where scale k of row `row` goes: its float in a float32 scale_out, else its byte.
inline float* scale_float(const QuantOutput& q, const Call& c, const ScaleGeometry& g,
                          int64_t row, int64_t k) {
  return reinterpret_cast<float*>(c.scale_out) + scale_element(q, g, row, k);
}
inline uint8_t* scale_byte(const QuantOutput& q, const Call& c, const ScaleGeometry& g,
                           int64_t row, int64_t k) {
  return c.scale_out + scale_element(q, g, row, k) * q.scale_pack + k % q.scale_pack;
}

// Quantise columns [s, e) of row `row` of out (already rounded to T) into c.quant_out /
// c.scale_out by the output's rule (quant_outputs.h); s and e are multiples of its span (a
// group, a block of 16), or 0 and H.
template <int D>
void quantize_columns(const typename Elem<D>::T* out, const Call& c, int64_t row, int64_t s,
                      int64_t e) {
  const QuantOutput& q = *quant_output(c.output);
  const int64_t H = c.hidden;
  if (q.rule == kRuleNone) return;
  uint8_t* dst = c.quant_out + row * (H / q.data_pack);
  if (q.rule == kRuleStatic) {
    const float inv_scale = 1.0f / c.scale;
    int64_t h = s + isa::fp8_row<D>(out + s, inv_scale, e - s, dst + s);
    for (; h < e; ++h) dst[h] = f32_to_e4m3(mul_o(Elem<D>::load(out[h]), inv_scale));
    return;
  }
  const int64_t span = scale_span(q, H, c.group_size);
  const ScaleGeometry g = scale_geometry(q, c.tokens, H, c.group_size);
  for (int64_t k = s / span; k < e / span; ++k) {
    const typename Elem<D>::T* v = out + k * span;
    if (q.rule == kRuleEncodeBlock) {  // span == kEncodeBlock: the block forms' 16
      uint8_t* sf = scale_byte(q, c, g, row, k);
      if (!isa::nvfp4_block<D>(v, c.scale, dst + k * (span / 2), sf)) {
        nvfp4_block_scalar<D>(v, c.scale, dst + k * (span / 2), sf);
      }
      continue;
    }
    uint8_t byte = 0;
    const float scale = span_scale(q, amax_of<D>(v, span), &byte);
    if (q.scale_type == kQuantTypeFloat32) {
      *scale_float(q, c, g, row, k) = scale;
    } else {
      *scale_byte(q, c, g, row, k) = byte;
    }
    fp8_divide<D>(v, scale, span, dst + k * span);
  }
}

// Whether quantize_columns can take a row by column ranges (an output with one scale per row
// takes the whole row's amax: the calling thread quantises it at the end).
inline bool quantizes_by_columns(const Call& c) {
  const QuantOutput& q = *quant_output(c.output);
  return q.rule == kRuleStatic || q.scale_group != 0;
}

// Quantise row `row` of out (already rounded to T) into c.quant_out / c.scale_out.
template <int D>
void quantize_row(const typename Elem<D>::T* out, const Call& c, int64_t row) {
  quantize_columns<D>(out, c, row, 0, c.hidden);
}

// The lane sums combined in the documented order (halving: lane i + lane i + width).
inline float combine_lanes(float* lanes) {
  for (int width = kSumLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] = add_o(lanes[i], lanes[i + width]);
  }
  return lanes[0];
}

// The first pass of a row by the vector form, as many elements as it takes.
template <int D>
int64_t vector_sum(const typename Elem<D>::T* const* rows, int ranks, int64_t H,
                   const typename Elem<D>::T* res, bool norm, typename Elem<D>::T* out,
                   typename Elem<D>::T* residual_out, float* lanes,
                   typename Elem<D>::T* sum_out, bool slot_residual_out) {
  if (sum_out) {
    if (!norm) return isa::row_sum<D, false, false, kSlotSum>(rows, ranks, H, nullptr, out,
                                                              lanes, sum_out);
    if (res && slot_residual_out) {
      return isa::row_sum<D, true, true, kSlotResidualOut>(rows, ranks, H, res, residual_out,
                                                           lanes, sum_out);
    }
    if (res) return isa::row_sum<D, true, true, kSlotSum>(rows, ranks, H, res, residual_out,
                                                          lanes, sum_out);
    return isa::row_sum<D, true, false, kSlotSum>(rows, ranks, H, nullptr, residual_out, lanes,
                                                  sum_out);
  }
  if (!norm) return isa::row_sum<D, false, false, kSlotNone>(rows, ranks, H, nullptr, out,
                                                             lanes, nullptr);
  if (res) return isa::row_sum<D, true, true, kSlotNone>(rows, ranks, H, res, residual_out,
                                                         lanes, nullptr);
  return isa::row_sum<D, true, false, kSlotNone>(rows, ranks, H, nullptr, residual_out, lanes,
                                                 nullptr);
}

// Pass 1 over [begin, end) of one row (begin a multiple of kSumLanes): the sum of the ranks'
// rows (rank order), rounded to T; plain: into out; norm: plus the residual, rounded, into
// residual_out, the squares going on into lanes. sum_out (may be null): the rounded sum there
// too, or residual_out when slot_residual_out (two-shot: the owner's result slot, which the
// others finish their rows from). The
// vector form takes the whole multiples of kSumLanes, the scalar loop the rest, with the same
// operations in the same order (NaN rule: add_o, mul_o).
template <int D>
void first_pass(const typename Elem<D>::T* const* rows, int ranks,
                const typename Elem<D>::T* res, bool norm, typename Elem<D>::T* out,
                typename Elem<D>::T* residual_out, typename Elem<D>::T* sum_out, float* lanes,
                int64_t begin, int64_t end, bool slot_residual_out = false) {
  using E = Elem<D>;
  using T = typename E::T;
  const T* from[layout::kMaxWorld];
  for (int j = 0; j < ranks; ++j) from[j] = rows[j] + begin;
  const bool slot_gets_residual_out = slot_residual_out && norm && res != nullptr;
  int64_t h = begin + vector_sum<D>(from, ranks, end - begin, res ? res + begin : nullptr, norm,
                                    out + begin, norm ? residual_out + begin : nullptr, lanes,
                                    sum_out ? sum_out + begin : nullptr,
                                    slot_gets_residual_out);
  for (; h < end; ++h) {
    float a = E::load(rows[0][h]);
    for (int j = 1; j < ranks; ++j) a = add_o(a, E::load(rows[j][h]));
    const T sum = E::store(a);
    if (sum_out && !slot_gets_residual_out) sum_out[h] = sum;
    if (!norm) {
      out[h] = sum;
      continue;
    }
    float pre = E::load(sum);
    if (res) pre = add_o(pre, E::load(res[h]));
    T rounded = E::store(pre);
    residual_out[h] = rounded;
    if (sum_out && slot_gets_residual_out) sum_out[h] = rounded;
    float r = E::load(rounded);
    float sq = r * r;
    lanes[h % kSumLanes] = add_o(lanes[h % kSumLanes], sq);
  }
}

// The RMSNorm factor of a row from its lane sums: 1 / sqrt(ss / H + eps).
inline float row_inv(const Call& c, float* lanes) {
  const float ss = combine_lanes(lanes);
  return 1.0f / std::sqrt(ss / float(c.hidden) + c.eps);
}

// Pass 2 over [begin, end) of one row (begin a multiple of kSumLanes): out from residual_out
// (exact: it holds r in T) and the gain.
template <int D>
void second_pass(const Call& c, float inv, const typename Elem<D>::T* residual_out,
                 typename Elem<D>::T* out, int64_t begin, int64_t end) {
  const typename Elem<D>::T* r = residual_out + begin;
  const float* gain = c.gain + begin;
  const int64_t n = end - begin;
  int64_t k = begin + (c.stream_out ? isa::row_scale<D, true>(r, gain, n, inv, out + begin)
                                    : isa::row_scale<D>(r, gain, n, inv, out + begin));
  for (; k < end; ++k) {
    float scaled = mul_o(Elem<D>::load(residual_out[k]), inv);
    out[k] = Elem<D>::store(mul_o(scaled, c.gain[k]));
  }
}

// Elements per segment of a row in finish_rows (256-1024 measured alike).
constexpr int64_t kSegment = 512;
static_assert(kSegment % kSumLanes == 0, "segments start on a whole step of lanes");

// How many times finish_rows of n rows calls its `between` hook.
inline int64_t between_calls(const Call& c, int64_t n) {
  return c.weight != nullptr ? (n + 1) * ((c.hidden + kSegment - 1) / kSegment) : n;
}

struct NothingBetween {
  void operator()() const {}
};

// Reduce rows [in_row, in_row + n) of `ranks` inputs (rank order) and run the whole epilogue
// on them, with rows [row, row + n) of the residual and of the quantised outputs; out,
// residual_out and sum_out (may be null) point at the first row's. With RMSNorm a row takes two
// passes (the second needs the first's sum of squares): pass 1 of each row runs in segments,
// each followed by the same segment of pass 2 of the row before, so that the second pass runs
// while the first pass's loads from other cores are in flight. between() runs after each
// segment (RMSNorm) or row (plain all-reduce, one pass): other work that stores while these
// rows load (two-shot: the copy of the next step into the slot).
template <int D, class Between = NothingBetween>
void finish_rows_serial(const typename Elem<D>::T* const* inputs, int ranks, int64_t in_row,
                        int64_t row, int64_t n, const Call& c, typename Elem<D>::T* out,
                        typename Elem<D>::T* residual_out, typename Elem<D>::T* sum_out = nullptr,
                        Between&& between = Between{}) {
  using T = typename Elem<D>::T;
  const int64_t H = c.hidden;
  const bool norm = c.weight != nullptr;
  const T* residual = c.residual ? static_cast<const T*>(c.residual) + row * H : nullptr;
  const T* rows[layout::kMaxWorld];
  T* const staging = static_cast<T*>(c.staging);
  if (!norm) {  // the plain all-reduce: one pass (the sum into out)
    for (int64_t i = 0; i < n; ++i) {
      float lanes[kSumLanes] = {};  // unused without RMSNorm
      for (int j = 0; j < ranks; ++j) rows[j] = inputs[j] + (in_row + i) * H;
      first_pass<D>(rows, ranks, nullptr, false, c.stream_out ? staging : out + i * H, nullptr,
                    sum_out ? sum_out + i * H : nullptr, lanes, 0, H);
      if (c.stream_out) {
        stream_store(reinterpret_cast<char*>(out + i * H),
                     reinterpret_cast<const char*>(staging), size_t(H) * sizeof(T));
      }
      quantize_row<D>(out + i * H, c, row + i);
      between();
    }
    if (c.stream_out) stream_fence();
    return;
  }
  // Where pass 1 puts a row's residual_out and pass 2 reads it: residual_out itself, or with
  // streaming stores one of two staging rows (row i in i % 2), stored out by pass 2.
  float inv_before = 0.0f;  // the row before's
  for (int64_t i = 0; i <= n; ++i) {
    const bool now = i < n, before = i > 0;
    float lanes[kSumLanes] = {};
    for (int j = 0; j < ranks; ++j) rows[j] = inputs[j] + (in_row + i) * H;
    T* const kept_now = c.stream_residual_out ? staging + (i & 1) * H : residual_out + i * H;
    T* const kept_before =
        c.stream_residual_out ? staging + ((i - 1) & 1) * H : residual_out + (i - 1) * H;
    for (int64_t s = 0; s < H; s += kSegment) {
      const int64_t e = std::min(H, s + kSegment);
      if (now) {
        first_pass<D>(rows, ranks, residual ? residual + i * H : nullptr, true, out + i * H,
                      kept_now, sum_out ? sum_out + i * H : nullptr, lanes, s, e,
                      c.slot_holds_residual_out);
      }
      if (before) {
        second_pass<D>(c, inv_before, kept_before, out + (i - 1) * H, s, e);
        if (c.stream_residual_out) {
          stream_store(reinterpret_cast<char*>(residual_out + (i - 1) * H + s),
                       reinterpret_cast<const char*>(kept_before + s), size_t(e - s) * sizeof(T));
        }
      }
      between();
    }
    if (before) quantize_row<D>(out + (i - 1) * H, c, row + i - 1);
    if (now) inv_before = row_inv(c, lanes);
  }
  if (c.stream_out || c.stream_residual_out) stream_fence();
}

}  // namespace arfuse
