// The call signature (R11): two int64 words a rank publishes beside its arrival flag for each
// call, compared by every rank before any rank reads a peer's data; the codes it holds; and the
// table of quantised outputs. Shared by every backend (arfuse/csrc: the core's constants).
// Python reads the constexpr lines of this file too (arfuse/ctables.py): arfuse.pattern names
// the pattern codes, arfuse.signature writes the same words for the pure-torch path and the
// torch backend. One copy: change a number here and both languages follow.
//
//   word 0: tokens (32 bits) | pattern code (8 bits) | two-shot (1 bit) | dtype (2 bits) |
//           for the MoE patterns: fan-in (8 bits: top_k, or the experts of a reduction) |
//           shared expert given (1 bit) | a digest of the expanded rows and the routed
//           scaling factor (11 bits; 0 for the other patterns)
//   word 1: hidden (32 bits) | op (29 bits: the group's construction count, the same on every
//           rank, modulo 2^29; 0 for torch.ops calls), so calls of two ops that share a
//           workspace never pair | the group size of a per-token-group output (2 bits: 0 for
//           the other outputs, else log2(group_size / kGroupUnit), so 32, 64, 128 are 1, 2, 3)
#pragma once

#include <cstdint>

namespace arfuse {

// The activation dtypes (arfuse.dtypes reads them).
constexpr int kBF16 = 0;
constexpr int kFP16 = 1;
constexpr int kFP32 = 2;


// ---- the quantised outputs ------------------------------------------------------------------
// One row per output a call can make, the only place one is named and numbered: the output
// code is what the pattern code carries and what the torch operator takes (its `quant`), and
// both languages derive everything else from the row (Python: arfuse.pattern, via ctables):
// which `quant`/`layout` arguments name it, what scale the caller gives, which rows it can
// quantise, and the shapes and dtypes of quant_out and scale_out. Adding an output: a row here,
// its arithmetic in the epilogues (epilogue.h, backends/torch/epilogue.py), the reference, and
// the backends' `fuses`.

constexpr int kOutputNone = 0;           // no quantised output
constexpr int kOutputFp8 = 1;            // FP8, the caller's static scale
constexpr int kOutputNvfp4Swizzled = 2;  // NVFP4, scales in swizzled_128x4
constexpr int kOutputNvfp4Linear = 3;    // NVFP4, linear scales
constexpr int kOutputFp8Dynamic = 4;     // FP8, a scale per token
constexpr int kOutputFp8GroupFp32 = 5;          // FP8, a scale per token and group: fp32
constexpr int kOutputFp8GroupColumnMajor = 6;   // the same scales, column-major [T, G]
constexpr int kOutputFp8GroupUe8m0 = 7;         // power-of-two scales, UE8M0 packed 4 per int32

// The caller's scale: none (the output computes its own, or has none: scale must be None), a
// dequantisation scale (its fp32 reciprocal is taken: >= kFp8ScaleMin), an encode scale
// (multiplied: >= kFp32Tiny).
constexpr int kScaleInNone = 0;
constexpr int kScaleInDequant = 1;
constexpr int kScaleInEncode = 2;
// The element types of quant_out and scale_out (none: that output is not made).
constexpr int kQuantTypeNone = 0;
constexpr int kQuantTypeE4m3 = 1;     // float8_e4m3fn
constexpr int kQuantTypeUint8 = 2;    // bytes (packed e2m1 codes, e4m3 block scales)
constexpr int kQuantTypeFloat32 = 3;  // float32
constexpr int kQuantTypeInt32 = 4;    // int32 (four UE8M0 exponent bytes, little-endian)
// `block` and `scale_group` of an output whose group is the call's `group_size` (fp8_group):
// hidden must be a multiple of it, and scale_out has one scale per group of it.
constexpr int kGroupOfCall = -1;
// The group sizes a call may ask for: kGroupUnit << code, code 1..kGroupCodes (32, 64, 128),
// the code being what word 1 of the signature carries.
constexpr int kGroupUnit = 16;
constexpr int kGroupCodes = 3;
constexpr int kDefaultGroupSize = 128;
// fp8_group's eps (vLLM's per_token_group_quant_fp8 and FlashInfer's UE8M0 scale use 1e-10),
// taken as float32: fp32 scales max(amax, eps) / 448, UE8M0 max(amax / 448, eps) rounded up
// to a power of two.
constexpr double kFp8GroupEps = 1e-10;

struct QuantOutput {
  const char* quant;   // the `quant` argument that names it ("none" for no output)
  const char* layout;  // the `layout` argument that picks it among its quant's rows ("": none)
  int code;
  int scale_in;        // kScaleIn*
  bool fp32;           // whether fp32 rows can be quantised (else bf16 and fp16 only)
  int block;           // hidden must be a multiple of it
  int data_type;       // quant_out: [tokens, hidden / data_pack] of kQuantType*
  int data_pack;       // values per element of quant_out
  int scale_type;      // scale_out: [rows, cols] of kQuantType*; rows = tokens, padded to
  int scale_row_align;  // a multiple of scale_row_align (row-major: in its shape; column-major:
                        // in its stride between columns, the shape keeps `tokens` rows);
  int scale_group;      // cols = 1 when scale_group is 0, else round_up(hidden / group,
  int scale_col_align;  // scale_col_align) / scale_pack (group: scale_group, or the call's
  int scale_pack;       // group_size for kGroupOfCall); scale_pack scales per element;
  bool scale_column_major;  // column-major: strides (1, padded rows). Padding reads zero.
};

// Columns as in QuantOutput. Python reads these rows: one a line however long (names of the
// constants above, numbers, strings, true/false).
inline constexpr QuantOutput kQuantOutputs[] = {
    {"none", "", kOutputNone, kScaleInNone, true, 1, kQuantTypeNone, 1, kQuantTypeNone, 1, 0, 1, 1, false},
    {"fp8", "", kOutputFp8, kScaleInDequant, true, 1, kQuantTypeE4m3, 1, kQuantTypeNone, 1, 0, 1, 1, false},
    {"fp8_dynamic", "", kOutputFp8Dynamic, kScaleInNone, true, 1, kQuantTypeE4m3, 1, kQuantTypeFloat32, 1, 0, 1, 1, false},
    {"nvfp4", "swizzled_128x4", kOutputNvfp4Swizzled, kScaleInEncode, false, 16, kQuantTypeUint8, 2, kQuantTypeUint8, 128, 16, 4, 1, false},
    {"nvfp4", "linear", kOutputNvfp4Linear, kScaleInEncode, false, 16, kQuantTypeUint8, 2, kQuantTypeUint8, 1, 16, 1, 1, false},
    {"fp8_group", "fp32", kOutputFp8GroupFp32, kScaleInNone, true, kGroupOfCall, kQuantTypeE4m3, 1, kQuantTypeFloat32, 1, kGroupOfCall, 1, 1, false},
    {"fp8_group", "fp32_column_major", kOutputFp8GroupColumnMajor, kScaleInNone, true, kGroupOfCall, kQuantTypeE4m3, 1, kQuantTypeFloat32, 1, kGroupOfCall, 1, 1, true},
    {"fp8_group", "ue8m0_packed", kOutputFp8GroupUe8m0, kScaleInNone, true, kGroupOfCall, kQuantTypeE4m3, 1, kQuantTypeInt32, 4, kGroupOfCall, 4, 4, true},
};
// A quant's first row is its default layout (layout=None): nvfp4 swizzled_128x4, fp8_group fp32.

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

// scale_out's geometry (arfuse.pattern.QuantOutput computes the same): its shape, strides and
// the elements its storage holds. `group`: the call's group size (kGroupOfCall rows).
struct ScaleGeometry {
  int64_t rows, cols, row_stride, col_stride, storage;
};
inline ScaleGeometry scale_geometry(const QuantOutput& q, int64_t tokens, int64_t hidden,
                                    int64_t group) {
  const int64_t padded = (tokens + q.scale_row_align - 1) / q.scale_row_align * q.scale_row_align;
  const int64_t per = q.scale_group == kGroupOfCall ? group : q.scale_group;
  const int64_t used = per == 0 ? 1 : hidden / per;
  const int64_t cols =
      (used + q.scale_col_align - 1) / q.scale_col_align * q.scale_col_align / q.scale_pack;
  if (q.scale_column_major) {
    return {tokens, cols, 1, padded, cols == 0 ? 0 : (cols - 1) * padded + tokens};
  }
  return {padded, cols, cols, 1, padded * cols};
}

namespace signature {

constexpr int kTokensShift = 0;
constexpr int kPatternShift = 32;
constexpr int kPatternBits = 8;
constexpr int kModeShift = 40;
constexpr int kDtypeShift = 41;
constexpr int kOpShift = 32;
constexpr int kMoeFanInShift = 43;
constexpr int kMoeFanInBits = 8;
constexpr int kMoeSharedShift = 51;
constexpr int kMoeDigestShift = 52;
constexpr int kMoeDigestBits = 11;
constexpr int64_t kMaxMoeFanIn = (int64_t(1) << kMoeFanInBits) - 1;
constexpr int64_t kMaxHidden = (int64_t(1) << 31) - 1;
constexpr int kOpBits = 29;
constexpr int64_t kMaxOp = (int64_t(1) << kOpBits) - 1;
constexpr int kGroupShift = kOpShift + kOpBits;
constexpr int kGroupBits = 2;

// A pattern's code: what is reduced (bits 5-7), the epilogue (bits 3-4), the quantised output
// (bits 0-2, a code of kQuantOutputs below). Room is left in each for patterns to come.
constexpr int kReductionShift = 5;
constexpr int kEpilogueShift = 3;
constexpr int kReductionAllReduce = 0;       // the sum over ranks of x
constexpr int kReductionMoeReduce = 1;       // of each rank's sum of expert rows (docs/design.md)
constexpr int kReductionMoeFinalize = 2;     // of each rank's finalized expert rows
constexpr int kEpilogueNone = 0;             // the sum alone
constexpr int kEpilogueRmsNorm = 1;          // + RMSNorm
constexpr int kEpilogueResidualRmsNorm = 2;  // + residual + RMSNorm
inline constexpr int64_t pattern_code(int reduction, int epilogue, int output) {
  return (int64_t(reduction) << kReductionShift) | (int64_t(epilogue) << kEpilogueShift) |
         int64_t(output);
}

inline constexpr int64_t word0(int64_t tokens, int64_t pattern, bool twoshot, int dtype) {
  return (int64_t(uint64_t(tokens) & 0xffffffffULL) << kTokensShift) |
         (pattern << kPatternShift) | (int64_t(twoshot ? 1 : 0) << kModeShift) |
         (int64_t(dtype) << kDtypeShift);
}

// Whether `moe` holds only what a MoE call adds to word 0: its reduction (in the pattern's
// place) and its fields.
inline constexpr bool moe_bits_only(int64_t moe) {
  return (moe & ~((int64_t(7) << (kReductionShift + kPatternShift)) |
                  ~((int64_t(1) << kMoeFanInShift) - 1))) == 0;
}

// The MoE fields of word 0 (arfuse.signature.moe_bits computes the same): the fan-in, the
// shared-expert bit and an 11-bit digest of the expanded rows and the routed scaling
// factor's fp32 bits, which mixes both by these odd multipliers and keeps the top bits.
constexpr uint64_t kMoeDigestRowsMul = 0x9E3779B97F4A7C15;
constexpr uint64_t kMoeDigestRoutedMul = 0xC2B2AE3D27D4EB4F;

inline constexpr int64_t moe_bits(int64_t fan_in, bool shared, int64_t rows,
                                  uint32_t routed_bits) {
  const uint64_t mixed = (uint64_t(rows) * kMoeDigestRowsMul) ^
                         (uint64_t(routed_bits) * kMoeDigestRoutedMul);
  const uint64_t digest = (mixed >> (64 - kMoeDigestBits)) & ((uint64_t(1) << kMoeDigestBits) - 1);
  return (fan_in << kMoeFanInShift) | (int64_t(shared ? 1 : 0) << kMoeSharedShift) |
         int64_t(digest << kMoeDigestShift);
}

inline constexpr int64_t word1(int64_t hidden, int64_t op, int64_t group_code = 0) {
  return int64_t((uint64_t(hidden) & 0xffffffffULL) | (uint64_t(op & kMaxOp) << kOpShift) |
                 (uint64_t(group_code & ((1 << kGroupBits) - 1)) << kGroupShift));
}

}  // namespace signature
}  // namespace arfuse
