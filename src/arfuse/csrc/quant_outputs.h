// The quantised outputs: one row per output a call can make, with its formats' constants. The
// only place an output is named, numbered and defined: the shm kernel (epilogue.h), the torch
// epilogue (arfuse.quant), the float64 reference (arfuse.reference), the CLI and the compile
// matcher read the row, not the output's name. Python reads the constexpr lines and the table
// of this file (arfuse/ctables.py: arfuse.pattern.QUANT_OUTPUTS); a test compiles what Python
// read against this file, so the two cannot drift.
//
// Adding an output whose arithmetic is one of the rules below: a code and a row here, the
// backends' `fuses` where one runs it natively (FlashInfer's pattern), the compile matcher's
// form where a graph writes it. A new rule: its arithmetic in the kernel (epilogue.h), the
// torch epilogue (arfuse/quant.py) and the reference (arfuse/reference.py) as well.
#pragma once

#include <cstdint>

namespace arfuse {

// ---- the formats' numbers -----------------------------------------------------------------
constexpr double kE4m3Max = 448.0;  // the largest finite float8_e4m3fn
constexpr double kE2m1Max = 6.0;    // the largest e2m1 (NVFP4 element)
// fp8_dynamic's smallest scale, taken as float32: 1 / (512 * 448).
constexpr double kFp8DynamicMinScale = 1.0 / (512.0 * kE4m3Max);
// fp8_group's eps (vLLM's per_token_group_quant_fp8 and FlashInfer's UE8M0 scale use 1e-10),
// taken as float32.
constexpr double kFp8GroupEps = 1e-10;
// The e2m1 code of |v| counts the thresholds it passes: ">" where strict, ">=" otherwise
// (nearest even on {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6).
struct E2m1Threshold {
  double at;
  bool strict;
};
inline constexpr E2m1Threshold kE2m1Thresholds[] = {
    {0.25, true},
    {0.75, false},
    {1.25, true},
    {1.75, false},
    {2.5, true},
    {3.5, false},
    {5.0, true},
};
// The swizzled_128x4 scale layout (FlashInfer's): tiles of 128 rows x 4 columns, 512 bytes
// each, row tiles outermost; in a tile, row m and column k at (m % 32) * 16 + (m / 32) * 4 + k.
constexpr int kSwizzleTileRows = 128;
constexpr int kSwizzleTileCols = 4;
constexpr int kSwizzleRowStripe = 32;
// The block of the encode-block rule (NVFP4): 16 values, one e4m3 scale.
constexpr int kEncodeBlock = 16;

// ---- the columns' codes ------------------------------------------------------------------
constexpr int kOutputNone = 0;           // no quantised output
constexpr int kOutputFp8 = 1;            // FP8, the caller's static scale
constexpr int kOutputNvfp4Swizzled = 2;  // NVFP4, scales in swizzled_128x4
constexpr int kOutputNvfp4Linear = 3;    // NVFP4, linear scales
constexpr int kOutputFp8Dynamic = 4;     // FP8, a scale per token
constexpr int kOutputFp8GroupFp32 = 5;          // FP8, a scale per token and group: fp32
constexpr int kOutputFp8GroupColumnMajor = 6;   // the same scales, column-major [T, G]
constexpr int kOutputFp8GroupUe8m0 = 7;         // power-of-two scales, UE8M0 packed 4 per int32
constexpr int kOutputCodes = 16;  // codes are < kOutputCodes: the pattern code's output field

// The caller's scale: none (the output computes its own, or has none: scale must be None), a
// dequantisation scale (its fp32 reciprocal is taken: >= kFp8ScaleMin), an encode scale
// (multiplied: >= kFp32Tiny).
constexpr int kScaleInNone = 0;
constexpr int kScaleInDequant = 1;
constexpr int kScaleInEncode = 2;
// The scale rule: how the codes, and the scale of each span (scale_group) of a row, are made
// from out (rounded to the activation dtype; v = f32(out); amax = the largest |v| of the span,
// NaN ignored; every step one fp32 operation; e4m3 and e2m1 round to nearest even and saturate).
constexpr int kRuleNone = 0;
constexpr int kRuleStatic = 1;         // q = e4m3(v * f32(1 / scale)), scale the caller's
constexpr int kRuleAmaxOverMax = 2;    // s = max(amax / kE4m3Max, f32(floor)); q = e4m3(v / s)
constexpr int kRuleFloorOverMax = 3;   // s = max(amax, f32(floor)) / kE4m3Max; q = e4m3(v / s)
constexpr int kRulePowerOfTwo = 4;     // s = max(amax / kE4m3Max, f32(floor)) rounded up to a
                                       // power of two (mantissa bits set: exponent + 1, mantissa
                                       // cleared); q = e4m3(v / s); stored: s's exponent byte
constexpr int kRuleEncodeBlock = 5;    // sf = e4m3(scale * (amax * f32(1 / kE2m1Max))), NaN when
                                       // all of the block are; es = sf != 0 ? scale / f32(sf) : 0;
                                       // q = e2m1(v * es), NaN -> +6; stored: sf's e4m3 byte
// The element types of quant_out and scale_out (none: that output is not made). A float32
// scale_out holds the scales; a byte-wide one the byte each rule stores, scale_pack a element.
constexpr int kQuantTypeNone = 0;
constexpr int kQuantTypeE4m3 = 1;     // float8_e4m3fn
constexpr int kQuantTypeUint8 = 2;    // bytes (packed e2m1 codes, e4m3 block scales)
constexpr int kQuantTypeFloat32 = 3;  // float32
constexpr int kQuantTypeInt32 = 4;    // int32 (four scale bytes, little-endian)
// Where scale (row, column) lies in scale_out: row-major, column-major (strides (1, padded
// rows)), or the swizzled_128x4 tiles.
constexpr int kOrderRowMajor = 0;
constexpr int kOrderColumnMajor = 1;
constexpr int kOrderSwizzled = 2;
// `block` and `scale_group` of an output whose group is the call's `group_size` (fp8_group):
// hidden must be a multiple of it, and scale_out has one scale per group of it.
constexpr int kGroupOfCall = -1;
// The group sizes a call may ask for: kGroupUnit << code, code 1..kGroupCodes (32, 64, 128),
// the code being what word 1 of the signature carries.
constexpr int kGroupUnit = 16;
constexpr int kGroupCodes = 3;
constexpr int kDefaultGroupSize = 128;

struct QuantOutput {
  const char* quant;   // the `quant` argument that names it ("none" for no output)
  const char* layout;  // the `layout` argument that picks it among its quant's rows ("": none)
  int code;            // kOutput*: the pattern's output field, the torch operator's `quant`
  int scale_in;        // kScaleIn*
  int rule;            // kRule*
  double floor;        // the rule's floor (0: none)
  bool fp32;           // whether fp32 rows can be quantised (else bf16 and fp16 only)
  int block;           // hidden must be a multiple of it
  int data_type;       // quant_out: [tokens, hidden / data_pack] of kQuantType*
  int data_pack;       // values per element of quant_out
  int scale_type;      // scale_out: [rows, cols] of kQuantType*; rows = tokens, padded to
  int scale_row_align;  // a multiple of scale_row_align (row-major: in its shape; column-major:
                        // in its stride between columns, the shape keeps `tokens` rows);
  int scale_group;      // the span of a scale: 0 the row, else scale_group columns (the call's
  int scale_col_align;  // group_size for kGroupOfCall); cols = 1 for a row, else
  int scale_pack;       // round_up(hidden / group, scale_col_align) / scale_pack, scale_pack
  int scale_order;      // scales an element; kOrder*. Padding reads zero.
};

// Columns as in QuantOutput. Python reads these rows: one a line however long (names of the
// constants above, numbers, strings, true/false). A quant's first row is its default layout.
inline constexpr QuantOutput kQuantOutputs[] = {
    {"none", "", kOutputNone, kScaleInNone, kRuleNone, 0.0, true, 1, kQuantTypeNone, 1, kQuantTypeNone, 1, 0, 1, 1, kOrderRowMajor},
    {"fp8", "", kOutputFp8, kScaleInDequant, kRuleStatic, 0.0, true, 1, kQuantTypeE4m3, 1, kQuantTypeNone, 1, 0, 1, 1, kOrderRowMajor},
    {"fp8_dynamic", "", kOutputFp8Dynamic, kScaleInNone, kRuleAmaxOverMax, kFp8DynamicMinScale, true, 1, kQuantTypeE4m3, 1, kQuantTypeFloat32, 1, 0, 1, 1, kOrderRowMajor},
    {"nvfp4", "swizzled_128x4", kOutputNvfp4Swizzled, kScaleInEncode, kRuleEncodeBlock, 0.0, false, kEncodeBlock, kQuantTypeUint8, 2, kQuantTypeUint8, kSwizzleTileRows, kEncodeBlock, kSwizzleTileCols, 1, kOrderSwizzled},
    {"nvfp4", "linear", kOutputNvfp4Linear, kScaleInEncode, kRuleEncodeBlock, 0.0, false, kEncodeBlock, kQuantTypeUint8, 2, kQuantTypeUint8, 1, kEncodeBlock, 1, 1, kOrderRowMajor},
    {"fp8_group", "fp32", kOutputFp8GroupFp32, kScaleInNone, kRuleFloorOverMax, kFp8GroupEps, true, kGroupOfCall, kQuantTypeE4m3, 1, kQuantTypeFloat32, 1, kGroupOfCall, 1, 1, kOrderRowMajor},
    {"fp8_group", "fp32_column_major", kOutputFp8GroupColumnMajor, kScaleInNone, kRuleFloorOverMax, kFp8GroupEps, true, kGroupOfCall, kQuantTypeE4m3, 1, kQuantTypeFloat32, 1, kGroupOfCall, 1, 1, kOrderColumnMajor},
    {"fp8_group", "ue8m0_packed", kOutputFp8GroupUe8m0, kScaleInNone, kRulePowerOfTwo, kFp8GroupEps, true, kGroupOfCall, kQuantTypeE4m3, 1, kQuantTypeInt32, 4, kGroupOfCall, 4, 4, kOrderColumnMajor},
};

// The row of an output code (nullptr: not one).
inline constexpr const QuantOutput* quant_output(int64_t code) {
  for (const QuantOutput& o : kQuantOutputs) {
    if (o.code == code) return &o;
  }
  return nullptr;
}

// The group size of code 1..kGroupCodes (0: none); the code of a group size (0: not one).
inline constexpr int64_t group_size_of(int64_t code) {
  return code >= 1 && code <= kGroupCodes ? int64_t(kGroupUnit) << code : 0;
}
inline constexpr int64_t group_code_of(int64_t group_size) {
  for (int64_t code = 1; code <= kGroupCodes; ++code) {
    if (group_size_of(code) == group_size) return code;
  }
  return 0;
}

// The columns a scale of `q` covers in a row of `hidden` (group_size: the call's).
inline constexpr int64_t scale_span(const QuantOutput& q, int64_t hidden, int64_t group_size) {
  return q.scale_group == 0 ? hidden : q.scale_group == kGroupOfCall ? group_size : q.scale_group;
}

// scale_out's geometry (arfuse.pattern.QuantOutput computes the same): its shape, strides and
// the elements its storage holds. `group_size`: the call's (kGroupOfCall rows).
struct ScaleGeometry {
  int64_t rows, cols, row_stride, col_stride, storage;
};
inline ScaleGeometry scale_geometry(const QuantOutput& q, int64_t tokens, int64_t hidden,
                                    int64_t group_size) {
  const int64_t padded = (tokens + q.scale_row_align - 1) / q.scale_row_align * q.scale_row_align;
  const int64_t used = q.scale_group == 0 ? 1 : hidden / scale_span(q, hidden, group_size);
  const int64_t cols =
      (used + q.scale_col_align - 1) / q.scale_col_align * q.scale_col_align / q.scale_pack;
  if (q.scale_order == kOrderColumnMajor) {
    return {tokens, cols, 1, padded, cols == 0 ? 0 : (cols - 1) * padded + tokens};
  }
  return {padded, cols, cols, 1, padded * cols};
}

// The element of scale_out that holds scale (row, k) (k: the span's index in the row; its byte
// there is k % scale_pack).
inline int64_t scale_element(const QuantOutput& q, const ScaleGeometry& g, int64_t row,
                             int64_t k) {
  const int64_t col = k / q.scale_pack;
  if (q.scale_order != kOrderSwizzled) return row * g.row_stride + col * g.col_stride;
  const int64_t tile = int64_t(kSwizzleTileRows) * kSwizzleTileCols;
  return (row / kSwizzleTileRows) * (g.cols / kSwizzleTileCols) * tile +
         (col / kSwizzleTileCols) * tile + (row % kSwizzleRowStripe) * (tile / kSwizzleRowStripe) +
         (row % kSwizzleTileRows) / kSwizzleRowStripe * kSwizzleTileCols + col % kSwizzleTileCols;
}

}  // namespace arfuse
