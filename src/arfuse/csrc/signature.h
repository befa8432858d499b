// The call signature (R11): two int64 words a rank publishes beside its arrival flag for each
// call, compared by every rank before any rank reads a peer's data, and the codes it holds (the
// quantised outputs' are quant_outputs.h's). Shared by every backend (arfuse/csrc: the core's constants).
// Python reads the constexpr lines of this file too (arfuse/ctables.py): arfuse.pattern names
// the pattern codes, arfuse.signature writes the same words for the pure-torch path and the
// torch backend. One copy: change a number here and both languages follow.
//
//   word 0: tokens (32 bits) | pattern code (9 bits) | two-shot (1 bit) | dtype (2 bits) |
//           for the MoE patterns: fan-in (8 bits: top_k, or the experts of a reduction) |
//           shared expert given (1 bit) | a digest of the expanded rows and the routed
//           scaling factor (10 bits; 0 for the other patterns); bit 63 clear
//   word 1: hidden (32 bits) | op (29 bits: the group's construction count, the same on every
//           rank, modulo 2^29; 0 for torch.ops calls), so calls of two ops that share a
//           workspace never pair | the group size of a per-token-group output (2 bits: 0 for
//           the other outputs, else log2(group_size / kGroupUnit), so 32, 64, 128 are 1, 2, 3)
#pragma once

#include <cstdint>

#include "quant_outputs.h"  // the output codes and group sizes the words carry

namespace arfuse {

// The activation dtypes (arfuse.dtypes reads them).
constexpr int kBF16 = 0;
constexpr int kFP16 = 1;
constexpr int kFP32 = 2;


namespace signature {

constexpr int kTokensShift = 0;
constexpr int kPatternShift = 32;
constexpr int kPatternBits = 9;
constexpr int kModeShift = kPatternShift + kPatternBits;
constexpr int kDtypeShift = kModeShift + 1;
constexpr int kOpShift = 32;
constexpr int kMoeFanInShift = kDtypeShift + 2;
constexpr int kMoeFanInBits = 8;
constexpr int kMoeSharedShift = kMoeFanInShift + kMoeFanInBits;
constexpr int kMoeDigestShift = kMoeSharedShift + 1;
constexpr int kMoeDigestBits = 63 - kMoeDigestShift;  // bit 63 stays clear: words are int64
constexpr int64_t kMaxMoeFanIn = (int64_t(1) << kMoeFanInBits) - 1;
constexpr int64_t kMaxHidden = (int64_t(1) << 31) - 1;
constexpr int kOpBits = 29;
constexpr int64_t kMaxOp = (int64_t(1) << kOpBits) - 1;
constexpr int kGroupShift = kOpShift + kOpBits;
constexpr int kGroupBits = 2;

// A pattern's code: what is reduced (bits 6-8), the epilogue (bits 4-5), the quantised output
// (bits 0-3, a code of kQuantOutputs, quant_outputs.h). Room is left in each for patterns to
// come.
constexpr int kEpilogueShift = 4;
constexpr int kReductionShift = kEpilogueShift + 2;
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
// shared-expert bit and a 10-bit digest of the expanded rows and the routed scaling
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
