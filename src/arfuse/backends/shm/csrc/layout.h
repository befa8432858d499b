// Byte layout of the shm segment and the limits of one call. layout.py holds the same numbers
// for Python; tests/test_shm_kernel_contract.py checks every one of them through
// layout_constants() (bindings.cpp), so change both or neither.
//
// Header page: line 0 the segment's identity (magic, layout version, creator; written by
// Python before the segment has a name, read by the sweep of stale segments), then per rank
// one cache line each of process identity (written by Python), arrival flag and done flag,
// then the copy-mode votes. A rank's arrival line holds its flag (int64 at byte 0) and,
// beside it, the descriptor of its current call (one per call parity, so a rank that has
// moved on to the next call never overwrites the descriptor a slower peer is still
// comparing), then the count of ranks asleep on the flag (int32, futex waits; the done line
// has one at the same offset) and the CPU the rank last started a call on (int32). Then, per
// rank and per buffer, an input slot of max_tokens rows and a result slot for the two-shot
// sums of the rows that rank owns.
#pragma once

#include <cstdint>

namespace arfuse {
namespace layout {

constexpr int64_t kCacheLine = 64;
constexpr int64_t kPage = 4096;
constexpr int64_t kHeaderBytes = kPage;
constexpr int64_t kBuffers = 2;
constexpr int kMaxWorld = 16;
// Line 0, int64 fields (these five stay at these offsets in every version).
constexpr int64_t kSegmentMagic = 0x4D53657375667261;  // the bytes "arfuseSM", little-endian
constexpr int64_t kSegmentVersion = 1;
constexpr int64_t kMagicOffset = 0;
constexpr int64_t kVersionOffset = 8;
constexpr int64_t kCreatorPidOffset = 16;
constexpr int64_t kCreatorStartOffset = 24;  // clock ticks after boot (/proc/PID/stat)
constexpr int64_t kCreatorPidnsOffset = 32;  // inode of the creator's /proc/self/ns/pid
constexpr int64_t kSegmentIdBytes = 40;
constexpr int64_t kIdentityOffset = kCacheLine;                         // pid, start time
constexpr int64_t kArriveOffset = kCacheLine * (1 + kMaxWorld);         // arrival flags
constexpr int64_t kDoneOffset = kCacheLine * (1 + 2 * kMaxWorld);       // done flags
constexpr int64_t kVoteOffset = kCacheLine * (1 + 3 * kMaxWorld);       // copy-mode votes
constexpr int kVoteBuckets = 40;                                        // bytes per rank
// A flag counts progress: call * kProgressUnits + blocks ready. A call has fewer blocks than
// kProgressUnits, hence the token limit.
constexpr int64_t kProgressUnits = int64_t(1) << 20;
constexpr int64_t kMaxTokens = kProgressUnits - kMaxWorld;

// The call descriptor (R11): two int64 words per call parity, after the flag in the arrival
// line. Word 0 packs the call's shape, word 1 is the hidden size.
constexpr int64_t kDescOffset = 8;    // bytes into the arrival line
constexpr int64_t kDescBytes = 16;    // per parity
constexpr int kDescTokensShift = 0;   // 32 bits
constexpr int kDescPatternShift = 32;  // 2 bits: kPattern*
constexpr int kDescQuantShift = 34;   // 2 bits: the quant code's low bits (see below)
constexpr int kDescLayoutShift = 36;  // 1 bit: NVFP4 scales swizzled (0 for other quants)
constexpr int kDescQuantHighShift = 37;  // 1 bit: the quant code's bit 2
// quant codes: 0 none, 1 fp8, 2 nvfp4, 3 other (announce: a quant the kernel does not run),
// 4 fp8_dynamic
constexpr int64_t kWaitersOffset = 40;  // bytes into a flag's line: int32, ranks asleep on it
constexpr int64_t kCpuOffset = 44;      // bytes into an arrival line: int32, the rank's CPU
constexpr int kDescModeShift = 38;    // 1 bit: two-shot (0: one-shot, or a call without data)
constexpr int kDescDtypeShift = 40;   // 2 bits: 0 bf16, 1 fp16, 2 fp32
// Word 1: the hidden size in its low 32 bits, the op that makes the call above them (31 bits:
// the group's construction count, the same on every rank; 0 for torch.ops calls), so calls
// of two ops that share a workspace do not pair.
constexpr int kDescOpShift = 32;
constexpr int64_t kMaxHidden = (int64_t(1) << 31) - 1;
constexpr int64_t kMaxOp = (int64_t(1) << 31) - 1;
constexpr int kPatternPlain = 0;      // all-reduce only
constexpr int kPatternNorm = 1;       // + RMSNorm
constexpr int kPatternNormResidual = 2;  // + residual + RMSNorm

static_assert(kCreatorPidnsOffset + 8 == kSegmentIdBytes && kSegmentIdBytes <= kIdentityOffset,
              "the segment's identity must fit in line 0");
static_assert(kVoteOffset + kMaxWorld * kVoteBuckets <= kHeaderBytes,
              "the copy-mode votes must fit in the header page");
static_assert(kDescOffset + kBuffers * kDescBytes <= kWaitersOffset &&
                  kWaitersOffset + 4 <= kCpuOffset && kCpuOffset + 4 <= kCacheLine,
              "the descriptors, waiters and CPU must share the arrival flag's cache line");
static_assert(kMaxTokens < (int64_t(1) << 32), "tokens must fit the descriptor's 32 bits");

inline constexpr int64_t round_up(int64_t value, int64_t to) { return (value + to - 1) / to * to; }

// The slot geometry ShmLayout (layout.py) computes, for the contract test.
struct SlotGeometry {
  int64_t chunk_rows, input_bytes, result_bytes, slot_bytes, total_bytes;
};
inline SlotGeometry slot_geometry(int64_t world, int64_t max_tokens, int64_t hidden,
                                  int64_t elem) {
  SlotGeometry g{};
  g.chunk_rows = (max_tokens + world - 1) / world;
  g.input_bytes = round_up(max_tokens * hidden * elem, kCacheLine);
  g.result_bytes = round_up(g.chunk_rows * hidden * elem, kCacheLine);
  g.slot_bytes = g.input_bytes + g.result_bytes;
  g.total_bytes = round_up(kHeaderBytes + world * kBuffers * g.slot_bytes, kPage);
  return g;
}

}  // namespace layout
}  // namespace arfuse
