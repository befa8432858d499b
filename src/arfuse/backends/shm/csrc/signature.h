// The call signature (R11): two int64 words a rank publishes beside its arrival flag for each
// call, compared by every rank before any rank reads a peer's data; and the codes it holds.
// Python reads the constexpr lines of this file too (arfuse/ctables.py): arfuse.pattern names
// the pattern codes, arfuse.signature writes the same words for the pure-torch path and the
// torch backend. One copy: change a number here and both languages follow.
//
//   word 0: tokens (32 bits) | pattern code (8 bits) | two-shot (1 bit) | dtype (2 bits) |
//           for the MoE patterns: fan-in (8 bits: top_k, or the experts of a reduction) |
//           shared expert given (1 bit) | a digest of the expanded rows and the routed
//           scaling factor (11 bits; 0 for the other patterns)
//   word 1: hidden (32 bits) | op (31 bits: the group's construction count, the same on every
//           rank; 0 for torch.ops calls), so calls of two ops that share a workspace never pair
#pragma once

#include <cstdint>

namespace arfuse {

// The activation dtypes (arfuse.dtypes reads them).
constexpr int kBF16 = 0;
constexpr int kFP16 = 1;
constexpr int kFP32 = 2;

// The quantisation argument of the torch operator, and Call::quant.
constexpr int kNone = 0;
constexpr int kFP8 = 1;
constexpr int kNVFP4 = 2;
constexpr int kFP8Dynamic = 4;

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
constexpr int64_t kMaxOp = (int64_t(1) << 31) - 1;

// A pattern's code: what is reduced (bits 5-7), the epilogue (bits 3-4), the quantised output
// (bits 0-2). Room is left in each for patterns to come.
constexpr int kReductionShift = 5;
constexpr int kEpilogueShift = 3;
constexpr int kReductionAllReduce = 0;       // the sum over ranks of x
constexpr int kReductionMoeReduce = 1;       // of each rank's sum of expert rows (docs/design.md)
constexpr int kReductionMoeFinalize = 2;     // of each rank's finalized expert rows
constexpr int kEpilogueNone = 0;             // the sum alone
constexpr int kEpilogueRmsNorm = 1;          // + RMSNorm
constexpr int kEpilogueResidualRmsNorm = 2;  // + residual + RMSNorm
constexpr int kOutputNone = 0;               // no quantised output
constexpr int kOutputFp8 = 1;                // FP8, the caller's static scale
constexpr int kOutputNvfp4Swizzled = 2;      // NVFP4, scales in swizzled_128x4
constexpr int kOutputNvfp4Linear = 3;        // NVFP4, linear scales
constexpr int kOutputFp8Dynamic = 4;         // FP8, a scale per token

inline constexpr int64_t pattern_code(int reduction, int epilogue, int output) {
  return (int64_t(reduction) << kReductionShift) | (int64_t(epilogue) << kEpilogueShift) |
         int64_t(output);
}

// The output code of a quantisation argument (-1: not one).
inline constexpr int output_code(int quant, bool swizzled) {
  return quant == kNone         ? kOutputNone
         : quant == kFP8        ? kOutputFp8
         : quant == kFP8Dynamic ? kOutputFp8Dynamic
         : quant == kNVFP4      ? (swizzled ? kOutputNvfp4Swizzled : kOutputNvfp4Linear)
                                : -1;
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

inline constexpr int64_t word1(int64_t hidden, int64_t op) {
  return int64_t((uint64_t(hidden) & 0xffffffffULL) | (uint64_t(op & kMaxOp) << kOpShift));
}

}  // namespace signature
}  // namespace arfuse
